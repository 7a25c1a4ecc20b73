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
        .map(|i| Ok(Device::new_cuda_with_stream(i % gpus)?))
        .collect()
}
