//! Conversions between f32 and the half types on the CPU. [`cast`] is `to_dtype` between f32
//! and bf16 as an op of candle's graph: candle's `to_dtype` converts one value per call of a
//! closure (`unary_map`, 5-8% of a bf16 `transformer_ddp` step in perf); [`cast`] converts in a
//! loop the compiler vectorizes, to the same bits (round to nearest, ties to even; a NaN stays a
//! quiet NaN with its sign and top payload bits, as `half`'s `bf16::from_f32`). DDP's and FSDP's
//! mixed precision cast their weights and gradients with it.
//!
//! The layers that compute half tensors in f32 (linear, attention) take them as they are and
//! convert inside their ops with [`f32_values`], [`storage_in`] and [`tensor_in`]: a cast of
//! the graph around them cost a node whose gradient candle adds to a tensor of zeros (the
//! default model's bf16 step on one thread, alternating runs: 51 K → 57 K tokens/s).

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

/// `t` in `dtype`, as `t.to_dtype(dtype)` and with its backward: `t` itself where it is in
/// `dtype` already; between contiguous f32 and bf16 on the CPU by this module's loops;
/// elsewhere candle's.
pub(crate) fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    let (from, on_cpu) = (t.dtype(), t.device().is_cpu());
    match (from, dtype) {
        _ if from == dtype => Ok(t.clone()),
        (DType::F32, DType::BF16) | (DType::BF16, DType::F32) if on_cpu && t.is_contiguous() => {
            t.apply_op1(Cast)
        }
        _ => t.to_dtype(dtype),
    }
}

/// The f32 values of a contiguous CPU storage of f32 (borrowed), bf16 or f16 (widened, exactly):
/// what a layer's kernel reads when it takes half tensors itself instead of through a [`cast`]
/// (no op of candle's graph between, so no gradient of it for candle to add to zeros). `what`
/// names the operand in the error.
pub(super) fn f32_values<'a>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> Result<std::borrow::Cow<'a, [f32]>> {
    use std::borrow::Cow;
    Ok(match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Cow::Borrowed(&v[a..b]),
        (CpuStorage::BF16(v), Some((a, b))) => Cow::Owned(convert(&v[a..b], to_f32)),
        (CpuStorage::F16(v), Some((a, b))) => Cow::Owned(convert(&v[a..b], f16::to_f32)),
        _ => candle_core::bail!(
            "the {what} must be a contiguous f32, bf16 or f16 tensor, got {:?} laid out {l:?}",
            candle_core::backend::BackendStorage::dtype(s)
        ),
    })
}

/// `values` in `dtype` (f32, bf16 or f16), each rounded once as candle's `to_dtype` rounds it;
/// f32 values are moved, not copied.
pub(super) fn storage_in(values: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    match dtype {
        DType::F32 => Ok(CpuStorage::F32(values)),
        _ => rounded(&values, dtype),
    }
}

/// [`storage_in`] from borrowed values (which the caller keeps).
pub(super) fn rounded(values: &[f32], dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(values.to_vec()),
        DType::BF16 => CpuStorage::BF16(convert(values, to_bf16)),
        DType::F16 => CpuStorage::F16(convert(values, f16::from_f32)),
        other => candle_core::bail!("cast: f32, bf16 or f16 values, asked for {other:?}"),
    })
}

/// A CPU tensor of `shape` in `dtype` from f32 `values` (rounded once, see [`storage_in`]).
pub(super) fn tensor_in<S: Into<Shape>>(
    values: Vec<f32>,
    shape: S,
    dtype: DType,
) -> Result<Tensor> {
    let cpu = &candle_core::Device::Cpu;
    match dtype {
        DType::F32 => Tensor::from_vec(values, shape, cpu),
        DType::BF16 => Tensor::from_vec(convert(&values, to_bf16), shape, cpu),
        DType::F16 => Tensor::from_vec(convert(&values, f16::from_f32), shape, cpu),
        other => candle_core::bail!("cast: f32, bf16 or f16 values, asked for {other:?}"),
    }
}

/// A CPU tensor's values in f32 (see [`f32_values`]) for the duration of `f`.
pub(super) fn with_f32_values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(s) => f(&f32_values(s, layout, "tensor")?),
        _ => candle_core::bail!("expected a CPU tensor, got one on {:?}", t.device()),
    }
}

/// The cast as a candle op (to bf16 from f32, to f32 from bf16), whose backward casts the
/// gradient back.
struct Cast;

impl candle_core::CustomOp1 for Cast {
    fn name(&self) -> &'static str {
        "cast-bf16"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let shape = l.shape().clone();
        let out = match (s, l.contiguous_offsets()) {
            (CpuStorage::F32(v), Some((a, b))) => CpuStorage::BF16(convert(&v[a..b], to_bf16)),
            (CpuStorage::BF16(v), Some((a, b))) => CpuStorage::F32(convert(&v[a..b], to_f32)),
            // [`cast`] gives candle's cast the rest.
            _ => candle_core::bail!("cast: a contiguous f32 or bf16 tensor, got {l:?}"),
        };
        Ok((out, shape))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(cast(grad, arg.dtype())?))
    }
}

/// `f` of each of `src`'s values: on the calling thread up to [`ALONE`] values (split over two
/// threads, the casts of a dim-512 transformer step took longer: a hand-off per 32 K values),
/// in blocks of [`ALONE`] over rayon's threads above (a 25 M-parameter model's weights, cast
/// every step under mixed precision).
fn convert<A: Copy + Sync, B: Send>(src: &[A], f: impl Fn(A) -> B + Sync) -> Vec<B> {
    use rayon::prelude::*;
    let mut out = Vec::with_capacity(src.len());
    let fill = |dst: &mut [std::mem::MaybeUninit<B>], src: &[A]| {
        for (d, &v) in dst.iter_mut().zip(src) {
            d.write(f(v));
        }
    };
    let dst = &mut out.spare_capacity_mut()[..src.len()];
    if src.len() <= ALONE || rayon::current_num_threads() == 1 {
        fill(dst, src);
    } else {
        dst.par_chunks_mut(ALONE)
            .zip(src.par_chunks(ALONE))
            .for_each(|(d, s)| fill(d, s));
    }
    // SAFETY: `fill` wrote each of the first `src.len()` values (`dst` is that long, and is
    // covered by the chunks `src`'s chunks pair with one for one).
    unsafe { out.set_len(src.len()) };
    out
}

/// The most values one thread casts alone.
const ALONE: usize = 1 << 18;

/// `v` in f32: bf16 is f32's top half, and a NaN is made quiet (as `half`'s `to_f32`).
#[inline(always)]
pub(super) fn to_f32(v: bf16) -> f32 {
    let x = u32::from(v.to_bits()) << 16;
    let nan = v.to_bits() & 0x7fff > 0x7f80;
    f32::from_bits(if nan { x | 0x0040_0000 } else { x })
}

/// `v` rounded to bf16 as the tiles' packing rounds it ([`super::amx::bf16_bits`]: to nearest,
/// ties to even, on the bits; a NaN keeps its top bits and is made quiet).
#[inline(always)]
pub(super) fn to_bf16(v: f32) -> bf16 {
    bf16::from_bits(super::amx::bf16_bits(v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Every f32 kind of value: both zeros, subnormals, the largest finite (which rounds to
    /// infinity), infinities, NaNs with payloads, ties either way, and random ones.
    fn specials() -> Vec<f32> {
        let mut v: Vec<f32> = [
            0.0,
            -0.0,
            1.0,
            -1.5,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-45,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xffc1_2345),
            f32::from_bits(0x3f80_8000), // a tie, kept part even: down
            f32::from_bits(0x3f81_8000), // a tie, kept part odd: up
            f32::from_bits(0x3f80_8001),
            f32::from_bits(0x3f80_7fff),
            f32::from_bits(0x7f7f_8000), // rounds to infinity
        ]
        .to_vec();
        v.extend(
            super::super::kernels::test_values(100_003, 7)
                .iter()
                .map(|x| x * 1e3),
        );
        v
    }

    #[test]
    fn both_ways_give_candles_bits_on_every_kind_of_value() -> Result<()> {
        let v = specials();
        let x = Tensor::from_vec(v.clone(), v.len(), &Device::Cpu)?;
        let (ours, candles) = (cast(&x, DType::BF16)?, x.to_dtype(DType::BF16)?);
        let bits = |t: &Tensor| -> Result<Vec<u16>> {
            Ok(t.to_vec1::<bf16>()?.iter().map(|b| b.to_bits()).collect())
        };
        assert_eq!(bits(&ours)?, bits(&candles)?);
        let (back, candles_back) = (cast(&ours, DType::F32)?, ours.to_dtype(DType::F32)?);
        let f32_bits = |t: &Tensor| -> Result<Vec<u32>> {
            Ok(t.to_vec1::<f32>()?.iter().map(|f| f.to_bits()).collect())
        };
        assert_eq!(f32_bits(&back)?, f32_bits(&candles_back)?);
        Ok(())
    }

    #[test]
    fn every_bf16_and_every_rounding_case_of_f32_give_halfs_bits() {
        // bf16 to f32: all 65,536 values, signalling NaNs included.
        for b in 0..=u16::MAX {
            let v = bf16::from_bits(b);
            assert_eq!(to_f32(v).to_bits(), v.to_f32().to_bits(), "bf16 {b:#06x}");
        }
        // f32 to bf16: every top half (sign, exponent, kept bits) with the dropped halves that
        // decide the rounding: zero, just above zero, just below a tie, a tie, just above it,
        // the largest.
        for high in 0..=u32::from(u16::MAX) {
            for low in [0, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
                let x = f32::from_bits(high << 16 | low);
                assert_eq!(
                    to_bf16(x).to_bits(),
                    bf16::from_f32(x).to_bits(),
                    "f32 {:#010x}",
                    x.to_bits()
                );
            }
        }
    }

    /// Tensors longer than [`ALONE`] values are cast in blocks over the threads: the same bits
    /// as candle's, with a partial last block and a view that starts inside the storage.
    #[test]
    fn long_tensors_cast_over_the_threads_give_candles_bits() -> Result<()> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("a pool");
        let n = 3 * ALONE + 5;
        let x = Tensor::randn(0f32, 3.0, n + 7, &Device::Cpu)?.narrow(0, 7, n)?;
        pool.install(|| -> Result<()> {
            let (ours, candles) = (cast(&x, DType::BF16)?, x.to_dtype(DType::BF16)?);
            let bits = |t: &Tensor| -> Result<Vec<u16>> {
                Ok(t.to_vec1::<bf16>()?.iter().map(|b| b.to_bits()).collect())
            };
            assert_eq!(bits(&ours)?, bits(&candles)?);
            let back = cast(&ours, DType::F32)?.to_vec1::<f32>()?;
            let candles_back = ours.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            assert!(back
                .iter()
                .zip(&candles_back)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            assert_eq!(back.len(), n);
            Ok(())
        })
    }

    #[test]
    fn views_with_an_offset_and_empty_tensors_cast_as_candles() -> Result<()> {
        let x = Tensor::arange(0f32, 24.0, &Device::Cpu)?.reshape((4, 3, 2))?;
        // Rows 1..3: contiguous, starting 6 values in.
        let rows = x.narrow(0, 1, 2)?;
        assert!(rows.is_contiguous());
        let ours = cast(&rows, DType::BF16)?;
        assert_eq!(ours.dims(), [2, 3, 2]);
        assert_eq!(
            ours.to_dtype(DType::F32)?.to_vec3::<f32>()?,
            rows.to_vec3::<f32>()?
        );
        let empty = Tensor::zeros((0, 5), DType::BF16, &Device::Cpu)?;
        let wide = cast(&empty, DType::F32)?;
        assert_eq!((wide.dims(), wide.dtype()), ([0, 5].as_slice(), DType::F32));
        Ok(())
    }

    #[test]
    fn the_gradient_is_cast_back_and_other_casts_are_candles() -> Result<()> {
        let x = Var::from_tensor(&Tensor::new(&[[1.0f32, -2.5, 3.25]], &Device::Cpu)?)?;
        let y = cast(x.as_tensor(), DType::BF16)?;
        let g = Tensor::new(&[[0.5f32, 2.0, -1.0]], &Device::Cpu)?.to_dtype(DType::BF16)?;
        let grads = (y * g)?.sum_all()?.backward()?;
        let dx = grads.get(x.as_tensor()).expect("x has a gradient");
        assert_eq!(dx.dtype(), DType::F32);
        assert_eq!(dx.to_vec2::<f32>()?, [[0.5, 2.0, -1.0]]);
        // Same dtype: the tensor itself (a watched copy stays recognisable by its id).
        assert_eq!(cast(x.as_tensor(), DType::F32)?.id(), x.as_tensor().id());
        // f16 and strided views: candle's.
        let t = x.as_tensor().t()?;
        for dtype in [DType::F16, DType::BF16] {
            assert_eq!(
                cast(&t, dtype)?.to_dtype(DType::F32)?.to_vec2::<f32>()?,
                [[1.0], [-2.5], [3.25]]
            );
        }
        Ok(())
    }
}
