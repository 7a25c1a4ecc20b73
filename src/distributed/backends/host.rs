//! The host backend (`Backend::Tcp`): collectives in host memory over direct peer connections
//! (gloo's role).
//!
//! CPU tensors are used directly; CUDA tensors are staged through the host. Every collective
//! starts with the ranks' agreement on what is being called ([`consensus`]), then runs its
//! algorithm over the [`Mesh`]. Between ranks of one machine the mesh uses Unix-domain sockets,
//! and ring neighbours exchange data through shared memory. A lost peer is noted in the
//! launcher's error file ([`error_file`]).

use crate::distributed::algorithms::{broadcast, consensus, ring, Links};
use crate::distributed::communicator::{Call, Communicator, Connected};
use crate::distributed::config::InitConfig;
use crate::distributed::error_file;
use crate::distributed::rendezvous::world::{join_world, MeshContext};
use crate::distributed::rendezvous::GroupPath;
use crate::distributed::rendezvous::Rendezvous;
use crate::distributed::transport::host_buf::{with_bytes, HostBuf};
use crate::distributed::transport::mesh::Mesh;
use crate::distributed::work::Finished;
use crate::distributed::ReduceOp;
use crate::error::Result;
use candle_core::{Shape, Tensor};
use std::sync::Arc;

/// Joins the job described by `r` and connects its TCP group.
pub(crate) fn connect(r: &Rendezvous, options: &InitConfig) -> Result<Connected> {
    let (joined, context, mesh) = join_world(r, options, Arc::new(error_file::note_loss))?;
    Ok(Connected {
        comm: Box::new(HostComm { mesh, context }),
        store: Some(joined.store),
        server: joined.server,
    })
}

pub(crate) struct HostComm {
    mesh: Mesh,
    context: MeshContext,
}

impl Communicator for HostComm {
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
            comm: Box::new(HostComm {
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
