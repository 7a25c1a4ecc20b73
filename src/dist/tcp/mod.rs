//! The TCP backend: collectives in host memory over direct peer connections (gloo's role).
//!
//! CPU tensors are used directly; CUDA tensors are staged through the host. Every collective
//! starts with the ranks' agreement on what is being called ([`consensus`]), then runs its
//! algorithm over the [`Mesh`].

pub(crate) mod conn;
pub(crate) mod connect;
pub(crate) mod mesh;
#[cfg(target_os = "linux")]
pub(crate) mod shm;

use super::algorithms::{broadcast, consensus, ring, Links};
use super::element::{with_bytes, HostBuf};
use super::group::Communicator;
use super::ReduceOp;
use crate::error::Result;
use candle_core::{Shape, Tensor};
pub(crate) use mesh::Mesh;

pub(crate) struct TcpComm {
    pub mesh: Mesh,
}

impl Communicator for TcpComm {
    fn all_reduce(&self, seq: u64, desc: &str, ts: &[Tensor], op: ReduceOp) -> Result<Vec<Tensor>> {
        consensus::check(&self.mesh, seq, desc)?;
        let Some(first) = ts.first() else {
            return Ok(Vec::new());
        };
        // Coalesce: one transfer for all tensors.
        let flat = if ts.len() == 1 {
            first.flatten_all()?
        } else {
            let parts = ts
                .iter()
                .map(|t| t.flatten_all())
                .collect::<candle_core::Result<Vec<_>>>()?;
            Tensor::cat(&parts, 0)?
        };
        let mut out = HostBuf::zeros(flat.dtype(), flat.elem_count());
        with_bytes(&flat, |input| {
            ring::all_reduce(&self.mesh, seq, &mut out, input, op)
        })?;
        if op == ReduceOp::Avg {
            out.divide(self.mesh.world());
        }
        let all = out.into_tensor(flat.shape(), first.device())?;
        let mut offset = 0;
        ts.iter()
            .map(|t| {
                let n = t.elem_count();
                let part = all.narrow(0, offset, n)?.reshape(t.shape())?;
                offset += n;
                Ok(part)
            })
            .collect()
    }

    fn broadcast(&self, seq: u64, desc: &str, t: &Tensor, root: usize) -> Result<Tensor> {
        consensus::check(&self.mesh, seq, desc)?;
        let mut out = HostBuf::zeros(t.dtype(), t.elem_count());
        if self.mesh.rank() == root {
            with_bytes(t, |mine| {
                out.bytes_mut(0..t.elem_count()).copy_from_slice(mine);
                Ok(())
            })?;
        }
        broadcast::broadcast(&self.mesh, seq, &mut out, root)?;
        out.into_tensor(t.shape(), t.device())
    }

    fn all_gather(&self, seq: u64, desc: &str, t: &Tensor) -> Result<Vec<Tensor>> {
        consensus::check(&self.mesh, seq, desc)?;
        let (n, r, m) = (self.mesh.world(), self.mesh.rank(), t.elem_count());
        let mut buf = HostBuf::zeros(t.dtype(), n * m);
        with_bytes(t, |mine| {
            buf.bytes_mut(r * m..(r + 1) * m).copy_from_slice(mine);
            Ok(())
        })?;
        ring::all_gather(&self.mesh, seq, &mut buf)?;
        let all = buf.into_tensor(&Shape::from(n * m), t.device())?;
        (0..n)
            .map(|i| Ok(all.narrow(0, i * m, m)?.reshape(t.shape())?))
            .collect()
    }

    fn reduce_scatter(&self, seq: u64, desc: &str, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        consensus::check(&self.mesh, seq, desc)?;
        let (n, r) = (self.mesh.world(), self.mesh.rank());
        let len = t.elem_count();
        let mut out = HostBuf::zeros(t.dtype(), len);
        with_bytes(t, |input| {
            ring::reduce_scatter(&self.mesh, seq, &mut out, input, op)
        })?;
        let mut mine = out.slice(r * len / n..(r + 1) * len / n);
        if op == ReduceOp::Avg {
            mine.divide(n);
        }
        let mut dims = t.dims().to_vec();
        dims[0] /= n;
        mine.into_tensor(&Shape::from(dims), t.device())
    }

    fn check(&self, seq: u64, desc: &str) -> Result<()> {
        consensus::check(&self.mesh, seq, desc)
    }

    fn transports(&self) -> Vec<Option<&'static str>> {
        self.mesh.transports()
    }
}
