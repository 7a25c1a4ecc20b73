//! The CIFAR Net's convolution block (convolution, bias, ReLU, max-pooling) and max-pooling on
//! CUDA, for f32 tensors, with a backward of our own.
//!
//! Composed from candle ops, the block's backward on a GPU is most of the Net's step: the
//! max-pooling's gradient (candle's is scaled by 1/kernel², so [`max_pool2d`](super::max_pool2d)
//! composes a right one from gathers, whose gradients scatter) and candle's convolution
//! backward, which takes the weight gradient as a convolution of the input by the output
//! gradient (a patch layout as large as the batch) and the input gradient even for the images
//! themselves, which need none. Here:
//! - the forward runs candle's convolution, then one kernel (`pool.cu`) adds the bias,
//!   rectifies and pools, noting where each pooled value came from (as the CPU op does);
//! - the backward sends each pooled gradient back there (one kernel), sums the bias gradient,
//!   takes the weight gradient as one batched matrix product of the output gradient by the
//!   input's patches, and the input gradient (only where the input needs one) as the weight's
//!   transpose times the output gradient, its patches added back (`col2im`).
//!
//! The windows of the pooling must not overlap (stride = kernel, the Net's and candle's
//! `max_pool2d`), the convolution must have one group; otherwise, and for other dtypes, the
//! candle ops run. [`use_own_cuda_kernels`](super::use_own_cuda_kernels)`(false)` selects them
//! too, for comparison.

use super::conv_kernel::Geometry;
use super::fused_cuda::{storage, view};
use crate::util::nvrtc::compiled;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice as S, WrapErr};
use candle_core::{
    CpuStorage, CudaDevice, CudaStorage, DType, Layout, Result, Shape, Storage, Tensor,
};
use candle_nn::Conv2dConfig;
use std::sync::{Arc, Mutex, OnceLock};

/// The source of the block's kernels.
const POOL_SRC: &str = include_str!("pool.cu");
/// The module of those kernels on a device.
const POOL_MODULE: &str = "candle_parallel_pool";
/// Threads per block of the element-wise kernels.
const THREADS: u32 = 256;
/// At most this many blocks: the kernels loop over what is left.
const MAX_BLOCKS: usize = 1 << 16;

/// Whether our CUDA kernels take these tensors: all f32 on a CUDA device, none empty, and ours
/// not switched off.
pub(super) fn takes(ts: &[&Tensor]) -> bool {
    super::kernels::own_cuda_kernels()
        && ts
            .iter()
            .all(|t| t.device().is_cuda() && t.dtype() == DType::F32 && t.elem_count() > 0)
}

fn pool_ptx() -> Result<&'static str> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    compiled(&PTX, POOL_SRC, "pooling kernels (nn/pool.cu)")
}

/// A launch over `total` elements (a loop in each thread covers what the blocks do not).
fn launch_over(total: usize) -> LaunchConfig {
    let blocks = total.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `v` as a kernel's `int`.
fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("{what} {v} is over 2^31")))
}

/// The f32 values of a CUDA storage.
fn f32s<'a>(s: &'a CudaStorage, what: &str) -> Result<&'a CudaSlice<f32>> {
    match &s.slice {
        S::F32(v) => Ok(v),
        _ => candle_core::bail!("the {what} must be f32 here (got {:?})", s.dtype()),
    }
}

/// Pooling sizes: `planes` planes of `h x w` pooled by `k x k` windows into `ho x wo`.
#[derive(Clone, Copy, Debug)]
struct Pooling {
    planes: usize,
    channels: usize,
    h: usize,
    w: usize,
    ho: usize,
    wo: usize,
    k: usize,
}

impl Pooling {
    fn new(n: usize, c: usize, h: usize, w: usize, k: usize) -> Result<Self> {
        if k == 0 || h < k || w < k {
            candle_core::bail!("max_pool2d: kernel-size {k} does not fit the input size {h},{w}")
        }
        if u32::try_from(h * w).map_or(true, |p| p >= 1 << 31) {
            candle_core::bail!("max_pool2d: planes of {h}x{w} are too large (at most 2^31 values)")
        }
        Ok(Self {
            planes: n * c,
            channels: c,
            h,
            w,
            ho: h / k,
            wo: w / k,
            k,
        })
    }

    /// Pools `y` (the planes), plus `bias` per channel and ReLU'd when asked: the pooled values,
    /// and where each came from.
    fn forward(
        &self,
        dev: &CudaDevice,
        y: &CudaSlice<f32>,
        yl: &Layout,
        bias: Option<(&CudaSlice<f32>, &Layout)>,
        relu: bool,
    ) -> Result<(CudaSlice<f32>, CudaSlice<u32>)> {
        let y = view(y, yl, "the convolution's output")?;
        let bias = bias.map(|(b, l)| view(b, l, "the bias")).transpose()?;
        let total = self.planes * self.ho * self.wo;
        // SAFETY: the kernel writes every element of both.
        let (out, from) = unsafe { (dev.alloc::<f32>(total)?, dev.alloc::<u32>(total)?) };
        let func = dev.get_or_load_custom_func("cp_pool_f32", POOL_MODULE, pool_ptx()?)?;
        let null = 0u64;
        let mut builder = func.builder();
        builder.arg(&y);
        match &bias {
            Some(b) => builder.arg(b),
            None => builder.arg(&null),
        };
        let relu = i32::from(relu);
        let planes = self.planes as i64;
        let (c, h, w) = (
            int(self.channels, "channels")?,
            int(self.h, "height")?,
            int(self.w, "width")?,
        );
        let (ho, wo, k) = (self.ho as i32, self.wo as i32, self.k as i32);
        builder.arg(&relu);
        builder.arg(&out);
        builder.arg(&from);
        candle_core::builder_arg!(builder, planes, c, h, w, ho, wo, k);
        // SAFETY: the arguments match `cp_pool_f32` in pool.cu.
        unsafe { builder.launch(launch_over(total)) }.w()?;
        Ok((out, from))
    }

    /// The planes' gradient from the pooled gradient `dy` and where each pooled value came from.
    fn backward(&self, dy: &Tensor, from: &CudaSlice<u32>) -> Result<Tensor> {
        let shape = Shape::from((self.planes / self.channels, self.channels, self.h, self.w));
        dy.contiguous()?.apply_op1_no_bwd(&Unpool {
            pooling: *self,
            from,
            shape,
        })
    }
}

/// Sends each pooled gradient back to where its value came from.
struct Unpool<'a> {
    pooling: Pooling,
    from: &'a CudaSlice<u32>,
    shape: Shape,
}

impl candle_core::CustomOp1 for Unpool<'_> {
    fn name(&self) -> &'static str {
        "max-pool2d-backward"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("max-pool2d-backward: CUDA only")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = s.device();
        let p = self.pooling;
        let dy = view(f32s(s, "pooled gradient")?, l, "the pooled gradient")?;
        let total = p.planes * p.h * p.w;
        // SAFETY: the kernel writes every element.
        let dx = unsafe { dev.alloc::<f32>(total)? };
        let func = dev.get_or_load_custom_func("cp_unpool_f32", POOL_MODULE, pool_ptx()?)?;
        let mut builder = func.builder();
        builder.arg(&dy);
        builder.arg(self.from);
        builder.arg(&dx);
        let planes = p.planes as i64;
        let (h, w, ho, wo, k) = (p.h as i32, p.w as i32, p.ho as i32, p.wo as i32, p.k as i32);
        candle_core::builder_arg!(builder, planes, h, w, ho, wo, k);
        // SAFETY: the arguments match `cp_unpool_f32` in pool.cu.
        unsafe { builder.launch(launch_over(total)) }.w()?;
        Ok((storage(S::F32(dx), dev), self.shape.clone()))
    }
}

/// The sizes the patch kernels take, as `int`s: images, input channels, height, width, kernel
/// height and width, output height and width, padding, stride, dilation.
fn patch_sizes(g: &Geometry) -> Result<[i32; 11]> {
    let values = [
        g.n, g.c_in, g.h, g.w, g.k_h, g.k_w, g.h_out, g.w_out, g.padding, g.stride, g.dilation,
    ];
    let mut out = [0i32; 11];
    for (o, v) in out.iter_mut().zip(values) {
        *o = int(v, "a convolution size")?;
    }
    Ok(out)
}

/// A convolution's patches as rows, per image: `(n, h_out * w_out, c_in * k_h * k_w)`.
struct Im2Col(Geometry);

/// The input gradient from the patches' gradient `(c_in * k_h * k_w, n * h_out * w_out)`.
struct Col2Im(Geometry);

/// Launches pool.cu's patch kernel `name` from `src` into a new tensor of `total` values.
fn patches(
    name: &str,
    g: &Geometry,
    s: &CudaStorage,
    l: &Layout,
    total: usize,
) -> Result<CudaStorage> {
    let dev = s.device();
    let src = view(f32s(s, "tensor")?, l, "the tensor")?;
    // SAFETY: the kernel writes every element.
    let dst = unsafe { dev.alloc::<f32>(total)? };
    let func = dev.get_or_load_custom_func(name, POOL_MODULE, pool_ptx()?)?;
    let mut builder = func.builder();
    builder.arg(&src);
    builder.arg(&dst);
    let sizes = patch_sizes(g)?;
    for size in &sizes {
        builder.arg(size);
    }
    // SAFETY: the arguments match the kernel's signature in pool.cu.
    unsafe { builder.launch(launch_over(total)) }.w()?;
    Ok(storage(S::F32(dst), dev))
}

impl candle_core::CustomOp1 for Im2Col {
    fn name(&self) -> &'static str {
        "im2col"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("im2col: CUDA only")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let g = &self.0;
        let shape = Shape::from((g.n, g.h_out * g.w_out, g.c_in * g.k_h * g.k_w));
        let cols = patches("cp_im2col_f32", g, s, l, shape.elem_count())?;
        Ok((cols, shape))
    }
}

impl candle_core::CustomOp1 for Col2Im {
    fn name(&self) -> &'static str {
        "col2im"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("col2im: CUDA only")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let g = &self.0;
        let shape = Shape::from((g.n, g.c_in, g.h, g.w));
        let dx = patches("cp_col2im_f32", g, s, l, shape.elem_count())?;
        Ok((dx, shape))
    }
}

/// Where the forward left each pooled value's origin, for the backward.
type Origins = Mutex<Option<Arc<CudaSlice<u32>>>>;

fn origins(from: &Origins, op: &str) -> Result<Arc<CudaSlice<u32>>> {
    match &*crate::util::sync::lock(from) {
        Some(from) => Ok(from.clone()),
        None => candle_core::bail!("{op}: the backward ran before the forward"),
    }
}

/// `max_pool2d(x, kernel)` (stride = kernel) on CUDA, for [`takes`] tensors.
pub(super) fn max_pool2d(x: &Tensor, kernel: usize) -> Result<Tensor> {
    let (n, c, h, w) = x.dims4()?;
    let op = PoolOp {
        pooling: Pooling::new(n, c, h, w, kernel)?,
        from: Mutex::new(None),
    };
    x.contiguous()?.apply_op1(op)
}

struct PoolOp {
    pooling: Pooling,
    from: Origins,
}

impl candle_core::CustomOp1 for PoolOp {
    fn name(&self) -> &'static str {
        "max-pool2d-cuda"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("max-pool2d-cuda: CUDA only")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let p = self.pooling;
        let (out, from) = p.forward(s.device(), f32s(s, "input")?, l, None, false)?;
        *crate::util::sync::lock(&self.from) = Some(Arc::new(from));
        let shape = Shape::from((p.planes / p.channels, p.channels, p.ho, p.wo));
        Ok((storage(S::F32(out), s.device()), shape))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let from = origins(&self.from, self.name())?;
        Ok(Some(self.pooling.backward(grad, &from)?))
    }
}

/// `max_pool2d(relu(conv2d(x, w) + bias), kernel)` on CUDA, for [`takes`] tensors and one group.
pub(super) fn conv2d_relu_max_pool2d(
    x: &Tensor,
    w: &Tensor,
    bias: &Tensor,
    cfg: &Conv2dConfig,
    kernel: usize,
) -> Result<Tensor> {
    let geometry = Geometry::new(x.dims(), w.dims(), cfg)?;
    if bias.dims() != [geometry.c_out] {
        candle_core::bail!(
            "conv2d: the bias has shape {:?}; it needs one value per output channel ({})",
            bias.dims(),
            geometry.c_out
        )
    }
    let pooling = Pooling::new(
        geometry.n,
        geometry.c_out,
        geometry.h_out,
        geometry.w_out,
        kernel,
    )?;
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    // candle's convolution, outside the graph: the op below is the block's one node.
    let conv = x
        .detach()
        .conv2d(&w.detach(), cfg.padding, cfg.stride, cfg.dilation, 1)?;
    let op = BlockOp {
        geometry,
        pooling,
        conv: Mutex::new(Some(conv)),
        from: Mutex::new(None),
    };
    x.apply_op3(&w, &bias.contiguous()?, op)
}

struct BlockOp {
    geometry: Geometry,
    pooling: Pooling,
    /// The convolution's output, until the forward pools it.
    conv: Mutex<Option<Tensor>>,
    from: Origins,
}

impl candle_core::CustomOp3 for BlockOp {
    fn name(&self) -> &'static str {
        "conv2d-relu-max-pool2d-cuda"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("conv2d-relu-max-pool2d-cuda: CUDA only")
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        bs: &CudaStorage,
        bl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let conv = crate::util::sync::lock(&self.conv).take();
        let Some(conv) = conv else {
            candle_core::bail!("{}: the op ran twice", self.name())
        };
        let (cs, cl) = conv.storage_and_layout();
        let Storage::Cuda(cs) = &*cs else {
            candle_core::bail!(
                "{}: the convolution's output is not on the GPU",
                self.name()
            )
        };
        let p = self.pooling;
        let bias = (f32s(bs, "bias")?, bl);
        let (out, from) = p.forward(bs.device(), f32s(cs, "input")?, cl, Some(bias), true)?;
        *crate::util::sync::lock(&self.from) = Some(Arc::new(from));
        let shape = Shape::from((self.geometry.n, p.channels, p.ho, p.wo));
        Ok((storage(S::F32(out), bs.device()), shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = self.geometry;
        let from = origins(&self.from, self.name())?;
        let dconv = self.pooling.backward(grad, &from)?;
        let positions = g.h_out * g.w_out;
        let patch = g.c_in * g.k_h * g.k_w;
        let db = b.track_op().then(|| dconv.sum((0, 2, 3))).transpose()?;
        let dconv = dconv.reshape((g.n, g.c_out, positions))?;
        let dw = match w.track_op() {
            // Per image (c_out x positions) . (positions x patch), summed over the images.
            true => {
                let cols = x.apply_op1_no_bwd(&Im2Col(g))?;
                Some(dconv.matmul(&cols)?.sum(0)?.reshape(w.shape())?)
            }
            false => None,
        };
        let dx = match x.track_op() {
            true => {
                let dconv = dconv
                    .transpose(0, 1)?
                    .contiguous()?
                    .reshape((g.c_out, g.n * positions))?;
                let wt = w.reshape((g.c_out, patch))?.t()?.contiguous()?;
                Some(wt.matmul(&dconv)?.apply_op1_no_bwd(&Col2Im(g))?)
            }
            false => None,
        };
        Ok((dx, dw, db))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC compiles the block's kernels (no GPU needed, only libnvrtc).
    #[test]
    fn the_pooling_kernels_compile_with_nvrtc() {
        let ptx = pool_ptx().unwrap();
        for kernel in [
            "cp_pool_f32",
            "cp_unpool_f32",
            "cp_im2col_f32",
            "cp_col2im_f32",
        ] {
            let entry = format!(".entry {kernel}(");
            assert!(ptx.contains(&entry), "{entry} is missing from the PTX");
        }
    }
}
