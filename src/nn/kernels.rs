//! The CPU building blocks of our training kernels: patches as columns (`im2col`) and back
//! (`col2im`), matrix products on slices (the `gemm` crate, as candle uses), and the batch split
//! over candle's thread pool (rayon's, sized by `RAYON_NUM_THREADS`).

use gemm::Parallelism;
use rayon::prelude::*;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether candle's kernels are wanted instead of ours (see [`use_own_cpu_kernels`]).
static CANDLE_KERNELS: AtomicBool = AtomicBool::new(false);

/// Chooses, for the whole process, between our CPU training kernels for [`Conv2d`] and
/// [`max_pool2d`] (`true`, the default) and candle's (`false`): to compare the two, or to rule
/// ours out when something looks wrong. Ops already recorded for a backward keep the kernels
/// their forward used.
///
/// [`Conv2d`]: super::Conv2d
/// [`max_pool2d`]: super::max_pool2d
pub fn use_own_cpu_kernels(on: bool) {
    CANDLE_KERNELS.store(!on, Ordering::Relaxed);
}

/// Whether our CPU kernels are in use ([`use_own_cpu_kernels`]).
pub fn own_cpu_kernels() -> bool {
    !CANDLE_KERNELS.load(Ordering::Relaxed)
}

/// Whether candle's ops are wanted on CUDA instead of ours (see [`use_own_cuda_kernels`]);
/// read from `CANDLE_PARALLEL_CUDA_KERNELS` on first use.
static CANDLE_CUDA_KERNELS: std::sync::OnceLock<AtomicBool> = std::sync::OnceLock::new();

/// The switch of [`use_own_cuda_kernels`], set from the environment on first use.
fn candle_cuda_kernels() -> &'static AtomicBool {
    CANDLE_CUDA_KERNELS.get_or_init(|| {
        let value = std::env::var("CANDLE_PARALLEL_CUDA_KERNELS").unwrap_or_default();
        let candle = match value.as_str() {
            "" | "ours" => false,
            "candle" => true,
            other => {
                log::warn!(
                    "CANDLE_PARALLEL_CUDA_KERNELS={other:?} is neither \"ours\" nor \"candle\": \
                     using ours"
                );
                false
            }
        };
        AtomicBool::new(candle)
    })
}

/// Chooses, for the whole process, between our CUDA kernels for the Net's convolution block
/// ([`Conv2d::forward_relu_max_pool2d`]), for [`max_pool2d`] and for [`Sgd`]'s step (`true`,
/// the default; f32 with the `cuda` feature) and candle's ops (`false`): to compare the two, or to rule ours
/// out. The environment chooses the same before the program does:
/// `CANDLE_PARALLEL_CUDA_KERNELS=candle` (or `ours`). Without the `cuda` feature nothing
/// changes. Ops already recorded for a backward keep the kernels their forward used.
///
/// [`Conv2d::forward_relu_max_pool2d`]: super::Conv2d::forward_relu_max_pool2d
/// [`max_pool2d`]: super::max_pool2d
/// [`Sgd`]: crate::optim::Sgd
pub fn use_own_cuda_kernels(on: bool) {
    candle_cuda_kernels().store(!on, Ordering::Relaxed);
}

/// Whether our CUDA kernels are in use ([`use_own_cuda_kernels`]).
pub fn own_cuda_kernels() -> bool {
    !candle_cuda_kernels().load(Ordering::Relaxed)
}

/// Whether our kernels take these tensors: f32 on the CPU, and ours not switched off.
pub(super) fn ours(ts: &[&candle_core::Tensor]) -> bool {
    own_cpu_kernels()
        && ts
            .iter()
            .all(|t| t.device().is_cpu() && t.dtype() == candle_core::DType::F32)
}

/// The dtype of these tensors when our kernels take them: f32, or f16 and bf16, which they
/// compute in f32 (the crate's rule for reductions, see the [`nn` module docs](super)); all of
/// one dtype, on the CPU, and ours not switched off.
pub(super) fn ours_in_f32(ts: &[&candle_core::Tensor]) -> Option<candle_core::DType> {
    use candle_core::DType;
    let dtype = ts.first()?.dtype();
    let takes = own_cpu_kernels()
        && matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
        && ts.iter().all(|t| t.device().is_cpu() && t.dtype() == dtype);
    if takes && dtype != DType::F32 {
        super::half_build::warn_if_half_is_slow(dtype, "a layer of candle_parallel::nn");
    }
    takes.then_some(dtype)
}

/// What `im2col` and `col2im` need of a convolution's geometry.
pub(super) trait Window {
    fn input(&self) -> (usize, usize);
    fn kernel(&self) -> (usize, usize);
    fn output(&self) -> (usize, usize);
    fn padding(&self) -> usize;
    fn stride(&self) -> usize;
    fn dilation(&self) -> usize;
}

/// Block `i` of `len` values in `data` (an image of a batch, a group of channels or weights).
pub(super) fn block<T>(data: &[T], i: usize, len: usize) -> &[T] {
    &data[i * len..(i + 1) * len]
}

/// Block `i` of `len` values in `data`, to write.
pub(super) fn block_mut(data: &mut [f32], i: usize, len: usize) -> &mut [f32] {
    &mut data[i * len..(i + 1) * len]
}

/// The element-wise sum of `partials`, each of `len` values (per-thread partial sums).
pub(super) fn sum_partials(partials: Vec<Vec<f32>>, len: usize) -> Vec<f32> {
    let mut total = vec![0f32; len];
    for p in partials {
        for (t, v) in total.iter_mut().zip(p) {
            *t += v;
        }
    }
    total
}

/// A matrix view of a slice: `rows x cols`, element `(i, j)` at `i * rs + j * cs`.
pub(super) struct Mat<P> {
    pub(super) ptr: P,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) rs: isize,
    pub(super) cs: isize,
}

impl<'a> Mat<&'a [f32]> {
    /// `data` as a row-major matrix of `cols` columns.
    pub fn rows_of(data: &'a [f32], cols: usize) -> Self {
        Self {
            ptr: data,
            rows: data.len() / cols,
            cols,
            rs: cols as isize,
            cs: 1,
        }
    }

    /// Columns `first..first + count` of `data` (a row-major matrix of `cols` columns),
    /// transposed: a `count x (data.len() / cols)` view where they lie.
    pub fn columns_transposed(data: &'a [f32], cols: usize, first: usize, count: usize) -> Self {
        assert!(
            first + count <= cols && data.len().is_multiple_of(cols.max(1)),
            "columns {first}..{} of a matrix of {cols} columns ({} values)",
            first + count,
            data.len()
        );
        Self {
            // The last element read, (count - 1) + (rows - 1) * cols from `first`, lies within.
            ptr: &data[first.min(data.len())..],
            rows: count,
            cols: data.len() / cols.max(1),
            rs: 1,
            cs: cols as isize,
        }
    }

    /// The transpose of `data` seen as a row-major matrix of `cols` columns.
    pub fn transposed(data: &'a [f32], cols: usize) -> Self {
        Self {
            ptr: data,
            rows: cols,
            cols: data.len() / cols,
            rs: 1,
            cs: cols as isize,
        }
    }
}

impl<'a> Mat<&'a [f32]> {
    /// `rows x cols` of `data` from its start, element `(i, j)` at `i * rs + j * cs` (columns
    /// of a wider matrix, or its transpose). Panics where the last element lies outside.
    pub fn strided(data: &'a [f32], rows: usize, cols: usize, rs: usize, cs: usize) -> Self {
        assert!(
            rows == 0 || cols == 0 || (rows - 1) * rs + (cols - 1) * cs < data.len(),
            "a {rows}x{cols} view with strides ({rs}, {cs}) over {} values",
            data.len()
        );
        Self {
            ptr: data,
            rows,
            cols,
            rs: rs as isize,
            cs: cs as isize,
        }
    }
}

impl<'a> Mat<&'a mut [f32]> {
    /// `rows x cols` of `data` from its start with rows `rs` apart, to write (columns of a
    /// wider row-major matrix). Panics where the last element lies outside.
    pub fn strided_rows(data: &'a mut [f32], rows: usize, cols: usize, rs: usize) -> Self {
        assert!(
            rows == 0 || cols == 0 || (rows - 1) * rs + cols <= data.len(),
            "a {rows}x{cols} view with row stride {rs} over {} values",
            data.len()
        );
        Self {
            ptr: data,
            rows,
            cols,
            rs: rs as isize,
            cs: 1,
        }
    }

    /// `data` as a row-major matrix of `cols` columns, to write.
    pub fn rows(data: &'a mut [f32], cols: usize) -> Self {
        let rows = data.len() / cols;
        Self {
            ptr: data,
            rows,
            cols,
            rs: cols as isize,
            cs: 1,
        }
    }
}

/// `dst += a . bᵀ` for row-major `a` (`m x k`), `b` (`n x k`) and `dst` (`m x n`): a
/// convolution's weight gradient, many long dot products; a kernel of our own where the CPU has
/// AVX2 and FMA ([`simd`](super::simd)), else `gemm`.
pub(super) fn matmul_nt(dst: &mut [f32], a: &[f32], b: &[f32], k: usize) {
    let n = b.len() / k.max(1);
    let b_rows: Vec<usize> = (0..n).map(|j| j * k).collect();
    if k == 0 || super::simd::dots(dst, a, b, &b_rows, k) {
        return;
    }
    matmul(
        Mat::rows(dst, n),
        Mat::rows_of(a, k),
        Mat::transposed(b, k),
        true,
    );
}

/// `dst = a . b`, or `dst += a . b` when `accumulate`, on the calling thread.
pub(super) fn matmul(dst: Mat<&mut [f32]>, a: Mat<&[f32]>, b: Mat<&[f32]>, accumulate: bool) {
    product(dst, a, b, accumulate, Parallelism::None)
}

/// Columns of `dst` (and of `b`) per `gemm` in [`matmul_threaded`].
const COLUMN_BLOCK: usize = 128;

/// [`matmul`] by blocks of [`COLUMN_BLOCK`] columns of `dst` and `b`, each block one `gemm`,
/// the blocks split over candle's threads ([`threads`]) in runs of neighbours: for a product
/// of few rows and a large `b` (a weight), which a split by rows of `dst` would have every
/// thread read whole. Each thread reads its own columns of `b` once: the 25 M MLP's forward
/// at batch 64 on 2 threads took 40 ms with `gemm`'s own split of the product (36-42 ms in
/// another run) and 27-34 ms with one block per thread (PyTorch 17-20). Blocks of 128 columns
/// rather than one per thread took a 64 x 4096 x 4096 product (a weight seen transposed)
/// from 45.8 to 41.6 ms on one thread and from 22.3 to 20.0 on two (medians of 7 and 9
/// alternating runs, 2026-11-27, the Xeon of docs/BENCHMARKS.md), 6-18% less time on the
/// MLP's other shapes and on 16 to 128 rows. Above one block, the blocks do not depend on the
/// threads, so neither do the sums. The linear layers' forward tries `few_rows`' kernel first
/// (3 to 96 rows, or 128 by a large weight, where the CPU has AVX-512), which packs the
/// weight faster than `gemm`.
pub(super) fn matmul_threaded(
    dst: Mat<&mut [f32]>,
    a: Mat<&[f32]>,
    b: Mat<&[f32]>,
    accumulate: bool,
) {
    let (threads, n) = (threads(), dst.cols);
    if dst.rows == 0 || a.cols == 0 || n <= COLUMN_BLOCK {
        // One block: gemm's own split (by rows, or along a long k).
        let parallelism = match threads {
            1 => Parallelism::None,
            t => Parallelism::Rayon(t),
        };
        return product(dst, a, b, accumulate, parallelism);
    }
    assert_shapes_agree(&dst, &a, &b);
    let blocks = n.div_ceil(COLUMN_BLOCK);
    let runs = threads.min(blocks);
    let out = ColumnsOut(dst.ptr.as_mut_ptr());
    let out = &out;
    let run = |r: usize| {
        for block in r * blocks / runs..(r + 1) * blocks / runs {
            let first = block * COLUMN_BLOCK;
            let cols = COLUMN_BLOCK.min(n - first);
            // SAFETY: the three views lie within their slices (their constructors checked
            // rows, columns and strides against the slices' lengths), so do their column
            // blocks; dst's rows do not overlap (the callers' views are row-major matrices),
            // so each block of its columns is written by this run alone; and dst is borrowed
            // mutably, so it aliases neither input.
            unsafe {
                gemm_views(
                    (dst.rows, cols, a.cols),
                    (out.0.offset(first as isize * dst.cs), dst.rs, dst.cs),
                    (a.ptr.as_ptr(), a.rs, a.cs),
                    (b.ptr.as_ptr().offset(first as isize * b.cs), b.rs, b.cs),
                    accumulate,
                    Parallelism::None,
                )
            }
        }
    };
    each_run(runs, run);
}

/// Runs `run(r)` for each `r < runs` over candle's thread pool, a single run on the calling
/// thread (no hand-off to a worker and back): the column runs of [`matmul_threaded`] and of
/// `few_rows`' kernel.
pub(super) fn each_run(runs: usize, run: impl Fn(usize) + Sync + Send) {
    if runs == 1 {
        run(0);
    } else {
        (0..runs).into_par_iter().for_each(run);
    }
}

/// `dst`'s first element, whose column blocks the runs of [`matmul_threaded`] (and of
/// `few_rows`' kernel) write.
pub(super) struct ColumnsOut(pub(super) *mut f32);

// SAFETY: each run (of matmul_threaded's or few_rows') writes its own blocks of columns, while
// the caller borrows dst mutably.
unsafe impl Sync for ColumnsOut {}

/// `gemm` on raw views: `(m, n, k)`, then `dst`, `a` and `b` as (first element, row stride,
/// column stride), split as `parallelism` says.
///
/// # Safety
/// Every element of the three views lies in memory valid for reads (and writes, for `dst`)
/// that nothing else uses meanwhile, and `dst` aliases neither input.
unsafe fn gemm_views(
    (m, n, k): (usize, usize, usize),
    (dst, drs, dcs): (*mut f32, isize, isize),
    (a, ars, acs): (*const f32, isize, isize),
    (b, brs, bcs): (*const f32, isize, isize),
    accumulate: bool,
    parallelism: Parallelism,
) {
    // SAFETY: the caller's.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            dcs,
            drs,
            accumulate,
            a,
            acs,
            ars,
            b,
            bcs,
            brs,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// Panics unless `dst = a . b` is a product of agreeing shapes (an internal invariant: the
/// layers build the views from shapes they checked).
pub(super) fn assert_shapes_agree(dst: &Mat<&mut [f32]>, a: &Mat<&[f32]>, b: &Mat<&[f32]>) {
    assert!(
        a.rows == dst.rows && b.cols == dst.cols && a.cols == b.rows,
        "matmul of {}x{} by {}x{} into {}x{}",
        a.rows,
        a.cols,
        b.rows,
        b.cols,
        dst.rows,
        dst.cols
    );
}

fn product(
    dst: Mat<&mut [f32]>,
    a: Mat<&[f32]>,
    b: Mat<&[f32]>,
    accumulate: bool,
    parallelism: Parallelism,
) {
    assert_shapes_agree(&dst, &a, &b);
    if dst.rows == 0 || dst.cols == 0 {
        return;
    }
    if a.cols == 0 {
        if !accumulate {
            for i in 0..dst.rows {
                for j in 0..dst.cols {
                    dst.ptr[i * dst.rs as usize + j * dst.cs as usize] = 0.0;
                }
            }
        }
        return;
    }
    // SAFETY: the three views lie within their slices (rows, columns and strides come from
    // the slices' lengths, checked above to agree), `dst` is borrowed mutably so it aliases
    // neither input, and f32 is a type gemm supports.
    unsafe {
        gemm_views(
            (dst.rows, dst.cols, a.cols),
            (dst.ptr.as_mut_ptr(), dst.rs, dst.cs),
            (a.ptr.as_ptr(), a.rs, a.cs),
            (b.ptr.as_ptr(), b.rs, b.cs),
            accumulate,
            parallelism,
        )
    }
}

/// Candle's thread count (`RAYON_NUM_THREADS`, else the machine's).
pub(super) fn threads() -> usize {
    candle_core::utils::get_num_threads().max(1)
}

/// Runs `f(first_item, items)` over `out`, a sequence of items of `item_len` elements, cut into
/// one run of whole items per thread.
pub(super) fn for_each_chunk<T: Send>(
    out: &mut [T],
    item_len: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let items = out.len() / item_len.max(1);
    if items == 0 {
        return;
    }
    let per = items.div_ceil(threads());
    out.par_chunks_mut(per * item_len)
        .enumerate()
        .for_each(|(c, chunk)| f(c * per, chunk));
}

/// `f` of each of the runs that `0..items` is cut into, one per thread, in order.
pub(super) fn map_chunks<R: Send>(items: usize, f: impl Fn(Range<usize>) -> R + Sync) -> Vec<R> {
    let per = items.div_ceil(threads()).max(1);
    (0..items.div_ceil(per))
        .into_par_iter()
        .map(|c| f(c * per..((c + 1) * per).min(items)))
        .collect()
}

/// The input position that output position `o` reads through kernel offset `k`, if inside.
#[inline(always)]
fn source(
    o: usize,
    k: usize,
    stride: usize,
    dilation: usize,
    padding: usize,
    size: usize,
) -> Option<usize> {
    (o * stride + k * dilation)
        .checked_sub(padding)
        .filter(|&i| i < size)
}

/// The outputs `lo..hi` (of `out` in all) whose input position through kernel offset `k` lies
/// inside `0..size`, and the input position of `lo`.
#[inline(always)]
fn inside(
    k: usize,
    out: usize,
    stride: usize,
    dilation: usize,
    padding: usize,
    size: usize,
) -> (usize, usize, usize) {
    let offset = k * dilation;
    let lo = padding.saturating_sub(offset).div_ceil(stride);
    let hi = if size + padding > offset {
        ((size - 1 + padding - offset) / stride + 1).min(out)
    } else {
        0
    };
    let lo = lo.min(hi);
    (lo, hi, (lo * stride + offset).saturating_sub(padding))
}

/// Lays out `channels` (`c` planes of the window's input size) as columns: row
/// `(channel, kh, kw)`, column `(oh, ow)` holds the input value that output `(oh, ow)` meets
/// at kernel position `(kh, kw)` (0 in the padding).
pub(super) fn im2col(channels: &[f32], c: usize, win: &impl Window, cols: &mut [f32]) {
    let ((h, w), (kh_n, kw_n), (ho, wo)) = (win.input(), win.kernel(), win.output());
    let (s, d, p) = (win.stride(), win.dilation(), win.padding());
    let positions = ho * wo;
    for ci in 0..c {
        let plane = &channels[ci * h * w..(ci + 1) * h * w];
        for kh in 0..kh_n {
            for kw in 0..kw_n {
                let row = (ci * kh_n + kh) * kw_n + kw;
                let dst = &mut cols[row * positions..(row + 1) * positions];
                let (lo, hi, first) = inside(kw, wo, s, d, p, w);
                for oh in 0..ho {
                    let out = &mut dst[oh * wo..(oh + 1) * wo];
                    let Some(ih) = source(oh, kh, s, d, p, h) else {
                        out.fill(0.0);
                        continue;
                    };
                    let src = &plane[ih * w..(ih + 1) * w];
                    out[..lo].fill(0.0);
                    out[hi..].fill(0.0);
                    if s == 1 {
                        out[lo..hi].copy_from_slice(&src[first..first + hi - lo]);
                    } else {
                        for (v, &x) in out[lo..hi].iter_mut().zip(src[first..].iter().step_by(s)) {
                            *v = x;
                        }
                    }
                }
            }
        }
    }
}

/// The reverse of [`im2col`]: adds each column value back onto the input position it came
/// from.
pub(super) fn col2im(cols: &[f32], c: usize, win: &impl Window, channels: &mut [f32]) {
    let ((h, w), (kh_n, kw_n), (ho, wo)) = (win.input(), win.kernel(), win.output());
    let (s, d, p) = (win.stride(), win.dilation(), win.padding());
    let positions = ho * wo;
    for ci in 0..c {
        let plane = &mut channels[ci * h * w..(ci + 1) * h * w];
        for kh in 0..kh_n {
            for kw in 0..kw_n {
                let row = (ci * kh_n + kh) * kw_n + kw;
                let src = &cols[row * positions..(row + 1) * positions];
                let (lo, hi, first) = inside(kw, wo, s, d, p, w);
                for oh in 0..ho {
                    let Some(ih) = source(oh, kh, s, d, p, h) else {
                        continue;
                    };
                    let dst = &mut plane[ih * w..(ih + 1) * w];
                    let values = &src[oh * wo + lo..oh * wo + hi];
                    if s == 1 {
                        let dst = &mut dst[first..first + values.len()];
                        for (x, &v) in dst.iter_mut().zip(values) {
                            *x += v;
                        }
                    } else {
                        for (x, &v) in dst[first..].iter_mut().step_by(s).zip(values) {
                            *x += v;
                        }
                    }
                }
            }
        }
    }
}

/// Values in [-1, 1), a different run for each `seed`: inputs for the kernels' unit tests.
#[cfg(test)]
pub(super) fn test_values(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let x = (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(40_503));
            (x >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}
