//! `ProcessGroup`: the one face of the distributed layer.

use super::store::Store;
use crate::error::{Error, Result};
use crate::replicate::lock;
use candle_core::{DType, Tensor};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How values from all ranks are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over the ranks (sum divided by the world size).
    Avg,
    /// Element-wise maximum (NaN wins).
    Max,
    /// Element-wise minimum (NaN wins).
    Min,
    /// Element-wise product.
    Product,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Sum => "sum",
            Self::Avg => "avg",
            Self::Max => "max",
            Self::Min => "min",
            Self::Product => "product",
        })
    }
}

/// The transport under a process group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Sockets and host memory (the gloo analogue): CPU tensors directly, CUDA tensors staged
    /// through the host. TCP across machines, Unix-domain sockets between ranks of one machine.
    Tcp,
    /// Threads of one process sharing memory.
    InProcess,
    /// NVIDIA's NCCL on candle's CUDA stream (feature `nccl`).
    Nccl,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Tcp => "tcp",
            Self::InProcess => "in-process",
            Self::Nccl => "nccl",
        })
    }
}

/// Timeouts and choices for creating a process group. `Default` reads nothing from the
/// environment; [`InitOptions::from_env`] takes the job token from `CANDLE_PARALLEL_TOKEN`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InitOptions {
    /// The backend; `None` picks NCCL for CUDA devices (with the `nccl` feature), else TCP.
    pub backend: Option<Backend>,
    /// The longest a collective waits for a live peer (PyTorch's default: 30 minutes).
    pub timeout: Duration,
    /// The longest a peer may be silent before it counts as lost (default 30 s). Peers send
    /// heartbeats, so only a dead, stopped or unreachable process is ever this silent.
    pub peer_timeout: Duration,
    /// The longest to wait for every rank to join (default 5 minutes).
    pub rendezvous_timeout: Duration,
    /// The job token every connection must present (default: none).
    pub token: String,
    /// Let ranks on the same machine talk over Unix-domain sockets, about twice as fast as TCP
    /// over loopback (default true; `CANDLE_PARALLEL_UNIX_SOCKETS=0` turns it off in
    /// [`InitOptions::from_env`]). Only the TCP backend (and NCCL's control links) use it.
    pub unix_sockets: bool,
    /// Let neighbouring ranks on the same machine exchange collective data through shared
    /// memory instead of sockets (default true, Linux; needs `unix_sockets`;
    /// `CANDLE_PARALLEL_SHM=0` turns it off in [`InitOptions::from_env`]).
    pub shared_memory: bool,
}

impl Default for InitOptions {
    fn default() -> Self {
        Self {
            backend: None,
            timeout: Duration::from_secs(30 * 60),
            peer_timeout: Duration::from_secs(30),
            rendezvous_timeout: Duration::from_secs(300),
            token: String::new(),
            unix_sockets: true,
            shared_memory: true,
        }
    }
}

/// The environment variable carrying the job token, set by `candle-run`.
pub const TOKEN_VAR: &str = "CANDLE_PARALLEL_TOKEN";

impl InitOptions {
    /// The defaults, with the token from `CANDLE_PARALLEL_TOKEN` when it is set, and Unix
    /// sockets (or shared memory) off when `CANDLE_PARALLEL_UNIX_SOCKETS` (`CANDLE_PARALLEL_SHM`)
    /// is `0`.
    pub fn from_env() -> Self {
        Self {
            token: std::env::var(TOKEN_VAR).unwrap_or_default(),
            unix_sockets: std::env::var("CANDLE_PARALLEL_UNIX_SOCKETS").map_or(true, |v| v != "0"),
            shared_memory: std::env::var("CANDLE_PARALLEL_SHM").map_or(true, |v| v != "0"),
            ..Self::default()
        }
    }
}

/// What a backend provides. Each call carries its collective's sequence number and a
/// description of it; the backend makes sure all ranks agree on the description before data
/// moves, and fails on every rank when they do not.
pub(crate) trait Communicator: Send + Sync {
    fn all_reduce(&self, seq: u64, desc: &str, ts: &[Tensor], op: ReduceOp) -> Result<Vec<Tensor>>;
    fn broadcast(&self, seq: u64, desc: &str, t: &Tensor, root: usize) -> Result<Tensor>;
    fn all_gather(&self, seq: u64, desc: &str, t: &Tensor) -> Result<Vec<Tensor>>;
    fn reduce_scatter(&self, seq: u64, desc: &str, t: &Tensor, op: ReduceOp) -> Result<Tensor>;
    /// Only the agreement on `desc`: a barrier.
    fn check(&self, seq: u64, desc: &str) -> Result<()>;
    /// How each peer is reached, for backends with per-peer links.
    fn transports(&self) -> Vec<Option<&'static str>> {
        Vec::new()
    }
}

pub(crate) struct Inner {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub backend: Backend,
    pub comm: Box<dyn Communicator>,
    /// The next collective's sequence number; held for the whole collective, so collectives
    /// from several threads run one after the other, in the same order on every rank only if
    /// the program issues them in one order.
    pub seq: Mutex<u64>,
    pub store: Option<Arc<Store>>,
    /// Rank 0's store server: lives as long as the group.
    pub _server: Option<super::store::StoreServer>,
}

/// A group of ranks that run collectives together (`torch.distributed`'s process group).
///
/// Cheap to clone: clones share one group. Every rank must call the same collectives in the
/// same order, with tensors of the same shape and dtype; a mismatch is reported as
/// [`Error::Mismatch`] on every rank, and no data moves. A lost rank makes pending and later
/// collectives fail with [`Error::PeerLost`] naming it.
#[derive(Clone)]
pub struct ProcessGroup {
    pub(crate) inner: Arc<Inner>,
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.inner.rank)
            .field("world_size", &self.inner.world_size)
            .field("backend", &self.inner.backend)
            .finish()
    }
}

/// "f32 [4, 3]".
pub(crate) fn describe_tensor(t: &Tensor) -> String {
    format!("{} {:?}", t.dtype().as_str(), t.dims())
}

fn check_float(t: &Tensor) -> Result<()> {
    match t.dtype() {
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 => Ok(()),
        other => Err(Error::InvalidArgument {
            what: "collective dtype",
            detail: format!("{other:?} is not supported: collectives take f32, f64, f16 or bf16"),
        }),
    }
}

impl ProcessGroup {
    pub(crate) fn from_inner(inner: Inner) -> Self {
        Self {
            inner: Arc::new(inner),
        }
    }

    /// This process's rank, in `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.inner.world_size
    }

    /// This process's rank on its machine (`LOCAL_RANK`): the GPU to use.
    pub fn local_rank(&self) -> usize {
        self.inner.local_rank
    }

    /// The number of ranks on this machine (`LOCAL_WORLD_SIZE`).
    pub fn local_world_size(&self) -> usize {
        self.inner.local_world_size
    }

    /// The transport in use.
    pub fn backend(&self) -> Backend {
        self.inner.backend
    }

    /// How this rank reaches each rank of the group: `Some("tcp")`, `Some("unix")` (a
    /// Unix-domain socket to a rank on this machine), `Some("shm")` (shared memory for data, a
    /// Unix socket for control) or `None` (itself); empty for backends without per-peer links
    /// (in-process).
    pub fn transports(&self) -> Vec<Option<&'static str>> {
        self.inner.comm.transports()
    }

    /// The rendezvous store (absent for in-process groups).
    pub fn store(&self) -> Option<&Store> {
        self.inner.store.as_deref()
    }

    /// Runs one collective under the group's sequence lock. A call that is invalid on this rank
    /// still takes part in the agreement on its description, so the other ranks see a mismatch
    /// instead of waiting for this one.
    fn collective<T>(
        &self,
        desc: String,
        valid: Result<()>,
        f: impl FnOnce(u64, &str) -> Result<T>,
    ) -> Result<T> {
        let mut seq = lock(&self.inner.seq);
        *seq += 1;
        match valid {
            Ok(()) => f(*seq, &desc),
            Err(e) => {
                let invalid = format!("{desc} (invalid on this rank: {e})");
                self.inner.comm.check(*seq, &invalid)?;
                Err(e)
            }
        }
    }

    /// Combines `t` from every rank with `op`; every rank gets the result, on `t`'s device.
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let desc = format!("all_reduce({op}) {}", describe_tensor(t));
        let mut out = self.collective(desc, check_float(t), |seq, desc| {
            self.inner
                .comm
                .all_reduce(seq, desc, std::slice::from_ref(t), op)
        })?;
        Ok(out.remove(0))
    }

    /// All-reduces several tensors of one dtype as one collective (one NCCL group, one
    /// coalesced transfer over TCP); returns them in order.
    pub fn all_reduce_many(&self, ts: &[Tensor], op: ReduceOp) -> Result<Vec<Tensor>> {
        let valid = ts.iter().try_for_each(|t| {
            check_float(t)?;
            if t.dtype() != ts[0].dtype() {
                return Err(Error::InvalidArgument {
                    what: "all_reduce_many tensors",
                    detail: format!(
                        "dtypes {:?} and {:?} mixed; pass tensors of one dtype",
                        ts[0].dtype(),
                        t.dtype()
                    ),
                });
            }
            Ok(())
        });
        let parts: Vec<String> = ts.iter().map(describe_tensor).collect();
        let desc = format!("all_reduce_many({op}) [{}]", parts.join(", "));
        self.collective(desc, valid, |seq, desc| {
            self.inner.comm.all_reduce(seq, desc, ts, op)
        })
    }

    /// Every rank gets `root`'s tensor (the others' `t` gives the expected shape and dtype).
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let valid = check_float(t).and_then(|()| self.check_root(root));
        let desc = format!("broadcast(root {root}) {}", describe_tensor(t));
        self.collective(desc, valid, |seq, desc| {
            self.inner.comm.broadcast(seq, desc, t, root)
        })
    }

    /// Every rank gets every rank's `t`, in rank order.
    pub fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        let desc = format!("all_gather {}", describe_tensor(t));
        self.collective(desc, check_float(t), |seq, desc| {
            self.inner.comm.all_gather(seq, desc, t)
        })
    }

    /// Reduces `t` across ranks and gives rank `r` the `r`-th of `world_size` equal slices along
    /// dimension 0 (`torch.distributed.reduce_scatter_tensor`).
    pub fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let n = self.world_size();
        let rows = t.dims().first().copied().unwrap_or(0);
        let valid = check_float(t).and_then(|()| {
            if t.rank() == 0 || rows % n != 0 {
                return Err(Error::InvalidArgument {
                    what: "reduce_scatter input",
                    detail: format!(
                        "shape {:?}: dimension 0 must be divisible by the world size {n}",
                        t.dims()
                    ),
                });
            }
            Ok(())
        });
        let desc = format!("reduce_scatter({op}) {}", describe_tensor(t));
        self.collective(desc, valid, |seq, desc| {
            self.inner.comm.reduce_scatter(seq, desc, t, op)
        })
    }

    /// Returns once every rank has called `barrier`.
    pub fn barrier(&self) -> Result<()> {
        self.collective("barrier".into(), Ok(()), |seq, desc| {
            self.inner.comm.check(seq, desc)
        })
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.world_size() {
            return Err(Error::InvalidArgument {
                what: "broadcast root",
                detail: format!(
                    "rank {root} is not in the group of {} ranks",
                    self.world_size()
                ),
            });
        }
        Ok(())
    }
}
