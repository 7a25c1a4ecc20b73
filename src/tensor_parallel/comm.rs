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
