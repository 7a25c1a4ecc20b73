//! Moving one frame: sending it to a peer, and waiting for one from a peer, through whichever
//! of the peer's channels carries it (shared memory for data that fits its slots, else the
//! socket), with the checks that turn a stuck or confused wait into an error.

use super::broken::Broken;
use super::shm_link::ShmLink;
use super::state::MeshState;
use crate::distributed::transport::wire::Tag;
use crate::error::Result;
use crate::util::sync::lock;
use std::time::Instant;

impl MeshState {
    /// Sends a frame to `peer`: through shared memory when the link carries it, else on the
    /// socket.
    pub(super) fn send(&self, peer: usize, tag: Tag, payload: &[u8]) -> Result<()> {
        if let Some(link) = self.shm(peer) {
            if link.carries(tag, payload.len()) {
                return self.send_shm(peer, link, tag, payload);
            }
        }
        self.send_socket(peer, tag, payload)
    }

    /// Waits for the frame `tag` from `peer`, on its socket or in its shared-memory channel,
    /// and runs `f` on its bytes where they lie.
    pub(super) fn recv_with<R>(
        &self,
        peer: usize,
        tag: Tag,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R> {
        let deadline = Instant::now() + self.options.timeout;
        let shm = self.shm(peer);
        loop {
            // Read before looking, so that a frame arriving after the look ends the wait.
            let bell = shm.map(ShmLink::recv_bell);
            let mut st = lock(&self.state);
            if let Some(b) = &st.broken {
                return Err(b.error());
            }
            if let Some(payload) = Self::take_from_inbox(&mut st, peer, tag) {
                drop(st);
                let out = f(&payload);
                self.recycle(payload);
                return Ok(out);
            }
            if let Some(link) = shm {
                if let Some(i) = link.find(tag) {
                    drop(st);
                    return Ok(link.read(i, f));
                }
            }
            // Frames of one link arrive in collective order: one from an earlier collective
            // was never consumed, so the ranks disagree on what they are doing. (Point-to-point
            // messages and all-to-all payloads are numbered apart and wait their turn.)
            let ordered = tag.kind.in_collective_order();
            let stale = st.inbox[peer]
                .iter()
                .find(|fr| ordered && fr.tag.kind.in_collective_order() && fr.tag.seq < tag.seq)
                .map(|fr| fr.tag);
            let stale =
                stale.or_else(|| shm.filter(|_| ordered).and_then(|link| link.stale(tag.seq)));
            if let Some(stale) = stale {
                drop(st);
                return Err(self.fail(Broken {
                    lost: None,
                    detail: format!(
                        "protocol error: rank {} waits for {tag:?} from rank {peer} but has an \
                         unconsumed {stale:?}",
                        self.rank
                    ),
                }));
            }
            if st.departed[peer] {
                drop(st);
                return Err(self.departed(peer, tag));
            }
            let now = Instant::now();
            if now >= deadline {
                drop(st);
                return Err(self.timed_out(peer, tag));
            }
            if let (Some(link), Some(bell)) = (shm, bell) {
                drop(st);
                link.wait_recv(bell, deadline - now);
                continue;
            }
            drop(
                self.changed
                    .wait_timeout(st, deadline - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0,
            );
        }
    }
}
