//! Point-to-point messages and all-to-all on a [`ProcessGroup`]: torch's `send`, `recv`,
//! `isend`, `irecv`, `batch_isend_irecv`, `all_to_all` and `all_to_all_single`.
//!
//! Messages from one rank to another match in the order they were issued: the k-th send from
//! rank a to rank b is the k-th receive from a on b. They run on the group's worker in issue
//! order with its collectives, but are numbered apart: ranks that take no part in a message do
//! not see it. A receive states the shape and dtype it expects ([`ProcessGroup::recv`]), and a
//! message that differs is an [`Error::P2pMismatch`] naming both, never reinterpreted; or it
//! takes what was sent ([`ProcessGroup::recv_as_sent`]). A lost sender fails the receive naming
//! it, within the peer timeout.
//!
//! On host backends a send never waits for its receive (the receiver's transport takes the
//! message in whatever it is doing); on NCCL a send completes with its receive, so ranks that
//! send to each other issue both directions in one [`ProcessGroup::batch_isend_irecv`], as with
//! torch.
//!
//! ```rust
//! use candle_core::{DType, Device, Tensor};
//! use candle_parallel::distributed::{self, P2pOp};
//! # fn main() -> candle_parallel::Result<()> {
//! // Each of three ranks passes its rank to the next one around a ring.
//! let got = distributed::spawn_threads(3, |pg| {
//!     let (me, n) = (pg.rank(), pg.world_size());
//!     let x = Tensor::new(&[me as f32; 2], &Device::Cpu)?;
//!     let done = pg.batch_isend_irecv(vec![
//!         P2pOp::send(&x, (me + 1) % n),
//!         P2pOp::recv((me + n - 1) % n, 2, DType::F32),
//!     ])?;
//!     let from_previous = done.wait()?.remove(1).expect("a receive's tensor");
//!     Ok(from_previous.to_vec1::<f32>()?[0])
//! })?;
//! assert_eq!(got, [2.0, 0.0, 1.0]);
//! # Ok(()) }
//! ```

use super::{describe_tensor, ProcessGroup};
use crate::distributed::algorithms::exchange::Meta;
use crate::distributed::communicator::PointOp;
use crate::distributed::transport::host_buf::check_raw_dtype;
use crate::distributed::work::Work;
use crate::error::{Error, Result};
use crate::util::sync::lock;
use candle_core::{DType, Shape, Tensor};

/// How many messages a rank has issued to and from each rank of a group.
pub(crate) struct Counters {
    sent: Vec<u64>,
    received: Vec<u64>,
}

impl Counters {
    pub fn new(world: usize) -> Self {
        Self {
            sent: vec![0; world],
            received: vec![0; world],
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Send { tensor: Tensor, peer: usize },
    Recv { peer: usize, expect: Option<Meta> },
}

/// One send or receive of a [`ProcessGroup::batch_isend_irecv`] (torch's `P2POp`).
///
/// ```rust
/// use candle_core::{DType, Device, Tensor};
/// use candle_parallel::distributed::{self, P2pOp};
/// # fn main() -> candle_parallel::Result<()> {
/// // Each of three ranks passes its rank to the next one around a ring.
/// let got = distributed::spawn_threads(3, |pg| {
///     let (me, n) = (pg.rank(), pg.world_size());
///     let x = Tensor::new(&[me as f32; 2], &Device::Cpu)?;
///     let done = pg.batch_isend_irecv(vec![
///         P2pOp::send(&x, (me + 1) % n),
///         P2pOp::recv((me + n - 1) % n, 2, DType::F32),
///     ])?;
///     let from_previous = done.wait()?.remove(1).expect("a receive's tensor");
///     Ok(from_previous.to_vec1::<f32>()?[0])
/// })?;
/// assert_eq!(got, [2.0, 0.0, 1.0]);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct P2pOp(Op);

impl P2pOp {
    /// Sends `t` to rank `peer`.
    pub fn send(t: &Tensor, peer: usize) -> Self {
        Self(Op::Send {
            tensor: t.clone(),
            peer,
        })
    }

    /// Receives a tensor of `shape` and `dtype` from rank `peer`.
    pub fn recv(peer: usize, shape: impl Into<Shape>, dtype: DType) -> Self {
        Self(Op::Recv {
            peer,
            expect: Some(Meta {
                dtype,
                dims: shape.into().dims().to_vec(),
            }),
        })
    }

    /// Receives from rank `peer` whatever shape and dtype it sent.
    pub fn recv_as_sent(peer: usize) -> Self {
        Self(Op::Recv { peer, expect: None })
    }

    fn peer(&self) -> usize {
        match &self.0 {
            Op::Send { peer, .. } | Op::Recv { peer, .. } => *peer,
        }
    }

    fn describe(&self) -> String {
        match &self.0 {
            Op::Send { tensor, peer } => format!("send {} to rank {peer}", describe_tensor(tensor)),
            Op::Recv {
                peer,
                expect: Some(m),
            } => format!("recv {} from rank {peer}", m.describe()),
            Op::Recv { peer, expect: None } => format!("recv from rank {peer}"),
        }
    }
}

impl ProcessGroup {
    /// Sends `t` to rank `dst` (torch's `send`). Returns once the message is handed to the
    /// transport (host backends) or sent (NCCL).
    pub fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        self.send_async(t, dst)?.wait()
    }

    /// [`ProcessGroup::send`], issued without waiting (torch's `isend`).
    pub fn send_async(&self, t: &Tensor, dst: usize) -> Result<Work<()>> {
        Ok(self
            .batch_isend_irecv(vec![P2pOp::send(t, dst)])?
            .map(|_| Ok(())))
    }

    /// Receives a tensor of `shape` and `dtype` from rank `src`, on [`ProcessGroup::device`]
    /// (torch's `recv`). A message of another shape or dtype is an [`Error::P2pMismatch`].
    pub fn recv(&self, src: usize, shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
        self.recv_async(src, shape, dtype)?.wait()
    }

    /// [`ProcessGroup::recv`], issued without waiting (torch's `irecv`).
    pub fn recv_async(
        &self,
        src: usize,
        shape: impl Into<Shape>,
        dtype: DType,
    ) -> Result<Work<Tensor>> {
        self.receive(P2pOp::recv(src, shape, dtype))
    }

    /// Receives from rank `src` whatever it sent, shape and dtype as sent, on
    /// [`ProcessGroup::device`].
    pub fn recv_as_sent(&self, src: usize) -> Result<Tensor> {
        self.recv_as_sent_async(src)?.wait()
    }

    /// [`ProcessGroup::recv_as_sent`], issued without waiting.
    pub fn recv_as_sent_async(&self, src: usize) -> Result<Work<Tensor>> {
        self.receive(P2pOp::recv_as_sent(src))
    }

    fn receive(&self, op: P2pOp) -> Result<Work<Tensor>> {
        Ok(self.batch_isend_irecv(vec![op])?.map(|mut v| {
            v.pop().flatten().ok_or_else(|| Error::Aborted {
                reason: "a receive came back without its tensor".into(),
            })
        }))
    }

    /// Issues several sends and receives, with one peer or many, as one unit (torch's
    /// `batch_isend_irecv`): every send is under way before any receive waits, so two ranks
    /// that send to each other in one batch never wait for each other, on any backend. The
    /// result holds, in `ops`' order, each receive's tensor (`None` for sends).
    ///
    /// Invalid ops (a peer outside the group, this rank itself, a dtype that cannot travel)
    /// fail here, on this rank, and nothing of the batch is issued.
    pub fn batch_isend_irecv(&self, ops: Vec<P2pOp>) -> Result<Work<Vec<Option<Tensor>>>> {
        for op in &ops {
            self.check_peer(op.peer())?;
            match &op.0 {
                Op::Send { tensor, .. } => check_raw_dtype(tensor.dtype())?,
                Op::Recv {
                    expect: Some(m), ..
                } => check_raw_dtype(m.dtype)?,
                Op::Recv { .. } => {}
            }
        }
        let what = match ops.as_slice() {
            [one] => one.describe(),
            many => {
                let parts: Vec<String> = many.iter().map(P2pOp::describe).collect();
                format!("batch_isend_irecv [{}]", parts.join(", "))
            }
        };
        let sends: Vec<Tensor> = ops
            .iter()
            .filter_map(|op| match &op.0 {
                Op::Send { tensor, .. } => Some(tensor.clone()),
                Op::Recv { .. } => None,
            })
            .collect();
        let comm = self.state.comm.clone();
        // Numbered and queued under one lock: the worker runs the messages in number order,
        // which is the order NCCL matches them in.
        let mut counters = lock(&self.state.p2p);
        let mark = comm.issue(&sends)?;
        let ops: Vec<PointOp> = ops
            .into_iter()
            .map(|op| match op.0 {
                Op::Send { tensor, peer } => {
                    counters.sent[peer] += 1;
                    PointOp::Send {
                        peer,
                        seq: counters.sent[peer],
                        tensor,
                    }
                }
                Op::Recv { peer, expect } => {
                    counters.received[peer] += 1;
                    PointOp::Recv {
                        peer,
                        seq: counters.received[peer],
                        expect,
                    }
                }
            })
            .collect();
        let device = self.state.device.clone();
        let work = self
            .state
            .worker
            .submit_unnumbered(what, move || comm.p2p(ops, &device, mark));
        drop(counters);
        Ok(work)
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        self.check_rank(peer, "point-to-point peer")?;
        if peer == self.rank() {
            return Err(Error::InvalidArgument {
                what: "point-to-point peer",
                detail: format!(
                    "rank {peer} is this rank itself; a rank sends to and receives from others"
                ),
            });
        }
        Ok(())
    }

    /// Sends `inputs[p]` to every rank `p` and returns what every rank sent to this one, in
    /// rank order (torch's `all_to_all`). Every rank passes `world_size` tensors of one dtype,
    /// the same dtype on every rank; their shapes are free (uneven splits), and each result
    /// has the shape its sender gave it. Results are on `inputs[rank]`'s device.
    pub fn all_to_all(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.all_to_all_async(inputs)?.wait()
    }

    /// [`ProcessGroup::all_to_all`], issued without waiting: returns at once.
    pub fn all_to_all_async(&self, inputs: &[Tensor]) -> Result<Work<Vec<Tensor>>> {
        let n = self.world_size();
        let dtype = inputs.first().map_or(DType::F32, Tensor::dtype);
        let valid = check_raw_dtype(dtype).and_then(|()| {
            if inputs.len() != n {
                return Err(Error::InvalidArgument {
                    what: "all_to_all inputs",
                    detail: format!(
                        "{} tensors given; pass one per rank of the group ({n})",
                        inputs.len()
                    ),
                });
            }
            match inputs.iter().position(|t| t.dtype() != dtype) {
                Some(i) => Err(Error::InvalidArgument {
                    what: "all_to_all inputs",
                    detail: format!(
                        "input {i} is {} but input 0 is {}; pass tensors of one dtype",
                        describe_tensor(&inputs[i]),
                        describe_tensor(&inputs[0])
                    ),
                }),
                None => Ok(()),
            }
        });
        let desc = format!("all_to_all {}", dtype.as_str());
        let owned = inputs.to_vec();
        self.issue(desc, valid, inputs, move |comm, call| {
            comm.all_to_all(call, &owned)
        })
    }

    /// All-to-all of one tensor cut along dimension 0 (torch's `all_to_all_single`): rows
    /// `input_splits[p]` of `t`, in order, go to rank `p`; the result stacks, in rank order,
    /// the `output_splits[p]` rows each rank `p` sent. Splits may be uneven (expert and context
    /// parallelism) and zero. The rows' other dimensions and the dtype must agree on every
    /// rank; a sender whose rows differ from `output_splits` is an [`Error::Mismatch`] naming
    /// both.
    pub fn all_to_all_single(
        &self,
        t: &Tensor,
        input_splits: &[usize],
        output_splits: &[usize],
    ) -> Result<Tensor> {
        let n = self.world_size();
        let rows = t.dims().first().copied().unwrap_or(0);
        for (splits, name) in [
            (input_splits, "input_splits"),
            (output_splits, "output_splits"),
        ] {
            if splits.len() != n {
                return Err(Error::InvalidArgument {
                    what: "all_to_all_single splits",
                    detail: format!(
                        "{name} has {} entries; give one per rank of the group ({n})",
                        splits.len()
                    ),
                });
            }
        }
        if t.rank() == 0 || input_splits.iter().sum::<usize>() != rows {
            return Err(Error::InvalidArgument {
                what: "all_to_all_single input_splits",
                detail: format!(
                    "{input_splits:?} add up to {} rows, but the input is {}",
                    input_splits.iter().sum::<usize>(),
                    describe_tensor(t)
                ),
            });
        }
        let mut offset = 0;
        let pieces = input_splits
            .iter()
            .map(|&k| {
                let piece = t.narrow(0, offset, k)?;
                offset += k;
                Ok(piece)
            })
            .collect::<Result<Vec<_>>>()?;
        let got = self.all_to_all(&pieces)?;
        let rest = &t.dims()[1..];
        for (p, (piece, &want)) in got.iter().zip(output_splits).enumerate() {
            if piece.dims().first() != Some(&want) || &piece.dims()[1..] != rest {
                let mut expected = vec![want];
                expected.extend_from_slice(rest);
                return Err(Error::Mismatch {
                    detail: format!(
                        "all_to_all_single: rank {} expected {} {expected:?} from rank {p}, which \
                         sent {}",
                        self.rank(),
                        t.dtype().as_str(),
                        describe_tensor(piece)
                    ),
                });
            }
        }
        Ok(Tensor::cat(&got, 0)?)
    }
}
