//! The forward of the custom ops that hand a tensor on unchanged, to hook autograd (DDP's
//! gradient-ready op, SyncBatchNorm's statistics gradient, the differentiable all-reduce).
//! candle's custom ops cannot return storage shared with their input, so the forward copies.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Result, Shape};

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
