//! Waiting on shared memory, from the mesh's side: ringing a peer's doorbells so that its
//! waiters look again, and sending a frame through its shared memory, waiting for a free slot.

use super::shm_link::ShmLink;
use super::state::MeshState;
use crate::distributed::transport::wire::Tag;
use crate::error::Result;
use crate::util::sync::lock;
use std::time::Instant;

impl MeshState {
    /// Wakes this process's waiters on the shared-memory channels with `peer`: a frame from it
    /// arrived on the socket, or something happened that they must look at.
    pub(super) fn ring_doorbell(&self, peer: usize) {
        if let Some(link) = self.peers[peer].as_ref().and_then(|p| p.shm.as_ref()) {
            link.ring();
        }
    }

    pub(super) fn ring_all_doorbells(&self) {
        for p in 0..self.world {
            self.ring_doorbell(p);
        }
    }

    /// Puts a frame in a free slot of `link`, waiting for the peer to free one.
    pub(super) fn send_shm(
        &self,
        peer: usize,
        link: &ShmLink,
        tag: Tag,
        payload: &[u8],
    ) -> Result<()> {
        let deadline = Instant::now() + self.options.timeout;
        loop {
            // Read before trying, so that a slot freed after the try ends the wait.
            let bell = link.send_bell();
            {
                let st = lock(&self.state);
                if let Some(b) = &st.broken {
                    return Err(b.error());
                }
                if link.try_send(tag, payload) {
                    return Ok(());
                }
                if st.departed[peer] {
                    drop(st);
                    return Err(self.departed(peer, tag));
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timed_out(peer, tag));
            }
            link.wait_send(bell, deadline - now);
        }
    }
}
