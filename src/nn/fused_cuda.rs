//! The CUDA forwards of the fused layers in [`ops`](super::ops) and
//! [`rotary_emb`](super::rotary_emb). Their backwards are made of candle ops, or reuse these
//! kernels (a rotation's backward is a rotation).
//!
//! The normalisations and softmax reduce, and candle's kernels for them break the crate's rule
//! (see the [`nn` module docs](super)): its layer norm takes the variance as `E[x²] - E[x]²` in
//! f32 (also for f64), and its softmax takes the exponentials in the element type. They run
//! kernels of our own instead (`rows.cu`, the CPU kernels' arithmetic, one warp per row),
//! compiled by NVRTC on first use. The rotary embeddings reduce nothing: candle's kernels
//! (`candle-kernels`' reduce module), launched as candle-nn launches them.

use crate::util::nvrtc::compiled;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{kernel_name, kernels, CudaStorageSlice as S, WrapErr};
use candle_core::{CudaDevice, CudaStorage, Layout, Result, Shape, WithDType};
use std::sync::OnceLock;

/// The source of our row kernels.
const ROWS_SRC: &str = include_str!("rows.cu");
/// Rows one block of the row kernels takes: a warp each.
const ROWS_PER_BLOCK: u32 = 8;

/// The module of our row kernels on a device.
const ROWS_MODULE: &str = "candle_parallel_rows";

/// The PTX of our row kernels, compiled once per process (NVRTC).
fn rows_ptx() -> Result<&'static str> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    compiled(&PTX, ROWS_SRC, "row kernels (nn/rows.cu)")
}

/// The name of our row kernel `kernel` (`cp_norm`, `cp_softmax`) for element type `T`.
fn row_kernel_name<T: WithDType>(kernel: &str) -> String {
    format!("{kernel}_{}", T::DTYPE.as_str())
}

/// The launch of a row kernel over `rows` rows.
fn row_launch(rows: usize) -> Result<LaunchConfig> {
    let blocks = u32::try_from(rows.div_ceil(ROWS_PER_BLOCK as usize))
        .map_err(|_| candle_core::Error::Msg(format!("{rows} rows are too many for one launch")))?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (32, ROWS_PER_BLOCK, 1),
        shared_mem_bytes: 0,
    })
}

/// `rows` and `n` as the kernels' `int`s.
fn row_sizes(rows: usize, n: usize) -> Result<(i32, i32)> {
    match (i32::try_from(rows), i32::try_from(n)) {
        (Ok(r), Ok(n)) => Ok((r, n)),
        _ => candle_core::bail!("{rows} rows of {n} values: both must be below 2^31"),
    }
}

/// The values of a contiguous tensor.
pub(super) fn view<'a, T>(s: &'a CudaSlice<T>, l: &Layout, what: &str) -> Result<CudaView<'a, T>> {
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

pub(super) fn storage(slice: S, device: &CudaDevice) -> CudaStorage {
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
    // SAFETY: every element is written by the kernel.
    let dst = unsafe { dev.alloc::<T>(el)? };
    if el == 0 {
        return Ok(dst);
    }
    let (rows, cols) = row_sizes(el / n, n)?;
    let name = row_kernel_name::<T>("cp_norm");
    let func = dev.get_or_load_custom_func(&name, ROWS_MODULE, rows_ptx()?)?;
    // The kernel skips the shift when given a null pointer.
    let null = 0u64;
    let mut builder = func.builder();
    builder.arg(&src);
    builder.arg(&dst);
    builder.arg(&alpha);
    match &beta {
        Some(beta) => builder.arg(beta),
        None => builder.arg(&null),
    };
    let remove_mean = i32::from(remove_mean);
    candle_core::builder_arg!(builder, rows, cols, eps, remove_mean);
    // SAFETY: the arguments match the kernel's signature (rows.cu's `cp_norm_*`).
    unsafe { builder.launch(row_launch(el / n)?) }.w()?;
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
    // SAFETY: every element is written by the kernel.
    let dst = unsafe { dev.alloc::<T>(el)? };
    if el == 0 {
        return Ok(dst);
    }
    let (rows, cols) = row_sizes(el / n, n)?;
    let name = row_kernel_name::<T>("cp_softmax");
    let func = dev.get_or_load_custom_func(&name, ROWS_MODULE, rows_ptx()?)?;
    let mut builder = func.builder();
    builder.arg(&src);
    builder.arg(&dst);
    candle_core::builder_arg!(builder, rows, cols);
    // SAFETY: the arguments match the kernel's signature (rows.cu's `cp_softmax_*`).
    unsafe { builder.launch(row_launch(el / n)?) }.w()?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC compiles the row kernels (no GPU needed, only libnvrtc): every entry point the
    /// launches name is in the PTX.
    #[test]
    fn the_row_kernels_compile_with_nvrtc() {
        let ptx = rows_ptx().unwrap();
        for kernel in ["cp_norm", "cp_softmax"] {
            for dtype in ["f32", "f64", "f16", "bf16"] {
                let entry = format!(".entry {kernel}_{dtype}(");
                assert!(ptx.contains(&entry), "{entry} is missing from the PTX");
            }
        }
        assert_eq!(row_kernel_name::<half::bf16>("cp_norm"), "cp_norm_bf16");
    }
}
