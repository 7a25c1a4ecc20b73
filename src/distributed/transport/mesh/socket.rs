//! Framed socket I/O: a frame written to a peer's connection is a header (kind, collective,
//! part, length) and its payload; the reader threads (see `watch`) put each peer's frames in
//! its inbox, where a receiver takes them by tag.

use super::broken::Broken;
use super::state::{MeshState, State};
use crate::distributed::transport::wire::{encode_header, Tag};
use crate::error::{Error, Result};
use crate::util::sync::lock;
use std::io::{IoSlice, Write};
use std::sync::atomic::Ordering;

/// Payloads up to this size go out in one write with their header.
const COALESCE: usize = 16 << 10;

/// Writes every byte of `bufs`, in as few system calls as the socket takes: a large frame's
/// header and payload leave together (`writev`), so that no packet carries the header alone,
/// and the peer's reader is woken once for the frame, not first for its 21 header bytes.
fn write_all_vectored(w: &mut impl Write, mut bufs: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

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
                write_all_vectored(&mut *s, &mut [IoSlice::new(&header), IoSlice::new(payload)])
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that takes at most `max` bytes a call, from the first buffers given.
    struct Trickle {
        got: Vec<u8>,
        max: usize,
    }

    impl Write for Trickle {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let n = buf.len().min(self.max);
            self.got.extend_from_slice(&buf[..n]);
            Ok(n)
        }
        fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
            let mut left = self.max;
            for b in bufs {
                let n = b.len().min(left);
                self.got.extend_from_slice(&b[..n]);
                left -= n;
            }
            Ok(self.max - left)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn vectored_writes_carry_every_byte_in_order_across_short_writes() {
        let (a, b) = (b"header".to_vec(), (0..=255u8).collect::<Vec<_>>());
        for max in [1, 5, 6, 7, 100, 1000] {
            let mut w = Trickle {
                got: Vec::new(),
                max,
            };
            write_all_vectored(&mut w, &mut [IoSlice::new(&a), IoSlice::new(&b)]).unwrap();
            assert_eq!(w.got, [a.as_slice(), b.as_slice()].concat(), "max {max}");
        }
        let mut stuck = Trickle {
            got: Vec::new(),
            max: 0,
        };
        let err = write_all_vectored(&mut stuck, &mut [IoSlice::new(&a)]).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::WriteZero);
    }
}
