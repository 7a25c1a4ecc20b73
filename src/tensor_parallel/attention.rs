//! Causal self-attention with its heads split over the tensor-parallel group (Megatron's
//! `ParallelAttention`): the packed `qkv` projection column-parallel (each rank projects the
//! queries, keys and values of its heads), attention over those heads alone, and the output
//! projection row-parallel, so the block costs one all-reduce forward and one backward.

use super::linear::{ColumnParallelLinear, RowParallelLinear};
use crate::distributed::ProcessGroup;
use crate::error::{Error, Result};
use crate::nn::attention::causal_attention;
use candle_core::Tensor;
use candle_nn::VarBuilder;

/// The heads of rank `tp.rank()`: `heads / tp`, or an error naming both numbers.
fn local_heads(heads: usize, tp: &ProcessGroup) -> Result<usize> {
    let ranks = tp.world_size();
    if heads == 0 || !heads.is_multiple_of(ranks) {
        return Err(Error::InvalidArgument {
            what: "tensor-parallel attention",
            detail: format!(
                "{heads} heads cannot be split over {ranks} tensor-parallel ranks; the heads must \
                 be a positive multiple of the group's size"
            ),
        });
    }
    Ok(heads / ranks)
}

/// This rank's part of a one-process packed projection `weight` (`3 * dim x dim`, queries then
/// keys then values, head `h` at rows `h * head_dim..` of each) and `bias` (`3 * dim`): the
/// rows of its heads in each of the three, packed again (`[q_r | k_r | v_r]`), as
/// [`ParallelAttention`]'s `qkv` holds them. (`shard_linear`'s contiguous rows would hand rank
/// 0 all the queries.)
pub fn shard_qkv(
    weight: &Tensor,
    bias: Option<&Tensor>,
    heads: usize,
    tp: &ProcessGroup,
) -> Result<(Tensor, Option<Tensor>)> {
    local_heads(heads, tp)?;
    let dim = weight.dim(0)? / 3;
    let rows = dim / tp.world_size();
    let at = tp.rank() * rows;
    let pick = |t: &Tensor| -> Result<Tensor> {
        let parts = (0..3)
            .map(|p| t.narrow(0, p * dim + at, rows))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Tensor::cat(&parts, 0)?.contiguous()?)
    };
    Ok((pick(weight)?, bias.map(pick).transpose()?))
}

/// Causal multi-head self-attention (`x` `(batch, time, dim)` to the same) with `heads / tp`
/// heads on each rank: variables `qkv.{weight,bias}` (`3 * dim / tp` rows, see [`shard_qkv`])
/// and `proj.{weight,bias}` (row-parallel).
#[derive(Clone, Debug)]
pub struct ParallelAttention {
    qkv: ColumnParallelLinear,
    proj: RowParallelLinear,
    heads: usize,
}

impl ParallelAttention {
    /// `dim` wide with `heads` heads in all, this rank's `heads / tp` built from `vb`.
    pub fn new(dim: usize, heads: usize, vb: VarBuilder, tp: &ProcessGroup) -> Result<Self> {
        let local = local_heads(heads, tp)?;
        if !dim.is_multiple_of(heads) {
            return Err(Error::InvalidArgument {
                what: "tensor-parallel attention",
                detail: format!("width {dim} is not a multiple of the {heads} heads"),
            });
        }
        Ok(Self {
            qkv: ColumnParallelLinear::new(dim, 3 * dim, vb.pp("qkv"), tp)?,
            proj: RowParallelLinear::new(dim, dim, vb.pp("proj"), tp)?,
            heads: local,
        })
    }

    /// Under sequence parallelism (`on`) the input and the output are this rank's positions
    /// `(batch, time / tp, dim)`: all-gathered before the `qkv` projection (attention needs
    /// every position), reduce-scattered after `proj`. `proj`'s bias then trains on each rank's
    /// positions: sum its gradient with [`super::sum_sequence_parallel_gradients`].
    pub fn sequence_parallel(self, on: bool) -> Self {
        Self {
            qkv: self.qkv.sequence_parallel(on),
            proj: self.proj.sequence_parallel(on),
            heads: self.heads,
        }
    }

    /// The attention of `x`, whole on every rank (or, under sequence parallelism, this rank's
    /// positions).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = causal_attention(&self.qkv.forward(x)?, self.heads)?;
        self.proj.forward(&y)
    }

    /// The heads this rank computes.
    pub fn local_heads(&self) -> usize {
        self.heads
    }
}

impl candle_core::Module for ParallelAttention {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        ParallelAttention::forward(self, x).map_err(Error::into_candle)
    }
}
