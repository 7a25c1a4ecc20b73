//! Pipeline parallelism across processes (`torch.distributed.pipelining`): the model is cut
//! into consecutive stages, one (or several) per rank, and each batch into micro-batches that
//! flow through the stages, forward and then backward, so that the ranks compute at once.
//!
//! Three pieces, as torch has them:
//! - [`PipelineStage`] ([`stage`]): a part of the model on the rank that runs it.
//! - [`Schedule`] ([`schedule`]): the order of the forwards and backwards, as a pure list of
//!   actions per rank: GPipe, 1F1B and interleaved 1F1B.
//! - [`PipelineSchedule`] ([`runtime`]): runs a schedule's step: splits the batch
//!   ([`microbatch`]), passes activations and gradients between neighbours (their shapes
//!   found at run time), computes the loss on the last stage and sums each stage's gradients
//!   over the micro-batches, the losses divided by their number (torch's `scale_grads`), so
//!   that one step equals the step of the unsplit model on the whole batch.
//!
//! Along a data-parallel dimension, [`all_reduce_gradients`] averages each stage's gradients
//! over its replicas after the step, or [`Zero2`] shards them and the optimizer's state
//! ([`data_parallel`]), or [`FullyShardedStage`] shards the parameters too, gathering the
//! stage for each step only ([`fully_shard`]).
//!
//! ```rust
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{linear, loss, Linear, Optimizer, VarMap};
//! use candle_parallel::init::seeded_var_builder;
//! use candle_parallel::optim::{Sgd, SgdConfig};
//! use candle_parallel::pipeline::{PipelineSchedule, PipelineStage, Schedule};
//! use candle_parallel::distributed;
//! # fn main() -> candle_parallel::Result<()> {
//! let x = Tensor::randn(0f32, 1., (8, 4), &Device::Cpu)?;
//! let y = Tensor::randn(0f32, 1., (8, 2), &Device::Cpu)?;
//! // Two stages: layer 0 (4 -> 6) on rank 0, layer 1 (6 -> 2) on rank 1.
//! let losses = distributed::spawn_threads(2, |pg| {
//!     let varmap = VarMap::new();
//!     let vb = seeded_var_builder(&varmap, 0, DType::F32, &Device::Cpu);
//!     let (i, o) = [(4, 6), (6, 2)][pg.rank()];
//!     let layer: Linear = linear(i, o, vb.pp(format!("layers.{}", pg.rank())))?;
//!     let stage = PipelineStage::new(layer, &varmap, pg.rank(), 2, &pg)?;
//!     let schedule = PipelineSchedule::new(Schedule::OneFOneB, 4, loss::mse)?;
//!     let mut opt = Sgd::new(stage.parameters(), SgdConfig { lr: 0.1, ..Default::default() })?;
//!     let out = schedule.step(&[&stage], Some(&x), Some(&y))?; // each rank uses its part
//!     opt.step(&out.grads)?;
//!     Ok(out.loss())
//! })?;
//! assert!(losses[0].is_none() && losses[1].is_some()); // the last stage has the loss
//! # Ok(()) }
//! ```

pub mod data_parallel;
pub mod fully_shard;
pub mod microbatch;
pub mod runtime;
pub mod schedule;
pub mod stage;

pub use data_parallel::{all_reduce_gradients, Zero2};
pub use fully_shard::FullyShardedStage;
pub use runtime::{EvalOutput, Event, PipelineSchedule, StepOutput};
pub use schedule::{Action, Computation, Schedule};
pub use stage::PipelineStage;
