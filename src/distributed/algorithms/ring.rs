//! Ring algorithms: all-reduce as reduce-scatter then all-gather, and each half alone.
//!
//! The buffer is cut into one chunk per rank. At every step each rank sends one chunk to its
//! successor and receives one from its predecessor; the chunk received at a step is the one sent
//! at the next, so each rank sends and receives `2 (n - 1) / n` of the buffer in an all-reduce,
//! the bandwidth optimum.
//!
//! Chunks travel in segments, scheduled segment by segment rather than step by step: segment
//! `k` goes through all its steps (receive, reduce, forward) while the first-step sends of the
//! next [`WINDOW`] segments are already on the wire. Every link then carries data in both
//! directions all the time, instead of each rank first sending a whole chunk and only then
//! starting to reduce. Frames are tagged with their step and segment, so a link may interleave
//! steps.

use super::{bounds, data, expect_len, segments, Links};
use crate::distributed::transport::host_buf::{HostBuf, HostSlice};
use crate::distributed::ReduceOp;
use crate::error::Result;
use std::ops::Range;

/// Reduces `input` (the bytes of this rank's elements) across all ranks with `op` into `out`, a
/// buffer of the same length: every element of `out` is written once. `Avg` averages: each
/// chunk is divided by the world size where its reduction completes, before it travels on (no
/// pass of its own over the buffer).
pub(crate) fn all_reduce(
    links: &impl Links,
    seq: u64,
    out: &mut HostBuf,
    input: &[u8],
    op: ReduceOp,
) -> Result<()> {
    let b = bounds(out.len(), links.world());
    Ring::all_reduce(links, op).run(links, seq, &mut out.view(), Some(input), &b)
}

/// Reduces `buf` (this rank's elements) across all ranks with `op`, in place. `Avg` averages,
/// as in [`all_reduce`].
pub(crate) fn all_reduce_in_place(
    links: &impl Links,
    seq: u64,
    buf: &mut HostBuf,
    op: ReduceOp,
) -> Result<()> {
    all_reduce_slice(links, seq, &mut buf.view(), op)
}

/// [`all_reduce_in_place`] over borrowed elements (a CPU tensor's own storage).
pub(crate) fn all_reduce_slice(
    links: &impl Links,
    seq: u64,
    buf: &mut HostSlice<'_>,
    op: ReduceOp,
) -> Result<()> {
    let b = bounds(buf.len(), links.world());
    // A segment of this rank's own chunk is sent (in the first step, up to WINDOW segments
    // ahead) before the last step overwrites it with the result.
    Ring::all_reduce(links, op).run(links, seq, buf, None, &b)
}

/// Reduces `input` (length divisible by the world size) across ranks into `out`; afterwards
/// rank `r`'s chunk of `out`, elements `[r * len / n, (r + 1) * len / n)`, holds the reduced
/// values (the other chunks hold partial results). `Avg` leaves the sum; the caller divides.
pub(crate) fn reduce_scatter(
    links: &impl Links,
    seq: u64,
    out: &mut HostBuf,
    input: &[u8],
    op: ReduceOp,
) -> Result<()> {
    let (n, r) = (links.world(), links.rank());
    let b = bounds(out.len(), n);
    let out = &mut out.view();
    // Starting one chunk behind leaves rank r holding the fully reduced chunk r.
    let ring = Ring {
        start: (r + n - 1) % n,
        steps: n - 1,
        reduce_steps: n - 1,
        op,
        average: false,
    };
    ring.run(links, seq, out, Some(input), &b)
}

/// Fills `buf` (n equal chunks, this rank's chunk already in place) with every rank's chunk.
pub(crate) fn all_gather(links: &impl Links, seq: u64, buf: &mut HostBuf) -> Result<()> {
    let n = links.world();
    let b = bounds(buf.len(), n);
    let ring = Ring {
        start: links.rank(),
        steps: n - 1,
        reduce_steps: 0,
        op: ReduceOp::Sum,
        average: false,
    };
    ring.run(links, seq, &mut buf.view(), None, &b)
}

/// First-step segments a rank sends ahead of the segment it is reducing.
pub(crate) const WINDOW: usize = 4;

/// `steps` ring steps over chunks delimited by bounds. Step 0 sends chunk `start`; step `s`
/// receives chunk `start - s - 1` from the predecessor, combines it with `op` and this rank's
/// own values for the first `reduce_steps` steps (copies it afterwards), and forwards the result
/// at the next step. With `average`, the last reducing step divides its chunk by the world size.
struct Ring {
    start: usize,
    steps: usize,
    reduce_steps: usize,
    op: ReduceOp,
    average: bool,
}

impl Ring {
    /// The all-reduce ring: a reduce-scatter (`n - 1` reducing steps) then an all-gather
    /// (`n - 1` copying steps), starting from this rank's own chunk.
    fn all_reduce(links: &impl Links, op: ReduceOp) -> Self {
        let n = links.world();
        Self {
            start: links.rank(),
            steps: 2 * (n - 1),
            reduce_steps: n - 1,
            op,
            average: op == ReduceOp::Avg,
        }
    }

    /// Runs the ring over `out`. This rank's own values are `input` when given (and `out` is
    /// written from them as it goes), else they are in `out` already.
    fn run(
        &self,
        links: &impl Links,
        seq: u64,
        out: &mut HostSlice<'_>,
        input: Option<&[u8]>,
        b: &[usize],
    ) -> Result<()> {
        let n = links.world();
        let es = out.elem_size();
        if n == 1 || self.steps == 0 {
            if let Some(input) = input {
                out.bytes_mut(0..out.len()).copy_from_slice(input);
            }
            return Ok(());
        }
        let r = links.rank();
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let segs: Vec<Vec<Range<usize>>> = (0..n)
            .map(|c| segments(b[c]..b[c + 1], es).collect())
            .collect();
        let most = segs.iter().map(Vec::len).max().unwrap_or(0);
        // The chunk received at step `s` (and forwarded at step `s + 1`).
        let chunk_at = |s: usize| (self.start + n * self.steps - s - 1) % n;
        let tag = |s: usize, k: usize| data(seq, ((s as u64) << 32) | k as u64);
        let send_first = |out: &HostSlice<'_>, k: usize| -> Result<()> {
            let Some(seg) = segs[self.start].get(k) else {
                return Ok(());
            };
            match input {
                Some(input) => links.send(next, tag(0, k), &input[seg.start * es..seg.end * es]),
                None => links.send(next, tag(0, k), out.bytes(seg.clone())),
            }
        };
        for k in 0..WINDOW.min(most) {
            send_first(out, k)?;
        }
        for k in 0..most {
            for s in 0..self.steps {
                let Some(seg) = segs[chunk_at(s)].get(k).cloned() else {
                    continue;
                };
                links.recv_with(prev, tag(s, k), |bytes| {
                    expect_len(bytes, seg.len() * es, prev)?;
                    if s < self.reduce_steps {
                        match input {
                            Some(input) => {
                                let mine = &input[seg.start * es..seg.end * es];
                                out.reduce_pair(seg.clone(), mine, bytes, self.op);
                            }
                            None => out.reduce_from(seg.clone(), bytes, self.op),
                        }
                        if self.average && s + 1 == self.reduce_steps {
                            // The chunk is complete here: the average travels on.
                            out.divide_range(seg.clone(), n);
                        }
                    } else {
                        out.bytes_mut(seg.clone()).copy_from_slice(bytes);
                    }
                    Ok::<(), crate::Error>(())
                })??;
                if s + 1 < self.steps {
                    links.send(next, tag(s + 1, k), out.bytes(seg))?;
                }
            }
            send_first(out, k + WINDOW)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::algorithms::testing::run as run_ranks;
    use crate::distributed::algorithms::SEGMENT_BYTES;

    fn values(rank: usize, len: usize) -> Vec<f64> {
        (0..len).map(|i| (rank * 1000 + i) as f64 * 0.5).collect()
    }

    /// What a sum over `world` ranks of [`values`] gives.
    fn summed(world: usize, len: usize) -> HostBuf {
        let inputs: Vec<Vec<f64>> = (0..world).map(|r| values(r, len)).collect();
        HostBuf::F64(
            (0..len)
                .map(|i| inputs.iter().map(|v| v[i]).sum())
                .collect(),
        )
    }

    #[test]
    fn all_reduce_sums_for_every_world_size_and_odd_lengths() {
        // Lengths below the world size, odd, and spanning several segments.
        let long = 2 * SEGMENT_BYTES / 8 + 7;
        for world in 1..=5 {
            for len in [0, 1, 3, 17, long] {
                let results = run_ranks(world, |l| {
                    let input = HostBuf::F64(values(l.rank(), len));
                    let mut out = HostBuf::zeros(candle_core::DType::F64, len);
                    all_reduce(l, 1, &mut out, input.bytes(0..len), ReduceOp::Sum).unwrap();
                    out
                });
                let want = summed(world, len);
                for got in results {
                    assert_eq!(got, want, "world {world} len {len}");
                }
            }
        }
    }

    #[test]
    fn all_reduce_in_place_sums_for_every_world_size_and_odd_lengths() {
        let long = 2 * SEGMENT_BYTES / 8 * WINDOW + 7;
        for world in 1..=4 {
            for len in [0, 1, 5, long] {
                let results = run_ranks(world, |l| {
                    let mut buf = HostBuf::F64(values(l.rank(), len));
                    all_reduce_in_place(l, 1, &mut buf, ReduceOp::Sum).unwrap();
                    buf
                });
                let want = summed(world, len);
                for got in results {
                    assert_eq!(got, want, "world {world} len {len}");
                }
            }
        }
    }

    #[test]
    fn an_average_divides_every_element_once_out_of_place_and_in_place() {
        let long = 2 * SEGMENT_BYTES / 8 * WINDOW + 7;
        for world in 1..=5 {
            for len in [0, 1, 3, 17, long] {
                let results = run_ranks(world, |l| {
                    let input = HostBuf::F64(values(l.rank(), len));
                    let mut out = HostBuf::zeros(candle_core::DType::F64, len);
                    all_reduce(l, 1, &mut out, input.bytes(0..len), ReduceOp::Avg).unwrap();
                    let mut buf = input.clone();
                    all_reduce_in_place(l, 2, &mut buf, ReduceOp::Avg).unwrap();
                    (out, buf)
                });
                let mut want = summed(world, len);
                want.divide(world);
                for (out, buf) in results {
                    assert_eq!(out, want, "world {world} len {len}");
                    assert_eq!(buf, want, "in place, world {world} len {len}");
                }
            }
        }
    }

    #[test]
    fn reduce_scatter_gives_rank_r_the_reduced_chunk_r() {
        for world in 1..=4 {
            let len = world * 5;
            let results = run_ranks(world, |l| {
                let input = HostBuf::F64(values(l.rank(), len));
                let mut out = HostBuf::zeros(candle_core::DType::F64, len);
                reduce_scatter(l, 3, &mut out, input.bytes(0..len), ReduceOp::Max).unwrap();
                let r = l.rank();
                out.slice(r * 5..r * 5 + 5)
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
