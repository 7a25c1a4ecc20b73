//! `Conv2d` with training kernels of our own on the CPU: candle-nn's `Conv2d`, same variables,
//! same configuration, same numbers.
//!
//! candle 0.11 computes a CPU convolution's weight gradient as a convolution with the batch as
//! channels and the output as a kernel, and its input gradient as a naive transposed
//! convolution, also when nothing needs it (the first layer's input: the images). Here, for f32
//! tensors on the CPU:
//!
//! - forward: each image's patches are laid out as columns (`im2col`) and multiplied by the
//!   weight, one matrix product per image and group (the `gemm` crate candle uses);
//! - backward, weight: the output gradient times the patches, accumulated over the batch;
//! - backward, input: the weight's transpose times the output gradient, scattered back onto
//!   the image (`col2im`), and only when the input needs a gradient (a variable, or the output
//!   of a tracked op);
//!
//! with the batch split over candle's thread pool. f16 and bf16 run the same f32 kernels and
//! round their results once, so that their sums (the weight and bias gradients over the batch)
//! accumulate in f32, as torch's do (see the [`nn` module docs](super)). f64 and other devices
//! (CUDA) use candle's own kernels, with the bias added in f32 for f16 and bf16; one model
//! definition serves all.
//!
//! ```rust
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{Conv2dConfig, VarBuilder, VarMap};
//! use candle_parallel::nn;
//! # fn main() -> candle_core::Result<()> {
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let conv = nn::conv2d(3, 6, 5, Conv2dConfig::default(), vb.pp("conv1"))?;
//! let x = Tensor::randn(0f32, 1.0, (2, 3, 32, 32), &Device::Cpu)?;
//! let y = conv.forward(&x)?;
//! assert_eq!(y.dims(), [2, 6, 28, 28]);
//! // candle's own convolution gives the same numbers.
//! let want = x.conv2d(conv.weight(), 0, 1, 1, 1)?.broadcast_add(&conv.bias().unwrap().reshape((1, 6, 1, 1))?)?;
//! assert!((y - want)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-4);
//! # Ok(()) }
//! ```

use super::accumulate;
use super::kernels::ours_in_f32;
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Conv2dConfig, Init, VarBuilder};

/// A 2-D convolution layer (candle-nn's `Conv2d`, with CPU training kernels of our own).
#[derive(Clone, Debug)]
pub struct Conv2d {
    weight: Tensor,
    bias: Option<Tensor>,
    config: Conv2dConfig,
}

impl Conv2d {
    /// A convolution with `weight` `(Cout, Cin / groups, K, K)` and an optional `bias` `(Cout)`.
    pub fn new(weight: Tensor, bias: Option<Tensor>, config: Conv2dConfig) -> Self {
        Self {
            weight,
            bias,
            config,
        }
    }

    /// The weight.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The padding, stride, dilation and groups.
    pub fn config(&self) -> &Conv2dConfig {
        &self.config
    }

    /// `max_pool2d(relu(self.forward(x)), kernel)`: the convolution, a ReLU and a max-pooling
    /// over `kernel`-sized windows with stride `kernel`, as the CIFAR Net's blocks are.
    ///
    /// For f32, f16 and bf16 tensors on the CPU (with our kernels on, and a bias) this is one op: each image
    /// is convolved, rectified and pooled while its output is in the cache. For f32 tensors on
    /// CUDA (the `cuda` feature, one group) candle's convolution is followed by one kernel of
    /// ours for the bias, ReLU and pooling, and the backward is ours (see
    /// [`use_own_cuda_kernels`](super::use_own_cuda_kernels)). The numbers are
    /// those of the three ops apart (which run elsewhere: candle's convolution and ReLU,
    /// [`max_pool2d`]) up to rounding: the sums run in another order.
    ///
    /// ```rust
    /// use candle_core::{DType, Device, Module, Tensor};
    /// use candle_nn::{Conv2dConfig, VarBuilder, VarMap};
    /// use candle_parallel::nn;
    /// # fn main() -> candle_core::Result<()> {
    /// let varmap = VarMap::new();
    /// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    /// let conv = nn::conv2d(3, 6, 5, Conv2dConfig::default(), vb.pp("conv1"))?;
    /// let x = Tensor::randn(0f32, 1.0, (2, 3, 32, 32), &Device::Cpu)?;
    /// let y = conv.forward_relu_max_pool2d(&x, 2)?;
    /// assert_eq!(y.dims(), [2, 6, 14, 14]);
    /// let apart = nn::max_pool2d(&conv.forward(&x)?.relu()?, 2)?;
    /// assert!((y - apart)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-4);
    /// # Ok(()) }
    /// ```
    ///
    /// [`max_pool2d`]: super::max_pool2d
    pub fn forward_relu_max_pool2d(&self, x: &Tensor, kernel: usize) -> Result<Tensor> {
        if let Some(b) = &self.bias {
            if let Some(dtype) = ours_in_f32(&[x, &self.weight, b]) {
                if x.rank() == 4 && self.weight.rank() == 4 {
                    return super::conv_relu_pool::conv2d_relu_max_pool2d(
                        &f32(x)?,
                        &f32(&self.weight)?,
                        &f32(b)?,
                        &self.config,
                        kernel,
                        kernel,
                    )?
                    .to_dtype(dtype);
                }
            }
        }
        #[cfg(feature = "cuda")]
        if let Some(b) = &self.bias {
            let one_group = self.config.groups == 1 && x.rank() == 4 && self.weight.rank() == 4;
            if one_group && super::conv_cuda::takes(&[x, &self.weight, b]) {
                return super::conv_cuda::conv2d_relu_max_pool2d(
                    x,
                    &self.weight,
                    b,
                    &self.config,
                    kernel,
                );
            }
        }
        super::max_pool2d(&self.forward(x)?.relu()?, kernel)
    }
}

/// A convolution layer with candle-nn's variables (`weight`, `bias`) and initialisation.
pub fn conv2d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    cfg: Conv2dConfig,
    vb: VarBuilder,
) -> Result<Conv2d> {
    if cfg.groups == 0
        || !in_channels.is_multiple_of(cfg.groups)
        || !out_channels.is_multiple_of(cfg.groups)
    {
        candle_core::bail!(
            "conv2d `{}`: {in_channels} input and {out_channels} output channels are not \
             divisible by {} groups",
            vb.prefix(),
            cfg.groups
        )
    }
    let shape = (
        out_channels,
        in_channels / cfg.groups,
        kernel_size,
        kernel_size,
    );
    let weight = vb.get_with_hints(shape, "weight", candle_nn::init::DEFAULT_KAIMING_NORMAL)?;
    let bound = 1. / (in_channels as f64).sqrt();
    let bias = vb.get_with_hints(
        out_channels,
        "bias",
        Init::Uniform {
            lo: -bound,
            up: bound,
        },
    )?;
    Ok(Conv2d::new(weight, Some(bias), cfg))
}

impl Module for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        conv2d_with_bias(x, &self.weight, self.bias.as_ref(), &self.config)
    }
}

/// The convolution of `x` `(N, Cin, H, W)` with `w` `(Cout, Cin / groups, K, K)`, no bias:
/// our kernels for f32, f16 and bf16 tensors on the CPU, candle's elsewhere.
pub fn conv2d_forward(x: &Tensor, w: &Tensor, cfg: &Conv2dConfig) -> Result<Tensor> {
    conv2d_with_bias(x, w, None, cfg)
}

/// The convolution plus a per-channel `bias`: in one op with our kernels (the bias gradient a
/// per-channel sum of the output gradient, which candle's broadcast backward computes slowly),
/// else candle's convolution and a broadcast add.
fn conv2d_with_bias(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    cfg: &Conv2dConfig,
) -> Result<Tensor> {
    let with_bias: Vec<&Tensor> = [x, w].into_iter().chain(bias).collect();
    match ours_in_f32(&with_bias) {
        Some(dtype) if x.rank() == 4 && w.rank() == 4 => {
            let bias = bias.map(f32).transpose()?;
            super::conv_kernel::conv2d(&f32(x)?, &f32(w)?, bias.as_ref(), cfg)?.to_dtype(dtype)
        }
        _ => {
            let y = x.conv2d(w, cfg.padding, cfg.stride, cfg.dilation, cfg.groups)?;
            match bias {
                None => Ok(y),
                Some(b) => accumulate::broadcast_add(&y, &b.reshape((1, (), 1, 1))?),
            }
        }
    }
}

/// `t` as f32 (itself when it is).
fn f32(t: &Tensor) -> Result<Tensor> {
    t.to_dtype(DType::F32)
}
