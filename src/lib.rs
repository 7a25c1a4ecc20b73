#![warn(missing_docs)]
//! candle-parallel: PyTorch-style multi-device training for candle.
//!
//! The wrappers, and the pieces under them:
//! - [`DataParallel`]: one process, one model, every device (`torch.nn.DataParallel`). Its
//!   pieces live in [`parallel`], as torch keeps `torch.nn.parallel`: [`comm`] (scatter, gather,
//!   broadcast, reduce_add across devices, differentiable), [`replicate`], [`parallel_apply`],
//!   [`data_parallel`] and [`devices`] (which devices to use), each also reachable from here.
//! - [`DistributedDataParallel`] ([`ddp`]): one process per device, gradients averaged over the
//!   world in buckets while backward runs (`torch.nn.parallel.DistributedDataParallel`), and
//!   [`vars_without_gradient`], which names the variables that got no gradient.
//! - [`FullyShardedDataParallel`] ([`fsdp`]): each rank keeps a shard of the parameters,
//!   gradients and optimizer state, and gathers a unit's parameters only while it computes
//!   (torch FSDP2's `fully_shard`).
//! - [`model_parallel`]: one model cut into stages on the devices of one process, optionally
//!   pipelined over micro-batches (the tutorials' `ModelParallelResNet50` and
//!   `PipelineParallelResNet50`).
//! - [`pipeline`]: the model cut into stages, one process each, and batches into micro-batches
//!   that flow through them under a schedule (GPipe, 1F1B, interleaved 1F1B), as
//!   `torch.distributed.pipelining`.
//! - [`distributed`] (also `dist`): process groups (TCP with shared memory, in-process, NCCL),
//!   their rendezvous and collectives, blocking and asynchronous (`torch.distributed`).
//! - [`launch`]: start N ranks (the `candle-run` launcher and its library entry).
//!
//! Layers and training:
//! - [`nn`]: layers for training: `SyncBatchNorm` and `batch_norm`; candle-nn's fused
//!   transformer layers with a backward ([`nn::ops`], [`nn::rotary_emb`], [`nn::LayerNorm`],
//!   [`nn::RmsNorm`]; candle 0.11's have none, candle issue #2168); `Conv2d` and `max_pool2d`
//!   with CPU training kernels of our own.
//! - [`optim`]: SGD and AdamW with PyTorch's semantics, and their state as tensors
//!   ([`optim::OptimizerState`]) for checkpoints and sharding; gradient clipping over shards.
//! - [`amp`]: mixed precision: `GradScaler` for f16.
//! - [`activation_checkpointing`]: blocks whose activations are recomputed in backward.
//! - [`sampler`]: `DistributedSampler`, each rank's share of a dataset.
//! - [`shard`]: flat shards, the layout ZeRO-2 and fully sharded training cut parameters by.
//! - [`init`]: seeded, reproducible variable initialisation.
//! - [`rng`]: a small seeded random generator that gives the same numbers everywhere.
//! - [`checkpoint`]: saving variables as safetensors, atomically.
//! - [`memory`]: the C allocator tuned for training loops, and what a rank holds in memory.
//! - [`logging`]: the library talks through the `log` facade; [`logging::init`] shows its
//!   messages on stderr.
//!
//! Example support: [`cifar`], the CIFAR-10 reader, a synthetic stand-in and the tutorial's Net.
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

pub mod activation_checkpointing;
pub mod amp;
pub mod checkpoint;
pub mod cifar;
pub mod ddp;
pub mod distributed;
mod error;
pub mod fsdp;
pub mod init;
#[cfg(unix)]
pub mod launch;
pub mod logging;
pub mod memory;
pub mod model_parallel;
pub mod nn;
pub mod optim;
pub mod parallel;
pub mod pipeline;
pub mod rng;
pub mod sampler;
pub mod shard;
pub mod tensor_parallel;
pub mod threads;
mod util;

pub use ddp::{vars_without_gradient, DdpConfig, DistributedDataParallel};
/// `torch.distributed`'s short name: the same module as [`distributed`].
pub use distributed as dist;
pub use error::{Error, Result};
pub use fsdp::{FsdpConfig, FullyShardedDataParallel};
pub use parallel::{comm, data_parallel, devices, parallel_apply, replicate};
pub use parallel::{DataParallel, DataParallelConfig};

/// The guides' complete examples, run by `cargo test --doc` so that they stay true.
#[cfg(doctest)]
pub mod guides {
    #[doc = include_str!("../docs/POINT_TO_POINT.md")]
    pub struct PointToPoint;
    #[doc = include_str!("../docs/DEVICE_MESH.md")]
    pub struct DeviceMesh;
    #[doc = include_str!("../docs/MODEL_PARALLEL.md")]
    pub struct ModelParallel;
    #[doc = include_str!("../docs/PIPELINE.md")]
    pub struct Pipeline;
    #[doc = include_str!("../docs/TENSOR_PARALLEL.md")]
    pub struct TensorParallel;
    #[doc = include_str!("../docs/CPU_SPEED.md")]
    pub struct CpuSpeed;
    #[doc = include_str!("../docs/DISTRIBUTED_CHECKPOINT.md")]
    pub struct DistributedCheckpoint;
}
