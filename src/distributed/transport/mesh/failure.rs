//! The failure protocol: how a mesh breaks (why is [`Broken`]): once, for the first reason,
//! telling every peer (an `Abort` frame) and whoever connected the mesh (its `OnLost`), and
//! waking every waiter. Once broken, a mesh stays broken: every later operation fails with the
//! first reason.

use super::broken::Broken;
use super::state::MeshState;
use crate::distributed::transport::wire::{encode_header, FrameKind, Tag};
use crate::error::Error;
use crate::util::sync::lock;
use std::io::Write;

/// How often, and how far apart, the `Abort` frame is tried on a healthy peer's busy writer
/// (100 ms in all).
const ABORT_TRIES: usize = 50;
const ABORT_RETRY: std::time::Duration = std::time::Duration::from_millis(2);

impl MeshState {
    /// Breaks the mesh for `reason` (unless already broken), tells every peer, and returns the
    /// error that now describes the mesh.
    pub(super) fn fail(&self, reason: Broken) -> Error {
        let (first, fresh) = {
            let mut st = lock(&self.state);
            let fresh = st.broken.is_none();
            // Told before the mesh is marked broken, under the same lock: a rank whose
            // collective sees the mark (waking, or looking on its own) and exits at once has
            // its loss noted for the launcher first.
            if fresh && !st.leaving {
                (self.on_lost)(reason.lost, &reason.detail);
            }
            (st.broken.get_or_insert(reason).clone(), fresh)
        };
        self.changed.notify_all();
        self.ring_all_doorbells();
        if fresh {
            let payload = first.encode();
            let header = encode_header(Tag::control(FrameKind::Abort), payload.len());
            for (peer, p) in self.peers.iter().enumerate() {
                let Some(p) = p else { continue };
                // Best effort; the lost peer's writer (which a send stuck on it may hold) is
                // tried once. Another peer's may be busy with a frame for a moment: it is
                // tried for a while, so that the peer learns which rank was lost rather than
                // seeing this rank leave and naming it instead.
                let tries = if first.lost == Some(peer) {
                    1
                } else {
                    ABORT_TRIES
                };
                for _ in 0..tries {
                    if let Ok(mut s) = p.writer.stream.try_lock() {
                        let _ = s.write_all(&header).and_then(|()| s.write_all(&payload));
                        break;
                    }
                    std::thread::sleep(ABORT_RETRY);
                }
            }
        }
        first.error()
    }

    /// `peer` said goodbye while this rank still waits for its frame `tag`.
    pub(super) fn departed(&self, peer: usize, tag: Tag) -> Error {
        let detail = if tag.kind == FrameKind::P2p {
            format!(
                "it shut down its process group without sending message #{} to rank {}: every \
                 receive needs a send from its peer",
                tag.seq, self.rank
            )
        } else {
            format!(
                "it shut down its process group before finishing collective #{}: the ranks \
                 ran different numbers of collectives (steps). Give every rank the same number \
                 of batches (DistributedSampler does), or wrap the loop in DDP's join() for \
                 uneven inputs",
                tag.seq
            )
        };
        self.fail(Broken {
            lost: Some(peer),
            detail,
        })
    }

    /// A wait for `peer`'s frame `tag` ran out: the mesh breaks, and every peer learns why.
    pub(super) fn timed_out(&self, peer: usize, tag: Tag) -> Error {
        let waited = self.options.timeout;
        let what = if tag.kind == FrameKind::P2p {
            format!("waiting for message #{} from rank {peer}", tag.seq)
        } else {
            format!("waiting for rank {peer} in collective #{}", tag.seq)
        };
        self.fail(Broken {
            lost: None,
            detail: format!("rank {} timed out after {waited:?} {what}", self.rank),
        });
        Error::Timeout { what, waited }
    }
}
