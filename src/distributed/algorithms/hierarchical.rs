//! Hierarchical all-reduce: reduce inside each machine, all-reduce between machines, gather
//! inside each machine (NCCL's and Horovod's two-level scheme).
//!
//! With `L` ranks on each of `N` machines, a flat ring crosses between machines on `N` of its
//! links, and each of those carries `2 (NL - 1) / NL` of the buffer each way. Here:
//!
//! 1. the `L` ranks of each machine reduce-scatter the buffer among themselves (shared memory
//!    or Unix sockets), so local rank `i` holds the machine's sum of chunk `i`;
//! 2. the `N` ranks with local index `i`, one per machine, all-reduce chunk `i` in a ring of
//!    their own: `L` rings side by side, striped across the local ranks, each over the network;
//! 3. the ranks of each machine all-gather the chunks.
//!
//! A machine then sends `2 (N - 1) / N` of the buffer across the network, spread over its `L`
//! ranks: for 2 machines of 2 ranks, 1 buffer each way instead of 1.5 on the flat ring's
//! crossing links, and `2 (L - 1) + 2 (N - 1)` steps instead of `2 (NL - 1)`.
//!
//! Each phase runs the ring algorithms over a [`SubLinks`], which shows them a subset of the
//! group's ranks as a group of its own, and marks its frames with the phase, so frames of two
//! phases between the same two ranks never match each other's receives.

use super::{bounds, ring, Links};
use crate::distributed::transport::host_buf::HostBuf;
use crate::distributed::transport::wire::Tag;
use crate::distributed::ReduceOp;
use crate::error::{Error, Result};

/// Where the ranks of a group are: which machine each is on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Topology {
    /// The ranks of each machine, machines in the order of their lowest rank, ranks ascending.
    pub machines: Vec<Vec<usize>>,
}

impl Topology {
    /// Groups ranks by `hosts[rank]`, an identity of each rank's machine.
    pub fn from_hosts<T: PartialEq>(hosts: &[T]) -> Self {
        let mut machines: Vec<(usize, Vec<usize>)> = Vec::new();
        for (rank, host) in hosts.iter().enumerate() {
            match machines
                .iter_mut()
                .find(|(first, _)| hosts[*first] == *host)
            {
                Some((_, ranks)) => ranks.push(rank),
                None => machines.push((rank, vec![rank])),
            }
        }
        Self {
            machines: machines.into_iter().map(|(_, ranks)| ranks).collect(),
        }
    }

    /// The number of ranks on every machine, when all hold the same number.
    pub fn uniform(&self) -> Option<usize> {
        let per = self.machines.first()?.len();
        self.machines.iter().all(|m| m.len() == per).then_some(per)
    }

    /// Whether the hierarchical all-reduce applies and pays: at least 2 machines, each with the
    /// same number of ranks, at least 2.
    pub fn favours_hierarchy(&self) -> bool {
        self.machines.len() >= 2 && self.uniform().is_some_and(|per| per >= 2)
    }

    /// How the ranks sit, for messages: "2 machines: ranks [0, 1], [2, 3]".
    pub fn describe(&self) -> String {
        let list: Vec<String> = self.machines.iter().map(|m| format!("{m:?}")).collect();
        format!(
            "{} machine(s): ranks {}",
            self.machines.len(),
            list.join(", ")
        )
    }

    /// `rank`'s machine and its index among that machine's ranks.
    fn locate(&self, rank: usize) -> Option<(usize, usize)> {
        self.machines
            .iter()
            .enumerate()
            .find_map(|(m, ranks)| ranks.iter().position(|&r| r == rank).map(|i| (m, i)))
    }
}

/// Some ranks of a group seen as a group of their own: rank `i` of the view is
/// `members[i]` of the group. Frames carry `phase` in the top bits of their part, which the
/// ring algorithms leave clear.
pub(crate) struct SubLinks<'a, L> {
    links: &'a L,
    members: Vec<usize>,
    rank: usize,
    phase: u64,
}

/// The bits of a frame's part that [`SubLinks`] claims for its phase.
const PHASE_SHIFT: u32 = 60;

impl<'a, L: Links> SubLinks<'a, L> {
    /// The view of `members` (which must include this rank) for phase `phase` (below 16).
    pub fn new(links: &'a L, members: Vec<usize>, phase: u64) -> Result<Self> {
        debug_assert!(phase < 16);
        let rank = members
            .iter()
            .position(|&r| r == links.rank())
            .ok_or_else(|| Error::Config {
                what: "hierarchical all-reduce".into(),
                detail: format!(
                    "rank {} is not among the ranks {members:?} of its own phase",
                    links.rank()
                ),
            })?;
        Ok(Self {
            links,
            members,
            rank,
            phase,
        })
    }

    fn tag(&self, tag: Tag) -> Tag {
        debug_assert!(
            tag.part >> PHASE_SHIFT == 0,
            "a ring part uses the phase bits"
        );
        Tag {
            part: tag.part | (self.phase << PHASE_SHIFT),
            ..tag
        }
    }
}

impl<L: Links> Links for SubLinks<'_, L> {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.members.len()
    }
    fn send(&self, peer: usize, tag: Tag, payload: &[u8]) -> Result<()> {
        self.links.send(self.members[peer], self.tag(tag), payload)
    }
    fn recv_with<R>(&self, peer: usize, tag: Tag, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        self.links.recv_with(self.members[peer], self.tag(tag), f)
    }
}

/// Reduces `input` (this rank's elements) across the group with `op` into `out` (of the same
/// length) in three phases, as the module describes; `topology` must be the group's and
/// [`Topology::uniform`]. `Avg` leaves the sum; the caller divides.
pub(crate) fn all_reduce(
    links: &impl Links,
    topology: &Topology,
    seq: u64,
    out: &mut HostBuf,
    input: &[u8],
    op: ReduceOp,
) -> Result<()> {
    let (machine, local) = topology.locate(links.rank()).ok_or_else(|| Error::Config {
        what: "hierarchical all-reduce".into(),
        detail: format!(
            "rank {} is on no machine of {}",
            links.rank(),
            topology.describe()
        ),
    })?;
    let per = topology.uniform().ok_or_else(|| Error::Config {
        what: "hierarchical all-reduce".into(),
        detail: format!(
            "it needs the same number of ranks on every machine; this group has {}",
            topology.describe()
        ),
    })?;
    let here = SubLinks::new(links, topology.machines[machine].clone(), 1)?;
    ring::reduce_scatter(&here, seq, out, input, op)?;

    let b = bounds(out.len(), per);
    let chunk = b[local]..b[local + 1];
    let stripe: Vec<usize> = topology.machines.iter().map(|m| m[local]).collect();
    if stripe.len() > 1 && !chunk.is_empty() {
        let across = SubLinks::new(links, stripe, 2)?;
        let mut mine = out.slice(chunk.clone());
        // The ring would average over the machines alone: the caller divides the sum.
        let sum = if op == ReduceOp::Avg {
            ReduceOp::Sum
        } else {
            op
        };
        ring::all_reduce_in_place(&across, seq, &mut mine, sum)?;
        out.bytes_mut(chunk.clone())
            .copy_from_slice(mine.bytes(0..chunk.len()));
    }

    let here = SubLinks::new(links, topology.machines[machine].clone(), 3)?;
    ring::all_gather(&here, seq, out)
}

/// As [`all_reduce`], in place in `buf`.
pub(crate) fn all_reduce_in_place(
    links: &impl Links,
    topology: &Topology,
    seq: u64,
    buf: &mut HostBuf,
    op: ReduceOp,
) -> Result<()> {
    let input = buf.bytes(0..buf.len()).to_vec();
    all_reduce(links, topology, seq, buf, &input, op)
}

#[cfg(test)]
mod tests {
    use super::super::testing::run;
    use super::*;
    use candle_core::DType;

    #[test]
    fn topology_groups_ranks_by_machine_in_order_of_their_lowest_rank() {
        let t = Topology::from_hosts(&["b", "a", "b", "a", "c", "c"]);
        assert_eq!(t.machines, vec![vec![0, 2], vec![1, 3], vec![4, 5]]);
        assert_eq!(t.uniform(), Some(2));
        assert!(t.favours_hierarchy());
        let uneven = Topology::from_hosts(&[1, 1, 2]);
        assert_eq!(uneven.uniform(), None);
        assert!(!uneven.favours_hierarchy());
        assert!(!Topology::from_hosts(&[1, 1, 1, 1]).favours_hierarchy());
        assert!(!Topology::from_hosts(&[1, 2, 3]).favours_hierarchy());
    }

    /// Element `e` of rank `r`'s input: distinct per rank and element, exact in f32 sums.
    fn value(r: usize, e: usize) -> f32 {
        ((r * 7 + e * 3) % 23) as f32 - 11.0
    }

    fn check(hosts: &[usize], len: usize, op: ReduceOp) {
        let world = hosts.len();
        let topology = Topology::from_hosts(hosts);
        let results = run(world, |links| {
            let r = links.rank();
            let input: Vec<f32> = (0..len).map(|e| value(r, e)).collect();
            let bytes: Vec<u8> = input.iter().flat_map(|x| x.to_le_bytes()).collect();
            let mut out = HostBuf::zeros(DType::F32, len);
            all_reduce(links, &topology, 5, &mut out, &bytes, op).unwrap();
            let mut again = HostBuf::zeros(DType::F32, len);
            again.bytes_mut(0..len).copy_from_slice(&bytes);
            all_reduce_in_place(links, &topology, 6, &mut again, op).unwrap();
            assert_eq!(out.bytes(0..len), again.bytes(0..len));
            out.bytes(0..len).to_vec()
        });
        let want: Vec<f32> = (0..len)
            .map(|e| {
                let vals = (0..world).map(|r| value(r, e));
                match op {
                    ReduceOp::Max => vals.fold(f32::MIN, f32::max),
                    _ => vals.sum(),
                }
            })
            .collect();
        for (r, got) in results.iter().enumerate() {
            let got: Vec<f32> = got
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            assert_eq!(got, want, "rank {r} of {hosts:?}, {len} elements, {op:?}");
        }
    }

    #[test]
    fn every_rank_gets_the_full_reduction_whatever_the_machines_and_the_length() {
        // Machines in rank order, interleaved, three of three; lengths below, at and above
        // the number of ranks per machine, and across several segments.
        for hosts in [
            vec![0, 0, 1, 1],
            vec![0, 1, 0, 1],
            vec![0, 0, 0, 1, 1, 1, 2, 2, 2],
            vec![0, 1],
            vec![0, 0, 0],
        ] {
            for len in [1, 2, 5, 1000, 300_001] {
                check(&hosts, len, ReduceOp::Sum);
            }
            check(&hosts, 77, ReduceOp::Max);
        }
    }
}
