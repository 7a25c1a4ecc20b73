//! [`LayerNorm`] and [`RmsNorm`]: candle-nn's modules of the same names, whose forward has a
//! backward in every case.
//!
//! candle-nn's modules route a contiguous input into the fused `ops::layer_norm` and
//! `ops::rms_norm`, which have no backward (candle issue
//! [#2168](https://github.com/huggingface/candle/issues/2168)): every parameter upstream of such
//! a layer silently stops training. These build the same variables under the same names
//! (`weight`, or `gamma`, and `bias`, or `beta`), take the same configuration and give the same
//! numbers, through [`ops`](super::ops), which has a backward.
//!
//! ```rust
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use candle_parallel::nn;
//! # fn main() -> candle_core::Result<()> {
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let below = candle_nn::linear(3, 3, vb.pp("below"))?;
//! let norm = nn::layer_norm(3, 1e-5, vb.pp("norm"))?;
//! let x = Tensor::new(&[[1f32, 2., 3.], [3., 0., 1.]], &Device::Cpu)?;
//! let y = norm.forward(&below.forward(&x)?)?;
//! let weights = Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?;
//! let grads = y.broadcast_mul(&weights)?.sum_all()?.backward()?;
//! // The linear layer below the normalisation gets its gradient.
//! assert!(grads.get(below.weight()).is_some());
//! # Ok(()) }
//! ```

use super::ops;
use candle_core::{Module, Result, Tensor};
use candle_nn::{Init, LayerNormConfig, VarBuilder};

/// Layer normalisation over the last dimension (or RMS normalisation, without the mean), as
/// `candle_nn::LayerNorm`, with a backward.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Option<Tensor>,
    remove_mean: bool,
    eps: f64,
}

impl LayerNorm {
    /// Layer normalisation with a scale and a shift.
    pub fn new(weight: Tensor, bias: Tensor, eps: f64) -> Self {
        Self {
            weight,
            bias: Some(bias),
            remove_mean: true,
            eps,
        }
    }

    /// Layer normalisation with a scale only.
    pub fn new_no_bias(weight: Tensor, eps: f64) -> Self {
        Self {
            weight,
            bias: None,
            remove_mean: true,
            eps,
        }
    }

    /// RMS normalisation (no mean removed) with a scale.
    pub fn rms_norm(weight: Tensor, eps: f64) -> Self {
        Self {
            weight,
            bias: None,
            remove_mean: false,
            eps,
        }
    }

    /// The scale.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The shift, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The epsilon added to the variance.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// Whether the mean is removed (layer normalisation) or not (RMS normalisation).
    pub fn remove_mean(&self) -> bool {
        self.remove_mean
    }
}

/// Takes candle-nn's layer, with its variables, so that it trains.
impl From<candle_nn::LayerNorm> for LayerNorm {
    fn from(ln: candle_nn::LayerNorm) -> Self {
        Self {
            weight: ln.weight().clone(),
            bias: ln.bias().cloned(),
            remove_mean: ln.remove_mean(),
            eps: ln.eps(),
        }
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let eps = self.eps as f32;
        match (self.remove_mean, &self.bias) {
            (true, Some(bias)) => ops::layer_norm(x, &self.weight, bias, eps),
            (true, None) => ops::layer_norm_no_bias(x, &self.weight, eps),
            (false, bias) => {
                let y = ops::rms_norm(x, &self.weight, eps)?;
                match bias {
                    Some(bias) => super::accumulate::broadcast_add(&y, bias),
                    None => Ok(y),
                }
            }
        }
    }
}

/// Builds a [`LayerNorm`] of `size` features from `vb`, as `candle_nn::layer_norm` (same
/// variables, same names, same initial values).
pub fn layer_norm<C: Into<LayerNormConfig>>(
    size: usize,
    config: C,
    vb: VarBuilder,
) -> Result<LayerNorm> {
    let config = config.into();
    let name = |names: [&'static str; 2]| {
        names
            .into_iter()
            .find(|n| vb.contains_tensor(n))
            .unwrap_or(names[0])
    };
    let weight = vb.get_with_hints(size, name(["weight", "gamma"]), Init::Const(1.))?;
    let bias = if config.affine {
        Some(vb.get_with_hints(size, name(["bias", "beta"]), Init::Const(0.))?)
    } else {
        None
    };
    Ok(LayerNorm {
        weight,
        bias,
        remove_mean: config.remove_mean,
        eps: config.eps,
    })
}

/// Builds a [`LayerNorm`] without a shift, as `candle_nn::layer_norm_no_bias`.
pub fn layer_norm_no_bias(size: usize, eps: f64, vb: VarBuilder) -> Result<LayerNorm> {
    let config = LayerNormConfig {
        eps,
        remove_mean: true,
        affine: false,
    };
    layer_norm(size, config, vb)
}

/// RMS normalisation over the last dimension, as `candle_nn::RmsNorm`, with a backward.
#[derive(Clone, Debug)]
pub struct RmsNorm(LayerNorm);

impl RmsNorm {
    /// RMS normalisation with the scale `weight`.
    pub fn new(weight: Tensor, eps: f64) -> Self {
        Self(LayerNorm::rms_norm(weight, eps))
    }

    /// The layer as a [`LayerNorm`] without mean removal.
    pub fn into_inner(self) -> LayerNorm {
        self.0
    }

    /// The scale.
    pub fn weight(&self) -> &Tensor {
        self.0.weight()
    }

    /// The epsilon added to the mean square.
    pub fn eps(&self) -> f64 {
        self.0.eps()
    }

    /// The forward pass; candle-nn's differentiable path, here the same as `forward`.
    pub fn forward_diff(&self, xs: &Tensor) -> Result<Tensor> {
        self.0.forward(xs)
    }
}

/// Takes candle-nn's layer, with its variables, so that it trains.
impl From<candle_nn::RmsNorm> for RmsNorm {
    fn from(rms: candle_nn::RmsNorm) -> Self {
        Self(rms.into_inner().into())
    }
}

impl Module for RmsNorm {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.0.forward(xs)
    }
}

/// Builds an [`RmsNorm`] of `size` features from `vb`, as `candle_nn::rms_norm`.
pub fn rms_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<RmsNorm> {
    let config = LayerNormConfig {
        eps,
        remove_mean: false,
        affine: false,
    };
    Ok(RmsNorm(layer_norm(size, config, vb)?))
}
