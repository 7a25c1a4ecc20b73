//! Framed socket I/O: a frame written to a peer's connection is a header (kind, collective,
//! part, length) and its payload; the reader threads (see `watch`) put each peer's frames in
//! its inbox, where a receiver takes them by tag.

use super::broken::Broken;
use super::state::{MeshState, State};
use crate::distributed::transport::wire::{encode_header, Tag};
use crate::error::{Error, Result};
use crate::util::sync::lock;
use std::io::Write;
use std::sync::atomic::Ordering;

/// Payloads up to this size go out in one write with their header.
const COALESCE: usize = 16 << 10;

impl MeshState {
    /// Writes one frame to `peer`'s connection; a failed write loses the peer.
    pub(super) fn send_socket(&self, peer: usize, tag: Tag, payload: &[u8]) -> Result<()> {
        if let Some(b) = &lock(&self.state).broken {
            return Err(b.error());
        }
        let writer = self.peers[peer]
            .as_ref()
            .map(|p| &p.writer)
            .ok_or_else(|| Error::InvalidArgument {
                what: "peer rank",
                detail: format!("rank {peer} is this rank or outside the group"),
            })?;
        let header = encode_header(tag, payload.len());
        let result = {
            let mut s = lock(&writer.stream);
            if payload.len() <= COALESCE {
                let mut b = Vec::with_capacity(header.len() + payload.len());
                b.extend_from_slice(&header);
                b.extend_from_slice(payload);
                s.write_all(&b)
            } else {
                s.write_all(&header).and_then(|()| s.write_all(payload))
            }
        };
        writer.last_sent_ms.store(self.now_ms(), Ordering::Relaxed);
        result.map_err(|e| {
            let detail = match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
                    "it stopped reading for {:?} (hung, stopped or unreachable)",
                    self.options.peer_timeout
                ),
                _ => format!("sending to it failed ({e}): the process exited or was killed"),
            };
            self.fail(Broken {
                lost: Some(peer),
                detail,
            })
        })
    }

    /// Takes the frame `tag` from `peer`'s inbox, if it has arrived.
    pub(super) fn take_from_inbox(st: &mut State, peer: usize, tag: Tag) -> Option<Vec<u8>> {
        let i = st.inbox[peer].iter().position(|fr| fr.tag == tag)?;
        Some(st.inbox[peer].remove(i).expect("found").payload)
    }

    /// Keeps a consumed payload's buffer for the reader threads to fill again.
    pub(super) fn recycle(&self, buf: Vec<u8>) {
        let mut st = lock(&self.state);
        if st.pool.len() < 32 {
            st.pool.push(buf);
        }
    }
}
