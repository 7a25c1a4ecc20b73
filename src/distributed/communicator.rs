//! What a backend provides: the [`Communicator`] that a [`ProcessGroup`](super::ProcessGroup)
//! drives from its worker thread.

use super::algorithms::exchange::Meta;
use super::config::Algorithm;
use super::rendezvous::GroupPath;
use super::store::{Store, StoreServer};
use super::work::Finished;
use super::ReduceOp;
use crate::error::Result;
use candle_core::{Device, Tensor};
use std::sync::Arc;

/// What a backend hands back when it has connected a group.
pub(crate) struct Connected {
    pub comm: Box<dyn Communicator>,
    /// The group's connection to the rendezvous store (absent for in-process groups).
    pub store: Option<Arc<Store>>,
    /// Rank 0's store server (the world group's; groups made from it share it).
    pub server: Option<Arc<StoreServer>>,
}

/// What a device backend records on the issuing thread, when a collective is issued: the point
/// in the producing device queue that the collective must wait for (NCCL: a CUDA event).
pub(crate) type IssueMark = Box<dyn std::any::Any + Send>;

/// One collective as the worker hands it to the backend: its sequence number in the group,
/// the description every rank must agree on, and what [`Communicator::issue`] recorded.
pub(crate) struct Call {
    pub seq: u64,
    pub desc: String,
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub mark: Option<IssueMark>,
}

/// One side of a point-to-point message as the worker hands it to the backend: the peer, and
/// the message's number among those between this rank and the peer in its direction (from 1;
/// messages between two ranks match in the order they were issued).
pub(crate) enum PointOp {
    Send {
        peer: usize,
        seq: u64,
        tensor: Tensor,
    },
    Recv {
        peer: usize,
        seq: u64,
        /// What the receive expects; `None` takes what was sent.
        expect: Option<Meta>,
    },
}

/// Runs a batch of point-to-point messages the host backends' way: every send first (`send`:
/// on these backends a send never waits for its receive), then each receive in order
/// (`recv`). `recv`'s outer error (a lost peer, a timeout) fails the batch at once; its inner
/// one (a message that did not match what the receive expected, consumed all the same) is
/// returned once every receive of the batch has taken its message. The result holds each
/// receive's tensor in `ops`' order (`None` for sends).
pub(crate) fn run_host_batch(
    ops: Vec<PointOp>,
    mut send: impl FnMut(usize, u64, &Tensor) -> Result<()>,
    mut recv: impl FnMut(usize, u64, Option<Meta>) -> Result<Result<Tensor>>,
) -> Result<Finished<Vec<Option<Tensor>>>> {
    for op in &ops {
        if let PointOp::Send { peer, seq, tensor } = op {
            send(*peer, *seq, tensor)?;
        }
    }
    let mut refused = None;
    let mut out = Vec::with_capacity(ops.len());
    for op in ops {
        let received = match op {
            PointOp::Send { .. } => None,
            PointOp::Recv { peer, seq, expect } => match recv(peer, seq, expect)? {
                Ok(t) => Some(t),
                Err(e) => {
                    refused.get_or_insert(e);
                    None
                }
            },
        };
        out.push(received);
    }
    match refused {
        Some(e) => Err(e),
        None => Ok(Finished::ready(out)),
    }
}

/// A backend's side of a process group. Each collective runs on the group's worker thread, one
/// at a time, in issue order; every rank agrees on `call.desc` before data moves and fails on
/// every rank when they do not.
pub(crate) trait Communicator: Send + Sync {
    /// Runs on the issuing thread as a collective is issued, before it is queued: device
    /// backends mark where the inputs are produced. Host backends need nothing.
    fn issue(&self, _inputs: &[Tensor]) -> Result<Option<IssueMark>> {
        Ok(None)
    }
    fn all_reduce(&self, call: Call, ts: &[Tensor], op: ReduceOp) -> Result<Finished<Vec<Tensor>>>;
    /// All-reduces `t`, which the caller owns (nothing reads or writes its storage meanwhile):
    /// the same collective as [`all_reduce`](Self::all_reduce) of `[t]`, on the wire and in
    /// its result, written into `t`'s own storage where the backend can (the host backend, for
    /// a contiguous CPU tensor) instead of into fresh memory. Returns the result.
    fn all_reduce_owned(&self, call: Call, t: Tensor, op: ReduceOp) -> Result<Finished<Tensor>> {
        let reduced = self.all_reduce(call, std::slice::from_ref(&t), op)?;
        Ok(Finished {
            value: reduced.value.into_iter().next().unwrap_or(t),
            device: reduced.device,
        })
    }
    fn broadcast(&self, call: Call, t: &Tensor, root: usize) -> Result<Finished<Tensor>>;
    fn all_gather(&self, call: Call, t: &Tensor) -> Result<Finished<Vec<Tensor>>>;
    fn reduce_scatter(&self, call: Call, t: &Tensor, op: ReduceOp) -> Result<Finished<Tensor>>;
    /// Runs a batch of point-to-point messages, with one peer or several, as one unit (torch's
    /// `batch_isend_irecv`): every send is under way before any receive waits, so ranks that
    /// send to each other in one batch never wait for each other. Returns, in `ops`' order,
    /// each receive's tensor on `device` (`None` for sends). `mark` is what
    /// [`Communicator::issue`] recorded for the sends' tensors.
    fn p2p(
        &self,
        ops: Vec<PointOp>,
        device: &Device,
        mark: Option<IssueMark>,
    ) -> Result<Finished<Vec<Option<Tensor>>>>;
    /// After the ranks agreed on `call.desc`, sends `inputs[p]` to every rank `p` and returns
    /// what each rank sent to this one, in rank order, shaped as it was sent.
    fn all_to_all(&self, call: Call, inputs: &[Tensor]) -> Result<Finished<Vec<Tensor>>>;
    /// Only the agreement on `call.desc`: a barrier.
    fn check(&self, call: &Call) -> Result<()>;
    /// After the ranks agreed on `call` (a `new_group` of `members`), connects the new group
    /// `path` on members and returns `None` on the others.
    fn split(&self, call: &Call, members: &[usize], path: &GroupPath) -> Result<Option<Connected>>;
    /// Whether the backend's own `Max` and `Min` propagate NaN as [`ReduceOp`] defines them;
    /// where not, the group carries NaN positions beside the data (see
    /// `ProcessGroup::all_reduce_tensors`).
    fn max_min_propagate_nan(&self) -> bool {
        true
    }
    /// How each peer is reached, for backends with per-peer links.
    fn transports(&self) -> Vec<Option<&'static str>> {
        Vec::new()
    }
    /// The all-reduce algorithm in use, for backends that offer a choice.
    fn algorithm(&self) -> Option<Algorithm> {
        None
    }
}
