//! [`Sgd`](super::Sgd)'s step on the CPU as one pass over each parameter, in place.
//!
//! The step written with tensor ops (`buf * momentum + g * (1 - dampening)`, then
//! `p - g * lr`, then `Var::set`) makes a new tensor per op and reads and writes the whole
//! parameter six times: for the 25.2 M parameters of an MLP that is most of a training step.
//! Here each element of the parameter, its gradient and its momentum buffer is read once and
//! the parameter and the buffer are written once, in place, split over candle's threads.
//!
//! The arithmetic is the tensor ops', in their order and in the variable's dtype (a scalar
//! product is candle's `affine`, `x * s + 0`), so both paths give the same bits; the tests
//! check that they do.

use super::SgdConfig;
use crate::distributed::transport::host_buf::with_bytes;
use crate::error::Error;
use candle_core::{CpuStorage, InplaceOp1, InplaceOp2, Layout, Result, Tensor, Var, WithDType};
use half::{bf16, f16};
use rayon::prelude::*;
use std::cell::RefCell;
use std::ops::Neg;

/// Parameters below this many elements are stepped on one thread: splitting costs more.
const PARALLEL_MIN: usize = 1 << 15;

/// An element type the kernel steps, and how to find its values in a CPU storage.
trait Elem: WithDType + Neg<Output = Self> {
    fn values(s: &mut CpuStorage) -> Option<&mut [Self]>;
}

macro_rules! elem {
    ($t:ty, $variant:ident) => {
        impl Elem for $t {
            fn values(s: &mut CpuStorage) -> Option<&mut [Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
elem!(f32, F32);
elem!(f64, F64);
elem!(f16, F16);
elem!(bf16, BF16);

/// The step's constants in the variable's dtype, as candle's scalar ops convert them.
#[derive(Clone, Copy)]
struct Coefficients<T> {
    lr: T,
    momentum: T,
    /// `1 - dampening`.
    keep: T,
    weight_decay: T,
    zero: T,
    decay: bool,
    nesterov: bool,
    maximize: bool,
    /// The buffer's first step: it becomes the gradient.
    first: bool,
}

impl<T: Elem> Coefficients<T> {
    fn new(c: &SgdConfig, first: bool) -> Self {
        Self {
            lr: T::from_f64(c.lr),
            momentum: T::from_f64(c.momentum),
            keep: T::from_f64(1.0 - c.dampening),
            weight_decay: T::from_f64(c.weight_decay),
            zero: T::from_f64(0.0),
            decay: c.weight_decay != 0.0,
            nesterov: c.nesterov,
            maximize: c.maximize,
            first,
        }
    }

    /// `x * s` as candle's `Tensor * f64` computes it (`affine(s, 0)`).
    #[inline(always)]
    fn scaled(&self, x: T, s: T) -> T {
        x * s + self.zero
    }

    /// Steps `p` (and `buf`, with momentum) by `g`, element by element.
    fn run(&self, p: &mut [T], g: &[T], mut buf: Option<&mut [T]>) {
        for i in 0..p.len() {
            let mut d = if self.maximize { -g[i] } else { g[i] };
            if self.decay {
                d += self.scaled(p[i], self.weight_decay);
            }
            if let Some(buf) = buf.as_deref_mut() {
                let b = if self.first {
                    d
                } else {
                    self.scaled(buf[i], self.momentum) + self.scaled(d, self.keep)
                };
                buf[i] = b;
                d = if self.nesterov {
                    d + self.scaled(b, self.momentum)
                } else {
                    b
                };
            }
            p[i] -= self.scaled(d, self.lr);
        }
    }

    /// [`run`](Self::run), split into one run of elements per thread.
    fn run_parallel(&self, p: &mut [T], g: &[T], buf: Option<&mut [T]>) {
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
fn range(layout: &Layout) -> Result<std::ops::Range<usize>> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(start..end),
        None => candle_core::bail!("sgd kernel: a non-contiguous operand"),
    }
}

/// The contiguous values of a storage under `layout`, to write.
fn values_mut<'a, T: Elem>(s: &'a mut CpuStorage, layout: &Layout) -> Result<&'a mut [T]> {
    let range = range(layout)?;
    match T::values(s) {
        Some(values) => Ok(&mut values[range]),
        None => candle_core::bail!("sgd kernel: operands of another dtype"),
    }
}

/// The contiguous values of a storage under `layout`.
fn values<'a, T: Elem>(s: &'a CpuStorage, layout: &Layout) -> Result<&'a [T]> {
    Ok(&s.as_slice::<T>()?[range(layout)?])
}

/// Writes the parameter (`dst`) from the gradient (`src`), with the momentum buffer's values,
/// which [`OnBuffer`] holds locked for the whole step.
struct OnParameter<'a, T> {
    coefficients: Coefficients<T>,
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

/// Locks the momentum buffer (`dst`) and steps the parameter with it.
struct OnBuffer<'a, T> {
    var: &'a Var,
    grad: &'a Tensor,
    coefficients: Coefficients<T>,
}

impl<T: Elem> InplaceOp1 for OnBuffer<'_, T> {
    fn name(&self) -> &'static str {
        "sgd-momentum"
    }

    fn cpu_fwd(&self, buf: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let on_parameter = OnParameter {
            coefficients: self.coefficients,
            buf: RefCell::new(Some(values_mut::<T>(buf, layout)?)),
        };
        self.var.inplace_op2(self.grad, &on_parameter)
    }
}

/// The address range of a contiguous CPU tensor's values, to tell whether two overlap. (For
/// any other tensor `with_bytes` would give a copy's: `step` asks only of contiguous CPU ones.)
fn span(t: &Tensor) -> Result<std::ops::Range<usize>> {
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
            &OnParameter {
                coefficients: Coefficients::<T>::new(c, false),
                buf: RefCell::new(None),
            },
        ),
        Some((buf, first)) => buf.inplace_op1(&OnBuffer {
            var,
            grad,
            coefficients: Coefficients::<T>::new(c, first),
        }),
    }
}
