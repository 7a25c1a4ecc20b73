//! Two convolution kernels with AVX-512 or AVX2 and FMA, for where the CPU has them.
//!
//! - [`dots`]: a matrix product shaped as many long dot products, `dst += a · bᵀ`, where the rows
//!   of `b` may start anywhere in one slice: a convolution's weight gradient (`dY · patchesᵀ`:
//!   a few output channels by a few dozen patch rows, each a dot product over an image's output
//!   positions). The `gemm` crate runs this shape (a small result, a long inner dimension) at a
//!   third of its speed on the forward's; here blocks of 3 rows by 4 columns of the result (6
//!   by 4 with AVX-512) are accumulated in vector lanes and summed at the end.
//! - [`shifted_rows`]: `dst[c] = init[c] + Σ_r w[c][r] · x[offset_r..]`, the forward of a
//!   stride-1 convolution straight from the image: with output rows as wide as the input's
//!   (see `conv_relu_pool`), patch row `r` is the image shifted by `offset_r`, so no patches
//!   are laid out; 6 output channels by 16 positions are accumulated at once.
//!
//! With AVX-512 (Rust 1.89's intrinsics, see build.rs) the blocks run in sixteen lanes, the dot products'
//! remainders in masked lanes, the forward 8 channels by 48 positions: measured per image of
//! the Net, the forward 7.5 -> 4.7 us (conv1) and 6.4 -> 4.1 us (conv2), the weight gradient
//! 8.3 -> 7.5 us (conv1). Both return `false` without AVX2 and FMA, and the callers then use
//! `gemm` on laid-out patches. The sums' order differs between the paths, within rounding.

/// `dst (m x n) += a (m x k) · bᵀ`, row `j` of `b` being `b[b_rows[j]..b_rows[j] + k]`, `a` and
/// `dst` row-major and contiguous, when this CPU has AVX-512 or AVX2 and FMA; returns whether
/// it did.
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
    dots_with(isa(), dst, a, b, b_rows, (m, k))
}

/// [`dots`] with the instructions of `isa`, which this CPU has.
fn dots_with(
    isa: Isa,
    dst: &mut [f32],
    a: &[f32],
    b: &[f32],
    b_rows: &[usize],
    (m, k): (usize, usize),
) -> bool {
    match isa {
        // SAFETY: the CPU has the instructions (isa() found them), and every row read or
        // written lies within its slice (checked by dots).
        #[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
        Isa::Avx512 => {
            unsafe { x86_512::dots(dst, a, b, b_rows, (m, k)) };
            true
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            unsafe { x86::dots(dst, a, b, b_rows, (m, k)) };
            true
        }
        Isa::None => false,
    }
}

/// `dst[c][q] = init[c] + Σ_r w[c][r] · x[x_rows[r] + q]` for `q < len` and each of the
/// `init.len()` rows `c` of `dst` (rows `ld` apart) and of `w` (`x_rows.len()` values each),
/// the terms added in the order of `r`, when this CPU has AVX-512 or AVX2 and FMA; returns
/// whether it did.
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
    shifted_rows_with(isa(), (dst, ld), w, init, x, x_rows, len)
}

/// [`shifted_rows`] with the instructions of `isa`, which this CPU has.
fn shifted_rows_with(
    isa: Isa,
    (dst, ld): (&mut [f32], usize),
    w: &[f32],
    init: &[f32],
    x: &[f32],
    x_rows: &[usize],
    len: usize,
) -> bool {
    match isa {
        // SAFETY: the CPU has the instructions (isa() found them), and every row read or
        // written lies within its slice (checked by shifted_rows).
        #[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
        Isa::Avx512 => {
            unsafe { x86_512::shifted_rows((dst, ld), w, init, x, x_rows, len) };
            true
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            unsafe { x86::shifted_rows((dst, ld), w, init, x, x_rows, len) };
            true
        }
        Isa::None => false,
    }
}

/// Whether the kernels run here (AVX-512 or AVX2, and FMA), so that [`dots`] and [`shifted_rows`] return
/// `true`.
pub(super) fn available() -> bool {
    isa() != Isa::None
}

/// The vector instructions the kernels use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    #[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    None,
}

/// The instructions of this CPU that the kernels use, best first.
fn isas() -> Vec<Isa> {
    #[allow(unused_mut)] // nothing to add off x86-64
    let mut found = Vec::new();
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("fma") {
        #[cfg(avx512_intrinsics)]
        if is_x86_feature_detected!("avx512f") {
            found.push(Isa::Avx512);
        }
        if is_x86_feature_detected!("avx2") {
            found.push(Isa::Avx2);
        }
    }
    found
}

/// The best of [`isas`] (checked once).
fn isa() -> Isa {
    use std::sync::OnceLock;
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| isas().first().copied().unwrap_or(Isa::None))
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

// The crate builds with Rust 1.85; this module only where build.rs found 1.89 or later.
#[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
#[clippy::msrv = "1.89"]
pub(super) mod x86_512 {
    use std::arch::x86_64::*;

    /// Transposes the 16 x 16 matrix of 32-bit lanes held by `rows`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(in crate::nn) fn transpose(rows: &mut [__m512; 16]) {
        // Pairs of rows interleaved, then pairs of pairs: each 128-bit lane then holds
        // four values of one column. (Loops, not `map`: its closures are not inlined.)
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            let (a, b) = (rows[2 * i], rows[2 * i + 1]);
            t[2 * i] = _mm512_unpacklo_ps(a, b);
            t[2 * i + 1] = _mm512_unpackhi_ps(a, b);
        }
        let mut u = [_mm512_setzero_ps(); 16];
        for g in 0..4 {
            let a = _mm512_castps_pd(t[4 * g]);
            let b = _mm512_castps_pd(t[4 * g + 2]);
            let c = _mm512_castps_pd(t[4 * g + 1]);
            let d = _mm512_castps_pd(t[4 * g + 3]);
            u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
            u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
            u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
        }
        // Then the 128-bit lanes gathered across the four groups of four rows.
        let mut v = [_mm512_setzero_ps(); 16];
        for q in 0..4 {
            v[q] = _mm512_shuffle_f32x4::<0x88>(u[q], u[4 + q]);
            v[4 + q] = _mm512_shuffle_f32x4::<0xdd>(u[q], u[4 + q]);
            v[8 + q] = _mm512_shuffle_f32x4::<0x88>(u[8 + q], u[12 + q]);
            v[12 + q] = _mm512_shuffle_f32x4::<0xdd>(u[8 + q], u[12 + q]);
        }
        for q in 0..4 {
            let out = [
                _mm512_shuffle_f32x4::<0x88>(v[q], v[8 + q]),
                _mm512_shuffle_f32x4::<0x88>(v[4 + q], v[12 + q]),
                _mm512_shuffle_f32x4::<0xdd>(v[q], v[8 + q]),
                _mm512_shuffle_f32x4::<0xdd>(v[4 + q], v[12 + q]),
            ];
            for (h, o) in out.into_iter().enumerate() {
                rows[4 * h + q] = o;
            }
        }
    }

    /// [`super::dots`] with AVX-512.
    ///
    /// # Safety
    /// The CPU must have AVX-512F and FMA; `dst` holds `m x n` values, `a` `m x k`, and every
    /// row of `b` (`b_rows`, `n` of them) `k` values.
    #[target_feature(enable = "avx512f,fma")]
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
            let rows = (m - i).min(6);
            let mut j = 0;
            while j < n {
                let cols = (n - j).min(4);
                let at = (i, j, n, k);
                let br = &b_rows[j..j + cols];
                // SAFETY: rows i..i + rows of a and dst, and the rows br of b, lie within them.
                // Four columns at a time, then one.
                let done = unsafe {
                    match (rows, cols) {
                        (6, 4) => tile::<6, 4>(dst, a, b, br, at),
                        (6, _) => tile::<6, 1>(dst, a, b, br, at),
                        (5, 4) => tile::<5, 4>(dst, a, b, br, at),
                        (5, _) => tile::<5, 1>(dst, a, b, br, at),
                        (4, 4) => tile::<4, 4>(dst, a, b, br, at),
                        (4, _) => tile::<4, 1>(dst, a, b, br, at),
                        (3, 4) => tile::<3, 4>(dst, a, b, br, at),
                        (3, _) => tile::<3, 1>(dst, a, b, br, at),
                        (2, 4) => tile::<2, 4>(dst, a, b, br, at),
                        (2, _) => tile::<2, 1>(dst, a, b, br, at),
                        (_, 4) => tile::<1, 4>(dst, a, b, br, at),
                        (_, _) => tile::<1, 1>(dst, a, b, br, at),
                    }
                };
                j += done;
            }
            i += rows;
        }
    }

    /// As the AVX2 tile, in sixteen lanes, the last `k % 16` values in masked lanes.
    ///
    /// # Safety
    /// AVX-512F; rows `i..i + M` of `a` (`k` values each) and of `dst` (`n` each) lie within
    /// them, and so do the `k` values from each of `b_rows` in `b`.
    #[target_feature(enable = "avx512f,fma")]
    #[inline]
    #[allow(clippy::needless_range_loop)] // acc is indexed by both r and c
    unsafe fn tile<const M: usize, const N: usize>(
        dst: &mut [f32],
        a: &[f32],
        b: &[f32],
        b_rows: &[usize],
        (i, j, n, k): (usize, usize, usize, usize),
    ) -> usize {
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [[_mm512_setzero_ps(); N]; M];
        let mut p = 0;
        while p < k {
            // All lanes, or the remainder's.
            let mask: __mmask16 = if k - p >= 16 {
                0xffff
            } else {
                (1u16 << (k - p)) - 1
            };
            let mut av = [_mm512_setzero_ps(); M];
            for (r, v) in av.iter_mut().enumerate() {
                // SAFETY: the masked lanes p..min(p + 16, k) lie within row i + r of a.
                *v = unsafe { _mm512_maskz_loadu_ps(mask, pa.add((i + r) * k + p)) };
            }
            for c in 0..N {
                // SAFETY: the masked lanes lie within the row of b at b_rows[c].
                let bv = unsafe { _mm512_maskz_loadu_ps(mask, pb.add(b_rows[c] + p)) };
                for r in 0..M {
                    acc[r][c] = _mm512_fmadd_ps(av[r], bv, acc[r][c]);
                }
            }
            p += 16;
        }
        for r in 0..M {
            for c in 0..N {
                dst[(i + r) * n + j + c] += _mm512_reduce_add_ps(acc[r][c]);
            }
        }
        N
    }

    /// [`super::shifted_rows`] with AVX-512.
    ///
    /// # Safety
    /// The CPU must have AVX-512F and FMA, and the rows lie within their slices as
    /// [`super::shifted_rows`] checks.
    #[target_feature(enable = "avx512f,fma")]
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
            let block = (channels - c).min(8);
            let rows = (&mut *dst, ld, c, len);
            // SAFETY: channels c..c + block of dst, w and init lie within them.
            unsafe {
                match block {
                    8 => channel_block::<8>(rows, w, init, x, x_rows),
                    7 => channel_block::<7>(rows, w, init, x, x_rows),
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

    /// Rows `c..c + C` of [`shifted_rows`]: 48 positions at a time, then 16 at a time, the
    /// last 16 again where `len` is not a multiple (the same sums, written twice), one at a
    /// time below 16.
    ///
    /// # Safety
    /// As [`shifted_rows`], with `c + C <= init.len()`.
    #[target_feature(enable = "avx512f,fma")]
    #[inline]
    unsafe fn channel_block<const C: usize>(
        (dst, ld, c, len): (&mut [f32], usize, usize, usize),
        w: &[f32],
        init: &[f32],
        x: &[f32],
        x_rows: &[usize],
    ) {
        let wide = len / 48 * 48;
        let mut q = 0;
        while q < wide {
            // SAFETY: q + 48 <= len.
            unsafe { chunk::<C, 3>((&mut *dst, ld, c), q, w, init, x, x_rows) };
            q += 48;
        }
        if len >= 16 {
            while q < len {
                let at = q.min(len - 16);
                // SAFETY: at + 16 <= len.
                unsafe { chunk::<C, 1>((&mut *dst, ld, c), at, w, init, x, x_rows) };
                q += 16;
            }
            return;
        }
        let r_n = x_rows.len();
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

    /// Positions `q..q + 16 V` of rows `c..c + C`.
    ///
    /// # Safety
    /// As [`shifted_rows`], with `c + C <= init.len()` and `q + 16 V <= len`.
    #[target_feature(enable = "avx512f,fma")]
    #[inline]
    unsafe fn chunk<const C: usize, const V: usize>(
        (dst, ld, c): (&mut [f32], usize, usize),
        q: usize,
        w: &[f32],
        init: &[f32],
        x: &[f32],
        x_rows: &[usize],
    ) {
        let r_n = x_rows.len();
        let (px, pw, pd) = (x.as_ptr(), w.as_ptr(), dst.as_mut_ptr());
        let mut acc = [[_mm512_setzero_ps(); V]; C];
        for (o, a) in acc.iter_mut().enumerate() {
            *a = [_mm512_set1_ps(init[c + o]); V];
        }
        for (r, &off) in x_rows.iter().enumerate() {
            let mut xv = [_mm512_setzero_ps(); V];
            for (v, xv) in xv.iter_mut().enumerate() {
                // SAFETY: off + q + 16 V <= off + len, within x.
                *xv = unsafe { _mm512_loadu_ps(px.add(off + q + 16 * v)) };
            }
            for (o, a) in acc.iter_mut().enumerate() {
                // SAFETY: (c + o) * r_n + r < w.len().
                let wv = _mm512_set1_ps(unsafe { *pw.add((c + o) * r_n + r) });
                for v in 0..V {
                    a[v] = _mm512_fmadd_ps(wv, xv[v], a[v]);
                }
            }
        }
        for (o, a) in acc.iter().enumerate() {
            for (v, a) in a.iter().enumerate() {
                // SAFETY: (c + o) * ld + q + 16 V <= (c + o) * ld + len, within dst.
                unsafe { _mm512_storeu_ps(pd.add((c + o) * ld + q + 16 * v), *a) };
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
            (2, 6, 20),
            (3, 4, 17),
        ];
        for (m, n, k) in shapes {
            let a = values(m * k, 7919);
            let b = values(n * k + 5, 104729);
            // Rows of b that overlap and start anywhere.
            let b_rows: Vec<usize> = (0..n)
                .map(|j| (j * 3 + j % 2) % (n * k + 5 - k + 1))
                .collect();
            // Every instruction set this CPU has (none: the callers use gemm).
            for isa in isas() {
                let mut dst: Vec<f32> = (0..m * n).map(|i| i as f32).collect();
                assert!(dots_with(isa, &mut dst, &a, &b, &b_rows, (m, k)));
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
                            "{isa:?} {m}x{n}x{k} at {r},{c}: {got} vs {want}"
                        );
                    }
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
            (9, 3, 70),
        ] {
            let x = values(len + 3 * rows + 7, 31);
            let x_rows: Vec<usize> = (0..rows).map(|r| (r * 3) % (3 * rows + 7)).collect();
            let w = values(channels * rows, 17);
            let init = values(channels, 5);
            let ld = len + 3;
            for isa in isas() {
                let mut dst = vec![f32::NAN; channels * ld];
                let rows_out = (&mut dst[..], ld);
                assert!(shifted_rows_with(
                    isa, rows_out, &w, &init, &x, &x_rows, len
                ));
                for c in 0..channels {
                    for q in 0..len {
                        let want: f64 = init[c] as f64
                            + (0..rows)
                                .map(|r| w[c * rows + r] as f64 * x[x_rows[r] + q] as f64)
                                .sum::<f64>();
                        let got = dst[c * ld + q] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                            "{isa:?} {c},{q}: {got} vs {want}"
                        );
                    }
                    // Nothing written between rows.
                    assert!(dst[c * ld + len..(c + 1) * ld].iter().all(|v| v.is_nan()));
                }
            }
        }
    }
}
