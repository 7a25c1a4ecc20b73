//! Building a model's replicas from its master variables.
//!
//! A candle model is built by a constructor that takes a `VarBuilder`. Replication therefore
//! needs no cooperation from the model: [`build_master`] runs the constructor once against the
//! user's `VarMap` and records which variables the model uses, and [`replica_var_builder`]
//! hands a later call of the same constructor those variables copied to another device.
//! The copies are differentiable (`Tensor::to_device`), so the gradient of every replica flows
//! back into the master variable and the optimizer sees one summed gradient.
//!
//! ```rust
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{linear, VarMap};
//! use candle_parallel::replicate::{build_master, replica_var_builder};
//! # fn main() -> candle_parallel::Result<()> {
//! let varmap = VarMap::new();
//! let (master, names) = build_master(&varmap, DType::F32, &Device::Cpu, |vb| linear(3, 2, vb))?;
//! assert_eq!(names, ["bias", "weight"]);
//!
//! let replica = linear(3, 2, replica_var_builder(&varmap, DType::F32, &Device::Cpu))?;
//! let x = Tensor::ones((1, 3), DType::F32, &Device::Cpu)?;
//! let (a, b) = (master.forward(&x)?, replica.forward(&x)?);
//! assert_eq!(a.to_vec2::<f32>()?, b.to_vec2::<f32>()?);
//! # Ok(()) }
//! ```

use crate::error::{device_name, Error, Result};
use crate::util::ordered_copy::to_device;
use crate::util::sync::lock;
use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};
use std::collections::{BTreeSet, HashMap};
use std::sync::{Mutex, MutexGuard};

/// Builds the master model on `device` from `varmap` (creating missing variables there, as
/// `VarBuilder::from_varmap` does) and returns it with the sorted names of the variables it uses.
///
/// Fails with [`Error::VariableNotOnDevice`] when one of those variables already existed on
/// another device.
pub fn build_master<M, F>(
    varmap: &VarMap,
    dtype: DType,
    device: &Device,
    build: F,
) -> Result<(M, Vec<String>)>
where
    F: FnOnce(VarBuilder) -> candle_core::Result<M>,
{
    let recorder = Recorder {
        varmap: varmap.clone(),
        names: Mutex::new(BTreeSet::new()),
    };
    let module = build(VarBuilder::from_backend(
        Box::new(&recorder),
        dtype,
        device.clone(),
    ))?;
    let names: Vec<String> = lock(&recorder.names).iter().cloned().collect();
    let vars = lock(varmap.data());
    for name in &names {
        if let Some(var) = vars.get(name) {
            if !var.device().same_device(device) {
                return Err(Error::VariableNotOnDevice {
                    layer: crate::error::DATA_PARALLEL_MASTER,
                    name: name.clone(),
                    found: device_name(var.device()),
                    expected: device_name(device),
                });
            }
        }
    }
    Ok((module, names))
}

/// A `VarBuilder` on `device` whose variables are `varmap`'s, copied there differentiably.
///
/// On the variable's own device the replica gets an alias that shares the master's storage but
/// is not the master `Var` itself, so layers that update state in place during the forward
/// (BatchNorm's running statistics) change a private copy, as replicas do in PyTorch; only the
/// master model's updates persist. Asking for a variable the `VarMap` lacks is an error
/// ([`Error::UnknownVariable`]): replicas never create variables.
pub fn replica_var_builder(varmap: &VarMap, dtype: DType, device: &Device) -> VarBuilder<'static> {
    VarBuilder::from_backend(
        Box::new(Replica {
            varmap: varmap.clone(),
        }),
        dtype,
        device.clone(),
    )
}

/// Delegates to the `VarMap` and remembers every name asked for.
struct Recorder {
    varmap: VarMap,
    names: Mutex<BTreeSet<String>>,
}

impl SimpleBackend for &Recorder {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.varmap.get(s, name, h, dtype, dev)?;
        lock(&self.names).insert(name.to_string());
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.varmap.get_unchecked(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.varmap.contains_tensor(name)
    }
}

/// Hands out copies of existing master variables.
struct Replica {
    varmap: VarMap,
}

impl Replica {
    fn fetch(&self, name: &str, dev: &Device) -> candle_core::Result<Var> {
        lock(self.varmap.data()).get(name).cloned().ok_or_else(|| {
            Error::UnknownVariable {
                name: name.to_string(),
                device: device_name(dev),
            }
            .into_candle()
        })
    }

    fn copy_to(var: &Var, dev: &Device) -> candle_core::Result<Tensor> {
        let t = var.as_tensor();
        if t.device().same_device(dev) {
            // A new tensor id over the same storage; its gradient flows into the master.
            t.reshape(t.shape())
        } else {
            to_device(t, dev, false)
        }
    }
}

impl SimpleBackend for Replica {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: Init,
        _: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let var = self.fetch(name, dev)?;
        if var.shape() != &s {
            return Err(candle_core::Error::UnexpectedShape {
                msg: format!("replica asked for variable `{name}` with another shape"),
                expected: s,
                got: var.shape().clone(),
            });
        }
        Self::copy_to(&var, dev)
    }

    fn get_unchecked(&self, name: &str, _: DType, dev: &Device) -> candle_core::Result<Tensor> {
        Self::copy_to(&self.fetch(name, dev)?, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        lock(self.varmap.data()).contains_key(name)
    }
}

/// The variables of `varmap` named in `names`, in that order.
pub(crate) fn vars_by_name(varmap: &VarMap, names: &[String]) -> Vec<Var> {
    let vars: MutexGuard<'_, HashMap<String, Var>> = lock(varmap.data());
    names.iter().filter_map(|n| vars.get(n).cloned()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Module;
    use candle_nn::{batch_norm, linear, ModuleT};

    #[test]
    fn master_records_sorted_names_and_replica_gradients_reach_the_master() -> Result<()> {
        let varmap = VarMap::new();
        let build = |vb: VarBuilder| {
            let a = linear(4, 3, vb.pp("b_layer"))?;
            let b = linear(3, 2, vb.pp("a_layer"))?;
            Ok((a, b))
        };
        let ((a, b), names) = build_master(&varmap, DType::F32, &Device::Cpu, build)?;
        assert_eq!(
            names,
            [
                "a_layer.bias",
                "a_layer.weight",
                "b_layer.bias",
                "b_layer.weight"
            ]
        );
        let (ra, rb) = build(replica_var_builder(&varmap, DType::F32, &Device::Cpu))?;
        let x = Tensor::arange(0f32, 8., &Device::Cpu)?.reshape((2, 4))?;
        let master_out = b.forward(&a.forward(&x)?)?;
        let replica_out = rb.forward(&ra.forward(&x)?)?;
        let loss = (master_out.sum_all()? + replica_out.sum_all()?)?;
        let grads = loss.backward()?;
        let single = b.forward(&a.forward(&x)?)?.sum_all()?.backward()?;
        for var in vars_by_name(&varmap, &names) {
            let both = grads.get(&var).expect("gradient reaches the master");
            let one = single.get(&var).unwrap();
            let diff = (both - (one * 2.0)?)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert!(diff < 1e-6);
        }
        Ok(())
    }

    #[test]
    fn replica_batch_norm_updates_stay_private_and_master_updates_persist() -> Result<()> {
        let varmap = VarMap::new();
        let build = |vb: VarBuilder| batch_norm(2, 1e-5, vb);
        let (master, _) = build_master(&varmap, DType::F32, &Device::Cpu, build)?;
        let replica = build(replica_var_builder(&varmap, DType::F32, &Device::Cpu))?;
        let x = Tensor::arange(0f32, 16., &Device::Cpu)?.reshape((4, 2, 2))?;
        replica.forward_t(&x, true)?;
        let mean = |bn: &candle_nn::BatchNorm| bn.running_mean().to_vec1::<f32>().unwrap();
        assert_eq!(mean(&master), [0., 0.]);
        master.forward_t(&x, true)?;
        assert_ne!(mean(&master), [0., 0.]);
        Ok(())
    }

    #[test]
    fn replica_asking_for_an_unknown_variable_is_an_error_naming_it() -> Result<()> {
        let varmap = VarMap::new();
        let vb = replica_var_builder(&varmap, DType::F32, &Device::Cpu);
        let err = linear(2, 2, vb.pp("head")).unwrap_err();
        assert!(err.to_string().contains("`head.weight`"), "{err}");
        Ok(())
    }
}
