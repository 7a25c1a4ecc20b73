//! How a bucket's gradients travel: DistributedDataParallel's communication hooks (torch's
//! default all-reduce, `fp16_compress_hook` and `bf16_compress_hook`).

use crate::distributed::{ProcessGroup, ReduceOp, Work};
use crate::error::Result;
use candle_core::{DType, Tensor};

/// How gradients travel (torch's communication hooks `fp16_compress_hook` and
/// `bf16_compress_hook`): divided by the world size, converted, summed, converted back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compression {
    /// Gradients travel in their own dtype (default).
    #[default]
    None,
    /// Gradients travel as bf16: half the bytes, f32's range.
    Bf16,
    /// Gradients travel as f16: half the bytes, more precision than bf16, less range.
    F16,
}

impl Compression {
    /// Issues the average of `grads` over `group`'s world: one asynchronous all-reduce of all
    /// of them (coalesced by the backend, on its own thread). The averages come back in the
    /// travelling dtype; the caller converts them to the parameters' own. The caller owns
    /// `grads` (the reducer: the gradients handed to it): a lone gradient that travels as it is
    /// is averaged in its own storage where the backend can.
    pub(crate) fn all_reduce_async(
        self,
        group: &ProcessGroup,
        grads: &[Tensor],
    ) -> Result<Work<Vec<Tensor>>> {
        let world = group.world_size() as f64;
        let compressed = |dtype: DType| -> candle_core::Result<Vec<Tensor>> {
            grads.iter().map(|g| (g / world)?.to_dtype(dtype)).collect()
        };
        match self {
            Compression::None => match grads {
                [one] => Ok(group
                    .all_reduce_owned_async(one.clone(), ReduceOp::Avg)?
                    .map(|t| Ok(vec![t]))),
                _ => group.all_reduce_many_async(grads, ReduceOp::Avg),
            },
            Compression::Bf16 => {
                group.all_reduce_many_async(&compressed(DType::BF16)?, ReduceOp::Sum)
            }
            Compression::F16 => {
                group.all_reduce_many_async(&compressed(DType::F16)?, ReduceOp::Sum)
            }
        }
    }

    /// Issues the average of the flat buffer `flat` over `group`'s world, of which this rank
    /// gets its shard (a reduce-scatter), in the travelling dtype.
    pub(crate) fn reduce_scatter_async(
        self,
        group: &ProcessGroup,
        flat: &Tensor,
    ) -> Result<Work<Tensor>> {
        let world = group.world_size() as f64;
        match self {
            Compression::None => group.reduce_scatter_async(flat, ReduceOp::Avg),
            Compression::Bf16 => {
                group.reduce_scatter_async(&(flat / world)?.to_dtype(DType::BF16)?, ReduceOp::Sum)
            }
            Compression::F16 => {
                group.reduce_scatter_async(&(flat / world)?.to_dtype(DType::F16)?, ReduceOp::Sum)
            }
        }
    }
}
