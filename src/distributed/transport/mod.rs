//! The transports: how bytes move between the ranks of a group, whatever collective or backend
//! uses them.
//!
//! - [`wire`]: the bytes on our sockets (handshake, frame headers, bounded reads);
//! - [`conn`]: one connection to a peer, over TCP or a Unix-domain socket;
//! - [`shm`] (Linux): shared-memory channels between two ranks of one machine;
//! - [`links`]: what the algorithms see of a transport ([`Links`](links::Links));
//! - [`mesh`]: a connection between every pair of ranks, with failure detection, which
//!   implements `Links`;
//! - [`host_buf`]: tensors as host buffers, the bytes the host transports carry.

pub(crate) mod conn;
pub(crate) mod host_buf;
pub(crate) mod links;
pub(crate) mod mesh;
#[cfg(target_os = "linux")]
pub(crate) mod shm;
pub(crate) mod wire;
