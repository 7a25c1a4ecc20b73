//! The forward of the custom ops that hand a tensor on unchanged, to hook autograd (DDP's
//! gradient-ready op, SyncBatchNorm's statistics gradient, the differentiable all-reduce).
//! candle's custom ops cannot return storage shared with their input, so the forward copies.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result, Shape};

/// Fails unless `l` is compact (contiguous from offset 0), where a storage's whole copy is
/// exactly the tensor's values. Every caller passes such a tensor (a variable, or a fresh
/// op result); a view would otherwise come out with the wrong values.
pub(crate) fn check(l: &Layout) -> Result<()> {
    if !l.is_contiguous() || l.start_offset() != 0 {
        candle_core::bail!("pass-through op given a view ({l:?}): make it contiguous first");
    }
    Ok(())
}

/// A copy of the compact tensor `s` under `l`.
pub(crate) fn cpu(s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
    check(l)?;
    Ok((s.try_clone(l)?, l.shape().clone()))
}

/// A copy of the compact tensor `s` under `l`, on its GPU.
#[cfg(feature = "cuda")]
pub(crate) fn cuda(
    s: &candle_core::CudaStorage,
    l: &Layout,
) -> Result<(candle_core::CudaStorage, Shape)> {
    check(l)?;
    Ok((s.try_clone(l)?, l.shape().clone()))
}

/// A copy of the compact tensor `s` under `l` in `dtype` (its own when `None`): the forward of
/// an identity that also casts (DDP's gradient hook under mixed precision).
pub(crate) fn cpu_as(
    s: &CpuStorage,
    l: &Layout,
    dtype: Option<DType>,
) -> Result<(CpuStorage, Shape)> {
    match dtype {
        Some(d) if d != s.dtype() => {
            check(l)?;
            Ok((s.to_dtype(l, d)?, l.shape().clone()))
        }
        _ => cpu(s, l),
    }
}

/// [`cpu_as`] on a GPU.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_as(
    s: &candle_core::CudaStorage,
    l: &Layout,
    dtype: Option<DType>,
) -> Result<(candle_core::CudaStorage, Shape)> {
    match dtype {
        Some(d) if d != s.dtype() => {
            check(l)?;
            Ok((s.to_dtype(l, d)?, l.shape().clone()))
        }
        _ => cuda(s, l),
    }
}
