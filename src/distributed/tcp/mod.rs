//! The TCP backend: collectives in host memory over direct peer connections (gloo's role).
//!
//! CPU tensors are used directly; CUDA tensors are staged through the host. Every collective
//! starts with the ranks' agreement on what is being called ([`consensus`]), then runs its
//! algorithm over the [`Mesh`]. Between ranks of one machine the mesh uses Unix-domain sockets,
//! and ring neighbours exchange data through shared memory ([`shm`]).

pub(crate) mod conn;
pub(crate) mod connect;
pub(crate) mod mesh;
#[cfg(target_os = "linux")]
pub(crate) mod shm;

use super::algorithms::{broadcast, consensus, ring, Links};
use super::communicator::{Call, Communicator, Connected, GroupPath};
use super::host_buf::{with_bytes, HostBuf};
use super::join::{join, Joined};
use super::options::InitOptions;
use super::rendezvous::Rendezvous;
use super::store::Store;
use super::work::Finished;
use super::ReduceOp;
use crate::error::Result;
use candle_core::{Shape, Tensor};
use connect::{connect_mesh, Identity};
pub(crate) use mesh::Mesh;
use mesh::MeshOptions;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

/// What it takes to connect a mesh of this job: for the world group, and again for every group
/// made from it.
#[derive(Clone)]
pub(crate) struct MeshContext {
    pub store_addr: SocketAddr,
    /// The interface that reaches the master, where peers reach this rank too.
    pub local_ip: IpAddr,
    pub options: InitOptions,
    /// The job's id (the world group's).
    pub job: u64,
    /// This rank in the world group, which names it to the store.
    pub world_rank: usize,
}

impl MeshContext {
    /// Connects `rank` of the `world` ranks of group `path` through `store`.
    pub fn connect(
        &self,
        store: &Store,
        path: &GroupPath,
        rank: usize,
        world: usize,
    ) -> Result<Mesh> {
        let prefix = path.store_prefix();
        let me = Identity {
            rank,
            world,
            token: &self.options.token,
            job: path.id_within(self.job),
            unix: self.options.unix_sockets,
            shm: self.options.shared_memory,
            prefix: &prefix,
        };
        let mesh_options = MeshOptions {
            timeout: self.options.timeout,
            peer_timeout: self.options.peer_timeout,
        };
        connect_mesh(
            store,
            self.local_ip,
            &me,
            self.options.rendezvous_timeout,
            mesh_options,
        )
    }

    /// Connects this rank as `rank` of the `world` ranks of group `path`: the group's own
    /// store connection (so that another group's long store waits never delay this one's) and
    /// its mesh.
    pub fn connect_group(
        &self,
        rank: usize,
        world: usize,
        path: &GroupPath,
    ) -> Result<(Arc<Store>, Mesh)> {
        let store = Arc::new(Store::connect(
            self.store_addr,
            &self.options.token,
            self.world_rank,
            self.options.rendezvous_timeout,
        )?);
        let mesh = self.connect(&store, path, rank, world)?;
        Ok((store, mesh))
    }
}

/// Joins the job described by `r` and connects the world group's mesh, which every backend
/// stands on (TCP carries its data over it; NCCL its agreement and failure detection). A rank
/// that cannot connect tells the others through the store.
pub(crate) fn join_world(
    r: &Rendezvous,
    options: &InitOptions,
) -> Result<(Joined, MeshContext, Mesh)> {
    let joined = join(r, options)?;
    let context = MeshContext {
        store_addr: joined.store.addr(),
        local_ip: joined.store.local_addr().ip(),
        options: options.clone(),
        job: joined.job,
        world_rank: r.rank,
    };
    let mesh = context
        .connect(&joined.store, &GroupPath::default(), r.rank, r.world_size)
        .inspect_err(|e| {
            joined
                .store
                .abort(&format!("rank {} could not join: {e}", r.rank))
        })?;
    Ok((joined, context, mesh))
}

/// Joins the job described by `r` and connects its TCP group.
pub(crate) fn connect(r: &Rendezvous, options: &InitOptions) -> Result<Connected> {
    let (joined, context, mesh) = join_world(r, options)?;
    Ok(Connected {
        comm: Box::new(TcpComm { mesh, context }),
        store: Some(joined.store),
        server: joined.server,
    })
}

pub(crate) struct TcpComm {
    mesh: Mesh,
    context: MeshContext,
}

impl Communicator for TcpComm {
    fn all_reduce(&self, call: Call, ts: &[Tensor], op: ReduceOp) -> Result<Finished<Vec<Tensor>>> {
        consensus::check(&self.mesh, call.seq, &call.desc)?;
        let Some(first) = ts.first() else {
            return Ok(Finished::ready(Vec::new()));
        };
        // Coalesce: one transfer for all tensors. Several are gathered into a buffer of our
        // own and reduced in it; a single one is read where it lies (it is the caller's).
        let len = ts.iter().map(Tensor::elem_count).sum::<usize>();
        let mut out = if ts.len() == 1 {
            let mut out = HostBuf::zeros(first.dtype(), len);
            with_bytes(first, |input| {
                ring::all_reduce(&self.mesh, call.seq, &mut out, input, op)
            })?;
            out
        } else {
            let mut buf = HostBuf::concat(ts)?;
            ring::all_reduce_in_place(&self.mesh, call.seq, &mut buf, op)?;
            buf
        };
        if op == ReduceOp::Avg {
            out.divide(self.mesh.world());
        }
        let all = out.into_tensor(&Shape::from(len), first.device())?;
        let mut offset = 0;
        let parts = ts
            .iter()
            .map(|t| {
                let n = t.elem_count();
                let part = all.narrow(0, offset, n)?.reshape(t.shape())?;
                offset += n;
                Ok(part)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Finished::ready(parts))
    }

    fn broadcast(&self, call: Call, t: &Tensor, root: usize) -> Result<Finished<Tensor>> {
        consensus::check(&self.mesh, call.seq, &call.desc)?;
        let mut out = HostBuf::zeros(t.dtype(), t.elem_count());
        if self.mesh.rank() == root {
            with_bytes(t, |mine| {
                out.bytes_mut(0..t.elem_count()).copy_from_slice(mine);
                Ok(())
            })?;
        }
        broadcast::broadcast(&self.mesh, call.seq, &mut out, root)?;
        Ok(Finished::ready(out.into_tensor(t.shape(), t.device())?))
    }

    fn all_gather(&self, call: Call, t: &Tensor) -> Result<Finished<Vec<Tensor>>> {
        consensus::check(&self.mesh, call.seq, &call.desc)?;
        let (n, r, m) = (self.mesh.world(), self.mesh.rank(), t.elem_count());
        let mut buf = HostBuf::zeros(t.dtype(), n * m);
        with_bytes(t, |mine| {
            buf.bytes_mut(r * m..(r + 1) * m).copy_from_slice(mine);
            Ok(())
        })?;
        ring::all_gather(&self.mesh, call.seq, &mut buf)?;
        let all = buf.into_tensor(&Shape::from(n * m), t.device())?;
        let parts = (0..n)
            .map(|i| Ok(all.narrow(0, i * m, m)?.reshape(t.shape())?))
            .collect::<Result<Vec<_>>>()?;
        Ok(Finished::ready(parts))
    }

    fn reduce_scatter(&self, call: Call, t: &Tensor, op: ReduceOp) -> Result<Finished<Tensor>> {
        consensus::check(&self.mesh, call.seq, &call.desc)?;
        let (n, r) = (self.mesh.world(), self.mesh.rank());
        let len = t.elem_count();
        let mut out = HostBuf::zeros(t.dtype(), len);
        with_bytes(t, |input| {
            ring::reduce_scatter(&self.mesh, call.seq, &mut out, input, op)
        })?;
        let mut mine = out.slice(r * len / n..(r + 1) * len / n);
        if op == ReduceOp::Avg {
            mine.divide(n);
        }
        let mut dims = t.dims().to_vec();
        dims[0] /= n;
        Ok(Finished::ready(
            mine.into_tensor(&Shape::from(dims), t.device())?,
        ))
    }

    fn check(&self, call: &Call) -> Result<()> {
        consensus::check(&self.mesh, call.seq, &call.desc)
    }

    fn split(&self, _: &Call, members: &[usize], path: &GroupPath) -> Result<Option<Connected>> {
        let Some(rank) = members.iter().position(|&r| r == self.mesh.rank()) else {
            return Ok(None);
        };
        let (store, mesh) = self.context.connect_group(rank, members.len(), path)?;
        Ok(Some(Connected {
            comm: Box::new(TcpComm {
                mesh,
                context: self.context.clone(),
            }),
            store: Some(store),
            server: None,
        }))
    }

    fn transports(&self) -> Vec<Option<&'static str>> {
        self.mesh.transports()
    }
}
