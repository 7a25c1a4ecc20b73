//! The CUDA forwards of the fused layers in [`ops`](super::ops) and
//! [`rotary_emb`](super::rotary_emb): candle's own kernels (`candle-kernels`' reduce module),
//! launched as candle-nn launches them, so the numbers are candle's. Their backwards are made of
//! candle ops, or reuse these kernels (a rotation's backward is a rotation).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{kernel_name, kernels, CudaStorageSlice as S, WrapErr};
use candle_core::{CudaDevice, CudaStorage, Layout, Result, Shape, WithDType};

/// The values of a contiguous tensor.
fn view<'a, T>(s: &'a CudaSlice<T>, l: &Layout, what: &str) -> Result<CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(s.slice(start..end)),
        None => candle_core::bail!("{what} must be contiguous here (got {l:?})"),
    }
}

/// The slice of element type `$v` in `$s`, or an error.
macro_rules! typed {
    ($v:ident, $s:expr) => {
        match $s {
            S::$v(v) => v,
            _ => candle_core::bail!("the fused layers take tensors of one dtype"),
        }
    };
}

/// Runs `$go!(F32)` (or F64, F16, BF16) for the element type of `$s`.
macro_rules! by_dtype {
    ($s:expr, $go:ident) => {
        match $s {
            S::F32(_) => S::F32($go!(F32)),
            S::F64(_) => S::F64($go!(F64)),
            S::F16(_) => S::F16($go!(F16)),
            S::BF16(_) => S::BF16($go!(BF16)),
            _ => candle_core::bail!("the fused layers take f32, f64, f16 or bf16 tensors"),
        }
    };
}

fn storage(slice: S, device: &CudaDevice) -> CudaStorage {
    CudaStorage {
        slice,
        device: device.clone(),
    }
}

#[allow(clippy::too_many_arguments)]
fn norm_kernel<T: DeviceRepr + WithDType>(
    dev: &CudaDevice,
    x: &CudaSlice<T>,
    lx: &Layout,
    alpha: &CudaSlice<T>,
    la: &Layout,
    beta: Option<(&CudaSlice<T>, &Layout)>,
    eps: f32,
    remove_mean: bool,
) -> Result<CudaSlice<T>> {
    let src = view(x, lx, "the input")?;
    let alpha = view(alpha, la, "the weight")?;
    let beta = match beta {
        Some((b, lb)) => Some(view(b, lb, "the bias")?),
        None => None,
    };
    let el = lx.shape().elem_count();
    let n = lx.dims().last().copied().unwrap_or(1).max(1);
    let block = if n < 1024 { 32u32 } else { 1024 };
    let cfg = LaunchConfig {
        grid_dim: ((el / n) as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    let name = if remove_mean { "layernorm" } else { "rmsnorm" };
    let func = dev.get_or_load_func(&kernel_name::<T>(name), &kernels::REDUCE)?;
    // SAFETY: every element is written by the kernel.
    let dst = unsafe { dev.alloc::<T>(el)? };
    // candle's layernorm kernel skips the shift when given a null pointer.
    let null = 0u64;
    let mut builder = func.builder();
    builder.arg(&src);
    builder.arg(&dst);
    builder.arg(&alpha);
    if remove_mean {
        match &beta {
            Some(beta) => builder.arg(beta),
            None => builder.arg(&null),
        };
    }
    candle_core::builder_arg!(builder, n as i32, block as i32, eps);
    // SAFETY: the arguments match the kernel's signature.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(dst)
}

/// Layer (`remove_mean`) or RMS normalisation over the last dimension.
pub(super) fn norm(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    beta: Option<(&CudaStorage, &Layout)>,
    eps: f32,
    remove_mean: bool,
) -> Result<(CudaStorage, Shape)> {
    let dev = s1.device();
    macro_rules! go {
        ($v:ident) => {{
            let beta = match beta {
                Some((s, l)) => Some((typed!($v, &s.slice), l)),
                None => None,
            };
            let x = typed!($v, &s1.slice);
            let alpha = typed!($v, &s2.slice);
            norm_kernel(dev, x, l1, alpha, l2, beta, eps, remove_mean)?
        }};
    }
    let slice = by_dtype!(&s1.slice, go);
    Ok((storage(slice, dev), l1.shape().clone()))
}

fn softmax_kernel<T: DeviceRepr + WithDType>(
    dev: &CudaDevice,
    x: &CudaSlice<T>,
    l: &Layout,
) -> Result<CudaSlice<T>> {
    let src = view(x, l, "the input")?;
    let el = l.shape().elem_count();
    let n = l.dims().last().copied().unwrap_or(1).max(1);
    let cfg = LaunchConfig {
        grid_dim: ((el / n) as u32, 1, 1),
        block_dim: (1, 32, 1),
        shared_mem_bytes: 0,
    };
    let func = dev.get_or_load_func(&kernel_name::<T>("softmax"), &kernels::REDUCE)?;
    // SAFETY: every element is written by the kernel.
    let dst = unsafe { dev.alloc::<T>(el)? };
    let mut builder = func.builder();
    builder.arg(&src);
    builder.arg(&dst);
    candle_core::builder_arg!(builder, n as i32);
    // SAFETY: the arguments match the kernel's signature.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(dst)
}

/// Softmax over the last dimension.
pub(super) fn softmax_last_dim(s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
    let dev = s.device();
    macro_rules! go {
        ($v:ident) => {
            softmax_kernel(dev, typed!($v, &s.slice), l)?
        };
    }
    let slice = by_dtype!(&s.slice, go);
    Ok((storage(slice, dev), l.shape().clone()))
}

#[allow(clippy::too_many_arguments)]
fn rope_kernel<T: DeviceRepr + WithDType>(
    dev: &CudaDevice,
    kernel: &str,
    x: &CudaSlice<T>,
    lx: &Layout,
    cos: &CudaSlice<T>,
    lc: &Layout,
    sin: &CudaSlice<T>,
    ls: &Layout,
) -> Result<CudaSlice<T>> {
    let src = view(x, lx, "the input")?;
    let cos = view(cos, lc, "cos")?;
    let sin = view(sin, ls, "sin")?;
    let (d0, d1, d2, d) = lx.shape().dims4()?;
    let el = d0 * d1 * d2 * d;
    let stride_b = if lc.dims().len() == 3 {
        (d1 * d2 * d) as u32
    } else {
        0
    };
    let cfg = LaunchConfig::for_num_elems((el / 2) as u32);
    let func = dev.get_or_load_func(&kernel_name::<T>(kernel), &kernels::REDUCE)?;
    // SAFETY: every element is written by the kernel.
    let dst = unsafe { dev.alloc::<T>(el)? };
    // The sizes each kernel takes after its four pointers (all u32).
    let (bh, td) = ((d0 * d1) as u32, (d2 * d) as u32);
    let sizes: Vec<u32> = match kernel {
        "rope_i" => vec![bh, td, stride_b],
        "rope" => vec![bh, td, d as u32, stride_b],
        _ => vec![d0 as u32, d1 as u32, d2 as u32, d as u32, stride_b],
    };
    let mut builder = func.builder();
    builder.arg(&src);
    builder.arg(&cos);
    builder.arg(&sin);
    builder.arg(&dst);
    for size in &sizes {
        builder.arg(size);
    }
    // SAFETY: the arguments match the kernel's signature.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(dst)
}

/// A rotary embedding with candle's kernel `kernel` (`rope`, `rope_i` or `rope_thd`).
pub(super) fn rope(
    kernel: &str,
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    s3: &CudaStorage,
    l3: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = s1.device();
    if l1.shape().elem_count() == 0 {
        candle_core::bail!("{kernel}: the input is empty");
    }
    macro_rules! go {
        ($v:ident) => {{
            let (x, cos, sin) = (
                typed!($v, &s1.slice),
                typed!($v, &s2.slice),
                typed!($v, &s3.slice),
            );
            rope_kernel(dev, kernel, x, l1, cos, l2, sin, l3)?
        }};
    }
    let slice = by_dtype!(&s1.slice, go);
    Ok((storage(slice, dev), l1.shape().clone()))
}
