//! Products of few rows by a weight seen transposed, `dst (+)= a · wᵀ`: a linear layer's
//! forward at a small batch, with AVX-512.
//!
//! `gemm` packs `wᵀ` (the columns of a row-major weight) for every product by strided copies,
//! and with few rows of `a` that packing costs as much as the arithmetic: a 64 x 4096 x 4096
//! product took 30-42 ms on one core (52-71 GFLOPS, by blocks of 128 columns as
//! [`matmul_threaded`] ran it) against PyTorch's 23 ms. Here each block of the weight, 32 of its
//! rows by 256 of `k`, is transposed in registers (16 x 16 at a time) into a panel of 256 steps
//! of 32 values, which a kernel of 12 rows of `a` by 32 columns walks with broadcasts and
//! FMAs, its 24 sums in registers; `a` is first copied into panels of 12 rows, the 12 values
//! of each step side by side. The same product took 21-32 ms (67-100 GFLOPS, 1.3-1.5× less
//! time than `gemm` in the same runs), 16 rows 2.1-2.4× less, 128 rows 1.07-1.13×; at 256 rows
//! `gemm` is as fast. Between 97 and 128 rows `gemm` is faster on small weights (128 x 120 x
//! 400: 2.5× less time than ours, 128 x 256 x 256: 1.25×; 512 x 512 and larger 1.08-1.24×
//! more), and at one or two rows, where it takes a matrix-vector path that reads the weight
//! once without packing it (1.5-4.5× less time than ours); from 3 to 96 rows ours took 1.1-10×
//! less time on every shape tried: see [`takes`].
//!
//! `nn`'s linear layers call it for a forward of fewer rows than the layer has outputs (and not
//! on AMX tiles, under [`MatmulPrecision::Medium`](super::MatmulPrecision::Medium)), before
//! [`matmul_threaded`] (`gemm` by blocks of columns), which takes what it declines.
//!
//! The columns are split over candle's threads in groups of 32, one run of neighbouring groups
//! per thread ([`run_columns`]). Each value of `dst` is the sum over `k` in blocks of 256, each
//! block's terms in order, added to `dst` block by block: the same sums whatever the threads.
//!
//! [`matmul_threaded`]: super::kernels::matmul_threaded

use super::kernels::{assert_shapes_agree, Mat};
#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
use super::kernels::{each_run, threads, ColumnsOut};
use std::ops::Range;

/// The fewest rows of `a` (and of `dst`) taken here.
const MIN_ROWS: usize = 3;
/// The most rows taken here, for a weight of at least
/// [`LARGE_WEIGHT`] values.
const MAX_ROWS: usize = 128;
/// The most rows taken here for any weight.
const ANY_WEIGHT_ROWS: usize = 96;
/// Values of a weight (`n x k`) large enough for [`MAX_ROWS`] rows: 512 x 512.
const LARGE_WEIGHT: usize = 1 << 18;

/// Whether a product of `m` rows by a weight of `n` rows of `k` is faster here than in `gemm`.
fn takes(m: usize, n: usize, k: usize) -> bool {
    m >= MIN_ROWS && (m <= ANY_WEIGHT_ROWS || (m <= MAX_ROWS && n * k >= LARGE_WEIGHT))
}

/// Columns of `dst` per group: the kernel's width.
const GROUP: usize = 32;

/// The columns of `n` that run `r` of `runs` computes: its share of the `n.div_ceil(GROUP)`
/// groups of [`GROUP`] columns, neighbours, the runs in order and together covering `0..n`
/// (`runs` at most the groups).
#[cfg_attr(
    not(all(target_arch = "x86_64", avx512_intrinsics)),
    allow(dead_code) // the kernel's only
)]
fn run_columns(r: usize, runs: usize, n: usize) -> Range<usize> {
    let groups = n.div_ceil(GROUP);
    (r * groups / runs * GROUP).min(n)..((r + 1) * groups / runs * GROUP).min(n)
}

/// `dst = a · b`, or `dst += a · b` when `accumulate`, where `a` is row-major with few rows
/// ([`takes`]), `b` is a row-major matrix seen transposed ([`Mat::transposed`]: a
/// weight in a linear layer's forward), `dst` is row-major, and the CPU has AVX-512; returns
/// whether it did (else nothing was written, and [`matmul_threaded`] is the way). The shapes
/// must agree ([`assert_shapes_agree`] panics otherwise).
pub(super) fn product(
    dst: &mut Mat<&mut [f32]>,
    a: &Mat<&[f32]>,
    b: &Mat<&[f32]>,
    accumulate: bool,
) -> bool {
    assert_shapes_agree(dst, a, b);
    let (m, n, k) = (dst.rows, dst.cols, a.cols);
    if m == 0 || n == 0 || k == 0 || !takes(m, n, k) || a.cs != 1 || b.rs != 1 || dst.cs != 1 {
        return false;
    }
    let (Ok(ars), Ok(ws), Ok(ds)) = (
        usize::try_from(a.rs),
        usize::try_from(b.cs),
        usize::try_from(dst.rs),
    ) else {
        return false;
    };
    // Rows of dst that overlap would have two runs write one value.
    if m > 1 && ds < n {
        return false;
    }
    assert!(
        (m - 1) * ars + k <= a.ptr.len()
            && (n - 1) * ws + k <= b.ptr.len()
            && (m - 1) * ds + n <= dst.ptr.len(),
        "few_rows::product: a {m}x{k} (rows {ars} apart, {} values), a weight of {n} rows \
         ({ws} apart, {} values) or a {m}x{n} result (rows {ds} apart, {} values) past its slice",
        a.ptr.len(),
        b.ptr.len(),
        dst.ptr.len()
    );
    #[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
    if super::rows::avx512() {
        let panels = x86::panels(a.ptr, ars, m, k);
        let runs = threads().min(n.div_ceil(GROUP));
        let out = ColumnsOut(dst.ptr.as_mut_ptr());
        let (out, panels, w) = (&out, &panels, b.ptr);
        let run = |r: usize| {
            let columns = run_columns(r, runs, n);
            // SAFETY: the CPU has AVX-512F; the weight's rows and dst's rows lie within their
            // slices (checked above), and so do the panels of a (built for m rows of k);
            // dst's rows do not overlap, so the runs' columns are disjoint, and dst is
            // borrowed mutably, so it aliases neither input.
            unsafe {
                x86::columns(
                    (out.0, ds),
                    panels,
                    (w.as_ptr(), ws),
                    (m, k),
                    columns,
                    accumulate,
                )
            }
        };
        each_run(runs, run);
        return true;
    }
    let _ = (ars, ws, ds, accumulate);
    false
}

#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
#[clippy::msrv = "1.89"]
mod x86 {
    use super::super::simd::x86_512::transpose;
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// Rows of `a` per panel, and of the kernel: 12 x 2 sums in registers.
    const MR: usize = 12;
    /// Columns of `dst` per block: two vectors.
    const NR: usize = super::GROUP;
    /// Steps of `k` per block of the weight: a packed block of 32 KiB which, with a panel's
    /// 12 KiB, fits the 48 KiB L1 of the Xeon measured (older AVX-512 cores have 32 KiB).
    const KC: usize = 256;

    /// `a`'s `m` rows (each `k` values, `rs` apart) in panels of [`MR`] rows: row `r` of panel
    /// `p` at step `s` is at `(p * k + s) * MR + r`; a last partial panel's missing rows are
    /// zeros.
    pub(super) fn panels(a: &[f32], rs: usize, m: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0f32; m.div_ceil(MR) * k * MR];
        for (p, panel) in out.chunks_exact_mut(k * MR).enumerate() {
            let rows = MR.min(m - p * MR);
            for (s, step) in panel.chunks_exact_mut(MR).enumerate() {
                for (r, v) in step[..rows].iter_mut().enumerate() {
                    *v = a[(p * MR + r) * rs + s];
                }
            }
        }
        out
    }

    /// Columns `columns` of `dst (m x n) (+)= a · wᵀ` from `a`'s [`panels`], in blocks of
    /// [`NR`] columns by [`KC`] steps.
    ///
    /// # Safety
    /// AVX-512F; `dst` holds `m` rows `ds` apart reaching every column of `columns`, and
    /// nothing else uses those columns meanwhile; the weight holds rows `columns` of `k`
    /// values, `ws` apart; `panels` is `a`'s, of `m` rows of `k`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn columns(
        (dst, ds): (*mut f32, usize),
        panels: &[f32],
        (w, ws): (*const f32, usize),
        (m, k): (usize, usize),
        columns: Range<usize>,
        accumulate: bool,
    ) {
        let mut packed = vec![0f32; KC * NR];
        let mut j0 = columns.start;
        while j0 < columns.end {
            let cols = (columns.end - j0).min(NR);
            let mut p0 = 0;
            while p0 < k {
                let depth = (k - p0).min(KC);
                // SAFETY (all below): rows j0..j0 + cols of the weight, steps p0..p0 + depth,
                // lie within it, as the caller vouches; `packed` holds KC steps of NR.
                unsafe { pack(w.add(j0 * ws + p0), ws, cols, depth, packed.as_mut_ptr()) };
                let add = accumulate || p0 > 0;
                let mut i0 = 0;
                while i0 < m {
                    let rows = (m - i0).min(MR);
                    // Panel i0 / MR starts at (i0 / MR) * k * MR = i0 * k.
                    let from = panels[(i0 * k + p0 * MR)..].as_ptr();
                    let to = (unsafe { dst.add(i0 * ds + j0) }, ds, cols, add);
                    let wp = packed.as_ptr();
                    unsafe {
                        match rows {
                            12 => kernel::<12>(from, wp, depth, to),
                            11 => kernel::<11>(from, wp, depth, to),
                            10 => kernel::<10>(from, wp, depth, to),
                            9 => kernel::<9>(from, wp, depth, to),
                            8 => kernel::<8>(from, wp, depth, to),
                            7 => kernel::<7>(from, wp, depth, to),
                            6 => kernel::<6>(from, wp, depth, to),
                            5 => kernel::<5>(from, wp, depth, to),
                            4 => kernel::<4>(from, wp, depth, to),
                            3 => kernel::<3>(from, wp, depth, to),
                            2 => kernel::<2>(from, wp, depth, to),
                            _ => kernel::<1>(from, wp, depth, to),
                        }
                    }
                    i0 += MR;
                }
                p0 += KC;
            }
            j0 += NR;
        }
    }

    /// Lane masks for the first `cols` of [`NR`] columns: the first vector's, the second's.
    #[target_feature(enable = "avx512f")]
    fn masks(cols: usize) -> (__mmask16, __mmask16) {
        let lanes = |c: usize| -> __mmask16 {
            match c {
                0 => 0,
                c if c >= 16 => 0xffff,
                c => (1u16 << c) - 1,
            }
        };
        (lanes(cols), lanes(cols.saturating_sub(16)))
    }

    /// Packs `cols` rows of the weight (from `w`, `ws` apart) by `depth` steps into `packed`:
    /// step `s`, column `c` at `s * NR + c`; the lanes of missing columns are left as they
    /// were (the kernel's masked stores never write them).
    ///
    /// # Safety
    /// AVX-512F; `depth` values from each of the `cols` rows are readable; `packed` holds
    /// `depth * NR` values.
    #[target_feature(enable = "avx512f")]
    unsafe fn pack(w: *const f32, ws: usize, cols: usize, depth: usize, packed: *mut f32) {
        for g in 0..cols.div_ceil(16) {
            let mut s = 0;
            while s < depth {
                let len = (depth - s).min(16);
                let (mask, _) = masks(len);
                let mut rows = [_mm512_setzero_ps(); 16];
                for (r, row) in rows.iter_mut().enumerate().take(cols - 16 * g) {
                    // SAFETY: the masked lanes s..s + len of row 16 g + r lie within it.
                    *row = unsafe { _mm512_maskz_loadu_ps(mask, w.add((16 * g + r) * ws + s)) };
                }
                transpose(&mut rows);
                for (q, column) in rows.iter().take(len).enumerate() {
                    // SAFETY: step s + q < depth of packed.
                    unsafe { _mm512_storeu_ps(packed.add((s + q) * NR + 16 * g), *column) };
                }
                s += 16;
            }
        }
    }

    /// `dst` (+)= `M` rows of a panel by the packed block, `depth` steps: `M x 2` sums of 16
    /// lanes, a broadcast of each row's value and an FMA per vector and step.
    ///
    /// # Safety
    /// AVX-512F; `from` starts a panel's step of `M` rows, [`MR`] apart per step, for `depth`
    /// steps; `packed` holds `depth` steps of [`NR`]; `dst` holds `M` rows `ds` apart of
    /// `cols` (at most `NR`) values; `add` says whether to add to them.
    #[target_feature(enable = "avx512f")]
    #[inline]
    #[allow(clippy::needless_range_loop)] // sums is indexed by row and vector
    unsafe fn kernel<const M: usize>(
        from: *const f32,
        packed: *const f32,
        depth: usize,
        (dst, ds, cols, add): (*mut f32, usize, usize, bool),
    ) {
        let mut sums = [[_mm512_setzero_ps(); 2]; M];
        for s in 0..depth {
            // SAFETY (all below): within the panel, the block and dst, as the caller vouches.
            let (b0, b1) = unsafe {
                (
                    _mm512_loadu_ps(packed.add(s * NR)),
                    _mm512_loadu_ps(packed.add(s * NR + 16)),
                )
            };
            for r in 0..M {
                let x = _mm512_set1_ps(unsafe { *from.add(s * MR + r) });
                sums[r][0] = _mm512_fmadd_ps(x, b0, sums[r][0]);
                sums[r][1] = _mm512_fmadd_ps(x, b1, sums[r][1]);
            }
        }
        let (m0, m1) = masks(cols);
        for r in 0..M {
            let row = unsafe { dst.add(r * ds) };
            // Past the row's end where it has 16 columns or fewer (then no lane is touched):
            // hence wrapping, not `add`, whose result must lie within the allocation.
            let second = row.wrapping_add(16);
            let [mut s0, mut s1] = sums[r];
            if add {
                s0 = _mm512_add_ps(s0, unsafe { _mm512_maskz_loadu_ps(m0, row) });
                s1 = _mm512_add_ps(s1, unsafe { _mm512_maskz_loadu_ps(m1, second) });
            }
            unsafe {
                _mm512_mask_storeu_ps(row, m0, s0);
                _mm512_mask_storeu_ps(second, m1, s1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::kernels::test_values as values;
    use super::*;

    /// Whether this CPU runs the kernel: without AVX-512 `product` must decline.
    fn runs_here() -> bool {
        cfg!(all(target_arch = "x86_64", avx512_intrinsics)) && super::super::rows::avx512()
    }

    /// A product on strided views: `a` (`m x k`, rows `k + 3` apart), the weight (`n` rows of
    /// `k`, `k + 5` apart), `dst` (`m x n`, rows `n + 2` apart, filled with `init`); returns
    /// whether `product` took it and `dst`'s whole slice.
    fn strided(
        (m, n, k): (usize, usize, usize),
        a: &[f32],
        w: &[f32],
        init: &[f32],
        accumulate: bool,
    ) -> (bool, Vec<f32>) {
        let (ars, ws, ds) = (k + 3, k + 5, n + 2);
        let mut dst = init.to_vec();
        let took = {
            let mut d = Mat::strided_rows(&mut dst, m, n, ds);
            let av = Mat::strided(a, m, k, ars, 1);
            let bv = Mat::strided(w, k, n, 1, ws);
            product(&mut d, &av, &bv, accumulate)
        };
        (took, dst)
    }

    #[test]
    fn products_equal_f64_sums_on_odd_shapes_and_strides() {
        let shapes = [
            (3, 1, 1),
            (4, 40, 17),
            (5, 33, 16),
            (14, 17, 300),
            (19, 33, 20),
            (21, 5, 33),
            (22, 64, 64),
            (23, 70, 40),
            (12, 32, 256),
            (13, 31, 257),
            (27, 100, 600),
            (64, 65, 15),
            (96, 300, 513),
            (128, 520, 513),
        ];
        for (case, &(m, n, k)) in shapes.iter().enumerate() {
            let (ars, ws, ds) = (k + 3, k + 5, n + 2);
            let a = values((m - 1) * ars + k, 3 * case as u32);
            let w = values((n - 1) * ws + k, 3 * case as u32 + 1);
            let init = values((m - 1) * ds + n + 1, 3 * case as u32 + 2);
            for accumulate in [false, true] {
                let (took, got) = strided((m, n, k), &a, &w, &init, accumulate);
                assert_eq!(took, runs_here(), "{m}x{n}x{k}");
                if !took {
                    assert_eq!(got, init, "declined, yet wrote");
                    continue;
                }
                for (at, (&g, &before)) in got.iter().zip(&init).enumerate() {
                    let (i, j) = (at / ds, at % ds);
                    if i >= m || j >= n {
                        assert_eq!(g, before, "{m}x{n}x{k}: value {at} outside dst written");
                        continue;
                    }
                    let terms = (0..k).map(|p| a[i * ars + p] as f64 * w[j * ws + p] as f64);
                    let start = if accumulate { before as f64 } else { 0.0 };
                    let (sum, size) =
                        terms.fold((start, start.abs()), |(s, z), t| (s + t, z + t.abs()));
                    assert!(
                        (g as f64 - sum).abs() <= 1e-6 * size + 1e-30,
                        "{m}x{n}x{k} accumulate {accumulate}: ({i}, {j}) is {g}, not {sum}"
                    );
                }
            }
        }
    }

    #[test]
    #[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
    fn the_runs_of_columns_do_not_change_the_sums() {
        if runs_here() {
            let (m, n, k) = (20, 150, 700);
            let (a, w) = (values(m * k, 7), values(n * k, 8));
            let panels = x86::panels(&a, k, m, k);
            let whole = |splits: &[usize]| {
                let mut dst = vec![0f32; m * n];
                for pair in splits.windows(2) {
                    // SAFETY: AVX-512 (runs_here); a 20 x 150 dst, 150 weight rows of 700
                    // and a's panels of 20 rows of 700.
                    unsafe {
                        x86::columns(
                            (dst.as_mut_ptr(), n),
                            &panels,
                            (w.as_ptr(), k),
                            (m, k),
                            pair[0]..pair[1],
                            false,
                        )
                    }
                }
                dst
            };
            let one = whole(&[0, n]);
            for splits in [&[0, 32, 96, n][..], &[0, 64, 128, n], &[0, 128, n]] {
                assert_eq!(whole(splits), one, "columns split at {splits:?}");
            }
        }
    }

    #[test]
    fn many_rows_and_other_layouts_are_left_to_gemm() {
        let (n, k) = (40, 20);
        let w = values(n * k, 1);
        for (m, a_cs, b_row_major) in [
            (MAX_ROWS + 1, 1, false),
            (ANY_WEIGHT_ROWS + 1, 1, false),
            (MIN_ROWS - 1, 1, false),
            (1, 1, false),
            (4, 1, true),
            (4, 2, false),
        ] {
            let a = values(m * k * a_cs, 2);
            let mut dst = vec![0.5f32; m * n];
            let mut d = Mat::rows(&mut dst, n);
            let av = Mat::strided(&a, m, k, k * a_cs, a_cs);
            let bv = if b_row_major {
                Mat::strided(&w[..k * n], k, n, n, 1)
            } else {
                Mat::transposed(&w, k)
            };
            assert!(!product(&mut d, &av, &bv, true), "{m} rows, a_cs {a_cs}");
            assert!(dst.iter().all(|&v| v == 0.5));
        }
    }

    #[test]
    fn a_nan_in_a_row_of_a_spoils_that_row_alone() {
        if !runs_here() {
            return;
        }
        let (m, n, k) = (6, 40, 30);
        let mut a = values(m * k, 4);
        a[2 * k + 7] = f32::NAN;
        let w = values(n * k, 5);
        let mut dst = vec![0f32; m * n];
        assert!(product(
            &mut Mat::rows(&mut dst, n),
            &Mat::rows_of(&a, k),
            &Mat::transposed(&w, k),
            false
        ));
        for (i, row) in dst.chunks(n).enumerate() {
            assert!(
                row.iter().all(|v| v.is_nan() == (i == 2)),
                "row {i}: {row:?}"
            );
        }
    }

    #[test]
    fn the_runs_of_columns_cover_every_column_once_in_whole_groups() {
        for n in [1usize, 31, 32, 33, 64, 100, 257, 1000, 4096] {
            for threads in 1..=17 {
                let runs = threads.min(n.div_ceil(GROUP));
                let mut next = 0;
                for r in 0..runs {
                    let columns = run_columns(r, runs, n);
                    assert_eq!(
                        columns.start, next,
                        "n {n}, {runs} runs: run {r} starts off"
                    );
                    assert!(!columns.is_empty(), "n {n}, {runs} runs: run {r} is empty");
                    assert!(
                        columns.start.is_multiple_of(GROUP),
                        "n {n}: run {r} splits a group"
                    );
                    next = columns.end;
                }
                assert_eq!(next, n, "n {n}, {runs} runs: the runs end short");
            }
        }
    }

    #[test]
    fn overlapping_rows_of_dst_are_left_to_gemm() {
        let (m, n, k) = (4, 40, 20);
        let (a, w) = (values(m * k, 1), values(n * k, 2));
        let mut dst = vec![0.5f32; (m - 1) * 10 + n];
        let mut d = Mat {
            ptr: &mut dst[..],
            rows: m,
            cols: n,
            rs: 10,
            cs: 1,
        };
        assert!(!product(
            &mut d,
            &Mat::rows_of(&a, k),
            &Mat::transposed(&w, k),
            false
        ));
        assert!(dst.iter().all(|&v| v == 0.5));
    }
}
