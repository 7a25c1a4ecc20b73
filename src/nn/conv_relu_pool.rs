//! A convolution, its bias, a ReLU and a max-pooling as one CPU op (the block each of the CIFAR
//! Net's convolutions is): [`Conv2d::forward_relu_max_pool2d`](super::Conv2d).
//!
//! Composed from separate candle ops the block writes and reads the convolution's output several
//! times in the forward and the backward each (the ReLU's mask, multiply and add, the pooling's
//! scatter). Here, for f32 tensors on the CPU, each image is convolved, rectified and pooled
//! while its output is in the cache; the forward keeps, for each pooled value, where it came
//! from. The backward rebuilds each image's convolution output gradient from that (the pooled
//! gradient at the chosen position when the ReLU let it through) and runs the convolution's
//! backward while it is in the cache.
//!
//! For stride-1 convolutions without padding (the Net's) on a CPU with AVX2 or AVX-512 the
//! patches are never laid out: see [`Planes`] and [`simd`](super::simd). Otherwise they are
//! laid out (`im2col`) for the forward and again for the weight gradient, one image at a time
//! into a buffer that stays in the cache: keeping the forward's instead (15 times the input's
//! size for the Net's first layer) measured slower, as writing and reading them back through
//! memory costs more than recomputing them.
//!
//! The numbers are those of `max_pool2d(relu(conv(x)))` with candle's ReLU (whose gradient
//! passes where the input is `>= 0`) and [`max_pool2d`](super::max_pool2d) (the first maximum
//! of a window wins), up to rounding: the direct kernels sum in another order
//! (`tests/kernels.rs` checks within 1e-5; exact on small integers, so ties stay ties).

use super::backward::{hand_over, through, Held};
use super::cast::with_f32_values;
use super::conv_kernel::{f32_slice, Geometry};
use super::kernels::{block, block_mut, col2im, matmul, matmul_nt, sum_partials, threads, Mat};
use crate::util::sync::lock;
use candle_core::{CpuStorage, Device, Layout, Result, Shape, Tensor};
use candle_nn::Conv2dConfig;
use rayon::prelude::*;
use std::ops::Range;
use std::sync::Mutex;

/// Where a pooled value came from, with this bit set when the ReLU stopped its gradient (the
/// convolution's output there was negative or NaN).
const STOPPED: u32 = 1 << 31;

/// `max_pool2d_with_stride(relu(conv2d(x, w) + bias), kernel, stride)` for f32 CPU tensors, as
/// one op.
pub(super) fn conv2d_relu_max_pool2d(
    x: &Tensor,
    w: &Tensor,
    bias: &Tensor,
    cfg: &Conv2dConfig,
    kernel: usize,
    stride: usize,
) -> Result<Tensor> {
    let geometry = Geometry::new(x.dims(), w.dims(), cfg)?;
    let (ho, wo) = (geometry.h_out, geometry.w_out);
    if kernel == 0 || stride == 0 {
        candle_core::bail!("max_pool2d: kernel {kernel} and stride {stride} must be at least 1")
    }
    if ho < kernel || wo < kernel {
        candle_core::bail!(
            "max_pool2d: kernel-size {kernel} is larger than the convolution's output {ho},{wo}"
        )
    }
    let layout = Planes::of(&geometry);
    if u32::try_from(layout.len).map_or(true, |p| p >= STOPPED) {
        candle_core::bail!("max_pool2d: planes of {ho}x{wo} are too large (at most 2^31 values)")
    }
    if bias.dims() != [geometry.c_out] {
        candle_core::bail!(
            "conv2d: the bias has shape {:?}; it needs one value per output channel ({})",
            bias.dims(),
            geometry.c_out
        )
    }
    let op = ConvReluPoolOp {
        geometry,
        kernel,
        stride,
        pooled: ((ho - kernel) / stride + 1, (wo - kernel) / stride + 1),
        layout,
        from: Mutex::new(Vec::new()),
    };
    let mut uses = Vec::new();
    let w = through(&w.contiguous()?, &mut uses);
    let bias = through(&bias.contiguous()?, &mut uses);
    x.contiguous()?.apply_op3(&w, &bias, Held::new(op, uses))
}

/// How the op holds an image's convolution output, one plane per output channel.
///
/// For a stride-1 convolution without padding or dilation, on a CPU with AVX2 and FMA, the
/// planes are *wide*: their rows are as long as the input's (`w_out` values, then `k_w - 1`
/// unused ones), so that output position `q` of a plane reads input position `q + offset` for
/// each patch row's `offset` (its channel, kernel row and column). The patches are then never
/// laid out: the forward and the weight gradient read the image at those offsets
/// ([`simd`](super::simd)), and the input gradient adds each patch row of the gradient back at
/// its offset. Otherwise the planes are `h_out x w_out` and the patches laid out (`im2col`).
#[derive(Clone, Debug)]
struct Planes {
    /// Distance between rows of a plane.
    row: usize,
    /// Values of a plane: `h_out` rows, the last only `w_out` long.
    len: usize,
    /// With wide planes, the offset of each patch row within its group's channels of an
    /// image; empty otherwise.
    offsets: Vec<usize>,
}

impl Planes {
    fn of(g: &Geometry) -> Self {
        let wide = g.stride == 1
            && g.dilation == 1
            && g.padding == 0
            && super::simd::available()
            && g.h_out > 0
            && g.w_out > 0;
        if !wide {
            return Self {
                row: g.w_out,
                len: g.positions(),
                offsets: Vec::new(),
            };
        }
        let plane = g.h * g.w;
        let mut offsets = Vec::with_capacity(g.patch());
        for ci in 0..g.c_in_g() {
            for kh in 0..g.k_h {
                offsets.extend((0..g.k_w).map(|kw| ci * plane + kh * g.w + kw));
            }
        }
        Self {
            row: g.w,
            len: (g.h_out - 1) * g.w + g.w_out,
            offsets,
        }
    }

    fn wide(&self) -> bool {
        !self.offsets.is_empty()
    }
}

/// The sum of `v` in eight interleaved partial sums, which the compiler keeps in one vector
/// register: a plain sum waits on each addition in turn, and for the Net's first layer that
/// (892 values per channel and image) took as long as the weight gradient's products.
fn lanes_sum(v: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let whole = v.chunks_exact(8);
    let rest = whole.remainder().iter().sum::<f32>();
    for chunk in whole {
        for (l, &x) in lanes.iter_mut().zip(chunk) {
            *l += x;
        }
    }
    lanes.iter().sum::<f32>() + rest
}

/// [`ConvReluPoolOp::relu_pool`] for 2x2 windows every 2 positions (the Net's), unrolled: the
/// same comparisons in the same order.
fn relu_pool_2x2(plane: &[f32], wd: usize, out: &mut [f32], from: &mut [u32], pw: usize) {
    for (oh, (out, from)) in out.chunks_mut(pw).zip(from.chunks_mut(pw)).enumerate() {
        let top = 2 * oh * wd;
        let (r0, r1) = (
            &plane[top..top + 2 * pw],
            &plane[top + wd..top + wd + 2 * pw],
        );
        for (ow, (o, f)) in out.iter_mut().zip(from.iter_mut()).enumerate() {
            let c = 2 * ow;
            let candidates = [
                (r0[c], c),
                (r0[c + 1], c + 1),
                (r1[c], wd + c),
                (r1[c + 1], wd + c + 1),
            ];
            let (mut max, mut best) = (candidates[0].0.max(0.0), 0);
            for (q, &(v, _)) in candidates.iter().enumerate().skip(1) {
                if v.max(0.0) > max {
                    max = v.max(0.0);
                    best = q;
                }
            }
            let (v, at) = candidates[best];
            *o = max;
            let stopped = if v >= 0.0 { 0 } else { STOPPED };
            *f = (top + at) as u32 | stopped;
        }
    }
}

/// The fused block as a candle op.
struct ConvReluPoolOp {
    geometry: Geometry,
    kernel: usize,
    stride: usize,
    /// Height and width of the pooled output.
    pooled: (usize, usize),
    /// How the convolution's output is held.
    layout: Planes,
    /// For each pooled value, the position within its channel's convolution output that it
    /// came from, [`STOPPED`] set where the ReLU stops the gradient (set by the forward).
    from: Mutex<Vec<u32>>,
}

impl ConvReluPoolOp {
    /// Pooled values of one output channel.
    fn pooled_plane(&self) -> usize {
        self.pooled.0 * self.pooled.1
    }

    /// Pooled values of one image.
    fn pooled_len(&self) -> usize {
        self.geometry.c_out * self.pooled_plane()
    }

    /// Images per chunk of the batch: at most 8, and four chunks per thread where the batch
    /// allows, so that a thread slowed by others on a shared machine delays the step by less
    /// (rayon hands the chunks out). Each chunk adds one partial weight gradient.
    fn per_chunk(&self) -> usize {
        self.geometry.n.div_ceil(4 * threads()).clamp(1, 8)
    }

    /// Rectifies and pools one channel's convolution output `plane` into `out`, noting in
    /// `from` where each value came from.
    fn relu_pool(&self, plane: &[f32], out: &mut [f32], from: &mut [u32]) {
        let wd = self.layout.row;
        let (ph, pw) = self.pooled;
        if self.kernel == 2 && self.stride == 2 {
            return relu_pool_2x2(plane, wd, out, from, pw);
        }
        for oh in 0..ph {
            for ow in 0..pw {
                let (top, left) = (oh * self.stride, ow * self.stride);
                let mut best = top * wd + left;
                let mut max = plane[best].max(0.0);
                for kh in 0..self.kernel {
                    let row = (top + kh) * wd + left;
                    for (j, &v) in plane[row..row + self.kernel].iter().enumerate() {
                        // candle's ReLU: max(v, 0), so NaN becomes 0. The first maximum wins.
                        if v.max(0.0) > max {
                            max = v.max(0.0);
                            best = row + j;
                        }
                    }
                }
                out[oh * pw + ow] = max;
                // candle's ReLU gradient passes where the input is >= 0.
                let stopped = if plane[best] >= 0.0 { 0 } else { STOPPED };
                from[oh * pw + ow] = best as u32 | stopped;
            }
        }
    }

    /// The forward of images `first..` (as many as `outs` holds): the convolution plus bias,
    /// then ReLU and pooling into `outs`, noting where each value came from in `from`.
    fn forward_images(
        &self,
        (x, w, bias): (&[f32], &[f32], &[f32]),
        first: usize,
        outs: &mut [f32],
        from: &mut [u32],
    ) {
        let g = self.geometry;
        let planes = &self.layout;
        let mut conv = vec![0f32; g.c_out * planes.len];
        let wide = planes.wide();
        let mut cols = vec![0f32; if wide { 0 } else { g.patch() * g.positions() }];
        let images = outs.chunks_mut(self.pooled_len());
        for (i, (out, from)) in images.zip(from.chunks_mut(self.pooled_len())).enumerate() {
            let image = block(x, first + i, g.image_len());
            if wide {
                let channels = g.c_in_g() * g.h * g.w;
                for grp in 0..g.groups {
                    // The group's patch rows, at their offsets in its block of the image.
                    super::simd::shifted_rows(
                        (
                            block_mut(&mut conv, grp, g.c_out_g() * planes.len),
                            planes.len,
                        ),
                        block(w, grp, g.c_out_g() * g.patch()),
                        block(bias, grp, g.c_out_g()),
                        block(image, grp, channels),
                        &planes.offsets,
                        planes.len,
                    );
                }
            } else {
                for (row, &v) in conv.chunks_mut(g.positions()).zip(bias) {
                    row.fill(v);
                }
                for grp in 0..g.groups {
                    g.im2col(image, grp, &mut cols);
                    matmul(
                        Mat::rows(
                            block_mut(&mut conv, grp, g.c_out_g() * g.positions()),
                            g.positions(),
                        ),
                        Mat::rows_of(block(w, grp, g.c_out_g() * g.patch()), g.patch()),
                        Mat::rows_of(&cols, g.positions()),
                        true,
                    );
                }
            }
            let planes = conv.chunks(planes.len);
            let pooled = out.chunks_mut(self.pooled_plane());
            for ((plane, out), from) in planes.zip(pooled).zip(from.chunks_mut(self.pooled_plane()))
            {
                self.relu_pool(plane, out, from);
            }
        }
    }

    /// An image's convolution output gradient from its pooled gradient `dy_i`.
    fn conv_grad(&self, dy_i: &[f32], from: &[u32], dconv: &mut [f32]) {
        dconv.fill(0.0);
        let planes = dconv.chunks_mut(self.layout.len);
        let pooled = dy_i.chunks(self.pooled_plane());
        for ((plane, dy), from) in planes.zip(pooled).zip(from.chunks(self.pooled_plane())) {
            for (&at, &d) in from.iter().zip(dy) {
                if at & STOPPED == 0 {
                    plane[at as usize] += d;
                }
            }
        }
    }

    /// The gradients of the images in `images`: their input gradient into `dx` (when given),
    /// and the returned partial sums of the weight and bias gradients (empty when not wanted).
    fn backward_images(
        &self,
        images: Range<usize>,
        (x, w, dy): (&[f32], &[f32], &[f32]),
        from: &[u32],
        mut dx: Option<&mut [f32]>,
        (want_dw, want_db): (bool, bool),
    ) -> (Vec<f32>, Vec<f32>) {
        let g = self.geometry;
        let planes = &self.layout;
        let wide = planes.wide();
        let per_group = g.c_out_g() * g.patch();
        let cols_len = g.patch() * planes.len;
        let channels = g.c_in_g() * g.h * g.w;
        let mut dw = vec![0f32; if want_dw { g.groups * per_group } else { 0 }];
        let mut db = vec![0f32; if want_db { g.c_out } else { 0 }];
        let mut dconv = vec![0f32; g.c_out * planes.len];
        let mut cols = vec![0f32; if want_dw && !wide { cols_len } else { 0 }];
        let mut dcols = vec![0f32; if dx.is_some() { cols_len } else { 0 }];
        for (k, i) in images.enumerate() {
            let from_i = block(from, i, self.pooled_len());
            self.conv_grad(block(dy, i, self.pooled_len()), from_i, &mut dconv);
            if want_db {
                // The unused values of wide planes are zeros: the same sums.
                for (a, row) in db.iter_mut().zip(dconv.chunks(planes.len)) {
                    *a += lanes_sum(row);
                }
            }
            let image = block(x, i, g.image_len());
            for grp in 0..g.groups {
                let dconv_g = block(&dconv, grp, g.c_out_g() * planes.len);
                if want_dw {
                    let dw_g = block_mut(&mut dw, grp, per_group);
                    let image_g = block(image, grp, channels);
                    // Wide: the patch rows are the image at their offsets (the unused
                    // positions meet zeros of the gradient).
                    if !(wide
                        && super::simd::dots(dw_g, dconv_g, image_g, &planes.offsets, planes.len))
                    {
                        g.im2col(image, grp, &mut cols);
                        matmul_nt(dw_g, dconv_g, &cols, planes.len);
                    }
                }
                if let Some(dx) = dx.as_deref_mut() {
                    matmul(
                        Mat::rows(&mut dcols, planes.len),
                        Mat::transposed(block(w, grp, per_group), g.patch()),
                        Mat::rows_of(dconv_g, planes.len),
                        false,
                    );
                    let dx_g = block_mut(block_mut(dx, k, g.image_len()), grp, channels);
                    if wide {
                        // Each patch row back at its offset.
                        for (row, &at) in dcols.chunks(planes.len).zip(&planes.offsets) {
                            for (x, &v) in dx_g[at..at + planes.len].iter_mut().zip(row) {
                                *x += v;
                            }
                        }
                    } else {
                        col2im(&dcols, g.c_in_g(), &g, dx_g);
                    }
                }
            }
        }
        (dw, db)
    }
}

impl candle_core::CustomOp3 for ConvReluPoolOp {
    fn name(&self) -> &'static str {
        "conv2d-relu-max-pool2d"
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
        let bias = f32_slice(bs, bl, "bias")?;
        let g = self.geometry;
        let shape = Shape::from((g.n, g.c_out, self.pooled.0, self.pooled.1));
        let mut out = vec![0f32; g.n * self.pooled_len()];
        let mut from = vec![0u32; g.n * self.pooled_len()];
        if g.n > 0 {
            let per = self.per_chunk();
            out.par_chunks_mut(per * self.pooled_len())
                .zip(from.par_chunks_mut(per * self.pooled_len()))
                .enumerate()
                .for_each(|(c, (outs, from))| {
                    self.forward_images((x, w, bias), c * per, outs, from)
                });
        }
        *lock(&self.from) = from;
        Ok((CpuStorage::F32(out), shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = self.geometry;
        let (want_dx, want_dw, want_db) = (x.track_op(), w.track_op(), b.track_op());
        let from = lock(&self.from);
        let per = self.per_chunk();
        let mut dx = vec![0f32; if want_dx { g.n * g.image_len() } else { 0 }];
        let (dw, db) = with_f32_values(x, |x| {
            with_f32_values(w, |w| {
                with_f32_values(grad, |dy| {
                    let ranges = (0..g.n.div_ceil(per)).map(|c| c * per..((c + 1) * per).min(g.n));
                    let chunks: Vec<(Range<usize>, Option<&mut [f32]>)> = if want_dx {
                        ranges
                            .zip(dx.chunks_mut(per * g.image_len()).map(Some))
                            .collect()
                    } else {
                        ranges.map(|r| (r, None)).collect()
                    };
                    let partials: Vec<(Vec<f32>, Vec<f32>)> = chunks
                        .into_par_iter()
                        .map(|(images, dx)| {
                            let wanted = (want_dw, want_db);
                            self.backward_images(images, (x, w, dy), &from, dx, wanted)
                        })
                        .collect();
                    let (dws, dbs): (Vec<_>, Vec<_>) = partials.into_iter().unzip();
                    Ok((
                        sum_partials(dws, if want_dw { g.c_out * g.patch() } else { 0 }),
                        sum_partials(dbs, if want_db { g.c_out } else { 0 }),
                    ))
                })
            })
        })?;
        let dx = want_dx
            .then(|| Tensor::from_vec(dx, (g.n, g.c_in, g.h, g.w), &Device::Cpu))
            .transpose()?;
        let dw = want_dw
            .then(|| Tensor::from_vec(dw, (g.c_out, g.c_in_g(), g.k_h, g.k_w), &Device::Cpu))
            .transpose()?;
        let db = want_db
            .then(|| Tensor::from_vec(db, g.c_out, &Device::Cpu))
            .transpose()?;
        Ok((
            hand_over(out, x, dx),
            hand_over(out, w, dw),
            hand_over(out, b, db),
        ))
    }
}
