//! The in-process backend: ranks are threads of one process and share memory.
//!
//! Each collective is one meeting: every rank leaves its tensors and its description of the
//! call, and once all are there each rank computes its result from all of them with candle's
//! own ops, in rank order (so every rank gets the same numbers, and tensors may live on any
//! device). A rank whose closure ends (returns, fails or panics) leaves the group; ranks
//! waiting for it fail at once, naming it.

use super::algorithms::consensus::describe;
use super::group::{Backend, Communicator, InitOptions, Inner, ProcessGroup};
use super::ReduceOp;
use crate::error::{Error, Result};
use crate::replicate::lock;
use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone)]
struct Deposit {
    desc: String,
    tensors: Vec<Tensor>,
}

struct Meeting {
    deposits: Vec<Option<Deposit>>,
    readers_left: usize,
}

struct State {
    meetings: HashMap<u64, Meeting>,
    /// Why each rank left, once it has.
    left: Vec<Option<String>>,
}

struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

struct InProcessComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl InProcessComm {
    /// Deposits this rank's part of collective `seq` and returns every rank's, once all are
    /// there and agree on the description.
    fn meet(&self, seq: u64, desc: &str, tensors: Vec<Tensor>) -> Result<Vec<Deposit>> {
        let sh = &self.shared;
        let deadline = Instant::now() + sh.timeout;
        let mut st = lock(&sh.state);
        let world = sh.world;
        st.meetings
            .entry(seq)
            .or_insert_with(|| Meeting {
                deposits: vec![None; world],
                readers_left: world,
            })
            .deposits[self.rank] = Some(Deposit {
            desc: desc.to_string(),
            tensors,
        });
        sh.changed.notify_all();
        loop {
            let meeting = &st.meetings[&seq];
            if meeting.deposits.iter().all(Option::is_some) {
                break;
            }
            let absent =
                (0..world).find(|&r| meeting.deposits[r].is_none() && st.left[r].is_some());
            if let Some(r) = absent {
                let why = st.left[r].clone().unwrap_or_default();
                return Err(Error::PeerLost {
                    rank: r,
                    detail: format!("it left the group ({why}) before joining collective #{seq}"),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    what: format!("waiting for the other ranks in collective #{seq}"),
                    waited: sh.timeout,
                });
            }
            st = sh
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        let meeting = st.meetings.get_mut(&seq).expect("meeting exists");
        let all: Vec<Deposit> = meeting.deposits.iter().flatten().cloned().collect();
        meeting.readers_left -= 1;
        if meeting.readers_left == 0 {
            st.meetings.remove(&seq);
        }
        drop(st);
        if all.iter().any(|d| d.desc != desc) {
            let calls: Vec<String> = all.iter().map(|d| d.desc.clone()).collect();
            return Err(Error::Mismatch {
                detail: describe(seq, &calls),
            });
        }
        Ok(all)
    }
}

/// A copy of `t` on `device` that shares no storage with `t`.
fn fresh(t: &Tensor, device: &Device) -> Result<Tensor> {
    let moved = if t.device().same_device(device) {
        t.copy()?
    } else {
        t.to_device(device)?
    };
    Ok(moved.detach())
}

fn combine(a: &Tensor, b: &Tensor, op: ReduceOp) -> Result<Tensor> {
    Ok(match op {
        ReduceOp::Sum | ReduceOp::Avg => (a + b)?,
        ReduceOp::Product => (a * b)?,
        ReduceOp::Max => a.maximum(b)?,
        ReduceOp::Min => a.minimum(b)?,
    })
}

/// Reduces tensor `i` of every deposit, in rank order, on `device`.
fn reduce(all: &[Deposit], i: usize, op: ReduceOp, device: &Device) -> Result<Tensor> {
    let mut acc = fresh(&all[0].tensors[i], device)?;
    for d in &all[1..] {
        acc = combine(&acc, &d.tensors[i].to_device(device)?, op)?;
    }
    if op == ReduceOp::Avg {
        acc = (acc / all.len() as f64)?;
    }
    Ok(acc.detach())
}

impl Communicator for InProcessComm {
    fn all_reduce(&self, seq: u64, desc: &str, ts: &[Tensor], op: ReduceOp) -> Result<Vec<Tensor>> {
        let all = self.meet(seq, desc, ts.to_vec())?;
        (0..ts.len())
            .map(|i| reduce(&all, i, op, ts[i].device()))
            .collect()
    }

    fn broadcast(&self, seq: u64, desc: &str, t: &Tensor, root: usize) -> Result<Tensor> {
        let mine = if self.rank == root {
            vec![t.clone()]
        } else {
            vec![]
        };
        let all = self.meet(seq, desc, mine)?;
        fresh(&all[root].tensors[0], t.device())
    }

    fn all_gather(&self, seq: u64, desc: &str, t: &Tensor) -> Result<Vec<Tensor>> {
        let all = self.meet(seq, desc, vec![t.clone()])?;
        all.iter()
            .map(|d| fresh(&d.tensors[0], t.device()))
            .collect()
    }

    fn reduce_scatter(&self, seq: u64, desc: &str, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let all = self.meet(seq, desc, vec![t.clone()])?;
        let rows = t.dim(0)? / self.shared.world;
        let reduced = reduce(&all, 0, op, t.device())?;
        Ok(reduced.narrow(0, self.rank * rows, rows)?.contiguous()?)
    }

    fn check(&self, seq: u64, desc: &str) -> Result<()> {
        self.meet(seq, desc, vec![]).map(|_| ())
    }
}

/// Marks its rank as gone when the rank's closure ends, however it ends.
struct Leave<'a> {
    shared: &'a Shared,
    rank: usize,
    why: &'static str,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        lock(&self.shared.state).left[self.rank] = Some(self.why.to_string());
        self.shared.changed.notify_all();
    }
}

/// Runs `f` on `world_size` threads, each a rank of one in-process group, and returns their
/// results in rank order, or the first failure (lowest rank).
///
/// ```rust
/// use candle_core::{Device, Tensor};
/// use candle_parallel::dist::{self, ReduceOp};
/// # fn main() -> candle_parallel::Result<()> {
/// let sums = dist::spawn(3, |pg| {
///     let x = Tensor::new(&[pg.rank() as f32 + 1.0], &Device::Cpu)?;
///     Ok(pg.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?[0])
/// })?;
/// assert_eq!(sums, [6.0, 6.0, 6.0]);
/// # Ok(()) }
/// ```
pub fn spawn<T, F>(world_size: usize, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(ProcessGroup) -> Result<T> + Sync,
{
    spawn_with(world_size, InitOptions::default(), f)
}

/// As [`spawn`], with options (only `timeout` applies to in-process groups).
pub fn spawn_with<T, F>(world_size: usize, options: InitOptions, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(ProcessGroup) -> Result<T> + Sync,
{
    if world_size == 0 {
        return Err(Error::Config {
            what: "world size".into(),
            detail: "0: a group needs at least one rank".into(),
        });
    }
    let shared = Arc::new(Shared {
        world: world_size,
        timeout: options.timeout,
        state: Mutex::new(State {
            meetings: HashMap::new(),
            left: vec![None; world_size],
        }),
        changed: Condvar::new(),
    });
    let results: Vec<Result<T>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let (shared, f) = (shared.clone(), &f);
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let mut leave = Leave {
                            shared: &shared,
                            rank,
                            why: "its closure returned",
                        };
                        let group = ProcessGroup::from_inner(Inner {
                            rank,
                            world_size,
                            local_rank: rank,
                            local_world_size: world_size,
                            backend: Backend::InProcess,
                            comm: Box::new(InProcessComm {
                                rank,
                                shared: shared.clone(),
                            }),
                            seq: Mutex::new(0),
                            store: None,
                            _server: None,
                        });
                        let out = catch_unwind(AssertUnwindSafe(|| f(group)));
                        leave.why = match &out {
                            Ok(Ok(_)) => "its closure returned",
                            Ok(Err(_)) => "its closure returned an error",
                            Err(_) => "it panicked",
                        };
                        out
                    })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Err(e) => Err(Error::Io {
                    context: format!("starting the thread of rank {rank}"),
                    source: e,
                }),
                Ok(h) => match h.join() {
                    Ok(Ok(r)) => r,
                    Ok(Err(_)) | Err(_) => Err(Error::RankFailed {
                        rank,
                        status: "panicked".into(),
                        code: 101,
                    }),
                },
            })
            .collect()
    });
    first_cause(results)
}

/// All values, or the error that caused the others: a rank's own failure rather than another
/// rank's report of losing it.
pub(crate) fn first_cause<T>(results: Vec<Result<T>>) -> Result<Vec<T>> {
    let consequence = |e: &Error| {
        matches!(
            e,
            Error::PeerLost { .. } | Error::Aborted { .. } | Error::Timeout { .. }
        )
    };
    if let Some(i) = results
        .iter()
        .position(|r| r.as_ref().is_err_and(|e| !consequence(e)))
    {
        return Err(results
            .into_iter()
            .nth(i)
            .expect("index")
            .err()
            .expect("error"));
    }
    results.into_iter().collect()
}
