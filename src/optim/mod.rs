//! Optimizers with PyTorch's semantics: [`Sgd`] (`torch.optim.SGD`: momentum, dampening,
//! weight decay, Nesterov) and [`AdamW`] (`torch.optim.AdamW`: decoupled weight decay, AMSGrad),
//! and their state as plain tensors ([`OptimizerState`]), to save, load and shard.
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
mod clip;
mod finite;
pub mod managed;
mod sgd;
mod sgd_kernel;

pub use adamw::{AdamW, AdamWConfig};
pub use clip::{clip_grad_norm, clip_grad_norm_over, clip_grad_value};
pub use finite::FiniteLoss;
pub use sgd::{Sgd, SgdConfig};

use crate::error::Error;
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
                // A copy, so that the caller's tensors and ours never share storage.
                Ok(t.to_device(var.device())?.to_dtype(dtype(var))?.copy()?)
            })
            .collect::<crate::Result<Vec<_>>>()?;
        out.push(Some(tensors));
    }
    Ok(out)
}
