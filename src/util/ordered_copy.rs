//! Copies between two CUDA devices, ordered on both devices' streams as PyTorch orders them.
//!
//! candle's `Tensor::to_device` from one CUDA device to another enqueues the copy on the
//! destination's stream. Between two candle devices of one GPU (one CUDA context) cudarc orders
//! it by the source buffer's write event alone, and that does not order it: candle's kernels
//! register the buffer they write as a *read* argument, so a kernel's output never records its
//! write event, and the copy may start before the kernel that fills its source has run. This is
//! what made `DataParallel` over two candle devices of one GPU compute with stale activations
//! and gradients. (Between two GPUs cudarc does make the destination wait for the source's
//! stream.) And cudarc keeps one read event per buffer, which the source's free waits for: once
//! its own stream reads it again (or, between GPUs, from the start), the free no longer waits
//! for the copy, and the memory may be reused under it.
//!
//! `OrderedCopy` does what PyTorch's cross-device `copy_` does: the destination's stream waits
//! for everything the source's stream has queued, the copy runs, and the source's stream waits
//! for the copy, so the source buffer is neither freed nor overwritten under it. Its backward
//! moves the gradient back the same way.

#[cfg(feature = "cuda")]
use candle_core::{CpuStorage, CudaStorage, Layout, Shape};
use candle_core::{Device, Result, Tensor};

/// `t` on `device`, differentiably: `t` itself on its own device; across devices, a view is
/// made compact first (candle would move its whole storage), then moved by an `OrderedCopy`
/// between two CUDA devices and by candle's `to_device` otherwise (copies through the host,
/// which wait for the source's stream). `is_view` says that `t` is a part of a larger storage
/// even where it looks compact (the first chunk of a narrow), so that it is compacted too.
pub(crate) fn to_device(t: &Tensor, device: &Device, is_view: bool) -> Result<Tensor> {
    if t.device().same_device(device) {
        return Ok(t.clone());
    }
    let t = if !is_view && t.is_contiguous() && t.layout().start_offset() == 0 {
        t.clone()
    } else {
        t.force_contiguous()?
    };
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() && device.is_cuda() {
        return t.apply_op1(OrderedCopy { to: device.clone() });
    }
    t.to_device(device)
}

/// The differentiable, stream-ordered copy of a compact CUDA tensor to another CUDA device.
#[cfg(feature = "cuda")]
struct OrderedCopy {
    /// Where the copy goes: a CUDA device other than the source's.
    to: Device,
}

#[cfg(feature = "cuda")]
impl candle_core::CustomOp1 for OrderedCopy {
    fn name(&self) -> &'static str {
        "ordered-cuda-copy"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the ordered copy runs between CUDA devices only; got a CPU tensor")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        crate::util::pass_through::check(l)?;
        let Device::Cuda(to) = &self.to else {
            candle_core::bail!("the ordered copy goes to a CUDA device, not {:?}", self.to)
        };
        let (src, dst) = (s.device().cuda_stream(), to.cuda_stream());
        dst.join(&src).map_err(candle_core::Error::wrap)?;
        let out = s.transfer_to_device(to)?;
        src.join(&dst).map_err(candle_core::Error::wrap)?;
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        to_device(grad, arg.device(), false).map(Some)
    }
}
