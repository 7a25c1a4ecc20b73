//! Rotary position embeddings with a backward: [`rope`], [`rope_i`] and [`rope_thd`], drop-ins
//! for `candle_nn::rotary_emb`'s functions of the same names.
//!
//! candle 0.11 applies them without a backward (candle issue
//! [#2168](https://github.com/huggingface/candle/issues/2168)), so the projections that produce
//! the queries and keys would get no gradient through them. These take the same arguments and
//! give the same forward numbers (candle's arithmetic on the CPU, candle's kernels on CUDA).
//! A rotation's backward is the opposite rotation, so the input's gradient is the same kernel
//! run with `-sin` (in f32 for f16 and bf16 inputs); `cos` and `sin` get gradients too when they
//! are tracked (made of variables). Unlike candle's, they also take non-contiguous inputs and
//! tables longer than the sequence.
//!
//! ```rust
//! use candle_core::{Device, Tensor, Var};
//! use candle_parallel::nn::rotary_emb::rope;
//! # fn main() -> candle_core::Result<()> {
//! let (b, h, t, d) = (1, 2, 3, 4);
//! let q = Var::from_tensor(&Tensor::randn(0f32, 1., (b, h, t, d), &Device::Cpu)?)?;
//! let angles = Tensor::arange(0f32, (t * d / 2) as f32, &Device::Cpu)?.reshape((t, d / 2))?;
//! let rotated = rope(&q, &angles.cos()?, &angles.sin()?)?;
//! let grads = rotated.sqr()?.sum_all()?.backward()?;
//! // A rotation keeps lengths: d/dq of |rope(q)|^2 is 2q.
//! let diff = (grads.get(&q).unwrap() - (q.as_tensor() * 2.)?)?.abs()?.max_all()?;
//! assert!(diff.to_scalar::<f32>()? < 1e-5);
//! # Ok(()) }
//! ```

use super::accumulate::wide;
use super::ops::check_float;
use super::rows::{self, values, with_float_slices, Elem};
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

pub use candle_nn::rotary_emb::{rope_i_slow, rope_slow};

/// Rotary embeddings over `xs` of shape `(batch, heads, seq, dim)`, rotating the first half of
/// the last dimension against the second; `cos` and `sin` are `(seq', dim / 2)` or
/// `(batch, seq', dim / 2)` with `seq' >= seq`. With a backward (see the [module docs](self)).
pub fn rope(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    Variant::Halves.apply(xs, cos, sin)
}

/// As [`rope`], with the pairs interleaved along the last dimension (`x0, x1, x0, x1, ...`).
pub fn rope_i(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    Variant::Interleaved.apply(xs, cos, sin)
}

/// As [`rope`], for `xs` of shape `(batch, seq, heads, dim)`.
pub fn rope_thd(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    Variant::Thd.apply(xs, cos, sin)
}

/// Which of candle's three rotary embeddings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    /// `(b, h, t, d)`, halves rotated against each other (`rope`).
    Halves,
    /// `(b, h, t, d)`, neighbours rotated against each other (`rope_i`).
    Interleaved,
    /// `(b, t, h, d)`, halves (`rope_thd`).
    Thd,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Self::Halves => "rope",
            Self::Interleaved => "rope_i",
            Self::Thd => "rope_thd",
        }
    }

    /// The dimension of the heads and of the sequence in `xs`.
    fn head_and_seq_dims(self) -> (usize, usize) {
        match self {
            Self::Thd => (2, 1),
            _ => (1, 2),
        }
    }

    fn apply(self, xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let what = self.name();
        check_float(what, &[("input", xs), ("cos", cos), ("sin", sin)])?;
        let dims = match xs.dims() {
            &[a, b, c, d] => [a, b, c, d],
            other => candle_core::bail!(
                "{what}: the input has shape {other:?}; it takes 4 dimensions, {}",
                if self == Self::Thd {
                    "(batch, seq, heads, dim)"
                } else {
                    "(batch, heads, seq, dim)"
                }
            ),
        };
        let (batch, seq, dim) = (dims[0], dims[self.head_and_seq_dims().1], dims[3]);
        if dim % 2 != 0 {
            candle_core::bail!("{what}: the last dimension of the input ({dim}) must be even")
        }
        let table = |t: &Tensor, name: &str| -> Result<Tensor> {
            let seq_axis = match *t.dims() {
                [_, half] if half * 2 == dim => 0,
                [b, _, half] if half * 2 == dim && b == batch => 1,
                _ => candle_core::bail!(
                    "{what}: {name} has shape {:?}; for the input {:?} it takes (seq, {}) or \
                     ({batch}, seq, {}) with seq at least {seq}",
                    t.dims(),
                    xs.dims(),
                    dim / 2,
                    dim / 2
                ),
            };
            if t.dim(seq_axis)? < seq {
                candle_core::bail!(
                    "{what}: {name} covers {} positions, the input has {seq}",
                    t.dim(seq_axis)?
                )
            }
            t.narrow(seq_axis, 0, seq)?.contiguous()
        };
        let (cos, sin) = (table(cos, "cos")?, table(sin, "sin")?);
        if xs.elem_count() == 0 {
            return xs.contiguous();
        }
        xs.contiguous()?.apply_op3(
            &cos,
            &sin,
            Rope {
                variant: self,
                wide: false,
            },
        )
    }
}

/// A rotary embedding as a custom op over `(x, cos, sin)`.
#[derive(Clone, Copy, Debug)]
struct Rope {
    variant: Variant,
    /// Compute in f32 for f16 and bf16 (the backward); the forward repeats candle's arithmetic.
    wide: bool,
}

impl candle_core::CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "cp-rotary-emb"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = l1.shape().dims4()?;
        let batched = l2.dims().len() == 3;
        let out = with_float_slices!(&[s1, s2, s3], |v: T| {
            let x = values(v[0], l1, "the input")?;
            let cos = values(v[1], l2, "cos")?;
            let sin = values(v[2], l3, "sin")?;
            rows::storage(rotate::<T>(*self, x, cos, sin, dims, batched))
        });
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let kernel = match self.variant {
            Variant::Halves => "rope",
            Variant::Interleaved => "rope_i",
            Variant::Thd => "rope_thd",
        };
        super::fused_cuda::rope(kernel, s1, l1, s2, l2, s3, l3)
    }

    fn bwd(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let back = Rope {
            variant: self.variant,
            wide: true,
        };
        let dtype = x.dtype();
        // The opposite rotation: our CPU kernel computes it in f32 itself; candle's CUDA kernels
        // compute in the element type, so half types go through f32 there.
        let dx = if x.device().is_cpu() || !matches!(dtype, DType::F16 | DType::BF16) {
            grad.contiguous()?
                .apply_op3_no_bwd(cos, &sin.neg()?, &back)?
        } else {
            let f32 = |t: &Tensor| t.to_dtype(DType::F32);
            f32(grad)?
                .apply_op3_no_bwd(&f32(cos)?, &f32(&sin.neg()?)?, &back)?
                .to_dtype(dtype)?
        };
        if !(cos.track_op() || sin.track_op()) {
            return Ok((Some(dx), None, None));
        }
        let (dcos, dsin) = self.table_grads(x, grad, cos.rank() == 3)?;
        Ok((Some(dx), Some(dcos), Some(dsin)))
    }
}

impl Rope {
    /// The gradients of the `cos` and `sin` tables (`batched`: one per batch element), made of
    /// candle ops in f32 (f64 for f64).
    fn table_grads(&self, x: &Tensor, grad: &Tensor, batched: bool) -> Result<(Tensor, Tensor)> {
        let dtype = x.dtype();
        let (x, g) = (x.to_dtype(wide(dtype))?, grad.to_dtype(wide(dtype))?);
        let half = x.dim(D::Minus1)? / 2;
        // The two members of each rotated pair, as tensors of the pairs' shape.
        let pair = |t: &Tensor| -> Result<(Tensor, Tensor)> {
            match self.variant {
                Variant::Interleaved => {
                    let mut dims = t.dims()[..3].to_vec();
                    dims.extend([half, 2]);
                    let t = t.reshape(dims)?;
                    Ok((
                        t.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?,
                        t.narrow(D::Minus1, 1, 1)?.squeeze(D::Minus1)?,
                    ))
                }
                _ => Ok((
                    t.narrow(D::Minus1, 0, half)?,
                    t.narrow(D::Minus1, half, half)?,
                )),
            }
        };
        let ((x1, x2), (g1, g2)) = (pair(&x)?, pair(&g)?);
        // y1 = x1 cos - x2 sin, y2 = x1 sin + x2 cos.
        let dcos = ((&g1 * &x1)? + (&g2 * &x2)?)?;
        let dsin = ((&g2 * &x1)? - (&g1 * &x2)?)?;
        let heads = self.variant.head_and_seq_dims().0;
        let reduce = |t: Tensor| -> Result<Tensor> {
            let t = t.sum(heads)?;
            let t = if batched { t } else { t.sum(0)? };
            t.to_dtype(dtype)
        };
        Ok((reduce(dcos)?, reduce(dsin)?))
    }
}

/// One rotated pair: candle's arithmetic in the element type, or f32 when `wide`.
#[inline(always)]
fn turn<T: Elem>(wide: bool, a: T, b: T, c: T, s: T) -> (T, T) {
    if wide {
        let (a, b, c, s) = (a.up(), b.up(), c.up(), s.up());
        (T::down(a * c - b * s), T::down(a * s + b * c))
    } else {
        (a * c - b * s, a * s + b * c)
    }
}

/// The CPU kernel: `x` of `dims` (as the variant reads them) rotated by the `cos`/`sin` tables,
/// one per batch element when `batched`.
fn rotate<T: Elem>(
    op: Rope,
    x: &[T],
    cos: &[T],
    sin: &[T],
    dims: (usize, usize, usize, usize),
    batched: bool,
) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    if x.is_empty() {
        return out;
    }
    let wide = op.wide;
    let (_, d1, d2, d) = dims;
    let half = d / 2;
    match op.variant {
        Variant::Halves | Variant::Interleaved => {
            let (h, t) = (d1, d2);
            x.par_chunks(t * d)
                .zip(out.par_chunks_mut(t * d))
                .enumerate()
                .for_each(|(bh, (src, dst))| {
                    let base = if batched { (bh / h) * t * half } else { 0 };
                    for i_t in 0..t {
                        for i_d in 0..half {
                            let cs = base + i_t * half + i_d;
                            let (i1, i2) = if op.variant == Variant::Interleaved {
                                let i = 2 * (i_t * half + i_d);
                                (i, i + 1)
                            } else {
                                (i_t * d + i_d, i_t * d + i_d + half)
                            };
                            (dst[i1], dst[i2]) = turn(wide, src[i1], src[i2], cos[cs], sin[cs]);
                        }
                    }
                });
        }
        Variant::Thd => {
            let (t, h) = (d1, d2);
            x.par_chunks(t * h * d)
                .zip(out.par_chunks_mut(t * h * d))
                .enumerate()
                .for_each(|(b, (src, dst))| {
                    let base = if batched { b * t * half } else { 0 };
                    for i_t in 0..t {
                        for i_d in 0..half {
                            let cs = base + i_t * half + i_d;
                            for i_h in 0..h {
                                let i1 = (i_t * h + i_h) * d + i_d;
                                let i2 = i1 + half;
                                (dst[i1], dst[i2]) = turn(wide, src[i1], src[i2], cos[cs], sin[cs]);
                            }
                        }
                    }
                });
        }
    }
    out
}
