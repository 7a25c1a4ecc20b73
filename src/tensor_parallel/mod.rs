//! Tensor parallelism (Megatron-LM; torch's `torch.distributed.tensor.parallel`): a layer too
//! large for one device is cut inside, its weight split over the ranks of a tensor-parallel
//! group, each rank computing its part of every batch.
//!
//! - [`ColumnParallelLinear`] splits the output features (torch's `ColwiseParallel`),
//!   [`RowParallelLinear`] the input features (`RowwiseParallel`); a column layer feeding a row
//!   layer (an MLP, attention's projections) needs one all-reduce forward and one backward.
//! - [`ParallelAttention`]: causal self-attention with its heads split over the ranks (the
//!   packed projection column-parallel, the output projection row-parallel).
//! - [`VocabParallelEmbedding`] and [`vocab_parallel_cross_entropy`]: the vocabulary split
//!   over the ranks, the loss computed from every rank's logits without gathering them.
//! - Sequence parallel (`.sequence_parallel(true)` on both linears): the activations between
//!   the pairs split along the sequence, so the norms there run on 1/tp of the positions;
//!   [`sum_sequence_parallel_gradients`] sums those norms' gradients over the group.
//! - [`comm`]: the conjugate collectives under them ([`copy_to`], [`reduce_from`]).
//! - [`ParallelMlp`]: a transformer's MLP block, column- then row-parallel.
//! - [`shard_linear`] and [`shard_qkv`] cut a one-process layer's weights into a rank's part;
//!   a [`ParallelPlan`] does it for a whole model by layer name, and puts a run's parts back
//!   together into the one-process weights (to save them for a plain program).
//!
//! ```rust
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use candle_parallel::distributed;
//! use candle_parallel::tensor_parallel::{ColumnParallelLinear, RowParallelLinear};
//! # fn main() -> candle_parallel::Result<()> {
//! let x = Tensor::randn(0f32, 1., (3, 8), &Device::Cpu)?;
//! let outs = distributed::spawn_threads(2, |tp| {
//!     let varmap = VarMap::new();
//!     let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//!     let fc1 = ColumnParallelLinear::new(8, 32, vb.pp("fc1"), &tp)?; // 16 features each
//!     let fc2 = RowParallelLinear::new(32, 8, vb.pp("fc2"), &tp)?;
//!     let h = fc1.forward(&x)?.relu()?;
//!     assert_eq!(h.dims(), [3, 16]);
//!     Ok(fc2.forward(&h)?.dims().to_vec()) // the whole output on every rank
//! })?;
//! assert_eq!(outs, [vec![3, 8], vec![3, 8]]);
//! # Ok(()) }
//! ```

pub mod attention;
mod checkpoint;
pub mod comm;
pub mod linear;
pub mod mlp;
pub mod plan;
pub mod vocab;

pub use attention::{shard_qkv, ParallelAttention};
pub use comm::{
    copy_to, gather_sequence, reduce_from, reset_volume, scatter_sequence, volume, Volume,
};
pub use linear::{
    shard_linear, sum_sequence_parallel_gradients, ColumnParallelLinear, RowParallelLinear,
};
pub use mlp::ParallelMlp;
pub use plan::{ParallelPlan, ParallelStyle, Placement};
pub use vocab::{vocab_parallel_cross_entropy, VocabParallelEmbedding};
