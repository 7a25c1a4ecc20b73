//! The mixed-precision policy of the data-parallel wrappers (torch FSDP2's
//! `MixedPrecisionPolicy`).

use crate::error::Result;
use candle_core::{DType, Tensor};

/// What dtypes a wrapper computes and communicates in, beside the dtype its parameters are kept
/// in (torch FSDP2's `MixedPrecisionPolicy`, for DistributedDataParallel (plain and ZeRO-2) and
/// FullyShardedDataParallel alike).
///
/// The parameters (the `VarMap`'s variables, or the pieces under sharding) stay in their dtype,
/// f32 for mixed precision: they are the master weights, and the optimizer keeps its state in
/// their dtype. Each forward computes with copies in `param_dtype` (under fully sharded
/// training the all-gather moves `param_dtype`); the gradients, computed in `param_dtype`, are
/// averaged in `reduce_dtype` and handed to the optimizer in the parameters' dtype.
///
/// ```rust
/// use candle_core::DType;
/// use candle_parallel::amp::MixedPrecision;
/// // torchtitan's default: bf16 compute, f32 gradient reduction.
/// let policy = MixedPrecision::bf16();
/// assert_eq!((policy.param_dtype, policy.reduce_dtype), (Some(DType::BF16), Some(DType::F32)));
/// assert!(MixedPrecision::default().is_off());
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MixedPrecision {
    /// The dtype forward and backward compute in (`None`: the parameters' own).
    pub param_dtype: Option<DType>,
    /// The dtype gradients travel and are averaged in (`None`: the gradients' own, as torch
    /// 2.15's FSDP2).
    pub reduce_dtype: Option<DType>,
    /// The dtype of the wrapper's output (`None`: whatever the model computes).
    pub output_dtype: Option<DType>,
    /// Cast floating-point inputs to `param_dtype` (default true, as torch).
    pub cast_forward_inputs: bool,
}

impl Default for MixedPrecision {
    /// No mixed precision: everything in the parameters' dtype.
    fn default() -> Self {
        Self {
            param_dtype: None,
            reduce_dtype: None,
            output_dtype: None,
            cast_forward_inputs: true,
        }
    }
}

impl MixedPrecision {
    /// bf16 compute, f32 gradient reduction, f32 output (torchtitan's default for every large
    /// model).
    pub fn bf16() -> Self {
        Self {
            param_dtype: Some(DType::BF16),
            reduce_dtype: Some(DType::F32),
            output_dtype: Some(DType::F32),
            cast_forward_inputs: true,
        }
    }

    /// f16 compute, f32 gradient reduction, f32 output; train with [`super::GradScaler`].
    pub fn f16() -> Self {
        Self {
            param_dtype: Some(DType::F16),
            ..Self::bf16()
        }
    }

    /// Logs a warning (once per process and dtype) where this policy computes in bf16 or f16
    /// on the CPU in a build that leaves candle's element-wise ops in that dtype on their slow
    /// path, naming the flags to build with ([`crate::nn::half_build_flags_missing`]).
    pub(crate) fn warn_if_slow_on(&self, device: &candle_core::Device) {
        if let Some(dtype) = self.param_dtype.filter(|_| device.is_cpu()) {
            crate::nn::warn_if_half_is_slow(dtype, "mixed precision");
        }
    }

    /// Whether the policy changes nothing.
    pub fn is_off(&self) -> bool {
        self.param_dtype.is_none() && self.reduce_dtype.is_none() && self.output_dtype.is_none()
    }

    /// The dtype parameters kept in `master` compute in.
    pub fn compute_dtype(&self, master: DType) -> DType {
        match self.param_dtype {
            Some(d) if master.is_float() => d,
            _ => master,
        }
    }

    /// The dtype gradients of `grad` dtype are averaged in.
    pub fn reduce_dtype(&self, grad: DType) -> DType {
        self.reduce_dtype.unwrap_or(grad)
    }

    /// `xs` as the model takes it: in `param_dtype` when it is a float and inputs are cast.
    pub fn cast_input(&self, xs: &Tensor) -> Result<Tensor> {
        Ok(match self.param_dtype {
            Some(d) if self.cast_forward_inputs && xs.dtype().is_float() && xs.dtype() != d => {
                xs.to_dtype(d)?
            }
            _ => xs.clone(),
        })
    }

    /// The model's output `ys` as the wrapper returns it.
    pub fn cast_output(&self, ys: Tensor) -> Result<Tensor> {
        Ok(match self.output_dtype {
            Some(d) if ys.dtype().is_float() && ys.dtype() != d => ys.to_dtype(d)?,
            _ => ys,
        })
    }
}
