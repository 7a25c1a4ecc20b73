//! Ring algorithms: all-reduce as reduce-scatter then all-gather, and each half alone.
//!
//! The buffer is cut into one chunk per rank. At every step each rank sends one chunk to its
//! successor and receives one from its predecessor; the chunk received at a step is the one sent
//! at the next, so each rank sends and receives `2 (n - 1) / n` of the buffer in an all-reduce,
//! the bandwidth optimum. Chunks travel in segments, and a segment is forwarded as soon as it
//! has been reduced, which pipelines the steps.

use super::{bounds, expect_len, segments, Links};
use crate::dist::element::HostBuf;
use crate::dist::wire::FrameKind;
use crate::dist::ReduceOp;
use crate::error::Result;

/// Sums (or reduces with `op`) `buf` across all ranks, in place. `Avg` leaves the sum; the
/// caller divides.
pub(crate) fn all_reduce(
    links: &impl Links,
    seq: u64,
    buf: &mut HostBuf,
    op: ReduceOp,
) -> Result<()> {
    let n = links.world();
    let b = bounds(buf.len(), n);
    run(links, seq, buf, &b, links.rank(), 2 * (n - 1), n - 1, op)
}

/// Reduces `buf` (length divisible by the world size) across ranks and returns this rank's
/// chunk: rank `r` gets elements `[r * len / n, (r + 1) * len / n)` of the reduced buffer.
pub(crate) fn reduce_scatter(
    links: &impl Links,
    seq: u64,
    buf: &mut HostBuf,
    op: ReduceOp,
) -> Result<HostBuf> {
    let (n, r) = (links.world(), links.rank());
    let b = bounds(buf.len(), n);
    // Starting one chunk behind leaves rank r holding the fully reduced chunk r.
    run(links, seq, buf, &b, (r + n - 1) % n, n - 1, n - 1, op)?;
    Ok(buf.slice(b[r]..b[r + 1]))
}

/// Fills `buf` (n equal chunks, this rank's chunk already in place) with every rank's chunk.
pub(crate) fn all_gather(links: &impl Links, seq: u64, buf: &mut HostBuf) -> Result<()> {
    let n = links.world();
    let b = bounds(buf.len(), n);
    run(links, seq, buf, &b, links.rank(), n - 1, 0, ReduceOp::Sum)
}

/// `steps` ring steps over the chunks of `buf` delimited by `b`. Step 0 sends chunk `start`;
/// step `s` receives chunk `start - s - 1` from the predecessor, reduces it into `buf` with
/// `op` for the first `reduce_steps` steps (copies it afterwards) and forwards it at the next
/// step.
#[allow(clippy::too_many_arguments)]
fn run(
    links: &impl Links,
    seq: u64,
    buf: &mut HostBuf,
    b: &[usize],
    start: usize,
    steps: usize,
    reduce_steps: usize,
    op: ReduceOp,
) -> Result<()> {
    let n = links.world();
    if n == 1 || steps == 0 {
        return Ok(());
    }
    let r = links.rank();
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let es = buf.elem_size();
    let chunk = |c: usize| b[c]..b[c + 1];
    for seg in segments(chunk(start), es) {
        links.send(next, FrameKind::Data, seq, buf.bytes(seg))?;
    }
    for s in 0..steps {
        let c = (start + n * steps - s - 1) % n;
        for seg in segments(chunk(c), es) {
            let data = links.recv(prev, FrameKind::Data, seq)?;
            expect_len(&data, seg.len() * es, prev)?;
            if s < reduce_steps {
                buf.reduce_from(seg.clone(), &data, op);
            } else {
                buf.bytes_mut(seg.clone()).copy_from_slice(&data);
            }
            links.recycle(data);
            if s + 1 < steps {
                links.send(next, FrameKind::Data, seq, buf.bytes(seg))?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::algorithms::testing::run as run_ranks;
    use crate::dist::algorithms::SEGMENT_BYTES;

    fn values(rank: usize, len: usize) -> Vec<f64> {
        (0..len).map(|i| (rank * 1000 + i) as f64 * 0.5).collect()
    }

    #[test]
    fn all_reduce_sums_for_every_world_size_and_odd_lengths() {
        // Lengths below the world size, odd, and spanning several segments.
        let long = 2 * SEGMENT_BYTES / 8 + 7;
        for world in 1..=5 {
            for len in [0, 1, 3, 17, long] {
                let results = run_ranks(world, |l| {
                    let mut buf = HostBuf::F64(values(l.rank(), len));
                    all_reduce(l, 1, &mut buf, ReduceOp::Sum).unwrap();
                    buf
                });
                let inputs: Vec<Vec<f64>> = (0..world).map(|r| values(r, len)).collect();
                let want: Vec<f64> = (0..len)
                    .map(|i| inputs.iter().map(|v| v[i]).sum())
                    .collect();
                for got in results {
                    assert_eq!(got, HostBuf::F64(want.clone()), "world {world} len {len}");
                }
            }
        }
    }

    #[test]
    fn reduce_scatter_gives_rank_r_the_reduced_chunk_r() {
        for world in 1..=4 {
            let len = world * 5;
            let results = run_ranks(world, |l| {
                let mut buf = HostBuf::F64(values(l.rank(), len));
                reduce_scatter(l, 3, &mut buf, ReduceOp::Max).unwrap()
            });
            for (r, got) in results.into_iter().enumerate() {
                let want = values(world - 1, len)[r * 5..r * 5 + 5].to_vec();
                assert_eq!(got, HostBuf::F64(want), "world {world} rank {r}");
            }
        }
    }

    #[test]
    fn all_gather_collects_every_chunk_in_rank_order() {
        let results = run_ranks(3, |l| {
            let mut buf = HostBuf::zeros(candle_core::DType::F64, 6);
            let mine = [l.rank() as f64, l.rank() as f64 + 0.5];
            if let HostBuf::F64(v) = &mut buf {
                v[2 * l.rank()..2 * l.rank() + 2].copy_from_slice(&mine);
            }
            all_gather(l, 9, &mut buf).unwrap();
            buf
        });
        for got in results {
            assert_eq!(got, HostBuf::F64(vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]));
        }
    }
}
