//! [`Stage`]: one part of a model-parallel model and its device, and the errors that name it.

use crate::error::{device_name, Error, Result};
use crate::parallel::parallel_apply::panic_message;
use candle_core::{Device, Module, Tensor};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// One part of a model and the device its variables live on.
pub struct Stage {
    pub(super) device: Device,
    pub(super) module: Box<dyn Module + Send + Sync>,
}

impl Stage {
    /// `module`, whose variables are on `device` (build it with a `VarBuilder` on `device`).
    pub fn new(device: &Device, module: impl Module + Send + Sync + 'static) -> Self {
        Self {
            device: device.clone(),
            module: Box::new(module),
        }
    }

    /// The stage's device.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

impl std::fmt::Debug for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stage({})", device_name(&self.device))
    }
}

/// Stage `i`'s forward (of micro-batch `j` where the forward is pipelined), a panic in it made
/// an error.
pub(super) fn compute(stage: &Stage, i: usize, j: Option<usize>, x: &Tensor) -> Result<Tensor> {
    match catch_unwind(AssertUnwindSafe(|| stage.module.forward(x))) {
        Ok(Ok(y)) => Ok(y),
        Ok(Err(source)) => Err(failed(stage, i, j, source)),
        Err(payload) => Err(failed(
            stage,
            i,
            j,
            candle_core::Error::Msg(format!("panicked: {}", panic_message(payload.as_ref()))),
        )),
    }
}

/// Stage `i` failed, on micro-batch `j` where the forward is pipelined.
pub(super) fn failed(
    stage: &Stage,
    i: usize,
    j: Option<usize>,
    source: candle_core::Error,
) -> Error {
    Error::Stage {
        stage: i,
        device: device_name(&stage.device),
        micro_batch: j,
        source: Box::new(source),
    }
}
