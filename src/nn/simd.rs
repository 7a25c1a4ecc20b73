//! A matrix product shaped as many long dot products, with AVX2 and FMA where the CPU has them:
//! the weight gradient of a convolution (`dY · patchesᵀ`: a few output channels by a few dozen
//! patch rows, each a dot product over every output position of an image).
//!
//! The `gemm` crate handles this shape (a small result, a long inner dimension) at a third of the
//! speed it reaches on the forward's shape, so it gets a kernel of its own: blocks of 3 rows by 4
//! columns of the result, each accumulated in eight lanes over the inner dimension, summed at
//! the end. Without AVX2 and FMA, [`dots`] returns `false` and the caller uses `gemm`.

/// `dst (m x n) += a (m x k) · bᵀ`, with `b` `n x k`, all row-major and contiguous, when this
/// CPU has AVX2 and FMA; returns whether it did.
pub(super) fn dots(
    dst: &mut [f32],
    a: &[f32],
    b: &[f32],
    (m, n, k): (usize, usize, usize),
) -> bool {
    assert!(
        dst.len() == m * n && a.len() == m * k && b.len() == n * k,
        "dots of {m}x{k} by ({n}x{k})ᵀ into {} values, from {} and {}",
        dst.len(),
        a.len(),
        b.len()
    );
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked), and the slices hold the values the kernel
        // reads and writes (checked above).
        unsafe { x86::dots(dst, a, b, (m, n, k)) };
        return true;
    }
    false
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
    /// The CPU must have AVX2 and FMA, and the slices their `m x n`, `m x k` and `n x k` values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dots(
        dst: &mut [f32],
        a: &[f32],
        b: &[f32],
        (m, n, k): (usize, usize, usize),
    ) {
        let mut i = 0;
        while i < m {
            let rows = (m - i).min(3);
            let mut j = 0;
            while j < n {
                let cols = (n - j).min(4);
                let at = (i, j, n, k);
                // SAFETY: rows and columns lie within the matrices (i + rows <= m, j + cols <= n).
                unsafe {
                    match (rows, cols) {
                        (3, 4) => tile::<3, 4>(dst, a, b, at),
                        (3, 3) => tile::<3, 3>(dst, a, b, at),
                        (3, 2) => tile::<3, 2>(dst, a, b, at),
                        (3, _) => tile::<3, 1>(dst, a, b, at),
                        (2, 4) => tile::<2, 4>(dst, a, b, at),
                        (2, 3) => tile::<2, 3>(dst, a, b, at),
                        (2, 2) => tile::<2, 2>(dst, a, b, at),
                        (2, _) => tile::<2, 1>(dst, a, b, at),
                        (_, 4) => tile::<1, 4>(dst, a, b, at),
                        (_, 3) => tile::<1, 3>(dst, a, b, at),
                        (_, 2) => tile::<1, 2>(dst, a, b, at),
                        (_, _) => tile::<1, 1>(dst, a, b, at),
                    }
                }
                j += cols;
            }
            i += rows;
        }
    }

    /// Adds to `dst[i..i + M][j..j + N]` the dot products of rows `i..i + M` of `a` with rows
    /// `j..j + N` of `b`.
    ///
    /// # Safety
    /// AVX2 and FMA; `i + M <= m`, `j + N <= n` for slices of `m x n`, `m x k`, `n x k` values.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    #[allow(clippy::needless_range_loop)] // acc is indexed by both r and c
    unsafe fn tile<const M: usize, const N: usize>(
        dst: &mut [f32],
        a: &[f32],
        b: &[f32],
        (i, j, n, k): (usize, usize, usize, usize),
    ) {
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); N]; M];
        let whole = k / 8 * 8;
        let mut p = 0;
        while p < whole {
            let mut av = [_mm256_setzero_ps(); M];
            for (r, v) in av.iter_mut().enumerate() {
                // SAFETY: p + 8 <= k within row i + r < m of a.
                *v = unsafe { _mm256_loadu_ps(pa.add((i + r) * k + p)) };
            }
            for c in 0..N {
                // SAFETY: p + 8 <= k within row j + c < n of b.
                let bv = unsafe { _mm256_loadu_ps(pb.add((j + c) * k + p)) };
                for r in 0..M {
                    acc[r][c] = _mm256_fmadd_ps(av[r], bv, acc[r][c]);
                }
            }
            p += 8;
        }
        for r in 0..M {
            for c in 0..N {
                let v = acc[r][c];
                let half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                let pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
                let one = _mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1));
                let mut sum = _mm_cvtss_f32(one);
                let (ra, rb) = (
                    &a[(i + r) * k..(i + r + 1) * k],
                    &b[(j + c) * k..(j + c + 1) * k],
                );
                for q in whole..k {
                    sum = ra[q].mul_add(rb[q], sum);
                }
                dst[(i + r) * n + j + c] += sum;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dots_are_the_naive_products_for_every_tile_and_remainder() {
        for (m, n, k) in [
            (6, 75, 784),
            (16, 150, 100),
            (1, 1, 1),
            (5, 7, 13),
            (4, 5, 8),
            (2, 9, 0),
        ] {
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7919) % 23) as f32 / 11.0 - 1.0)
                .collect();
            let b: Vec<f32> = (0..n * k)
                .map(|i| ((i * 104729) % 31) as f32 / 15.0 - 1.0)
                .collect();
            let mut dst: Vec<f32> = (0..m * n).map(|i| i as f32).collect();
            if !dots(&mut dst, &a, &b, (m, n, k)) {
                return; // no AVX2 here: the callers use gemm
            }
            for r in 0..m {
                for c in 0..n {
                    let want: f64 = (r * n + c) as f64
                        + (0..k)
                            .map(|q| a[r * k + q] as f64 * b[c * k + q] as f64)
                            .sum::<f64>();
                    let got = dst[r * n + c] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                        "{m}x{n}x{k} at {r},{c}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
