//! The optimizers' steps on CUDA for f32 parameters: one kernel per parameter (`kernels.cu`),
//! in place, instead of the tensor ops' kernel and new tensor per op.
//!
//! On a GPU the tensor ops' cost is mostly the host's: each allocates and launches. For the
//! CIFAR Net's ten small parameters the host took 1.07 ms to issue an SGD update the GPU ran in
//! 0.16 ms (`net_phases`, 2026-11-26); AdamW's step is about twelve ops per parameter. The
//! kernels' arithmetic is the tensor ops' (and the CPU kernels'), op for op and rounded one by
//! one, so that they give the same bits. Other dtypes, and
//! [`use_own_cuda_kernels`](crate::nn::use_own_cuda_kernels)`(false)`, take the tensor ops.

use super::adamw_kernel::Scalars;
use super::SgdConfig;
use crate::util::nvrtc::compiled;
use crate::util::sync::lock;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice as S, WrapErr};
use candle_core::{
    CpuStorage, CudaStorage, DType, InplaceOp1, InplaceOp2, Layout, Result, Storage, Tensor, Var,
};
use std::cell::RefCell;
use std::sync::{Mutex, OnceLock};

const SRC: &str = include_str!("kernels.cu");
const MODULE: &str = "candle_parallel_optim";

fn ptx() -> Result<&'static str> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    compiled(&PTX, SRC, "optimizer kernels (optim/kernels.cu)")
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

/// One parameter's step: the kernel and its scalars.
#[derive(Clone, Copy)]
enum Step {
    Sgd { config: SgdConfig, first: bool },
    AdamW(Scalars),
}

impl Step {
    /// AdamW's `1 - lr * weight_decay` (1 without decay, and for SGD).
    fn decay_factor(&self) -> f32 {
        match self {
            Step::AdamW(s) => s.decay.unwrap_or(1.0) as f32,
            Step::Sgd { .. } => 1.0,
        }
    }
}

/// Steps `var` by `grad` in place with `step`, and `states` (SGD's momentum buffer, or AdamW's
/// moments) in place with it. Returns `false`, having done nothing, where the kernels do not
/// apply: off CUDA, a dtype other than f32, shapes or devices that differ, non-contiguous
/// tensors, a gradient or state that shares the variable's memory, or our CUDA kernels
/// switched off. The caller then steps with tensor ops.
fn run(var: &Var, grad: &Tensor, states: &[&Tensor], step: Step) -> Result<bool> {
    let fits = |t: &Tensor| {
        t.dtype() == DType::F32 && t.shape() == var.shape() && t.device().same_device(var.device())
    };
    if !crate::nn::own_cuda_kernels()
        || !var.device().is_cuda()
        || var.dtype() != DType::F32
        || !fits(grad)
        || states.iter().any(|s| !fits(s))
    {
        return Ok(false);
    }
    let grad = grad.contiguous()?;
    let Some(p) = addresses(var) else {
        return Ok(false);
    };
    let overlaps = |t: &Tensor| addresses(t).is_none_or(|a| a.start < p.end && p.start < a.end);
    if overlaps(&grad) || states.iter().any(|s| overlaps(s)) {
        return Ok(false);
    }
    let kernel = Kernel {
        step,
        states: Mutex::new(Vec::new()),
    };
    held(states, &|| var.inplace_op2(&grad, &kernel), &kernel.states)?;
    Ok(true)
}

/// SGD's step of `var` by `grad`, with `buf` (the momentum buffer, and whether this is its
/// first step) when there is momentum: see [`run`].
pub(super) fn sgd(
    var: &Var,
    grad: &Tensor,
    buf: Option<(&Tensor, bool)>,
    config: &SgdConfig,
) -> Result<bool> {
    let step = Step::Sgd {
        config: *config,
        first: buf.is_some_and(|(_, first)| first),
    };
    match buf {
        Some((b, _)) => run(var, grad, &[b], step),
        None => run(var, grad, &[], step),
    }
}

/// AdamW's step of `var` by `grad` with its moments (f32, the variable's dtype): see [`run`].
pub(super) fn adamw(
    var: &Var,
    grad: &Tensor,
    state: &super::adamw_kernel::State<'_>,
    scalars: &Scalars,
) -> Result<bool> {
    let mut states = vec![state.exp_avg, state.exp_avg_sq];
    states.extend(state.max_exp_avg_sq);
    run(var, grad, &states, Step::AdamW(*scalars))
}

/// Holds `states` locked for writing, noting their addresses in `into`, while `f` runs.
fn held(states: &[&Tensor], f: &dyn Fn() -> Result<()>, into: &Mutex<Vec<u64>>) -> Result<()> {
    match states.split_first() {
        None => f(),
        Some((first, rest)) => first.inplace_op1(&Hold {
            rest: RefCell::new(Some((rest, f))),
            into,
        }),
    }
}

/// The states still to hold, and what runs once all are.
type Rest<'a, 'f> = (&'a [&'a Tensor], &'f dyn Fn() -> Result<()>);

/// Holds one state tensor (see [`held`]).
struct Hold<'a, 'f> {
    rest: RefCell<Option<Rest<'a, 'f>>>,
    into: &'a Mutex<Vec<u64>>,
}

impl InplaceOp1 for Hold<'_, '_> {
    fn name(&self) -> &'static str {
        "optimizer-state-cuda"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        candle_core::bail!("optimizer-state-cuda: CUDA only")
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, layout: &Layout) -> Result<()> {
        let Some((rest, f)) = self.rest.borrow_mut().take() else {
            candle_core::bail!("optimizer-state-cuda: a state held twice")
        };
        let (Some((start, _)), S::F32(v)) = (layout.contiguous_offsets(), &mut s.slice) else {
            candle_core::bail!("optimizer-state-cuda: a non-contiguous or non-f32 state")
        };
        let (ptr, _sync) = v.device_ptr(v.stream());
        lock(self.into).push(ptr + 4 * start as u64);
        let done = held(rest, f, self.into);
        lock(self.into).pop();
        done
    }
}

/// The launch on the parameter (written) and its gradient, with the states' addresses that
/// [`held`] noted.
struct Kernel {
    step: Step,
    states: Mutex<Vec<u64>>,
}

impl InplaceOp2 for Kernel {
    fn name(&self) -> &'static str {
        "optimizer-step-cuda"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        candle_core::bail!("optimizer-step-cuda: CUDA only")
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
            candle_core::bail!("optimizer-step-cuda: a non-contiguous operand")
        };
        let (S::F32(pv), S::F32(gv)) = (&mut p.slice, &g.slice) else {
            candle_core::bail!("optimizer-step-cuda: operands of another dtype")
        };
        let n = p1 - p0;
        if g1 - g0 != n {
            candle_core::bail!("optimizer-step-cuda: operands of different sizes");
        }
        let mut pv = pv.slice_mut(p0..p1);
        let gv = gv.slice(g0..g1);
        let states = lock(&self.states).clone();
        // A missing state (no momentum, no AMSGrad) is a null pointer.
        let state = |i: usize| states.get(i).copied().unwrap_or(0);
        let len = n as i64;
        let name = match self.step {
            Step::Sgd { .. } => "cp_sgd_f32",
            Step::AdamW(_) => "cp_adamw_f32",
        };
        let func = dev.get_or_load_custom_func(name, MODULE, ptx()?)?;
        let mut builder = func.builder();
        builder.arg(&mut pv);
        builder.arg(&gv);
        // The scalars in f32, as the tensor ops take them (for f32, torch's alphas round to f32
        // too), the flags as ints, in the order of the kernel's signature.
        let f = |x: f64| x as f32;
        let (pointers, floats, flags): (Vec<u64>, Vec<f32>, Vec<i32>) = match self.step {
            Step::Sgd { config: c, first } => (
                vec![state(0)],
                vec![
                    f(-c.lr),
                    f(c.momentum),
                    f(c.momentum),
                    f(1.0 - c.dampening),
                    f(c.weight_decay),
                ],
                vec![c.weight_decay != 0.0, c.nesterov, c.maximize, first]
                    .into_iter()
                    .map(i32::from)
                    .collect(),
            ),
            Step::AdamW(s) => {
                if s.amsgrad && state(2) == 0 {
                    candle_core::bail!("optimizer-step-cuda: AMSGrad without its maximum");
                }
                (
                    vec![state(0), state(1), state(2)],
                    vec![
                        f(s.lerp_weight),
                        f(1.0 - s.lerp_weight),
                        f(s.beta2),
                        f(1.0 - s.beta2),
                        f(s.step_size),
                        f(s.bias_correction2_sqrt),
                        f(s.eps),
                    ],
                    vec![s.decay.is_some(), s.maximize, s.lerp_weight.abs() < 0.5]
                        .into_iter()
                        .map(i32::from)
                        .collect(),
                )
            }
        };
        let k = self.step.decay_factor();
        for ptr in &pointers {
            builder.arg(ptr);
        }
        builder.arg(&len);
        match self.step {
            // cp_sgd_f32(p, g, buf, n, the floats, the flags)
            Step::Sgd { .. } => {
                for x in &floats {
                    builder.arg(x);
                }
                for x in &flags {
                    builder.arg(x);
                }
            }
            // cp_adamw_f32(p, g, m, v, max, n, k, the flags, the floats)
            Step::AdamW(_) => {
                builder.arg(&k);
                for x in &flags {
                    builder.arg(x);
                }
                for x in &floats {
                    builder.arg(x);
                }
            }
        }
        let blocks = n.div_ceil(256).clamp(1, 1 << 16) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature in kernels.cu; the states are held
        // by `held` (their storages locked for writing) while the launch is issued, and it is
        // ordered on the device's stream like every access to them.
        unsafe { builder.launch(cfg) }.w()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC compiles the kernels (no GPU needed, only libnvrtc).
    #[test]
    fn the_optimizer_kernels_compile_with_nvrtc() {
        let ptx = ptx().unwrap();
        for kernel in ["cp_sgd_f32", "cp_adamw_f32"] {
            assert!(
                ptx.contains(&format!(".entry {kernel}(")),
                "{kernel} is missing"
            );
        }
    }
}
