//! Pipeline schedules as pure action lists (torch's pipelining IR, compute actions only).
//!
//! A schedule decides the order in which each rank runs the forwards and backwards of its
//! stages' micro-batches; nothing here moves data. [`Schedule::actions`] gives one rank's list,
//! [`Schedule::timeline`] runs every rank's list on a clock where each action takes one tick
//! and an action waits for its inputs (the previous stage's forward, the next stage's
//! backward), as the runtime's blocking receives make it wait. The timeline finds a schedule
//! that would hang (every rank waiting) and gives the theoretical bubble and the chart.
//!
//! Stage `s` lives on rank `s % pp`: one stage per rank for GPipe and 1F1B, `stages_per_rank`
//! stages per rank for interleaved 1F1B (stage = local index × pp + rank, torch's layout).
//!
//! ```rust
//! use candle_parallel::pipeline::schedule::Schedule;
//! # fn main() -> candle_parallel::Result<()> {
//! // 1F1B, 2 stages, 4 micro-batches: rank 0 runs two forwards before its first backward.
//! let order: Vec<String> = Schedule::OneFOneB.actions(2, 0, 4)?.iter().map(|a| a.to_string()).collect();
//! assert_eq!(order, ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"]);
//! // GPipe's bubble is (p - 1) / (m + p - 1).
//! let bubble = Schedule::GPipe.timeline(4, 8)?.bubble();
//! assert!((bubble - 3.0 / 11.0).abs() < 1e-12);
//! # Ok(()) }
//! ```

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::fmt;

/// Which schedule runs the micro-batches (torch's `ScheduleGPipe`, `Schedule1F1B`,
/// `ScheduleInterleaved1F1B`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// Every forward, then every backward: simple, holds the activations of all `m`
    /// micro-batches.
    GPipe,
    /// One forward, one backward: stage `s` of `p` runs `p - s` forwards ahead, then
    /// alternates, so it holds at most `p - s` micro-batches' activations. Needs `m >= p`
    /// to keep the pipe full (torch requires it; fewer still runs here, it just stalls).
    OneFOneB,
    /// 1F1B over several stages per rank (Megatron's interleaving): a smaller bubble for the
    /// same micro-batches, at the price of more messages. Stage `s` lives on rank `s % pp`.
    Interleaved1F1B {
        /// How many stages each rank holds (at least 1).
        stages_per_rank: usize,
    },
}

/// A forward or a backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Computation {
    /// The stage's forward of a micro-batch.
    Forward,
    /// The stage's backward of a micro-batch (input and weight gradients together).
    Backward,
}

/// One computation of a schedule: a stage's forward or backward of one micro-batch. Displayed
/// as torch displays its actions: `"2F0"` is stage 2's forward of micro-batch 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Action {
    /// The stage (0 is the first).
    pub stage: usize,
    /// Forward or backward.
    pub computation: Computation,
    /// The micro-batch.
    pub microbatch: usize,
}

impl Action {
    fn new(stage: usize, computation: Computation, microbatch: usize) -> Self {
        Self {
            stage,
            computation,
            microbatch,
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = match self.computation {
            Computation::Forward => 'F',
            Computation::Backward => 'B',
        };
        write!(f, "{}{c}{}", self.stage, self.microbatch)
    }
}

impl Schedule {
    /// How many stages each rank holds.
    pub fn stages_per_rank(&self) -> usize {
        match self {
            Schedule::GPipe | Schedule::OneFOneB => 1,
            Schedule::Interleaved1F1B { stages_per_rank } => *stages_per_rank,
        }
    }

    /// The stages rank `rank` of `pp` holds, in order.
    pub fn stages_of(&self, pp: usize, rank: usize) -> Vec<usize> {
        (0..self.stages_per_rank()).map(|l| l * pp + rank).collect()
    }

    fn check(&self, pp: usize, rank: usize, n_microbatches: usize) -> Result<()> {
        let bad = |detail: String| {
            Err(Error::InvalidArgument {
                what: "pipeline schedule",
                detail,
            })
        };
        if pp == 0 || rank >= pp {
            return bad(format!(
                "rank {rank} of a pipeline of {pp} ranks; the rank must be below the number \
                 of ranks, which must be at least 1"
            ));
        }
        if n_microbatches == 0 {
            return bad("0 micro-batches; split the batch into at least 1".into());
        }
        if let Schedule::Interleaved1F1B { stages_per_rank } = *self {
            if stages_per_rank == 0 {
                return bad("interleaved 1F1B with 0 stages per rank; hold at least 1".into());
            }
            let rounds = (n_microbatches / pp).max(1);
            if !n_microbatches.is_multiple_of(rounds) {
                return bad(format!(
                    "interleaved 1F1B needs the number of micro-batches to be a multiple of \
                     the number of rounds ({rounds} = max(1, {n_microbatches} / {pp})), as \
                     torch's; got {n_microbatches}"
                ));
            }
        }
        Ok(())
    }

    /// The computations rank `rank` of a pipeline of `pp` ranks runs, in order, for
    /// `n_microbatches` micro-batches. Every stage of the rank runs each micro-batch's
    /// forward once and its backward once, after the forward.
    pub fn actions(&self, pp: usize, rank: usize, n_microbatches: usize) -> Result<Vec<Action>> {
        self.check(pp, rank, n_microbatches)?;
        let m = n_microbatches;
        let (f, b) = (Computation::Forward, Computation::Backward);
        Ok(match *self {
            Schedule::GPipe => (0..m)
                .map(|i| Action::new(rank, f, i))
                .chain((0..m).map(|i| Action::new(rank, b, i)))
                .collect(),
            Schedule::OneFOneB => {
                // torch's Schedule1F1B: warm up with p - s forwards, then backward/forward
                // pairs, then the remaining backwards.
                let warmup = m.min(pp - rank);
                let mut out: Vec<Action> = (0..warmup).map(|i| Action::new(rank, f, i)).collect();
                for i in 0..m {
                    out.push(Action::new(rank, b, i));
                    if warmup + i < m {
                        out.push(Action::new(rank, f, warmup + i));
                    }
                }
                out
            }
            Schedule::Interleaved1F1B { stages_per_rank } => {
                interleaved(stages_per_rank, pp, rank, m)
            }
        })
    }

    /// Every rank's actions on a clock of one tick per action, each starting as soon as its
    /// inputs are there; fails naming the stuck ranks if the schedule would hang.
    pub fn timeline(&self, pp: usize, n_microbatches: usize) -> Result<Timeline> {
        let lists = (0..pp)
            .map(|r| self.actions(pp, r, n_microbatches))
            .collect::<Result<Vec<_>>>()?;
        run(&lists, pp * self.stages_per_rank()).map_err(|stuck| Error::InvalidArgument {
            what: "pipeline schedule",
            detail: format!(
                "{self:?} over {pp} ranks and {n_microbatches} micro-batches would hang: {stuck} \
                 wait for each other"
            ),
        })
    }

    /// Checks that between every pair of ranks the messages are received in the order they
    /// are sent: the runtime matches them in order (first sent, first received), without
    /// tags, so a schedule that receives in another order would pair the wrong tensors.
    pub fn check_message_order(&self, pp: usize, n_microbatches: usize) -> Result<()> {
        let n_stages = pp * self.stages_per_rank();
        let lists = (0..pp)
            .map(|r| self.actions(pp, r, n_microbatches))
            .collect::<Result<Vec<_>>>()?;
        let position: HashMap<Action, usize> = lists
            .iter()
            .flat_map(|l| l.iter().enumerate().map(|(i, a)| (*a, i)))
            .collect();
        let mut pairs: HashMap<(usize, usize), Vec<Message>> = HashMap::new();
        for a in lists.iter().flatten() {
            if let Some(from) = message_source(a, n_stages) {
                let (src, dst) = (from.stage % pp, a.stage % pp);
                if src != dst {
                    pairs
                        .entry((src, dst))
                        .or_default()
                        .push((position[&from], position[a], *a));
                }
            }
        }
        for ((src, dst), mut messages) in pairs {
            messages.sort_by_key(|m| m.0);
            if let Some(w) = messages.windows(2).find(|w| w[0].1 > w[1].1) {
                return Err(Error::InvalidArgument {
                    what: "pipeline schedule",
                    detail: format!(
                        "{self:?} over {pp} ranks: rank {src} sends the input of {} before that \
                         of {}, but rank {dst} needs them the other way round",
                        w[0].2, w[1].2
                    ),
                });
            }
        }
        Ok(())
    }
}

/// A message between two ranks: its position in the sender's list, in the receiver's list,
/// and the action that receives it.
type Message = (usize, usize, Action);

/// The action whose result `a` receives from its neighbour stage, if any: the previous stage's
/// forward for a forward, the next stage's backward for a backward.
fn message_source(a: &Action, n_stages: usize) -> Option<Action> {
    match a.computation {
        Computation::Forward if a.stage > 0 => {
            Some(Action::new(a.stage - 1, Computation::Forward, a.microbatch))
        }
        Computation::Backward if a.stage + 1 < n_stages => Some(Action::new(
            a.stage + 1,
            Computation::Backward,
            a.microbatch,
        )),
        _ => None,
    }
}

/// What must have run before `a`: its message's source and, for a backward, its own forward.
fn inputs(a: &Action, n_stages: usize) -> Vec<Action> {
    let mut out: Vec<Action> = message_source(a, n_stages).into_iter().collect();
    if a.computation == Computation::Backward {
        out.push(Action::new(a.stage, Computation::Forward, a.microbatch));
    }
    out
}

/// Runs every rank's list on the clock of [`Schedule::timeline`]; on a hang, says which ranks
/// wait at which action.
fn run(lists: &[Vec<Action>], n_stages: usize) -> std::result::Result<Timeline, String> {
    let mut done: HashMap<Action, usize> = HashMap::new();
    let mut next = vec![0usize; lists.len()];
    let mut slots: Vec<Vec<Option<Action>>> = vec![Vec::new(); lists.len()];
    let total: usize = lists.iter().map(Vec::len).sum();
    let mut tick = 0;
    while done.len() < total {
        let mut ran = Vec::new();
        for (r, list) in lists.iter().enumerate() {
            let ready = list
                .get(next[r])
                .filter(|a| inputs(a, n_stages).iter().all(|i| done.contains_key(i)));
            slots[r].push(ready.copied());
            if let Some(a) = ready {
                ran.push(*a);
                next[r] += 1;
            }
        }
        if ran.is_empty() {
            let stuck: Vec<String> = (0..lists.len())
                .filter_map(|r| lists[r].get(next[r]).map(|a| format!("rank {r} at {a}")))
                .collect();
            return Err(stuck.join(", "));
        }
        done.extend(ran.into_iter().map(|a| (a, tick)));
        tick += 1;
    }
    Ok(Timeline { slots })
}

/// torch's `ScheduleInterleaved1F1B._calculate_single_rank_operations`, without its padding.
fn interleaved(n_local: usize, pp: usize, rank: usize, m: usize) -> Vec<Action> {
    let rounds = (m / pp).max(1);
    let per_round = m / rounds;
    let warmup = ((n_local - 1) * per_round + 2 * (pp - 1 - rank)).min(m * n_local);
    let total = n_local * m;
    let fwd_stage = |op: usize| (op / per_round) % n_local * pp + rank;
    let bwd_stage = |op: usize| (n_local - 1 - ((op - warmup) / per_round) % n_local) * pp + rank;
    let mut fwd_next: HashMap<usize, usize> = HashMap::new();
    let mut bwd_next: HashMap<usize, usize> = HashMap::new();
    let take = |counter: &mut HashMap<usize, usize>, stage: usize| {
        let c = counter.entry(stage).or_default();
        *c += 1;
        *c - 1
    };
    let mut out = Vec::with_capacity(2 * total);
    for op in 0..total {
        let s = fwd_stage(op);
        out.push(Action::new(s, Computation::Forward, take(&mut fwd_next, s)));
        if op >= warmup {
            let s = bwd_stage(op);
            out.push(Action::new(
                s,
                Computation::Backward,
                take(&mut bwd_next, s),
            ));
        }
    }
    for op in total..total + warmup {
        let s = bwd_stage(op);
        out.push(Action::new(
            s,
            Computation::Backward,
            take(&mut bwd_next, s),
        ));
    }
    out
}

/// Every rank's actions by tick, `None` where the rank waits ([`Schedule::timeline`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// `slots[rank][tick]`.
    pub slots: Vec<Vec<Option<Action>>>,
}

impl Timeline {
    /// How many ticks the whole step takes.
    pub fn ticks(&self) -> usize {
        self.slots.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// The fraction of rank-ticks spent waiting, up to the step's end.
    pub fn bubble(&self) -> f64 {
        let total = self.ticks() * self.slots.len();
        let busy: usize = self.slots.iter().flatten().filter(|a| a.is_some()).count();
        if total == 0 {
            0.0
        } else {
            1.0 - busy as f64 / total as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(actions: &[Action]) -> Vec<String> {
        actions.iter().map(Action::to_string).collect()
    }

    const ALL: [Schedule; 4] = [
        Schedule::GPipe,
        Schedule::OneFOneB,
        Schedule::Interleaved1F1B { stages_per_rank: 2 },
        Schedule::Interleaved1F1B { stages_per_rank: 3 },
    ];

    #[test]
    fn gpipe_runs_every_forward_then_every_backward() {
        let order = names(&Schedule::GPipe.actions(3, 1, 3).unwrap());
        assert_eq!(order, ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]);
    }

    #[test]
    fn one_f_one_b_warms_up_with_p_minus_s_forwards() {
        let s = Schedule::OneFOneB;
        assert_eq!(
            names(&s.actions(4, 0, 6).unwrap()),
            ["0F0", "0F1", "0F2", "0F3", "0B0", "0F4", "0B1", "0F5", "0B2", "0B3", "0B4", "0B5"]
        );
        assert_eq!(
            names(&s.actions(4, 3, 6).unwrap()),
            ["3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3", "3F4", "3B4", "3F5", "3B5"]
        );
        // Fewer micro-batches than stages: all forwards, then all backwards.
        assert_eq!(
            names(&s.actions(4, 0, 2).unwrap()),
            ["0F0", "0F1", "0B0", "0B1"]
        );
    }

    #[test]
    fn one_f_one_b_holds_at_most_p_minus_s_micro_batches() {
        for rank in 0..4 {
            let mut live: i64 = 0;
            let mut most = 0;
            for a in Schedule::OneFOneB.actions(4, rank, 8).unwrap() {
                live += if a.computation == Computation::Forward {
                    1
                } else {
                    -1
                };
                most = most.max(live);
            }
            assert_eq!(most, 4 - rank as i64, "rank {rank}");
        }
    }

    #[test]
    fn interleaved_matches_torchs_order_on_rank_0() {
        // torch 2.15's ScheduleInterleaved1F1B pipeline_order[0], Nones dropped.
        let s = Schedule::Interleaved1F1B { stages_per_rank: 2 };
        assert_eq!(
            names(&s.actions(2, 0, 4).unwrap()),
            [
                "0F0", "0F1", "2F0", "2F1", "0F2", "2B0", "0F3", "2B1", "2F2", "0B0", "2F3", "0B1",
                "2B2", "2B3", "0B2", "0B3"
            ]
        );
        assert_eq!(
            names(&s.actions(4, 0, 8).unwrap()).join(" "),
            "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 \
             4F7 0B1 0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7"
        );
    }

    #[test]
    fn every_schedule_runs_each_computation_once_and_backward_after_forward() {
        for s in ALL {
            for (pp, m) in [(1, 1), (2, 2), (2, 4), (3, 5), (4, 4), (4, 8)] {
                let Ok(timeline) = s.timeline(pp, m) else {
                    // Interleaving refuses micro-batch counts that are not a multiple of the
                    // rounds (checked below).
                    assert!(matches!(s, Schedule::Interleaved1F1B { .. }));
                    continue;
                };
                for rank in 0..pp {
                    let list = s.actions(pp, rank, m).unwrap();
                    assert_eq!(list.len(), 2 * m * s.stages_per_rank(), "{s:?} {pp} {m}");
                    let mut seen = std::collections::HashSet::new();
                    for a in &list {
                        assert!(seen.insert(*a), "{s:?}: {a} twice");
                        assert_eq!(a.stage % pp, rank);
                        if a.computation == Computation::Backward {
                            let f = Action::new(a.stage, Computation::Forward, a.microbatch);
                            assert!(seen.contains(&f), "{s:?}: {a} before its forward");
                        }
                    }
                }
                assert_eq!(timeline.slots.len(), pp);
            }
        }
    }

    #[test]
    fn interleaving_refuses_micro_batches_that_do_not_fill_the_rounds() {
        let s = Schedule::Interleaved1F1B { stages_per_rank: 2 };
        let err = s.actions(2, 0, 5).unwrap_err().to_string();
        assert!(err.contains("multiple of the number of rounds (2"), "{err}");
    }

    #[test]
    fn gpipe_and_1f1b_bubbles_are_p_minus_1_over_m_plus_p_minus_1() {
        for s in [Schedule::GPipe, Schedule::OneFOneB] {
            for (p, m) in [(2, 2), (2, 8), (4, 4), (4, 16), (3, 7)] {
                let t = s.timeline(p, m).unwrap();
                let theory = (p - 1) as f64 / (m + p - 1) as f64;
                assert!((t.bubble() - theory).abs() < 1e-12, "{s:?} p {p} m {m}");
                assert_eq!(t.ticks(), 2 * (m + p - 1));
            }
        }
    }

    #[test]
    fn interleaving_shrinks_the_bubble() {
        let plain = Schedule::OneFOneB.timeline(4, 8).unwrap().bubble();
        let inter = Schedule::Interleaved1F1B { stages_per_rank: 2 }
            .timeline(4, 8)
            .unwrap()
            .bubble();
        assert!(inter < plain, "interleaved {inter} vs 1F1B {plain}");
    }

    #[test]
    fn every_schedule_receives_in_the_order_it_sends() {
        for s in ALL {
            for (pp, m) in [(2, 2), (2, 4), (2, 8), (3, 6), (4, 4), (4, 8), (4, 12)] {
                s.check_message_order(pp, m)
                    .unwrap_or_else(|e| panic!("{s:?} pp {pp} m {m}: {e}"));
            }
        }
    }

    #[test]
    fn a_schedule_that_waits_on_itself_is_reported_as_a_hang() {
        // Rank 0 waits for stage 1's backward before running the forward stage 1 needs.
        let f = Computation::Forward;
        let b = Computation::Backward;
        let lists = [
            vec![Action::new(0, b, 0), Action::new(0, f, 0)],
            vec![Action::new(1, f, 0), Action::new(1, b, 0)],
        ];
        let stuck = run(&lists, 2).unwrap_err();
        assert_eq!(stuck, "rank 0 at 0B0, rank 1 at 1F0");
    }
}
