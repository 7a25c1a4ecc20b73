//! [`Conv2d`](super::Conv2d)'s CPU training kernel: the convolution as a candle op over f32
//! tensors, forward and backward, built on [`kernels`](super::kernels)' im2col, col2im and
//! matrix products, with the batch split over candle's thread pool.

use super::backward::{hand_over, through, Held};
use super::cast::with_f32_values;
use super::kernels::{block, block_mut, col2im, for_each_chunk, im2col, map_chunks, matmul};
use super::kernels::{matmul_nt, sum_partials, Mat, Window};
use candle_core::{CpuStorage, Layout, Result, Shape, Tensor};
use candle_nn::Conv2dConfig;

/// The convolution of f32 CPU tensors `x` and `w`, plus `bias` (one value per output channel)
/// when given, as one op with our kernels.
pub(super) fn conv2d(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    cfg: &Conv2dConfig,
) -> Result<Tensor> {
    let geometry = Geometry::new(x.dims(), w.dims(), cfg)?;
    let op = Conv2dOp { geometry };
    let mut uses = Vec::new();
    let (x, w) = (x.contiguous()?, through(&w.contiguous()?, &mut uses));
    match bias {
        None => x.apply_op2(&w, Held::new(op, uses)),
        Some(b) => {
            if b.dims() != [geometry.c_out] {
                candle_core::bail!(
                    "conv2d: the bias has shape {:?}; it needs one value per output channel ({})",
                    b.dims(),
                    geometry.c_out
                )
            }
            let b = through(&b.contiguous()?, &mut uses);
            x.apply_op3(&w, &b, Held::new(op, uses))
        }
    }
}

/// The sizes of one convolution.
#[derive(Clone, Copy, Debug)]
pub(super) struct Geometry {
    pub(super) n: usize,
    pub(super) c_in: usize,
    pub(super) h: usize,
    pub(super) w: usize,
    pub(super) c_out: usize,
    pub(super) k_h: usize,
    pub(super) k_w: usize,
    pub(super) h_out: usize,
    pub(super) w_out: usize,
    pub(super) padding: usize,
    pub(super) stride: usize,
    pub(super) dilation: usize,
    pub(super) groups: usize,
}

impl Geometry {
    /// The geometry of `x` convolved with `w` under `cfg`, checked.
    pub(super) fn new(x: &[usize], w: &[usize], cfg: &Conv2dConfig) -> Result<Self> {
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
    pub(super) fn c_in_g(&self) -> usize {
        self.c_in / self.groups
    }

    /// Output channels of a group.
    pub(super) fn c_out_g(&self) -> usize {
        self.c_out / self.groups
    }

    /// Rows of a group's patch matrix: input channels × kernel positions.
    pub(super) fn patch(&self) -> usize {
        self.c_in_g() * self.k_h * self.k_w
    }

    /// Output positions of an image.
    pub(super) fn positions(&self) -> usize {
        self.h_out * self.w_out
    }

    /// Values of one input image.
    pub(super) fn image_len(&self) -> usize {
        self.c_in * self.h * self.w
    }

    /// Values of one output image.
    pub(super) fn out_len(&self) -> usize {
        self.c_out * self.positions()
    }

    /// Lays out group `g` of `image` as patch columns in `cols`.
    pub(super) fn im2col(&self, image: &[f32], g: usize, cols: &mut [f32]) {
        let plane = self.h * self.w;
        let channels = block(image, g, self.c_in_g() * plane);
        im2col(channels, self.c_in_g(), self, cols);
    }
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

pub(super) fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((start, end))) => Ok(&v[start..end]),
        _ => candle_core::bail!("conv2d: the {what} must be a contiguous f32 tensor"),
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
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = self.input_and_weight_grads(x, w, grad)?;
        Ok((hand_over(out, x, dx), hand_over(out, w, dw)))
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
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = self.input_and_weight_grads(x, w, grad)?;
        let db = if b.track_op() {
            Some(self.bias_grad(grad)?)
        } else {
            None
        };
        Ok((
            hand_over(out, x, dx),
            hand_over(out, w, dw),
            hand_over(out, b, db),
        ))
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
                let image = block(x, first + i, g.image_len());
                if let Some(b) = bias {
                    for (row, &v) in out.chunks_mut(g.positions()).zip(b) {
                        row.fill(v);
                    }
                }
                for grp in 0..g.groups {
                    g.im2col(image, grp, &mut cols);
                    let w_g = block(w, grp, g.c_out_g() * g.patch());
                    let out_g = block_mut(out, grp, g.c_out_g() * g.positions());
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
        let sums = with_f32_values(grad, |dy| {
            let partials = map_chunks(g.n, |images| {
                let mut acc = vec![0f32; g.c_out];
                for i in images {
                    let dy_i = block(dy, i, g.out_len());
                    for (a, row) in acc.iter_mut().zip(dy_i.chunks(g.positions())) {
                        *a += row.iter().sum::<f32>();
                    }
                }
                acc
            });
            Ok(sum_partials(partials, g.c_out))
        })?;
        Tensor::from_vec(sums, g.c_out, &candle_core::Device::Cpu)
    }

    /// dW_g = sum over images of dY_g (Cout_g x P) . cols_gᵀ (P x patch).
    fn weight_grad(&self, x: &Tensor, grad: &Tensor) -> Result<Tensor> {
        let g = self.geometry;
        let per_group = g.c_out_g() * g.patch();
        let total = with_f32_values(x, |x| {
            with_f32_values(grad, |dy| {
                let partials = map_chunks(g.n, |images| {
                    let mut acc = vec![0f32; g.groups * per_group];
                    let mut cols = vec![0f32; g.patch() * g.positions()];
                    for i in images {
                        let image = block(x, i, g.image_len());
                        let dy_i = block(dy, i, g.out_len());
                        for grp in 0..g.groups {
                            g.im2col(image, grp, &mut cols);
                            let dy_g = block(dy_i, grp, g.c_out_g() * g.positions());
                            let acc_g = block_mut(&mut acc, grp, per_group);
                            matmul_nt(acc_g, dy_g, &cols, g.positions());
                        }
                    }
                    acc
                });
                Ok(sum_partials(partials, g.groups * per_group))
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
        with_f32_values(w, |w| {
            with_f32_values(grad, |dy| {
                for_each_chunk(&mut dx, g.image_len(), |first, dxs| {
                    let mut dcols = vec![0f32; g.patch() * g.positions()];
                    let plane = g.h * g.w;
                    for (i, dx_i) in dxs.chunks_mut(g.image_len()).enumerate() {
                        let dy_i = block(dy, first + i, g.out_len());
                        for grp in 0..g.groups {
                            let w_g = block(w, grp, g.c_out_g() * g.patch());
                            let dy_g = block(dy_i, grp, g.c_out_g() * g.positions());
                            matmul(
                                Mat::rows(&mut dcols, g.positions()),
                                Mat::transposed(w_g, g.patch()),
                                Mat::rows_of(dy_g, g.positions()),
                                false,
                            );
                            let channels = block_mut(dx_i, grp, g.c_in_g() * plane);
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
