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
//! with the batch split over candle's thread pool. Other dtypes and devices (CUDA) use candle's
//! own kernels, so one model definition serves both.
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

use super::kernels::{col2im, for_each_chunk, im2col, matmul, ours, Mat};
use candle_core::{CpuStorage, Layout, Module, Result, Shape, Tensor};
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
}

/// A convolution layer with candle-nn's variables (`weight`, `bias`) and initialisation.
pub fn conv2d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    cfg: Conv2dConfig,
    vb: VarBuilder,
) -> Result<Conv2d> {
    if cfg.groups == 0 || in_channels % cfg.groups != 0 || out_channels % cfg.groups != 0 {
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
/// our kernels for f32 tensors on the CPU, candle's elsewhere.
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
    if !(ours(&with_bias) && x.rank() == 4 && w.rank() == 4) {
        let y = x.conv2d(w, cfg.padding, cfg.stride, cfg.dilation, cfg.groups)?;
        return match bias {
            None => Ok(y),
            Some(b) => y.broadcast_add(&b.reshape((1, (), 1, 1))?),
        };
    }
    let geometry = Geometry::new(x.dims(), w.dims(), cfg)?;
    let op = Conv2dOp { geometry };
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    match bias {
        None => x.apply_op2(&w, op),
        Some(b) => {
            if b.dims() != [geometry.c_out] {
                candle_core::bail!(
                    "conv2d: the bias has shape {:?}; it needs one value per output channel ({})",
                    b.dims(),
                    geometry.c_out
                )
            }
            x.apply_op3(&w, &b.contiguous()?, op)
        }
    }
}

/// The sizes of one convolution.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    n: usize,
    c_in: usize,
    h: usize,
    w: usize,
    c_out: usize,
    k_h: usize,
    k_w: usize,
    h_out: usize,
    w_out: usize,
    padding: usize,
    stride: usize,
    dilation: usize,
    groups: usize,
}

impl Geometry {
    fn new(x: &[usize], w: &[usize], cfg: &Conv2dConfig) -> Result<Self> {
        let (n, c_in, h, wd) = (x[0], x[1], x[2], x[3]);
        let (c_out, c_in_g, k_h, k_w) = (w[0], w[1], w[2], w[3]);
        let groups = cfg.groups;
        if groups == 0 || c_in != c_in_g * groups || c_out % groups != 0 {
            candle_core::bail!(
                "conv2d: input {x:?} and weight {w:?} do not fit {groups} groups: the input needs \
                 groups x weight.dim(1) channels and the output channels must divide by groups"
            )
        }
        if cfg.stride == 0 || cfg.dilation == 0 {
            candle_core::bail!("conv2d: stride and dilation must be at least 1")
        }
        let span = |k: usize| cfg.dilation * (k - 1) + 1;
        if k_h == 0
            || k_w == 0
            || h + 2 * cfg.padding < span(k_h)
            || wd + 2 * cfg.padding < span(k_w)
        {
            candle_core::bail!(
                "conv2d: a {k_h}x{k_w} kernel with dilation {} does not fit the input {x:?} \
                 padded by {}",
                cfg.dilation,
                cfg.padding
            )
        }
        Ok(Self {
            n,
            c_in,
            h,
            w: wd,
            c_out,
            k_h,
            k_w,
            h_out: (h + 2 * cfg.padding - span(k_h)) / cfg.stride + 1,
            w_out: (wd + 2 * cfg.padding - span(k_w)) / cfg.stride + 1,
            padding: cfg.padding,
            stride: cfg.stride,
            dilation: cfg.dilation,
            groups,
        })
    }

    /// Input channels of a group.
    fn c_in_g(&self) -> usize {
        self.c_in / self.groups
    }

    /// Output channels of a group.
    fn c_out_g(&self) -> usize {
        self.c_out / self.groups
    }

    /// Rows of a group's patch matrix: input channels × kernel positions.
    fn patch(&self) -> usize {
        self.c_in_g() * self.k_h * self.k_w
    }

    /// Output positions of an image.
    fn positions(&self) -> usize {
        self.h_out * self.w_out
    }

    fn image_len(&self) -> usize {
        self.c_in * self.h * self.w
    }

    fn out_len(&self) -> usize {
        self.c_out * self.positions()
    }

    /// Lays out group `g` of `image` as patch columns in `cols`.
    fn im2col(&self, image: &[f32], g: usize, cols: &mut [f32]) {
        let plane = self.h * self.w;
        let channels = &image[g * self.c_in_g() * plane..(g + 1) * self.c_in_g() * plane];
        im2col(channels, self.c_in_g(), self, cols);
    }
}

/// What `im2col` and `col2im` need of a convolution's geometry.
pub(super) trait Window {
    fn input(&self) -> (usize, usize);
    fn kernel(&self) -> (usize, usize);
    fn output(&self) -> (usize, usize);
    fn padding(&self) -> usize;
    fn stride(&self) -> usize;
    fn dilation(&self) -> usize;
}

impl Window for Geometry {
    fn input(&self) -> (usize, usize) {
        (self.h, self.w)
    }
    fn kernel(&self) -> (usize, usize) {
        (self.k_h, self.k_w)
    }
    fn output(&self) -> (usize, usize) {
        (self.h_out, self.w_out)
    }
    fn padding(&self) -> usize {
        self.padding
    }
    fn stride(&self) -> usize {
        self.stride
    }
    fn dilation(&self) -> usize {
        self.dilation
    }
}

/// The convolution as a candle op: forward and backward with our kernels.
struct Conv2dOp {
    geometry: Geometry,
}

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((start, end))) => Ok(&v[start..end]),
        _ => candle_core::bail!("conv2d: the {what} must be a contiguous f32 tensor"),
    }
}

/// A tensor's f32 values (contiguous, on the CPU) for the duration of `f`.
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(s) => f(f32_slice(s, layout, "tensor")?),
        _ => candle_core::bail!("conv2d: expected a CPU tensor"),
    }
}

impl candle_core::CustomOp2 for Conv2dOp {
    fn name(&self) -> &'static str {
        "conv2d-im2col"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (f32_slice(xs, xl, "input")?, f32_slice(ws, wl, "weight")?);
        Ok(self.forward(x, w, None))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        self.input_and_weight_grads(x, w, grad)
    }
}

impl candle_core::CustomOp3 for Conv2dOp {
    fn name(&self) -> &'static str {
        "conv2d-im2col-bias"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (f32_slice(xs, xl, "input")?, f32_slice(ws, wl, "weight")?);
        let b = f32_slice(bs, bl, "bias")?;
        Ok(self.forward(x, w, Some(b)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = self.input_and_weight_grads(x, w, grad)?;
        let db = if b.track_op() {
            Some(self.bias_grad(grad)?)
        } else {
            None
        };
        Ok((dx, dw, db))
    }
}

impl Conv2dOp {
    /// The output, one matrix product per image and group, the bias (if any) added.
    fn forward(&self, x: &[f32], w: &[f32], bias: Option<&[f32]>) -> (CpuStorage, Shape) {
        let g = self.geometry;
        let mut out = vec![0f32; g.n * g.out_len()];
        for_each_chunk(&mut out, g.out_len(), |first, outs| {
            let mut cols = vec![0f32; g.patch() * g.positions()];
            for (i, out) in outs.chunks_mut(g.out_len()).enumerate() {
                let image = &x[(first + i) * g.image_len()..(first + i + 1) * g.image_len()];
                if let Some(b) = bias {
                    for (row, &v) in out.chunks_mut(g.positions()).zip(b) {
                        row.fill(v);
                    }
                }
                for grp in 0..g.groups {
                    g.im2col(image, grp, &mut cols);
                    let w_g =
                        &w[grp * g.c_out_g() * g.patch()..(grp + 1) * g.c_out_g() * g.patch()];
                    let out_g = &mut out[grp * g.c_out_g() * g.positions()
                        ..(grp + 1) * g.c_out_g() * g.positions()];
                    // out_g (Cout_g x P) (+)= w_g (Cout_g x patch) . cols (patch x P)
                    matmul(
                        Mat::rows(out_g, g.positions()),
                        Mat::rows_of(w_g, g.patch()),
                        Mat::rows_of(&cols, g.positions()),
                        bias.is_some(),
                    );
                }
            }
        });
        (
            CpuStorage::F32(out),
            Shape::from((g.n, g.c_out, g.h_out, g.w_out)),
        )
    }

    /// The input and weight gradients, each only when something needs it: the input
    /// gradient costs as much as the forward, and the images never need one.
    fn input_and_weight_grads(
        &self,
        x: &Tensor,
        w: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dw = if w.track_op() {
            Some(self.weight_grad(x, grad)?)
        } else {
            None
        };
        let dx = if x.track_op() {
            Some(self.input_grad(w, grad)?)
        } else {
            None
        };
        Ok((dx, dw))
    }

    /// dB: the output gradient summed per channel.
    fn bias_grad(&self, grad: &Tensor) -> Result<Tensor> {
        let g = self.geometry;
        let sums = with_f32(grad, |dy| {
            let partials = super::kernels::map_chunks(g.n, |images| {
                let mut acc = vec![0f32; g.c_out];
                for i in images {
                    let dy_i = &dy[i * g.out_len()..(i + 1) * g.out_len()];
                    for (a, row) in acc.iter_mut().zip(dy_i.chunks(g.positions())) {
                        *a += row.iter().sum::<f32>();
                    }
                }
                acc
            });
            let mut total = vec![0f32; g.c_out];
            for p in partials {
                for (t, v) in total.iter_mut().zip(p) {
                    *t += v;
                }
            }
            Ok(total)
        })?;
        Tensor::from_vec(sums, g.c_out, &candle_core::Device::Cpu)
    }

    /// dW_g = sum over images of dY_g (Cout_g x P) . cols_gᵀ (P x patch).
    fn weight_grad(&self, x: &Tensor, grad: &Tensor) -> Result<Tensor> {
        let g = self.geometry;
        let per_group = g.c_out_g() * g.patch();
        let total = with_f32(x, |x| {
            with_f32(grad, |dy| {
                let partials = super::kernels::map_chunks(g.n, |images| {
                    let mut acc = vec![0f32; g.groups * per_group];
                    let mut cols = vec![0f32; g.patch() * g.positions()];
                    for i in images {
                        let image = &x[i * g.image_len()..(i + 1) * g.image_len()];
                        let dy_i = &dy[i * g.out_len()..(i + 1) * g.out_len()];
                        for grp in 0..g.groups {
                            g.im2col(image, grp, &mut cols);
                            let dy_g = &dy_i[grp * g.c_out_g() * g.positions()
                                ..(grp + 1) * g.c_out_g() * g.positions()];
                            matmul(
                                Mat::rows(
                                    &mut acc[grp * per_group..(grp + 1) * per_group],
                                    g.patch(),
                                ),
                                Mat::rows_of(dy_g, g.positions()),
                                Mat::transposed(&cols, g.positions()),
                                true,
                            );
                        }
                    }
                    acc
                });
                let mut total = vec![0f32; g.groups * per_group];
                for p in partials {
                    for (t, v) in total.iter_mut().zip(p) {
                        *t += v;
                    }
                }
                Ok(total)
            })
        })?;
        Tensor::from_vec(
            total,
            (g.c_out, g.c_in_g(), g.k_h, g.k_w),
            &candle_core::Device::Cpu,
        )
    }

    /// dX: for each image and group, dcols = w_gᵀ (patch x Cout_g) . dY_g (Cout_g x P),
    /// scattered back with col2im.
    fn input_grad(&self, w: &Tensor, grad: &Tensor) -> Result<Tensor> {
        let g = self.geometry;
        let mut dx = vec![0f32; g.n * g.image_len()];
        with_f32(w, |w| {
            with_f32(grad, |dy| {
                for_each_chunk(&mut dx, g.image_len(), |first, dxs| {
                    let mut dcols = vec![0f32; g.patch() * g.positions()];
                    let plane = g.h * g.w;
                    for (i, dx_i) in dxs.chunks_mut(g.image_len()).enumerate() {
                        let dy_i = &dy[(first + i) * g.out_len()..(first + i + 1) * g.out_len()];
                        for grp in 0..g.groups {
                            let w_g = &w[grp * g.c_out_g() * g.patch()
                                ..(grp + 1) * g.c_out_g() * g.patch()];
                            let dy_g = &dy_i[grp * g.c_out_g() * g.positions()
                                ..(grp + 1) * g.c_out_g() * g.positions()];
                            matmul(
                                Mat::rows(&mut dcols, g.positions()),
                                Mat::transposed(w_g, g.patch()),
                                Mat::rows_of(dy_g, g.positions()),
                                false,
                            );
                            let channels =
                                &mut dx_i[grp * g.c_in_g() * plane..(grp + 1) * g.c_in_g() * plane];
                            col2im(&dcols, g.c_in_g(), &g, channels);
                        }
                    }
                });
                Ok(())
            })
        })?;
        Tensor::from_vec(dx, (g.n, g.c_in, g.h, g.w), &candle_core::Device::Cpu)
    }
}
