//! The exact (erf) GELU as one op with its own backward, on the CPU: `x · Φ(x)` forward and
//! `g · (Φ(x) + x · φ(x))` backward, each one pass over the elements.
//!
//! candle's `gelu_erf` calls libm's scalar `erff` per element, and its backward is nine tensor
//! ops (squares, an exponential, a second erf, sums), each a fresh tensor: in the transformer's
//! MLP (`benches/transformer_phases`) that was 10x PyTorch's time forward and 13x backward. Here
//! Φ comes from `erfc` by a Chebyshev fit (Numerical Recipes' `erfcc`: fractional error below
//! 1.2e-7 everywhere) and the exponentials from a branch-free polynomial `exp`, so the loops
//! vectorise. `Φ(x) = erfc(-x/√2) / 2` has no cancellation for negative `x`, where torch's
//! `(1 + erf(x/√2)) / 2` loses every digit: at x = -5 this gives -1.4333e-6 (the true value),
//! torch -1.4901e-6. Elsewhere the two agree to f32 rounding (the tests compare with candle's
//! op; the torch twin compares the whole model). f16 and bf16 compute in f32 and round once;
//! f64, and every tensor off the CPU, use candle's `gelu_erf`, whose f64 erf is exact to f64.

use super::kernels::{for_each_chunk, threads};
use super::rows::{storage, values, with_float_slices, Elem};
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};

/// Tensors below this many elements run on one thread: splitting costs more.
const PARALLEL_MIN: usize = 1 << 14;

/// 1/√2.
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// 1/√(2π).
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

/// `e^x` in f32, branch-free (so that loops of it vectorise): Cephes' `expf` range reduction
/// and polynomial, within 2 ulp; 0 below -87 and NaN for NaN.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-87.0, 88.0);
    let n = xc.mul_add(LOG2E, 0.5).floor();
    let r = n.mul_add(-C2, n.mul_add(-C1, xc));
    let p = 1.987_569_2e-4f32;
    let p = p.mul_add(r, 1.398_199_9e-3);
    let p = p.mul_add(r, 8.333_452e-3);
    let p = p.mul_add(r, 4.166_579_6e-2);
    let p = p.mul_add(r, 1.666_666_5e-1);
    let p = p.mul_add(r, 0.5);
    let e = (p * r).mul_add(r, r + 1.0);
    // 2^n from n's bits: adding 1.5 * 2^23 puts the integer n (within -127..=128 here) in the
    // low bits of the mantissa, without a float-to-int conversion (Rust's saturating `as`
    // does not vectorise: it ran lane by lane, most of the pass's time).
    let biased = (n + 12_582_912.0).to_bits().wrapping_sub(0x4B40_0000 - 127);
    let scale = f32::from_bits(biased << 23);
    let y = e * scale;
    if x < -87.0 {
        0.0
    } else if x.is_nan() {
        x
    } else {
        y
    }
}

/// `erfc(x)` in f32 (Numerical Recipes' `erfcc`, fractional error below 1.2e-7 in exact
/// arithmetic).
#[inline(always)]
fn erfc(x: f32) -> f32 {
    let z = x.abs();
    let t = 1.0 / z.mul_add(0.5, 1.0);
    let p = 0.170_872_77f32;
    let p = p.mul_add(t, -0.822_152_23);
    let p = p.mul_add(t, 1.488_515_9);
    let p = p.mul_add(t, -1.135_204);
    let p = p.mul_add(t, 0.278_868_07);
    let p = p.mul_add(t, -0.186_288_06);
    let p = p.mul_add(t, 0.096_784_18);
    let p = p.mul_add(t, 0.374_091_96);
    let p = p.mul_add(t, 1.000_023_7);
    let ans = t * exp(t.mul_add(p, (-z).mul_add(z, -1.265_512_2)));
    if x >= 0.0 {
        ans
    } else {
        2.0 - ans
    }
}

/// Φ(x), the standard normal distribution function.
#[inline(always)]
fn cdf(x: f32) -> f32 {
    0.5 * erfc(-x * FRAC_1_SQRT_2)
}

#[inline(always)]
fn forward(x: f32) -> f32 {
    x * cdf(x)
}

/// d gelu / dx = Φ(x) + x φ(x).
#[inline(always)]
fn derivative(x: f32) -> f32 {
    x.mul_add(FRAC_1_SQRT_2PI * exp(-0.5 * x * x), cdf(x))
}

/// What an elementwise pass computes: GELU's value (`x` alone), or its gradient (`x` and the
/// incoming gradient). A type, not a closure, so that it inlines into the AVX2 loop.
#[derive(Clone, Copy)]
enum Pass {
    Forward,
    Backward,
}

impl Pass {
    #[inline(always)]
    fn at(self, x: f32, g: f32) -> f32 {
        match self {
            Pass::Forward => forward(x),
            Pass::Backward => g * derivative(x),
        }
    }
}

/// `out[i] = pass(a[i], b[i])` (`b` only for the backward), computed in f32 and rounded to `T`
/// once, over candle's threads for large inputs.
fn map<T>(a: &[T], b: Option<&[T]>, pass: Pass) -> Vec<T>
where
    T: Elem + Send + Sync,
    T::Acc: From<f32> + Into<f64>,
{
    let run = |a: &[T], b: Option<&[T]>, out: &mut [T]| {
        #[cfg(target_arch = "x86_64")]
        if super::rows::avx512() {
            // SAFETY: the CPU has the instructions, just checked.
            return unsafe {
                match pass {
                    Pass::Forward => run_avx512::<T, true>(a, b, out),
                    Pass::Backward => run_avx512::<T, false>(a, b, out),
                }
            };
        }
        #[cfg(target_arch = "x86_64")]
        if super::rows::avx2() {
            // SAFETY: the CPU has the instructions, just checked.
            return unsafe {
                match pass {
                    Pass::Forward => run_avx2::<T, true>(a, b, out),
                    Pass::Backward => run_avx2::<T, false>(a, b, out),
                }
            };
        }
        match pass {
            Pass::Forward => run_plain::<T, true>(a, b, out),
            Pass::Backward => run_plain::<T, false>(a, b, out),
        }
    };
    let mut out = vec![T::zero(); a.len()];
    if a.len() < PARALLEL_MIN || threads() == 1 {
        run(a, b, &mut out);
        return out;
    }
    for_each_chunk(&mut out, 1, |first, o| {
        let range = first..first + o.len();
        run(&a[range.clone()], b.map(|b| &b[range]), o);
    });
    out
}

/// The elementwise loop of [`map`]: the forward (`FORWARD`) or the backward, whose gradients
/// `b` holds.
#[inline(always)]
fn run_plain<T, const FORWARD: bool>(a: &[T], b: Option<&[T]>, out: &mut [T])
where
    T: Elem,
    T::Acc: From<f32> + Into<f64>,
{
    let f32_of = |v: T| -> f32 { v.up().into() as f32 };
    match b {
        Some(b) if !FORWARD => {
            for ((o, &x), &g) in out.iter_mut().zip(a).zip(b) {
                *o = T::down(Pass::Backward.at(f32_of(x), f32_of(g)).into());
            }
        }
        _ => {
            for (o, &x) in out.iter_mut().zip(a) {
                *o = T::down(Pass::Forward.at(f32_of(x), 0.0).into());
            }
        }
    }
}

/// [`run_plain`] compiled for AVX2 and FMA, where the loop vectorises (SSE2, the baseline, has
/// no vector `floor` for `exp`'s range reduction). Rust never fuses a multiply and an add on its
/// own: the polynomials' fused multiply-adds are written as `mul_add`, which rounds once on
/// every CPU (in software where there is no FMA), so the numbers are the plain loop's.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2<T, const FORWARD: bool>(a: &[T], b: Option<&[T]>, out: &mut [T])
where
    T: Elem,
    T::Acc: From<f32> + Into<f64>,
{
    run_plain::<T, FORWARD>(a, b, out)
}

/// [`run_plain`] compiled for AVX-512 (see [`in_place_avx512`]).
///
/// # Safety
/// The CPU must have AVX-512F, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn run_avx512<T, const FORWARD: bool>(a: &[T], b: Option<&[T]>, out: &mut [T])
where
    T: Elem,
    T::Acc: From<f32> + Into<f64>,
{
    run_plain::<T, FORWARD>(a, b, out)
}

/// `v[i] = gelu(v[i])` in place, over candle's threads for large inputs: the forward of a
/// linear layer fused with its GELU (`nn::linear_gelu`).
pub(super) fn gelu_in_place(v: &mut [f32]) {
    in_place(None, v);
}

/// `g[i] *= gelu'(x[i])` in place, given also the GELU's output `y`: the gradient at a GELU's
/// input from the one at its output. `Φ(x)` is read back as `y / x` (0.5 near 0), so that only
/// `φ(x)`'s exponential is computed, not a second `erfc`; where `x · Φ(x)` underflowed (x below
/// -13) the gradient is 0, within 1e-36 of the true one.
pub(super) fn gelu_grad_in_place(x: &[f32], y: &[f32], g: &mut [f32]) {
    in_place(Some((x, y)), g);
}

/// `gelu'(x)` from `x` and `y = gelu(x)` (see [`gelu_grad_in_place`]).
#[inline(always)]
fn derivative_from_output(x: f32, y: f32) -> f32 {
    // Near 0, Φ(x) = 0.5 + 0.4 x to f32 precision, and y / x would lose y to underflow.
    let cdf = if x.abs() < 1e-30 { 0.5 } else { y / x };
    x.mul_add(FRAC_1_SQRT_2PI * exp(-0.5 * x * x), cdf)
}

/// [`gelu_in_place`] (`xy` absent) or [`gelu_grad_in_place`].
fn in_place(xy: Option<(&[f32], &[f32])>, v: &mut [f32]) {
    let run = |xy: Option<(&[f32], &[f32])>, v: &mut [f32]| {
        #[cfg(target_arch = "x86_64")]
        if super::rows::avx512() {
            // SAFETY: the CPU has the instructions, just checked.
            return unsafe { in_place_avx512(xy, v) };
        }
        #[cfg(target_arch = "x86_64")]
        if super::rows::avx2() {
            // SAFETY: the CPU has the instructions, just checked.
            return unsafe { in_place_avx2(xy, v) };
        }
        in_place_plain(xy, v)
    };
    if v.len() < PARALLEL_MIN || threads() == 1 {
        return run(xy, v);
    }
    for_each_chunk(v, 1, |first, chunk| {
        let range = first..first + chunk.len();
        run(xy.map(|(x, y)| (&x[range.clone()], &y[range])), chunk)
    });
}

#[inline(always)]
fn in_place_plain(xy: Option<(&[f32], &[f32])>, v: &mut [f32]) {
    match xy {
        Some((x, y)) => {
            for ((g, &x), &y) in v.iter_mut().zip(x).zip(y) {
                *g *= derivative_from_output(x, y);
            }
        }
        None => {
            for v in v.iter_mut() {
                *v = forward(*v);
            }
        }
    }
}

/// [`in_place_plain`] compiled for AVX2 and FMA (the same numbers: every fused multiply-add
/// is written as `mul_add`, which rounds once everywhere).
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn in_place_avx2(xy: Option<(&[f32], &[f32])>, v: &mut [f32]) {
    in_place_plain(xy, v)
}

/// [`in_place_plain`] compiled for AVX-512: sixteen lanes, half the time of eight (the
/// forward 2.4-2.6 -> 1.2-1.3 ns a value on one core of the Xeon of docs/BENCHMARKS.md, the
/// backward 1.3-1.6 -> 0.7-0.9), the same numbers.
///
/// # Safety
/// The CPU must have AVX-512F, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn in_place_avx512(xy: Option<(&[f32], &[f32])>, v: &mut [f32]) {
    in_place_plain(xy, v)
}

/// The GELU of `x` with the exact (erf) form, `x · Φ(x)`, as torch's `F.gelu` (default
/// `approximate='none'`) and candle's `gelu_erf`, with a one-pass backward on the CPU (see the
/// [module docs](self)).
pub fn gelu_erf(xs: &Tensor) -> Result<Tensor> {
    let own = xs.device().is_cpu()
        && matches!(xs.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && xs.elem_count() > 0;
    if !own {
        return xs.gelu_erf();
    }
    xs.contiguous()?.apply_op1(GeluErf)
}

struct GeluErf;

impl candle_core::CustomOp1 for GeluErf {
    fn name(&self) -> &'static str {
        "cp-gelu-erf"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = with_float_slices!(&[s], |v: T| {
            storage(map::<T>(values(v[0], l, "the input")?, None, Pass::Forward))
        });
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(&grad.contiguous()?, &GeluErfGrad)?))
    }
}

/// The backward of [`GeluErf`] over `(x, grad)`.
struct GeluErfGrad;

impl candle_core::CustomOp2 for GeluErfGrad {
    fn name(&self) -> &'static str {
        "cp-gelu-erf-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = with_float_slices!(&[s1, s2], |v: T| {
            let x = values(v[0], l1, "the input")?;
            let g = values(v[1], l2, "the gradient")?;
            storage(map::<T>(x, Some(g), Pass::Backward))
        });
        Ok((out, l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Values across the whole range: the tails, around zero, and every special value.
    fn inputs() -> Vec<f32> {
        let mut v: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.005).collect();
        v.extend([
            -100.0,
            -30.0,
            -13.0,
            -9.5,
            -7.0,
            -5.0,
            1e-30,
            -1e-30,
            0.0,
            -0.0,
            5.0,
            9.5,
            30.0,
            1e30,
            -1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ]);
        v
    }

    /// Φ and φ computed in f64 from candle's f64 erf (libm's, exact to f64).
    fn exact(x: f64) -> (f64, f64) {
        let t = Tensor::new(&[x / std::f64::consts::SQRT_2], &Device::Cpu).unwrap();
        let erf = t.erf().unwrap().to_vec1::<f64>().unwrap()[0];
        let cdf = 0.5 * (1.0 + erf);
        let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
        (x * cdf, cdf + x * pdf)
    }

    fn close(got: f32, want: f64) -> bool {
        if want.is_nan() {
            return got.is_nan();
        }
        if want.is_infinite() {
            return got as f64 == want;
        }
        (got as f64 - want).abs() <= 2e-7 * want.abs().max(1.0)
    }

    #[test]
    fn values_and_gradients_match_the_exact_function_everywhere() -> Result<()> {
        let xs = inputs();
        let var = Var::new(xs.as_slice(), &Device::Cpu)?;
        let y = gelu_erf(&var)?;
        let grads = y.sum_all()?.backward()?;
        let (y, g) = (
            y.to_vec1::<f32>()?,
            grads.get(&var).unwrap().to_vec1::<f32>()?,
        );
        for (i, &x) in xs.iter().enumerate() {
            let (fy, fg) = if x.is_nan() {
                (f64::NAN, f64::NAN)
            } else if x == f32::INFINITY {
                (f64::INFINITY, f64::NAN)
            } else if x == f32::NEG_INFINITY {
                (f64::NAN, f64::NAN)
            } else {
                exact(x as f64)
            };
            assert!(close(y[i], fy), "gelu({x}) = {} want {fy}", y[i]);
            assert!(close(g[i], fg), "gelu'({x}) = {} want {fg}", g[i]);
        }
        Ok(())
    }

    /// The vector builds compute the plain loop's numbers, bit for bit (every FMA is written
    /// as `mul_add`), over every special value and a few thousand ordinary ones: the GELU's
    /// results do not depend on the CPU.
    #[test]
    fn every_build_gives_the_plain_loops_bits() {
        let xs = inputs();
        let mut plain = xs.clone();
        in_place_plain(None, &mut plain);
        let mut plain_grad = vec![1.5f32; xs.len()];
        in_place_plain(Some((&xs, &plain)), &mut plain_grad);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        /// A build of the in-place loops: the GELU, or its gradient given `(x, y)`.
        type Build = unsafe fn(Option<(&[f32], &[f32])>, &mut [f32]);
        #[allow(unused_mut)] // nothing to add off x86-64
        let mut builds: Vec<(&str, Build)> = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if super::super::rows::avx2() {
                builds.push(("AVX2", in_place_avx2));
            }
            if super::super::rows::avx512() {
                builds.push(("AVX-512", in_place_avx512));
            }
        }
        for (name, build) in builds {
            let mut y = xs.clone();
            let mut g = vec![1.5f32; xs.len()];
            // SAFETY: the CPU has the build's instructions, checked above.
            unsafe {
                build(None, &mut y);
                build(Some((&xs, &y)), &mut g);
            }
            assert_eq!(bits(&y), bits(&plain), "{name}: the forward");
            assert_eq!(bits(&g), bits(&plain_grad), "{name}: the backward");
        }
    }

    /// Against candle's op (libm's erf and its composed backward), on a strided input large
    /// enough to run on several threads, and in every dtype it handles.
    #[test]
    fn it_equals_candles_gelu_erf_within_rounding_in_every_dtype() -> Result<()> {
        let n = 3 * PARALLEL_MIN + 5;
        let base = Tensor::arange(0u32, (2 * n) as u32, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .affine(12.0 / (2 * n) as f64, -6.0)?
            .reshape((n, 2))?
            .t()?; // non-contiguous
        for (dtype, tol) in [(DType::F32, 2e-6), (DType::BF16, 1e-2), (DType::F16, 2e-3)] {
            let x = Var::from_tensor(&base.to_dtype(dtype)?)?;
            let ours = gelu_erf(&x)?;
            let g = (ours.sqr()? * 0.5)?.sum_all()?.backward()?;
            let theirs = x.as_tensor().gelu_erf()?;
            let h = (theirs.sqr()? * 0.5)?.sum_all()?.backward()?;
            let diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
                let d = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?.abs()?;
                let scale = b.to_dtype(DType::F32)?.abs()?.maximum(1.0)?;
                (d / scale)?.flatten_all()?.max(0)?.to_scalar::<f32>()
            };
            assert!(diff(&ours, &theirs)? <= tol, "{dtype:?} values");
            let (a, b) = (g.get(&x).unwrap(), h.get(&x).unwrap());
            assert!(diff(a, b)? <= tol * 4.0, "{dtype:?} gradients");
            assert_eq!(ours.dtype(), dtype);
        }
        Ok(())
    }

    /// The backward from the forward's input and output (Φ read back as y / x) equals the
    /// backward from the input alone, across the range, at 0 and where y underflows.
    #[test]
    fn the_derivative_from_the_output_equals_the_one_from_the_input() {
        let mut xs = inputs();
        xs.extend([-13.0, -13.3, -14.0, -20.0, 1e-38, -1e-38, 1e-45]);
        let mut g = vec![1f32; xs.len()];
        let ys: Vec<f32> = xs.iter().map(|&x| forward(x)).collect();
        gelu_grad_in_place(&xs, &ys, &mut g);
        for (&x, &got) in xs.iter().zip(&g) {
            let want = derivative(x);
            if x.is_nan() || x.is_infinite() {
                assert!(
                    got.is_nan() || got == want,
                    "gelu'({x}) = {got}, want {want}"
                );
                continue;
            }
            assert!(
                (got - want).abs() <= 2e-7 * want.abs().max(1.0),
                "gelu'({x}) = {got}, want {want}"
            );
        }
    }

    #[test]
    fn f64_empty_and_non_cpu_inputs_take_candles_op() -> Result<()> {
        let x = Tensor::new(&[-1.5f64, 0.0, 2.0], &Device::Cpu)?;
        assert_eq!(
            gelu_erf(&x)?.to_vec1::<f64>()?,
            x.gelu_erf()?.to_vec1::<f64>()?
        );
        let e = Tensor::zeros((0, 3), DType::F32, &Device::Cpu)?;
        assert_eq!(gelu_erf(&e)?.dims(), [0, 3]);
        Ok(())
    }
}
