//! The NCCL backend: collectives on GPUs, on a CUDA stream of the group's own.
//!
//! A collective is issued on the caller's thread and run by the group's worker, as on every
//! backend; what moves the data is NCCL on the group's communication stream:
//!
//! - when the call is issued, an event is recorded on the stream that produced the inputs
//!   (candle's stream, as seen from the issuing thread), and the communication stream waits
//!   for it before NCCL reads them: the collective sees every kernel launched before the call,
//!   and none launched after it has to wait;
//! - outputs are allocated on candle's stream (as torch allocates them on the current stream),
//!   and the communication stream waits for the allocation;
//!   [`Work::wait`](crate::distributed::Work::wait) makes the consumer's stream wait for an
//!   event recorded after the NCCL call: kernels launched afterwards read the result, and the
//!   host never waits for the GPU;
//! - inputs and outputs are held until the consumer's stream has waited, so that their memory
//!   returns to candle's stream only behind NCCL. These explicit orders are all there is on a
//!   device without cudarc's per-buffer events (`devices::cuda_device`); with them, cudarc
//!   orders the same uses again.
//!
//! So compute on candle's stream overlaps communication on the group's stream. Every group has
//! a stream of its own: two groups' collectives, issued from two threads in any order, never
//! wait for each other.
//!
//! The NCCL unique id travels through the store. A TCP mesh beside the communicator carries the
//! cross-rank agreement on every call (so mismatches fail on every rank instead of hanging the
//! GPU) and watches the peers: when one is lost, a watchdog aborts the communicator, which
//! releases kernels waiting for the dead peer, and every later call fails naming it. Groups
//! made by `new_group` split the communicator (`ncclCommSplit`) and connect a mesh of their own.
//!
//! We hold the raw communicator rather than cudarc's `Comm`, which keeps it private: the
//! watchdog needs it to call `ncclCommAbort` from its own thread.

use crate::distributed::algorithms::exchange::{self, Meta};
use crate::distributed::algorithms::{consensus, Links};
use crate::distributed::communicator::{Call, Communicator, Connected, IssueMark, PointOp};
use crate::distributed::config::InitConfig;
use crate::distributed::error_file;
use crate::distributed::rendezvous::world::{join_world, MeshContext};
use crate::distributed::rendezvous::GroupPath;
use crate::distributed::rendezvous::Rendezvous;
use crate::distributed::transport::mesh::{Broken, Mesh};
use crate::distributed::transport::wire::FrameKind;
use crate::distributed::work::{DeviceCompletion, Finished};
use crate::distributed::ReduceOp;
use crate::error::{device_name, Error, Result};
use crate::util::sync::lock;
use candle_core::cuda_backend::cudarc::driver::{
    self, CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DriverError, SyncOnDrop,
};
use candle_core::cuda_backend::cudarc::nccl::{result, sys};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Layout, Shape, Storage, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

/// NCCL's color for ranks that take part in a split but join no new communicator.
const SPLIT_NO_COLOR: i32 = -1;

/// A raw NCCL communicator.
struct RawComm(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap; every use goes through the `Mutex` in `Shared`, including the watchdog's abort.
unsafe impl Send for RawComm {}

struct Shared {
    /// `None` once aborted: an aborted communicator must never be used again.
    comm: Mutex<Option<RawComm>>,
    /// The group's communication stream.
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
    context: MeshContext,
    stop: Arc<AtomicBool>,
    watchdog: Option<JoinHandle<()>>,
}

/// What [`NcclComm::issue`] records on the issuing thread.
struct Issued {
    /// The inputs, contiguous (made so on the issuing thread's stream).
    inputs: Vec<Tensor>,
    /// Recorded on the producing stream once the inputs are made.
    ready: CudaEvent,
}

/// A collective enqueued on the communication stream.
///
/// It holds the tensors NCCL reads and writes (the issued inputs, the messages sent, the
/// outputs and received messages, all on candle's stream) until the consumer's stream has
/// waited for the collective, as torch's `recordStream` does: their memory goes back to
/// candle's stream only behind that wait. cudarc alone does not guarantee it: it keeps one read
/// event per buffer, which the next read on candle's stream overwrites, and the free then waits
/// for that read only, not for NCCL's; and on a device without its event tracking
/// (`devices::cuda_device`) nothing else orders them. A `Work` dropped without `wait` makes the
/// consumer's stream wait all the same, before the tensors go.
struct Enqueued {
    done: CudaEvent,
    device: CudaDevice,
    /// What NCCL reads and writes, released once the consumer's stream is ordered after `done`.
    held: Vec<Tensor>,
}

impl Enqueued {
    /// Makes the consumer's stream (the device's, as seen from this thread: where its next
    /// kernels go) wait for the collective.
    fn order(&self) -> Result<()> {
        let consumer = self.device.cuda_stream();
        consumer
            .context()
            .bind_to_thread()
            .and_then(|()| consumer.wait(&self.done))
            .map_err(driver_error(
                "ordering the consumer's stream after the collective",
            ))
    }
}

impl DeviceCompletion for Enqueued {
    fn is_complete(&self) -> bool {
        self.done.is_complete()
    }

    fn order_consumer(mut self: Box<Self>) -> Result<()> {
        let ordered = self.order();
        if ordered.is_ok() {
            // Freed behind the wait: Drop has nothing left to order.
            std::mem::take(&mut self.held);
        }
        ordered
    }
}

impl Drop for Enqueued {
    /// A collective nobody waited for: its inputs are freed on candle's stream only behind it.
    fn drop(&mut self) {
        if self.held.is_empty() {
            return;
        }
        if let Err(e) = self.order() {
            // Freeing under NCCL could corrupt whatever reuses the memory: leak it instead.
            log::error!(
                "NCCL: {e}; the collective's {} tensor(s) are kept (leaked) rather than freed \
                 while NCCL may still use them",
                self.held.len()
            );
            std::mem::forget(std::mem::take(&mut self.held));
        }
    }
}

/// Leaks `tensors` after a failed NCCL call: NCCL may still use their memory, and no event
/// orders candle's stream after it, so freeing them could hand the memory to a kernel while
/// NCCL writes it.
fn keep(tensors: Vec<Tensor>) {
    if !tensors.is_empty() {
        log::error!(
            "NCCL: after the failed call its {} tensor(s) are kept (leaked) rather than freed \
             while NCCL may still use them",
            tensors.len()
        );
        std::mem::forget(tensors);
    }
}

/// Whether collectives run with both streams finished around them
/// (`CANDLE_PARALLEL_NCCL_SYNC=1`): the producer's stream when the call is issued, the
/// communication stream after the NCCL call. A diagnostic, and a partial one: the issuing
/// thread goes on launching kernels on candle's stream while the worker runs the call (as
/// fully sharded's prefetch does), so those may still overlap it.
fn serialised() -> bool {
    static SERIALISED: OnceLock<bool> = OnceLock::new();
    switch(
        &SERIALISED,
        "CANDLE_PARALLEL_NCCL_SYNC",
        "every NCCL collective runs alone (slow)",
    )
}

/// Whether every collective's output is filled with NaN (all bytes 0xFF) on candle's stream
/// before NCCL writes it (`CANDLE_PARALLEL_NCCL_POISON=1`): a diagnostic that turns any read of
/// an output before NCCL has written it into NaN.
fn poisoned() -> bool {
    static POISONED: OnceLock<bool> = OnceLock::new();
    switch(
        &POISONED,
        "CANDLE_PARALLEL_NCCL_POISON",
        "every NCCL output starts as NaN",
    )
}

/// Whether the diagnostic switch `var` is on (`=1`), read once into `cell`; says `what` it does
/// when it is.
fn switch(cell: &OnceLock<bool>, var: &str, what: &str) -> bool {
    *cell.get_or_init(|| {
        let on = std::env::var(var).is_ok_and(|v| v == "1");
        if on {
            log::warn!("{var}=1: {what}");
        }
        on
    })
}

/// Makes the communication stream `comm` wait until buffers just allocated on `device`'s stream
/// exist (an allocation is ordered on its own stream only).
fn after_allocation(device: &CudaDevice, comm: &CudaStream) -> Result<()> {
    device
        .cuda_stream()
        .record_event(None)
        .and_then(|allocated| comm.wait(&allocated))
        .map_err(driver_error(
            "ordering the communication stream after its buffers",
        ))
}

fn driver_error(op: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::Nccl {
        op,
        detail: format!("{e:?}"),
    }
}

/// What one NCCL call does.
#[derive(Clone, Copy)]
enum Kind {
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

/// One NCCL call as a candle custom op, so that it reads candle's buffers and hands back a
/// tensor over a fresh buffer of candle's stream, written on the communication stream.
struct NcclOp<'a> {
    kind: Kind,
    comm: sys::ncclComm_t,
    stream: &'a Arc<CudaStream>,
    world: usize,
}

impl NcclOp<'_> {
    fn output_len(&self, count: usize) -> usize {
        match self.kind {
            Kind::AllGather => count * self.world,
            Kind::ReduceScatter(_) => count / self.world,
            Kind::AllReduce(_) | Kind::Broadcast(_) => count,
        }
    }

    fn output_shape(&self, shape: &Shape) -> Shape {
        match self.kind {
            Kind::AllGather => Shape::from(shape.elem_count() * self.world),
            Kind::ReduceScatter(_) => {
                let mut dims = shape.dims().to_vec();
                dims[0] /= self.world;
                Shape::from(dims)
            }
            Kind::AllReduce(_) | Kind::Broadcast(_) => shape.clone(),
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
        // `dt` names, both on the communicator's device; the guards keep them alive (and, where
        // cudarc tracks events, record their use on `stream`) until the call is enqueued, and
        // `Enqueued` holds them after.
        let status = unsafe {
            match self.kind {
                Kind::AllReduce(op) => {
                    result::all_reduce(sp, dp, count, dt, nccl_op(op), self.comm, st)
                }
                Kind::Broadcast(root) => {
                    result::broadcast(sp, dp, count, dt, root as i32, self.comm, st)
                }
                Kind::AllGather => result::all_gather(sp, dp, count, dt, self.comm, st),
                Kind::ReduceScatter(op) => result::reduce_scatter(
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
        macro_rules! run {
            ($src:expr, $t:ty, $variant:ident, $dt:ident) => {{
                let src = $src.slice(start..end);
                // On the consumer's stream, as torch allocates a collective's output: the
                // buffer belongs to candle's stream like every other, so candle's copies and
                // frees of it (which run on a buffer's own stream) stay on that stream. The
                // communication stream waits for the allocation.
                // SAFETY: NCCL writes every element of the output before anything reads it
                // (readers wait for the collective's event).
                let mut dst = unsafe { s.device.alloc::<$t>(out) }?;
                if poisoned() {
                    let consumer = s.device.cuda_stream();
                    let (ptr, _written) = dst.device_ptr_mut(&consumer);
                    let bytes = out * std::mem::size_of::<$t>();
                    // SAFETY: `ptr` holds `out` elements of `$t` on this device, just
                    // allocated on `consumer`, which fills them in its order.
                    unsafe {
                        driver::result::memset_d8_async(ptr, 0xFF, bytes, consumer.cu_stream())
                    }
                    .map_err(candle_core::Error::wrap)?;
                }
                after_allocation(&s.device, self.stream).map_err(candle_core::Error::wrap)?;
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
            device: s.device.clone(),
        };
        Ok((storage, self.output_shape(l.shape())))
    }
}

impl NcclComm {
    /// Runs `kind` on every input recorded by `issue`, inside one NCCL group, once the ranks
    /// agree on the call.
    fn run(&self, call: Call, kind: Kind) -> Result<Finished<Vec<Tensor>>> {
        let issued = call
            .mark
            .and_then(|m| m.downcast::<Issued>().ok())
            .expect("NcclComm::issue marked the call");
        consensus::check(&*self.mesh, call.seq, &call.desc)?;
        let guard = lock(&self.shared.comm);
        let Some(comm) = guard.as_ref().map(|c| c.0) else {
            self.mesh.usable()?;
            return Err(Error::Aborted {
                reason: "the NCCL communicator was aborted".into(),
            });
        };
        let stream = &self.shared.stream;
        stream
            .context()
            .bind_to_thread()
            .and_then(|()| stream.wait(&issued.ready))
            .map_err(driver_error("waiting for the collective's inputs"))?;
        let op = NcclOp {
            kind,
            comm,
            stream,
            world: self.mesh.world(),
        };
        let grouped = issued.inputs.len() > 1;
        if grouped {
            result::group_start().map_err(|e| self.failed("ncclGroupStart", e))?;
        }
        // Output by output, so that those already enqueued are known when one fails.
        let mut outs = Vec::with_capacity(issued.inputs.len());
        let mut failed = None;
        for t in &issued.inputs {
            match t.apply_op1_no_bwd(&op) {
                Ok(out) => outs.push(out),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        // The outputs are held too: a Work dropped unwaited frees them on candle's stream only
        // once that stream has waited for NCCL's writes.
        let mut held = issued.inputs;
        held.extend(outs.iter().cloned());
        let ended = match grouped {
            true => result::group_end()
                .map(|_| ())
                .map_err(|e| self.failed("ncclGroupEnd", e)),
            false => Ok(()),
        };
        let done = stream.record_event(None);
        let synced = match serialised() {
            true => stream.synchronize().map_err(driver_error(
                "finishing the collective (CANDLE_PARALLEL_NCCL_SYNC)",
            )),
            false => Ok(()),
        };
        drop(guard);
        let failed = failed.map(|e| {
            self.mesh.fail(Broken {
                lost: None,
                detail: format!("an NCCL call failed on rank {}: {e}", self.mesh.rank()),
            });
            Error::from(e)
        });
        let done = match (failed, ended, synced) {
            (Some(e), _, _) | (None, Err(e), _) | (None, Ok(()), Err(e)) => Err(e),
            (None, Ok(()), Ok(())) => {
                done.map_err(driver_error("recording the collective's completion"))
            }
        };
        let done = match done {
            Ok(done) => done,
            Err(e) => {
                // NCCL may still read or write what was enqueued, and nothing orders candle's
                // stream after it: keep the buffers rather than free them under it.
                keep(held);
                return Err(e);
            }
        };
        Ok(Finished {
            value: outs,
            device: Some(Box::new(Enqueued {
                done,
                device: self.device.clone(),
                held,
            })),
        })
    }

    /// Enqueues, as one NCCL group on the communication stream once `ready` has passed, a send
    /// of each of `sends` (contiguous tensors on this group's device) and a receive of each of
    /// `recvs` into a fresh buffer; returns the received tensors. Both sides know every
    /// message's size (the headers went first), so empty messages are skipped on both.
    fn send_recv(
        &self,
        ready: &CudaEvent,
        sends: &[(usize, Tensor)],
        recvs: &[(usize, Meta)],
    ) -> Result<Finished<Vec<Tensor>>> {
        let guard = lock(&self.shared.comm);
        let Some(comm) = guard.as_ref().map(|c| c.0) else {
            self.mesh.usable()?;
            return Err(Error::Aborted {
                reason: "the NCCL communicator was aborted".into(),
            });
        };
        let stream = &self.shared.stream;
        stream
            .context()
            .bind_to_thread()
            .and_then(|()| stream.wait(ready))
            .map_err(driver_error("waiting for the messages' tensors"))?;
        let st = stream.cu_stream() as sys::cudaStream_t;
        let held: Vec<_> = sends
            .iter()
            .map(|(peer, t)| {
                let (storage, layout) = t.storage_and_layout();
                (*peer, storage, layout.clone())
            })
            .collect();
        // Receive buffers on candle's stream, as collectives' outputs are.
        let consumer = self.device.cuda_stream();
        let mut bufs = recvs
            .iter()
            .map(|(_, meta)| alloc(&consumer, meta))
            .collect::<Result<Vec<_>>>()?;
        if !bufs.is_empty() {
            after_allocation(&self.device, stream)?;
        }
        let mut uses = Vec::new();
        result::group_start().map_err(|e| self.failed("ncclGroupStart", e))?;
        let mut enqueued = Ok(());
        for (peer, storage, layout) in &held {
            let Storage::Cuda(cs) = &**storage else {
                enqueued = Err(not_cuda());
                break;
            };
            let Some((start, end)) = layout.contiguous_offsets() else {
                enqueued = Err(not_cuda());
                break;
            };
            let (ptr, bytes) = match slice_ptr(&cs.slice, stream, start, end, &mut uses) {
                Ok(p) => p,
                Err(e) => {
                    enqueued = Err(e);
                    break;
                }
            };
            if bytes > 0 {
                // SAFETY: `ptr` holds `bytes` bytes on the communicator's device; the storage
                // guard and `uses` keep the buffer alive and record its use on `stream`.
                let sent = unsafe {
                    result::send(
                        ptr as *const std::ffi::c_void,
                        bytes,
                        sys::ncclDataType_t::ncclUint8,
                        *peer as i32,
                        comm,
                        st,
                    )
                };
                if let Err(e) = sent {
                    enqueued = Err(self.failed("ncclSend", e));
                    break;
                }
            }
        }
        if enqueued.is_ok() {
            for ((peer, meta), buf) in recvs.iter().zip(bufs.iter_mut()) {
                let bytes = meta.bytes();
                if bytes == 0 {
                    continue;
                }
                let ptr = slice_ptr_mut(buf, stream, &mut uses);
                // SAFETY: `ptr` is a fresh buffer of exactly `bytes` bytes on the
                // communicator's device, kept alive by `bufs`; `uses` records the write.
                let got = unsafe {
                    result::recv(
                        ptr as *mut std::ffi::c_void,
                        bytes,
                        sys::ncclDataType_t::ncclUint8,
                        *peer as i32,
                        comm,
                        st,
                    )
                };
                if let Err(e) = got {
                    enqueued = Err(self.failed("ncclRecv", e));
                    break;
                }
            }
        }
        let ended = result::group_end()
            .map(|_| ())
            .map_err(|e| self.failed("ncclGroupEnd", e));
        let done = stream.record_event(None);
        drop(uses);
        drop(held);
        drop(guard);
        let done = match (enqueued, ended) {
            (Err(e), _) | (Ok(()), Err(e)) => Err(e),
            (Ok(()), Ok(())) => done.map_err(driver_error("recording the messages' completion")),
        };
        let done = match done {
            Ok(done) => done,
            Err(e) => {
                // NCCL may still read the sends and write the receives: keep both rather than
                // free them under it (the receives' buffers, and a clone of each send, which
                // outlives the caller's).
                keep(sends.iter().map(|(_, t)| t.clone()).collect());
                std::mem::forget(bufs);
                return Err(e);
            }
        };
        let outs = bufs
            .into_iter()
            .zip(recvs)
            .map(|(slice, (_, meta))| {
                let storage = CudaStorage {
                    slice,
                    device: self.device.clone(),
                };
                Tensor::from_storage(
                    Storage::Cuda(storage),
                    meta.dims.clone(),
                    BackpropOp::none(),
                    false,
                )
            })
            .collect::<Vec<Tensor>>();
        let held = sends
            .iter()
            .map(|(_, t)| t.clone())
            .chain(outs.iter().cloned())
            .collect();
        Ok(Finished {
            value: outs,
            device: Some(Box::new(Enqueued {
                done,
                device: self.device.clone(),
                held,
            })),
        })
    }

    /// Receives the headers of `recvs` and checks them against what each receive expects. A
    /// receive that would not match breaks the group: its sender is about to send, and NCCL
    /// would wait for the receive forever.
    fn headers(&self, kind: FrameKind, recvs: &[(usize, u64, Option<Meta>)]) -> Result<Vec<Meta>> {
        let me = self.mesh.rank();
        recvs
            .iter()
            .map(|(peer, seq, expect)| {
                let meta = exchange::recv_meta(&*self.mesh, *peer, kind, *seq)?;
                if let Err(e) = exchange::check_expected(expect.as_ref(), &meta, *peer, me, *seq) {
                    self.mesh.fail(Broken {
                        lost: None,
                        detail: e.to_string(),
                    });
                    return Err(e);
                }
                Ok(meta)
            })
            .collect()
    }

    fn failed(&self, op: &'static str, e: result::NcclError) -> Error {
        let detail = format!("{e:?}");
        self.mesh.fail(Broken {
            lost: None,
            detail: format!("{op} failed on rank {}: {detail}", self.mesh.rank()),
        });
        Error::Nccl { op, detail }
    }

    /// Takes over `comm`: gives it a communication stream and a watchdog (and aborts it when
    /// either cannot be had).
    fn start(
        comm: sys::ncclComm_t,
        mesh: Mesh,
        device: &CudaDevice,
        context: MeshContext,
    ) -> Result<Self> {
        let stream = match device.cuda_stream().context().new_stream() {
            Ok(s) => s,
            Err(e) => {
                // SAFETY: `comm` is valid and nobody else holds it.
                let _ = unsafe { result::comm_abort(comm) };
                return Err(driver_error("creating the communication stream")(e));
            }
        };
        let shared = Arc::new(Shared {
            comm: Mutex::new(Some(RawComm(comm))),
            stream,
        });
        let mesh = Arc::new(mesh);
        let stop = Arc::new(AtomicBool::new(false));
        let watchdog = {
            let (shared, mesh, stop) = (shared.clone(), mesh.clone(), stop.clone());
            std::thread::Builder::new()
                .name("nccl-watchdog".into())
                .spawn(move || watchdog(&shared, &mesh, &stop))
                .map_err(|source| Error::Io {
                    context: "starting the NCCL watchdog".into(),
                    source,
                })
        };
        let watchdog = match watchdog {
            Ok(w) => w,
            Err(e) => {
                shared.abort();
                return Err(e);
            }
        };
        Ok(Self {
            shared,
            mesh,
            device: device.clone(),
            context,
            stop,
            watchdog: Some(watchdog),
        })
    }
}

impl Communicator for NcclComm {
    /// Checks the inputs' device, makes them contiguous and marks where their producer's stream
    /// stands, all on the issuing thread.
    fn issue(&self, inputs: &[Tensor]) -> Result<Option<IssueMark>> {
        let here = Device::Cuda(self.device.clone());
        if let Some(t) = inputs.iter().find(|t| !t.device().same_device(&here)) {
            return Err(Error::InvalidArgument {
                what: "NCCL tensor device",
                detail: format!(
                    "the tensor is on {} but the group's device is {}; move it there first (the \
                     same candle Device instance)",
                    device_name(t.device()),
                    device_name(&here)
                ),
            });
        }
        let inputs = inputs
            .iter()
            .map(Tensor::contiguous)
            .collect::<candle_core::Result<Vec<_>>>()?;
        let producer = self.device.cuda_stream();
        let ready = producer
            .context()
            .bind_to_thread()
            .and_then(|()| producer.record_event(None))
            .map_err(driver_error("marking the collective's inputs"))?;
        if serialised() {
            producer.synchronize().map_err(driver_error(
                "finishing the producer's work (CANDLE_PARALLEL_NCCL_SYNC)",
            ))?;
        }
        Ok(Some(Box::new(Issued { inputs, ready })))
    }

    fn all_reduce(&self, call: Call, _: &[Tensor], op: ReduceOp) -> Result<Finished<Vec<Tensor>>> {
        self.run(call, Kind::AllReduce(op))
    }

    fn broadcast(&self, call: Call, _: &Tensor, root: usize) -> Result<Finished<Tensor>> {
        let mut out = self.run(call, Kind::Broadcast(root))?;
        Ok(Finished {
            value: out.value.remove(0),
            device: out.device,
        })
    }

    fn all_gather(&self, call: Call, t: &Tensor) -> Result<Finished<Vec<Tensor>>> {
        let out = self.run(call, Kind::AllGather)?;
        let all = &out.value[0];
        let m = t.elem_count();
        // Views of the gathered buffer: no kernel runs here.
        let parts = (0..self.mesh.world())
            .map(|i| Ok(all.narrow(0, i * m, m)?.reshape(t.shape())?))
            .collect::<Result<Vec<_>>>()?;
        Ok(Finished {
            value: parts,
            device: out.device,
        })
    }

    fn reduce_scatter(&self, call: Call, _: &Tensor, op: ReduceOp) -> Result<Finished<Tensor>> {
        let mut out = self.run(call, Kind::ReduceScatter(op))?;
        Ok(Finished {
            value: out.value.remove(0),
            device: out.device,
        })
    }

    fn check(&self, call: &Call) -> Result<()> {
        consensus::check(&*self.mesh, call.seq, &call.desc)
    }

    /// The headers travel over the mesh first (so receives are checked and sized before NCCL
    /// is called), then every send and receive of the batch runs in one NCCL group.
    fn p2p(
        &self,
        ops: Vec<PointOp>,
        _: &Device,
        mark: Option<IssueMark>,
    ) -> Result<Finished<Vec<Option<Tensor>>>> {
        let issued = mark
            .and_then(|m| m.downcast::<Issued>().ok())
            .expect("NcclComm::issue marked the sends");
        let mut inputs = issued.inputs.into_iter();
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        for op in &ops {
            match op {
                PointOp::Send { peer, seq, .. } => {
                    let t = inputs.next().expect("one issued input per send");
                    exchange::send_meta(&*self.mesh, *peer, FrameKind::P2p, *seq, &Meta::of(&t))?;
                    sends.push((*peer, t));
                }
                PointOp::Recv { peer, seq, expect } => recvs.push((*peer, *seq, expect.clone())),
            }
        }
        let metas = self.headers(FrameKind::P2p, &recvs)?;
        let recvs: Vec<(usize, Meta)> = recvs.iter().map(|r| r.0).zip(metas).collect();
        let done = self.send_recv(&issued.ready, &sends, &recvs)?;
        let mut got = done.value.into_iter();
        let value = ops
            .iter()
            .map(|op| match op {
                PointOp::Send { .. } => None,
                PointOp::Recv { .. } => got.next(),
            })
            .collect();
        Ok(Finished {
            value,
            device: done.device,
        })
    }

    fn all_to_all(&self, call: Call, _: &[Tensor]) -> Result<Finished<Vec<Tensor>>> {
        let issued = call
            .mark
            .and_then(|m| m.downcast::<Issued>().ok())
            .expect("NcclComm::issue marked the call");
        consensus::check(&*self.mesh, call.seq, &call.desc)?;
        let (n, me) = (self.mesh.world(), self.mesh.rank());
        let peers: Vec<usize> = (1..n).map(|k| (me + k) % n).collect();
        for &p in &peers {
            let meta = Meta::of(&issued.inputs[p]);
            exchange::send_meta(&*self.mesh, p, FrameKind::Exchange, call.seq, &meta)?;
        }
        let from: Vec<_> = peers.iter().map(|&p| (p, call.seq, None)).collect();
        let metas = self.headers(FrameKind::Exchange, &from)?;
        let sends: Vec<(usize, Tensor)> = peers
            .iter()
            .map(|&p| (p, issued.inputs[p].clone()))
            .collect();
        let recvs: Vec<(usize, Meta)> = peers.iter().copied().zip(metas).collect();
        let done = self.send_recv(&issued.ready, &sends, &recvs)?;
        let mut out: Vec<Option<Tensor>> = vec![None; n];
        for (&p, t) in peers.iter().zip(done.value) {
            out[p] = Some(t);
        }
        // This rank's own part never leaves the device: a copy on the producing stream.
        out[me] = Some(issued.inputs[me].copy()?);
        Ok(Finished {
            value: out.into_iter().flatten().collect(),
            device: done.device,
        })
    }

    /// Every rank of this group takes part in `ncclCommSplit` (the others with no color); then
    /// the members connect the new group's mesh.
    fn split(&self, _: &Call, members: &[usize], path: &GroupPath) -> Result<Option<Connected>> {
        let position = members.iter().position(|&r| r == self.mesh.rank());
        let mut split: sys::ncclComm_t = std::ptr::null_mut();
        {
            let guard = lock(&self.shared.comm);
            let Some(comm) = guard.as_ref().map(|c| c.0) else {
                self.mesh.usable()?;
                return Err(Error::Aborted {
                    reason: "the NCCL communicator was aborted".into(),
                });
            };
            self.shared
                .stream
                .context()
                .bind_to_thread()
                .map_err(driver_error("binding the CUDA context"))?;
            let (color, key) = match position {
                Some(p) => (0, p as i32),
                None => (SPLIT_NO_COLOR, 0),
            };
            // SAFETY: a valid communicator, serialised by the lock; `split` receives the new
            // communicator (null for ranks without a color); a null config inherits the
            // parent's.
            unsafe { sys::ncclCommSplit(comm, color, key, &mut split, std::ptr::null_mut()) }
                .result()
                .map_err(|e| self.failed("ncclCommSplit", e))?;
        }
        let Some(rank) = position else {
            return Ok(None);
        };
        let abort_split = |e: Error| {
            // SAFETY: the new communicator is valid and nobody else holds it yet.
            let _ = unsafe { result::comm_abort(split) };
            e
        };
        let (store, mesh) = self
            .context
            .connect_group(rank, members.len(), path)
            .map_err(abort_split)?;
        let comm = NcclComm::start(split, mesh, &self.device, self.context.clone())?;
        Ok(Some(Connected {
            comm: Box::new(comm),
            store: Some(store),
            server: None,
        }))
    }

    /// NCCL's `Max`/`Min` kernels (`fmaxf`/`fminf`) drop NaN.
    fn max_min_propagate_nan(&self) -> bool {
        false
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

fn not_cuda() -> Error {
    Error::InvalidArgument {
        what: "NCCL message tensor",
        detail: "the tensor is not a contiguous CUDA tensor on the group's device".into(),
    }
}

/// The device address and byte length of elements `start..end` of `slice`, whose use on
/// `stream` is recorded when the guard pushed onto `uses` drops.
fn slice_ptr<'a>(
    slice: &'a CudaStorageSlice,
    stream: &'a Arc<CudaStream>,
    start: usize,
    end: usize,
    uses: &mut Vec<SyncOnDrop<'a>>,
) -> Result<(u64, usize)> {
    macro_rules! at {
        ($x:expr, $t:ty) => {{
            let (base, used) = $x.device_ptr(stream);
            uses.push(used);
            let size = std::mem::size_of::<$t>();
            Ok((base as u64 + (start * size) as u64, (end - start) * size))
        }};
    }
    match slice {
        CudaStorageSlice::U8(x) => at!(x, u8),
        CudaStorageSlice::U32(x) => at!(x, u32),
        CudaStorageSlice::I16(x) => at!(x, i16),
        CudaStorageSlice::I32(x) => at!(x, i32),
        CudaStorageSlice::I64(x) => at!(x, i64),
        CudaStorageSlice::BF16(x) => at!(x, half::bf16),
        CudaStorageSlice::F16(x) => at!(x, half::f16),
        CudaStorageSlice::F32(x) => at!(x, f32),
        CudaStorageSlice::F64(x) => at!(x, f64),
        _ => Err(Error::InvalidArgument {
            what: "NCCL message tensor",
            detail: "its dtype cannot be sent; convert it to a dtype with whole bytes".into(),
        }),
    }
}

/// The device address of a whole fresh buffer, for a receive to write into.
fn slice_ptr_mut<'a>(
    slice: &'a mut CudaStorageSlice,
    stream: &'a Arc<CudaStream>,
    uses: &mut Vec<SyncOnDrop<'a>>,
) -> u64 {
    macro_rules! at {
        ($x:expr) => {{
            let (base, used) = $x.device_ptr_mut(stream);
            uses.push(used);
            base as u64
        }};
    }
    match slice {
        CudaStorageSlice::U8(x) => at!(x),
        CudaStorageSlice::U32(x) => at!(x),
        CudaStorageSlice::I16(x) => at!(x),
        CudaStorageSlice::I32(x) => at!(x),
        CudaStorageSlice::I64(x) => at!(x),
        CudaStorageSlice::BF16(x) => at!(x),
        CudaStorageSlice::F16(x) => at!(x),
        CudaStorageSlice::F32(x) => at!(x),
        CudaStorageSlice::F64(x) => at!(x),
        CudaStorageSlice::F8E4M3(x) => at!(x),
        CudaStorageSlice::F6E2M3(x)
        | CudaStorageSlice::F6E3M2(x)
        | CudaStorageSlice::F4(x)
        | CudaStorageSlice::F8E8M0(x) => at!(x),
    }
}

/// A fresh buffer on `stream` for a message of `meta` (at least one element: CUDA allocates no
/// empty buffers, and an empty message moves no bytes).
fn alloc(stream: &Arc<CudaStream>, meta: &Meta) -> Result<CudaStorageSlice> {
    let n = meta.dims.iter().product::<usize>().max(1);
    macro_rules! fresh {
        ($t:ty, $variant:ident) => {
            // SAFETY: NCCL writes every element before anything reads them (readers wait for
            // the messages' event); an empty message's one element is never read.
            CudaStorageSlice::$variant(
                unsafe { stream.alloc::<$t>(n) }
                    .map_err(driver_error("allocating a receive buffer"))?,
            )
        };
    }
    Ok(match meta.dtype {
        DType::U8 => fresh!(u8, U8),
        DType::U32 => fresh!(u32, U32),
        DType::I16 => fresh!(i16, I16),
        DType::I32 => fresh!(i32, I32),
        DType::I64 => fresh!(i64, I64),
        DType::BF16 => fresh!(half::bf16, BF16),
        DType::F16 => fresh!(half::f16, F16),
        DType::F32 => fresh!(f32, F32),
        DType::F64 => fresh!(f64, F64),
        other => {
            return Err(Error::InvalidArgument {
                what: "NCCL message dtype",
                detail: format!("{} tensors cannot be received", other.as_str()),
            })
        }
    })
}

/// Watches the peers and NCCL's own error state; aborts the communicator when either fails.
fn watchdog(shared: &Shared, mesh: &Mesh, stop: &AtomicBool) {
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

/// Joins the job described by `r` and connects its NCCL group on `device`, one GPU per rank.
pub(crate) fn connect(r: &Rendezvous, device: &Device, options: &InitConfig) -> Result<Connected> {
    let Device::Cuda(cuda) = device else {
        return Err(Error::Config {
            what: "backend".into(),
            detail: format!(
                "NCCL needs a CUDA device but got {}; use Backend::Tcp for CPU tensors",
                device_name(device)
            ),
        });
    };
    let (joined, context, mesh) = join_world(r, options, Arc::new(error_file::note_loss))?;
    let id = if r.rank == 0 {
        let id = result::get_uniqueid().map_err(|e| Error::Nccl {
            op: "ncclGetUniqueId",
            detail: format!("{e:?}"),
        })?;
        let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
        joined.store.set("nccl/id", &bytes)?;
        id
    } else {
        let waited = joined.store.wait_for_ranks(
            &[(0, "nccl/id".into())],
            r.rank,
            options.rendezvous_timeout,
            None,
        )?;
        if !waited.is_empty() {
            return Err(Error::Rendezvous {
                detail: format!(
                    "rank 0 did not publish the NCCL unique id within {:?}",
                    options.rendezvous_timeout
                ),
            });
        }
        let bytes = joined.store.get("nccl/id", options.rendezvous_timeout)?;
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
    cuda.cuda_stream()
        .context()
        .bind_to_thread()
        .map_err(driver_error("binding the CUDA context"))?;
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
    let comm = NcclComm::start(comm, mesh, cuda, context)?;
    Ok(Connected {
        comm: Box::new(comm),
        store: Some(joined.store),
        server: joined.server,
    })
}
