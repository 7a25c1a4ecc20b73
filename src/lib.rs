#![warn(missing_docs)]
//! candle-parallel: PyTorch-style multi-device training for candle.
//!
//! - [`comm`]: scatter, gather, broadcast and reduce_add across candle devices, differentiable.
//! - [`DataParallel`]: one process, one model, every device (`torch.nn.DataParallel`).
//! - [`DistributedDataParallel`]: one process per device, gradients averaged over the world in
//!   buckets while backward runs (`torch.nn.parallel.DistributedDataParallel`).
//! - [`replicate`] and [`parallel_apply`]: the pieces `DataParallel` is made of.
//! - [`distributed`] (also reachable as `dist`): process groups (TCP, in-process, NCCL),
//!   rendezvous and collectives, blocking and asynchronous.
//! - [`nn::SyncBatchNorm`]: batch statistics over every rank's samples, and [`nn::batch_norm`],
//!   which lets one model definition serve one device and many.
//! - [`nn::ops`], [`nn::rotary_emb`], [`nn::LayerNorm`], [`nn::RmsNorm`]: candle-nn's fused
//!   transformer layers with a backward (candle 0.11's have none, candle issue #2168), and
//!   [`vars_without_gradient`], which names the variables that got no gradient.
//! - [`sampler::DistributedSampler`]: each rank's share of a dataset.
//! - [`launch`]: start N ranks (the `candle-run` launcher and its library entry).
//! - [`logging`]: the library talks through the `log` facade; `logging::init` shows its
//!   messages on stderr.
//!
//! ```rust
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{linear, loss, Optimizer, VarMap};
//! use candle_parallel::{optim::Sgd, optim::SgdConfig, DataParallel};
//! # fn main() -> anyhow::Result<()> {
//! let varmap = VarMap::new();
//! let model = DataParallel::new(&varmap, vec![Device::Cpu; 2], |vb| linear(4, 3, vb))?;
//! let mut opt = Sgd::new(model.parameters(), SgdConfig { lr: 0.1, momentum: 0.9, ..Default::default() })?;
//! let x = Tensor::randn(0f32, 1., (8, 4), &Device::Cpu)?;
//! let y = Tensor::new(&[0u32, 1, 2, 0, 1, 2, 0, 1], &Device::Cpu)?;
//! let loss = loss::cross_entropy(&model.forward(&x)?, &y)?;
//! opt.backward_step(&loss)?;
//! # Ok(()) }
//! ```

pub mod checkpoint;
pub mod cifar;
pub mod ddp;
pub mod distributed;
mod error;
pub mod init;
#[cfg(unix)]
pub mod launch;
pub mod logging;
pub mod memory;
pub mod nn;
pub mod optim;
pub mod parallel;
pub mod rng;
pub mod sampler;
mod util;

pub use ddp::{vars_without_gradient, DdpConfig, DistributedDataParallel};
/// `torch.distributed`'s short name: the same module as [`distributed`].
pub use distributed as dist;
pub use error::{Error, Result};
pub use parallel::{comm, data_parallel, devices, parallel_apply, replicate};
pub use parallel::{DataParallel, DataParallelConfig};
