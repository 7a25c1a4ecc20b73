//! The NCCL backend: collectives on GPUs, on candle's own CUDA stream.
//!
//! Each collective is enqueued on the stream of the tensor's candle device, so it is ordered
//! with candle's kernels and the host never waits for it. The NCCL unique id travels through the
//! store. A TCP mesh beside the communicator carries the cross-rank agreement on every call
//! (so mismatches fail on every rank instead of hanging the GPU) and watches the peers: when one
//! is lost, a watchdog aborts the communicator, which releases kernels waiting for the dead
//! peer, and every later call fails naming it.
//!
//! We hold the raw communicator rather than cudarc's `Comm`, which keeps it private: the
//! watchdog needs it to call `ncclCommAbort` from its own thread.

use super::algorithms::consensus;
use super::algorithms::Links;
use super::group::{Backend, Communicator, InitOptions, Inner, ProcessGroup};
use super::meet::{form_mesh, meet};
use super::rendezvous::Rendezvous;
use super::tcp::mesh::Broken;
use super::tcp::Mesh;
use super::ReduceOp;
use crate::error::{device_name, Error, Result};
use crate::sync::lock;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::cudarc::nccl::{result, sys};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{CudaDevice, CudaStorage, Device, Layout, Shape, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// A raw NCCL communicator.
struct RawComm(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap; every use goes through the `Mutex` in `Shared`, including the watchdog's abort.
unsafe impl Send for RawComm {}

struct Shared {
    /// `None` once aborted: an aborted communicator must never be used again.
    comm: Mutex<Option<RawComm>>,
    stream: Arc<CudaStream>,
}

impl Shared {
    fn abort(&self) {
        if let Some(c) = lock(&self.comm).take() {
            let _ = self.stream.context().bind_to_thread();
            // SAFETY: the communicator is valid (not yet aborted) and no call is in flight on
            // it: we hold the lock every call holds.
            let _ = unsafe { result::comm_abort(c.0) };
        }
    }

    /// An error NCCL reported asynchronously (a network failure inside NCCL), if any.
    fn async_error(&self) -> Option<sys::ncclResult_t> {
        let guard = lock(&self.comm);
        let c = guard.as_ref()?;
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: valid communicator, serialised by the lock.
        unsafe { sys::ncclCommGetAsyncError(c.0, &mut state) };
        match state {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => None,
            e => Some(e),
        }
    }
}

pub(crate) struct NcclComm {
    shared: Arc<Shared>,
    mesh: Arc<Mesh>,
    device: CudaDevice,
    stop: Arc<AtomicBool>,
    watchdog: Option<JoinHandle<()>>,
}

/// What one NCCL call does.
#[derive(Clone, Copy)]
enum Call {
    AllReduce(ReduceOp),
    Broadcast(usize),
    AllGather,
    ReduceScatter(ReduceOp),
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
        ReduceOp::Product => sys::ncclRedOp_t::ncclProd,
    }
}

/// One NCCL call as a candle custom op, so that it reads and writes candle's own buffers.
struct NcclOp<'a> {
    call: Call,
    comm: sys::ncclComm_t,
    stream: &'a CudaStream,
    world: usize,
}

impl NcclOp<'_> {
    fn output_len(&self, count: usize) -> usize {
        match self.call {
            Call::AllGather => count * self.world,
            Call::ReduceScatter(_) => count / self.world,
            Call::AllReduce(_) | Call::Broadcast(_) => count,
        }
    }

    fn output_shape(&self, shape: &Shape) -> Shape {
        match self.call {
            Call::AllGather => Shape::from(shape.elem_count() * self.world),
            Call::ReduceScatter(_) => {
                let mut dims = shape.dims().to_vec();
                dims[0] /= self.world;
                Shape::from(dims)
            }
            Call::AllReduce(_) | Call::Broadcast(_) => shape.clone(),
        }
    }

    /// Enqueues the call from `src` (`count` elements) into `dst`.
    fn enqueue<T, S, D>(
        &self,
        src: &S,
        dst: &mut D,
        count: usize,
        dt: sys::ncclDataType_t,
    ) -> candle_core::Result<()>
    where
        S: DevicePtr<T>,
        D: DevicePtrMut<T>,
    {
        let (sp, _read) = src.device_ptr(self.stream);
        let (dp, _write) = dst.device_ptr_mut(self.stream);
        let (sp, dp) = (sp as *const std::ffi::c_void, dp as *mut std::ffi::c_void);
        let st = self.stream.cu_stream() as sys::cudaStream_t;
        // SAFETY: `sp` holds `count` elements and `dp` `output_len(count)` elements of the type
        // `dt` names, both on the communicator's device; the guards keep them alive and ordered
        // on `stream` until the call is enqueued.
        let status = unsafe {
            match self.call {
                Call::AllReduce(op) => {
                    result::all_reduce(sp, dp, count, dt, nccl_op(op), self.comm, st)
                }
                Call::Broadcast(root) => {
                    result::broadcast(sp, dp, count, dt, root as i32, self.comm, st)
                }
                Call::AllGather => result::all_gather(sp, dp, count, dt, self.comm, st),
                Call::ReduceScatter(op) => result::reduce_scatter(
                    sp,
                    dp,
                    count / self.world,
                    dt,
                    nccl_op(op),
                    self.comm,
                    st,
                ),
            }
        };
        status.map(|_| ()).map_err(|e| {
            candle_core::Error::wrap(Error::Nccl {
                op: "collective",
                detail: format!("{e:?}"),
            })
        })
    }
}

impl candle_core::CustomOp1 for NcclOp<'_> {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!(
            "NCCL collectives need CUDA tensors; use the TCP backend for CPU tensors"
        )
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("NCCL needs a contiguous tensor")
        };
        let count = end - start;
        let out = self.output_len(count);
        let dev = s.device();
        macro_rules! run {
            ($src:expr, $t:ty, $variant:ident, $dt:ident) => {{
                let src = $src.slice(start..end);
                // SAFETY: NCCL writes every element of the output before anything reads it.
                let mut dst = unsafe { dev.alloc::<$t>(out)? };
                self.enqueue(&src, &mut dst, count, sys::ncclDataType_t::$dt)?;
                CudaStorageSlice::$variant(dst)
            }};
        }
        let slice = match &s.slice {
            CudaStorageSlice::F32(x) => run!(x, f32, F32, ncclFloat32),
            CudaStorageSlice::F64(x) => run!(x, f64, F64, ncclFloat64),
            CudaStorageSlice::F16(x) => run!(x, half::f16, F16, ncclFloat16),
            CudaStorageSlice::BF16(x) => run!(x, half::bf16, BF16, ncclBfloat16),
            _ => candle_core::bail!("NCCL collectives take f32, f64, f16 or bf16 tensors"),
        };
        let storage = CudaStorage {
            slice,
            device: dev.clone(),
        };
        Ok((storage, self.output_shape(l.shape())))
    }
}

impl NcclComm {
    /// Agrees on the call (an invalid one on this rank still takes part) and returns the live
    /// communicator, locked.
    fn ready(
        &self,
        seq: u64,
        desc: &str,
        ts: &[&Tensor],
    ) -> Result<std::sync::MutexGuard<'_, Option<RawComm>>> {
        let here = Device::Cuda(self.device.clone());
        if let Some(t) = ts.iter().find(|t| !t.device().same_device(&here)) {
            let e = Error::InvalidArgument {
                what: "NCCL tensor device",
                detail: format!(
                    "the tensor is on {} but the group's device is {}; move it there first (the \
                     same candle Device instance)",
                    device_name(t.device()),
                    device_name(&here)
                ),
            };
            consensus::check(
                &*self.mesh,
                seq,
                &format!("{desc} (invalid on this rank: {e})"),
            )?;
            return Err(e);
        }
        consensus::check(&*self.mesh, seq, desc)?;
        let guard = lock(&self.shared.comm);
        if guard.is_none() {
            self.mesh.usable()?;
            return Err(Error::Aborted {
                reason: "the NCCL communicator was aborted".into(),
            });
        }
        self.shared
            .stream
            .context()
            .bind_to_thread()
            .map_err(|e| Error::Nccl {
                op: "binding the CUDA context",
                detail: format!("{e:?}"),
            })?;
        Ok(guard)
    }

    /// Runs `call` on every tensor of `ts` inside one NCCL group.
    fn run(&self, seq: u64, desc: &str, ts: &[&Tensor], call: Call) -> Result<Vec<Tensor>> {
        let guard = self.ready(seq, desc, ts)?;
        let comm = guard.as_ref().expect("checked by ready").0;
        let op = NcclOp {
            call,
            comm,
            stream: &self.shared.stream,
            world: self.mesh.world(),
        };
        let grouped = ts.len() > 1;
        if grouped {
            result::group_start().map_err(|e| self.failed("ncclGroupStart", e))?;
        }
        let outs: candle_core::Result<Vec<Tensor>> = ts
            .iter()
            .map(|t| t.contiguous()?.apply_op1_no_bwd(&op))
            .collect();
        if grouped {
            result::group_end().map_err(|e| self.failed("ncclGroupEnd", e))?;
        }
        drop(guard);
        outs.map_err(|e| {
            self.mesh.fail(Broken {
                lost: None,
                detail: format!("an NCCL call failed on rank {}: {e}", self.mesh.rank()),
            });
            Error::from(e)
        })
    }

    fn failed(&self, op: &'static str, e: result::NcclError) -> Error {
        let detail = format!("{e:?}");
        self.mesh.fail(Broken {
            lost: None,
            detail: format!("{op} failed on rank {}: {detail}", self.mesh.rank()),
        });
        Error::Nccl { op, detail }
    }
}

impl Communicator for NcclComm {
    fn all_reduce(&self, seq: u64, desc: &str, ts: &[Tensor], op: ReduceOp) -> Result<Vec<Tensor>> {
        let refs: Vec<&Tensor> = ts.iter().collect();
        self.run(seq, desc, &refs, Call::AllReduce(op))
    }

    fn broadcast(&self, seq: u64, desc: &str, t: &Tensor, root: usize) -> Result<Tensor> {
        Ok(self.run(seq, desc, &[t], Call::Broadcast(root))?.remove(0))
    }

    fn all_gather(&self, seq: u64, desc: &str, t: &Tensor) -> Result<Vec<Tensor>> {
        let all = self.run(seq, desc, &[t], Call::AllGather)?.remove(0);
        let m = t.elem_count();
        (0..self.mesh.world())
            .map(|i| Ok(all.narrow(0, i * m, m)?.reshape(t.shape())?))
            .collect()
    }

    fn reduce_scatter(&self, seq: u64, desc: &str, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        Ok(self
            .run(seq, desc, &[t], Call::ReduceScatter(op))?
            .remove(0))
    }

    fn check(&self, seq: u64, desc: &str) -> Result<()> {
        consensus::check(&*self.mesh, seq, desc)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        // Abort rather than destroy: destroying waits for pending work, which never ends when
        // a peer is gone.
        self.shared.abort();
    }
}

/// Watches the peers and NCCL's own error state; aborts the communicator when either fails.
fn watchdog(shared: Arc<Shared>, mesh: Arc<Mesh>, stop: Arc<AtomicBool>) {
    let _ = shared.stream.context().bind_to_thread();
    while !stop.load(Ordering::SeqCst) {
        if mesh.usable().is_err() {
            shared.abort();
            return;
        }
        if let Some(e) = shared.async_error() {
            mesh.fail(Broken {
                lost: None,
                detail: format!("NCCL reported an asynchronous error: {e:?}"),
            });
            shared.abort();
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Creates an NCCL process group on `device`, one GPU per rank.
pub(crate) fn nccl_group(
    r: &Rendezvous,
    device: &Device,
    options: &InitOptions,
) -> Result<ProcessGroup> {
    let Device::Cuda(cuda) = device else {
        return Err(Error::Config {
            what: "backend".into(),
            detail: format!(
                "NCCL needs a CUDA device but got {}; use Backend::Tcp for CPU tensors",
                device_name(device)
            ),
        });
    };
    let meeting = meet(r, options)?;
    let mesh = Arc::new(form_mesh(r, options, &meeting)?);
    let id = if r.rank == 0 {
        let id = result::get_uniqueid().map_err(|e| Error::Nccl {
            op: "ncclGetUniqueId",
            detail: format!("{e:?}"),
        })?;
        let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
        meeting.store.set("nccl/id", &bytes)?;
        id
    } else {
        let bytes = meeting.store.get("nccl/id", options.rendezvous_timeout)?;
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        if bytes.len() != id.internal.len() {
            return Err(Error::Rendezvous {
                detail: format!(
                    "the NCCL unique id in the store has {} bytes, not 128",
                    bytes.len()
                ),
            });
        }
        for (d, &s) in id.internal.iter_mut().zip(&bytes) {
            *d = s as std::ffi::c_char;
        }
        id
    };
    let stream = cuda.cuda_stream();
    stream.context().bind_to_thread().map_err(|e| Error::Nccl {
        op: "binding the CUDA context",
        detail: format!("{e:?}"),
    })?;
    let mut comm = std::mem::MaybeUninit::uninit();
    // SAFETY: `comm` is written by a successful init, which we check before reading it.
    let comm = unsafe {
        result::comm_init_rank(comm.as_mut_ptr(), r.world_size as i32, id, r.rank as i32).map_err(
            |e| Error::Nccl {
                op: "ncclCommInitRank",
                detail: format!("{e:?}"),
            },
        )?;
        comm.assume_init()
    };
    let shared = Arc::new(Shared {
        comm: Mutex::new(Some(RawComm(comm))),
        stream,
    });
    let stop = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let (shared, mesh, stop) = (shared.clone(), mesh.clone(), stop.clone());
        std::thread::Builder::new()
            .name("nccl-watchdog".into())
            .spawn(move || watchdog(shared, mesh, stop))
            .map_err(|source| Error::Io {
                context: "starting the NCCL watchdog".into(),
                source,
            })?
    };
    let comm = NcclComm {
        shared,
        mesh,
        device: cuda.clone(),
        stop,
        watchdog: Some(watchdog),
    };
    Ok(ProcessGroup::from_inner(Inner {
        rank: r.rank,
        world_size: r.world_size,
        local_rank: r.local_rank,
        local_world_size: r.local_world_size,
        backend: Backend::Nccl,
        comm: Box::new(comm),
        seq: Mutex::new(0),
        store: Some(meeting.store),
        _server: meeting.server,
    }))
}
