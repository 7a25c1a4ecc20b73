//! DataParallel and the pieces it is made of, kept together as torch keeps `torch.nn.parallel`:
//! [`comm`] (scatter, gather, broadcast, reduce_add across devices, differentiable),
//! [`replicate`] (the model rebuilt on every device over the master variables),
//! [`parallel_apply`] (the replicas run in parallel, one thread each), [`data_parallel`] (the
//! module that composes them) and [`devices`] (which devices to run on).
//!
//! Each is also reachable from the crate root (`candle_parallel::comm`, ...).
//!
//! ```rust
//! use candle_core::{Device, Tensor};
//! use candle_parallel::parallel::{comm, DataParallel};
//! # fn main() -> candle_parallel::Result<()> {
//! let x = Tensor::arange(0f32, 10., &Device::Cpu)?.reshape((10, 1))?;
//! let chunks = comm::scatter(&x, &[Device::Cpu, Device::Cpu, Device::Cpu], 0)?;
//! assert_eq!(chunks.iter().map(|c| c.dim(0).unwrap()).collect::<Vec<_>>(), [4, 4, 2]);
//! # let _ = std::any::type_name::<DataParallel<()>>();
//! # Ok(()) }
//! ```

pub mod comm;
pub mod data_parallel;
pub mod devices;
pub mod parallel_apply;
pub mod replicate;

pub use data_parallel::{DataParallel, DataParallelConfig};
