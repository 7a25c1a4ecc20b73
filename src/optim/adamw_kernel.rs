//! [`AdamW`](super::AdamW)'s step on the CPU as one pass over each parameter, in place.
//!
//! The step written with tensor ops (weight decay, `lerp`, the second moment, its square root,
//! the bias corrections, the update) makes about twelve new tensors per parameter and reads and
//! writes the parameter-sized data as often: for the 25 M parameters of an MLP that is much of a
//! training step. Here each element of the parameter, its gradient and its moments is read once
//! and the parameter and the moments are written once, in place, split over candle's threads.
//!
//! The arithmetic is the tensor ops' of [`AdamW`](super::AdamW), op for op and in their order
//! (candle's `affine` is `x * mul + add`, a scalar `+ eps` is `affine(1, eps)`, `maximum` keeps
//! the first operand unless it is smaller), so both paths give the same bits, and both give
//! torch's (the tests check the first; `scripts/torch_optim_check.py` the second). It runs for
//! f32 and f64 parameters, whose moments have their dtype; half-precision parameters (f32
//! moments) take the tensor ops.

use super::sgd_kernel::{locked, span, values, values_mut, Elem, PARALLEL_MIN};
use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Result, Tensor, Var};
use num_traits::Float;
use rayon::prelude::*;
use std::cell::RefCell;

/// The step's scalars, each as the tensor op that uses it converts it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Scalars {
    /// `1 - lr * weight_decay`, when there is weight decay.
    pub decay: Option<f64>,
    pub maximize: bool,
    /// The `lerp` weight `1 - beta1`, rounded to the moments' dtype.
    pub lerp_weight: f64,
    pub beta2: f64,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f64,
    /// `sqrt(1 - beta2^t)`.
    pub bias_correction2_sqrt: f64,
    pub eps: f64,
    pub amsgrad: bool,
}

/// [`Scalars`] in the element type, as candle's ops take them (`T::from_f64`).
#[derive(Clone, Copy)]
struct Coefficients<T> {
    decay: Option<T>,
    maximize: bool,
    /// Which branch of `lerp` (torch's two, for accuracy near either end).
    lerp_low: bool,
    weight: T,
    one_minus_weight: T,
    beta2: T,
    one_minus_beta2: T,
    step_size: T,
    bias_correction2_sqrt: T,
    eps: T,
    amsgrad: bool,
}

impl<T: Elem<Acc = T> + Float> Coefficients<T> {
    fn new(s: &Scalars) -> Self {
        let f = |x: f64| T::from_f64(x);
        Self {
            decay: s.decay.map(f),
            maximize: s.maximize,
            lerp_low: s.lerp_weight.abs() < 0.5,
            weight: f(s.lerp_weight),
            one_minus_weight: f(1.0 - s.lerp_weight),
            beta2: f(s.beta2),
            one_minus_beta2: f(1.0 - s.beta2),
            step_size: f(s.step_size),
            bias_correction2_sqrt: f(s.bias_correction2_sqrt),
            eps: f(s.eps),
            amsgrad: s.amsgrad,
        }
    }

    /// Steps `p`, `m`, `v` (and `max`, under AMSGrad) by `g`, element by element: the loop
    /// for this configuration, its branches decided outside it.
    fn run(&self, p: &mut [T], g: &[T], m: &mut [T], v: &mut [T], max: Option<&mut [T]>) {
        macro_rules! pick {
            ($($d:literal $x:literal $l:literal),*) => {
                match (self.decay.is_some(), self.maximize, self.lerp_low) {
                    $(($d, $x, $l) => self.run_as::<$d, $x, $l>(p, g, m, v, max),)*
                }
            };
        }
        pick!(
            false false false, false false true, false true false, false true true,
            true false false, true false true, true true false, true true true
        )
    }

    #[inline(always)]
    fn run_as<const DECAY: bool, const MAXIMIZE: bool, const LOW: bool>(
        &self,
        p: &mut [T],
        g: &[T],
        m: &mut [T],
        v: &mut [T],
        max: Option<&mut [T]>,
    ) {
        let (zero, one) = (T::from_f64(0.0), T::from_f64(1.0));
        let k = self.decay.unwrap_or(one);
        // One element's step, up to the second moment: the new p (before its update), m and v.
        let moments = |pi: T, gi: T, mi: T, vi: T| {
            let pi = if DECAY { pi * k + zero } else { pi };
            let gi = if MAXIMIZE { -gi } else { gi };
            let diff = gi - mi;
            let mi = if LOW {
                mi + (diff * self.weight + zero)
            } else {
                gi - (diff * self.one_minus_weight + zero)
            };
            let vi = (vi * self.beta2 + zero) + ((gi * self.one_minus_beta2 + zero) * gi);
            (pi, mi, vi)
        };
        let update = |pi: T, mi: T, second: T| {
            let denom = (second.sqrt() / self.bias_correction2_sqrt) * one + self.eps;
            pi - ((mi * self.step_size + zero) / denom)
        };
        match max {
            Some(max) if self.amsgrad => {
                for i in 0..p.len() {
                    let (pi, mi, vi) = moments(p[i], g[i], m[i], v[i]);
                    let kept = if max[i] < vi { vi } else { max[i] };
                    (p[i], m[i], v[i], max[i]) = (update(pi, mi, kept), mi, vi, kept);
                }
            }
            _ => {
                let n = p.len();
                // Equal lengths, seen by the compiler: no bounds checks in the loop.
                let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
                for i in 0..p.len() {
                    let (pi, mi, vi) = moments(p[i], g[i], m[i], v[i]);
                    (p[i], m[i], v[i]) = (update(pi, mi, vi), mi, vi);
                }
            }
        }
    }

    /// [`run`](Self::run), split into one run of elements per thread.
    fn run_parallel(&self, p: &mut [T], g: &[T], m: &mut [T], v: &mut [T], max: Option<&mut [T]>) {
        let threads = candle_core::utils::get_num_threads().max(1);
        if p.len() < PARALLEL_MIN || threads == 1 {
            return self.run(p, g, m, v, max);
        }
        let per = p.len().div_ceil(threads);
        let chunks = p
            .par_chunks_mut(per)
            .zip(g.par_chunks(per))
            .zip(m.par_chunks_mut(per))
            .zip(v.par_chunks_mut(per));
        match max {
            Some(max) => chunks
                .zip(max.par_chunks_mut(per))
                .for_each(|((((p, g), m), v), x)| self.run(p, g, m, v, Some(x))),
            None => chunks.for_each(|(((p, g), m), v)| self.run(p, g, m, v, None)),
        }
    }
}

/// The moments, already locked, for the parameter's step.
type Moments<'a, T> = (&'a mut [T], &'a mut [T], Option<&'a mut [T]>);

/// Writes the parameter (`dst`) from the gradient (`src`) and the locked moments.
struct OnParameter<'a, T> {
    coefficients: Coefficients<T>,
    moments: RefCell<Option<Moments<'a, T>>>,
}

impl<T: Elem<Acc = T> + Float> InplaceOp2 for OnParameter<'_, T> {
    fn name(&self) -> &'static str {
        "adamw-step"
    }

    fn cpu_fwd(&self, p: &mut CpuStorage, lp: &Layout, g: &CpuStorage, lg: &Layout) -> Result<()> {
        let (p, g) = (values_mut::<T>(p, lp)?, values::<T>(g, lg)?);
        let Some((m, v, max)) = self.moments.borrow_mut().take() else {
            candle_core::bail!("adamw kernel: the parameter stepped twice")
        };
        let n = p.len();
        if g.len() != n
            || m.len() != n
            || v.len() != n
            || max.as_ref().is_some_and(|x| x.len() != n)
        {
            candle_core::bail!("adamw kernel: operands of different sizes");
        }
        self.coefficients.run_parallel(p, g, m, v, max);
        Ok(())
    }
}

/// The moments of one parameter, for the kernel to write in place.
pub(super) struct State<'a> {
    pub exp_avg: &'a Tensor,
    pub exp_avg_sq: &'a Tensor,
    pub max_exp_avg_sq: Option<&'a Tensor>,
}

/// Steps `var` and its moments in place by `grad`. Returns `false`, having done nothing, where
/// the kernel does not apply: off the CPU, a dtype other than f32 or f64, a gradient or moment
/// of another dtype or shape, a non-contiguous variable or moment, or a gradient that shares the
/// variable's storage. The caller then steps with tensor ops.
pub(super) fn step(var: &Var, grad: &Tensor, state: State<'_>, s: &Scalars) -> Result<bool> {
    type Typed = fn(&Var, &Tensor, State<'_>, &Scalars) -> Result<()>;
    let typed: Typed = match var.dtype() {
        DType::F32 => typed::<f32>,
        DType::F64 => typed::<f64>,
        _ => return Ok(false),
    };
    let fits =
        |t: &Tensor| t.device().is_cpu() && t.dtype() == var.dtype() && t.shape() == var.shape();
    let moments = [
        Some(state.exp_avg),
        Some(state.exp_avg_sq),
        state.max_exp_avg_sq,
    ];
    if !fits(grad)
        || !var.device().is_cpu()
        || !var.is_contiguous()
        || moments
            .iter()
            .flatten()
            .any(|m| !fits(m) || !m.is_contiguous())
    {
        return Ok(false);
    }
    let grad = grad.contiguous()?;
    let (p, g) = (span(var)?, span(&grad)?);
    if p.start < g.end && g.start < p.end {
        return Ok(false);
    }
    typed(var, &grad, state, s)?;
    Ok(true)
}

fn typed<T: Elem<Acc = T> + Float>(
    var: &Var,
    grad: &Tensor,
    state: State<'_>,
    s: &Scalars,
) -> Result<()> {
    let coefficients = Coefficients::<T>::new(s);
    let on_parameter = |moments: Moments<'_, T>| {
        var.inplace_op2(
            grad,
            &OnParameter {
                coefficients,
                moments: RefCell::new(Some(moments)),
            },
        )
    };
    locked::<T>(state.exp_avg, |m| {
        locked::<T>(state.exp_avg_sq, |v| match state.max_exp_avg_sq {
            Some(max) => locked::<T>(max, |x| on_parameter((m, v, Some(x)))),
            None => on_parameter((m, v, None)),
        })
    })
}
