//! Process groups: ranks that find each other and run collectives on candle tensors
//! (`torch.distributed`; also reachable as `candle_parallel::dist`).
//!
//! - [`ProcessGroup`] is the one face: `rank`, `world_size`, `all_reduce`, `broadcast`,
//!   `all_gather`, `reduce_scatter`, `barrier`, on f32, f64, f16 and bf16 tensors of any shape,
//!   each blocking or asynchronous (`all_reduce_async` and so on, returning a [`Work`]). Results
//!   stay on the input's device.
//! - Point-to-point messages (`send`, `recv`, `recv_as_sent`, each with an `_async` form, and
//!   [`ProcessGroup::batch_isend_irecv`] of [`P2pOp`]s) and `all_to_all` /
//!   `all_to_all_single` with uneven splits, on every backend: messages between two ranks
//!   match in the order they were issued, and a receive that expected another shape or dtype
//!   fails naming both.
//! - Groups are created from torchrun's or Slurm's environment ([`ProcessGroup::from_env`]),
//!   from a `tcp://host:port` address ([`ProcessGroup::from_url`]), explicitly
//!   ([`ProcessGroup::new`] with a [`Rendezvous`]), or as threads of one process
//!   ([`spawn_threads`]); a group makes groups of some or all of its ranks with
//!   [`ProcessGroup::new_group`]; a [`DeviceMesh`] lays the ranks out in named dimensions
//!   with a group along each (torch's `init_device_mesh`).
//! - Backends: TCP (host memory over sockets: ring all-reduce, pipelined), in-process (threads
//!   sharing memory), NCCL (feature `nccl`, on a CUDA stream of its own, ordered with candle's
//!   by events). Every backend reduces by one rule ([`reduce_op`]).
//! - Ranks meet through a [`store`] hosted by rank 0; connections must present the job token
//!   (`CANDLE_PARALLEL_TOKEN`, set by `candle-run`).
//!
//! The module is layered as gloo is. From the bottom: the shared pieces (`config`,
//! [`reduce_op`], [`work`], [`error_file`]); `transport` (how bytes move: wire format,
//! connections, shared memory, the mesh, host buffers); `algorithms` (collectives over any
//! `Links`); `rendezvous` (where to meet, the store, joining, connecting a group's mesh);
//! `communicator` (what a backend provides); `backends` (host, NCCL, threads, each on the
//! layers below and never on another); and the face: [`ProcessGroup`] (`group`), its
//! autograd-aware collectives (`autograd`) and [`spawn_threads`] (`spawn`).
//!
//! Every collective first checks that all ranks called the same thing (kind, op, dtype, shape):
//! a mismatch is an [`Error::Mismatch`](crate::Error::Mismatch) on every rank, never a hang. A
//! rank that dies makes the others' pending and later collectives fail with
//! [`Error::PeerLost`](crate::Error::PeerLost) naming it, within `peer_timeout` (30 s by default;
//! at once when its connections close).
//!
//! ```rust
//! use candle_core::{Device, Tensor};
//! use candle_parallel::distributed::{self, ReduceOp};
//! # fn main() -> candle_parallel::Result<()> {
//! // Four ranks as threads; with processes, each would call ProcessGroup::from_env instead.
//! let results = distributed::spawn_threads(4, |pg| {
//!     let x = Tensor::new(&[pg.rank() as f32, 1.0], &Device::Cpu)?;
//!     let mean = pg.all_reduce(&x, ReduceOp::Avg)?;
//!     let from_root = pg.broadcast_async(&x, 2)?; // in flight while we go on
//!     Ok((mean.to_vec1::<f32>()?, from_root.wait()?.to_vec1::<f32>()?))
//! })?;
//! for (mean, from_root) in results {
//!     assert_eq!(mean, [1.5, 1.0]);
//!     assert_eq!(from_root, [2.0, 1.0]);
//! }
//! # Ok(()) }
//! ```

pub(crate) mod algorithms;
mod autograd;
mod backends;
mod communicator;
mod config;
mod device_mesh;
pub mod error_file;
mod group;
pub mod objects;
pub mod reduce_op;
mod rendezvous;
mod spawn;
pub(crate) mod transport;
pub mod work;

#[allow(deprecated)]
pub use config::InitOptions;
pub use config::{
    build_global_pool, check_threads_var, global_pool_built_here, honour_omp_num_threads,
    omp_threads, Algorithm, Backend, InitConfig, ALGORITHM_VAR, BACKEND_VAR, OMP_THREADS_VAR,
    RENDEZVOUS_TIMEOUT_VAR, THREADS_VAR, TOKEN_VAR, WORKER_STACK,
};
pub use device_mesh::{DeviceMesh, MeshLayout};
pub use group::{P2pOp, ProcessGroup};
pub use reduce_op::ReduceOp;
pub use rendezvous::store;
pub use rendezvous::{Launcher, Rendezvous, MAX_WORLD_SIZE};
#[allow(deprecated)]
pub use spawn::spawn_threads_with;
pub use spawn::{spawn_threads, spawn_threads_with_config, spawn_threads_with_error};
pub use work::Work;
