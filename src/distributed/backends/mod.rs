//! The backends: each provides a [`Communicator`](super::communicator::Communicator) for the
//! process group, standing on the transports and the rendezvous, never on another backend.
//!
//! - [`host`]: collectives in host memory over the mesh (gloo's role; `Backend::Tcp`);
//! - `nccl` (feature `nccl`): collectives on CUDA devices by NCCL;
//! - [`threads`]: ranks as threads of one process, sharing memory.

pub(crate) mod host;
#[cfg(feature = "nccl")]
pub(crate) mod nccl;
pub(crate) mod threads;
