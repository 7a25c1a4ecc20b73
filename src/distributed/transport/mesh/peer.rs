//! The channel to one peer: its socket, which carries every kind of frame, and, with a ring
//! neighbour on this machine, the shared memory that carries its data frames. The mesh sends
//! and waits through a peer's channel the same way whichever of the two carries a frame.

use super::shm_link::ShmLink;
use super::socket::PeerWriter;
use crate::distributed::transport::conn::Conn;

/// How this rank reaches one peer.
pub(super) struct Peer {
    /// How the peer is reached: "tcp", "unix", or "shm" (a socket and shared memory).
    pub kind: &'static str,
    /// The socket's writing end; the reader thread holds its reading end.
    pub writer: PeerWriter,
    /// The socket itself, kept to shut it down (waking its reader) when the mesh closes.
    pub socket: Conn,
    /// The shared-memory data channels, with a ring neighbour on this machine.
    pub shm: Option<ShmLink>,
}
