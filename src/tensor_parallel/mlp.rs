//! A transformer's MLP block cut over the tensor-parallel group (Megatron's `ParallelMLP`):
//! the widening layer column-parallel, the exact (erf) GELU on each rank's slice of the hidden
//! features, the narrowing layer row-parallel: one all-reduce forward and one backward.

use super::linear::{ColumnParallelLinear, RowParallelLinear};
use crate::distributed::ProcessGroup;
use crate::error::Result;
use candle_core::Tensor;
use candle_nn::VarBuilder;

/// `fc2(gelu(fc1(x)))` with `hidden / tp` hidden features on each rank: variables
/// `fc1.{weight,bias}` (column-parallel) and `fc2.{weight,bias}` (row-parallel), the same names
/// and, where new, the same initialisation as two candle-nn `linear`s of the whole block.
#[derive(Clone, Debug)]
pub struct ParallelMlp {
    fc1: ColumnParallelLinear,
    fc2: RowParallelLinear,
}

impl ParallelMlp {
    /// `dim -> hidden -> dim`, this rank's share of the hidden features built from `vb`.
    /// `hidden` must be a multiple of the group's size (an error naming both otherwise).
    pub fn new(dim: usize, hidden: usize, vb: VarBuilder, tp: &ProcessGroup) -> Result<Self> {
        Ok(Self {
            fc1: ColumnParallelLinear::new(dim, hidden, vb.pp("fc1"), tp)?,
            fc2: RowParallelLinear::new(hidden, dim, vb.pp("fc2"), tp)?,
        })
    }

    /// Under sequence parallelism (`on`) the input and the output are this rank's positions
    /// `(batch, time / tp, dim)`: all-gathered before `fc1`, reduce-scattered after `fc2`
    /// (see [`ColumnParallelLinear::sequence_parallel`]). `fc2`'s bias then trains on each
    /// rank's positions: sum its gradient with [`super::sum_sequence_parallel_gradients`].
    pub fn sequence_parallel(self, on: bool) -> Self {
        Self {
            fc1: self.fc1.sequence_parallel(on),
            fc2: self.fc2.sequence_parallel(on),
        }
    }

    /// The block's output for `x` `(.., dim)`: whole on every rank (or, under sequence
    /// parallelism, this rank's positions).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.forward(&self.fc1.forward_gelu(x)?)
    }
}

impl candle_core::Module for ParallelMlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        ParallelMlp::forward(self, x).map_err(crate::error::Error::into_candle)
    }
}
