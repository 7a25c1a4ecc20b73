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

/// Megatron's `f`: identity forward, all-reduce (sum) of the gradient over `tp` backward.
pub fn copy_to(x: &Tensor, tp: &ProcessGroup) -> Result<Tensor> {
    if tp.world_size() == 1 {
        return Ok(x.clone());
    }
    Ok(x.contiguous()?.apply_op1(CopyTo { tp: tp.clone() })?)
}

/// Megatron's `g`: all-reduce (sum) over `tp` forward, the gradient unchanged backward.
pub fn reduce_from(x: &Tensor, tp: &ProcessGroup) -> Result<Tensor> {
    if tp.world_size() == 1 {
        return Ok(x.clone());
    }
    let reduced = tp.all_reduce(x, ReduceOp::Sum)?.contiguous()?;
    Ok(x.apply_op2(&reduced, ReduceFrom)?)
}

/// `x` `(batch, time / tp, ...)`, this rank's positions, to the whole sequence on every rank
/// (all-gather along dimension 1); the gradient is reduce-scattered back.
pub fn gather_sequence(x: &Tensor, tp: &ProcessGroup) -> Result<Tensor> {
    if tp.world_size() == 1 {
        return Ok(x.clone());
    }
    let whole = gather_along_1(x, tp)?;
    Ok(x.contiguous()?.apply_op2(
        &whole,
        Sequence {
            tp: tp.clone(),
            gather: true,
        },
    )?)
}

/// `x` `(batch, time, ...)`, a partial sum on each rank, to the sum of this rank's positions
/// `(batch, time / tp, ...)` (reduce-scatter along dimension 1); the gradient is all-gathered
/// back. `time` must be a multiple of the group's size.
pub fn scatter_sequence(x: &Tensor, tp: &ProcessGroup) -> Result<Tensor> {
    if tp.world_size() == 1 {
        return Ok(x.clone());
    }
    let mine = scatter_along_1(x, tp)?;
    Ok(x.contiguous()?.apply_op2(
        &mine,
        Sequence {
            tp: tp.clone(),
            gather: false,
        },
    )?)
}

/// Every rank's `x` concatenated along dimension 1.
fn gather_along_1(x: &Tensor, tp: &ProcessGroup) -> Result<Tensor> {
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
    let first = x.transpose(0, 1)?.contiguous()?;
    let mine = tp.reduce_scatter(&first, ReduceOp::Sum)?;
    Ok(mine.transpose(0, 1)?.contiguous()?)
}

/// Hands on the collective's result (its second input); the backward runs the conjugate
/// collective on the gradient.
struct Sequence {
    tp: ProcessGroup,
    /// Forward all-gather (backward reduce-scatter), or the reverse.
    gather: bool,
}

impl candle_core::CustomOp2 for Sequence {
    fn name(&self) -> &'static str {
        "sequence-parallel"
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
        let g = match self.gather {
            true => scatter_along_1(grad, &self.tp),
            false => gather_along_1(grad, &self.tp),
        };
        Ok((Some(g.map_err(Error::into_candle)?), None))
    }
}

struct CopyTo {
    tp: ProcessGroup,
}

impl candle_core::CustomOp1 for CopyTo {
    fn name(&self) -> &'static str {
        "tensor-parallel-copy"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        crate::util::pass_through::cpu(s, l)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::util::pass_through::cuda(s, l)
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let g = self
            .tp
            .all_reduce(grad, ReduceOp::Sum)
            .map_err(Error::into_candle)?;
        Ok(Some(g))
    }
}

/// Hands on the all-reduced tensor (its second input); the gradient goes to the first as is.
struct ReduceFrom;

impl candle_core::CustomOp2 for ReduceFrom {
    fn name(&self) -> &'static str {
        "tensor-parallel-reduce"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        reduced: &CpuStorage,
        l: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        crate::util::pass_through::cpu(reduced, l)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        reduced: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::util::pass_through::cuda(reduced, l)
    }

    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.clone()), None))
    }
}
