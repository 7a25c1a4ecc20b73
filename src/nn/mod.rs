//! Layers for training: [`SyncBatchNorm`]; [`batch_norm`], the constructor that lets one model
//! definition serve one device and many (torch's `convert_sync_batchnorm`); [`Conv2d`] and
//! [`max_pool2d`], candle's with CPU training kernels of our own; and candle-nn's fused
//! transformer layers with a backward, at candle-nn's paths: [`LayerNorm`], [`RmsNorm`],
//! [`layer_norm`], [`rms_norm`], [`ops`]`::{layer_norm, rms_norm, softmax_last_dim}` and
//! [`rotary_emb`]`::{rope, rope_i, rope_thd}` (candle 0.11's have none: see [`ops`]).
//! [`backward`](fn@backward) is candle's backward with these layers' variable gradients stored
//! as made rather than added to zeros (`docs/CPU_SPEED.md`).
//!
//! # One rule for every reduction, in every dtype
//!
//! Every layer here that sums (means, variances, softmax's exponentials and their sum, a
//! product's dot products, the bias, weight and affine gradients summed over a batch) follows
//! torch's rule: for f16 and bf16 inputs the sum runs in f32 (f64 for f64, f32 for f32), and
//! each result is rounded to the element type once. Variances are stable at any mean: two
//! passes, the second correcting the first mean (`(x - m) - mean(x - m)`), never
//! `E[x²] - E[x]²`. On the CPU, sums run in 8 interleaved partial sums over blocks of 256
//! values, the blocks added pairwise, so their error stays near a pairwise sum's.
//!
//! candle's own kernels do not: its fused layer norm cancels to a negative variance for rows of
//! mean 1e3 and spread 0.1 (every output NaN in f32), its softmax and its sums accumulate bf16
//! in bf16 (a bias gradient over 4096 rows of ones comes out 256). Hence: [`ops`]' layers run
//! kernels of our own on the CPU and on CUDA; [`linear`], [`linear_relu`] and [`Conv2d`] run
//! f16 and bf16 through their f32 CPU kernels; elsewhere a bias is added in f32; [`SyncBatchNorm`]
//! keeps its normalised values and affine step in f32. `scripts/torch_layers_check.py` measures
//! every layer in f32, f64, f16 and bf16 on adversarial inputs against torch, both against f64.
//!
//! An empty batch gives every parameter a gradient of zeros, as in torch (candle cuts an op on
//! an empty tensor out of the graph).
//!
//! # Batch normalisation on one device and many
//!
//! A candle model is its constructor, so instead of converting a built model, the model asks
//! for its normalisation layers through [`batch_norm`] (a drop-in for `candle_nn::batch_norm`,
//! same arguments, same variables). Called anywhere else it builds candle-nn's `BatchNorm`;
//! called while `DistributedDataParallel` builds the model with `DdpConfig::sync_batch_norm`
//! set, it builds a [`SyncBatchNorm`] over a process group of DDP's own, so its collectives
//! never interleave with DDP's gradient buckets nor with the user's.
//!
//! ```rust
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{ModuleT, VarBuilder, VarMap};
//! use candle_parallel::ddp::DdpConfig;
//! use candle_parallel::{distributed, nn, DistributedDataParallel};
//!
//! // One definition.
//! fn model(vb: VarBuilder) -> candle_core::Result<nn::BatchNorm> {
//!     nn::batch_norm(2, 1e-5, vb.pp("bn"))
//! }
//! # fn main() -> candle_parallel::Result<()> {
//! // One process: candle-nn's BatchNorm.
//! let varmap = VarMap::new();
//! let plain = model(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
//! assert!(matches!(plain, nn::BatchNorm::Plain(_)));
//! // Under DDP with the switch on: SyncBatchNorm.
//! distributed::spawn_threads(2, |pg| {
//!     let varmap = VarMap::new();
//!     let config = DdpConfig { sync_batch_norm: true, ..Default::default() };
//!     let ddp = DistributedDataParallel::with_config(&varmap, &pg, &Device::Cpu, config, model)?;
//!     assert!(matches!(ddp.module(), nn::BatchNorm::Sync(_)));
//!     Ok(())
//! })?;
//! # Ok(()) }
//! ```

mod accumulate;
mod amx;
pub mod attention;
mod backward;
mod cast;
mod conv;
#[cfg(feature = "cuda")]
mod conv_cuda;
mod conv_kernel;
mod conv_relu_pool;
mod few_rows;
#[cfg(feature = "cuda")]
mod fused_cuda;
mod gelu;
mod half_build;
mod kernels;
mod layer_norm;
mod linear;
pub mod ops;
mod pool;
pub mod rotary_emb;
mod rows;
mod simd;
mod sync_batch_norm;

pub use amx::{
    bf16_tiles_available, float32_matmul_precision, set_float32_matmul_precision, MatmulPrecision,
};
pub use backward::backward;
pub(crate) use backward::{copy_gradient, GradientHook};
pub use candle_nn::LayerNormConfig;
pub(crate) use cast::cast;
pub use conv::{conv2d, conv2d_forward, Conv2d};
pub use half_build::half_build_flags_missing;
pub(crate) use half_build::warn_if_half_is_slow;
pub use kernels::{own_cpu_kernels, own_cuda_kernels, use_own_cpu_kernels, use_own_cuda_kernels};
pub use layer_norm::{layer_norm, layer_norm_no_bias, rms_norm, LayerNorm, RmsNorm};
pub use linear::{linear, linear_gelu, linear_relu};
pub use pool::{max_pool2d, max_pool2d_with_stride};
pub use sync_batch_norm::{finish_backward, sync_batch_norm, SyncBatchNorm};

use crate::distributed::ProcessGroup;
use candle_core::{Result, Tensor};
use candle_nn::{BatchNormConfig, ModuleT, VarBuilder};
use std::cell::RefCell;

/// A batch normalisation layer: candle-nn's, or synchronised over the ranks ([`batch_norm`]).
#[derive(Clone, Debug)]
pub enum BatchNorm {
    /// candle-nn's BatchNorm: this rank's statistics.
    Plain(candle_nn::BatchNorm),
    /// Every rank's statistics.
    Sync(SyncBatchNorm),
}

impl BatchNorm {
    /// The running mean.
    pub fn running_mean(&self) -> &Tensor {
        match self {
            Self::Plain(bn) => bn.running_mean(),
            Self::Sync(bn) => bn.running_mean(),
        }
    }

    /// The running variance.
    pub fn running_var(&self) -> &Tensor {
        match self {
            Self::Plain(bn) => bn.running_var(),
            Self::Sync(bn) => bn.running_var(),
        }
    }
}

impl ModuleT for BatchNorm {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        match self {
            Self::Plain(bn) => bn.forward_t(x, train),
            Self::Sync(bn) => bn.forward_t(x, train),
        }
    }
}

/// `candle_nn::batch_norm`, or [`sync_batch_norm`] when called while DistributedDataParallel
/// builds a model with `DdpConfig::sync_batch_norm` set (see the [module documentation](self)).
pub fn batch_norm<C: Into<BatchNormConfig>>(
    num_features: usize,
    config: C,
    vb: VarBuilder,
) -> Result<BatchNorm> {
    match BUILDING.with(|b| b.borrow().as_ref().and_then(|c| c.sync_group.clone())) {
        Some(group) => Ok(BatchNorm::Sync(sync_batch_norm(
            num_features,
            config,
            vb,
            &group,
        )?)),
        None => Ok(BatchNorm::Plain(candle_nn::batch_norm(
            num_features,
            config,
            vb,
        )?)),
    }
}

/// What a model's construction under DistributedDataParallel shares with the layers it builds.
struct Building {
    /// The group [`batch_norm`] synchronises over, when DDP converts.
    sync_group: Option<ProcessGroup>,
    /// The groups of the SyncBatchNorm layers built, each once.
    sync_groups: Vec<ProcessGroup>,
}

thread_local! {
    static BUILDING: RefCell<Option<Building>> = const { RefCell::new(None) };
}

/// Runs `build` (a model's construction) with [`batch_norm`] building SyncBatchNorm layers over
/// `sync_group` (when given); returns its result and the groups of every SyncBatchNorm layer
/// it built, whose backward DDP completes ([`finish_backward`]).
pub(crate) fn building<R>(
    sync_group: Option<ProcessGroup>,
    build: impl FnOnce() -> R,
) -> (R, Vec<ProcessGroup>) {
    let outer = BUILDING.with(|b| {
        b.borrow_mut().replace(Building {
            sync_group,
            sync_groups: Vec::new(),
        })
    });
    /// Puts the outer construction's context back, also when `build` panics.
    struct Restore(Option<Option<Building>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(outer) = self.0.take() {
                BUILDING.with(|b| *b.borrow_mut() = outer);
            }
        }
    }
    let mut restore = Restore(Some(outer));
    let out = build();
    let mine = BUILDING.with(|b| b.borrow_mut().take());
    if let Some(outer) = restore.0.take() {
        BUILDING.with(|b| *b.borrow_mut() = outer);
    }
    (out, mine.map(|m| m.sync_groups).unwrap_or_default())
}

/// The group [`batch_norm`] synchronises over in the construction under way, if any: for code
/// that builds a module again later (activation checkpointing's recomputation), to build it
/// as it was built first ([`rebuilding`]).
pub(crate) fn building_sync_group() -> Option<ProcessGroup> {
    BUILDING.with(|b| b.borrow().as_ref().and_then(|c| c.sync_group.clone()))
}

/// Runs `build` as a construction with [`batch_norm`] synchronising over `sync_group`, as
/// [`building`] does, for a module built again: the groups it notes were noted the first time.
pub(crate) fn rebuilding<R>(sync_group: Option<ProcessGroup>, build: impl FnOnce() -> R) -> R {
    building(sync_group, build).0
}

/// Records, for the construction under way (if any), that a SyncBatchNorm layer uses `group`.
fn note_sync_group(group: &ProcessGroup) {
    BUILDING.with(|b| {
        if let Some(building) = b.borrow_mut().as_mut() {
            if !building.sync_groups.iter().any(|g| g.same_group(group)) {
                building.sync_groups.push(group.clone());
            }
        }
    });
}
