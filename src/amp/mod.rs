//! Mixed precision (torch's `torch.amp`): [`GradScaler`] for f16's dynamic loss scaling.
//!
//! ```rust
//! use candle_parallel::amp::{GradScaler, GradScalerConfig};
//! # fn main() -> candle_parallel::Result<()> {
//! let scaler = GradScaler::new(GradScalerConfig::default())?;
//! assert_eq!(scaler.scale_factor(), 65536.0);
//! # Ok(()) }
//! ```

mod grad_scaler;

pub use grad_scaler::{GradScaler, GradScalerConfig};
