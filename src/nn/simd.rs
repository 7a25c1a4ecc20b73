//! Two convolution kernels with AVX2 and FMA, for where the CPU has them.
//!
//! - [`dots`]: a matrix product shaped as many long dot products, `dst += a · bᵀ`, where the rows
//!   of `b` may start anywhere in one slice: a convolution's weight gradient (`dY · patchesᵀ`:
//!   a few output channels by a few dozen patch rows, each a dot product over an image's output
//!   positions). The `gemm` crate runs this shape (a small result, a long inner dimension) at a
//!   third of its speed on the forward's; here blocks of 3 rows by 4 columns of the result are
//!   accumulated in eight lanes and summed at the end.
//! - [`shifted_rows`]: `dst[c] = init[c] + Σ_r w[c][r] · x[offset_r..]`, the forward of a
//!   stride-1 convolution straight from the image: with output rows as wide as the input's
//!   (see `conv_relu_pool`), patch row `r` is the image shifted by `offset_r`, so no patches
//!   are laid out; 6 output channels by 16 positions are accumulated at once.
//!
//! Both return `false` without AVX2 and FMA, and the callers then use `gemm` on laid-out
//! patches.

/// `dst (m x n) += a (m x k) · bᵀ`, row `j` of `b` being `b[b_rows[j]..b_rows[j] + k]`, `a` and
/// `dst` row-major and contiguous, when this CPU has AVX2 and FMA; returns whether it did.
pub(super) fn dots(dst: &mut [f32], a: &[f32], b: &[f32], b_rows: &[usize], k: usize) -> bool {
    let n = b_rows.len();
    let m = dst.len().checked_div(n).unwrap_or(0);
    assert!(
        dst.len() == m * n && a.len() == m * k && b_rows.iter().all(|&o| o + k <= b.len()),
        "dots of {}x{k} by ({n}x{k})ᵀ into {} values: a row of b ends past its {} values",
        a.len() / k.max(1),
        dst.len(),
        b.len()
    );
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked), and every row read or written lies within
        // its slice (checked above).
        unsafe { x86::dots(dst, a, b, b_rows, (m, k)) };
        return true;
    }
    false
}

/// `dst[c][q] = init[c] + Σ_r w[c][r] · x[x_rows[r] + q]` for `q < len` and each of the
/// `init.len()` rows `c` of `dst` (rows `ld` apart) and of `w` (`x_rows.len()` values each),
/// the terms added in the order of `r`, when this CPU has AVX2 and FMA; returns whether it did.
pub(super) fn shifted_rows(
    (dst, ld): (&mut [f32], usize),
    w: &[f32],
    init: &[f32],
    x: &[f32],
    x_rows: &[usize],
    len: usize,
) -> bool {
    let (c, r) = (init.len(), x_rows.len());
    assert!(
        ld >= len
            && (c == 0 || dst.len() >= (c - 1) * ld + len)
            && w.len() == c * r
            && x_rows.iter().all(|&o| o + len <= x.len()),
        "shifted_rows: {c} rows of {len} into {} values {ld} apart from {} weights and {} \
         inputs: a row ends past its slice",
        dst.len(),
        w.len(),
        x.len()
    );
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked), and every row read or written lies within
        // its slice (checked above).
        unsafe { x86::shifted_rows((dst, ld), w, init, x, x_rows, len) };
        return true;
    }
    false
}

/// Whether the kernels run here (AVX2 and FMA), so that [`dots`] and [`shifted_rows`] return
/// `true`.
pub(super) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx2_fma()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this CPU has AVX2 and FMA (checked once).
#[cfg(target_arch = "x86_64")]
fn avx2_fma() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// [`super::dots`] with AVX2 and FMA.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; `dst` holds `m x n` values, `a` `m x k`, and every row
    /// of `b` (`b_rows`, `n` of them) `k` values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dots(
        dst: &mut [f32],
        a: &[f32],
        b: &[f32],
        b_rows: &[usize],
        (m, k): (usize, usize),
    ) {
        let n = b_rows.len();
        let mut i = 0;
        while i < m {
            let rows = (m - i).min(3);
            let mut j = 0;
            while j < n {
                let cols = (n - j).min(4);
                let at = (i, j, n, k);
                let br = &b_rows[j..j + cols];
                // SAFETY: rows i..i + rows of a and dst, and the rows br of b, lie within them.
                unsafe {
                    match (rows, cols) {
                        (3, 4) => tile::<3, 4>(dst, a, b, br, at),
                        (3, 3) => tile::<3, 3>(dst, a, b, br, at),
                        (3, 2) => tile::<3, 2>(dst, a, b, br, at),
                        (3, _) => tile::<3, 1>(dst, a, b, br, at),
                        (2, 4) => tile::<2, 4>(dst, a, b, br, at),
                        (2, 3) => tile::<2, 3>(dst, a, b, br, at),
                        (2, 2) => tile::<2, 2>(dst, a, b, br, at),
                        (2, _) => tile::<2, 1>(dst, a, b, br, at),
                        (_, 4) => tile::<1, 4>(dst, a, b, br, at),
                        (_, 3) => tile::<1, 3>(dst, a, b, br, at),
                        (_, 2) => tile::<1, 2>(dst, a, b, br, at),
                        (_, _) => tile::<1, 1>(dst, a, b, br, at),
                    }
                }
                j += cols;
            }
            i += rows;
        }
    }

    /// The sum of a vector's eight lanes.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn lanes_sum(v: __m256) -> f32 {
        let half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
        _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)))
    }

    /// Adds to `dst[i..i + M][j..j + N]` the dot products of rows `i..i + M` of `a` with the
    /// rows of `b` starting at `b_rows` (`N` of them).
    ///
    /// # Safety
    /// AVX2 and FMA; rows `i..i + M` of `a` (`k` values each) and of `dst` (`n` each) lie
    /// within them, and so do the `k` values from each of `b_rows` in `b`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    #[allow(clippy::needless_range_loop)] // acc is indexed by both r and c
    unsafe fn tile<const M: usize, const N: usize>(
        dst: &mut [f32],
        a: &[f32],
        b: &[f32],
        b_rows: &[usize],
        (i, j, n, k): (usize, usize, usize, usize),
    ) {
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); N]; M];
        let whole = k / 8 * 8;
        let mut p = 0;
        while p < whole {
            let mut av = [_mm256_setzero_ps(); M];
            for (r, v) in av.iter_mut().enumerate() {
                // SAFETY: p + 8 <= k within row i + r of a.
                *v = unsafe { _mm256_loadu_ps(pa.add((i + r) * k + p)) };
            }
            for c in 0..N {
                // SAFETY: p + 8 <= k within the row of b at b_rows[c].
                let bv = unsafe { _mm256_loadu_ps(pb.add(b_rows[c] + p)) };
                for r in 0..M {
                    acc[r][c] = _mm256_fmadd_ps(av[r], bv, acc[r][c]);
                }
            }
            p += 8;
        }
        for r in 0..M {
            let ra = &a[(i + r) * k..(i + r + 1) * k];
            for c in 0..N {
                let rb = &b[b_rows[c]..b_rows[c] + k];
                let mut sum = lanes_sum(acc[r][c]);
                for q in whole..k {
                    sum = ra[q].mul_add(rb[q], sum);
                }
                dst[(i + r) * n + j + c] += sum;
            }
        }
    }

    /// [`super::shifted_rows`] with AVX2 and FMA.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA, and the rows lie within their slices as
    /// [`super::shifted_rows`] checks.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn shifted_rows(
        (dst, ld): (&mut [f32], usize),
        w: &[f32],
        init: &[f32],
        x: &[f32],
        x_rows: &[usize],
        len: usize,
    ) {
        let channels = init.len();
        let mut c = 0;
        while c < channels {
            let block = (channels - c).min(6);
            let rows = (&mut *dst, ld, c, len);
            // SAFETY: channels c..c + block of dst, w and init lie within them.
            unsafe {
                match block {
                    6 => channel_block::<6>(rows, w, init, x, x_rows),
                    5 => channel_block::<5>(rows, w, init, x, x_rows),
                    4 => channel_block::<4>(rows, w, init, x, x_rows),
                    3 => channel_block::<3>(rows, w, init, x, x_rows),
                    2 => channel_block::<2>(rows, w, init, x, x_rows),
                    _ => channel_block::<1>(rows, w, init, x, x_rows),
                }
            }
            c += block;
        }
    }

    /// Rows `c..c + C` of [`shifted_rows`]: 16 positions at a time, the last 16 again where
    /// `len` is not a multiple (the same sums, written twice), one at a time below 16.
    ///
    /// # Safety
    /// As [`shifted_rows`], with `c + C <= init.len()`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn channel_block<const C: usize>(
        (dst, ld, c, len): (&mut [f32], usize, usize, usize),
        w: &[f32],
        init: &[f32],
        x: &[f32],
        x_rows: &[usize],
    ) {
        let r_n = x_rows.len();
        let (px, pw, pd) = (x.as_ptr(), w.as_ptr(), dst.as_mut_ptr());
        let chunks = len / 16 + usize::from(len >= 16 && len % 16 != 0);
        for s in 0..chunks {
            let q = (s * 16).min(len - 16);
            let mut acc = [[_mm256_setzero_ps(); 2]; C];
            for (o, a) in acc.iter_mut().enumerate() {
                let v = _mm256_set1_ps(init[c + o]);
                *a = [v, v];
            }
            for (r, &off) in x_rows.iter().enumerate() {
                // SAFETY: off + q + 16 <= off + len, within x.
                let (x0, x1) = unsafe {
                    (
                        _mm256_loadu_ps(px.add(off + q)),
                        _mm256_loadu_ps(px.add(off + q + 8)),
                    )
                };
                for (o, a) in acc.iter_mut().enumerate() {
                    // SAFETY: (c + o) * r_n + r < w.len().
                    let wv = unsafe { _mm256_broadcast_ss(&*pw.add((c + o) * r_n + r)) };
                    a[0] = _mm256_fmadd_ps(wv, x0, a[0]);
                    a[1] = _mm256_fmadd_ps(wv, x1, a[1]);
                }
            }
            for (o, a) in acc.iter().enumerate() {
                // SAFETY: (c + o) * ld + q + 16 <= (c + o) * ld + len, within dst.
                unsafe {
                    _mm256_storeu_ps(pd.add((c + o) * ld + q), a[0]);
                    _mm256_storeu_ps(pd.add((c + o) * ld + q + 8), a[1]);
                }
            }
        }
        if len < 16 {
            for o in 0..C {
                let wc = &w[(c + o) * r_n..(c + o + 1) * r_n];
                for q in 0..len {
                    let mut sum = init[c + o];
                    for (&wr, &off) in wc.iter().zip(x_rows) {
                        sum = wr.mul_add(x[off + q], sum);
                    }
                    dst[(c + o) * ld + q] = sum;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * seed) % 23) as f32 / 11.0 - 1.0)
            .collect()
    }

    #[test]
    fn dots_are_the_naive_products_for_every_tile_and_remainder() {
        let shapes = [
            (6, 75, 784),
            (16, 150, 100),
            (1, 1, 1),
            (5, 7, 13),
            (4, 5, 8),
            (2, 9, 0),
        ];
        for (m, n, k) in shapes {
            let a = values(m * k, 7919);
            let b = values(n * k + 5, 104729);
            // Rows of b that overlap and start anywhere.
            let b_rows: Vec<usize> = (0..n)
                .map(|j| (j * 3 + j % 2) % (n * k + 5 - k + 1))
                .collect();
            let mut dst: Vec<f32> = (0..m * n).map(|i| i as f32).collect();
            if !dots(&mut dst, &a, &b, &b_rows, k) {
                return; // no AVX2 here: the callers use gemm
            }
            for r in 0..m {
                for c in 0..n {
                    let dot: f64 = (0..k)
                        .map(|q| a[r * k + q] as f64 * b[b_rows[c] + q] as f64)
                        .sum();
                    let want = (r * n + c) as f64 + dot;
                    let got = dst[r * n + c] as f64;
                    let tolerance = 1e-5 * want.abs().max(1.0);
                    assert!(
                        (got - want).abs() <= tolerance,
                        "{m}x{n}x{k} at {r},{c}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn shifted_rows_are_the_naive_sums_for_every_block_and_length() {
        for (channels, rows, len) in [
            (6, 75, 892),
            (16, 150, 136),
            (7, 4, 15),
            (3, 2, 16),
            (1, 5, 33),
        ] {
            let x = values(len + 3 * rows + 7, 31);
            let x_rows: Vec<usize> = (0..rows).map(|r| (r * 3) % (3 * rows + 7)).collect();
            let w = values(channels * rows, 17);
            let init = values(channels, 5);
            let ld = len + 3;
            let mut dst = vec![f32::NAN; channels * ld];
            if !shifted_rows((&mut dst, ld), &w, &init, &x, &x_rows, len) {
                return;
            }
            for c in 0..channels {
                for q in 0..len {
                    let want: f64 = init[c] as f64
                        + (0..rows)
                            .map(|r| w[c * rows + r] as f64 * x[x_rows[r] + q] as f64)
                            .sum::<f64>();
                    let got = dst[c * ld + q] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                        "{c},{q}: {got} vs {want}"
                    );
                }
                // Nothing written between rows.
                assert!(dst[c * ld + len..(c + 1) * ld].iter().all(|v| v.is_nan()));
            }
        }
    }
}
