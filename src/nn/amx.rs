//! bf16 matrix products on Intel's AMX tiles, for the layers' bf16 compute on CPUs that have
//! them (Sapphire Rapids and later Xeons): what oneDNN gives PyTorch's bf16 `Linear` there.
//!
//! `dst (+)= a . b` with `a` and `b` rounded to bf16 (to nearest, even) and every product and
//! sum in f32, as torch's bf16 matmul: `tdpbf16ps` multiplies a 16 x 32 bf16 tile by a
//! 32 x 16 one into 16 x 16 f32 sums. Both operands are first copied into tiles of bf16, which
//! takes any strides (a transposed weight, columns of a gradient), zero-padded to whole tiles;
//! `dst` is then computed by blocks of 32 x 32 (four sums, two tiles of each operand), split
//! over candle's thread pool: a group of row blocks of `a` that fits in a quarter of the core's
//! cache meets every 32-column stripe of `b`, each stripe its rows one after the other, so
//! that both stay in cache. Only products large enough to gain come here ([`worth`]). Whole
//! panels of a weight are packed in AVX-512 registers, and the two packing buffers of the last
//! product are kept for the next ([`SPARE`]): a weight's are too large for the C allocator to
//! keep, and fresh memory costs a page fault per page.
//!
//! Used where [`available`]: an x86-64 Linux CPU with AMX-TILE and AMX-BF16 whose kernel grants
//! the process the tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), and not switched off with
//! `CANDLE_PARALLEL_AMX=0`. The hardware treats bf16 subnormals as zero, as oneDNN's do.

use super::kernels::{assert_shapes_agree, threads, Mat};
use rayon::prelude::*;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};

/// Rows of a tile, and rows (pairs of rows, for `b`) of a tile's worth of `k`.
const TILE: usize = 16;
/// Values of `k` in one step: a tile row of `a` holds 32 bf16 (64 bytes).
const STEP: usize = 32;
/// Rows of `dst` (columns, for `b`) in a block: two tiles.
const BLOCK: usize = 2 * TILE;
/// bf16 values in one packed block of one step: 32 rows of 32 values (2 KiB).
const PANEL: usize = BLOCK * STEP;

/// The precision of the f32 matrix products in this crate's linear layers ([`nn::linear`],
/// [`nn::linear_relu`], [`nn::linear_gelu`]), torch's `torch.set_float32_matmul_precision`.
///
/// [`nn::linear`]: super::linear
/// [`nn::linear_relu`]: super::linear_relu
/// [`nn::linear_gelu`]: super::linear_gelu
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MatmulPrecision {
    /// f32 products (the default).
    #[default]
    Highest,
    /// Products may round their two operands to bf16 (every product and sum stays f32), as
    /// torch's `"medium"`: they do where the CPU has AMX tiles and the product is large enough
    /// to gain (from 4 rows, through a layer of at least 128 inputs and 128 outputs, 4 M
    /// multiply-adds in all; a weight's gradient from batches of 128 rows: see the guide
    /// `docs/CPU_SPEED.md`), which makes it several times faster; elsewhere they stay f32.
    /// The tensors, and every other op, stay f32: mixed precision's speed without candle's
    /// bf16 element-wise ops.
    Medium,
}

static MATMUL_PRECISION: AtomicU8 = AtomicU8::new(0);

/// Sets, for the whole process, the precision of this crate's f32 linear layers' products
/// ([`MatmulPrecision`]). Ops already recorded for a backward keep the precision their forward
/// used.
///
/// ```rust
/// use candle_parallel::nn::{self, MatmulPrecision};
/// nn::set_float32_matmul_precision(MatmulPrecision::Medium);
/// assert_eq!(nn::float32_matmul_precision(), MatmulPrecision::Medium);
/// nn::set_float32_matmul_precision(MatmulPrecision::Highest);
/// ```
pub fn set_float32_matmul_precision(precision: MatmulPrecision) {
    MATMUL_PRECISION.store(precision as u8, Ordering::Relaxed);
}

/// The precision set by [`set_float32_matmul_precision`] (`Highest` until then).
pub fn float32_matmul_precision() -> MatmulPrecision {
    match MATMUL_PRECISION.load(Ordering::Relaxed) {
        0 => MatmulPrecision::Highest,
        _ => MatmulPrecision::Medium,
    }
}

/// Whether a linear layer computing in `dtype` runs its products on AMX tiles: bf16 layers,
/// and f32 ones under [`MatmulPrecision::Medium`], where [`available`].
pub(super) fn tiles_for(dtype: candle_core::DType) -> bool {
    use candle_core::DType;
    let wanted = match dtype {
        DType::BF16 => true,
        DType::F32 => float32_matmul_precision() == MatmulPrecision::Medium,
        _ => false,
    };
    wanted && available()
}

/// Whether this machine runs bf16 products on AMX tiles: an x86-64 Linux CPU with AMX-TILE
/// and AMX-BF16 whose kernel grants the tile state, and not switched off with
/// `CANDLE_PARALLEL_AMX=0` (checked once). Where false, [`MatmulPrecision::Medium`] changes
/// nothing and bf16 layers compute their products in f32.
pub fn bf16_tiles_available() -> bool {
    available()
}

/// Whether a product of `m x k` by `k x n` gains from the tiles. Both operands are first
/// packed (about half a nanosecond per value of a weight, the costly one), and each of the
/// `m x n` sums leaves the tiles through memory; the tiles then save about 15 ps per
/// multiply-add over f32's AVX-512 products. So each sum must gather `k >= 128` products (a
/// 4096 x 4096 result over 128: as fast as f32; over 64, the weight gradient of a batch of
/// 64 rows, 1.6x slower), the product must be large enough to pay the packing (4 M
/// multiply-adds, twice the 2 M of 32 x 256 x 256, which ran as fast either way), and `b` at
/// least 128 columns wide (512 x 256 x 64, the default transformer's fc2, is slower on the
/// tiles: the packed rows of `a` serve too few columns). Few rows of `a` gain most: `gemm`
/// packs a 4096 x 4096 weight for each product whatever the rows, and at 4 to 64 rows the
/// tiles took half its time (the f32 forward at few rows has since moved to `few_rows`'
/// kernel, which the tiles still beat: the 25 M MLP's forward at batch 64 on one thread,
/// 24-34 ms against 32-50 in f32, in two runs of `mlp_phases`). A single row (a
/// matrix-vector product) does not: the weight is read once either way.
pub(super) fn worth(m: usize, k: usize, n: usize) -> bool {
    m >= 4 && n >= 128 && k >= 128 && m * k * n >= 1 << 22
}

/// [`bf16_tiles_available`].
pub(super) fn available() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        let wanted = !matches!(
            std::env::var("CANDLE_PARALLEL_AMX").as_deref(),
            Ok("0" | "off" | "false")
        );
        let on = wanted && tiles::enable();
        if on {
            log::debug!("bf16 products run on AMX tiles (CANDLE_PARALLEL_AMX=0 turns this off)");
        }
        on
    })
}

/// `x` rounded to bf16, to nearest even (a NaN made quiet), as its 16 bits: `half`'s
/// `bf16::from_f32`, bit for bit (`cast`'s tests try every rounding case).
#[inline(always)]
pub(super) fn bf16_bits(x: f32) -> u16 {
    // Branch-free, for the packing loops to vectorise: adding 0x7fff and the kept part's
    // lowest bit carries into it exactly when the dropped half is above one half, or one half
    // with an odd kept part.
    let bits = x.to_bits();
    let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
    let quiet = ((bits >> 16) | 0x40) as u16;
    if x.is_nan() {
        quiet
    } else {
        rounded
    }
}

/// `lo` and `hi` rounded to bf16 as one pair: `lo` in the low half (the lower `k`).
#[inline(always)]
fn bf16_pair(lo: f32, hi: f32) -> u32 {
    u32::from(bf16_bits(lo)) | u32::from(bf16_bits(hi)) << 16
}

/// `dst = a . b`, or `dst += a . b` when `accumulate`, in bf16 with f32 sums, split over
/// candle's threads. The caller has checked [`available`]; the shapes agree
/// ([`assert_shapes_agree`], as [`super::kernels::matmul`] checks).
pub(super) fn matmul(dst: Mat<&mut [f32]>, a: Mat<&[f32]>, b: Mat<&[f32]>, accumulate: bool) {
    // The tile instructions fault unless the process asked for their state (in `available`).
    assert!(
        available(),
        "bf16 matmul on AMX tiles where they are not available"
    );
    assert_shapes_agree(&dst, &a, &b);
    let (m, n, k) = (dst.rows, dst.cols, a.cols);
    if m == 0 || n == 0 {
        return;
    }
    // The writes below go through a raw pointer from several threads, the reads index the
    // slices: every view must lie within its slice (as `Mat`'s constructors check) and dst's
    // elements must not overlap (rows after rows, or columns after columns).
    let inside = |rows: usize, cols: usize, rs: isize, cs: isize, len: usize| {
        rows == 0
            || cols == 0
            || (rs >= 0 && cs >= 0 && (rows - 1) * (rs as usize) + (cols - 1) * (cs as usize) < len)
    };
    let (drs, dcs) = (dst.rs.max(0) as usize, dst.cs.max(0) as usize);
    assert!(
        inside(m, n, dst.rs, dst.cs, dst.ptr.len())
            && (m == 1 || n == 1 || drs >= n * dcs || dcs >= m * drs)
            && (m == 1 || drs > 0)
            && (n == 1 || dcs > 0)
            && inside(m, k, a.rs, a.cs, a.ptr.len())
            && inside(k, n, b.rs, b.cs, b.ptr.len()),
        "bf16 matmul: views outside their values or an output that overlaps itself"
    );
    let steps = k.div_ceil(STEP);
    let a_tiles = pack(&a, steps, Side::Rows);
    let b_tiles = pack(&b, steps, Side::Columns);
    let (row_blocks, col_blocks) = (m.div_ceil(BLOCK), n.div_ceil(BLOCK));
    let out = Out {
        ptr: dst.ptr.as_mut_ptr(),
        rs: dst.rs,
        cs: dst.cs,
        rows: m,
        cols: n,
    };
    // The blocks in the order they run: a group of row blocks whose packed rows of `a` fit in
    // a quarter of the core's cache (512 KiB of 2 MiB on the CPUs with AMX) meets every
    // stripe of `b`, each stripe meeting the group's row blocks one after the other (so its
    // tiles stay in cache too).
    let group = (512 * 1024 / (steps * PANEL * 2).max(1)).max(1);
    let order: Vec<(usize, usize)> = (0..row_blocks)
        .step_by(group)
        .flat_map(|g| {
            (0..col_blocks).flat_map(move |stripe| {
                (g..(g + group).min(row_blocks)).map(move |row| (row, stripe))
            })
        })
        .collect();
    // The packed steps of block i (of rows of `a`, or columns of `b`).
    let span = |i: usize| i * steps * PANEL / 2..(i + 1) * steps * PANEL / 2;
    let jobs = order.len();
    let runs = (4 * threads()).min(jobs);
    (0..runs).into_par_iter().for_each(|run| {
        let (first, last) = (run * jobs / runs, (run + 1) * jobs / runs);
        let mut sums = [0f32; BLOCK * BLOCK];
        tiles::with_config(|| {
            for &(row, stripe) in &order[first..last] {
                let (a_panel, b_panel) = (&a_tiles[span(row)], &b_tiles[span(stripe)]);
                // SAFETY: both panels hold `steps` packed blocks of PANEL values, and `sums`
                // BLOCK x BLOCK f32: what the kernel reads and writes; the tile state is
                // configured on this thread by `with_config`.
                unsafe {
                    tiles::block(
                        a_panel.as_ptr().cast(),
                        b_panel.as_ptr().cast(),
                        steps,
                        &mut sums,
                    )
                };
                out.write(row * BLOCK, stripe * BLOCK, &sums, accumulate);
            }
        });
    });
    keep(a_tiles);
    keep(b_tiles);
}

/// Packing buffers kept for the next product: a weight's packed tiles are as large as half
/// the weight (32 MiB for a 4096 x 4096 layer), past what the C allocator keeps, and fresh
/// memory costs a page fault per page on its first write: packing a 4096 x 4096 weight took
/// 21-29 ms in fresh memory against 7-10 ms in memory used before (this module's own
/// packing, 2026-11-27, on the Xeon of docs/BENCHMARKS.md). At most [`SPARES`] buffers of at
/// most [`SPARE_BYTES`] each are kept: the process holds up to 128 MiB for them.
static SPARE: Mutex<Vec<Vec<u32>>> = Mutex::new(Vec::new());

/// How many buffers [`SPARE`] holds at most: both operands of one product.
const SPARES: usize = 2;

/// The largest buffer [`SPARE`] keeps (a 4096 x 8192 weight's): larger ones are freed.
const SPARE_BYTES: usize = 64 << 20;

/// A buffer of `len` values (their contents left from an earlier packing, or zeros): the
/// smallest kept one that is large enough, else a new one.
fn buffer(len: usize) -> Vec<u32> {
    let mut spare = SPARE.lock().unwrap_or_else(|e| e.into_inner());
    let fits = (0..spare.len())
        .filter(|&i| spare[i].capacity() >= len)
        .min_by_key(|&i| spare[i].capacity());
    let kept = fits.map(|i| spare.swap_remove(i));
    drop(spare);
    match kept {
        // Within its capacity: no new memory, zeros only past its old length.
        Some(mut v) => {
            v.resize(len, 0);
            v
        }
        // Fresh zero pages from the allocator, faulted in by the packing that writes them.
        None => vec![0; len],
    }
}

/// Keeps `v` for a later [`buffer`] unless it is larger than [`SPARE_BYTES`], dropping the
/// smallest when more than [`SPARES`] are kept.
fn keep(v: Vec<u32>) {
    if v.capacity() * std::mem::size_of::<u32>() > SPARE_BYTES {
        return;
    }
    let mut spare = SPARE.lock().unwrap_or_else(|e| e.into_inner());
    spare.push(v);
    let extra = if spare.len() > SPARES {
        let smallest = (0..spare.len()).min_by_key(|&i| spare[i].capacity());
        smallest.map(|i| spare.swap_remove(i))
    } else {
        None
    };
    drop(spare);
    drop(extra); // freed outside the lock
}

/// Which operand a packing is for: `a`, whose tiles hold rows, or `b`, whose tiles hold pairs
/// of rows interleaved by column (the layout `tdpbf16ps` reads its second operand in).
#[derive(Clone, Copy, PartialEq)]
enum Side {
    Rows,
    Columns,
}

/// `mat` in bf16 tiles: for each block of 32 rows (`Rows`) or columns (`Columns`), `steps`
/// panels of PANEL values, zero past the matrix. Values go in pairs along `k` (a u32 each: the
/// lower `k` in the low half), which both layouts keep together.
fn pack(mat: &Mat<&[f32]>, steps: usize, side: Side) -> Vec<u32> {
    let (lines, depth) = match side {
        Side::Rows => (mat.rows, mat.cols),
        Side::Columns => (mat.cols, mat.rows),
    };
    let blocks = lines.div_ceil(BLOCK);
    let len = blocks * steps * PANEL / 2;
    // Every panel below is written whole (zeros past the matrix): the buffer's old contents
    // do not matter.
    let mut tiles = buffer(len);
    if len == 0 {
        return tiles;
    }
    let (rs, cs) = (mat.rs as usize, mat.cs as usize);
    let packer = Packer {
        data: mat.ptr,
        side,
        lines,
        depth,
        // Element (line, depth) of the operand lies at line * ls + depth * ds.
        ls: if side == Side::Rows { rs } else { cs },
        ds: if side == Side::Rows { cs } else { rs },
        whole_panels_in_vectors: true,
    };
    let panels = Panels(tiles.as_mut_ptr());
    let panels = &panels;
    // Panel (block, step) of the output, which one job alone writes.
    let panel = |block: usize, step: usize| {
        let at = (block * steps + step) * PANEL / 2;
        // SAFETY: `at + PANEL / 2 <= len`, the vector's length (its values initialised), and
        // each (block, step) is filled once, by one job: the panels do not overlap.
        unsafe { std::slice::from_raw_parts_mut(panels.0.add(at), PANEL / 2) }
    };
    let jobs = (4 * threads()).min(blocks.max(steps));
    // Lines side by side: along the source's rows, steps outer (each step reads 32 rows once,
    // from end to end), split over threads by steps; else by blocks, blocks outer.
    let steps_outer = packer.ls == 1 && packer.ds != 1;
    let (outer, inner) = if steps_outer {
        (steps, blocks)
    } else {
        (blocks, steps)
    };
    let per = outer.div_ceil(jobs);
    (0..outer.div_ceil(per)).into_par_iter().for_each(|job| {
        let mut scratch = Scratch::default();
        for o in job * per..((job + 1) * per).min(outer) {
            for i in 0..inner {
                let (block, step) = if steps_outer { (i, o) } else { (o, i) };
                packer.fill(block, step, panel(block, step), &mut scratch);
            }
        }
    });
    tiles
}

/// The packed tiles, written by panels from several threads.
struct Panels(*mut u32);

// SAFETY: each thread writes panels no other writes (see `pack`), while `pack` holds the
// vector.
unsafe impl Sync for Panels {}

/// What packing reads: an operand, its shape along lines (rows of `a`, columns of `b`) and
/// `k`, and their strides.
struct Packer<'a> {
    data: &'a [f32],
    side: Side,
    lines: usize,
    depth: usize,
    ls: usize,
    ds: usize,
    /// Whether whole panels of `b` go through [`simd512`] where the CPU has it (the tests
    /// compare both ways).
    whole_panels_in_vectors: bool,
}

/// One panel's pairs, gathered in the order the source lies in: line by line, or pair by pair.
struct Scratch {
    by_line: [[u32; STEP / 2]; BLOCK],
    by_pair: [[u32; BLOCK]; STEP / 2],
}

impl Default for Scratch {
    fn default() -> Self {
        Self {
            by_line: [[0; STEP / 2]; BLOCK],
            by_pair: [[0; BLOCK]; STEP / 2],
        }
    }
}

impl Packer<'_> {
    /// Fills `panel` with step `step` of block `block`: the pairs gathered in the order the
    /// source lies in, then laid out as the panel wants (copied, or transposed), zero past the
    /// matrix.
    fn fill(&self, block: usize, step: usize, panel: &mut [u32], scratch: &mut Scratch) {
        let (data, ls, ds) = (self.data, self.ls, self.ds);
        let first = block * BLOCK;
        let count = BLOCK.min(self.lines - first);
        let d0 = step * STEP;
        let width = STEP.min(self.depth - d0);
        if self.whole_panels_in_vectors
            && count == BLOCK
            && width == STEP
            && self.side == Side::Columns
        {
            // A whole panel of `b` (a weight, read as wᵀ in the forward or as w for the
            // input's gradient: the packings that cost most), in vector registers.
            let from = &data[first * ls + d0 * ds..];
            if simd512::columns(from, (ls, ds), panel) {
                return;
            }
        }
        let pairs = width.div_ceil(2);
        if ls != 1 || ds == 1 {
            let by_line = &mut scratch.by_line;
            for (l, row) in by_line.iter_mut().enumerate() {
                if l >= count {
                    row.fill(0);
                    continue;
                }
                let base = (first + l) * ls + d0 * ds;
                if ds == 1 {
                    let run = &data[base..base + width];
                    pairs_along(&mut row[..width / 2], &run[..width / 2 * 2]);
                    if width % 2 == 1 {
                        row[width / 2] = bf16_pair(run[width - 1], 0.0);
                    }
                } else {
                    for (p, v) in row.iter_mut().enumerate().take(pairs) {
                        let hi = if 2 * p + 1 < width {
                            data[base + (2 * p + 1) * ds]
                        } else {
                            0.0
                        };
                        *v = bf16_pair(data[base + 2 * p * ds], hi);
                    }
                }
                row[pairs..].fill(0);
            }
            match self.side {
                Side::Rows => {
                    for (l, row) in by_line.iter().enumerate() {
                        panel[l * STEP / 2..(l + 1) * STEP / 2].copy_from_slice(row);
                    }
                }
                Side::Columns => {
                    for (l, row) in by_line.iter().enumerate() {
                        let tile = (l / TILE) * (TILE * STEP / 2) + l % TILE;
                        for (p, &v) in row.iter().enumerate() {
                            panel[tile + p * TILE] = v;
                        }
                    }
                }
            }
        } else {
            // Lines side by side (and k strided): two runs along them per pair.
            let by_pair = &mut scratch.by_pair;
            for (p, row) in by_pair.iter_mut().enumerate() {
                if p >= pairs {
                    row.fill(0);
                    continue;
                }
                let lo = &data[first + (d0 + 2 * p) * ds..][..count];
                if 2 * p + 1 < width {
                    let hi = &data[first + (d0 + 2 * p + 1) * ds..][..count];
                    pairs_across(&mut row[..count], lo, hi);
                } else {
                    for (v, &a) in row.iter_mut().zip(lo) {
                        *v = bf16_pair(a, 0.0);
                    }
                }
                row[count..].fill(0);
            }
            match self.side {
                Side::Columns => {
                    for (p, row) in by_pair.iter().enumerate() {
                        for tile in 0..BLOCK / TILE {
                            let at = tile * (TILE * STEP / 2) + p * TILE;
                            panel[at..at + TILE]
                                .copy_from_slice(&row[tile * TILE..(tile + 1) * TILE]);
                        }
                    }
                }
                Side::Rows => {
                    for (p, row) in by_pair.iter().enumerate() {
                        for (l, &v) in row.iter().enumerate() {
                            panel[l * STEP / 2 + p] = v;
                        }
                    }
                }
            }
        }
    }
}

/// `out[i]` = the bf16 pair of `run[2i]` and `run[2i + 1]` (`run` twice as long as `out`).
fn pairs_along(out: &mut [u32], run: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2; the lengths are as documented (checked inside).
        return unsafe { simd::pairs_along(out, run) };
    }
    for (v, two) in out.iter_mut().zip(run.chunks_exact(2)) {
        *v = bf16_pair(two[0], two[1]);
    }
}

/// `out[i]` = the bf16 pair of `lo[i]` and `hi[i]` (all three as long).
fn pairs_across(out: &mut [u32], lo: &[f32], hi: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2; the lengths are as documented (checked inside).
        return unsafe { simd::pairs_across(out, lo, hi) };
    }
    for ((v, &a), &b) in out.iter_mut().zip(lo).zip(hi) {
        *v = bf16_pair(a, b);
    }
}

/// The packing's rounding, 8 values at a time (AVX2: every CPU with AMX has it).
#[cfg(target_arch = "x86_64")]
mod simd {
    use super::bf16_pair;
    use std::arch::x86_64::*;

    /// The bits of 8 f32 rounded to bf16, each in the upper half of its 32-bit lane (the lower
    /// half is garbage), as [`super::bf16_bits`] rounds (NaN stays NaN).
    #[target_feature(enable = "avx2")]
    unsafe fn rounded(x: __m256) -> __m256i {
        let bits = _mm256_castps_si256(x);
        let lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
        let sum = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
        let quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x0040_0000));
        let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
        _mm256_blendv_epi8(sum, quiet, nan)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn pairs_along(out: &mut [u32], run: &[f32]) {
        assert_eq!(run.len(), 2 * out.len());
        let mut i = 0;
        while i + 8 <= out.len() {
            let a = rounded(_mm256_loadu_ps(run.as_ptr().add(2 * i)));
            let b = rounded(_mm256_loadu_ps(run.as_ptr().add(2 * i + 8)));
            // The upper halves as u16, in order: pack (per 128-bit half) and restore the order.
            let packed = _mm256_packus_epi32(_mm256_srli_epi32(a, 16), _mm256_srli_epi32(b, 16));
            let ordered = _mm256_permute4x64_epi64::<0b11_01_10_00>(packed);
            _mm256_storeu_si256(out.as_mut_ptr().add(i).cast(), ordered);
            i += 8;
        }
        for j in i..out.len() {
            out[j] = bf16_pair(run[2 * j], run[2 * j + 1]);
        }
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn pairs_across(out: &mut [u32], lo: &[f32], hi: &[f32]) {
        assert!(lo.len() == out.len() && hi.len() == out.len());
        let upper = _mm256_set1_epi32(0xffff_0000u32 as i32);
        let mut i = 0;
        while i + 8 <= out.len() {
            let a = rounded(_mm256_loadu_ps(lo.as_ptr().add(i)));
            let b = rounded(_mm256_loadu_ps(hi.as_ptr().add(i)));
            let v = _mm256_or_si256(_mm256_srli_epi32(a, 16), _mm256_and_si256(b, upper));
            _mm256_storeu_si256(out.as_mut_ptr().add(i).cast(), v);
            i += 8;
        }
        for j in i..out.len() {
            out[j] = bf16_pair(lo[j], hi[j]);
        }
    }
}

/// Whole panels of `b` with AVX-512 (every CPU with AMX has it): 16 lines (or pairs) at a
/// time, rounded as [`bf16_bits`] rounds.
mod simd512 {
    /// Fills `panel` (PANEL / 2 pairs) with the 32 x 32 values of a whole panel of `b` that
    /// start at `from[0]`, line `l` and depth `d` at `from[l * ls + d * ds]`, where one of the
    /// strides is 1 and the CPU has AVX-512; returns whether it did.
    pub(super) fn columns(from: &[f32], (ls, ds): (usize, usize), panel: &mut [u32]) -> bool {
        #[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
        if std::is_x86_feature_detected!("avx512f") && (ls == 1 || ds == 1) {
            let last = (super::BLOCK - 1) * ls + (super::STEP - 1) * ds;
            assert!(
                last < from.len() && panel.len() == super::PANEL / 2,
                "a panel of b past its matrix ({last} of {} values) or of {} pairs",
                from.len(),
                panel.len()
            );
            // SAFETY: the CPU has AVX-512F; the panel's values lie within `from` (its last
            // one checked above) and `panel` holds PANEL / 2 pairs.
            unsafe {
                if ds == 1 {
                    x86::along(from.as_ptr(), ls, panel.as_mut_ptr())
                } else {
                    x86::across(from.as_ptr(), ds, panel.as_mut_ptr())
                }
            }
            return true;
        }
        let _ = (from, ls, ds, panel);
        false
    }

    #[cfg(all(target_arch = "x86_64", avx512_intrinsics))]
    mod x86 {
        use super::super::super::simd::x86_512::transpose;
        use super::super::{STEP, TILE};
        use std::arch::x86_64::*;

        /// 16 f32 rounded to bf16, to nearest even (NaN stays NaN, made quiet), each in the
        /// upper half of its lane (the lower half is garbage).
        #[target_feature(enable = "avx512f")]
        fn rounded(x: __m512) -> __m512i {
            let bits = _mm512_castps_si512(x);
            let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
            let sum = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
            let quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x0040_0000));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
            _mm512_mask_blend_epi32(nan, sum, quiet)
        }

        /// Lane by lane, the pair of `lo`'s bf16 (low half) and `hi`'s (high half), both from
        /// [`rounded`].
        #[target_feature(enable = "avx512f")]
        fn pairs(lo: __m512i, hi: __m512i) -> __m512i {
            let upper = _mm512_set1_epi32(0xffff_0000u32 as i32);
            _mm512_or_si512(_mm512_srli_epi32::<16>(lo), _mm512_and_si512(hi, upper))
        }

        /// Lines along `k` (`wᵀ` in the forward): each line's 32 values become 16 pairs, and
        /// 16 lines of pairs are transposed into a tile's 16 rows of pairs.
        ///
        /// # Safety
        /// AVX-512F; the 32 lines of 32 values from `from`, `ls` apart, are readable, and
        /// `panel` holds PANEL / 2 pairs.
        #[target_feature(enable = "avx512f")]
        pub(super) unsafe fn along(from: *const f32, ls: usize, panel: *mut u32) {
            let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
            for tile in 0..2 {
                let mut rows = [_mm512_setzero_ps(); 16];
                for (l, row) in rows.iter_mut().enumerate() {
                    // SAFETY (all below): within the panel the caller vouches for.
                    let line = unsafe { from.add((tile * TILE + l) * ls) };
                    let lo = rounded(unsafe { _mm512_loadu_ps(line) });
                    let hi = rounded(unsafe { _mm512_loadu_ps(line.add(16)) });
                    *row = _mm512_castsi512_ps(pairs(
                        _mm512_permutex2var_epi32(lo, even, hi),
                        _mm512_permutex2var_epi32(lo, odd, hi),
                    ));
                }
                transpose(&mut rows);
                for (p, row) in rows.iter().enumerate() {
                    let at = tile * (TILE * STEP / 2) + p * TILE;
                    unsafe { _mm512_storeu_ps(panel.add(at).cast(), *row) };
                }
            }
        }

        /// Lines side by side (`w` for the input's gradient): two rows of `k` make 16 pairs
        /// of each tile at once.
        ///
        /// # Safety
        /// As [`along`], the 32 rows of 32 values `ds` apart.
        #[target_feature(enable = "avx512f")]
        pub(super) unsafe fn across(from: *const f32, ds: usize, panel: *mut u32) {
            for p in 0..STEP / 2 {
                // SAFETY (all below): within the panel the caller vouches for.
                let (lo, hi) = unsafe { (from.add(2 * p * ds), from.add((2 * p + 1) * ds)) };
                for tile in 0..2 {
                    let (a, b) = unsafe {
                        (
                            _mm512_loadu_ps(lo.add(tile * TILE)),
                            _mm512_loadu_ps(hi.add(tile * TILE)),
                        )
                    };
                    let at = tile * (TILE * STEP / 2) + p * TILE;
                    let v = pairs(rounded(a), rounded(b));
                    unsafe { _mm512_storeu_si512(panel.add(at).cast(), v) };
                }
            }
        }
    }
}

/// `dst`'s elements, written by blocks from several threads.
struct Out {
    ptr: *mut f32,
    rs: isize,
    cs: isize,
    rows: usize,
    cols: usize,
}

// SAFETY: the threads write disjoint blocks of `dst` (each block's job runs once), which the
// caller borrows mutably for the whole product.
unsafe impl Sync for Out {}

impl Out {
    /// Writes (adds, when `accumulate`) the part of the 32 x 32 `sums` that lies inside `dst`
    /// at rows and columns from `(i0, j0)`.
    fn write(&self, i0: usize, j0: usize, sums: &[f32; BLOCK * BLOCK], accumulate: bool) {
        let (rows, cols) = (BLOCK.min(self.rows - i0), BLOCK.min(self.cols - j0));
        if self.cs == 1 {
            // Rows of dst lie along memory: a run of `cols` values per row.
            for (r, sums) in sums.chunks_exact(BLOCK).take(rows).enumerate() {
                let offset = (i0 + r) as isize * self.rs + j0 as isize;
                // SAFETY: as below, the run (this block's columns of row i0 + r) lies inside
                // dst, and this job alone writes it.
                let run = unsafe { std::slice::from_raw_parts_mut(self.ptr.offset(offset), cols) };
                if accumulate {
                    for (d, &v) in run.iter_mut().zip(sums) {
                        *d += v;
                    }
                } else {
                    run.copy_from_slice(&sums[..cols]);
                }
            }
            return;
        }
        for r in 0..rows {
            for c in 0..cols {
                let offset = (i0 + r) as isize * self.rs + (j0 + c) as isize * self.cs;
                // SAFETY: (i0 + r, j0 + c) is inside dst's rows and columns, whose strides
                // the view's constructor checked against its slice; no other thread writes
                // this block.
                unsafe {
                    let p = self.ptr.offset(offset);
                    let v = sums[r * BLOCK + c];
                    *p = if accumulate { *p + v } else { v };
                }
            }
        }
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod tiles {
    use super::{BLOCK, PANEL, STEP, TILE};
    use std::arch::asm;
    use std::arch::x86_64::__cpuid_count;

    /// Whether the CPU has AMX-TILE and AMX-BF16 and the kernel gives this process the tile
    /// data state.
    pub(super) fn enable() -> bool {
        // SAFETY: cpuid leaf 7 exists on every x86-64 CPU that could have AMX (leaf 0 says how
        // many there are). (Newer Rust has made `__cpuid_count` safe.)
        #[allow(unused_unsafe)]
        let (max_leaf, features) = unsafe { (__cpuid_count(0, 0).eax, __cpuid_count(7, 0)) };
        let (amx_bf16, amx_tile) = (features.edx & (1 << 22) != 0, features.edx & (1 << 24) != 0);
        if max_leaf < 7 || !amx_bf16 || !amx_tile {
            return false;
        }
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with these arguments only asks for a permission.
        let granted = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        if granted != 0 {
            log::info!(
                "the CPU has AMX but the kernel refused its tile state ({}): bf16 products \
                 run in f32",
                std::io::Error::last_os_error()
            );
        }
        granted == 0
    }

    /// Runs `f` with the tiles configured on this thread (8 tiles of 16 rows of 64 bytes),
    /// releasing them after.
    pub(super) fn with_config(f: impl FnOnce()) {
        let mut config = [0u8; 64];
        config[0] = 1; // palette 1
        for tile in 0..8 {
            config[16 + 2 * tile..18 + 2 * tile].copy_from_slice(&(STEP as u16 * 2).to_le_bytes());
            config[48 + tile] = TILE as u8;
        }
        // SAFETY: `enable` returned true (the only way here), so the instructions exist and
        // the process may use the tile state; the configuration is a valid palette-1 one.
        unsafe { asm!("ldtilecfg [{}]", in(reg) config.as_ptr(), options(nostack)) };
        f();
        // SAFETY: as above.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    /// `sums` (32 x 32, row-major) = the product of one block of packed rows of `a` and one
    /// of packed columns of `b`, over `steps` panels of each.
    ///
    /// # Safety
    /// `a` and `b` point to `steps * PANEL` bf16 values each; the tiles are configured on this
    /// thread ([`with_config`]).
    pub(super) unsafe fn block(
        a: *const u16,
        b: *const u16,
        steps: usize,
        sums: &mut [f32; BLOCK * BLOCK],
    ) {
        const _: () = assert!(PANEL == 1024 && BLOCK == 32);
        // tmm0..3 the four 16 x 16 sums; tmm4, tmm5 the two 16-row tiles of a's panel;
        // tmm6, tmm7 the two 16-column tiles of b's.
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "test {steps}, {steps}",
            "jz 3f",
            "2:",
            "tileloadd tmm4, [{a} + {row}]",
            "tileloadd tmm5, [{a} + {row} + 1024]",
            "tileloadd tmm6, [{b} + {row}]",
            "tileloadd tmm7, [{b} + {row} + 1024]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            // The next step's panels into the first-level cache while these products run
            // (5-10% faster on the Xeon, in products whose panels come from the second).
            ".irp ahead, 2048,2112,2176,2240,2304,2368,2432,2496,2560,2624,2688,2752,2816,2880,2944,3008,3072,3136,3200,3264,3328,3392,3456,3520,3584,3648,3712,3776,3840,3904,3968,4032",
            "prefetcht0 [{a} + \\ahead]",
            "prefetcht0 [{b} + \\ahead]",
            ".endr",
            "add {a}, 2048",
            "add {b}, 2048",
            "dec {steps}",
            "jnz 2b",
            "3:",
            "tilestored [{c} + {out_row}], tmm0",
            "tilestored [{c} + {out_row} + 64], tmm1",
            "tilestored [{c} + {out_row} + 2048], tmm2",
            "tilestored [{c} + {out_row} + 2112], tmm3",
            a = inout(reg) a => _,
            b = inout(reg) b => _,
            steps = inout(reg) steps => _,
            c = in(reg) sums.as_mut_ptr(),
            row = in(reg) 64usize,
            out_row = in(reg) 128usize,
            options(nostack),
        );
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
mod tiles {
    use super::BLOCK;

    /// No AMX off x86-64 Linux.
    pub(super) fn enable() -> bool {
        false
    }

    /// Never reached: [`super::available`] is false.
    pub(super) fn with_config(f: impl FnOnce()) {
        f()
    }

    /// Never reached: [`super::available`] is false.
    pub(super) unsafe fn block(
        _: *const u16,
        _: *const u16,
        _: usize,
        _: &mut [f32; BLOCK * BLOCK],
    ) {
        unreachable!("AMX tiles exist only on x86-64")
    }
}

#[cfg(test)]
mod tests {
    use super::super::kernels::test_values as values;
    use super::*;

    /// `a . b` in f64 over the bf16 roundings of `a` and `b` (row-major, `m x k`, `k x n`).
    fn reference(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
        let round = |x: f32| f32::from_bits((bf16_bits(x) as u32) << 16) as f64;
        let mut out = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|p| round(a[i * k + p]) * round(b[p * n + j]))
                    .sum();
            }
        }
        out
    }

    #[test]
    fn bf16_rounding_is_to_nearest_even() {
        for x in [
            1.0f32,
            -2.5,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            3.4e38,
            1e-40,
            0.0,
            -0.0,
        ] {
            assert_eq!(bf16_bits(x), half::bf16::from_f32(x).to_bits(), "{x}");
        }
        assert!(f32::from_bits((bf16_bits(f32::NAN) as u32) << 16).is_nan());
    }

    #[test]
    fn the_kept_buffers_stay_few_and_bounded() {
        // Other tests' products use the pool at the same time: only its invariants hold.
        for len in [1000, 10, 5000] {
            keep(vec![7; len]);
            let v = buffer(len + 1);
            assert_eq!(v.len(), len + 1);
            keep(v);
        }
        keep(Vec::with_capacity(SPARE_BYTES / 4 + 1)); // 4 bytes past the bound: freed
        let spare = SPARE.lock().unwrap_or_else(|e| e.into_inner());
        assert!(spare.len() <= SPARES, "{} buffers kept", spare.len());
        assert!(
            spare.iter().all(|v| v.capacity() * 4 <= SPARE_BYTES),
            "a buffer past {SPARE_BYTES} bytes kept"
        );
    }

    #[test]
    fn whole_panels_in_vectors_pack_to_the_same_bits() {
        // Ties, the largest values (which round to infinity), infinities, NaNs, subnormals
        // and signed zeros among ordinary values, in a weight read both ways.
        let special = [
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            -(1.0 + 1.0 / 256.0),
            f32::MAX,
            -f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001), // a signalling NaN
            1e-40,
            -1e-40,
            f32::from_bits(0x007f_ffff),
            0.0,
            -0.0,
        ];
        let (rows, cols) = (70, 100);
        let w: Vec<f32> = values(rows * cols, 3)
            .into_iter()
            .enumerate()
            .map(|(i, v)| {
                if i % 7 == 0 {
                    special[i / 7 % special.len()]
                } else {
                    v
                }
            })
            .collect();
        // wᵀ as the forward reads it (lines along k), then w as the input's gradient does
        // (lines side by side).
        for (lines, depth, ls, ds) in [(rows, cols, cols, 1), (cols, rows, 1, cols)] {
            let steps = depth.div_ceil(STEP);
            let packer = |whole_panels_in_vectors| Packer {
                data: &w,
                side: Side::Columns,
                lines,
                depth,
                ls,
                ds,
                whole_panels_in_vectors,
            };
            let mut probe = [0u32; PANEL / 2];
            if !simd512::columns(&w, (ls, ds), &mut probe) {
                eprintln!("no AVX-512 here: the scalar packing is compared with itself");
            }
            let (fast, plain) = (packer(true), packer(false));
            let mut scratch = Scratch::default();
            for block in 0..lines.div_ceil(BLOCK) {
                for step in 0..steps {
                    let (mut a, mut b) = ([7u32; PANEL / 2], [9u32; PANEL / 2]);
                    fast.fill(block, step, &mut a, &mut scratch);
                    plain.fill(block, step, &mut b, &mut scratch);
                    assert_eq!(a, b, "block {block}, step {step}, lines {ls} apart");
                }
            }
        }
    }

    #[test]
    fn products_of_odd_shapes_and_strides_equal_the_bf16_reference() {
        if !available() {
            eprintln!("skipped: no AMX tiles on this machine");
            return;
        }
        for (m, k, n) in [
            (1, 1, 1),
            (5, 7, 3),
            (33, 65, 31),
            (64, 32, 64),
            (70, 100, 129),
            (3, 300, 2),
            // 128 steps of k: groups of 2 row blocks, so 2 groups meet every stripe.
            (100, 4096, 40),
        ] {
            let (a, b) = (values(m * k, 1), values(k * n, 2));
            let want = reference(&a, &b, m, k, n);
            // a row-major and b as the transpose of a row-major n x k copy: both pack orders.
            let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
            for (accumulate, b_view) in [(false, 0), (true, 1)] {
                let mut dst = vec![0.5f32; m * n];
                let bm = if b_view == 0 {
                    Mat::rows_of(&b, n)
                } else {
                    Mat::transposed(&bt, k)
                };
                matmul(Mat::rows(&mut dst, n), Mat::rows_of(&a, k), bm, accumulate);
                let offset = if accumulate { 0.5 } else { 0.0 };
                for (got, want) in dst.iter().zip(&want) {
                    let tol = 1e-6 * k as f64 + 1e-6;
                    assert!(
                        (*got as f64 - offset - want).abs() <= tol,
                        "{m}x{k}x{n}: {got} against {want}"
                    );
                }
            }
            // a read with neither stride 1: every other value of a matrix twice as wide.
            let wide: Vec<f32> = a.iter().flat_map(|&v| [v, f32::NAN]).collect();
            let mut dst = vec![0f32; m * n];
            let a_view = Mat::strided(&wide, m, k, 2 * k, 2);
            matmul(Mat::rows(&mut dst, n), a_view, Mat::rows_of(&b, n), false);
            for (got, want) in dst.iter().zip(&want) {
                assert!(
                    (*got as f64 - want).abs() <= 1e-6 * k as f64 + 1e-6,
                    "{m}x{k}x{n} (wide)"
                );
            }
            // a read as columns of a wider matrix's transpose (rows one apart).
            let at: Vec<f32> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
            let mut dst = vec![0f32; m * n];
            matmul(
                Mat::rows(&mut dst, n),
                Mat::transposed(&at, m),
                Mat::rows_of(&b, n),
                false,
            );
            for (got, want) in dst.iter().zip(&want) {
                assert!(
                    (*got as f64 - want).abs() <= 1e-6 * k as f64 + 1e-6,
                    "{m}x{k}x{n} (at)"
                );
            }
        }
    }
}
