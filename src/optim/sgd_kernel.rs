//! [`Sgd`](super::Sgd)'s step on the CPU as one pass over each parameter, in place.
//!
//! The step written with tensor ops (`buf * momentum + g * (1 - dampening)`, then
//! `p - g * lr`, then `Var::set`) makes a new tensor per op and reads and writes the whole
//! parameter six times: for the 25.2 M parameters of an MLP that is most of a training step.
//! Here each element of the parameter, its gradient and its momentum buffer is read once and
//! the parameter and the buffer are written once, in place, split over candle's threads.
//!
//! The arithmetic is torch's CPU `SGD` (`foreach=False`) and the tensor ops' of
//! [`Sgd`](super::Sgd), in their order, so both paths give the same bits (the tests check that
//! they do): each torch op (`grad.add(param, alpha=weight_decay)`, `buf.mul_(momentum)`,
//! `buf.add_(grad, alpha=1 - dampening)`, `grad.add(buf, alpha=momentum)`, `param.add_(grad,
//! alpha=-lr)`) is computed in f32 for f16 and bf16 (f64 for f64) and rounded to the
//! parameter's dtype once. The scalars are taken as torch's CPU kernels take a Python float: the
//! factor of `mul_` in f32 (f64 for f64), an `alpha` rounded to the parameter's dtype. For bf16,
//! momentum 0.99 multiplies as 0.99, not as bf16's 0.98828.

use super::SgdConfig;
use crate::distributed::transport::host_buf::with_bytes;
use crate::error::Error;
use candle_core::{CpuStorage, InplaceOp1, InplaceOp2, Layout, Result, Tensor, Var, WithDType};
use half::{bf16, f16};
use num_traits::Float;
use rayon::prelude::*;
use std::cell::RefCell;
use std::marker::PhantomData;

/// Parameters below this many elements are stepped on one thread: splitting costs more.
pub(super) const PARALLEL_MIN: usize = 1 << 15;

/// An element type the kernel steps, the type it computes in, and how to find its values in a
/// CPU storage.
pub(super) trait Elem: WithDType {
    /// f32 for f32, f16 and bf16; f64 for f64.
    type Acc: Float + Send + Sync;
    fn values(s: &mut CpuStorage) -> Option<&mut [Self]>;
    fn up(self) -> Self::Acc;
    fn down(a: Self::Acc) -> Self;
    /// A Python float as the factor of a tensor-by-scalar product (f32, f64 for f64).
    fn factor(x: f64) -> Self::Acc;
    /// A Python float as the `alpha` of an `add`: rounded to the element type (through f32).
    fn alpha(x: f64) -> Self::Acc {
        Self::down(Self::factor(x)).up()
    }
    /// `a` rounded to the element type, back in the computing type.
    #[inline(always)]
    fn round(a: Self::Acc) -> Self::Acc {
        Self::down(a).up()
    }
}

macro_rules! elem {
    ($t:ty, $variant:ident, $acc:ty, $up:expr, $down:expr) => {
        impl Elem for $t {
            type Acc = $acc;
            fn values(s: &mut CpuStorage) -> Option<&mut [Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            #[inline(always)]
            fn up(self) -> $acc {
                $up(self)
            }
            #[inline(always)]
            fn down(a: $acc) -> Self {
                $down(a)
            }
            fn factor(x: f64) -> $acc {
                x as $acc
            }
        }
    };
}
elem!(f32, F32, f32, |x| x, |a| a);
elem!(f64, F64, f64, |x| x, |a| a);
elem!(f16, F16, f32, f16::to_f32, f16::from_f32);
elem!(bf16, BF16, f32, bf16::to_f32, bf16::from_f32);

/// `x` (a Python float) as torch's CPU `add` takes its `alpha` for a tensor of `dtype`: rounded
/// to f32, then to `dtype` (f64 stays f64).
pub(super) fn alpha(x: f64, dtype: candle_core::DType) -> f64 {
    use candle_core::DType;
    match dtype {
        DType::F16 => f16::alpha(x) as f64,
        DType::BF16 => bf16::alpha(x) as f64,
        DType::F32 => f32::alpha(x) as f64,
        _ => x,
    }
}

/// The step's constants in the type it computes in (see the module docs).
#[derive(Clone, Copy)]
struct Coefficients<A> {
    /// `-lr`, an alpha.
    neg_lr: A,
    /// The factor of `buf.mul_(momentum)`.
    momentum: A,
    /// Momentum as the alpha of Nesterov's `grad.add(buf, alpha=momentum)`.
    momentum_alpha: A,
    /// `1 - dampening`, an alpha.
    keep: A,
    /// An alpha.
    weight_decay: A,
    decay: bool,
    nesterov: bool,
    maximize: bool,
    /// The buffer's first step: it becomes the gradient.
    first: bool,
}

impl<A: Float + Send + Sync> Coefficients<A> {
    fn new<T: Elem<Acc = A>>(c: &SgdConfig, first: bool) -> Self {
        Self {
            neg_lr: T::alpha(-c.lr),
            momentum: T::factor(c.momentum),
            momentum_alpha: T::alpha(c.momentum),
            keep: T::alpha(1.0 - c.dampening),
            weight_decay: T::alpha(c.weight_decay),
            decay: c.weight_decay != 0.0,
            nesterov: c.nesterov,
            maximize: c.maximize,
            first,
        }
    }

    /// Steps `p` (and `buf`, with momentum) by `g`, element by element.
    fn run<T: Elem<Acc = A>>(&self, p: &mut [T], g: &[T], mut buf: Option<&mut [T]>) {
        for i in 0..p.len() {
            let pi = p[i].up();
            let mut d = if self.maximize { -g[i].up() } else { g[i].up() };
            if self.decay {
                d = T::round(d + self.weight_decay * pi);
            }
            if let Some(buf) = buf.as_deref_mut() {
                let b = if self.first {
                    d
                } else {
                    let kept = T::round(buf[i].up() * self.momentum);
                    T::round(kept + self.keep * d)
                };
                buf[i] = T::down(b);
                d = if self.nesterov {
                    T::round(d + self.momentum_alpha * b)
                } else {
                    b
                };
            }
            p[i] = T::down(pi + self.neg_lr * d);
        }
    }

    /// [`run`](Self::run), split into one run of elements per thread.
    fn run_parallel<T: Elem<Acc = A>>(&self, p: &mut [T], g: &[T], buf: Option<&mut [T]>) {
        let threads = candle_core::utils::get_num_threads().max(1);
        if p.len() < PARALLEL_MIN || threads == 1 {
            return self.run(p, g, buf);
        }
        let per = p.len().div_ceil(threads);
        let (ps, gs) = (p.par_chunks_mut(per), g.par_chunks(per));
        match buf {
            Some(buf) => ps
                .zip(gs)
                .zip(buf.par_chunks_mut(per))
                .for_each(|((p, g), b)| self.run(p, g, Some(b))),
            None => ps.zip(gs).for_each(|(p, g)| self.run(p, g, None)),
        }
    }
}

/// The range of a contiguous layout's values in its storage.
pub(super) fn range(layout: &Layout) -> Result<std::ops::Range<usize>> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(start..end),
        None => candle_core::bail!("optimizer kernel: a non-contiguous operand"),
    }
}

/// The contiguous values of a storage under `layout`, to write.
pub(super) fn values_mut<'a, T: Elem>(
    s: &'a mut CpuStorage,
    layout: &Layout,
) -> Result<&'a mut [T]> {
    let range = range(layout)?;
    match T::values(s) {
        Some(values) => Ok(&mut values[range]),
        None => candle_core::bail!("optimizer kernel: operands of another dtype"),
    }
}

/// The contiguous values of a storage under `layout`.
pub(super) fn values<'a, T: Elem>(s: &'a CpuStorage, layout: &Layout) -> Result<&'a [T]> {
    Ok(&s.as_slice::<T>()?[range(layout)?])
}

/// Writes the parameter (`dst`) from the gradient (`src`), with the momentum buffer's values,
/// which [`locked`] holds for the whole step.
struct OnParameter<'a, T: Elem> {
    coefficients: Coefficients<T::Acc>,
    buf: RefCell<Option<&'a mut [T]>>,
}

impl<T: Elem> InplaceOp2 for OnParameter<'_, T> {
    fn name(&self) -> &'static str {
        "sgd-step"
    }

    fn cpu_fwd(&self, p: &mut CpuStorage, lp: &Layout, g: &CpuStorage, lg: &Layout) -> Result<()> {
        let (p, g) = (values_mut::<T>(p, lp)?, values::<T>(g, lg)?);
        let buf = self.buf.borrow_mut().take();
        if p.len() != g.len() || buf.as_ref().is_some_and(|b| b.len() != p.len()) {
            candle_core::bail!("sgd kernel: operands of different sizes");
        }
        self.coefficients.run_parallel(p, g, buf);
        Ok(())
    }
}

/// Holds a state tensor's values (a momentum buffer, a moment) locked while `f` runs on them.
struct Lock<T, F> {
    f: RefCell<Option<F>>,
    elem: PhantomData<T>,
}

impl<T: Elem, F: FnOnce(&mut [T]) -> Result<()>> InplaceOp1 for Lock<T, F> {
    fn name(&self) -> &'static str {
        "optimizer-state"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, layout: &Layout) -> Result<()> {
        match self.f.borrow_mut().take() {
            Some(f) => f(values_mut::<T>(s, layout)?),
            None => candle_core::bail!("optimizer kernel: a state locked twice"),
        }
    }
}

pub(super) fn locked<T: Elem>(t: &Tensor, f: impl FnOnce(&mut [T]) -> Result<()>) -> Result<()> {
    t.inplace_op1(&Lock {
        f: RefCell::new(Some(f)),
        elem: PhantomData,
    })
}

/// The address range of a contiguous CPU tensor's values, to tell whether two overlap. (For
/// any other tensor `with_bytes` would give a copy's: `step` asks only of contiguous CPU ones.)
pub(super) fn span(t: &Tensor) -> Result<std::ops::Range<usize>> {
    with_bytes(
        t,
        |b| Ok(b.as_ptr() as usize..b.as_ptr() as usize + b.len()),
    )
    .map_err(Error::into_candle)
}

/// Steps `var` in place by `grad` with `c`, and `buf` (the momentum buffer, and whether this is
/// its first step) when there is momentum. Returns `false`, having done nothing, where the kernel
/// does not apply: off the CPU, a dtype other than f32, f64, f16 or bf16, shapes or dtypes that
/// differ, a non-contiguous variable or buffer, or a gradient that shares the variable's
/// storage. The caller then steps with tensor ops.
pub(super) fn step(
    var: &Var,
    grad: &Tensor,
    buf: Option<(&Tensor, bool)>,
    c: &SgdConfig,
) -> Result<bool> {
    type Typed = fn(&Var, &Tensor, Option<(&Tensor, bool)>, &SgdConfig) -> Result<()>;
    let typed: Typed = match var.dtype() {
        candle_core::DType::F32 => typed::<f32>,
        candle_core::DType::F64 => typed::<f64>,
        candle_core::DType::F16 => typed::<f16>,
        candle_core::DType::BF16 => typed::<bf16>,
        _ => return Ok(false),
    };
    let fits =
        |t: &Tensor| t.device().is_cpu() && t.dtype() == var.dtype() && t.shape() == var.shape();
    if !fits(grad)
        || !var.device().is_cpu()
        || !var.is_contiguous()
        || buf.is_some_and(|(b, _)| !fits(b) || !b.is_contiguous())
    {
        return Ok(false);
    }
    let grad = grad.contiguous()?;
    let (p, g) = (span(var)?, span(&grad)?);
    if p.start < g.end && g.start < p.end {
        return Ok(false);
    }
    typed(var, &grad, buf, c)?;
    Ok(true)
}

fn typed<T: Elem>(
    var: &Var,
    grad: &Tensor,
    buf: Option<(&Tensor, bool)>,
    c: &SgdConfig,
) -> Result<()> {
    match buf {
        None => var.inplace_op2(
            grad,
            &OnParameter::<T> {
                coefficients: Coefficients::new::<T>(c, false),
                buf: RefCell::new(None),
            },
        ),
        Some((buf, first)) => locked::<T>(buf, |buf| {
            var.inplace_op2(
                grad,
                &OnParameter::<T> {
                    coefficients: Coefficients::new::<T>(c, first),
                    buf: RefCell::new(Some(buf)),
                },
            )
        }),
    }
}
