//! The forward of the custom ops that hand a tensor on unchanged, to hook autograd (DDP's
//! gradient-ready op, SyncBatchNorm's statistics gradient, the differentiable all-reduce,
//! activation checkpointing's output).
//!
//! candle's custom ops cannot return storage shared with their input, so the forward copies,
//! into a buffer of exactly the tensor's elements in row-major order: the op's output gets a
//! fresh contiguous layout over that buffer, so the copy must be of the values the input's
//! layout shows, not of its storage (a view — a narrow, a transpose, a broadcast — would come
//! out with another tensor's values, and the first rows of a larger buffer would keep all of
//! it alive).

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, DType, Layout, Result, Shape};

/// Fails unless `l` is compact (contiguous from offset 0), where a storage's whole copy holds
/// the tensor's values first: for an op that moves a storage whole (the ordered CUDA copy).
#[cfg(feature = "cuda")]
pub(crate) fn check(l: &Layout) -> Result<()> {
    if !l.is_contiguous() || l.start_offset() != 0 {
        candle_core::bail!("pass-through op given a view ({l:?}): make it contiguous first");
    }
    Ok(())
}

/// The values `s` holds under `l`, in a new buffer of exactly their count, row-major.
fn compact<S>(s: &S, l: &Layout) -> Result<(S, Shape)>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    // SAFETY: `copy_strided_src` writes every element of the new buffer (it has the shape of
    // `l`) before anything reads it, as candle's own `force_contiguous` relies on.
    let mut out = unsafe { s.device().alloc_uninit(l.shape(), s.dtype())? };
    s.copy_strided_src(&mut out, 0, l)?;
    Ok((out, l.shape().clone()))
}

/// A compact copy of the tensor `s` under `l` (any layout).
pub(crate) fn cpu(s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
    compact(s, l)
}

/// A compact copy of the tensor `s` under `l` (any layout), on its GPU.
#[cfg(feature = "cuda")]
pub(crate) fn cuda(
    s: &candle_core::CudaStorage,
    l: &Layout,
) -> Result<(candle_core::CudaStorage, Shape)> {
    compact(s, l)
}

/// A compact copy of the tensor `s` under `l` in `dtype` (its own when `None`): the forward of
/// an identity that also casts (DDP's gradient hook under mixed precision).
pub(crate) fn cpu_as(
    s: &CpuStorage,
    l: &Layout,
    dtype: Option<DType>,
) -> Result<(CpuStorage, Shape)> {
    match dtype {
        // The cast reads the values through `l` into a new buffer of their count.
        Some(d) if d != s.dtype() => Ok((s.to_dtype(l, d)?, l.shape().clone())),
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
        Some(d) if d != s.dtype() => Ok((s.to_dtype(l, d)?, l.shape().clone())),
        _ => cuda(s, l),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{CpuStorage, Device, Storage, Tensor};

    /// The identity through [`cpu`].
    struct Hand;

    impl candle_core::CustomOp1 for Hand {
        fn name(&self) -> &'static str {
            "hand-on"
        }

        fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
            cpu(s, l)
        }
    }

    #[test]
    fn views_come_out_with_their_own_values_in_a_buffer_of_their_size() -> Result<()> {
        let base = Tensor::arange(0f32, 24., &Device::Cpu)?.reshape((4, 6))?;
        let views = [
            ("a narrow at an offset", base.narrow(0, 1, 2)?),
            ("the first rows", base.narrow(0, 0, 2)?),
            ("columns", base.narrow(1, 2, 3)?),
            ("a transpose", base.t()?),
            ("a broadcast", base.sum_keepdim(0)?.broadcast_as((3, 6))?),
        ];
        for (what, v) in views {
            let got = v.apply_op1(Hand)?;
            assert_eq!(got.dims(), v.dims(), "{what}");
            let values = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
            assert_eq!(values(&got)?, values(&v)?, "{what}");
            let (storage, _) = got.storage_and_layout();
            let Storage::Cpu(CpuStorage::F32(buffer)) = &*storage else {
                panic!("an f32 CPU tensor")
            };
            assert_eq!(buffer.len(), v.elem_count(), "{what}: the buffer's size");
        }
        Ok(())
    }
}
