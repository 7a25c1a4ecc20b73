//! An all-reduce that autograd flows through.
//!
//! `y = all_reduce(x)` on every rank means each `x_r` contributes to every `y_k`, so the
//! gradient of `x_r` is the all-reduce of the gradients of `y`: backward runs the same collective
//! on the gradient (the same order on every rank, as their graphs are the same). This is what
//! SyncBatchNorm's statistics need.

use super::group::ProcessGroup;
use super::ReduceOp;
use crate::error::{Error, Result};
use candle_core::{CpuStorage, Layout, Shape, Tensor};

/// Passes through a precomputed all-reduce result and all-reduces the gradient.
struct AllReduceGrad {
    group: ProcessGroup,
    op: ReduceOp,
}

impl candle_core::CustomOp2 for AllReduceGrad {
    fn name(&self) -> &'static str {
        "all-reduce"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        result: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        crate::util::pass_through::cpu(result, layout)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        result: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::util::pass_through::cuda(result, layout)
    }

    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let g = self
            .group
            .all_reduce(grad, self.op)
            .map_err(Error::into_candle)?;
        Ok((Some(g), None))
    }
}

impl ProcessGroup {
    /// [`ProcessGroup::all_reduce`] with a backward pass: the gradient of `t` is the same
    /// all-reduce of the result's gradient. Only `Sum` and `Avg` are differentiable.
    pub fn all_reduce_differentiable(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        if !matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
            return Err(Error::InvalidArgument {
                what: "differentiable all-reduce op",
                detail: format!("{op} has no gradient here; use sum or avg"),
            });
        }
        // The op's forward hands on a compact copy of the result, whatever its layout.
        let reduced = self.all_reduce(t, op)?;
        let group = self.clone();
        Ok(t.apply_op2(&reduced, AllReduceGrad { group, op })?)
    }
}
