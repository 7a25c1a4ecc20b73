//! `DistributedDataParallel`: one process per device, one model replica per process, gradients
//! averaged over the world while backward runs (`torch.nn.parallel.DistributedDataParallel`).
//!
//! Each rank builds the model with its own constructor, over its own `VarMap`. At construction
//! the ranks check that they built the same variables (names, shapes, dtypes: a difference is an
//! error on every rank naming the variable) and take rank 0's values, so that ranks that
//! initialised differently start equal. In training, `backward` averages every parameter's
//! gradient over the world in buckets (25 MiB, the first 1 MiB), each all-reduced on a group of
//! DDP's own as soon as its gradients are ready, while the rest of backward runs; it returns
//! once the last bucket is reduced, with the averaged gradients in the `GradStore` it returns.
//! Every rank then takes the same optimizer step, and the replicas stay equal.
//!
//! From a one-device program, five lines change: the process group, the constructor, the
//! parameters given to the optimizer, `forward_t` on the wrapper, and `model.backward(&loss)`
//! with `opt.step(&grads)` instead of `opt.backward_step(&loss)`.
//!
//! ```rust
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{linear, loss, Optimizer, VarMap};
//! use candle_parallel::distributed;
//! use candle_parallel::optim::{Sgd, SgdConfig};
//! use candle_parallel::DistributedDataParallel;
//! # fn main() -> candle_parallel::Result<()> {
//! // Two ranks as threads here; as processes, each calls ProcessGroup::from_env(&device).
//! let weights = distributed::spawn_threads(2, |pg| {
//!     let varmap = VarMap::new();
//!     let model = DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, |vb| linear(4, 2, vb))?;
//!     let mut opt = Sgd::new(model.parameters(), SgdConfig { lr: 0.1, ..Default::default() })?;
//!     // Each rank trains on its own share of the batch.
//!     let x = Tensor::randn(0f32, 1., (8, 4), &Device::Cpu)?;
//!     let y = Tensor::new(&[0u32, 1, 1, 0, 1, 0, 0, 1], &Device::Cpu)?;
//!     let loss = loss::cross_entropy(&model.forward_t(&x, true)?, &y)?;
//!     let grads = model.backward(&loss)?; // averaged over both ranks
//!     opt.step(&grads)?;
//!     Ok(model.parameters()[1].to_vec2::<f32>()?)
//! })?;
//! assert_eq!(weights[0], weights[1]); // the replicas stay equal
//! # Ok(()) }
//! ```
//!
//! Parameters without a gradient: one that gets no gradient on some ranks (a branch not taken
//! there) gets the average of the others' gradients and zeros; one that gets a gradient on no
//! rank at all gets none from `backward`, as in one process, so that the optimizer leaves it as
//! it is (with zeros, AdamW's weight decay and moments would move it). Such parameters are
//! usually a mistake, a layer without a backward between them and the loss (candle-nn's fused
//! norms, softmax and rope: candle issue #2168), so rank 0 says so through the `log` facade,
//! once per distinct set ([`UnusedReport`]; install a logger, e.g. [`crate::logging::init`], to
//! see it); [`DistributedDataParallel::unused_parameters`] names them, and
//! [`DdpConfig::frozen_parameters`] declares those frozen on purpose.
//!
//! [`DdpConfig::sharding`] = [`Sharding::Zero2`] shards gradients and optimizer state over the
//! ranks with the same training loop; [`DistributedDataParallel::join`] lets ranks with fewer
//! batches shadow the others ([`JoinDivisor`]); `save_checkpoint`/`load_checkpoint` and their
//! sharded twins save and load the whole training state, with or without sharding.
//!
//! Differences from torch, on purpose: no `find_unused_parameters` knob, since the check that
//! it enables costs one small all-reduce per backward here and is always on (torch errors
//! without the knob and is silent with it; we report by default); the gradients come back in a
//! `GradStore` rather than in `.grad`; `backward` must be called on the wrapper
//! (`model.backward(&loss)`), which a forward checks, as torch's DDP checks that the previous
//! reduction finished; [`DistributedDataParallel::module`] refreshes the model's parameter
//! copies at each call.

pub mod bucket;

mod checkpoint;

pub mod unused;

pub(crate) mod agreement;
mod compression;
mod hook;
mod integers;
mod iteration;
mod join;
mod param;
mod reducer;
mod sharding;
mod zero2;

pub use compression::Compression;
pub use join::JoinDivisor;
pub use reducer::BackwardStats;
pub use sharding::Sharding;
pub use unused::{named_vars_without_gradient, vars_without_gradient, UnusedReport};

use crate::amp::MixedPrecision;
use crate::distributed::ProcessGroup;
use crate::error::{Error, Result};
use crate::nn;
use crate::optim::managed::{self, Registration};
use crate::util::sync::lock;
use agreement::{broadcast_from_rank_0, check_same_model, travels};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{ModuleT, VarBuilder, VarMap};
use hook::{Entry, Kind, Registry};
use param::Param;
use reducer::{Reducer, Setup};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

/// Options of [`DistributedDataParallel`]; `Default` gives torch's defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct DdpConfig {
    /// The size of a gradient bucket, in MiB (torch's `bucket_cap_mb`, default 25).
    pub bucket_cap_mb: f64,
    /// The size of the first bucket, in MiB (default 1): small, so that the first all-reduce
    /// starts early in backward.
    pub first_bucket_mb: f64,
    /// Broadcast rank 0's buffers (BatchNorm's running statistics) before each training
    /// forward (default true, as torch).
    pub broadcast_buffers: bool,
    /// How gradients travel (default: uncompressed).
    pub compression: Compression,
    /// Rebuild the buckets once, after the first iteration, from the order gradients actually
    /// became ready (default true, as torch).
    pub rebuild_buckets: bool,
    /// Variables whose name ends in one of these path components are buffers, not parameters:
    /// they get no gradient and are broadcast from rank 0 (default: candle-nn's BatchNorm
    /// statistics `running_mean` and `running_var`, and torch's `num_batches_tracked`).
    /// Integer variables are buffers whatever their name.
    pub buffer_names: Vec<String>,
    /// The dtype variables are created with when the `VarMap` lacks them (default f32).
    pub dtype: DType,
    /// Make the model's [`nn::batch_norm`] layers SyncBatchNorm, over a
    /// process group of their own (torch's `convert_sync_batchnorm`; default false).
    pub sync_batch_norm: bool,
    /// What a backward that leaves parameters without a gradient on every rank does: warn
    /// (default) or fail. See [`UnusedReport`].
    pub unused_report: UnusedReport,
    /// Parameters frozen on purpose, never reported for having no gradient: names, or
    /// prefixes of a whole path component (`"encoder"` covers `"encoder.l1.weight"`, not
    /// `"encoder2.weight"`). Default: none.
    pub frozen_parameters: Vec<String>,
    /// Whether each rank keeps every gradient and optimizer state (default) or its shard of
    /// them (ZeRO-2). See [`Sharding`].
    pub sharding: Sharding,
    /// The dtype the model computes in and gradients are averaged in, beside the parameters'
    /// (`dtype`, the master weights' and the optimizer's); default: none. See
    /// [`MixedPrecision`].
    pub mixed_precision: MixedPrecision,
}

impl Default for DdpConfig {
    fn default() -> Self {
        Self {
            bucket_cap_mb: 25.0,
            first_bucket_mb: 1.0,
            broadcast_buffers: true,
            compression: Compression::None,
            rebuild_buckets: true,
            buffer_names: crate::util::BUFFER_NAMES.map(String::from).to_vec(),
            dtype: DType::F32,
            sync_batch_norm: false,
            unused_report: UnusedReport::Warn,
            frozen_parameters: Vec::new(),
            sharding: Sharding::None,
            mixed_precision: MixedPrecision::default(),
        }
    }
}

fn mib_to_bytes(what: &'static str, mib: f64) -> Result<usize> {
    if !(mib.is_finite() && mib > 0.0) {
        return Err(Error::InvalidArgument {
            what,
            detail: format!("{mib} MiB; a bucket must have a positive, finite size"),
        });
    }
    Ok(((mib * (1 << 20) as f64) as usize).max(1))
}

/// Data parallelism over processes, one replica each (`torch.nn.parallel.DistributedDataParallel`).
/// See the [module documentation](self).
pub struct DistributedDataParallel<M> {
    module: M,
    varmap: VarMap,
    /// DDP's own group: its collectives never interleave with the user's.
    group: ProcessGroup,
    reducer: Arc<Reducer>,
    /// The parameters, in the order the model asked for them.
    params: Vec<Entry>,
    /// The buffers (float and integer), in the order the model asked for them.
    buffers: Vec<Var>,
    /// The parameters' names and variables, sorted by name.
    sorted: Vec<(String, Var)>,
    /// The index in `params` of each of `sorted`.
    sorted_index: Vec<usize>,
    bucket_bytes: usize,
    broadcast_buffers: bool,
    /// The groups of the model's SyncBatchNorm layers, whose backward `backward` completes.
    sync_groups: Vec<ProcessGroup>,
    /// Open `no_sync` guards.
    no_sync: AtomicUsize,
    /// Under ZeRO-2, what this crate's optimizers are told about the parameters and pieces
    /// (see [`crate::optim::managed`]), for as long as the wrapper lives.
    _managed: Vec<Registration>,
    /// Inside `join`: how an iteration with joined ranks averages.
    joining: std::sync::Mutex<Option<JoinDivisor>>,
    /// Where the parameters live.
    device: Device,
    /// The dtypes the model computes in and gradients are averaged in.
    precision: MixedPrecision,
}

impl<M> DistributedDataParallel<M> {
    /// Wraps the model that `build` constructs, with default options. Every rank of `group`
    /// must call it, at the same point of its program.
    ///
    /// `build` is called once, on `device`, with a `VarBuilder` over `varmap` (which creates
    /// the variables `varmap` lacks). Then the ranks check that they built the same model and
    /// take rank 0's parameters and buffers.
    pub fn new<F>(varmap: &VarMap, group: &ProcessGroup, device: &Device, build: F) -> Result<Self>
    where
        F: Fn(VarBuilder) -> candle_core::Result<M>,
    {
        Self::with_config(varmap, group, device, DdpConfig::default(), build)
    }

    /// As [`DistributedDataParallel::new`], with options.
    pub fn with_config<F>(
        varmap: &VarMap,
        group: &ProcessGroup,
        device: &Device,
        config: DdpConfig,
        build: F,
    ) -> Result<Self>
    where
        F: Fn(VarBuilder) -> candle_core::Result<M>,
    {
        let bucket_bytes = mib_to_bytes("DDP bucket_cap_mb", config.bucket_cap_mb)?;
        let first_bucket_bytes = mib_to_bytes("DDP first_bucket_mb", config.first_bucket_mb)?;
        let everyone: Vec<usize> = (0..group.world_size()).collect();
        let own = group
            .new_group(&everyone)?
            .expect("every rank is a member of a group of every rank");
        let reducer = Arc::new(Reducer::default());
        let buffer_names = config.buffer_names.clone();
        let is_buffer = move |name: &str| {
            let last = name.rsplit('.').next().unwrap_or(name);
            buffer_names.iter().any(|b| b == last)
        };
        let precision = config.mixed_precision;
        precision.warn_if_slow_on(device);
        let registry = Registry::new(varmap, device, is_buffer, reducer.clone())
            .compute_in(precision.param_dtype);
        // SyncBatchNorm gets a group of its own: its backward collectives must not interleave
        // with the gradient buckets (a rank with no rows sends them late).
        let sync_group = if config.sync_batch_norm {
            Some(
                group
                    .new_group(&everyone)?
                    .expect("every rank is a member of a group of every rank"),
            )
        } else {
            None
        };
        let (module, sync_groups) = nn::building(sync_group, || {
            build(VarBuilder::from_backend(
                Box::new(&registry),
                config.dtype,
                device.clone(),
            ))
        });
        let module = module?;
        let entries = registry.entries();
        check_same_model(&own, &entries, device)?;
        let travelling: Vec<Var> = entries
            .iter()
            .filter(|e| travels(e.var.dtype()))
            .map(|e| e.var.clone())
            .collect();
        broadcast_from_rank_0(&own, &travelling, bucket_bytes)?;
        let params: Vec<Entry> = entries
            .iter()
            .filter(|e| e.kind == Kind::Parameter)
            .cloned()
            .collect();
        let buffers = entries
            .iter()
            .filter(|e| e.kind == Kind::Buffer && travels(e.var.dtype()))
            .map(|e| e.var.clone())
            .collect();
        let mut sorted_index: Vec<usize> = (0..params.len()).collect();
        sorted_index.sort_by(|&a, &b| params[a].name.cmp(&params[b].name));
        let sorted: Vec<(String, Var)> = sorted_index
            .iter()
            .map(|&i| (params[i].name.clone(), params[i].var.clone()))
            .collect();
        reducer.configure(Setup {
            group: own.clone(),
            params: params
                .iter()
                .map(|e| Param {
                    name: e.name.clone(),
                    var: e.var.clone(),
                    grad_dtype: precision.reduce_dtype(e.held.dtype()),
                })
                .collect(),
            // Backward meets the parameters in about the reverse of the order the model
            // asked for them.
            expected_order: (0..params.len()).rev().collect(),
            first_bucket_bytes,
            bucket_bytes,
            compression: config.compression,
            rebuild_buckets: config.rebuild_buckets,
            unused_report: config.unused_report,
            frozen: params
                .iter()
                .map(|e| unused::is_declared(&e.name, &config.frozen_parameters))
                .collect(),
            sharding: config.sharding,
        })?;
        let _managed = match config.sharding {
            Sharding::None => Vec::new(),
            Sharding::Zero2 => {
                let weak: Weak<Reducer> = Arc::downgrade(&reducer);
                let gather = Arc::new(move || match weak.upgrade() {
                    Some(reducer) => reducer.gather_parameters(),
                    None => Ok(()),
                });
                vec![
                    managed::register_whole(
                        &sorted,
                        "DistributedDataParallel with Sharding::Zero2",
                    ),
                    managed::register_pieces(&reducer.pieces(), gather),
                ]
            }
        };
        Ok(Self {
            module,
            varmap: varmap.clone(),
            group: own,
            reducer,
            params,
            buffers,
            sorted,
            sorted_index,
            bucket_bytes,
            broadcast_buffers: config.broadcast_buffers,
            sync_groups,
            no_sync: AtomicUsize::new(0),
            _managed,
            joining: std::sync::Mutex::new(None),
            device: device.clone(),
            precision,
        })
    }

    /// The wrapped model (torch's `.module`), computing with the variables' current values:
    /// right after `opt.step(&grads)`, `model.module().forward(&x)` uses the new weights, on
    /// any rank, with no collective. Save the variables (`varmap()`), not the module.
    ///
    /// The model holds copies of the parameters (the gradient hooks' outputs, which candle
    /// cannot make share the variables' storage), and candle's optimizers write the variables
    /// in place without telling anyone. So each call copies every parameter into the model,
    /// as each [`forward_t`](Self::forward_t) does: one pass over the model's bytes, small
    /// beside a forward. Take the reference once per evaluation, not once per batch, when that
    /// copy matters.
    ///
    /// Under [`Sharding::Zero2`] the parameters are current after a step of this crate's
    /// optimizers, which gather the pieces at its end. An optimizer that does not (candle-nn's)
    /// leaves them behind until [`gather_parameters`](Self::gather_parameters) or the next
    /// training forward: then this says so through the `log` facade (an evaluation forward
    /// fails with [`Error::StaleParameters`]).
    pub fn module(&self) -> &M {
        match self.reducer.stale_parameter() {
            Ok(Some(parameter)) => log::error!(
                "{}",
                Error::StaleParameters {
                    rank: self.group.rank(),
                    parameter
                }
            ),
            Ok(None) => {}
            Err(e) => log::error!("DistributedDataParallel::module: {e}"),
        }
        if let Err(e) = self.refresh_copies() {
            // Only a device failure can get here (the copies have the variables' shapes and
            // devices); the module then computes with the values of the last refresh.
            log::error!(
                "DistributedDataParallel::module: could not copy the variables into the \
                 model ({e}); it computes with the values of the last forward"
            );
        }
        &self.module
    }

    /// Copies each parameter's current value into the model's copy of it.
    fn refresh_copies(&self) -> Result<()> {
        for e in &self.params {
            // The crate's cast: vectorized (and over the threads for large tensors) where
            // candle's converts a value per call.
            let value = nn::cast(&e.var.as_tensor().detach().flatten_all()?, e.held.dtype())?;
            e.held.flatten_all()?.slice_set(&value, 0, 0)?;
        }
        Ok(())
    }

    /// The names of the parameters that got a gradient on no rank in the last synchronised
    /// backward (sorted by name); they got none from it, and the optimizer left them as they
    /// were. Empty before the first backward. See the [module documentation](self).
    pub fn unused_parameters(&self) -> Vec<String> {
        self.reducer.unused_names()
    }

    /// The `VarMap` holding the variables.
    pub fn varmap(&self) -> &VarMap {
        &self.varmap
    }

    /// What the optimizer steps: the trainable variables (buffers excluded), sorted by name;
    /// under [`Sharding::Zero2`] this rank's piece of each of them instead, in the same order
    /// (a 1-D chunk of the flattened parameter, see [`crate::shard`]).
    pub fn parameters(&self) -> Vec<Var> {
        match self.reducer.pieces() {
            pieces if !pieces.is_empty() => self
                .sorted_index
                .iter()
                .map(|&i| pieces[i].clone())
                .collect(),
            _ => self.sorted.iter().map(|(_, v)| v.clone()).collect(),
        }
    }

    /// The names of [`DistributedDataParallel::parameters`], in the same order: the
    /// parameters' names, sorted, whatever the sharding.
    pub fn parameter_names(&self) -> Vec<String> {
        self.sorted.iter().map(|(n, _)| n.clone()).collect()
    }

    /// The model's trainable variables by name, sorted (whatever the sharding: under ZeRO-2
    /// they hold the values of the last gather, see [`module`](Self::module)).
    pub fn named_parameters(&self) -> Vec<(String, Var)> {
        self.sorted.clone()
    }

    /// Under [`Sharding::Zero2`], puts every rank's pieces together into the model's
    /// parameters (an all-gather per bucket). This crate's optimizers do it at the end of each
    /// step; after a step of another optimizer call it on every rank before reading, saving or
    /// evaluating the model (the next training forward does it too). Does nothing without
    /// sharding. Not inside [`join`](Self::join), where a rank that ran out of batches only
    /// shadows training iterations.
    pub fn gather_parameters(&self) -> Result<()> {
        self.refuse_inside_join("gather_parameters")?;
        self.reducer.gather_parameters()
    }

    /// torch's `clip_grad_norm_` over the gradients `backward` returned, with the whole
    /// model's norm whatever the sharding: under [`Sharding::Zero2`] every rank holds its
    /// pieces' gradients only, and their norms are added over the ranks (one all-reduce), so
    /// every rank scales by the same coefficient. Returns the total norm. Every rank must call
    /// it. See [`crate::optim::clip_grad_norm`].
    pub fn clip_grad_norm(
        &self,
        grads: &mut GradStore,
        max_norm: f64,
        norm_type: f64,
        error_if_nonfinite: bool,
    ) -> Result<f64> {
        let sharded = !self.reducer.pieces().is_empty();
        crate::optim::clip_grad_norm_over(
            grads,
            &self.parameters(),
            max_norm,
            norm_type,
            error_if_nonfinite,
            sharded.then_some(&self.group),
        )
    }

    /// Fails, naming this rank and `what`, inside [`join`](Self::join): a rank that has run
    /// out of batches shadows only the training iterations of the others, so any other
    /// collective would pair with one of theirs.
    fn refuse_inside_join(&self, what: &str) -> Result<()> {
        if lock(&self.joining).is_none() {
            return Ok(());
        }
        Err(Error::InvalidArgument {
            what: "DistributedDataParallel::join",
            detail: format!(
                "rank {}: {what} inside join; a rank that ran out of batches shadows only \
                 training iterations (a training forward, backward, one step), so it would \
                 not take part: call {what} after join returns",
                self.group.rank()
            ),
        })
    }

    /// DDP's own process group (a second group over the same ranks as the one given).
    pub fn process_group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The gradient buckets, in the order they are all-reduced: each a list of parameter names.
    pub fn buckets(&self) -> Vec<Vec<String>> {
        self.reducer.bucket_names()
    }

    /// Timings of the last synchronised backward: how long autograd took and how much of the
    /// communication came after it (was not hidden).
    pub fn last_backward_stats(&self) -> BackwardStats {
        self.reducer.stats()
    }

    /// Gradient accumulation without communication (torch's `no_sync`): while the guard lives,
    /// forwards prepare backwards that sum gradients on this rank only; the first backward
    /// after it all-reduces the sums. For k micro-batches whose losses are divided by k, the
    /// result equals one batch k times larger.
    ///
    /// ```rust
    /// # use candle_core::{Device, Tensor};
    /// # use candle_nn::{linear, VarMap};
    /// # use candle_parallel::{distributed, DistributedDataParallel};
    /// # fn main() -> candle_parallel::Result<()> {
    /// # distributed::spawn_threads(1, |pg| {
    /// # let varmap = VarMap::new();
    /// # let model = DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, |vb| linear(2, 1, vb))?;
    /// # let micro = Tensor::ones((4, 2), candle_core::DType::F32, &Device::Cpu)?;
    /// let k = 3.0;
    /// {
    ///     let _local = model.no_sync();
    ///     for _ in 0..2 {
    ///         let loss = (model.forward_t(&micro, true)?.sum_all()? / k)?;
    ///         model.backward(&loss)?; // summed here, not sent
    ///     }
    /// }
    /// let loss = (model.forward_t(&micro, true)?.sum_all()? / k)?;
    /// let grads = model.backward(&loss)?; // one all-reduce of the three micro-batches' sum
    /// # Ok(()) })?; Ok(()) }
    /// ```
    pub fn no_sync(&self) -> NoSync<'_> {
        self.no_sync.fetch_add(1, Ordering::SeqCst);
        NoSync {
            open: &self.no_sync,
        }
    }

    /// Averages the gradients of `loss` over the world: runs backward (buckets are all-reduced
    /// as their gradients come in), then waits for the last bucket. The returned `GradStore`
    /// holds each parameter's averaged gradient (under `no_sync`: this rank's sum so far),
    /// except for parameters that got a gradient on no rank, which get none (see
    /// [`unused_parameters`](Self::unused_parameters)); pass it to the optimizer's `step`.
    /// Call it once after each `forward_t`, on every rank.
    ///
    /// Fails with [`Error::ParametersWithoutGradient`], on every rank, when such parameters
    /// are not declared frozen and [`DdpConfig::unused_report`] is [`UnusedReport::Error`];
    /// with [`Error::BackwardWithoutForward`] when no forward came since the last backward, and
    /// with [`Error::GradientTwice`] when `loss` reaches a parameter's hook twice (a second
    /// backward through one forward's graph).
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        let started = Instant::now();
        let grads = nn::backward(loss);
        for e in &self.params {
            if let Some(hook) = &e.hook {
                hook.reset_uses();
            }
        }
        let mut grads = grads?;
        for group in &self.sync_groups {
            nn::finish_backward(group)?;
        }
        self.reducer.finalize_backward(&mut grads, started)?;
        Ok(grads)
    }
}

impl<M> DistributedDataParallel<M> {
    /// What every forward does before the model runs (and a joined rank's shadow of it): in
    /// training, take rank 0's buffers and (ZeRO-2) gather the pieces if the optimizer did not;
    /// in evaluation, no collective, but (ZeRO-2) refuse a model behind its pieces. Then
    /// refresh the model's parameter copies.
    fn before_forward(&self, train: bool) -> Result<()> {
        if train {
            if self.broadcast_buffers {
                self.broadcast_buffers()?;
            }
            self.reducer.before_training_forward()?;
        } else if let Some(parameter) = self.reducer.stale_parameter()? {
            return Err(Error::StaleParameters {
                rank: self.group.rank(),
                parameter,
            });
        }
        self.refresh_copies()
    }

    /// Overwrites this rank's buffers (BatchNorm's running statistics) with rank 0's, on every
    /// rank: what each training forward does first (unless `broadcast_buffers` is off). Call it
    /// before evaluating or saving on every rank, for every rank to hold rank 0's statistics
    /// (not inside [`join`](Self::join)).
    pub fn sync_buffers(&self) -> Result<()> {
        self.refuse_inside_join("sync_buffers")?;
        self.broadcast_buffers()
    }

    fn broadcast_buffers(&self) -> Result<()> {
        broadcast_from_rank_0(&self.group, &self.buffers, self.bucket_bytes)
    }
}

impl<M: ModuleT> DistributedDataParallel<M> {
    /// The forward pass in training (`train = true`) or evaluation mode. In training mode it
    /// first takes rank 0's buffers (unless `broadcast_buffers` is off); in every mode it
    /// refreshes the model's parameter copies from the variables and starts an iteration of
    /// the reducer.
    ///
    /// Fails with [`Error::UnfinishedReduction`] when the last forward's gradients were
    /// computed (`loss.backward()`) but never reduced by [`backward`](Self::backward).
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        let xs = &self.precision.cast_input(xs)?;
        self.reducer
            .prepare_for_backward(self.no_sync.load(Ordering::SeqCst) == 0)?;
        let joining = *lock(&self.joining);
        if let Some(divisor) = joining {
            self.join_iteration(divisor, train)?;
        }
        self.before_forward(train)?;
        self.precision
            .cast_output(self.module.forward_t(xs, train)?)
    }
}

/// The forward pass in training mode, for code written against candle's `Module`.
impl<M: ModuleT> candle_core::Module for DistributedDataParallel<M> {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_t(xs, true).map_err(Error::into_candle)
    }
}

/// While it lives, backwards sum gradients locally ([`DistributedDataParallel::no_sync`]).
#[must_use = "no_sync only lasts while its guard lives"]
pub struct NoSync<'a> {
    open: &'a AtomicUsize,
}

impl Drop for NoSync<'_> {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::SeqCst);
    }
}
