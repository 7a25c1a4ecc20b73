//! Shared memory as a transport: data frames to a ring neighbour on this machine go through
//! the pair's mapped channels ([`shm`](crate::distributed::transport::shm)) instead of its socket,
//! while control frames stay on the socket. A waiter sleeps on a futex of its channel; the
//! socket reader rings the same doorbell when something happens that the waiter must see (a
//! frame on the socket, an abort, a goodbye).

use super::MeshState;
#[cfg(target_os = "linux")]
use {
    crate::distributed::transport::shm::{futex_wait, futex_wake, Channel, Region},
    crate::distributed::transport::wire::{FrameKind, Tag},
    crate::error::Result,
    crate::util::sync::lock,
    std::sync::atomic::Ordering,
    std::time::{Duration, Instant},
};

/// Shared-memory data channels with one peer on this machine.
#[cfg(target_os = "linux")]
pub(crate) struct ShmLink {
    pub send: Channel,
    pub recv: Channel,
    /// The mapping both channels point into; dropped (unmapped) after them.
    pub _region: Region,
}

#[cfg(not(target_os = "linux"))]
pub(crate) enum ShmLink {}

/// How long a futex wait sleeps before looking at the mesh's state again.
#[cfg(target_os = "linux")]
pub(super) const WAIT_SLICE: Duration = Duration::from_millis(100);

impl ShmLink {
    /// Whether this link carries the frame (data that fits a slot), rather than the socket.
    #[cfg(target_os = "linux")]
    pub fn carries(&self, tag: Tag, len: usize) -> bool {
        tag.kind == FrameKind::Data && len <= self.send.capacity()
    }
}

impl MeshState {
    /// Wakes this process's waiters on the shared-memory channels with `peer`: a frame from it
    /// arrived on the socket, or something happened that they must look at.
    pub(super) fn ring_doorbell(&self, peer: usize) {
        #[cfg(target_os = "linux")]
        if let Some(link) = &self.shm[peer] {
            for word in [link.recv.produced(), link.send.consumed()] {
                word.fetch_add(1, Ordering::Release);
                futex_wake(word);
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = peer;
    }

    pub(super) fn ring_all_doorbells(&self) {
        for p in 0..self.world {
            self.ring_doorbell(p);
        }
    }

    /// Puts a frame in a free slot of `link`, waiting for the peer to free one.
    #[cfg(target_os = "linux")]
    pub(super) fn send_shm(
        &self,
        peer: usize,
        link: &ShmLink,
        tag: Tag,
        payload: &[u8],
    ) -> Result<()> {
        let ch = &link.send;
        let deadline = Instant::now() + self.options.timeout;
        loop {
            // Read before trying, so that a slot freed after the try ends the wait.
            let bell = ch.consumed().load(Ordering::Acquire);
            {
                let st = lock(&self.state);
                if let Some(b) = &st.broken {
                    return Err(b.error());
                }
                if ch.try_send(tag, payload) {
                    return Ok(());
                }
                if st.departed[peer] {
                    drop(st);
                    return Err(self.departed(peer, tag.seq));
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timed_out(peer, tag.seq));
            }
            futex_wait(ch.consumed(), bell, (deadline - now).min(WAIT_SLICE));
        }
    }
}
