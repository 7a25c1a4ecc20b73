//! `ProcessGroup`: the one face of the distributed layer. Its state, its constructors, and its
//! collectives, blocking and asynchronous.

use super::communicator::{Call, Communicator, Connected};
use super::config::{Backend, InitConfig};
use super::reduce_op::{check_dtype, ReduceOp};
use super::rendezvous::GroupPath;
use super::rendezvous::{config, Rendezvous};
use super::store::{Store, StoreServer};
use super::work::{Finished, Work, Worker};
use crate::error::{Error, Result};
use crate::util::sync::lock;
use candle_core::{Device, Tensor};
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

mod p2p;
pub use p2p::P2pOp;

/// Where this process stands in a group.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Membership {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
}

impl Membership {
    pub fn of(r: &Rendezvous) -> Self {
        Self {
            rank: r.rank,
            world_size: r.world_size,
            local_rank: r.local_rank,
            local_world_size: r.local_world_size,
        }
    }
}

struct GroupState {
    /// Declared first, so dropped first: it runs every issued collective to the end before the
    /// communicator goes.
    worker: Worker,
    comm: Arc<dyn Communicator>,
    membership: Membership,
    backend: Backend,
    /// Where received messages land.
    device: Device,
    path: GroupPath,
    /// How many point-to-point messages this rank has issued to and from each rank.
    p2p: Mutex<p2p::Counters>,
    store: Option<Arc<Store>>,
    /// Rank 0's store server lives as long as any group that needs it.
    store_server: Option<Arc<StoreServer>>,
    /// State that layers built on the group keep with it, one value per type.
    extensions: Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>,
}

impl Drop for GroupState {
    /// Before the group goes: when it holds rank 0's store server for the last time, the server
    /// stops taking new connections first (a rank connecting from now on belongs to the next
    /// job on this port and retries), then the peers say goodbye, then the server stops.
    fn drop(&mut self) {
        if let Some(server) = &self.store_server {
            if Arc::strong_count(server) == 1 {
                server.begin_closing();
            }
        }
    }
}

/// A group of ranks that run collectives together (`torch.distributed`'s process group).
///
/// Cheap to clone: clones share one group. Every rank must call the same collectives in the
/// same order, with tensors of the same shape and dtype; a mismatch is reported as
/// [`Error::Mismatch`] on every rank, and no data moves. A lost rank makes pending and later
/// collectives fail with [`Error::PeerLost`] naming it.
///
/// Each collective has a blocking form (`all_reduce`) and an asynchronous one
/// (`all_reduce_async`, returning a [`Work`]). Both run in the order they were issued on this
/// group, on a thread of the group's own; collectives on different groups (see
/// [`ProcessGroup::new_group`]) run independently, also at the same time.
#[derive(Clone)]
pub struct ProcessGroup {
    state: Arc<GroupState>,
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("backend", &self.backend())
            .finish()
    }
}

/// "f32 [4, 3]".
pub(crate) fn describe_tensor(t: &Tensor) -> String {
    format!("{} {:?}", t.dtype().as_str(), t.dims())
}

/// 1 where `t` is NaN, else 0 (-1 and 0 for `Min`), in `t`'s dtype: reduced with `op`, it is
/// non-zero exactly where some rank had a NaN.
fn nan_mask(t: &Tensor, op: ReduceOp) -> Result<Tensor> {
    let mask = t.ne(t)?.to_dtype(t.dtype())?;
    Ok(if op == ReduceOp::Min {
        mask.neg()?
    } else {
        mask
    })
}

/// `t` with NaN wherever the reduced `mask` is non-zero.
fn restore_nan(t: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let nan = t.ones_like()?.affine(0.0, f64::NAN)?;
    Ok(mask.ne(0.0)?.where_cond(&nan, t)?)
}

impl ProcessGroup {
    /// Joins the group described by the environment of the launcher that started this process
    /// (torchrun's, candle-run's, Slurm's, Open MPI's or MPICH's: [`Rendezvous::from_env`]),
    /// with the options `CANDLE_PARALLEL_*` variables set ([`InitConfig::from_env`]: the job
    /// token among them, else one from the launcher's job id, see
    /// [`Launcher::default_token`](super::Launcher::default_token)); the backend follows
    /// `device` (NCCL for CUDA with the `nccl` feature, else TCP) unless
    /// `CANDLE_PARALLEL_BACKEND` says otherwise. First, `OMP_NUM_THREADS` sizes the compute pool
    /// when `RAYON_NUM_THREADS` is unset ([`honour_omp_num_threads`](super::honour_omp_num_threads)).
    pub fn from_env(device: &Device) -> Result<Self> {
        if let Err(e) = super::check_threads_var(std::env::var(super::THREADS_VAR).ok().as_deref())
        {
            log::warn!("{e}");
        }
        super::honour_omp_num_threads();
        let rendezvous = Rendezvous::from_env()?;
        let mut options = InitConfig::from_env()?;
        if std::env::var_os(super::TOKEN_VAR).is_none() {
            options.token = rendezvous.launcher.default_token().unwrap_or_default();
        }
        Self::new(&rendezvous, device, options)
    }

    /// Joins the group at `tcp://host:port` as `rank` of `world_size`.
    pub fn from_url(
        url: &str,
        rank: usize,
        world_size: usize,
        device: &Device,
        options: InitConfig,
    ) -> Result<Self> {
        Self::new(
            &Rendezvous::from_url(url, rank, world_size)?,
            device,
            options,
        )
    }

    /// Joins the group described by `rendezvous`.
    pub fn new(rendezvous: &Rendezvous, device: &Device, options: InitConfig) -> Result<Self> {
        rendezvous.validate()?;
        let backend = options
            .backend
            .unwrap_or(if device.is_cuda() && cfg!(feature = "nccl") {
                Backend::Nccl
            } else {
                Backend::Tcp
            });
        let connected = match backend {
            Backend::Tcp => super::backends::host::connect(rendezvous, &options)?,
            Backend::InProcess => {
                return Err(config(
                    "backend",
                    "in-process groups are made by distributed::spawn_threads (ranks are \
                     threads of one process)",
                ))
            }
            #[cfg(feature = "nccl")]
            Backend::Nccl => super::backends::nccl::connect(rendezvous, device, &options)?,
            #[cfg(not(feature = "nccl"))]
            Backend::Nccl => {
                return Err(config(
                    "backend",
                    "NCCL needs candle-parallel built with the `nccl` feature",
                ))
            }
        };
        Self::assemble(
            Membership::of(rendezvous),
            backend,
            device,
            GroupPath::default(),
            connected,
        )
    }

    /// A group over a connected communicator: the one place a group's state is made.
    pub(crate) fn assemble(
        membership: Membership,
        backend: Backend,
        device: &Device,
        path: GroupPath,
        connected: Connected,
    ) -> Result<Self> {
        let name = format!("pg-{backend}-r{}{}", membership.rank, path.0);
        Ok(Self {
            state: Arc::new(GroupState {
                worker: Worker::start(name)?,
                comm: Arc::from(connected.comm),
                membership,
                backend,
                device: device.clone(),
                path,
                p2p: Mutex::new(p2p::Counters::new(membership.world_size)),
                store: connected.store,
                store_server: connected.server,
                extensions: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// This process's rank, in `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.state.membership.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.state.membership.world_size
    }

    /// This process's rank on its machine (`LOCAL_RANK`): the GPU to use.
    pub fn local_rank(&self) -> usize {
        self.state.membership.local_rank
    }

    /// The number of ranks on this machine (`LOCAL_WORLD_SIZE`).
    pub fn local_world_size(&self) -> usize {
        self.state.membership.local_world_size
    }

    /// The transport in use.
    pub fn backend(&self) -> Backend {
        self.state.backend
    }

    /// The device the group was made for: where [`recv`](Self::recv) puts what it receives
    /// (the CPU for [`spawn_threads`](super::spawn_threads)'s groups). Groups made by
    /// [`new_group`](Self::new_group) keep their parent's.
    pub fn device(&self) -> &Device {
        &self.state.device
    }

    /// How this rank reaches each rank of the group: `Some("tcp")`, `Some("unix")` (a
    /// Unix-domain socket to a rank on this machine), `Some("shm")` (shared memory for data, a
    /// Unix socket for control) or `None` (itself); empty for backends without per-peer links
    /// (in-process).
    pub fn transports(&self) -> Vec<Option<&'static str>> {
        self.state.comm.transports()
    }

    /// The TCP backend's all-reduce algorithm, as chosen when the group formed from
    /// [`InitConfig::algorithm`](super::InitConfig::algorithm) and the machines its ranks are
    /// on: [`Algorithm::Ring`](super::Algorithm::Ring) or
    /// [`Algorithm::Hierarchical`](super::Algorithm::Hierarchical); `None` for the other
    /// backends, which choose their own.
    pub fn algorithm(&self) -> Option<super::Algorithm> {
        self.state.comm.algorithm()
    }

    /// The rendezvous store (absent for in-process groups).
    pub fn store(&self) -> Option<&Store> {
        self.state.store.as_deref()
    }

    /// The value of type `T` this group keeps for the layers built on it (made with `Default`
    /// on first use); every clone of the group sees the same one.
    pub(crate) fn extension<T: Default + Send + Sync + 'static>(&self) -> Arc<T> {
        let mut map = lock(&self.state.extensions);
        let value = map
            .entry(TypeId::of::<T>())
            .or_insert_with(|| Arc::new(T::default()));
        value
            .clone()
            .downcast::<T>()
            .expect("keyed by its own type")
    }

    /// Whether `self` and `other` are the same group (clones of one another).
    pub fn same_group(&self, other: &ProcessGroup) -> bool {
        Arc::ptr_eq(&self.state, &other.state)
    }

    /// Issues one collective: numbers it and queues it behind the group's earlier calls. A call
    /// that is invalid on this rank fails here, and still takes part in the agreement on its
    /// description, so that the other ranks see a mismatch instead of waiting for this one.
    fn issue<T, F>(
        &self,
        desc: String,
        valid: Result<()>,
        inputs: &[Tensor],
        run: F,
    ) -> Result<Work<T>>
    where
        T: Send + 'static,
        F: FnOnce(&dyn Communicator, Call) -> Result<Finished<T>> + Send + 'static,
    {
        let comm = self.state.comm.clone();
        match valid.and_then(|()| comm.issue(inputs)) {
            Ok(mark) => Ok(self.state.worker.submit(desc.clone(), move |seq| {
                run(&*comm, Call { seq, desc, mark })
            })),
            Err(e) => {
                let desc = format!("{desc} (invalid on this rank: {e})");
                let check = self.state.worker.submit(desc.clone(), move |seq| {
                    let call = Call {
                        seq,
                        desc,
                        mark: None,
                    };
                    comm.check(&call).map(Finished::ready)
                });
                drop(check);
                Err(e)
            }
        }
    }

    /// Combines `t` from every rank with `op`; every rank gets the result, on `t`'s device.
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.all_reduce_async(t, op)?.wait()
    }

    /// [`ProcessGroup::all_reduce`], issued without waiting: returns at once.
    pub fn all_reduce_async(&self, t: &Tensor, op: ReduceOp) -> Result<Work<Tensor>> {
        let desc = format!("all_reduce({op}) {}", describe_tensor(t));
        let work =
            self.all_reduce_tensors(desc, check_dtype(t.dtype()), std::slice::from_ref(t), op)?;
        Ok(work.map(|mut v| Ok(v.remove(0))))
    }

    /// [`ProcessGroup::all_reduce_async`] of a tensor the caller gives up (nothing else reads
    /// or writes its storage until the work is waited for): the host backend reduces it in its
    /// own storage, with no new buffer. The result is `t` itself there, a new tensor elsewhere.
    pub(crate) fn all_reduce_owned_async(&self, t: Tensor, op: ReduceOp) -> Result<Work<Tensor>> {
        if matches!(op, ReduceOp::Max | ReduceOp::Min) && !self.state.comm.max_min_propagate_nan() {
            return self.all_reduce_async(&t, op);
        }
        let desc = format!("all_reduce({op}) {}", describe_tensor(&t));
        let inputs = [t.clone()];
        self.issue(desc, check_dtype(t.dtype()), &inputs, move |comm, call| {
            comm.all_reduce_owned(call, t, op)
        })
    }

    /// All-reduces several tensors of one dtype as one collective (one NCCL group, one
    /// coalesced transfer over TCP); returns them in order.
    pub fn all_reduce_many(&self, ts: &[Tensor], op: ReduceOp) -> Result<Vec<Tensor>> {
        self.all_reduce_many_async(ts, op)?.wait()
    }

    /// [`ProcessGroup::all_reduce_many`], issued without waiting: returns at once.
    pub fn all_reduce_many_async(&self, ts: &[Tensor], op: ReduceOp) -> Result<Work<Vec<Tensor>>> {
        let valid = ts.iter().try_for_each(|t| {
            check_dtype(t.dtype())?;
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
        self.all_reduce_tensors(desc, valid, ts, op)
    }

    /// Issues the all-reduce of `ts`. Where the backend's `Max`/`Min` drop NaN (NCCL), each
    /// tensor travels with a mask of its NaN positions (reduced in the same collective, by the
    /// same op), and the waiting thread puts NaN back where any rank had one.
    fn all_reduce_tensors(
        &self,
        desc: String,
        valid: Result<()>,
        ts: &[Tensor],
        op: ReduceOp,
    ) -> Result<Work<Vec<Tensor>>> {
        let masked = matches!(op, ReduceOp::Max | ReduceOp::Min)
            && valid.is_ok()
            && !self.state.comm.max_min_propagate_nan();
        let mut all = ts.to_vec();
        if masked {
            for t in ts {
                all.push(nan_mask(t, op)?);
            }
        }
        let inputs = all.clone();
        let work = self.issue(desc, valid, &inputs, move |comm, call| {
            comm.all_reduce(call, &all, op)
        })?;
        if !masked {
            return Ok(work);
        }
        let n = ts.len();
        Ok(work.map(move |mut reduced| {
            let masks = reduced.split_off(n);
            reduced
                .iter()
                .zip(&masks)
                .map(|(t, mask)| restore_nan(t, mask))
                .collect()
        }))
    }

    /// Every rank gets `root`'s tensor (the others' `t` gives the expected shape and dtype).
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.broadcast_async(t, root)?.wait()
    }

    /// [`ProcessGroup::broadcast`], issued without waiting: returns at once.
    pub fn broadcast_async(&self, t: &Tensor, root: usize) -> Result<Work<Tensor>> {
        let valid = check_dtype(t.dtype()).and_then(|()| self.check_rank(root, "broadcast root"));
        let desc = format!("broadcast(root {root}) {}", describe_tensor(t));
        let owned = t.clone();
        self.issue(desc, valid, std::slice::from_ref(t), move |comm, call| {
            comm.broadcast(call, &owned, root)
        })
    }

    /// Every rank gets every rank's `t`, in rank order.
    pub fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        self.all_gather_async(t)?.wait()
    }

    /// [`ProcessGroup::all_gather`], issued without waiting: returns at once.
    pub fn all_gather_async(&self, t: &Tensor) -> Result<Work<Vec<Tensor>>> {
        let desc = format!("all_gather {}", describe_tensor(t));
        let owned = t.clone();
        self.issue(
            desc,
            check_dtype(t.dtype()),
            std::slice::from_ref(t),
            move |comm, call| comm.all_gather(call, &owned),
        )
    }

    /// Reduces `t` across ranks and gives rank `r` the `r`-th of `world_size` equal slices along
    /// dimension 0 (`torch.distributed.reduce_scatter_tensor`).
    pub fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.reduce_scatter_async(t, op)?.wait()
    }

    /// [`ProcessGroup::reduce_scatter`], issued without waiting: returns at once.
    pub fn reduce_scatter_async(&self, t: &Tensor, op: ReduceOp) -> Result<Work<Tensor>> {
        let n = self.world_size();
        let rows = t.dims().first().copied().unwrap_or(0);
        let valid = check_dtype(t.dtype()).and_then(|()| {
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
        let owned = t.clone();
        self.issue(desc, valid, std::slice::from_ref(t), move |comm, call| {
            comm.reduce_scatter(call, &owned, op)
        })
    }

    /// Returns once every rank has called `barrier`.
    pub fn barrier(&self) -> Result<()> {
        self.barrier_async()?.wait()
    }

    /// [`ProcessGroup::barrier`], issued without waiting: the `Work` completes once every rank
    /// has issued its barrier.
    pub fn barrier_async(&self) -> Result<Work<()>> {
        self.issue("barrier".into(), Ok(()), &[], |comm, call| {
            comm.check(&call).map(Finished::ready)
        })
    }

    /// A group of the ranks `ranks` (torch's `new_group`): a channel of their own, whose
    /// collectives never interleave with this group's. Every rank of this group must call it,
    /// with the same list, in the same order relative to its other collectives; members get the
    /// new group, with ranks renumbered in list order (rank `ranks[i]` becomes rank `i`; torch
    /// sorts the list first, so pass it sorted to get torch's numbering), the others `None`.
    ///
    /// `new_group(&(0..world).collect::<Vec<_>>())` gives the whole world a second, independent
    /// group: DistributedDataParallel and SyncBatchNorm talk on groups of their own this way.
    ///
    /// ```rust
    /// use candle_core::{Device, Tensor};
    /// use candle_parallel::distributed::{self, ReduceOp};
    /// # fn main() -> candle_parallel::Result<()> {
    /// let sums = distributed::spawn_threads(3, |pg| {
    ///     let x = Tensor::new(&[pg.rank() as f32], &Device::Cpu)?;
    ///     match pg.new_group(&[0, 2])? {
    ///         Some(pair) => Ok(Some(pair.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?[0])),
    ///         None => Ok(None), // rank 1 is not a member
    ///     }
    /// })?;
    /// assert_eq!(sums, [Some(2.0), None, Some(2.0)]);
    /// # Ok(()) }
    /// ```
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        let valid = self.check_members(ranks);
        let desc = format!("new_group {ranks:?}");
        let members = ranks.to_vec();
        let parent = self.state.path.clone();
        let work = self.issue(desc, valid, &[], move |comm, call| {
            comm.check(&call)?;
            let path = parent.child(call.seq);
            let made = comm.split(&call, &members, &path)?;
            Ok(Finished::ready(made.map(|c| (c, path))))
        })?;
        let Some((connected, path)) = work.wait()? else {
            return Ok(None);
        };
        let rank = ranks
            .iter()
            .position(|&r| r == self.rank())
            .expect("the backend made a group for a member");
        let membership = Membership {
            rank,
            world_size: ranks.len(),
            ..self.state.membership
        };
        let connected = Connected {
            server: connected.server.or_else(|| self.state.store_server.clone()),
            ..connected
        };
        Self::assemble(membership, self.backend(), self.device(), path, connected).map(Some)
    }

    fn check_rank(&self, rank: usize, what: &'static str) -> Result<()> {
        if rank >= self.world_size() {
            return Err(Error::InvalidArgument {
                what,
                detail: format!(
                    "rank {rank} is not in the group of {} ranks",
                    self.world_size()
                ),
            });
        }
        Ok(())
    }

    fn check_members(&self, ranks: &[usize]) -> Result<()> {
        if ranks.is_empty() {
            return Err(Error::InvalidArgument {
                what: "new_group ranks",
                detail: "the list is empty; a group needs at least one rank".into(),
            });
        }
        for (i, &r) in ranks.iter().enumerate() {
            self.check_rank(r, "new_group rank")?;
            if ranks[..i].contains(&r) {
                return Err(Error::InvalidArgument {
                    what: "new_group ranks",
                    detail: format!("rank {r} is listed twice in {ranks:?}"),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nan_masks_restore_what_a_nan_dropping_max_or_min_lost() -> Result<()> {
        let cpu = Device::Cpu;
        let ranks = [
            [1.0f32, f32::NAN, 3.0, f32::NAN],
            [2.0, 0.5, f32::NAN, f32::NAN],
        ];
        for op in [ReduceOp::Max, ReduceOp::Min] {
            // What NCCL's kernels do (fmaxf / fminf, like Rust's f32::max / min): drop NaN.
            let dropping = |a: f32, b: f32| {
                if op == ReduceOp::Max {
                    a.max(b)
                } else {
                    a.min(b)
                }
            };
            let combine = |a: &[f32], b: &[f32]| -> Vec<f32> {
                a.iter().zip(b).map(|(&x, &y)| dropping(x, y)).collect()
            };
            let data = combine(&ranks[0], &ranks[1]);
            let masks = ranks
                .iter()
                .map(|r| {
                    nan_mask(&Tensor::new(r, &cpu)?, op)?
                        .to_vec1::<f32>()
                        .map_err(Into::into)
                })
                .collect::<Result<Vec<_>>>()?;
            let mask = combine(&masks[0], &masks[1]);
            let out = restore_nan(&Tensor::new(data, &cpu)?, &Tensor::new(mask, &cpu)?)?;
            let out = out.to_vec1::<f32>()?;
            let first = if op == ReduceOp::Max { 2.0 } else { 1.0 };
            assert_eq!(out[0], first, "{op}");
            assert!(out[1..].iter().all(|x| x.is_nan()), "{op}: {out:?}");
        }
        Ok(())
    }
}
