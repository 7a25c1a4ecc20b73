//! Mixed precision (torch's `torch.amp` and FSDP2's `MixedPrecisionPolicy`): [`MixedPrecision`],
//! the dtypes the data-parallel wrappers compute and average gradients in beside their f32
//! master weights, and [`GradScaler`] for f16's dynamic loss scaling.
//!
//! ```rust
//! use candle_parallel::amp::{GradScaler, GradScalerConfig};
//! # fn main() -> candle_parallel::Result<()> {
//! let scaler = GradScaler::new(GradScalerConfig::default())?;
//! assert_eq!(scaler.scale_factor(), 65536.0);
//! # Ok(()) }
//! ```

mod grad_scaler;
mod policy;

pub use grad_scaler::{GradScaler, GradScalerConfig};
pub use policy::MixedPrecision;
