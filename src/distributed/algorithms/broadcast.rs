//! Broadcast along a pipelined chain: the root sends to its successor, every other rank
//! forwards each segment to its own successor as soon as it arrives, and the chain ends at the
//! root's predecessor. Every link carries the buffer once, and segments overlap in flight.

use super::{data, expect_len, segments, Links};
use crate::distributed::transport::host_buf::HostBuf;
use crate::error::Result;

/// Overwrites `buf` on every rank with the root's.
pub(crate) fn broadcast(
    links: &impl Links,
    seq: u64,
    buf: &mut HostBuf,
    root: usize,
) -> Result<()> {
    let n = links.world();
    if n == 1 {
        return Ok(());
    }
    let r = links.rank();
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let es = buf.elem_size();
    for (k, seg) in segments(0..buf.len(), es).enumerate() {
        let tag = data(seq, k as u64);
        if r != root {
            links.recv_with(prev, tag, |bytes| {
                expect_len(bytes, seg.len() * es, prev)?;
                buf.bytes_mut(seg.clone()).copy_from_slice(bytes);
                Ok::<(), crate::Error>(())
            })??;
        }
        if next != root {
            links.send(next, tag, buf.bytes(seg))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::algorithms::testing::run;
    use crate::distributed::algorithms::SEGMENT_BYTES;

    #[test]
    fn every_rank_gets_the_roots_buffer_from_any_root() {
        let len = SEGMENT_BYTES / 4 * 3 + 5;
        for world in 1..=4 {
            for root in 0..world {
                let results = run(world, |l| {
                    let mut buf = HostBuf::F32(vec![l.rank() as f32; len]);
                    broadcast(l, 2, &mut buf, root).unwrap();
                    buf
                });
                for got in results {
                    assert_eq!(got, HostBuf::F32(vec![root as f32; len]), "world {world}");
                }
            }
        }
    }
}
