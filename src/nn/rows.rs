//! CPU kernels of the fused layers in [`ops`](super::ops) that work row by row over the last
//! dimension: layer and RMS normalisation, and softmax, forward and backward.
//!
//! The forwards repeat candle-nn 0.11's fused CPU kernels operation for operation, so that they
//! give the same numbers (statistics in f32 for f32, f16 and bf16; candle's order of
//! operations). The backwards compute in f32 (f64 for f64) and round once at the end. Rows are
//! spread over candle's thread pool (rayon's).

use candle_core::{CpuStorage, Layout, Result, WithDType};
use num_traits::{Float, NumCast, Zero};
use rayon::prelude::*;
use std::ops::AddAssign;

/// An element type of the fused layers, with the type its statistics are computed in.
pub(super) trait Elem: WithDType + Float {
    /// f32 for f32, f16 and bf16; f64 for f64.
    type Acc: Float + AddAssign + Send + Sync;
    fn up(self) -> Self::Acc;
    fn down(a: Self::Acc) -> Self;
    /// `a` as the f32 candle's kernels compute statistics in (f64 stays f64 here).
    fn acc_from_f32(a: f32) -> Self::Acc;
}

macro_rules! elem {
    ($t:ty, $acc:ty, $up:expr, $down:expr) => {
        impl Elem for $t {
            type Acc = $acc;
            #[inline(always)]
            fn up(self) -> $acc {
                $up(self)
            }
            #[inline(always)]
            fn down(a: $acc) -> Self {
                $down(a)
            }
            #[inline(always)]
            fn acc_from_f32(a: f32) -> $acc {
                a as $acc
            }
        }
    };
}
elem!(f32, f32, |x| x, |a| a);
elem!(f64, f64, |x| x, |a| a);
elem!(half::f16, f32, half::f16::to_f32, half::f16::from_f32);
elem!(half::bf16, f32, half::bf16::to_f32, half::bf16::from_f32);

/// The values of a contiguous tensor (`what` names it in the error).
pub(super) fn values<'a, T>(s: &'a [T], l: &Layout, what: &str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&s[start..end]),
        None => candle_core::bail!("{what} must be contiguous here (got {l:?})"),
    }
}

/// `n` as a float.
#[inline(always)]
fn count<A: Float>(n: usize) -> A {
    <A as NumCast>::from(n).expect("a length converts to a float")
}

/// Row statistics as candle's kernels compute them: the mean (0 for RMS normalisation) and
/// the inverse of the standard deviation (of the root mean square).
#[inline(always)]
fn stats<T: Elem>(row: &[T], eps: T::Acc, remove_mean: bool) -> (T::Acc, T::Acc) {
    let n = count::<T::Acc>(row.len());
    let (mut sum, mut sum2) = (T::Acc::zero(), T::Acc::zero());
    for &v in row {
        let v = v.up();
        sum += v;
        sum2 += v * v;
    }
    if remove_mean {
        let mean = sum / n;
        (mean, (sum2 / n - mean * mean + eps).sqrt().recip())
    } else {
        (T::Acc::zero(), (sum2 / n + eps).sqrt().recip())
    }
}

/// Layer normalisation (`remove_mean`) or RMS normalisation of each row of `n` values, scaled
/// by `alpha` and shifted by `beta`.
pub(super) fn norm_fwd<T: Elem>(
    x: &[T],
    alpha: &[T],
    beta: Option<&[T]>,
    eps: f32,
    remove_mean: bool,
) -> Vec<T> {
    let n = alpha.len();
    let mut out = vec![T::zero(); x.len()];
    let eps_acc = T::acc_from_f32(eps);
    x.par_chunks(n)
        .zip(out.par_chunks_mut(n))
        .for_each(|(row, dst)| {
            if remove_mean {
                let (mean, inv_std) = stats(row, eps_acc, true);
                let scaled = dst.iter_mut().zip(row).zip(alpha);
                match beta {
                    Some(beta) => {
                        for (((d, &s), &a), &b) in scaled.zip(beta) {
                            *d = T::down((s.up() - mean) * inv_std * a.up() + b.up());
                        }
                    }
                    None => {
                        for ((d, &s), &a) in scaled {
                            *d = T::down((s.up() - mean) * inv_std * a.up());
                        }
                    }
                }
            } else {
                // candle divides by the root mean square rounded to the element type.
                let mut sum2 = T::Acc::zero();
                for &v in row {
                    sum2 += v.up() * v.up();
                }
                let rms = T::down((sum2 / count(n) + eps_acc).sqrt());
                for (j, (d, &s)) in dst.iter_mut().zip(row).enumerate() {
                    *d = s / rms * alpha[j];
                }
            }
        });
    out
}

/// The gradients of [`norm_fwd`] given the output's gradient `g`, packed into one vector: the
/// input's gradient (as many values as `x`), then `alpha`'s, then `beta`'s when `with_beta`.
pub(super) fn norm_bwd<T: Elem>(
    x: &[T],
    alpha: &[T],
    g: &[T],
    eps: f32,
    remove_mean: bool,
    with_beta: bool,
) -> Vec<T> {
    let n = alpha.len();
    let rows = x.len() / n.max(1);
    let eps_acc = T::acc_from_f32(eps);
    let n_acc = count::<T::Acc>(n);
    let mut packed = vec![T::zero(); x.len() + n * if with_beta { 2 } else { 1 }];
    let (dx, dparams) = packed.split_at_mut(x.len());
    // Each block of rows sums its share of the parameters' gradients; the blocks are then added.
    let block = rows.div_ceil(4 * rayon::current_num_threads()).max(1) * n;
    let zeros = || (vec![T::Acc::zero(); n], vec![T::Acc::zero(); n]);
    let (d_alpha, d_beta) = if n == 0 {
        zeros()
    } else {
        x.par_chunks(block)
            .zip(g.par_chunks(block))
            .zip(dx.par_chunks_mut(block))
            .map(|((xs, gs), dxs)| {
                let (mut da, mut db) = zeros();
                for ((row, gr), dr) in xs.chunks(n).zip(gs.chunks(n)).zip(dxs.chunks_mut(n)) {
                    let (mean, rstd) = stats(row, eps_acc, remove_mean);
                    let (mut sum_gy, mut sum_gy_xhat) = (T::Acc::zero(), T::Acc::zero());
                    for j in 0..n {
                        let xhat = (row[j].up() - mean) * rstd;
                        let gj = gr[j].up();
                        let gy = gj * alpha[j].up();
                        sum_gy += gy;
                        sum_gy_xhat += gy * xhat;
                        da[j] += gj * xhat;
                        db[j] += gj;
                    }
                    let c1 = sum_gy_xhat / n_acc;
                    let c2 = if remove_mean {
                        sum_gy / n_acc
                    } else {
                        T::Acc::zero()
                    };
                    for j in 0..n {
                        let xhat = (row[j].up() - mean) * rstd;
                        let gy = gr[j].up() * alpha[j].up();
                        dr[j] = T::down(rstd * (gy - c2 - xhat * c1));
                    }
                }
                (da, db)
            })
            .reduce(zeros, |(mut a, mut b), (c, d)| {
                for j in 0..n {
                    a[j] += c[j];
                    b[j] += d[j];
                }
                (a, b)
            })
    };
    let (da, db) = dparams.split_at_mut(n);
    for j in 0..n {
        da[j] = T::down(d_alpha[j]);
        if with_beta {
            db[j] = T::down(d_beta[j]);
        }
    }
    packed
}

/// Softmax of each row of `n` values, as candle's fused kernel computes it.
pub(super) fn softmax_fwd<T: Elem>(x: &[T], n: usize) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    if n == 0 {
        return out;
    }
    x.par_chunks(n)
        .zip(out.par_chunks_mut(n))
        .for_each(|(row, dst)| {
            let mut max = T::neg_infinity();
            // SAFETY: `row` holds `n` values.
            unsafe { T::vec_reduce_max(row.as_ptr(), &mut max, n) };
            for (d, &s) in dst.iter_mut().zip(row) {
                *d = (s - max).exp();
            }
            let mut sum = T::zero();
            // SAFETY: `dst` holds `n` values.
            unsafe { T::vec_reduce_sum(dst.as_ptr(), &mut sum, n) };
            for d in dst.iter_mut() {
                *d /= sum;
            }
        });
    out
}

/// The gradient of a softmax over rows of `n` values from its output `y` and the output's
/// gradient `g`: `y * (g - sum(g * y))`.
pub(super) fn softmax_bwd<T: Elem>(y: &[T], g: &[T], n: usize) -> Vec<T> {
    let mut dx = vec![T::zero(); y.len()];
    if n == 0 {
        return dx;
    }
    y.par_chunks(n)
        .zip(g.par_chunks(n))
        .zip(dx.par_chunks_mut(n))
        .for_each(|((yr, gr), dr)| {
            let mut dot = T::Acc::zero();
            for (&y, &g) in yr.iter().zip(gr) {
                dot += y.up() * g.up();
            }
            for ((d, &y), &g) in dr.iter_mut().zip(yr).zip(gr) {
                *d = T::down(y.up() * (g.up() - dot));
            }
        });
    dx
}

/// Applies `f` to the slices of one float dtype held by `storages` (all of the same dtype).
macro_rules! with_float_slices {
    ($storages:expr, |$s:ident : $t:ident| $body:expr) => {{
        use candle_core::backend::BackendStorage;
        use candle_core::CpuStorage as C;
        let storages: &[&C] = $storages;
        macro_rules! all {
            ($variant:ident) => {
                storages
                    .iter()
                    .map(|s| match s {
                        C::$variant(v) => Some(v.as_slice()),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()
            };
        }
        if let Some($s) = all!(F32) {
            type $t = f32;
            $body
        } else if let Some($s) = all!(F64) {
            type $t = f64;
            $body
        } else if let Some($s) = all!(F16) {
            type $t = half::f16;
            $body
        } else if let Some($s) = all!(BF16) {
            type $t = half::bf16;
            $body
        } else {
            let dtypes: Vec<_> = storages.iter().map(|s| s.dtype()).collect();
            candle_core::bail!(
                "the fused layers take f32, f64, f16 or bf16 tensors of one dtype, got {dtypes:?}"
            )
        }
    }};
}
pub(super) use with_float_slices;

/// A CPU storage holding `v`.
pub(super) fn storage<T: WithDType>(v: Vec<T>) -> CpuStorage {
    T::to_cpu_storage_owned(v)
}
