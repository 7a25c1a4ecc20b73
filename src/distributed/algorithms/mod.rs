//! Collective algorithms over point-to-point links, one per file (as in gloo).
//!
//! An algorithm sees only [`Links`] (the transport's face): send bytes to a rank, receive the
//! next frame from a rank. A new transport implements `Links` and gets every algorithm; a new
//! algorithm touches no transport. Payloads are cut into segments of [`SEGMENT_BYTES`] so large tensors stream
//! through the ring: a segment is forwarded while the next one is still on the wire.

pub(crate) mod broadcast;
pub(crate) mod consensus;
pub(crate) mod exchange;
pub(crate) mod hierarchical;
pub(crate) mod ring;

pub(crate) use crate::distributed::transport::links::Links;
pub(crate) use crate::distributed::transport::wire::data;
use crate::error::Result;
use std::ops::Range;

/// Segment size of pipelined transfers.
pub(crate) const SEGMENT_BYTES: usize = 512 << 10;

/// Splits `len` elements into `parts` contiguous ranges of near-equal size (the first ones one
/// larger), as boundaries `[0, .., len]`.
pub(crate) fn bounds(len: usize, parts: usize) -> Vec<usize> {
    let (base, extra) = (len / parts, len % parts);
    let mut b = Vec::with_capacity(parts + 1);
    b.push(0);
    for p in 0..parts {
        b.push(b[p] + base + usize::from(p < extra));
    }
    b
}

/// Cuts `range` into segments of at most `SEGMENT_BYTES` for elements of `elem_size` bytes.
pub(crate) fn segments(
    range: Range<usize>,
    elem_size: usize,
) -> impl Iterator<Item = Range<usize>> {
    let step = (SEGMENT_BYTES / elem_size).max(1);
    range
        .clone()
        .step_by(step)
        .map(move |start| start..(start + step).min(range.end))
}

/// Checks that a received payload has the size the algorithm expects.
pub(crate) fn expect_len(got: &[u8], want: usize, peer: usize) -> Result<()> {
    if got.len() != want {
        return Err(crate::Error::Mismatch {
            detail: format!(
                "rank {peer} sent {} bytes where {want} were expected; the ranks disagree on \
                 the tensor's size",
                got.len()
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod testing {
    //! In-memory links between thread-ranks, to test algorithms without sockets.

    use super::*;
    use crate::distributed::transport::wire::Tag;
    use std::collections::VecDeque;
    use std::sync::{Arc, Condvar, Mutex};

    type Queue = (Mutex<VecDeque<(Tag, Vec<u8>)>>, Condvar);

    pub struct MemLinks {
        rank: usize,
        world: usize,
        /// queues[to][from]
        queues: Arc<Vec<Vec<Queue>>>,
    }

    pub fn mem_links(world: usize) -> Vec<MemLinks> {
        let queues: Arc<Vec<Vec<Queue>>> = Arc::new(
            (0..world)
                .map(|_| (0..world).map(|_| Queue::default()).collect())
                .collect(),
        );
        (0..world)
            .map(|rank| MemLinks {
                rank,
                world,
                queues: queues.clone(),
            })
            .collect()
    }

    impl Links for MemLinks {
        fn rank(&self) -> usize {
            self.rank
        }
        fn world(&self) -> usize {
            self.world
        }
        fn send(&self, peer: usize, tag: Tag, payload: &[u8]) -> Result<()> {
            let (q, cv) = &self.queues[peer][self.rank];
            q.lock().unwrap().push_back((tag, payload.to_vec()));
            cv.notify_all();
            Ok(())
        }
        fn recv_with<R>(&self, peer: usize, tag: Tag, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
            let (q, cv) = &self.queues[self.rank][peer];
            let mut q = q.lock().unwrap();
            loop {
                if let Some(i) = q.iter().position(|(t, _)| *t == tag) {
                    let payload = q.remove(i).expect("found").1;
                    return Ok(f(&payload));
                }
                q = cv.wait(q).unwrap();
            }
        }
    }

    /// Runs `f` on `world` thread-ranks connected by in-memory links.
    pub fn run<T: Send>(world: usize, f: impl Fn(&MemLinks) -> T + Sync) -> Vec<T> {
        let links = mem_links(world);
        std::thread::scope(|s| {
            let hs: Vec<_> = links.iter().map(|l| s.spawn(|| f(l))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_cover_the_range_in_near_equal_parts() {
        assert_eq!(bounds(10, 3), [0, 4, 7, 10]);
        assert_eq!(bounds(2, 4), [0, 1, 2, 2, 2]);
        assert_eq!(bounds(0, 2), [0, 0, 0]);
    }

    #[test]
    fn segments_respect_the_byte_limit() {
        let per = SEGMENT_BYTES / 4;
        let segs: Vec<_> = segments(10..10 + 2 * per + 3, 4).collect();
        assert_eq!(
            segs,
            [
                10..10 + per,
                10 + per..10 + 2 * per,
                10 + 2 * per..13 + 2 * per
            ]
        );
        assert_eq!(segments(5..5, 4).count(), 0);
    }
}
