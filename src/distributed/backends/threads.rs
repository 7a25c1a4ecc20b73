//! The in-process backend: ranks are threads of one process and share memory (started by
//! [`spawn_threads`](crate::distributed::spawn_threads)).
//!
//! Each collective is one round: every rank leaves its tensors and its description of the call,
//! and once all are there each rank computes its result from all of them, in rank order, with
//! the arithmetic every backend shares ([`reduce_op`](crate::distributed::reduce_op)); tensors
//! may live on any device. A rank whose closure ends (returns, fails or panics) leaves the
//! group; ranks waiting for it fail at once, naming it.

use crate::distributed::algorithms::consensus::describe;
use crate::distributed::algorithms::exchange::{check_expected, Meta};
use crate::distributed::communicator::{
    run_host_batch, Call, Communicator, Connected, IssueMark, PointOp,
};
use crate::distributed::rendezvous::GroupPath;
use crate::distributed::transport::host_buf::{with_bytes, HostBuf};
use crate::distributed::work::Finished;
use crate::distributed::ReduceOp;
use crate::error::{Error, Result};
use crate::util::sync::lock;
use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone)]
struct Deposit {
    desc: String,
    tensors: Vec<Tensor>,
}

/// One collective's deposits, until every rank has read them.
struct Round {
    deposits: Vec<Option<Deposit>>,
    readers_left: usize,
}

/// A group made by `new_group`, until every member has taken its part.
struct NewGroup {
    shared: Arc<Shared>,
    members_left: usize,
}

struct State {
    rounds: HashMap<u64, Round>,
    /// Point-to-point messages not yet received, by (sender, receiver, number).
    mail: HashMap<(usize, usize, u64), Tensor>,
    new_groups: HashMap<u64, NewGroup>,
    /// Why each rank left, once it has.
    left: Vec<Option<String>>,
}

/// What the thread-ranks of one group share.
pub(crate) struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    /// The state of a group of `world` thread-ranks whose waits last up to `timeout`.
    pub fn new(world: usize, timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            world,
            timeout,
            state: Mutex::new(State {
                rounds: HashMap::new(),
                mail: HashMap::new(),
                new_groups: HashMap::new(),
                left: vec![None; world],
            }),
            changed: Condvar::new(),
        })
    }

    fn leave(&self, rank: usize, why: &str) {
        lock(&self.state).left[rank].get_or_insert_with(|| why.to_string());
        self.changed.notify_all();
    }

    /// Rank `rank`'s side of the world group: its communicator, and the guard that marks it
    /// gone when its closure ends.
    pub fn member(self: &Arc<Self>, rank: usize) -> (Connected, Leave<'_>) {
        let leave = Leave {
            shared: self,
            rank,
            why: "its closure returned",
        };
        let connected = Connected {
            comm: Box::new(ThreadComm {
                rank,
                shared: self.clone(),
                leave_on_drop: false,
            }),
            store: None,
            server: None,
        };
        (connected, leave)
    }
}

struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
    /// Groups made by `new_group` leave when their communicator goes; the world's ranks leave
    /// when their closure ends (see [`Leave`]), which says better why.
    leave_on_drop: bool,
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        if self.leave_on_drop {
            self.shared.leave(self.rank, "it dropped the group");
        }
    }
}

impl ThreadComm {
    /// Deposits this rank's part of collective `seq` and returns every rank's, once all are
    /// there and agree on the description.
    fn meet(&self, call: &Call, tensors: Vec<Tensor>) -> Result<Vec<Deposit>> {
        let (sh, seq) = (&self.shared, call.seq);
        let deadline = Instant::now() + sh.timeout;
        let mut st = lock(&sh.state);
        let world = sh.world;
        st.rounds
            .entry(seq)
            .or_insert_with(|| Round {
                deposits: vec![None; world],
                readers_left: world,
            })
            .deposits[self.rank] = Some(Deposit {
            desc: call.desc.clone(),
            tensors,
        });
        sh.changed.notify_all();
        loop {
            let round = &st.rounds[&seq];
            if round.deposits.iter().all(Option::is_some) {
                break;
            }
            let absent = (0..world).find(|&r| round.deposits[r].is_none() && st.left[r].is_some());
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
        let round = st.rounds.get_mut(&seq).expect("round exists");
        let all: Vec<Deposit> = round.deposits.iter().flatten().cloned().collect();
        round.readers_left -= 1;
        if round.readers_left == 0 {
            st.rounds.remove(&seq);
        }
        drop(st);
        if all.iter().any(|d| d.desc != call.desc) {
            let calls: Vec<String> = all.iter().map(|d| d.desc.clone()).collect();
            return Err(Error::Mismatch {
                detail: describe(seq, &calls),
            });
        }
        Ok(all)
    }
}

impl ThreadComm {
    /// Waits for message `seq` from `peer` and takes it out of the mailbox.
    fn take_mail(&self, peer: usize, seq: u64) -> Result<Tensor> {
        let sh = &self.shared;
        let deadline = Instant::now() + sh.timeout;
        let key = (peer, self.rank, seq);
        let mut st = lock(&sh.state);
        loop {
            if let Some(t) = st.mail.remove(&key) {
                return Ok(t);
            }
            if let Some(why) = &st.left[peer] {
                return Err(Error::PeerLost {
                    rank: peer,
                    detail: format!(
                        "it left the group ({why}) before sending message #{seq} to rank {}",
                        self.rank
                    ),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    what: format!("waiting for message #{seq} from rank {peer}"),
                    waited: sh.timeout,
                });
            }
            st = sh
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// A copy of `t` on `device` that shares no storage with `t`.
fn fresh(t: &Tensor, device: &Device) -> Result<Tensor> {
    let moved = if t.device().same_device(device) {
        t.copy()?
    } else {
        crate::util::ordered_copy::to_device(t, device, false)?
    };
    Ok(moved.detach())
}

/// Reduces tensor `i` of every deposit, in rank order, onto `device`.
fn reduce(all: &[Deposit], i: usize, op: ReduceOp, device: &Device) -> Result<Tensor> {
    let first = &all[0].tensors[i];
    let mut acc = HostBuf::from_tensor(first)?;
    let len = acc.len();
    for d in &all[1..] {
        with_bytes(&d.tensors[i], |bytes| {
            acc.reduce_from(0..len, bytes, op);
            Ok(())
        })?;
    }
    if op == ReduceOp::Avg {
        acc.divide(all.len());
    }
    acc.into_tensor(first.shape(), device)
}

impl Communicator for ThreadComm {
    fn all_reduce(&self, call: Call, ts: &[Tensor], op: ReduceOp) -> Result<Finished<Vec<Tensor>>> {
        let all = self.meet(&call, ts.to_vec())?;
        let out = (0..ts.len())
            .map(|i| reduce(&all, i, op, ts[i].device()))
            .collect::<Result<Vec<_>>>()?;
        Ok(Finished::ready(out))
    }

    fn broadcast(&self, call: Call, t: &Tensor, root: usize) -> Result<Finished<Tensor>> {
        let mine = if self.rank == root {
            vec![t.clone()]
        } else {
            vec![]
        };
        let all = self.meet(&call, mine)?;
        Ok(Finished::ready(fresh(&all[root].tensors[0], t.device())?))
    }

    fn all_gather(&self, call: Call, t: &Tensor) -> Result<Finished<Vec<Tensor>>> {
        let all = self.meet(&call, vec![t.clone()])?;
        let out = all
            .iter()
            .map(|d| fresh(&d.tensors[0], t.device()))
            .collect::<Result<Vec<_>>>()?;
        Ok(Finished::ready(out))
    }

    fn reduce_scatter(&self, call: Call, t: &Tensor, op: ReduceOp) -> Result<Finished<Tensor>> {
        let all = self.meet(&call, vec![t.clone()])?;
        let rows = t.dim(0)? / self.shared.world;
        let reduced = reduce(&all, 0, op, t.device())?;
        Ok(Finished::ready(
            reduced.narrow(0, self.rank * rows, rows)?.contiguous()?,
        ))
    }

    fn check(&self, call: &Call) -> Result<()> {
        self.meet(call, vec![]).map(|_| ())
    }

    /// A send leaves a copy in the mailbox (the sender may change its variable afterwards);
    /// a receive takes it out.
    fn p2p(
        &self,
        ops: Vec<PointOp>,
        device: &Device,
        _: Option<IssueMark>,
    ) -> Result<Finished<Vec<Option<Tensor>>>> {
        run_host_batch(
            ops,
            |peer, seq, t| {
                let copy = t.copy()?.detach();
                lock(&self.shared.state)
                    .mail
                    .insert((self.rank, peer, seq), copy);
                self.shared.changed.notify_all();
                Ok(())
            },
            |peer, seq, expect| {
                let t = self.take_mail(peer, seq)?;
                Ok(
                    match check_expected(expect.as_ref(), &Meta::of(&t), peer, self.rank, seq) {
                        // The mailbox held a copy of its own: moved only when it lands elsewhere.
                        Ok(()) if t.device().same_device(device) => Ok(t),
                        Ok(()) => Ok(fresh(&t, device)?),
                        Err(e) => Err(e),
                    },
                )
            },
        )
    }

    fn all_to_all(&self, call: Call, inputs: &[Tensor]) -> Result<Finished<Vec<Tensor>>> {
        let all = self.meet(&call, inputs.to_vec())?;
        let device = inputs[self.rank].device();
        let out = all
            .iter()
            .map(|d| fresh(&d.tensors[self.rank], device))
            .collect::<Result<Vec<_>>>()?;
        Ok(Finished::ready(out))
    }

    /// The first member to arrive makes the new group's shared state; the others take it.
    fn split(&self, call: &Call, members: &[usize], _: &GroupPath) -> Result<Option<Connected>> {
        let Some(rank) = members.iter().position(|&r| r == self.rank) else {
            return Ok(None);
        };
        let shared = {
            let mut st = lock(&self.shared.state);
            let entry = st.new_groups.entry(call.seq).or_insert_with(|| NewGroup {
                shared: Shared::new(members.len(), self.shared.timeout),
                members_left: members.len(),
            });
            entry.members_left -= 1;
            let shared = entry.shared.clone();
            if entry.members_left == 0 {
                st.new_groups.remove(&call.seq);
            }
            shared
        };
        Ok(Some(Connected {
            comm: Box::new(ThreadComm {
                rank,
                shared,
                leave_on_drop: true,
            }),
            store: None,
            server: None,
        }))
    }
}

/// Marks its rank as gone when the rank's closure ends, however it ends.
pub(crate) struct Leave<'a> {
    shared: &'a Shared,
    rank: usize,
    /// Why the rank left, as its peers will be told.
    pub why: &'static str,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        self.shared.leave(self.rank, self.why);
    }
}
