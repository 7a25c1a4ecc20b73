//! Seeded, reproducible variable initialisation.
//!
//! candle's CPU random generator cannot be seeded, so two runs (or two ranks) of the same model
//! start from different weights. [`seeded_var_builder`] is a `VarBuilder` over a `VarMap` that
//! creates each missing variable from [`Rng`] seeded by the seed and the variable's name. The
//! values do not depend on the device, the order variables are created in, or the machine, and
//! they follow candle-nn's `Init` hints (constants, uniform, normal, Kaiming).
//!
//! ```rust
//! use candle_core::{DType, Device};
//! use candle_nn::{linear, VarMap};
//! use candle_parallel::init::seeded_var_builder;
//! # fn main() -> candle_core::Result<()> {
//! let (a, b) = (VarMap::new(), VarMap::new());
//! let la = linear(4, 2, seeded_var_builder(&a, 7, DType::F32, &Device::Cpu))?;
//! let lb = linear(4, 2, seeded_var_builder(&b, 7, DType::F32, &Device::Cpu))?;
//! assert_eq!(la.weight().to_vec2::<f32>()?, lb.weight().to_vec2::<f32>()?);
//! # Ok(()) }
//! ```

use crate::rng::{fnv1a, Rng};
use crate::util::sync::lock;
use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::init::NormalOrUniform;
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};

/// A `VarBuilder` on `device` that takes existing variables from `varmap` and creates missing
/// ones there, initialised from `seed` and the variable's name.
pub fn seeded_var_builder(
    varmap: &VarMap,
    seed: u64,
    dtype: DType,
    device: &Device,
) -> VarBuilder<'static> {
    let backend = Seeded {
        varmap: varmap.clone(),
        seed,
    };
    VarBuilder::from_backend(Box::new(backend), dtype, device.clone())
}

/// The values `init` gives a variable named `name` of `shape` under `seed`, as f64 on the CPU.
pub fn seeded_values(init: Init, shape: &Shape, name: &str, seed: u64) -> Vec<f64> {
    let mut rng = Rng::new(seed ^ fnv1a(name.as_bytes()));
    let n = shape.elem_count();
    let uniform = |rng: &mut Rng, lo: f64, up: f64| -> Vec<f64> {
        (0..n).map(|_| rng.uniform_in(lo, up)).collect()
    };
    let normal = |rng: &mut Rng, mean: f64, std: f64| -> Vec<f64> {
        (0..n).map(|_| mean + std * rng.normal()).collect()
    };
    match init {
        Init::Const(v) => vec![v; n],
        Init::Uniform { lo, up } => uniform(&mut rng, lo, up),
        Init::Randn { mean, stdev } => normal(&mut rng, mean, stdev),
        Init::Kaiming {
            dist,
            fan,
            non_linearity,
        } => {
            let std = non_linearity.gain() / (fan.for_shape(shape) as f64).sqrt();
            match dist {
                NormalOrUniform::Uniform => {
                    let bound = 3f64.sqrt() * std;
                    uniform(&mut rng, -bound, bound)
                }
                NormalOrUniform::Normal => normal(&mut rng, 0.0, std),
            }
        }
    }
}

struct Seeded {
    varmap: VarMap,
    seed: u64,
}

impl SimpleBackend for Seeded {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut vars = lock(self.varmap.data());
        if let Some(var) = vars.get(name) {
            if var.shape() != &s {
                candle_core::bail!(
                    "shape mismatch on {name}: asked for {s:?}, the VarMap has {:?}",
                    var.shape()
                )
            }
            return Ok(var.as_tensor().clone());
        }
        let values = seeded_values(h, &s, name, self.seed);
        let t = Tensor::from_vec(values, s, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(dev)?;
        let var = Var::from_tensor(&t)?;
        vars.insert(name.to_string(), var.clone());
        Ok(var.as_tensor().clone())
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        match lock(self.varmap.data()).get(name) {
            Some(var) => Ok(var.as_tensor().clone()),
            None => candle_core::bail!("variable {name} is not in the VarMap"),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        lock(self.varmap.data()).contains_key(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_nn::init::{FanInOut, NonLinearity};

    #[test]
    fn values_depend_on_seed_and_name_only() {
        let shape = Shape::from((3, 4));
        let init = Init::Uniform { lo: -1.0, up: 1.0 };
        let a = seeded_values(init, &shape, "fc.weight", 1);
        assert_eq!(a, seeded_values(init, &shape, "fc.weight", 1));
        assert_ne!(a, seeded_values(init, &shape, "fc.weight", 2));
        assert_ne!(a, seeded_values(init, &shape, "fc.bias", 1));
        assert!(a.iter().all(|v| (-1.0..1.0).contains(v)));
    }

    #[test]
    fn kaiming_uniform_uses_the_fan_in_bound() {
        let shape = Shape::from((8, 300));
        let init = Init::Kaiming {
            dist: NormalOrUniform::Uniform,
            fan: FanInOut::FanIn,
            non_linearity: NonLinearity::ReLU,
        };
        let bound = 3f64.sqrt() * 2f64.sqrt() / 300f64.sqrt();
        let v = seeded_values(init, &shape, "w", 0);
        assert!(v.iter().all(|x| x.abs() <= bound));
        assert!(v.iter().any(|x| x.abs() > 0.9 * bound));
    }

    #[test]
    fn existing_variables_are_kept_and_new_ones_land_in_the_varmap() -> candle_core::Result<()> {
        let varmap = VarMap::new();
        let vb = seeded_var_builder(&varmap, 3, DType::F32, &Device::Cpu);
        let first = vb.get_with_hints((2, 2), "w", Init::Const(0.5))?;
        let again = vb.get_with_hints((2, 2), "w", Init::Const(9.0))?;
        assert_eq!(again.to_vec2::<f32>()?, [[0.5, 0.5], [0.5, 0.5]]);
        assert_eq!(first.id(), again.id());
        assert!(vb.get_with_hints((3, 2), "w", Init::Const(0.0)).is_err());
        assert_eq!(varmap.all_vars().len(), 1);
        Ok(())
    }
}
