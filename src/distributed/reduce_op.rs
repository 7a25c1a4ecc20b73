//! How values from all ranks are combined: the one rule every backend follows.
//!
//! Each [`ReduceOp`] is defined here once, element by element, and the host-memory backends
//! (TCP, in-process) reduce with exactly this code; the NCCL backend maps each op onto NCCL's
//! and corrects where NCCL differs (NaN in `Max`/`Min`). The rule is PyTorch's:
//!
//! - `Sum`, `Avg` and `Product` are IEEE arithmetic (so NaN and `inf - inf` give NaN); `Avg`
//!   is the sum divided by the number of ranks, once, at the end.
//! - `Max` and `Min` propagate NaN (PyTorch's `maximum` / `minimum`), and order the zeros as
//!   IEEE 754-2019's `maximum` / `minimum` do (`-0 < +0`), which makes them commutative and
//!   associative: every reduction order, on every backend, gives the same bits.
//! - Half-precision values (f16, bf16) are combined in f32 and rounded back after each step, as
//!   an element-wise half-precision operation is.
//!
//! Collectives take the float dtypes in [`SUPPORTED_DTYPES`]; any other dtype is an error that
//! names it, never a silent conversion.
//!
//! ```rust
//! use candle_core::{Device, Tensor};
//! use candle_parallel::distributed::{self, ReduceOp};
//! # fn main() -> candle_parallel::Result<()> {
//! let maxima = distributed::spawn_threads(2, |pg| {
//!     let x = if pg.rank() == 0 { [1.0f32, f32::NAN] } else { [3.0, 2.0] };
//!     let y = pg.all_reduce(&Tensor::new(&x, &Device::Cpu)?, ReduceOp::Max)?;
//!     Ok(y.to_vec1::<f32>()?)
//! })?;
//! assert_eq!(maxima[0][0], 3.0);
//! assert!(maxima[0][1].is_nan()); // NaN wins, on every backend
//! # Ok(()) }
//! ```

use crate::error::{Error, Result};
use candle_core::DType;
use half::{bf16, f16};
use std::fmt;

/// How values from all ranks are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over the ranks (sum divided by the world size).
    Avg,
    /// Element-wise maximum (NaN wins).
    Max,
    /// Element-wise minimum (NaN wins).
    Min,
    /// Element-wise product.
    Product,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Sum => "sum",
            Self::Avg => "avg",
            Self::Max => "max",
            Self::Min => "min",
            Self::Product => "product",
        })
    }
}

/// The dtypes collectives take.
pub const SUPPORTED_DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// Fails, naming `dtype`, when collectives do not take it.
pub(crate) fn check_dtype(dtype: DType) -> Result<()> {
    if SUPPORTED_DTYPES.contains(&dtype) {
        return Ok(());
    }
    Err(Error::InvalidArgument {
        what: "collective dtype",
        detail: format!(
            "{dtype:?} is not supported: collectives take f32, f64, f16 or bf16 tensors; convert \
             with `to_dtype` first"
        ),
    })
}

/// A float element type that collectives combine, and that crosses the wire as its
/// little-endian bytes.
pub(crate) trait Element: Copy + Send + Sync + 'static {
    const SIZE: usize;
    fn from_le(bytes: &[u8]) -> Self;
    /// `op` applied to one pair of elements (`Avg` sums; see [`Element::average`]).
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self;
    /// The last step of `Avg`: the sum divided by the number of ranks.
    fn average(self, ranks: usize) -> Self;
}

/// NaN-propagating maximum with `-0 < +0`.
#[inline(always)]
fn maximum<T: Float>(a: T, b: T) -> T {
    if a.is_nan() {
        a
    } else if b.is_nan() || b > a || (a == b && a.is_sign_negative()) {
        b
    } else {
        a
    }
}

/// NaN-propagating minimum with `-0 < +0`.
#[inline(always)]
fn minimum<T: Float>(a: T, b: T) -> T {
    if a.is_nan() {
        a
    } else if b.is_nan() || b < a || (a == b && b.is_sign_negative()) {
        b
    } else {
        a
    }
}

/// What [`maximum`] and [`minimum`] need of f32 and f64.
trait Float: PartialOrd + Copy {
    fn is_nan(self) -> bool;
    fn is_sign_negative(self) -> bool;
}

macro_rules! float_element {
    ($t:ty) => {
        impl Float for $t {
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            #[inline(always)]
            fn is_sign_negative(self) -> bool {
                <$t>::is_sign_negative(self)
            }
        }

        impl Element for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            #[inline(always)]
            fn from_le(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("element-sized chunk"))
            }
            #[inline(always)]
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    ReduceOp::Product => a * b,
                    ReduceOp::Max => maximum(a, b),
                    ReduceOp::Min => minimum(a, b),
                }
            }
            fn average(self, ranks: usize) -> Self {
                self / ranks as $t
            }
        }
    };
}

macro_rules! half_element {
    ($t:ty) => {
        impl Element for $t {
            const SIZE: usize = 2;
            #[inline(always)]
            fn from_le(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("element-sized chunk"))
            }
            #[inline(always)]
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                <$t>::from_f32(f32::combine(op, a.to_f32(), b.to_f32()))
            }
            fn average(self, ranks: usize) -> Self {
                <$t>::from_f32(self.to_f32() / ranks as f32)
            }
        }
    };
}

float_element!(f32);
float_element!(f64);
half_element!(f16);
half_element!(bf16);

#[cfg(test)]
mod tests {
    use super::*;

    const OPS: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Product,
    ];

    #[test]
    fn nan_wins_max_and_min_from_either_side() {
        for (a, b) in [(f32::NAN, 1.0), (1.0, f32::NAN), (f32::NAN, f32::INFINITY)] {
            assert!(f32::combine(ReduceOp::Max, a, b).is_nan(), "max({a}, {b})");
            assert!(f32::combine(ReduceOp::Min, a, b).is_nan(), "min({a}, {b})");
        }
        assert_eq!(f64::combine(ReduceOp::Max, 1.0, 2.0), 2.0);
        assert_eq!(f64::combine(ReduceOp::Min, 1.0, 2.0), 1.0);
    }

    #[test]
    fn every_op_is_commutative_bit_for_bit_including_signed_zeros() {
        let values = [
            0.0f32,
            -0.0,
            1.5,
            -2.25,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            0.1,
        ];
        for op in OPS {
            for a in values {
                for b in values {
                    let (x, y) = (f32::combine(op, a, b), f32::combine(op, b, a));
                    assert!(
                        x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
                        "{op}({a}, {b}) = {x} but {op}({b}, {a}) = {y}"
                    );
                }
            }
        }
        assert!(f32::combine(ReduceOp::Max, -0.0, 0.0).is_sign_positive());
        assert!(f32::combine(ReduceOp::Min, 0.0, -0.0).is_sign_negative());
        assert!(f32::combine(ReduceOp::Sum, f32::INFINITY, f32::NEG_INFINITY).is_nan());
    }

    #[test]
    fn half_types_combine_in_f32_and_round_back() {
        let (a, b) = (bf16::from_f32(1.0), bf16::from_f32(1.0 / 256.0));
        // 1 + 2^-8 is not a bf16 (8 bits of precision): it rounds back to 1.
        assert_eq!(bf16::combine(ReduceOp::Sum, a, b), a);
        assert!(f16::combine(ReduceOp::Max, f16::NAN, f16::ONE).is_nan());
        assert_eq!(f16::from_f32(3.0).average(2), f16::from_f32(1.5));
    }

    #[test]
    fn unsupported_dtypes_are_named() {
        for dtype in SUPPORTED_DTYPES {
            assert!(check_dtype(dtype).is_ok());
        }
        let err = check_dtype(DType::U32).unwrap_err().to_string();
        assert!(err.contains("U32") && err.contains("to_dtype"), "{err}");
    }
}
