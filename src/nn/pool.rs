//! 2-D max-pooling with a CPU training kernel of our own: candle's `max_pool2d` shapes, and a
//! backward that sends each output's gradient to the input position its forward picked.
//!
//! candle 0.11 computes max-pool's gradient through a generic path (an upsampled mask, an
//! average pool, another upsampling) and supports only a stride equal to the kernel. Here the
//! forward records, for f32 tensors on the CPU, where each maximum came from (the first, on
//! ties, as PyTorch does); the backward adds each output gradient there. f32 tensors on CUDA
//! (with the `cuda` feature, stride = kernel) run kernels of our own that do the same on the
//! GPU. Other dtypes and devices use candle's kernels, composed so that the gradient is right:
//! candle's own max-pool backward scales every gradient by 1/kernel².
//!
//! ```rust
//! use candle_core::{Device, Tensor};
//! use candle_parallel::nn;
//! # fn main() -> candle_core::Result<()> {
//! let x = Tensor::arange(0f32, 16., &Device::Cpu)?.reshape((1, 1, 4, 4))?;
//! let y = nn::max_pool2d(&x, 2)?;
//! assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, [5., 7., 13., 15.]);
//! # Ok(()) }
//! ```

use super::kernels::{for_each_chunk, ours, own_cpu_kernels, threads};
use crate::util::sync::lock;
use candle_core::{CpuStorage, DType, Device, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;
use std::sync::Mutex;

/// Max-pooling of `x` `(N, C, H, W)` over `kernel`-sized windows with stride `kernel`
/// (candle's `max_pool2d`).
pub fn max_pool2d(x: &Tensor, kernel: usize) -> Result<Tensor> {
    max_pool2d_with_stride(x, kernel, kernel)
}

/// Max-pooling of `x` `(N, C, H, W)` over `kernel`-sized windows every `stride` positions:
/// outputs `(H - kernel) / stride + 1` high and wide, as candle's `max_pool2d_with_stride`.
pub fn max_pool2d_with_stride(x: &Tensor, kernel: usize, stride: usize) -> Result<Tensor> {
    let cpu_f32 = x.device().is_cpu() && x.dtype() == DType::F32;
    if x.rank() != 4 || (cpu_f32 && !own_cpu_kernels()) {
        return x.max_pool2d_with_stride(kernel, stride);
    }
    let (n, c, h, w) = x.dims4()?;
    if kernel == 0 || stride == 0 {
        candle_core::bail!("max_pool2d: kernel {kernel} and stride {stride} must be at least 1")
    }
    if h < kernel || w < kernel {
        candle_core::bail!("max_pool2d: kernel-size {kernel} is larger than the input size {h},{w}")
    }
    if u32::try_from(h * w).is_err() {
        candle_core::bail!("max_pool2d: planes of {h}x{w} are too large (at most 2^32 values)")
    }
    #[cfg(feature = "cuda")]
    if stride == kernel && super::conv_cuda::takes(&[x]) {
        return super::conv_cuda::max_pool2d(x, kernel);
    }
    if !ours(&[x]) {
        return by_gather(x, kernel, stride);
    }
    let op = MaxPool2dOp {
        dims: (n, c),
        input: (h, w),
        output: ((h - kernel) / stride + 1, (w - kernel) / stride + 1),
        kernel,
        stride,
        argmax: Mutex::new(Vec::new()),
    };
    x.contiguous()?.apply_op1(op)
}

/// Max-pooling from candle ops whose gradients are right, for devices and dtypes our kernel
/// does not take (candle's own max-pool gradient is scaled by 1/kernel², and it has none for a
/// stride other than the kernel): every window's values gathered (`index_select`), the
/// position of each maximum (`argmax`), the maximum taken there (`gather`), so the backward
/// sends each output's gradient to one input, as PyTorch's does.
fn by_gather(x: &Tensor, kernel: usize, stride: usize) -> Result<Tensor> {
    let (n, c, h, w) = x.dims4()?;
    let (ho, wo) = ((h - kernel) / stride + 1, (w - kernel) / stride + 1);
    let window = kernel * kernel;
    let mut at = Vec::with_capacity(ho * wo * window);
    for oh in 0..ho {
        for ow in 0..wo {
            for kh in 0..kernel {
                let row = (oh * stride + kh) * w + ow * stride;
                // Fits: h * w was checked against u32.
                at.extend((row..row + kernel).map(|i| i as u32));
            }
        }
    }
    let at = Tensor::from_vec(at, ho * wo * window, &Device::Cpu)?.to_device(x.device())?;
    let windows = x
        .flatten_from(2)?
        .index_select(&at, 2)?
        .reshape((n, c, ho * wo, window))?;
    let best = windows.argmax_keepdim(D::Minus1)?;
    windows.gather(&best, D::Minus1)?.reshape((n, c, ho, wo))
}

/// One max-pooling, with where each maximum came from.
struct MaxPool2dOp {
    /// Images and channels: `dims.0 * dims.1` planes.
    dims: (usize, usize),
    input: (usize, usize),
    output: (usize, usize),
    kernel: usize,
    stride: usize,
    /// For each output, the index within its input plane of the value it took (set by the
    /// forward, read by the backward).
    argmax: Mutex<Vec<u32>>,
}

impl MaxPool2dOp {
    fn planes(&self) -> usize {
        self.dims.0 * self.dims.1
    }

    /// Pools one input plane into `out`, noting in `idx` where each maximum came from.
    fn pool_plane(&self, plane: &[f32], out: &mut [f32], idx: &mut [u32]) {
        let ((_, w), (ho, wo)) = (self.input, self.output);
        for oh in 0..ho {
            for ow in 0..wo {
                let (top, left) = (oh * self.stride, ow * self.stride);
                let mut best = top * w + left;
                for kh in 0..self.kernel {
                    let row = (top + kh) * w + left;
                    for j in row..row + self.kernel {
                        // The first maximum wins ties; a NaN wins, as in PyTorch.
                        let (v, b) = (plane[j], plane[best]);
                        if v > b || (v.is_nan() && !b.is_nan()) {
                            best = j;
                        }
                    }
                }
                out[oh * wo + ow] = plane[best];
                idx[oh * wo + ow] = best as u32;
            }
        }
    }
}

impl candle_core::CustomOp1 for MaxPool2dOp {
    fn name(&self) -> &'static str {
        "max-pool2d-argmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = match (s, l.contiguous_offsets()) {
            (CpuStorage::F32(v), Some((a, b))) => &v[a..b],
            _ => candle_core::bail!("max_pool2d: expected a contiguous f32 tensor"),
        };
        let ((h, w), (ho, wo)) = (self.input, self.output);
        let per_plane = ho * wo;
        let planes = self.planes();
        let (n, c) = self.dims;
        if planes == 0 {
            return Ok((CpuStorage::F32(Vec::new()), Shape::from((n, c, ho, wo))));
        }
        let mut out = vec![0f32; planes * per_plane];
        let mut argmax = vec![0u32; planes * per_plane];
        let per_chunk = planes.div_ceil(threads()) * per_plane;
        out.par_chunks_mut(per_chunk)
            .zip(argmax.par_chunks_mut(per_chunk))
            .enumerate()
            .for_each(|(c, (outs, idxs))| {
                let first = c * per_chunk / per_plane;
                let pairs = outs.chunks_mut(per_plane).zip(idxs.chunks_mut(per_plane));
                for (i, (out, idx)) in pairs.enumerate() {
                    let plane = &x[(first + i) * h * w..(first + i + 1) * h * w];
                    self.pool_plane(plane, out, idx);
                }
            });
        *lock(&self.argmax) = argmax;
        Ok((CpuStorage::F32(out), Shape::from((n, c, ho, wo))))
    }

    fn bwd(&self, x: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let ((h, w), (ho, wo)) = (self.input, self.output);
        let per_plane = ho * wo;
        let argmax = lock(&self.argmax);
        let grad = grad.contiguous()?;
        let (storage, layout) = grad.storage_and_layout();
        let dy = match (&*storage, layout.contiguous_offsets()) {
            (candle_core::Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => &v[a..b],
            _ => candle_core::bail!("max_pool2d: expected a contiguous f32 CPU gradient"),
        };
        let mut dx = vec![0f32; self.planes() * h * w];
        for_each_chunk(&mut dx, h * w, |first, planes| {
            for (i, plane) in planes.chunks_mut(h * w).enumerate() {
                let p = first + i;
                let from = &argmax[p * per_plane..(p + 1) * per_plane];
                for (&at, &g) in from.iter().zip(&dy[p * per_plane..(p + 1) * per_plane]) {
                    plane[at as usize] += g;
                }
            }
        });
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}
