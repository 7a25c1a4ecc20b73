//! CPU kernels of the fused layers in [`ops`](super::ops) that work row by row over the last
//! dimension: layer and RMS normalisation, and softmax, forward and backward.
//!
//! They follow the crate's rule for reductions (see the [`nn` module docs](super)): every sum
//! runs in f32 for f32, f16 and bf16 (f64 for f64), in [`LANES`] interleaved partial sums
//! over blocks of [`BLOCK`] values (which the compiler keeps in vector registers, and which
//! keep each partial sum short), the blocks added pairwise; each element is computed in that type and rounded to the
//! element type once. The variance is stable at any mean: a first pass takes the mean `m`, a
//! second the sums of `d = x - m` and `d²`, from which the mean's correction `c = Σd / n` and
//! the variance `Σd² / n - c²` follow (the corrected two-pass algorithm); each value is then
//! centred as `(x - m) - c`, where `x - m` is exact for values near the mean. Rows are spread
//! over candle's thread pool (rayon's).

use candle_core::{CpuStorage, Layout, Result, WithDType};
use num_traits::{Float, NumCast, Zero};
use rayon::prelude::*;
use std::ops::{AddAssign, Range};

/// An element type of the fused layers, with the type its sums are computed in.
pub(super) trait Elem: WithDType + Float {
    /// f32 for f32, f16 and bf16; f64 for f64.
    type Acc: Float + AddAssign + Total + Send + Sync;
    fn up(self) -> Self::Acc;
    fn down(a: Self::Acc) -> Self;
    /// `a` in the accumulation type.
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
// bf16 through the cast's conversions: the same bits as `half`'s, without branches, so that
// the rows' loops vectorise.
elem!(half::bf16, f32, super::cast::to_f32, super::cast::to_bf16);

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

/// The number of interleaved partial sums of a row's reductions.
const LANES: usize = 8;
/// The most values one set of partial sums takes: longer rows are halved, pairwise.
const BLOCK: usize = 32 * LANES;

/// What a block of a row sums to: one sum (f32, f64), or two side by side.
pub(super) trait Total: Copy + Default {
    /// `self + other`, side by side for two.
    fn plus(self, other: Self) -> Self;
}

impl Total for f32 {
    fn plus(self, other: Self) -> Self {
        self + other
    }
}

impl Total for f64 {
    fn plus(self, other: Self) -> Self {
        self + other
    }
}

impl<A: Total> Total for (A, A) {
    fn plus(self, other: Self) -> Self {
        (self.0.plus(other.0), self.1.plus(other.1))
    }
}

/// A sum over a row taken block by block (see [`pairwise`]).
trait Blocks {
    /// What a block sums to.
    type Total: Total;
    /// The total of the values in `range` (at most [`BLOCK`] of them).
    fn block(&mut self, range: Range<usize>) -> Self::Total;
}

/// The total of `len` values taken in blocks of at most [`BLOCK`], the blocks' totals added
/// pairwise: the first half of the blocks (rounded up) before the second, down to single
/// blocks.
///
/// A loop over a trait's `#[inline(always)]` method, not a recursion over the values nor a
/// closure, so that the blocks' loops inline into the callers' AVX2 builds (a recursive
/// function, or a closure the compiler declines to inline, is compiled once, for the baseline).
#[inline(always)]
fn pairwise<B: Blocks>(len: usize, sums: &mut B) -> B::Total {
    if len <= BLOCK {
        return sums.block(0..len);
    }
    // Rows of up to 64 blocks keep their totals on the stack.
    const ON_STACK: usize = 64;
    let blocks = len.div_ceil(BLOCK);
    let (mut stack, mut heap) = ([B::Total::default(); ON_STACK], Vec::new());
    let totals = if blocks <= ON_STACK {
        &mut stack[..blocks]
    } else {
        heap.resize(blocks, B::Total::default());
        &mut heap[..]
    };
    for (b, total) in totals.iter_mut().enumerate() {
        *total = sums.block(b * BLOCK..len.min((b + 1) * BLOCK));
    }
    tree(totals)
}

/// `totals` added pairwise: the first half (rounded up) and the second, each in turn so.
fn tree<S: Total>(totals: &[S]) -> S {
    match totals {
        [one] => *one,
        _ => {
            let (a, b) = totals.split_at(totals.len().div_ceil(2));
            tree(a).plus(tree(b))
        }
    }
}

/// `Σ f(v)` over `values`: [`LANES`] partial sums over each block of at most [`BLOCK`] values,
/// the blocks' totals added pairwise. Each partial sum adds at most `BLOCK / LANES` terms, so
/// the error stays near that of a pairwise sum, at the speed of a vectorised loop.
#[inline(always)]
pub(super) fn lane_sum<V: Copy, A: Float + AddAssign + Total>(
    values: &[V],
    f: impl Fn(V) -> A + Copy,
) -> A {
    pairwise(values.len(), &mut LaneSum { values, f })
}

/// The blocks of [`lane_sum`].
struct LaneSum<'a, V, F> {
    values: &'a [V],
    f: F,
}

impl<V: Copy, A: Float + AddAssign + Total, F: Fn(V) -> A> Blocks for LaneSum<'_, V, F> {
    type Total = A;

    #[inline(always)]
    fn block(&mut self, range: Range<usize>) -> A {
        let mut lanes = [A::zero(); LANES];
        let mut whole = self.values[range].chunks_exact(LANES);
        for chunk in &mut whole {
            for (l, &v) in lanes.iter_mut().zip(chunk) {
                *l += (self.f)(v);
            }
        }
        for (l, &v) in lanes.iter_mut().zip(whole.remainder()) {
            *l += (self.f)(v);
        }
        fold_lanes(lanes)
    }
}

/// `Σ a·b` over two rows, in the accumulation type, as [`lane_sum`] adds.
#[inline(always)]
fn lane_dot<T: Elem>(a: &[T], b: &[T]) -> T::Acc {
    pairwise(a.len(), &mut LaneDot { a, b })
}

/// The blocks of [`lane_dot`].
struct LaneDot<'a, T> {
    a: &'a [T],
    b: &'a [T],
}

impl<T: Elem> Blocks for LaneDot<'_, T> {
    type Total = T::Acc;

    #[inline(always)]
    fn block(&mut self, range: Range<usize>) -> T::Acc {
        let mut lanes = [T::Acc::zero(); LANES];
        let (a, b) = (&self.a[range.clone()], &self.b[range]);
        let (mut wa, mut wb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
        for (ca, cb) in (&mut wa).zip(&mut wb) {
            for ((l, &x), &y) in lanes.iter_mut().zip(ca).zip(cb) {
                *l += x.up() * y.up();
            }
        }
        for ((l, &x), &y) in lanes.iter_mut().zip(wa.remainder()).zip(wb.remainder()) {
            *l += x.up() * y.up();
        }
        fold_lanes(lanes)
    }
}

/// The sum of the partial sums, pairwise.
#[inline(always)]
fn fold_lanes<A: Float>(l: [A; LANES]) -> A {
    ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]))
}

/// A row's statistics: each value is centred as `(x - shift) - correction` and scaled by
/// `rstd`, the inverse standard deviation (of the root mean square, for RMS normalisation,
/// where both offsets are 0).
#[derive(Clone, Copy)]
struct Stats<A> {
    shift: A,
    correction: A,
    rstd: A,
}

impl<A: Float> Stats<A> {
    /// `x` normalised.
    #[inline(always)]
    fn xhat(&self, x: A) -> A {
        ((x - self.shift) - self.correction) * self.rstd
    }
}

/// Row statistics (see the module docs): the corrected two-pass mean and variance, or
/// (without `remove_mean`) the mean square.
#[inline(always)]
fn stats<T: Elem>(row: &[T], eps: T::Acc, remove_mean: bool) -> Stats<T::Acc> {
    let n = count::<T::Acc>(row.len());
    let zero = T::Acc::zero();
    if !remove_mean {
        let ms = lane_sum(row, |v: T| v.up() * v.up()) / n;
        return Stats {
            shift: zero,
            correction: zero,
            rstd: (ms + eps).sqrt().recip(),
        };
    }
    let shift = lane_sum(row, |v: T| v.up()) / n;
    let total = deviation_sums(row, shift);
    let correction = total.0 / n;
    // Σ(d - c)² = Σd² - n c², never below 0 (up to rounding, clamped).
    let var = (total.1 / n - correction * correction).max(zero);
    Stats {
        shift,
        correction,
        rstd: (var + eps).sqrt().recip(),
    }
}

/// `(Σd, Σd²)` for `d = x - shift` over `row`, in lanes and pairwise as [`lane_sum`] adds.
#[inline(always)]
fn deviation_sums<T: Elem>(row: &[T], shift: T::Acc) -> (T::Acc, T::Acc) {
    pairwise(row.len(), &mut Deviations { row, shift })
}

/// The blocks of [`deviation_sums`].
struct Deviations<'a, T: Elem> {
    row: &'a [T],
    shift: T::Acc,
}

impl<T: Elem> Blocks for Deviations<'_, T> {
    type Total = (T::Acc, T::Acc);

    #[inline(always)]
    fn block(&mut self, range: Range<usize>) -> Self::Total {
        let zero = T::Acc::zero();
        let (mut s, mut s2) = ([zero; LANES], [zero; LANES]);
        let mut add = |j: usize, v: T| {
            let d = v.up() - self.shift;
            s[j] += d;
            s2[j] += d * d;
        };
        let mut whole = self.row[range].chunks_exact(LANES);
        for chunk in &mut whole {
            for (j, &v) in chunk.iter().enumerate() {
                add(j, v);
            }
        }
        for (j, &v) in whole.remainder().iter().enumerate() {
            add(j, v);
        }
        (fold_lanes(s), fold_lanes(s2))
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
    if n == 0 {
        return out;
    }
    let eps = T::acc_from_f32(eps);
    let wide = avx2();
    x.par_chunks(n)
        .zip(out.par_chunks_mut(n))
        .for_each(|(row, dst)| match wide {
            // SAFETY: avx2() checked that the CPU has the instructions.
            #[cfg(target_arch = "x86_64")]
            true => unsafe { norm_row_avx2(row, dst, alpha, beta, eps, remove_mean) },
            _ => norm_row(row, dst, alpha, beta, eps, remove_mean),
        });
    out
}

/// Whether this CPU runs the kernels' AVX2 and FMA builds (the row kernels', the GELU's).
pub(super) fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this CPU runs the kernels' AVX-512 builds (the GELU's, `few_rows`'): AVX-512F with
/// AVX2 and FMA.
pub(super) fn avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx2() && std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// One row of [`norm_fwd`] into `dst`.
#[inline(always)]
fn norm_row<T: Elem>(
    row: &[T],
    dst: &mut [T],
    alpha: &[T],
    beta: Option<&[T]>,
    eps: T::Acc,
    remove_mean: bool,
) {
    let s = stats(row, eps, remove_mean);
    let scaled = dst.iter_mut().zip(row).zip(alpha);
    match beta {
        Some(beta) => {
            for (((d, &v), &a), &b) in scaled.zip(beta) {
                *d = T::down(s.xhat(v.up()) * a.up() + b.up());
            }
        }
        None => {
            for ((d, &v), &a) in scaled {
                *d = T::down(s.xhat(v.up()) * a.up());
            }
        }
    }
}

/// [`norm_row`] compiled for AVX2: eight lanes where the baseline has four. Rust never fuses a
/// multiply and an add by itself, so the numbers are the baseline's.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn norm_row_avx2<T: Elem>(
    row: &[T],
    dst: &mut [T],
    alpha: &[T],
    beta: Option<&[T]>,
    eps: T::Acc,
    remove_mean: bool,
) {
    norm_row(row, dst, alpha, beta, eps, remove_mean)
}

/// The gradients of [`norm_fwd`] given the output's gradient `g`, packed into one vector: the
/// input's gradient (as many values as `x`), then `alpha`'s, then `beta`'s when `with_beta`.
/// With no rows, the gradients of `alpha` and `beta` are zeros.
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
    let eps = T::acc_from_f32(eps);
    let mut packed = vec![T::zero(); x.len() + n * if with_beta { 2 } else { 1 }];
    let (dx, dparams) = packed.split_at_mut(x.len());
    // Each block of rows sums its share of the parameters' gradients; the blocks are then added.
    let block = rows.div_ceil(4 * rayon::current_num_threads()).max(1) * n;
    let zeros = || (vec![T::Acc::zero(); n], vec![T::Acc::zero(); n]);
    let (d_alpha, d_beta) = if n == 0 || rows == 0 {
        zeros()
    } else {
        let wide = avx2();
        x.par_chunks(block)
            .zip(g.par_chunks(block))
            .zip(dx.par_chunks_mut(block))
            .map(|((xs, gs), dxs)| {
                let (mut da, mut db) = zeros();
                let rows = NormRows {
                    alpha,
                    eps,
                    remove_mean,
                };
                match wide {
                    // SAFETY: avx2() checked that the CPU has the instructions.
                    #[cfg(target_arch = "x86_64")]
                    true => unsafe { rows.backward_avx2(xs, gs, dxs, &mut da, &mut db) },
                    _ => rows.backward(xs, gs, dxs, &mut da, &mut db),
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

/// What the backward of a block of rows of [`norm_bwd`] reads besides the rows.
struct NormRows<'a, T: Elem> {
    alpha: &'a [T],
    eps: T::Acc,
    remove_mean: bool,
}

impl<T: Elem> NormRows<'_, T> {
    /// The input gradients `dxs` of the rows `xs` given the output's `gs`, and the rows' parts
    /// of the parameters' gradients added to `da` and `db`.
    #[inline(always)]
    fn backward(&self, xs: &[T], gs: &[T], dxs: &mut [T], da: &mut [T::Acc], db: &mut [T::Acc]) {
        let n = self.alpha.len();
        let n_acc = count::<T::Acc>(n);
        let alpha = self.alpha;
        for ((row, gr), dr) in xs.chunks(n).zip(gs.chunks(n)).zip(dxs.chunks_mut(n)) {
            let s = stats(row, self.eps, self.remove_mean);
            // Σ gy and Σ gy·x̂ in lanes and pairwise, as `lane_sum` adds; the parameters'
            // gradients gather block by block beside them.
            let (sum_gy, sum_gy_xhat) = pairwise(
                n,
                &mut NormGradSums {
                    s,
                    row,
                    g: gr,
                    alpha,
                    da: &mut *da,
                    db: &mut *db,
                },
            );
            let c1 = sum_gy_xhat / n_acc;
            let c2 = if self.remove_mean {
                sum_gy / n_acc
            } else {
                T::Acc::zero()
            };
            for (((d, &x), &g), &a) in dr.iter_mut().zip(row).zip(gr).zip(alpha) {
                let gy = g.up() * a.up();
                *d = T::down(s.rstd * (gy - c2 - s.xhat(x.up()) * c1));
            }
        }
    }

    /// [`NormRows::backward`] compiled for AVX2 (the same numbers, see [`norm_row_avx2`]).
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn backward_avx2(
        &self,
        xs: &[T],
        gs: &[T],
        dxs: &mut [T],
        da: &mut [T::Acc],
        db: &mut [T::Acc],
    ) {
        self.backward(xs, gs, dxs, da, db)
    }
}

/// The blocks of a row's `(Σ gy, Σ gy·x̂)` in [`NormRows::backward`], with `gy = g·alpha`,
/// adding the row's parts of the parameters' gradients (`g·x̂` and `g`) to `da` and `db` in
/// the same block (in a second loop over it).
struct NormGradSums<'a, T: Elem> {
    s: Stats<T::Acc>,
    row: &'a [T],
    g: &'a [T],
    alpha: &'a [T],
    da: &'a mut [T::Acc],
    db: &'a mut [T::Acc],
}

impl<T: Elem> Blocks for NormGradSums<'_, T> {
    type Total = (T::Acc, T::Acc);

    #[inline(always)]
    fn block(&mut self, range: Range<usize>) -> Self::Total {
        let zero = T::Acc::zero();
        let (mut s1, mut s2) = ([zero; LANES], [zero; LANES]);
        let s = self.s;
        let (x, g) = (&self.row[range.clone()], &self.g[range.clone()]);
        let alpha = &self.alpha[range.clone()];
        // The sums first, in lanes, then the parameters' gradients value by value: two plain
        // loops the compiler vectorises (one loop doing both it did not).
        let mut add = |l: usize, x: T, g: T, a: T| {
            let gy = g.up() * a.up();
            s1[l] += gy;
            s2[l] += gy * s.xhat(x.up());
        };
        let (mut xs, mut gs, mut als) = (
            x.chunks_exact(LANES),
            g.chunks_exact(LANES),
            alpha.chunks_exact(LANES),
        );
        for ((x, g), a) in (&mut xs).zip(&mut gs).zip(&mut als) {
            for l in 0..LANES {
                add(l, x[l], g[l], a[l]);
            }
        }
        let rest = xs
            .remainder()
            .iter()
            .zip(gs.remainder())
            .zip(als.remainder());
        for (l, ((&x, &g), &a)) in rest.enumerate() {
            add(l, x, g, a);
        }
        let (da, db) = (&mut self.da[range.clone()], &mut self.db[range]);
        for (((da, db), &x), &g) in da.iter_mut().zip(db.iter_mut()).zip(x).zip(g) {
            let g = g.up();
            *da += g * s.xhat(x.up());
            *db += g;
        }
        (fold_lanes(s1), fold_lanes(s2))
    }
}

/// Softmax of each row of `n` values: the exponentials and their sum in the accumulation type,
/// each output rounded once.
pub(super) fn softmax_fwd<T: Elem>(x: &[T], n: usize) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    if n == 0 {
        return out;
    }
    // Where the element type is the accumulation type (f32, f64), the exponentials go straight
    // into the output; f16 and bf16 keep them in f32 beside it, so that each output is rounded
    // once.
    let exact = std::mem::size_of::<T>() == std::mem::size_of::<T::Acc>();
    x.par_chunks(n).zip(out.par_chunks_mut(n)).for_each_init(
        Vec::new,
        |exps: &mut Vec<T::Acc>, (row, dst)| {
            // NaN is no maximum: a row holding one comes out NaN through its exponential.
            let max = row
                .iter()
                .fold(T::neg_infinity(), |m, &v| if v > m { v } else { m })
                .up();
            if exact {
                for (d, &v) in dst.iter_mut().zip(row) {
                    *d = T::down((v.up() - max).exp());
                }
                let sum = lane_sum(dst, |e: T| e.up());
                for d in dst.iter_mut() {
                    *d = T::down(d.up() / sum);
                }
                return;
            }
            exps.clear();
            exps.extend(row.iter().map(|&v| (v.up() - max).exp()));
            let sum = lane_sum(exps.as_slice(), |e| e);
            for (d, &e) in dst.iter_mut().zip(exps.iter()) {
                *d = T::down(e / sum);
            }
        },
    );
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
            let dot = lane_dot(yr, gr);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The sums as they were before `pairwise`: halving long rows by recursion.
    fn recursive_lane_sum(values: &[f32]) -> f32 {
        if values.len() > BLOCK {
            let half = values.len().div_ceil(2 * BLOCK) * BLOCK;
            return recursive_lane_sum(&values[..half]) + recursive_lane_sum(&values[half..]);
        }
        let mut lanes = [0f32; LANES];
        for (i, &v) in values.iter().enumerate() {
            lanes[i % LANES] += v;
        }
        fold_lanes(lanes)
    }

    /// `pairwise` adds the blocks in the recursion's order, bit for bit, on either side of the
    /// 64 blocks kept on the stack, for whole and partial last blocks.
    #[test]
    fn block_sums_keep_the_recursive_order() {
        let mut rng = crate::rng::Rng::new(7);
        for blocks in 0..=70 {
            for rest in [0, 1, BLOCK - 1] {
                let n = blocks * BLOCK + rest;
                // Values of many magnitudes, so that another order rounds differently.
                let v: Vec<f32> = (0..n)
                    .map(|i| rng.uniform_in(-1.0, 1.0) as f32 * 10f32.powi((i % 7) as i32 - 3))
                    .collect();
                let (ours, before) = (lane_sum(&v, |x: f32| x), recursive_lane_sum(&v));
                assert_eq!(ours.to_bits(), before.to_bits(), "{n} values");
                let dev = deviation_sums(&v, 0.25f32);
                let (d, d2): (Vec<f32>, Vec<f32>) = v
                    .iter()
                    .map(|x| (x - 0.25, (x - 0.25) * (x - 0.25)))
                    .unzip();
                assert_eq!(dev.0.to_bits(), recursive_lane_sum(&d).to_bits(), "{n}: Σd");
                assert_eq!(
                    dev.1.to_bits(),
                    recursive_lane_sum(&d2).to_bits(),
                    "{n}: Σd²"
                );
            }
        }
    }
}
