//! Stopping where the loss stops being a number: [`FiniteLoss`] notes each step's loss on the
//! device, without waiting for it, and [`FiniteLoss::check`] fails with
//! [`Error::NonFiniteLoss`](crate::Error::NonFiniteLoss) naming the first step whose loss was
//! NaN or infinite. A corrupt checkpoint, bad data or a learning rate that is too high would
//! otherwise train on with NaN weights, report `loss NaN` and save them.
//!
//! Check before each checkpoint and at the end of each epoch: one number read from the device.
//! (f16 training with a gradient scaler skips such steps on purpose instead.)
//!
//! ```rust
//! use candle_core::{Device, Tensor};
//! use candle_parallel::optim::FiniteLoss;
//! # fn main() -> candle_parallel::Result<()> {
//! let mut finite = FiniteLoss::new(&Device::Cpu)?;
//! finite.observe(&Tensor::new(0.7f32, &Device::Cpu)?, 1)?;
//! finite.check()?;
//! finite.observe(&Tensor::new(f32::NAN, &Device::Cpu)?, 2)?;
//! finite.observe(&Tensor::new(f32::INFINITY, &Device::Cpu)?, 3)?;
//! let err = finite.check().unwrap_err().to_string();
//! assert!(err.contains("NaN at step 2"), "{err}");
//! # Ok(()) }
//! ```

use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};

/// Watches the losses of a training loop for NaN and infinity (see the
/// [module documentation](self)).
#[derive(Clone, Debug)]
pub struct FiniteLoss {
    /// The first step whose loss was not finite (+inf while there is none), f64 on the device.
    first: Tensor,
    /// That step's loss.
    value: Tensor,
}

impl FiniteLoss {
    /// A watch with nothing seen yet, whose numbers live on `device` (the loss's).
    pub fn new(device: &Device) -> Result<Self> {
        Ok(Self {
            first: Tensor::new(f64::INFINITY, device)?,
            value: Tensor::new(0f64, device)?,
        })
    }

    /// Notes the loss of step `step` (a tensor of any shape and float dtype: its sum is what
    /// is checked). Launches a few kernels; waits for nothing.
    pub fn observe(&mut self, loss: &Tensor, step: u64) -> Result<()> {
        let l = loss.detach().to_dtype(DType::F64)?.sum_all()?;
        // x * 0 is 0 for every finite x, NaN for NaN and for either infinity.
        let finite = l.affine(0.0, 0.0)?.eq(0f64)?;
        let device = l.device();
        let at = finite.where_cond(
            &Tensor::new(f64::INFINITY, device)?,
            &Tensor::new(step as f64, device)?,
        )?;
        let earlier = at.lt(&self.first)?;
        self.value = earlier.where_cond(&l, &self.value)?;
        self.first = self.first.minimum(&at)?;
        Ok(())
    }

    /// Fails with [`Error::NonFiniteLoss`] when a loss noted so far was NaN or infinite,
    /// naming the first such step and its loss. Reads two numbers from the device.
    pub fn check(&self) -> Result<()> {
        let first = self.first.to_device(&Device::Cpu)?.to_scalar::<f64>()?;
        if first.is_finite() {
            let value = self.value.to_device(&Device::Cpu)?.to_scalar::<f64>()?;
            return Err(Error::NonFiniteLoss {
                step: first as u64,
                value,
            });
        }
        Ok(())
    }
}
