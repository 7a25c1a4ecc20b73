//! candle-nn's fused layers, with a backward: [`layer_norm`], [`rms_norm`] and
//! [`softmax_last_dim`], drop-ins for `candle_nn::ops`' functions of the same names; and
//! [`gelu_erf`], `Tensor::gelu_erf` as one op with a one-pass backward on the CPU.
//!
//! candle 0.11 applies its fused layers without a backward (`apply_op*_no_bwd`, candle issue
//! [#2168](https://github.com/huggingface/candle/issues/2168)): gradients stop there without an
//! error, and every parameter upstream of them trains as if frozen. These take the same
//! arguments and carry an analytic backward; they also take non-contiguous inputs, which
//! candle's refuse. On the CPU both directions run kernels of our own, elsewhere the forward is
//! a CUDA kernel of ours (compiled at run time) and the backward is made of candle ops.
//!
//! Their numbers follow the crate's rule for reductions (see the [`nn` module docs](super)), not
//! candle's kernels, which they replace where those fail: candle's layer normalisation takes the
//! variance as `E[x²] - E[x]²`, which cancels and goes negative for rows of mean 1e3 and spread
//! 0.1 (every output NaN, in f32), and its softmax sums in the element type (a bf16 row of 4096
//! zeros sums to 256, so each output is 1/256). Here the variance is a corrected two-pass one
//! and every sum runs in f32 (f64 for f64), each output rounded once: the errors against an f64
//! computation are torch's or smaller. On an empty input they give every input a gradient of
//! zeros, as torch does.
//!
//! The rest of `candle_nn::ops`' differentiable functions are re-exported, so that
//! `use candle_parallel::nn::ops` can replace `use candle_nn::ops` whole; [`softmax`] and
//! [`log_softmax`], which sum, follow the rule too (candle's sum bf16 in bf16).
//!
//! ```rust
//! use candle_core::{Device, Tensor, Var};
//! use candle_parallel::nn::ops;
//! # fn main() -> candle_core::Result<()> {
//! let x = Var::new(&[[1f32, 2., 4.], [0., 1., 0.]], &Device::Cpu)?;
//! let w = Var::new(&[1f32, 1., 1.], &Device::Cpu)?;
//! let b = Var::new(&[0f32, 0., 0.], &Device::Cpu)?;
//! let y = ops::layer_norm(&x, &w, &b, 1e-5)?;
//! let loss = (y.sqr()? * ops::softmax_last_dim(&x)?)?.sum_all()?;
//! let grads = loss.backward()?;
//! // candle_nn::ops::layer_norm would leave all three without a gradient.
//! assert!(grads.get(&x).is_some() && grads.get(&w).is_some() && grads.get(&b).is_some());
//! # Ok(()) }
//! ```

use super::accumulate::{empty_output, wide, widen};
use super::backward::{hand_over, through, Held};
use super::cast::cast;
use super::kernels::own_cpu_kernels;
use super::rows::{self, values, with_float_slices};
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, D};

pub use super::gelu::gelu_erf;
pub use candle_nn::ops::{
    dropout, hard_sigmoid, layer_norm_slow, leaky_relu, mish, pixel_shuffle, pixel_unshuffle,
    replication_pad2d, rms_norm_slow, selu, sigmoid, silu, swiglu, Dropout,
};

/// Layer normalisation over the last dimension, `(x - mean) / sqrt(var + eps) * alpha + beta`,
/// with a backward (`candle_nn::ops::layer_norm` has none; see the [module docs](self)).
/// `alpha` and `beta` have the size of the last dimension.
pub fn layer_norm(xs: &Tensor, alpha: &Tensor, beta: &Tensor, eps: f32) -> Result<Tensor> {
    check_norm("layer_norm", xs, alpha, Some(beta))?;
    let op = Norm {
        eps,
        remove_mean: true,
    };
    if xs.elem_count() == 0 {
        return empty_output(xs.shape(), &[xs, alpha, beta]);
    }
    let mut uses = Vec::new();
    let alpha = through(&alpha.contiguous()?, &mut uses);
    let beta = through(&beta.contiguous()?, &mut uses);
    xs.contiguous()?
        .apply_op3(&alpha, &beta, Held::new(op, uses))
}

/// Layer normalisation without a shift: `(x - mean) / sqrt(var + eps) * alpha`.
pub(super) fn layer_norm_no_bias(xs: &Tensor, alpha: &Tensor, eps: f32) -> Result<Tensor> {
    norm2("layer_norm", xs, alpha, eps, true)
}

/// RMS normalisation over the last dimension, `x / sqrt(mean(x^2) + eps) * alpha`, with a
/// backward (`candle_nn::ops::rms_norm` has none; see the [module docs](self)).
pub fn rms_norm(xs: &Tensor, alpha: &Tensor, eps: f32) -> Result<Tensor> {
    norm2("rms_norm", xs, alpha, eps, false)
}

/// Softmax over the last dimension, with a backward (`candle_nn::ops::softmax_last_dim` has
/// none; see the [module docs](self)).
pub fn softmax_last_dim(xs: &Tensor) -> Result<Tensor> {
    check_float("softmax_last_dim", &[("input", xs)])?;
    if xs.rank() == 0 {
        candle_core::bail!("softmax_last_dim: the input is a scalar; it needs a last dimension");
    }
    if xs.elem_count() == 0 {
        return empty_output(xs.shape(), &[xs]);
    }
    xs.contiguous()?.apply_op1(SoftmaxLastDim)
}

/// Softmax over dimension `dim`, as `candle_nn::ops::softmax`, by the crate's rule: over the
/// last dimension [`softmax_last_dim`]; over another, candle's ops in f32 for f16 and bf16
/// (candle's sum a bf16 row of 4096 zeros to 256), rounded once.
pub fn softmax<D: candle_core::shape::Dim>(xs: &Tensor, dim: D) -> Result<Tensor> {
    let dim = dim.to_index(xs.shape(), "softmax")?;
    if dim + 1 == xs.rank() {
        return softmax_last_dim(xs);
    }
    cast(&candle_nn::ops::softmax(&widen(xs)?, dim)?, xs.dtype())
}

/// Log-softmax over dimension `d`, as `candle_nn::ops::log_softmax`, in f32 for f16 and bf16
/// (the crate's rule), rounded once.
pub fn log_softmax<D: candle_core::shape::Dim>(xs: &Tensor, d: D) -> Result<Tensor> {
    cast(&candle_nn::ops::log_softmax(&widen(xs)?, d)?, xs.dtype())
}

fn norm2(what: &str, xs: &Tensor, alpha: &Tensor, eps: f32, remove_mean: bool) -> Result<Tensor> {
    check_norm(what, xs, alpha, None)?;
    if xs.elem_count() == 0 {
        return empty_output(xs.shape(), &[xs, alpha]);
    }
    let mut uses = Vec::new();
    let alpha = through(&alpha.contiguous()?, &mut uses);
    let op = Held::new(Norm { eps, remove_mean }, uses);
    xs.contiguous()?.apply_op2(&alpha, op)
}

/// Fails unless every tensor has one float dtype the fused layers take; `what` names the layer.
pub(super) fn check_float(what: &str, ts: &[(&str, &Tensor)]) -> Result<()> {
    let dtype = ts[0].1.dtype();
    if !matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
        candle_core::bail!(
            "{what}: the {} is {dtype:?}; it takes f32, f64, f16 or bf16",
            ts[0].0
        )
    }
    for (name, t) in &ts[1..] {
        if t.dtype() != dtype {
            candle_core::bail!(
                "{what}: the {} is {dtype:?} but the {name} is {:?}: give them one dtype",
                ts[0].0,
                t.dtype()
            )
        }
    }
    Ok(())
}

/// Checks a normalisation's arguments.
fn check_norm(what: &str, xs: &Tensor, alpha: &Tensor, beta: Option<&Tensor>) -> Result<()> {
    let mut ts = vec![("input", xs), ("weight", alpha)];
    ts.extend(beta.map(|b| ("bias", b)));
    check_float(what, &ts)?;
    let n = match xs.dims().last() {
        Some(&n) => n,
        None => candle_core::bail!("{what}: the input is a scalar; it needs a last dimension"),
    };
    for (name, t) in &ts[1..] {
        if t.dims() != [n] {
            candle_core::bail!(
                "{what}: the {name} has shape {:?}, but the input {:?} needs one of [{n}] (its \
                 last dimension)",
                t.dims(),
                xs.dims()
            )
        }
    }
    Ok(())
}

/// Whether this backward runs our CPU kernels (rather than candle ops).
fn kernel_backward(t: &Tensor) -> bool {
    t.device().is_cpu() && own_cpu_kernels()
}

/// Layer (`remove_mean`) or RMS normalisation over the last dimension, as a custom op over
/// `(x, alpha)` or `(x, alpha, beta)`.
#[derive(Clone, Copy, Debug)]
struct Norm {
    eps: f32,
    remove_mean: bool,
}

impl Norm {
    fn name(&self) -> &'static str {
        if self.remove_mean {
            "cp-layer-norm"
        } else {
            "cp-rms-norm"
        }
    }

    fn cpu(&self, s: &[(&CpuStorage, &Layout)]) -> Result<(CpuStorage, Shape)> {
        let storages: Vec<&CpuStorage> = s.iter().map(|(s, _)| *s).collect();
        let out = with_float_slices!(&storages, |v: T| {
            let x = values(v[0], s[0].1, "the input")?;
            let alpha = values(v[1], s[1].1, "the weight")?;
            let beta = match s.get(2) {
                Some((_, l)) => Some(values(v[2], l, "the bias")?),
                None => None,
            };
            rows::storage(rows::norm_fwd::<T>(
                x,
                alpha,
                beta,
                self.eps,
                self.remove_mean,
            ))
        });
        Ok((out, s[0].1.shape().clone()))
    }

    /// The gradients of `x`, `alpha` and (`with_beta`) `beta` from the output's gradient.
    fn backward(
        &self,
        x: &Tensor,
        alpha: &Tensor,
        grad: &Tensor,
        with_beta: bool,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        if kernel_backward(x) {
            let packed = x.apply_op3_no_bwd(
                alpha,
                &grad.contiguous()?,
                &NormGrad {
                    norm: *self,
                    with_beta,
                },
            )?;
            let (len, n) = (x.elem_count(), alpha.elem_count());
            let dx = packed.narrow(0, 0, len)?.reshape(x.shape())?;
            let da = packed.narrow(0, len, n)?;
            let db = if with_beta {
                Some(packed.narrow(0, len + n, n)?)
            } else {
                None
            };
            return Ok((dx, da, db));
        }
        norm_backward_ops(x, alpha, grad, *self, with_beta)
    }
}

/// The backward of [`Norm`] made of candle ops: what runs on CUDA (and on the CPU with our
/// kernels switched off).
fn norm_backward_ops(
    x: &Tensor,
    alpha: &Tensor,
    grad: &Tensor,
    norm: Norm,
    with_beta: bool,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let dtype = x.dtype();
    let n = alpha.elem_count();
    let rows = x.elem_count() / n;
    let (x2, g) = (
        x.to_dtype(wide(dtype))?.reshape((rows, n))?,
        grad.to_dtype(wide(dtype))?.reshape((rows, n))?,
    );
    let alpha = alpha.to_dtype(wide(dtype))?;
    let centred = if norm.remove_mean {
        // Two passes, the second correcting the first mean, as the kernels do.
        let d = x2.broadcast_sub(&x2.mean_keepdim(D::Minus1)?)?;
        d.broadcast_sub(&d.mean_keepdim(D::Minus1)?)?
    } else {
        x2
    };
    let rstd = (centred.sqr()?.mean_keepdim(D::Minus1)? + norm.eps as f64)?
        .sqrt()?
        .recip()?;
    let xhat = centred.broadcast_mul(&rstd)?;
    let gy = g.broadcast_mul(&alpha)?;
    let c1 = (&gy * &xhat)?.mean_keepdim(D::Minus1)?;
    let mut inner = (&gy - xhat.broadcast_mul(&c1)?)?;
    if norm.remove_mean {
        inner = inner.broadcast_sub(&gy.mean_keepdim(D::Minus1)?)?;
    }
    let dx = inner
        .broadcast_mul(&rstd)?
        .to_dtype(dtype)?
        .reshape(x.shape())?;
    let da = (&g * &xhat)?.sum(0)?.to_dtype(dtype)?;
    let db = if with_beta {
        Some(g.sum(0)?.to_dtype(dtype)?)
    } else {
        None
    };
    Ok((dx, da, db))
}

impl candle_core::CustomOp2 for Norm {
    fn name(&self) -> &'static str {
        Norm::name(self)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu(&[(s1, l1), (s2, l2)])
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::fused_cuda::norm(s1, l1, s2, l2, None, self.eps, self.remove_mean)
    }

    fn bwd(
        &self,
        x: &Tensor,
        alpha: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, da, _) = self.backward(x, alpha, grad, false)?;
        Ok((hand_over(res, x, Some(dx)), hand_over(res, alpha, Some(da))))
    }
}

impl candle_core::CustomOp3 for Norm {
    fn name(&self) -> &'static str {
        Norm::name(self)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu(&[(s1, l1), (s2, l2), (s3, l3)])
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::fused_cuda::norm(s1, l1, s2, l2, Some((s3, l3)), self.eps, self.remove_mean)
    }

    fn bwd(
        &self,
        x: &Tensor,
        alpha: &Tensor,
        beta: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, da, db) = self.backward(x, alpha, grad, true)?;
        let (da, db) = (hand_over(res, alpha, Some(da)), hand_over(res, beta, db));
        Ok((hand_over(res, x, Some(dx)), da, db))
    }
}

/// The CPU backward of [`Norm`] over `(x, alpha, grad)`: one flat tensor holding the gradients
/// of `x`, `alpha` and (`with_beta`) `beta`, one after the other.
struct NormGrad {
    norm: Norm,
    with_beta: bool,
}

impl candle_core::CustomOp3 for NormGrad {
    fn name(&self) -> &'static str {
        "cp-norm-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let packed = with_float_slices!(&[s1, s2, s3], |v: T| {
            let x = values(v[0], l1, "the input")?;
            let alpha = values(v[1], l2, "the weight")?;
            let g = values(v[2], l3, "the gradient")?;
            let packed = rows::norm_bwd::<T>(
                x,
                alpha,
                g,
                self.norm.eps,
                self.norm.remove_mean,
                self.with_beta,
            );
            let len = packed.len();
            (rows::storage(packed), len)
        });
        Ok((packed.0, Shape::from(packed.1)))
    }
}

/// Softmax over the last dimension, as a custom op.
struct SoftmaxLastDim;

impl candle_core::CustomOp1 for SoftmaxLastDim {
    fn name(&self) -> &'static str {
        "cp-softmax-last-dim"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = l.dims().last().copied().unwrap_or(1);
        let out = with_float_slices!(&[s], |v: T| {
            rows::storage(rows::softmax_fwd::<T>(values(v[0], l, "the input")?, n))
        });
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::fused_cuda::softmax_last_dim(s, l)
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if kernel_backward(y) {
            return Ok(Some(y.apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxGrad)?));
        }
        Ok(Some(softmax_backward_ops(y, grad)?))
    }
}

/// The backward of [`SoftmaxLastDim`] made of candle ops, from its output `y`.
fn softmax_backward_ops(y: &Tensor, grad: &Tensor) -> Result<Tensor> {
    let dtype = y.dtype();
    let (y, g) = (y.to_dtype(wide(dtype))?, grad.to_dtype(wide(dtype))?);
    let dot = (&y * &g)?.sum_keepdim(D::Minus1)?;
    (y * g.broadcast_sub(&dot)?)?.to_dtype(dtype)
}

/// The CPU backward of [`SoftmaxLastDim`] over `(y, grad)`.
struct SoftmaxGrad;

impl candle_core::CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "cp-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let n = l1.dims().last().copied().unwrap_or(1);
        let out = with_float_slices!(&[s1, s2], |v: T| {
            let y = values(v[0], l1, "the output")?;
            let g = values(v[1], l2, "the gradient")?;
            rows::storage(rows::softmax_bwd::<T>(y, g, n))
        });
        Ok((out, l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// softmax over any dimension and log_softmax sum in f32 for bf16 and f16: over 4096 zeros
    /// every probability is 1/4096 (candle's: 1/256 in bf16), every log-probability -ln 4096.
    #[test]
    fn softmax_and_log_softmax_over_4096_values_hold_in_half_precision() -> Result<()> {
        for dtype in [DType::BF16, DType::F16, DType::F32, DType::F64] {
            let x = Tensor::zeros((4096, 2), dtype, &Device::Cpu)?;
            let p = softmax(&x, 0)?.to_dtype(DType::F64)?.to_vec2::<f64>()?;
            assert!(p.iter().flatten().all(|&v| v == 1.0 / 4096.0), "{dtype:?}");
            let l = log_softmax(&x.t()?, D::Minus1)?;
            assert_eq!(l.dtype(), dtype);
            let want = -(4096f64.ln());
            for v in l.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()? {
                assert!((v - want).abs() <= want.abs() * 4e-3, "{dtype:?}: {v}");
            }
        }
        Ok(())
    }

    /// The candle-ops backward (CUDA's) equals the kernel backward, on the CPU.
    #[test]
    fn the_candle_ops_backward_equals_the_kernel_backward() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0.3f32, 1.7, (5, 3, 7), &dev)?;
        let alpha = Tensor::randn(1f32, 0.5, 7, &dev)?;
        let g = Tensor::randn(0f32, 1., (5, 3, 7), &dev)?;
        for remove_mean in [true, false] {
            let norm = Norm {
                eps: 1e-5,
                remove_mean,
            };
            let (dx, da, db) = norm.backward(&x, &alpha, &g, true)?;
            let (ex, ea, eb) = norm_backward_ops(&x, &alpha, &g, norm, true)?;
            for (a, b) in [(dx, ex), (da, ea), (db.unwrap(), eb.unwrap())] {
                let diff = (a - &b)?.abs()?.max_all()?.to_scalar::<f32>()?;
                let size = b.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(diff <= 1e-5 * size.max(1.0), "{diff} against {size}");
            }
        }
        let xv = Var::from_tensor(&x)?;
        let y = softmax_last_dim(&xv)?;
        let kernel = (&y * &g)?.sum_all()?.backward()?;
        let ops = softmax_backward_ops(&y, &g)?;
        let diff = (kernel.get(&xv).unwrap() - ops)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert!(diff < 1e-6, "{diff}");
        Ok(())
    }
}
