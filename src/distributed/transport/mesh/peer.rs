//! The channel to one peer: its socket, which carries every kind of frame, and, with a ring
//! neighbour on this machine, the shared memory that carries its data frames. The mesh sends
//! and waits through a peer's channel the same way whichever of the two carries a frame.

use super::shm_link::ShmLink;
use crate::distributed::transport::conn::Conn;
use crate::distributed::transport::wire::Tag;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

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

/// A frame read from a peer, waiting in its inbox.
pub(crate) struct Frame {
    pub tag: Tag,
    pub payload: Vec<u8>,
}

/// The writing end of the connection to one peer.
pub(crate) struct PeerWriter {
    pub stream: Mutex<Conn>,
    /// When this rank last wrote to the peer, in ms since the mesh's epoch (for heartbeats).
    pub last_sent_ms: AtomicU64,
}
