//! [`Sgd`](super::Sgd)'s step on CUDA for f32 parameters: one kernel per parameter (`sgd.cu`),
//! in place, instead of the tensor ops' seven kernels and six new tensors.
//!
//! On a GPU the tensor ops' cost is mostly the host's: each allocates and launches, so that for
//! the CIFAR Net's ten small parameters the host took 1.07 ms to issue an update the GPU ran in
//! 0.16 ms (`net_phases`, 2026-11-26). The kernel's arithmetic is the tensor ops', in their
//! order and rounded one by one, so the two give the same bits. Other dtypes, and
//! [`use_own_cuda_kernels`](crate::nn::use_own_cuda_kernels)`(false)`, take the tensor ops.

use super::SgdConfig;
use crate::util::nvrtc::compiled;
use crate::util::sync::lock;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DevicePtr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaStorageSlice as S, WrapErr};
use candle_core::{
    CpuStorage, CudaStorage, DType, InplaceOp1, InplaceOp2, Layout, Result, Storage, Tensor, Var,
};
use std::sync::{Mutex, OnceLock};

const SGD_SRC: &str = include_str!("sgd.cu");
const SGD_MODULE: &str = "candle_parallel_sgd";

fn sgd_ptx() -> Result<&'static str> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    compiled(&PTX, SGD_SRC, "SGD kernel (optim/sgd.cu)")
}

/// The device addresses a contiguous f32 CUDA tensor's values take, to tell whether two
/// overlap; `None` for any other tensor.
fn addresses(t: &Tensor) -> Option<std::ops::Range<u64>> {
    let (storage, layout) = t.storage_and_layout();
    let (start, end) = layout.contiguous_offsets()?;
    match &*storage {
        Storage::Cuda(CudaStorage {
            slice: S::F32(v), ..
        }) => {
            let (ptr, _sync) = v.device_ptr(v.stream());
            Some(ptr + 4 * start as u64..ptr + 4 * end as u64)
        }
        _ => None,
    }
}

/// Steps `var` in place by `grad` with `c`, and `buf` (the momentum buffer, and whether this is
/// its first step) when there is momentum. Returns `false`, having done nothing, where the
/// kernel does not apply: off CUDA, a dtype other than f32, shapes or devices that differ,
/// non-contiguous tensors, a gradient or buffer that shares the variable's memory, or our CUDA
/// kernels switched off. The caller then steps with tensor ops.
pub(super) fn step(
    var: &Var,
    grad: &Tensor,
    buf: Option<(&Tensor, bool)>,
    c: &SgdConfig,
) -> Result<bool> {
    let fits = |t: &Tensor| {
        t.dtype() == DType::F32 && t.shape() == var.shape() && t.device().same_device(var.device())
    };
    if !crate::nn::own_cuda_kernels()
        || !var.device().is_cuda()
        || var.dtype() != DType::F32
        || !fits(grad)
        || buf.is_some_and(|(b, _)| !fits(b))
    {
        return Ok(false);
    }
    let grad = grad.contiguous()?;
    let Some(p) = addresses(var) else {
        return Ok(false);
    };
    let overlaps = |t: &Tensor| addresses(t).is_none_or(|a| a.start < p.end && p.start < a.end);
    if overlaps(&grad) || buf.is_some_and(|(b, _)| overlaps(b)) {
        return Ok(false);
    }
    let kernel = Kernel {
        config: *c,
        first: buf.is_some_and(|(_, first)| first),
        buf: Mutex::new(None),
    };
    match buf {
        None => var.inplace_op2(&grad, &kernel)?,
        Some((b, _)) => b.inplace_op1(&Buffer {
            var,
            grad: &grad,
            kernel: &kernel,
        })?,
    }
    Ok(true)
}

/// The step's launch, with the momentum buffer (when there is one) that [`Buffer`] holds for
/// it.
struct Kernel {
    config: SgdConfig,
    first: bool,
    /// The buffer's address, set while [`Buffer`] holds it.
    buf: Mutex<Option<u64>>,
}

impl InplaceOp2 for Kernel {
    fn name(&self) -> &'static str {
        "sgd-step-cuda"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        candle_core::bail!("sgd-step-cuda: CUDA only")
    }

    fn cuda_fwd(
        &self,
        p: &mut CudaStorage,
        lp: &Layout,
        g: &CudaStorage,
        lg: &Layout,
    ) -> Result<()> {
        let dev = p.device().clone();
        let (Some((p0, p1)), Some((g0, g1))) = (lp.contiguous_offsets(), lg.contiguous_offsets())
        else {
            candle_core::bail!("sgd-step-cuda: a non-contiguous operand")
        };
        let (S::F32(pv), S::F32(gv)) = (&mut p.slice, &g.slice) else {
            candle_core::bail!("sgd-step-cuda: operands of another dtype")
        };
        let n = p1 - p0;
        if g1 - g0 != n {
            candle_core::bail!("sgd-step-cuda: operands of different sizes");
        }
        let mut pv = pv.slice_mut(p0..p1);
        let gv = gv.slice(g0..g1);
        let c = &self.config;
        // The step's constants as the tensor ops take them: f32 factors; for f32, torch's
        // alphas round to f32 too.
        let (neg_lr, momentum, keep, weight_decay) = (
            -c.lr as f32,
            c.momentum as f32,
            (1.0 - c.dampening) as f32,
            c.weight_decay as f32,
        );
        let flags = [
            i32::from(c.weight_decay != 0.0),
            i32::from(c.nesterov),
            i32::from(c.maximize),
            i32::from(self.first),
        ];
        let buf = lock(&self.buf).unwrap_or(0);
        let func = dev.get_or_load_custom_func("cp_sgd_f32", SGD_MODULE, sgd_ptx()?)?;
        let mut builder = func.builder();
        builder.arg(&mut pv);
        builder.arg(&gv);
        builder.arg(&buf);
        let len = n as i64;
        candle_core::builder_arg!(builder, len, neg_lr, momentum, momentum, keep, weight_decay);
        for flag in &flags {
            builder.arg(flag);
        }
        let blocks = n.div_ceil(256).clamp(1, 1 << 16) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `cp_sgd_f32` in sgd.cu; the buffer, when given, is held
        // by `Buffer` (its storage locked for writing) for as long as the launch is issued, and
        // the launch is ordered on the device's stream like every access to it.
        unsafe { builder.launch(cfg) }.w()?;
        Ok(())
    }
}

/// Holds the momentum buffer locked for writing while the step runs on the variable.
struct Buffer<'a> {
    var: &'a Var,
    grad: &'a Tensor,
    kernel: &'a Kernel,
}

impl InplaceOp1 for Buffer<'_> {
    fn name(&self) -> &'static str {
        "sgd-momentum-buffer-cuda"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        candle_core::bail!("sgd-momentum-buffer-cuda: CUDA only")
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, layout: &Layout) -> Result<()> {
        let (Some((start, end)), S::F32(v)) = (layout.contiguous_offsets(), &mut s.slice) else {
            candle_core::bail!("sgd-momentum-buffer-cuda: a non-contiguous or non-f32 buffer")
        };
        if end - start != self.var.elem_count() {
            candle_core::bail!("sgd-momentum-buffer-cuda: the buffer's size is not the variable's");
        }
        let slice: &mut CudaSlice<f32> = v;
        let (ptr, _sync) = slice.device_ptr(slice.stream());
        *lock(&self.kernel.buf) = Some(ptr + 4 * start as u64);
        let stepped = self.var.inplace_op2(self.grad, self.kernel);
        *lock(&self.kernel.buf) = None;
        stepped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC compiles the kernel (no GPU needed, only libnvrtc).
    #[test]
    fn the_sgd_kernel_compiles_with_nvrtc() {
        assert!(sgd_ptx().unwrap().contains(".entry cp_sgd_f32("));
    }
}
