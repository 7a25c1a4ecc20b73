//! Process groups: ranks that find each other and run collectives on candle tensors
//! (`torch.distributed`).
//!
//! - [`ProcessGroup`] is the one face: `rank`, `world_size`, `all_reduce`, `broadcast`,
//!   `all_gather`, `reduce_scatter`, `barrier`, on f32, f64, f16 and bf16 tensors of any shape.
//!   Results stay on the input's device.
//! - Groups are created from torchrun's or Slurm's environment ([`ProcessGroup::from_env`]),
//!   from a `tcp://host:port` address ([`ProcessGroup::from_url`]), explicitly
//!   ([`ProcessGroup::new`] with a [`Rendezvous`]), or as threads of one process ([`spawn`]).
//! - Backends: TCP (host memory over sockets: ring all-reduce, pipelined), in-process (threads
//!   sharing memory), NCCL (feature `nccl`, on candle's CUDA stream).
//! - Ranks meet through a [`store`] hosted by rank 0; connections must present the job token
//!   (`CANDLE_PARALLEL_TOKEN`, set by `candle-run`).
//!
//! Every collective first checks that all ranks called the same thing (kind, op, dtype, shape):
//! a mismatch is an [`Error::Mismatch`](crate::Error::Mismatch) on every rank, never a hang. A
//! rank that dies makes the others' pending and later collectives fail with
//! [`Error::PeerLost`](crate::Error::PeerLost) naming it, within `peer_timeout` (30 s by default;
//! at once when its connections close).
//!
//! ```rust
//! use candle_core::{Device, Tensor};
//! use candle_parallel::dist::{self, ReduceOp};
//! # fn main() -> candle_parallel::Result<()> {
//! // Four ranks as threads; with processes, each would call ProcessGroup::from_env instead.
//! let results = dist::spawn(4, |pg| {
//!     let x = Tensor::new(&[pg.rank() as f32, 1.0], &Device::Cpu)?;
//!     let mean = pg.all_reduce(&x, ReduceOp::Avg)?;
//!     let from_root = pg.broadcast(&x, 2)?;
//!     Ok((mean.to_vec1::<f32>()?, from_root.to_vec1::<f32>()?))
//! })?;
//! for (mean, from_root) in results {
//!     assert_eq!(mean, [1.5, 1.0]);
//!     assert_eq!(from_root, [2.0, 1.0]);
//! }
//! # Ok(()) }
//! ```

pub(crate) mod algorithms;
mod autograd;
pub(crate) mod element;
mod group;
mod inproc;
mod meet;
#[cfg(feature = "nccl")]
mod nccl;
mod rendezvous;
pub mod store;
pub(crate) mod tcp;
pub(crate) mod wire;

pub use group::{Backend, InitOptions, ProcessGroup, ReduceOp, TOKEN_VAR};
pub use inproc::{spawn, spawn_with};
pub use rendezvous::Rendezvous;
