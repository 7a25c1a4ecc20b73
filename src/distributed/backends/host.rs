//! The host backend (`Backend::Tcp`): collectives in host memory over direct peer connections
//! (gloo's role).
//!
//! CPU tensors are used directly; CUDA tensors are staged through the host. Every collective
//! starts with the ranks' agreement on what is being called ([`consensus`]), then runs its
//! algorithm over the [`Mesh`]. Between ranks of one machine the mesh uses Unix-domain sockets,
//! and ring neighbours exchange data through shared memory. A lost peer is noted in the
//! launcher's error file ([`error_file`]).

use crate::distributed::algorithms::hierarchical::{self, Topology};
use crate::distributed::algorithms::{broadcast, consensus, exchange, ring, Links};
use crate::distributed::communicator::{
    run_host_batch, Call, Communicator, Connected, IssueMark, PointOp,
};
use crate::distributed::config::{Algorithm, InitConfig};
use crate::distributed::error_file;
use crate::distributed::rendezvous::world::{join_world, MeshContext};
use crate::distributed::rendezvous::GroupPath;
use crate::distributed::rendezvous::Rendezvous;
use crate::distributed::transport::conn::host_identity;
use crate::distributed::transport::host_buf::{with_bytes, with_slice_mut, HostBuf};
use crate::distributed::transport::mesh::Mesh;
use crate::distributed::transport::wire::FrameKind;
use crate::distributed::work::Finished;
use crate::distributed::ReduceOp;
use crate::error::{Error, Result};
use candle_core::{DType, Device, Shape, Tensor};
use std::sync::Arc;

/// Joins the job described by `r` and connects its TCP group.
pub(crate) fn connect(r: &Rendezvous, options: &InitConfig) -> Result<Connected> {
    let (joined, context, mesh) = join_world(r, options, Arc::new(error_file::note_loss))?;
    Ok(Connected {
        comm: Box::new(HostComm::new(mesh, context, true)?),
        store: Some(joined.store),
        server: joined.server,
    })
}

pub(crate) struct HostComm {
    mesh: Mesh,
    context: MeshContext,
    /// The machines of the group's ranks, when the all-reduce is hierarchical.
    hierarchy: Option<Topology>,
}

/// The sequence number of the exchange of machine identities when a group forms: collectives
/// are numbered from 1.
const TOPOLOGY_SEQ: u64 = 0;

/// A 64-bit FNV-1a hash: the same on every rank, whatever its build.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl HostComm {
    /// The communicator of a connected `mesh`. Learns which machine each rank is on (one
    /// all-gather of machine identities) and picks the all-reduce algorithm; `world` says
    /// whether this is the job's world group (whose choice rank 0 logs).
    fn new(mesh: Mesh, context: MeshContext, world: bool) -> Result<Self> {
        let hierarchy = match (context.options.algorithm, mesh.world()) {
            (Algorithm::Ring, _) | (_, 1) => None,
            (algorithm, n) => {
                let topology = Topology::from_hosts(&machines(&mesh, n)?);
                match algorithm {
                    Algorithm::Hierarchical if topology.uniform().is_none() => {
                        return Err(Error::Config {
                            what: "CANDLE_PARALLEL_ALGORITHM=hierarchical".into(),
                            detail: format!(
                                "the hierarchical all-reduce needs the same number of ranks on \
                                 every machine, and this group has {}; use `ring` or `auto`",
                                topology.describe()
                            ),
                        });
                    }
                    Algorithm::Hierarchical => Some(topology),
                    _ => topology.favours_hierarchy().then_some(topology),
                }
            }
        };
        if world && mesh.rank() == 0 {
            match &hierarchy {
                Some(t) => log::info!("all-reduce: hierarchical over {}", t.describe()),
                None => log::debug!("all-reduce: one ring through the {} ranks", mesh.world()),
            }
        }
        Ok(Self {
            mesh,
            context,
            hierarchy,
        })
    }

    /// `t` reduced with `op` across the group into a new buffer, `t` read where it lies.
    fn reduce_into_new(&self, seq: u64, t: &Tensor, op: ReduceOp) -> Result<HostBuf> {
        let mut out = HostBuf::zeros(t.dtype(), t.elem_count());
        with_bytes(t, |input| match &self.hierarchy {
            Some(h) => hierarchical::all_reduce(&self.mesh, h, seq, &mut out, input, op),
            None => ring::all_reduce(&self.mesh, seq, &mut out, input, op),
        })?;
        Ok(self.finish_average(out, op))
    }

    /// A reduced buffer as `op` wants it: the ring averages as it goes; the hierarchical
    /// all-reduce leaves the sum, divided here.
    fn finish_average(&self, mut out: HostBuf, op: ReduceOp) -> HostBuf {
        if op == ReduceOp::Avg && self.hierarchy.is_some() {
            out.divide(self.mesh.world());
        }
        out
    }
}

/// Every rank's machine, as a hash of its identity (boot id and network namespace); a rank
/// whose machine cannot be told counts as a machine of its own.
fn machines(mesh: &Mesh, n: usize) -> Result<Vec<u64>> {
    let r = mesh.rank();
    let mine = host_identity().map_or(u64::MAX - r as u64, |id| fnv1a(&id));
    // Raw bytes through a buffer of 8-byte elements: the all-gather only copies them.
    let mut buf = HostBuf::zeros(DType::F64, n);
    buf.bytes_mut(r..r + 1).copy_from_slice(&mine.to_le_bytes());
    ring::all_gather(mesh, TOPOLOGY_SEQ, &mut buf)?;
    Ok((0..n)
        .map(|p| u64::from_le_bytes(buf.bytes(p..p + 1).try_into().expect("8 bytes")))
        .collect())
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
        let out = if ts.len() == 1 {
            self.reduce_into_new(call.seq, first, op)?
        } else {
            let mut buf = HostBuf::concat(ts)?;
            match &self.hierarchy {
                Some(t) => {
                    hierarchical::all_reduce_in_place(&self.mesh, t, call.seq, &mut buf, op)?
                }
                None => ring::all_reduce_in_place(&self.mesh, call.seq, &mut buf, op)?,
            }
            self.finish_average(buf, op)
        };
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

    /// The ring in `t`'s own storage (no output buffer to fault in and zero) where `t` is a CPU
    /// tensor that spans its storage; else, as [`all_reduce`](Communicator::all_reduce) does
    /// for one tensor, into a fresh buffer (the ranks may differ in this: the frames are the
    /// same), and always so where the all-reduce is hierarchical.
    fn all_reduce_owned(&self, call: Call, t: Tensor, op: ReduceOp) -> Result<Finished<Tensor>> {
        consensus::check(&self.mesh, call.seq, &call.desc)?;
        let seq = call.seq;
        if self.hierarchy.is_none() {
            let reduced = with_slice_mut(&t, |s| ring::all_reduce_slice(&self.mesh, seq, s, op))?;
            if let Some(()) = reduced {
                return Ok(Finished::ready(t));
            }
        }
        let out = self.reduce_into_new(seq, &t, op)?;
        Ok(Finished::ready(out.into_tensor(t.shape(), t.device())?))
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

    /// Sends go out first (the peers' reader threads take them in whatever the peers are
    /// doing, so a send never waits for its receive), then the receives wait in order.
    fn p2p(
        &self,
        ops: Vec<PointOp>,
        device: &Device,
        _: Option<IssueMark>,
    ) -> Result<Finished<Vec<Option<Tensor>>>> {
        let me = self.mesh.rank();
        let mesh = &self.mesh;
        run_host_batch(
            ops,
            |peer, seq, t| exchange::send(mesh, peer, FrameKind::P2p, seq, t),
            |peer, seq, expect| {
                let meta = exchange::recv_meta(mesh, peer, FrameKind::P2p, seq)?;
                Ok(
                    match exchange::check_expected(expect.as_ref(), &meta, peer, me, seq) {
                        Ok(()) => Ok(exchange::recv_body(
                            mesh,
                            peer,
                            FrameKind::P2p,
                            seq,
                            &meta,
                            device,
                        )?),
                        Err(e) => {
                            // Consumed all the same: the next message from `peer` must find
                            // its way.
                            exchange::skip_body(mesh, peer, FrameKind::P2p, seq, &meta)?;
                            Err(e)
                        }
                    },
                )
            },
        )
    }

    fn all_to_all(&self, call: Call, inputs: &[Tensor]) -> Result<Finished<Vec<Tensor>>> {
        consensus::check(&self.mesh, call.seq, &call.desc)?;
        let (n, me) = (self.mesh.world(), self.mesh.rank());
        // Each rank starts with its next neighbour, so that no rank is everyone's first.
        for p in (1..n).map(|k| (me + k) % n) {
            exchange::send(&self.mesh, p, FrameKind::Exchange, call.seq, &inputs[p])?;
        }
        let device = inputs[me].device();
        let out = (0..n)
            .map(|p| {
                if p == me {
                    return Ok(inputs[me].copy()?);
                }
                let meta = exchange::recv_meta(&self.mesh, p, FrameKind::Exchange, call.seq)?;
                exchange::recv_body(&self.mesh, p, FrameKind::Exchange, call.seq, &meta, device)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Finished::ready(out))
    }

    fn split(&self, _: &Call, members: &[usize], path: &GroupPath) -> Result<Option<Connected>> {
        let Some(rank) = members.iter().position(|&r| r == self.mesh.rank()) else {
            return Ok(None);
        };
        let (store, mesh) = self.context.connect_group(rank, members.len(), path)?;
        Ok(Some(Connected {
            comm: Box::new(HostComm::new(mesh, self.context.clone(), false)?),
            store: Some(store),
            server: None,
        }))
    }

    fn transports(&self) -> Vec<Option<&'static str>> {
        self.mesh.transports()
    }

    fn algorithm(&self) -> Option<Algorithm> {
        Some(match self.hierarchy {
            Some(_) => Algorithm::Hierarchical,
            None => Algorithm::Ring,
        })
    }
}
