//! Causal multi-head self-attention as one op, from the packed projection `qkv` to the heads'
//! outputs side by side: [`causal_attention`].
//!
//! Composed from candle ops, attention reshapes and permutes `qkv` into queries, keys and
//! values (three copies), multiplies, scales, masks and normalises the scores, multiplies by
//! the values and transposes back; its backward then adds each of those copies' gradients into
//! fresh zeros through strided writes. Here, for f32 tensors on the CPU, each head of each
//! sequence reads its queries, keys and values where they lie in `qkv` (rows `3 * dim` apart),
//! and works through blocks of [`ROWS`] query rows: their scores against the keys they may see
//! (never more of the score matrix than a block's), the softmax, the product with the values.
//! The forward keeps each row's log-sum-exp; the backward recomputes a block's probabilities
//! from it and writes the three gradients into one `qkv`-shaped tensor. f16 and bf16 tensors on
//! the CPU go through the same kernel in f32 (widened once, the output and the input's gradient
//! rounded once); other dtypes and devices run the composed ops, which the kernel must equal
//! (`tests/layers.rs`).
//!
//! ```rust
//! use candle_core::{Device, Tensor};
//! use candle_parallel::nn::attention::causal_attention;
//! # fn main() -> candle_core::Result<()> {
//! // 2 sequences of 5 positions, width 8 in 2 heads: qkv is (2, 5, 3 * 8).
//! let qkv = Tensor::randn(0f32, 1., (2, 5, 24), &Device::Cpu)?;
//! let y = causal_attention(&qkv, 2)?;
//! assert_eq!(y.dims(), [2, 5, 8]);
//! // The first position sees only itself: its output is its own value.
//! let v0 = qkv.narrow(2, 16, 8)?.narrow(1, 0, 1)?;
//! let diff = (y.narrow(1, 0, 1)? - v0)?.abs()?.max_all()?.to_scalar::<f32>()?;
//! assert!(diff < 1e-6);
//! # Ok(()) }
//! ```

use super::cast::{f32_values, storage_in, tensor_in, with_f32_values};
use super::kernels::{matmul, ours_in_f32, Mat};
use super::ops::softmax_last_dim;
use crate::util::sync::lock;
use candle_core::{CpuStorage, DType, Device, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::sync::Mutex;

/// Query rows per block: a block's scores are at most this many rows of the sequence's length.
pub const ROWS: usize = 64;

/// Causal multi-head self-attention: `qkv` is `(batch, time, 3 * dim)`, the queries, keys and
/// values of `heads` heads side by side (`[q | k | v]`, each `dim = heads * head_dim` wide, head
/// `h` at columns `h * head_dim..`), as one linear layer projects them. Returns `(batch, time,
/// dim)`: for each head, `softmax(q kᵀ / sqrt(head_dim) + causal mask) v`, the heads side by
/// side (torch's `scaled_dot_product_attention(q, k, v, is_causal=True)` with the heads'
/// transposes). Position `i` attends to positions `0..=i`.
pub fn causal_attention(qkv: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, t, width) = qkv.dims3()?;
    if heads == 0 || width % 3 != 0 || (width / 3) % heads != 0 {
        candle_core::bail!(
            "causal_attention: qkv is {:?}; its last dimension must be 3 * dim with dim a \
             multiple of the {heads} heads",
            qkv.dims()
        )
    }
    let dim = width / 3;
    // f16 and bf16 run the f32 kernel, each value widened once (inside the op: no cast of
    // candle's graph between) and each output (and each input gradient) rounded once, as
    // torch's CPU attention computes half types.
    let dtype = match ours_in_f32(&[qkv]) {
        Some(dtype) if b * t * dim != 0 => dtype,
        _ => return composed(qkv, heads),
    };
    let op = CausalAttention {
        dtype,
        batch: b,
        time: t,
        heads,
        head_dim: dim / heads,
        lse: Mutex::new(Vec::new()),
    };
    qkv.contiguous()?.apply_op1(op)
}

/// [`causal_attention`] from candle ops (and our softmax), for any dtype and device.
pub fn composed(qkv: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, t, width) = qkv.dims3()?;
    let dim = width / 3;
    let hd = dim / heads;
    // (b, t, 3, heads, hd) -> three of (b, heads, t, hd)
    let qkv = qkv
        .reshape((b, t, 3, heads, hd))?
        .permute((2, 0, 3, 1, 4))?;
    let q = qkv.get(0)?.contiguous()?;
    let k = qkv.get(1)?.contiguous()?;
    let v = qkv.get(2)?.contiguous()?;
    let scores = (q.matmul(&k.t()?.contiguous()?)? / (hd as f64).sqrt())?;
    let mask: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu)?
        .to_device(scores.device())?
        .to_dtype(scores.dtype())?;
    let att = softmax_last_dim(&scores.broadcast_add(&mask)?)?;
    att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, dim))
}

/// The op, with each row's log-sum-exp of its scaled scores (set by the forward).
struct CausalAttention {
    /// The dtype of `qkv` and the output (f32, bf16 or f16); the kernel computes in f32.
    dtype: DType,
    batch: usize,
    time: usize,
    heads: usize,
    head_dim: usize,
    /// `(batch, heads, time)`.
    lse: Mutex<Vec<f32>>,
}

/// One head of one sequence: where its queries, keys and values lie in the sequence's `qkv`
/// rows (each `3 * dim` long).
#[derive(Clone, Copy)]
struct Head {
    dim: usize,
    head_dim: usize,
    h: usize,
}

impl Head {
    fn row(&self) -> usize {
        3 * self.dim
    }

    /// Rows `r0..r1` of the queries (`part` 0), keys (1) or values (2) in `qkv`: a
    /// `(r1 - r0) x head_dim` view.
    fn part<'a>(&self, qkv: &'a [f32], part: usize, r0: usize, r1: usize) -> Mat<&'a [f32]> {
        let at = r0 * self.row() + part * self.dim + self.h * self.head_dim;
        Mat::strided(&qkv[at..], r1 - r0, self.head_dim, self.row(), 1)
    }

    /// The transpose of the keys' rows `0..n`: `head_dim x n`.
    fn keys_t<'a>(&self, qkv: &'a [f32], n: usize) -> Mat<&'a [f32]> {
        let at = self.dim + self.h * self.head_dim;
        Mat::strided(&qkv[at..], self.head_dim, n, 1, self.row())
    }

    /// The transpose of the values' rows `0..n`: `head_dim x n`.
    fn values_t<'a>(&self, qkv: &'a [f32], n: usize) -> Mat<&'a [f32]> {
        let at = 2 * self.dim + self.h * self.head_dim;
        Mat::strided(&qkv[at..], self.head_dim, n, 1, self.row())
    }

    /// `1 / sqrt(head_dim)` is not what the composed ops compute: they divide by the root.
    fn root(&self) -> f32 {
        (self.head_dim as f64).sqrt() as f32
    }

    /// The scaled scores of query rows `r0..r1` against keys `0..r1` into `s` (rows `r1` long).
    fn scores(&self, qkv: &[f32], r0: usize, r1: usize, s: &mut [f32]) {
        let s = &mut s[..(r1 - r0) * r1];
        matmul(
            Mat::rows(s, r1),
            self.part(qkv, 0, r0, r1),
            self.keys_t(qkv, r1),
            false,
        );
        let root = self.root();
        for v in s.iter_mut() {
            *v /= root;
        }
    }
}

impl CausalAttention {
    fn dim(&self) -> usize {
        self.heads * self.head_dim
    }

    fn head(&self, h: usize) -> Head {
        Head {
            dim: self.dim(),
            head_dim: self.head_dim,
            h,
        }
    }

    /// One sequence's forward: `out` (`time x dim`) and `lse` (`heads x time`) from its `qkv`.
    fn forward_sequence(&self, qkv: &[f32], out: &mut [f32], lse: &mut [f32]) {
        let t = self.time;
        let mut s = vec![0f32; ROWS.min(t) * t];
        for h in 0..self.heads {
            let head = self.head(h);
            for r0 in (0..t).step_by(ROWS) {
                let r1 = (r0 + ROWS).min(t);
                head.scores(qkv, r0, r1, &mut s);
                for (i, row) in s[..(r1 - r0) * r1].chunks_mut(r1).enumerate() {
                    let seen = r0 + i + 1;
                    let (visible, future) = row.split_at_mut(seen);
                    let max = visible.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0f32;
                    for v in visible.iter_mut() {
                        *v = (*v - max).exp();
                        sum += *v;
                    }
                    for v in visible.iter_mut() {
                        *v /= sum;
                    }
                    future.fill(0.0);
                    lse[h * t + r0 + i] = max + sum.ln();
                }
                let at = r0 * self.dim() + h * self.head_dim;
                matmul(
                    Mat::strided_rows(&mut out[at..], r1 - r0, self.head_dim, self.dim()),
                    Mat::rows_of(&s[..(r1 - r0) * r1], r1),
                    head.part(qkv, 2, 0, r1),
                    false,
                );
            }
        }
    }

    /// One sequence's backward: the gradient of its `qkv` into `dqkv` (zeros on entry) from
    /// the output's gradient `dout` and the forward's `lse`.
    fn backward_sequence(&self, (qkv, dout, lse): (&[f32], &[f32], &[f32]), dqkv: &mut [f32]) {
        let (t, dim, hd) = (self.time, self.dim(), self.head_dim);
        let block = ROWS.min(t) * t;
        let (mut p, mut ds) = (vec![0f32; block], vec![0f32; block]);
        for h in 0..self.heads {
            let head = self.head(h);
            let root = head.root();
            for r0 in (0..t).step_by(ROWS) {
                let (r1, rows) = ((r0 + ROWS).min(t), (r0 + ROWS).min(t) - r0);
                let (p, ds) = (&mut p[..rows * r1], &mut ds[..rows * r1]);
                // The probabilities again, from the scores and each row's log-sum-exp.
                head.scores(qkv, r0, r1, p);
                for (i, row) in p.chunks_mut(r1).enumerate() {
                    let seen = r0 + i + 1;
                    let l = lse[h * t + r0 + i];
                    for v in &mut row[..seen] {
                        *v = (*v - l).exp();
                    }
                    row[seen..].fill(0.0);
                }
                // dP = dO vᵀ, then dS = P * (dP - Σ_j P dP) / sqrt(head_dim). The row sum is
                // taken from this block's P and dP, not as rowsum(dO * O) (FlashAttention's
                // shortcut): with a nearly one-hot row that cancels against O's rounding and was
                // 22 times less accurate than the composed ops at scores near 1e4.
                let dout_blk = Mat::strided(&dout[r0 * dim + h * hd..], rows, hd, dim, 1);
                matmul(Mat::rows(ds, r1), dout_blk, head.values_t(qkv, r1), false);
                for (dsr, pr) in ds.chunks_mut(r1).zip(p.chunks(r1)) {
                    let delta: f32 = dsr.iter().zip(pr).map(|(d, q)| d * q).sum();
                    for (d, &pv) in dsr.iter_mut().zip(pr) {
                        *d = pv * (*d - delta) / root;
                    }
                }
                let row = head.row();
                // dQ rows = dS k.
                let at = r0 * row + h * hd;
                matmul(
                    Mat::strided_rows(&mut dqkv[at..], rows, hd, row),
                    Mat::rows_of(ds, r1),
                    head.part(qkv, 1, 0, r1),
                    false,
                );
                // dK rows 0..r1 += dSᵀ q; dV rows 0..r1 += Pᵀ dO.
                let at = dim + h * hd;
                matmul(
                    Mat::strided_rows(&mut dqkv[at..], r1, hd, row),
                    Mat::strided(ds, r1, rows, 1, r1),
                    head.part(qkv, 0, r0, r1),
                    true,
                );
                let at = 2 * dim + h * hd;
                matmul(
                    Mat::strided_rows(&mut dqkv[at..], r1, hd, row),
                    Mat::strided(p, r1, rows, 1, r1),
                    Mat::strided(&dout[r0 * dim + h * hd..], rows, hd, dim, 1),
                    true,
                );
            }
        }
    }
}

impl candle_core::CustomOp1 for CausalAttention {
    fn name(&self) -> &'static str {
        "causal-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let qkv = f32_values(s, l, "causal_attention's qkv")?;
        let (b, t, dim) = (self.batch, self.time, self.dim());
        let mut out = vec![0f32; b * t * dim];
        let mut lse = vec![0f32; b * self.heads * t];
        out.par_chunks_mut(t * dim)
            .zip(lse.par_chunks_mut(self.heads * t))
            .zip(qkv.par_chunks(3 * t * dim))
            .for_each(|((out, lse), qkv)| self.forward_sequence(qkv, out, lse));
        *lock(&self.lse) = lse;
        Ok((storage_in(out, self.dtype)?, Shape::from((b, t, dim))))
    }

    fn bwd(&self, qkv: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (b, t, dim) = (self.batch, self.time, self.dim());
        let lse = lock(&self.lse);
        if lse.len() != b * self.heads * t {
            candle_core::bail!("causal_attention: the backward ran before the forward");
        }
        let mut dqkv = vec![0f32; b * t * 3 * dim];
        with_f32_values(qkv, |qkv_v| {
            with_f32_values(grad, |dout| {
                dqkv.par_chunks_mut(3 * t * dim)
                    .enumerate()
                    .for_each(|(i, dqkv)| {
                        let parts = (
                            &qkv_v[i * t * 3 * dim..(i + 1) * t * 3 * dim],
                            &dout[i * t * dim..(i + 1) * t * dim],
                            &lse[i * self.heads * t..(i + 1) * self.heads * t],
                        );
                        self.backward_sequence(parts, dqkv)
                    });
                Ok(())
            })
        })?;
        Ok(Some(tensor_in(dqkv, (b, t, 3 * dim), self.dtype)?))
    }
}
