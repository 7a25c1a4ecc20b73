//! Optimizers with PyTorch's semantics: [`Sgd`] (`torch.optim.SGD`: momentum, dampening,
//! weight decay, Nesterov) and [`AdamW`] (`torch.optim.AdamW`: decoupled weight decay, AMSGrad),
//! and their state as plain tensors ([`OptimizerState`]), to save, load and shard.
//!
//! A step checks every gradient against its variable (shape, device) before it writes anything,
//! so it updates every variable that has a gradient or, with an error that names the variable,
//! none. A variable of no elements steps as in torch: nothing to write, an empty state.
//!
//! Both update each element of a variable from that element, its gradient and its state alone
//! ([`ElementwiseOptimizer`]), so stepping a slice of the parameters equals stepping all of them
//! and slicing: sharded data parallel steps each rank's shard with them.
//!
//! ```rust
//! use candle_core::{Device, Var};
//! use candle_nn::Optimizer;
//! use candle_parallel::optim::{AdamW, AdamWConfig, ElementwiseOptimizer};
//! # fn main() -> candle_parallel::Result<()> {
//! let p = Var::new(&[1f64, -2.], &Device::Cpu)?;
//! let config = AdamWConfig { lr: 0.1, weight_decay: 0.0, ..Default::default() };
//! let mut opt = AdamW::new(vec![p.clone()], config)?;
//! let loss = (p.as_tensor().sqr()? * 0.5)?.sum_all()?; // gradient = p
//! opt.backward_step(&loss)?;
//! // Adam's first step moves every element by lr against the sign of its gradient.
//! let got = p.to_vec1::<f64>()?;
//! assert!((got[0] - 0.9).abs() < 1e-6 && (got[1] + 1.9).abs() < 1e-6);
//! // Its state, to save or to hand to a fresh optimizer.
//! let state = opt.state();
//! assert_eq!(state.scalars["step"], 1.0);
//! assert_eq!(state.per_var[0]["exp_avg"].to_vec1::<f64>()?.len(), 2);
//! let mut resumed = AdamW::new(vec![p.clone()], config)?;
//! resumed.load_state(&state)?;
//! # Ok(()) }
//! ```

mod adamw;
mod adamw_kernel;
mod clip;
#[cfg(feature = "cuda")]
mod cuda;
mod finite;
pub mod managed;
mod sgd;
mod sgd_kernel;

pub use adamw::{AdamW, AdamWConfig};
pub use clip::{clip_grad_norm, clip_grad_norm_over, clip_grad_norm_parts, clip_grad_value};
pub use finite::FiniteLoss;
pub use sgd::{Sgd, SgdConfig};

use crate::error::Error;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use std::collections::BTreeMap;

/// State of an optimizer whose update of each element depends only on that element of the
/// variable, its gradient and its state: every per-variable state tensor has the variable's
/// shape.
#[derive(Clone, Debug, Default)]
pub struct OptimizerState {
    /// Scalars shared by every variable (e.g. "step"), as f64.
    pub scalars: BTreeMap<String, f64>,
    /// Per variable (in the order of `vars()`), its state tensors by name ("momentum_buffer";
    /// "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), each of the variable's shape. A variable with
    /// no state yet has an empty map. State names never contain a dot.
    pub per_var: Vec<BTreeMap<String, Tensor>>,
}

/// An optimizer that can step any slice of its variables on its own: stepping a flat shard of
/// parameters equals stepping the whole and slicing. Sharded data parallel steps shards with it.
pub trait ElementwiseOptimizer: candle_nn::Optimizer {
    /// The variables this optimizer updates, in the order of [`OptimizerState::per_var`].
    fn vars(&self) -> &[Var];
    /// A snapshot of the state. Its tensors are never written in place by later steps.
    fn state(&self) -> OptimizerState;
    /// Replaces the state; errors (typed, naming the variable index, state name and shapes) when
    /// it does not fit `vars()`.
    fn load_state(&mut self, state: &OptimizerState) -> crate::Result<()>;
}

/// Checks `state` against `vars` for an optimizer keeping the per-variable states `names` (all
/// of them or none, per variable) and the scalars `scalars`, and returns each variable's state
/// tensors in the order of `names`, converted to `dtype(var)` on the variable's device.
fn checked_state(
    optimizer: &'static str,
    vars: &[Var],
    state: &OptimizerState,
    names: &[&'static str],
    scalars: &[&str],
    dtype: impl Fn(&Var) -> DType,
) -> crate::Result<Vec<Option<Vec<Tensor>>>> {
    let mismatch = |detail: String| Error::OptimizerStateMismatch { optimizer, detail };
    if state.per_var.len() != vars.len() {
        return Err(mismatch(format!(
            "the state has {} variables, the optimizer {}",
            state.per_var.len(),
            vars.len()
        )));
    }
    if let Some(name) = state
        .scalars
        .keys()
        .find(|k| !scalars.contains(&k.as_str()))
    {
        return Err(mismatch(format!(
            "the state has a scalar `{name}`, which {optimizer} does not keep (it keeps {scalars:?})"
        )));
    }
    let mut out = Vec::with_capacity(vars.len());
    for (i, (var, map)) in vars.iter().zip(&state.per_var).enumerate() {
        if let Some(name) = map.keys().find(|k| !names.contains(&k.as_str())) {
            return Err(mismatch(format!(
                "variable {i} has a state `{name}`, which {optimizer} with these options does not \
                 keep (it keeps {names:?})"
            )));
        }
        if map.is_empty() {
            out.push(None);
            continue;
        }
        let tensors = names
            .iter()
            .map(|name| {
                let t = map.get(*name).ok_or_else(|| {
                    mismatch(format!(
                        "variable {i} has the states {:?} but not `{name}`",
                        map.keys().collect::<Vec<_>>()
                    ))
                })?;
                if t.dims() != var.dims() {
                    return Err(Error::OptimizerStateShape {
                        optimizer,
                        variable: i,
                        state: name,
                        expected: var.dims().to_vec(),
                        found: t.dims().to_vec(),
                    });
                }
                // A copy, so that the caller's tensors and ours never share storage; between
                // two CUDA devices, ordered on both streams.
                let moved = crate::util::ordered_copy::to_device(t, var.device(), false)?;
                Ok(moved.to_dtype(dtype(var))?.copy()?)
            })
            .collect::<crate::Result<Vec<_>>>()?;
        out.push(Some(tensors));
    }
    Ok(out)
}

/// Fails, naming the first variable at fault, unless every variable of `vars` that has a
/// gradient in `grads` can be stepped by it: the gradient of the variable's shape and on its
/// device, the variable contiguous (what `Var::set` writes). Optimizers call it before they
/// write anything, so that a step is never partial.
fn check_grads(optimizer: &'static str, vars: &[Var], grads: &GradStore) -> crate::Result<()> {
    for (i, var) in vars.iter().enumerate() {
        let Some(grad) = grads.get(var) else {
            continue;
        };
        let fault = if grad.dims() != var.dims() {
            format!(
                "has shape {:?} but its gradient {:?}",
                var.dims(),
                grad.dims()
            )
        } else if !grad.device().same_device(var.device()) {
            format!(
                "is on {} but its gradient on {}",
                crate::error::device_name(var.device()),
                crate::error::device_name(grad.device())
            )
        } else if !var.is_contiguous() {
            format!(
                "(shape {:?}) is not contiguous, so it cannot be written",
                var.dims()
            )
        } else {
            continue;
        };
        return Err(Error::InvalidArgument {
            what: "optimizer step",
            detail: format!(
                "{optimizer}: variable {i} {fault}; no variable was updated by this step"
            ),
        });
    }
    Ok(())
}

/// A fresh tensor of zeros of `var`'s shape and device, in `dtype`: the state of a variable of
/// no elements (never `zeros_like` of a tensor derived from it, which candle may hand back as
/// the same storage).
fn empty_state(var: &Var, dtype: DType) -> candle_core::Result<Tensor> {
    Tensor::zeros(var.shape(), dtype, var.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Variables around one of no elements, in `dtype`.
    fn vars_around_an_empty_one(dtype: DType) -> candle_core::Result<Vec<Var>> {
        let t = |v: &[f32], shape: &[usize]| {
            Var::from_tensor(&Tensor::from_slice(v, shape, &Device::Cpu)?.to_dtype(dtype)?)
        };
        Ok(vec![
            t(&[1.0, -2.0, 0.5], &[3])?,
            t(&[], &[0, 4])?,
            t(&[3.0, 0.25], &[2])?,
        ])
    }

    /// A loss over every variable: its gradients include the empty one's.
    fn loss(vars: &[Var]) -> candle_core::Result<Tensor> {
        let mut total = vars[0].as_tensor().sqr()?.sum_all()?;
        for v in &vars[1..] {
            total = (total + v.as_tensor().sqr()?.sum_all()?)?;
        }
        Ok(total)
    }

    /// A variable of no elements steps as in torch, beside the others: the step succeeds,
    /// updates the others, and leaves an empty state (it failed with "cannot set a variable to a
    /// tensor that is derived from its value", after earlier variables were already updated).
    fn steps_beside_an_empty_variable<O: ElementwiseOptimizer>(
        make: impl Fn(Vec<Var>) -> candle_core::Result<O>,
    ) -> candle_core::Result<()> {
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            let vars = vars_around_an_empty_one(dtype)?;
            let before: Vec<Vec<f64>> = vars
                .iter()
                .map(|v| v.to_dtype(DType::F64)?.flatten_all()?.to_vec1())
                .collect::<candle_core::Result<_>>()?;
            let mut opt = make(vars.clone())?;
            for _ in 0..2 {
                let grads = loss(&vars)?.backward()?;
                assert!(
                    grads.get(&vars[1]).is_some(),
                    "the empty variable has a gradient"
                );
                opt.step(&grads)?;
            }
            for i in [0, 2] {
                let after = vars[i].to_dtype(DType::F64)?.to_vec1::<f64>()?;
                assert!(
                    after.iter().zip(&before[i]).all(|(a, b)| a != b),
                    "{dtype:?}"
                );
            }
            let state = opt.state();
            // A state like the others' (none for Sgd without momentum).
            assert_eq!(
                state.per_var[1].keys().collect::<Vec<_>>(),
                state.per_var[0].keys().collect::<Vec<_>>(),
                "{dtype:?}: the empty variable's state"
            );
            for t in state.per_var[1].values() {
                assert_eq!(t.dims(), [0, 4]);
            }
            let mut resumed = make(vars.clone())?;
            resumed.load_state(&state).map_err(Error::into_candle)?;
            resumed.step(&loss(&vars)?.backward()?)?;
        }
        Ok(())
    }

    #[test]
    fn sgd_and_adamw_step_beside_a_variable_of_no_elements() -> candle_core::Result<()> {
        use candle_nn::Optimizer;
        let sgd = |momentum| {
            move |vars| {
                let config = SgdConfig {
                    lr: 0.1,
                    momentum,
                    weight_decay: 0.01,
                    ..Default::default()
                };
                Sgd::new(vars, config)
            }
        };
        steps_beside_an_empty_variable(sgd(0.9))?;
        steps_beside_an_empty_variable(sgd(0.0))?;
        for amsgrad in [false, true] {
            steps_beside_an_empty_variable(|vars| {
                let config = AdamWConfig {
                    lr: 0.1,
                    amsgrad,
                    ..Default::default()
                };
                AdamW::new(vars, config)
            })?;
        }
        Ok(())
    }

    /// A gradient that does not fit its variable fails the step before anything is written,
    /// naming the variable.
    fn a_bad_gradient_writes_nothing<O: ElementwiseOptimizer>(
        make: impl Fn(Vec<Var>) -> candle_core::Result<O>,
    ) -> candle_core::Result<()> {
        let vars = vars_around_an_empty_one(DType::F32)?;
        let mut opt = make(vars.clone())?;
        let mut grads = loss(&vars)?.backward()?;
        grads.insert(&vars[2], Tensor::ones(5, DType::F32, &Device::Cpu)?);
        let err = opt.step(&grads).unwrap_err().to_string();
        assert!(err.contains("variable 2") && err.contains("[5]"), "{err}");
        assert!(err.contains("no variable was updated"), "{err}");
        assert_eq!(vars[0].to_vec1::<f32>()?, [1.0, -2.0, 0.5]);
        assert!(opt.state().per_var.iter().all(|m| m.is_empty()));
        Ok(())
    }

    #[test]
    fn a_gradient_that_does_not_fit_fails_the_step_before_any_write() -> candle_core::Result<()> {
        use candle_nn::Optimizer;
        a_bad_gradient_writes_nothing(|vars| {
            let config = SgdConfig {
                lr: 0.1,
                momentum: 0.9,
                ..Default::default()
            };
            Sgd::new(vars, config)
        })?;
        a_bad_gradient_writes_nothing(|vars| AdamW::new(vars, Default::default()))
    }
}
