//! Data parallel across pipelines: the replicas of a stage (one per pipeline, along the "dp"
//! dimension of a `[dp, pp]` layout) average their gradients after each step.
//!
//! `DistributedDataParallel` and `FullyShardedDataParallel` tie one backward to each forward
//! (or, under `no_sync`, every forward since the last backward to the next one), but a
//! schedule runs several forwards before their backwards (1F1B's warm-up, GPipe's whole
//! forward half) and one backward per micro-batch: neither wrapper can follow it. A
//! schedule sums its micro-batches' gradients itself, so the data-parallel part is what those
//! wrappers do after the last micro-batch of an accumulation: one average of the sums over the
//! replicas. [`all_reduce_gradients`] does it, in one coalesced all-reduce, and every replica
//! then takes the same optimizer step (torch runs `REDUCE_GRAD` after the last backward of a
//! step in the same place).
//!
//! [`Zero2`] shards the optimizer's work along "dp" instead (ZeRO-2, as
//! `Sharding::Zero2` does for DDP): one reduce-scatter hands each replica its piece of every
//! averaged gradient ([`crate::shard`]'s layout), the optimizer steps the pieces only (so its
//! state is 1/dp of the stage's), and one all-gather puts the stepped pieces back together
//! into every replica's parameters.
//!
//! ```rust
//! use candle_core::{Device, Tensor, Var};
//! use candle_parallel::{distributed, pipeline::all_reduce_gradients};
//! # fn main() -> candle_parallel::Result<()> {
//! let got = distributed::spawn_threads(2, |dp| {
//!     let w = Var::new(&[1f32, 2.], &Device::Cpu)?;
//!     let mut grads = (w.as_tensor() * (dp.rank() as f64 + 1.))?.sum_all()?.backward()?;
//!     all_reduce_gradients(&mut grads, &[w.clone()], &dp)?;
//!     Ok(grads.get(w.as_tensor()).unwrap().to_vec1::<f32>()?)
//! })?;
//! assert_eq!(got, [vec![1.5, 1.5], vec![1.5, 1.5]]); // the mean of 1 and 2
//! # Ok(()) }
//! ```

use crate::distributed::{ProcessGroup, ReduceOp};
use crate::error::Result;
use crate::shard::{chunk_of, FlatLayout};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

/// Replaces each of `params`' gradients in `grads` with its average over `dp` (every rank of
/// `dp` calls it with the same parameters, in the same order). A parameter without a gradient
/// on this rank takes part with zeros; one without a gradient on every rank of `dp` is
/// averaged to zeros too, and said through the `log` facade.
pub fn all_reduce_gradients(
    grads: &mut GradStore,
    params: &[Var],
    dp: &ProcessGroup,
) -> Result<()> {
    if dp.world_size() == 1 || params.is_empty() {
        return Ok(());
    }
    let mut missing = Vec::new();
    let tensors = params
        .iter()
        .enumerate()
        .map(|(i, p)| match grads.get(p.as_tensor()) {
            Some(g) => Ok(g.clone()),
            None => {
                missing.push(i);
                p.as_tensor().zeros_like()
            }
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    if !missing.is_empty() {
        log::warn!(
            "rank {} of the data-parallel group: parameters {missing:?} (in the order given) got \
             no gradient in this step; they take part in the average with zeros",
            dp.rank()
        );
    }
    let averaged = dp.all_reduce_many(&tensors, ReduceOp::Avg)?;
    for (p, g) in params.iter().zip(averaged) {
        grads.insert(p.as_tensor(), g);
    }
    Ok(())
}

/// ZeRO-2 along the data-parallel dimension: the optimizer steps this replica's pieces of the
/// stage's parameters. See the [module documentation](self).
///
/// ```rust
/// use candle_core::{Device, Tensor, Var};
/// use candle_nn::Optimizer;
/// use candle_parallel::optim::{Sgd, SgdConfig};
/// use candle_parallel::{distributed, pipeline::Zero2};
/// # fn main() -> candle_parallel::Result<()> {
/// let got = distributed::spawn_threads(2, |dp| {
///     let w = Var::new(&[1f32, 2., 3.], &Device::Cpu)?;
///     let zero = Zero2::new(&[w.clone()], &dp)?;
///     let mut opt = Sgd::new(zero.pieces().to_vec(), SgdConfig { lr: 1.0, ..Default::default() })?;
///     let grads = (w.as_tensor() * (dp.rank() as f64 + 1.))?.sum_all()?.backward()?;
///     opt.step(&zero.reduce_scatter(&grads)?)?; // each replica steps 2 of the 3 elements
///     zero.gather()?;
///     Ok(w.as_tensor().to_vec1::<f32>()?)
/// })?;
/// assert_eq!(got, [vec![-0.5, 0.5, 1.5], vec![-0.5, 0.5, 1.5]]); // each moved by the mean, 1.5
/// # Ok(()) }
/// ```
pub struct Zero2 {
    dp: ProcessGroup,
    params: Vec<Var>,
    layout: FlatLayout,
    /// This replica's chunk of each parameter (flattened, padded with zeros).
    pieces: Vec<Var>,
}

impl Zero2 {
    /// Shards `params` (a stage's parameters, the same on every replica of `dp`, in the same
    /// order) over `dp`. The replicas first take dp rank 0's values, as DDP does at
    /// construction. Every rank of `dp` calls it.
    pub fn new(params: &[Var], dp: &ProcessGroup) -> Result<Self> {
        for p in params {
            p.set(&dp.broadcast(p.as_tensor(), 0)?)?;
        }
        let numels: Vec<usize> = params.iter().map(|p| p.elem_count()).collect();
        let (world, rank) = (dp.world_size(), dp.rank());
        let pieces = params
            .iter()
            .map(|p| Ok(Var::from_tensor(&chunk_of(p.as_tensor(), world, rank)?)?))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            dp: dp.clone(),
            params: params.to_vec(),
            layout: FlatLayout::new(&numels, world),
            pieces,
        })
    }

    /// This replica's pieces of the parameters, in their order: give them to the optimizer.
    pub fn pieces(&self) -> &[Var] {
        &self.pieces
    }

    /// The gradients of the pieces: each parameter's gradient in `grads` (zeros where it has
    /// none), averaged over `dp` by one reduce-scatter, this replica's chunk of each; a
    /// parameter without a gradient on every replica is left out (the optimizer skips it).
    /// Every rank of `dp` calls it.
    pub fn reduce_scatter(&self, grads: &GradStore) -> Result<GradStore> {
        reduce_scatter_to_pieces(
            &self.dp,
            &self.layout,
            &self.params,
            &self.pieces,
            grads,
            None,
        )
    }

    /// Puts every replica's stepped pieces back together into the parameters (one
    /// all-gather). Every rank of `dp` calls it after the optimizer's step.
    pub fn gather(&self) -> Result<()> {
        let shapes: Vec<Vec<usize>> = self.params.iter().map(|p| p.dims().to_vec()).collect();
        let whole = gather_pieces(&self.dp, &self.layout, &self.pieces, &shapes)?;
        for (p, t) in self.params.iter().zip(whole) {
            p.set(&t)?;
        }
        Ok(())
    }
}

/// The gradients of `pieces` (this replica's chunks of `params`, in `layout`): each parameter's
/// gradient in `grads`, averaged over `dp` by one reduce-scatter. A parameter without a
/// gradient on this replica takes part with zeros; one without a gradient on every replica is
/// left out of the result (so the optimizer skips it, as in one process: no weight decay, no
/// momentum) and said through the `log` facade, by name where `names` gives them.
pub(super) fn reduce_scatter_to_pieces(
    dp: &ProcessGroup,
    layout: &FlatLayout,
    params: &[Var],
    pieces: &[Var],
    grads: &GradStore,
    names: Option<&[String]>,
) -> Result<GradStore> {
    let mut out = GradStore::default();
    let Some(first) = params.first() else {
        return Ok(out);
    };
    // Which parameters have a gradient on some replica (one small all-reduce).
    let here: Vec<f32> = params
        .iter()
        .map(|p| f32::from(u8::from(grads.get(p.as_tensor()).is_some())))
        .collect();
    let here =
        Tensor::new(here.as_slice(), &candle_core::Device::Cpu)?.to_device(first.device())?;
    let anywhere = dp.all_reduce(&here, ReduceOp::Max)?.to_vec1::<f32>()?;
    let full = params
        .iter()
        .map(|p| match grads.get(p.as_tensor()) {
            Some(g) => Ok(g.clone()),
            None => p.as_tensor().zeros_like(),
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let shard = dp.reduce_scatter(&layout.flatten(&full)?, ReduceOp::Avg)?;
    let mut unused = Vec::new();
    for (i, (piece, g)) in pieces.iter().zip(layout.split_shard(&shard)?).enumerate() {
        if anywhere[i] > 0.0 {
            out.insert(piece.as_tensor(), g);
        } else {
            unused.push(names.map_or_else(|| format!("#{i}"), |n| format!("`{}`", n[i])));
        }
    }
    if !unused.is_empty() {
        log::warn!(
            "rank {} of the data-parallel group: parameters {} got no gradient on any replica in \
             this step; the optimizer leaves them out, as in one process",
            dp.rank(),
            unused.join(", ")
        );
    }
    Ok(out)
}

/// The whole parameters, of `shapes`, from every replica's `pieces` (one all-gather over `dp`).
pub(super) fn gather_pieces(
    dp: &ProcessGroup,
    layout: &FlatLayout,
    pieces: &[Var],
    shapes: &[Vec<usize>],
) -> Result<Vec<Tensor>> {
    if pieces.is_empty() {
        return Ok(Vec::new());
    }
    let mine: Vec<Tensor> = pieces.iter().map(|p| p.as_tensor().clone()).collect();
    let shards = dp.all_gather(&Tensor::cat(&mine, 0)?)?;
    layout.from_shards(&shards, shapes)
}
