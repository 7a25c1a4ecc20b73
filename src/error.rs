//! The crate's error type.
//!
//! Every variant says what went wrong and, where there is one, what to do about it. Errors from
//! candle itself pass through as [`Error::Candle`]. Where this crate implements one of candle's
//! traits (`Module`, `Optimizer`), its errors are wrapped into `candle_core::Error` with
//! [`candle_core::Error::wrap`] and can be recovered with `downcast_ref`.

use std::path::PathBuf;

/// Errors returned by candle-parallel.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operation that spreads work over devices was given none.
    #[error("no devices given: pass at least one device, e.g. `vec![Device::Cpu]`")]
    NoDevices,

    /// A tensor to be split along `dim` has size 0 there.
    #[error(
        "cannot split an empty batch: dimension {dim} of the input with shape {shape:?} has size 0; \
         pass at least one sample"
    )]
    EmptyBatch {
        /// The dimension that was to be split.
        dim: usize,
        /// The input's shape.
        shape: Vec<usize>,
    },

    /// A dimension index does not exist on the tensor it was applied to.
    #[error(
        "dimension {dim} is out of range for {what} with shape {shape:?} (rank {rank}); \
         use a dimension below {rank}"
    )]
    DimOutOfRange {
        /// The dimension asked for.
        dim: usize,
        /// The tensor's rank.
        rank: usize,
        /// The tensor's shape.
        shape: Vec<usize>,
        /// Which tensor (e.g. "the input", "output 2").
        what: String,
    },

    /// Tensors to be joined or summed disagree in shape or dtype.
    #[error("{op}: {detail}")]
    ShapeMismatch {
        /// The operation (e.g. "gather", "reduce_add").
        op: &'static str,
        /// What differs, naming the tensors.
        detail: String,
    },

    /// A replica asked for a variable the master model never created.
    #[error(
        "replica on {device} asked for variable `{name}`, which the master model does not have; \
         the model builder must create the same variables every time it is called"
    )]
    UnknownVariable {
        /// The variable's name.
        name: String,
        /// The replica's device.
        device: String,
    },

    /// One replica's forward pass failed.
    #[error("replica {index} on {device} failed: {source}")]
    Replica {
        /// The replica's index (also its chunk's index).
        index: usize,
        /// The replica's device.
        device: String,
        /// What failed.
        #[source]
        source: candle_core::Error,
    },

    /// One replica's thread panicked.
    #[error("replica {index} on {device} panicked: {message}")]
    ReplicaPanicked {
        /// The replica's index.
        index: usize,
        /// The replica's device.
        device: String,
        /// The panic's message.
        message: String,
    },

    /// A stage of a model-parallel model failed: an error or a panic in its forward, or moving
    /// its output to the next stage's device.
    #[error(
        "model-parallel stage {stage} on {device} failed{}: {source}",
        micro_batch.map(|j| format!(" on micro-batch {j}")).unwrap_or_default()
    )]
    Stage {
        /// The stage's index.
        stage: usize,
        /// The stage's device.
        device: String,
        /// The micro-batch, where the forward is pipelined.
        micro_batch: Option<usize>,
        /// What failed (boxed: the variant stays small).
        #[source]
        source: Box<candle_core::Error>,
    },

    /// A hyper-parameter or option is outside its valid range.
    #[error("invalid {what}: {detail}")]
    InvalidArgument {
        /// The parameter (e.g. "SGD momentum").
        what: &'static str,
        /// Why it is invalid and what is allowed.
        detail: String,
    },

    /// An I/O operation on a file failed.
    #[error("{action} {path}: {source}")]
    File {
        /// What was being done ("reading", "writing", "renaming to").
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// A setting (an environment variable, an address, a rank) is missing or invalid.
    #[error("{what}: {detail}")]
    Config {
        /// The setting (e.g. "environment variable RANK").
        what: String,
        /// What is wrong and how to fix it.
        detail: String,
    },

    /// Ranks did not all join in time, or joined inconsistently.
    #[error("rendezvous failed: {detail}")]
    Rendezvous {
        /// Who is missing or what disagreed.
        detail: String,
    },

    /// The port to listen on is taken.
    #[error(
        "cannot listen on {addr}: the port is already in use; pick another MASTER_PORT (candle-run \
         picks a free one when --master-port is omitted)"
    )]
    PortInUse {
        /// The address asked for.
        addr: String,
    },

    /// The master (rank 0's store) did not answer.
    #[error(
        "cannot reach the master at {addr} within {waited:?} ({detail}); check MASTER_ADDR and \
         MASTER_PORT and that rank 0 is running"
    )]
    Unreachable {
        /// The master's address.
        addr: String,
        /// How long connecting was retried.
        waited: std::time::Duration,
        /// The last connection error.
        detail: String,
    },

    /// A peer or the store refused our connection.
    #[error("{peer} refused the connection: {reason}")]
    Refused {
        /// Who refused.
        peer: String,
        /// Why.
        reason: String,
    },

    /// A rank died, exited, or stopped answering.
    #[error("rank {rank} was lost: {detail}")]
    PeerLost {
        /// The lost rank.
        rank: usize,
        /// How it was noticed.
        detail: String,
    },

    /// Ranks called collectives that do not match (shape, dtype, op or kind).
    #[error("collective mismatch between ranks: {detail}")]
    Mismatch {
        /// What each rank called.
        detail: String,
    },

    /// A point-to-point receive expected another shape or dtype than its sender sent. The
    /// message is consumed; nothing was reinterpreted.
    #[error(
        "rank {receiver} expected {expected} from rank {sender} (message #{seq} from rank \
         {sender} to rank {receiver}), but rank {sender} sent {sent}; receives must expect what \
         their sender sends, in the order it sends it"
    )]
    P2pMismatch {
        /// The sending rank.
        sender: usize,
        /// The receiving rank.
        receiver: usize,
        /// The message's number among those from `sender` to `receiver`, from 1.
        seq: u64,
        /// What the receive expected ("f32 [4, 8]").
        expected: String,
        /// What was sent.
        sent: String,
    },

    /// A bounded wait ran out.
    #[error("timed out after {waited:?} {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// How long.
        waited: std::time::Duration,
    },

    /// The process group broke earlier; no collective can run on it any more.
    #[error("the process group is no longer usable: {reason}")]
    Aborted {
        /// Why it broke.
        reason: String,
    },

    /// Network or process I/O failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// NCCL reported an error.
    #[error("NCCL {op} failed: {detail}")]
    Nccl {
        /// The NCCL call.
        op: &'static str,
        /// NCCL's error.
        detail: String,
    },

    /// A launched rank exited unsuccessfully.
    #[error("rank {rank} failed: {status}")]
    RankFailed {
        /// The failing rank.
        rank: usize,
        /// How it ended ("exit status 3", "killed by signal 9").
        status: String,
        /// The exit code the launcher returns for it.
        code: i32,
    },

    /// The launcher was interrupted; it stopped every rank.
    #[error("interrupted by {signal}: every rank was stopped")]
    Interrupted {
        /// The signal received.
        signal: String,
        /// The exit code the launcher returns (128 + the signal number).
        code: i32,
    },

    /// The ranks built different models under a data-parallel wrapper.
    #[error(
        "the ranks' models differ at variable `{variable}` ({detail}); every rank must build the \
         same model (names, shapes and dtypes) before {wrapper} can keep them equal"
    )]
    ModelMismatch {
        /// The wrapper ("DistributedDataParallel", "FullyShardedDataParallel").
        wrapper: &'static str,
        /// The first variable that differs.
        variable: String,
        /// Which ranks have what.
        detail: String,
    },

    /// A model's variable is not on the device the wrapper keeps it on: DataParallel's master
    /// variables on `devices[0]`, DistributedDataParallel's on its device.
    #[error(
        "variable `{name}` is on {found}, but {layer} keeps it on {expected}: {}",
        not_on_device_fix(layer)
    )]
    VariableNotOnDevice {
        /// The wrapper ("DataParallel's master copy" or "DistributedDataParallel").
        layer: &'static str,
        /// The variable's name in the `VarMap`.
        name: String,
        /// Where it is.
        found: String,
        /// Where it should be.
        expected: String,
    },

    /// A DistributedDataParallel forward found the previous iteration's gradients computed but
    /// never reduced: `loss.backward()` ran instead of `DistributedDataParallel::backward`.
    #[error(
        "DistributedDataParallel: gradients of the last iteration (the first for `{parameter}`) \
         came in but were never reduced; call DistributedDataParallel::backward(&loss), not \
         loss.backward(), once after each forward"
    )]
    UnfinishedReduction {
        /// The parameter whose gradient came in first.
        parameter: String,
    },

    /// A parameter's gradient came in between a finished DistributedDataParallel backward and
    /// the next forward: a backward through a graph built before the last one was reduced.
    #[error(
        "DistributedDataParallel: the gradient of `{parameter}` came in outside an iteration: \
         run DistributedDataParallel::forward_t before each backward"
    )]
    GradientOutsideIteration {
        /// The parameter.
        parameter: String,
    },

    /// A parameter's gradient came in twice after one DistributedDataParallel forward: two
    /// backwards through one forward's graph, or the variable itself (not the model's copy of
    /// it) used in the loss.
    #[error(
        "DistributedDataParallel: the gradient of `{parameter}` came in twice in one iteration: \
         run forward_t once before each DistributedDataParallel::backward, and compute the loss \
         from the wrapped model only (a variable of the VarMap used directly bypasses DDP)"
    )]
    GradientTwice {
        /// The parameter.
        parameter: String,
    },

    /// The loss reached a variable of the `VarMap` itself through candle's ops, not the copy
    /// DistributedDataParallel hands the model: that part of its gradient would not be
    /// averaged over the ranks, and the averaged gradient would replace it.
    #[error(
        "DistributedDataParallel: rank {rank}: the loss used the variable `{parameter}` of the \
         VarMap directly (a candle op on the Var from VarMap or parameters()), not the model's \
         copy of it: that gradient would bypass DDP's average and be lost; compute the loss \
         from the wrapped model's output only (a penalty on the weights belongs in the \
         optimizer's weight decay, or in the model's forward)"
    )]
    VariableUsedDirectly {
        /// This rank.
        rank: usize,
        /// The variable.
        parameter: String,
    },

    /// `DistributedDataParallel::backward` ran with no forward since the last one.
    #[error(
        "DistributedDataParallel: backward was called without a forward since the last backward \
         (a second backward of one forward's loss?): run DistributedDataParallel::forward_t \
         before each backward"
    )]
    BackwardWithoutForward,

    /// A synchronised DistributedDataParallel backward left parameters without a gradient on
    /// every rank, and `DdpConfig::unused_report` asks for an error.
    #[error(
        "DistributedDataParallel: {summary} (this is an error because DdpConfig::unused_report \
         is UnusedReport::Error)"
    )]
    ParametersWithoutGradient {
        /// The parameters' names, sorted.
        names: Vec<String>,
        /// The first names, a count, and the likely causes.
        summary: String,
    },

    /// A fully sharded unit (`fsdp::unit`) was used in a way FullyShardedDataParallel cannot
    /// shard: nested in another unit, without variables, sharing a variable with another unit
    /// or the root, with parameters of several dtypes, or asked for differently by a later
    /// build of the model.
    #[error("FullyShardedDataParallel: unit `{unit}`: {detail}")]
    FsdpUnit {
        /// The unit's prefix (`"h.0"`), or `"(root)"` for the parameters outside every unit.
        unit: String,
        /// What was wrong and what to do.
        detail: String,
    },

    /// `FullyShardedDataParallel::backward` ran with no training forward since the last one.
    #[error(
        "FullyShardedDataParallel: backward was called without a training forward since the \
         last backward (a second backward of one loss?): run forward_t(xs, true) before each \
         backward"
    )]
    FsdpBackwardWithoutForward,

    /// A training forward of FullyShardedDataParallel found that a backward ran through the
    /// previous forwards outside `FullyShardedDataParallel::backward`.
    #[error(
        "FullyShardedDataParallel: a backward ran through the last training forward outside \
         model.backward(&loss) (loss.backward(), or candle's opt.backward_step(&loss)): its \
         gradients were never averaged over the ranks nor handed to the optimizer, which \
         stepped nothing; call let grads = model.backward(&loss)?; opt.step(&grads)?"
    )]
    FsdpUnreducedBackward,

    /// An optimizer state does not fit the optimizer it is loaded into: another number of
    /// variables, a state or scalar this optimizer does not keep, or one it needs missing.
    #[error(
        "{optimizer}: cannot load the optimizer state: {detail}; load a state saved from the \
         same kind of optimizer, with the same options, over the same variables in the same order"
    )]
    OptimizerStateMismatch {
        /// The optimizer ("AdamW", "Sgd").
        optimizer: &'static str,
        /// What does not fit, naming the variable's index and the state.
        detail: String,
    },

    /// A state tensor's shape differs from its variable's.
    #[error(
        "{optimizer}: cannot load the optimizer state: `{state}` of variable {variable} has shape \
         {found:?}, but the variable has shape {expected:?}; load a state saved from an optimizer \
         over the same variables in the same order"
    )]
    OptimizerStateShape {
        /// The optimizer ("AdamW", "Sgd").
        optimizer: &'static str,
        /// The variable's index in the optimizer's `vars()`.
        variable: usize,
        /// The state's name ("exp_avg", "momentum_buffer", ...).
        state: &'static str,
        /// The variable's shape.
        expected: Vec<usize>,
        /// The state tensor's shape.
        found: Vec<usize>,
    },

    /// An optimizer's variable is not in the `VarMap` a training state is saved from or loaded
    /// into, so it has no name.
    #[error(
        "the optimizer's variable {index} (shape {shape:?}) is not in the VarMap, so it has no \
         name in the checkpoint; build the optimizer from the VarMap's own variables \
         (`varmap.all_vars()`)"
    )]
    VariableNotInVarMap {
        /// The variable's index in the optimizer's `vars()`.
        index: usize,
        /// Its shape.
        shape: Vec<usize>,
    },

    /// An optimizer was given a parameter that a sharding wrapper keeps as pieces: under
    /// ZeRO-2 and fully sharded training the optimizer steps each rank's pieces, never the
    /// whole parameters (which every gather overwrites).
    #[error(
        "the optimizer was given `{parameter}`, a whole parameter of {wrapper}, which keeps it \
         sharded: make the optimizer over model.parameters() (this rank's pieces), not over the \
         VarMap's variables"
    )]
    ShardedParameterInOptimizer {
        /// The parameter's name.
        parameter: String,
        /// The wrapper and its sharding ("DistributedDataParallel with Sharding::Zero2").
        wrapper: &'static str,
    },

    /// Under ZeRO-2, the model was read (evaluated) after its pieces were stepped and before
    /// they were gathered into its parameters.
    #[error(
        "DistributedDataParallel (rank {rank}): the optimizer stepped this rank's pieces (of \
         `{parameter}`, among others) since the parameters were last gathered, so the model \
         still has the weights of before the step; call gather_parameters() on every rank \
         first (the next training forward does it too), or step with an optimizer of \
         candle_parallel::optim, which gathers at the end of each step"
    )]
    StaleParameters {
        /// This rank.
        rank: usize,
        /// The first parameter whose piece changed.
        parameter: String,
    },

    /// A training step's loss was NaN or infinite (see [`crate::optim::FiniteLoss`]).
    #[error(
        "the training loss is {value} at step {step}: the weights are no longer numbers to \
         trust, so training stops there; lower the learning rate, or check that step's data \
         and the checkpoint it resumed from"
    )]
    NonFiniteLoss {
        /// The first step whose loss was not finite.
        step: u64,
        /// Its loss.
        value: f64,
    },

    /// `clip_grad_norm` with `error_if_nonfinite` found a total norm that is NaN or infinite.
    #[error(
        "the total norm of order {norm_type} of the gradients is {total}, not finite, so they \
         cannot be clipped (a NaN or an overflow in backward); skip this step, or clip with \
         error_if_nonfinite off to scale them anyway"
    )]
    NonFiniteGradientNorm {
        /// The norm's order.
        norm_type: f64,
        /// The total norm.
        total: f64,
    },

    /// A file could not be written for want of space (or of quota).
    #[error(
        "no space left to write {path}: it needs {} and {} are free in {folder}; {hint}",
        human_bytes(*needed),
        human_bytes(*available)
    )]
    DiskFull {
        /// The file that was being written.
        path: PathBuf,
        /// The folder it goes in.
        folder: PathBuf,
        /// Its size in bytes.
        needed: u64,
        /// The bytes free in the folder's file system when the write failed.
        available: u64,
        /// What to do.
        hint: String,
    },

    /// A checkpoint lacks a tensor it must have, or holds one that does not fit.
    #[error("checkpoint {path}: {detail}")]
    Checkpoint {
        /// The tensor's key in the file.
        key: String,
        /// The file.
        path: PathBuf,
        /// What is wrong with it, and what to do.
        detail: String,
    },

    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

/// [`Error::VariableNotOnDevice`]'s layer for DataParallel.
pub(crate) const DATA_PARALLEL_MASTER: &str = "DataParallel's master copy";
/// [`Error::VariableNotOnDevice`]'s layer for DistributedDataParallel.
pub(crate) const DISTRIBUTED_DATA_PARALLEL: &str = "DistributedDataParallel";
/// [`Error::ModelMismatch`]'s wrapper for putting tensor-parallel parts back together.
pub(crate) const TENSOR_PARALLEL_PLAN: &str = "ParallelPlan::gather";

/// What to do about a variable on the wrong device, for each wrapper.
fn not_on_device_fix(layer: &str) -> &'static str {
    if layer == DATA_PARALLEL_MASTER {
        "create the model's variables on devices[0], or put that device first"
    } else {
        "create the model's variables on the device passed to DistributedDataParallel::new"
    }
}
impl Error {
    /// Wraps this error into candle's error type, for trait methods that must return it.
    /// A [`Error::Candle`] is unwrapped rather than nested.
    pub fn into_candle(self) -> candle_core::Error {
        match self {
            Error::Candle(e) => e,
            other => candle_core::Error::wrap(other),
        }
    }
}

/// A size in words, for messages: `512 bytes`, `3.2 MB` (powers of 1000, as `df -H`).
pub(crate) fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["kB", "MB", "GB", "TB", "PB"];
    if n < 1000 {
        return format!("{n} bytes");
    }
    let mut v = n as f64;
    let mut unit = "";
    for u in UNITS {
        v /= 1000.0;
        unit = u;
        if v < 1000.0 {
            break;
        }
    }
    format!("{v:.1} {unit}")
}

/// A device in words, for error messages: `cpu` or `cuda:0`.
pub(crate) fn device_name(device: &candle_core::Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".to_string(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}
