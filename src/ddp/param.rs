//! One parameter as DistributedDataParallel's reducer and ZeRO-2's pieces see it.

use candle_core::{DType, Var};

/// One parameter, as the reducer needs it.
pub(crate) struct Param {
    pub name: String,
    pub var: Var,
    /// The dtype its gradient travels and is averaged in (mixed precision's reduce dtype, or
    /// the dtype it is computed in).
    pub grad_dtype: DType,
}

impl Param {
    /// The bytes its gradient takes in a bucket.
    pub(super) fn bytes(&self) -> usize {
        self.var.elem_count() * self.grad_dtype.size_in_bytes()
    }
}
