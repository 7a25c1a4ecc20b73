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
use candle_core::backprop::GradStore;
use candle_core::Var;

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
