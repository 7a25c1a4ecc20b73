//! Choosing the devices to replicate a model over.
//!
//! candle tells devices apart by instance, not by GPU number: two `Device::new_cuda(0)` calls
//! are two different devices. [`replica_devices`] creates each device once, each CUDA device
//! with a stream of its own, so replicas on it run concurrently; [`comm`](crate::parallel::comm) orders
//! every copy between them on both streams. Asking for more replicas than there are GPUs
//! places several on one GPU, which is how one GPU can exercise the multi-device paths.
//!
//! ```rust
//! use candle_parallel::devices::replica_devices;
//! # fn main() -> candle_parallel::Result<()> {
//! let devices = replica_devices(Some(3), true)?; // three CPU replicas
//! assert_eq!(devices.len(), 3);
//! assert!(devices.iter().all(|d| d.is_cpu()));
//! # Ok(()) }
//! ```

use crate::error::{Error, Result};
use candle_core::Device;

/// The number of CUDA GPUs visible to this process: 0 without the `cuda` feature or a driver.
pub fn gpu_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::CudaContext;
        CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}

/// GPU `ordinal` as a candle device with a CUDA stream of its own, set up for candle-parallel:
/// cudarc's per-buffer event bookkeeping is off.
///
/// A candle device made with `Device::new_cuda_with_stream` records two CUDA events for every
/// buffer argument of every kernel (cudarc's "event tracking"), so that a buffer used on two
/// streams is ordered between them. On a model of many small kernels that bookkeeping is most
/// of the host's time per op: off, the Net's step at batch 128 took 1.2-1.5 ms of GPU time
/// instead of 2.0-2.3 and the small transformer trained 1.1-2.0x faster (H200, 2026-11-27, two
/// calls, `net_phases` and `transformer_ddp --time-steps`). candle-parallel orders every use
/// it makes of a second stream itself, as PyTorch does: NCCL waits for an event recorded where
/// its inputs were made, allocates its outputs on the device's stream and keeps inputs and
/// outputs alive until that stream has waited for the collective; copies between two devices
/// make each stream wait for the other. Nothing else in a training step uses another stream.
///
/// Use a device from here (`DataParallel`'s [`replica_devices`] are made so) unless your own
/// code runs work on other streams of the same GPU and relies on cudarc to order it; then make
/// the device with `Device::new_cuda_with_stream`, which candle-parallel also handles, only more
/// slowly. `CANDLE_PARALLEL_EVENT_TRACKING=1` keeps the bookkeeping on here too (to compare).
/// Without the `cuda` feature, or without that GPU, it fails with candle's error.
///
/// One exception for now: `FullyShardedDataParallel` on NCCL trained wrongly on such a device
/// on a GPU (with gradient clipping: loss 0.78 where the CPU gives 0.59), while `DataParallel`,
/// DDP and SyncBatchNorm on NCCL (`tests/gpu.rs`) and DDP and fully sharded over TCP gave the
/// CPU's numbers. (At world size 1 DDP and ZeRO-2 make no collective call while training:
/// there only fully sharded training runs NCCL every step.) Until that is found, give fully
/// sharded training a device from `Device::new_cuda_with_stream`; it warns otherwise.
///
/// ```rust
/// use candle_parallel::devices::{cuda_device, gpu_count};
/// # fn main() -> candle_parallel::Result<()> {
/// let device = match gpu_count() {
///     0 => candle_core::Device::Cpu,
///     _ => cuda_device(0)?, // one per GPU and process, created once and cloned
/// };
/// # let _ = device;
/// # Ok(()) }
/// ```
pub fn cuda_device(ordinal: usize) -> Result<Device> {
    let device = Device::new_cuda_with_stream(ordinal)?;
    #[cfg(feature = "cuda")]
    if !std::env::var("CANDLE_PARALLEL_EVENT_TRACKING").is_ok_and(|v| v == "1") {
        // SAFETY: the device was just made, so no buffer of it exists yet, and candle-parallel
        // orders its own uses of other streams explicitly (above).
        unsafe { device.as_cuda_device()?.disable_event_tracking() };
    }
    Ok(device)
}

/// `count` replica devices: GPUs when there are any (and `cpu_only` is false), round-robin over
/// them, else CPU replicas. `None` means one per GPU, or a single CPU replica.
pub fn replica_devices(count: Option<usize>, cpu_only: bool) -> Result<Vec<Device>> {
    if count == Some(0) {
        return Err(Error::InvalidArgument {
            what: "device count",
            detail: "0 replicas asked for; ask for at least 1".to_string(),
        });
    }
    let gpus = if cpu_only { 0 } else { gpu_count() };
    if gpus == 0 {
        return Ok(vec![Device::Cpu; count.unwrap_or(1)]);
    }
    (0..count.unwrap_or(gpus))
        .map(|i| cuda_device(i % gpus))
        .collect()
}
