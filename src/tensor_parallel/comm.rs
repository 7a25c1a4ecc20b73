//! The conjugate collectives of Megatron's tensor parallelism, each a differentiable op: what
//! one does in the forward, the other does in the backward.
//!
//! - [`copy_to`] (Megatron's `f`): the forward hands the input on unchanged; the backward
//!   all-reduces the gradient (each rank's partial gradient of a replicated input).
//! - [`reduce_from`] (Megatron's `g`): the forward all-reduces (each rank's partial sum); the
//!   backward hands the gradient on unchanged (the result is replicated, and so is its gradient).
//!
//! A column-parallel layer starts with `copy_to`, a row-parallel one ends with `reduce_from`,
//! so a column layer feeding a row layer costs one all-reduce forward and one backward.
//!
//! Under sequence parallelism the activations between such pairs are split along the sequence
//! (dimension 1 of `(batch, time, dim)`), and the pair's collectives become:
//! - [`gather_sequence`]: all-gather along the sequence forward, reduce-scatter of the gradient
//!   backward (before a column layer);
//! - [`scatter_sequence`]: reduce-scatter along the sequence forward (the row layer's partial
//!   sums, each rank keeping its positions), all-gather of the gradient backward.
//!
//! The same bytes move as with one all-reduce (an all-reduce is a reduce-scatter and an
//! all-gather), and the norms between the pairs run on 1/tp of the positions.
//! Every rank of the group runs the same ops in the same order, forward and backward.

use crate::distributed::{ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use candle_core::{CpuStorage, Layout, Shape, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};

/// Elements this process has put into the tensor-parallel collectives, by kind: all-reduces,
/// all-gathers (each rank's part), reduce-scatters (the whole input).
static VOLUME: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

/// How many elements this process's tensor-parallel collectives ([`copy_to`], [`reduce_from`],
/// [`gather_sequence`], [`scatter_sequence`], forward and backward) have moved since the last
/// [`reset_volume`], by kind: what Megatron's communication formula counts (an all-reduce of
/// `n` elements per rank, an all-gather of `n` per rank into `n * tp`, a reduce-scatter of `n`
/// per rank into `n / tp`). Ranks that are threads of one process add up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Volume {
    /// Elements all-reduced (each call's tensor size).
    pub all_reduce: u64,
    /// Elements all-gathered (each call's input, one rank's part).
    pub all_gather: u64,
    /// Elements reduce-scattered (each call's whole input).
    pub reduce_scatter: u64,
}

/// The counts since the last [`reset_volume`].
pub fn volume() -> Volume {
    Volume {
        all_reduce: VOLUME[0].load(Ordering::Relaxed),
        all_gather: VOLUME[1].load(Ordering::Relaxed),
        reduce_scatter: VOLUME[2].load(Ordering::Relaxed),
    }
}

/// Sets the counts of [`volume`] to zero.
pub fn reset_volume() {
    for v in &VOLUME {
        v.store(0, Ordering::Relaxed);
    }
}

fn count(kind: usize, t: &Tensor) {
    VOLUME[kind].fetch_add(t.elem_count() as u64, Ordering::Relaxed);
}

/// Megatron's `f`: identity forward, all-reduce (sum) of the gradient over `tp` backward.
pub fn copy_to(x: &Tensor, tp: &ProcessGroup) -> Result<Tensor> {
    if tp.world_size() == 1 {
        return Ok(x.clone());
    }
    handed_on(x, x, tp, Backward::AllReduce)
}

/// Megatron's `g`: all-reduce (sum) over `tp` forward, the gradient unchanged backward.
pub fn reduce_from(x: &Tensor, tp: &ProcessGroup) -> Result<Tensor> {
    if tp.world_size() == 1 {
        return Ok(x.clone());
    }
    count(0, x);
    let reduced = tp.all_reduce(x, ReduceOp::Sum)?.contiguous()?;
    handed_on(x, &reduced, tp, Backward::Identity)
}

/// `x` `(batch, time / tp, ...)`, this rank's positions, to the whole sequence on every rank
/// (all-gather along dimension 1); the gradient is reduce-scattered back.
pub fn gather_sequence(x: &Tensor, tp: &ProcessGroup) -> Result<Tensor> {
    if tp.world_size() == 1 {
        return Ok(x.clone());
    }
    let whole = gather_along_1(x, tp)?;
    handed_on(x, &whole, tp, Backward::ReduceScatter)
}

/// `x` `(batch, time, ...)`, a partial sum on each rank, to the sum of this rank's positions
/// `(batch, time / tp, ...)` (reduce-scatter along dimension 1); the gradient is all-gathered
/// back. `time` must be a multiple of the group's size.
pub fn scatter_sequence(x: &Tensor, tp: &ProcessGroup) -> Result<Tensor> {
    if tp.world_size() == 1 {
        return Ok(x.clone());
    }
    let mine = scatter_along_1(x, tp)?;
    handed_on(x, &mine, tp, Backward::AllGather)
}

/// Every rank's `x` concatenated along dimension 1.
fn gather_along_1(x: &Tensor, tp: &ProcessGroup) -> Result<Tensor> {
    count(1, x);
    let parts = tp.all_gather(&x.contiguous()?)?;
    Ok(Tensor::cat(&parts, 1)?.contiguous()?)
}

/// The sum over ranks of `x`, this rank's slice along dimension 1.
fn scatter_along_1(x: &Tensor, tp: &ProcessGroup) -> Result<Tensor> {
    let time = x.dim(1)?;
    if time % tp.world_size() != 0 {
        return Err(Error::InvalidArgument {
            what: "sequence-parallel split",
            detail: format!(
                "a sequence of {time} positions cannot be split over {} tensor-parallel ranks; \
                 make it a multiple of the group's size",
                tp.world_size()
            ),
        });
    }
    count(2, x);
    let first = x.transpose(0, 1)?.contiguous()?;
    let mine = tp.reduce_scatter(&first, ReduceOp::Sum)?;
    Ok(mine.transpose(0, 1)?.contiguous()?)
}

/// What the backward of a collective does with the gradient: the conjugate collective.
#[derive(Clone, Copy)]
enum Backward {
    /// Sums it over the group (after [`copy_to`]'s identity).
    AllReduce,
    /// Hands it on (after [`reduce_from`]'s all-reduce).
    Identity,
    /// Sums it and keeps this rank's positions (after [`gather_sequence`]).
    ReduceScatter,
    /// Gathers every rank's positions (after [`scatter_sequence`]).
    AllGather,
}

/// `result` (a collective's output, computed from `x`, or `x` itself) as a node of `x`'s graph
/// whose backward runs `backward` on the gradient.
fn handed_on(x: &Tensor, result: &Tensor, tp: &ProcessGroup, backward: Backward) -> Result<Tensor> {
    let op = Conjugate {
        tp: tp.clone(),
        backward,
    };
    // The op's forward hands on a compact copy of `result`, whatever its layout.
    Ok(x.apply_op2(result, op)?)
}

/// Hands on its second input (the collective's result); the backward runs the conjugate
/// collective on the gradient, for the first.
struct Conjugate {
    tp: ProcessGroup,
    backward: Backward,
}

impl candle_core::CustomOp2 for Conjugate {
    fn name(&self) -> &'static str {
        "tensor-parallel-collective"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        result: &CpuStorage,
        l: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        crate::util::pass_through::cpu(result, l)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        result: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::util::pass_through::cuda(result, l)
    }

    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let g = match self.backward {
            Backward::AllReduce => {
                count(0, grad);
                self.tp.all_reduce(grad, ReduceOp::Sum)
            }
            Backward::Identity => Ok(grad.clone()),
            Backward::ReduceScatter => scatter_along_1(grad, &self.tp),
            Backward::AllGather => gather_along_1(grad, &self.tp),
        };
        Ok((Some(g.map_err(Error::into_candle)?), None))
    }
}
