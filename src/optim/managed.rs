//! What the sharding wrappers tell this crate's optimizers about the variables they manage.
//!
//! Under ZeRO-2 ([`crate::ddp::Sharding::Zero2`]) the optimizer steps each rank's pieces of the
//! parameters, and an all-gather puts the pieces together into the model's parameters. Two
//! mistakes would give wrong weights in silence, and this registry lets the optimizers of
//! [`crate::optim`] prevent both:
//! - an optimizer made over the whole parameters (`varmap.all_vars()`, candle's usual idiom)
//!   would never get a gradient: it is refused, naming the parameter;
//! - the model's parameters would keep their values of before the step until the next training
//!   forward: an optimizer over pieces runs the wrapper's gather at the end of its step (as
//!   torch's `ZeroRedundancyOptimizer` does), so that the model, its `VarMap` and an evaluation
//!   on any rank see the new weights at once. The gather is a collective: every rank steps.
//!
//! Wrappers register variables for as long as they live ([`Registration`]). A custom optimizer
//! can honour the same contract by calling [`check_vars`] when it is made and [`after_step`]
//! at the end of each step.

use crate::error::{Error, Result};
use crate::util::sync::lock;
use candle_core::{TensorId, Var};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// What a wrapper runs at the end of a step over its pieces.
pub(crate) type AfterStep = Arc<dyn Fn() -> Result<()> + Send + Sync>;

#[derive(Clone)]
enum Role {
    /// A whole parameter that a wrapper keeps sharded.
    Whole { name: String, wrapper: &'static str },
    /// A rank's piece of a parameter.
    Piece(AfterStep),
    /// A buffer (running statistics) of a wrapper whose parameters are not in the `VarMap`.
    Buffer { name: String, wrapper: &'static str },
}

fn registry() -> &'static Mutex<HashMap<TensorId, Role>> {
    static REGISTRY: OnceLock<Mutex<HashMap<TensorId, Role>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// How many of this crate's optimizers hold each variable (those whose step runs
/// [`after_step`]).
fn holders() -> &'static Mutex<HashMap<TensorId, usize>> {
    static HOLDERS: OnceLock<Mutex<HashMap<TensorId, usize>>> = OnceLock::new();
    HOLDERS.get_or_init(Default::default)
}

/// Notes that an optimizer of this crate (whose step ends with [`after_step`]) steps `vars`,
/// until [`release`].
pub(crate) fn hold(vars: &[Var]) {
    let mut h = lock(holders());
    for v in vars {
        *h.entry(v.as_tensor().id()).or_insert(0) += 1;
    }
}

/// Undoes [`hold`] (an optimizer of this crate dropped).
pub(crate) fn release(vars: &[Var]) {
    let mut h = lock(holders());
    for v in vars {
        let id = v.as_tensor().id();
        if let Some(n) = h.get_mut(&id) {
            *n -= 1;
            if *n == 0 {
                h.remove(&id);
            }
        }
    }
}

/// Whether every one of `pieces` is stepped by an optimizer of this crate, so that a step over
/// them always ends with the wrapper's gather.
pub(crate) fn all_stepped_by_this_crate(pieces: &[Var]) -> bool {
    let h = lock(holders());
    pieces.iter().all(|p| h.contains_key(&p.as_tensor().id()))
}

/// Variables registered by a wrapper, forgotten when this is dropped (with the wrapper).
pub(crate) struct Registration(Vec<TensorId>);

impl Drop for Registration {
    fn drop(&mut self) {
        let mut map = lock(registry());
        for id in &self.0 {
            map.remove(id);
        }
    }
}

/// Registers whole parameters (by name) that `wrapper` keeps sharded: an optimizer of this
/// crate made over one of them is refused.
pub(crate) fn register_whole(named: &[(String, Var)], wrapper: &'static str) -> Registration {
    let mut map = lock(registry());
    let ids = named
        .iter()
        .map(|(name, var)| {
            let id = var.as_tensor().id();
            let role = Role::Whole {
                name: name.clone(),
                wrapper,
            };
            map.insert(id, role);
            id
        })
        .collect();
    Registration(ids)
}

/// Registers the buffers of a wrapper whose parameters are not in the `VarMap` (fully sharded):
/// an optimizer of this crate made over them (`varmap.all_vars()`, which holds only those) is
/// refused.
pub(crate) fn register_buffers(named: &[(String, Var)], wrapper: &'static str) -> Registration {
    let mut map = lock(registry());
    let ids = named
        .iter()
        .map(|(name, var)| {
            let id = var.as_tensor().id();
            let role = Role::Buffer {
                name: name.clone(),
                wrapper,
            };
            map.insert(id, role);
            id
        })
        .collect();
    Registration(ids)
}

/// Registers a rank's pieces: an optimizer of this crate over any of them runs `after` at the
/// end of each step.
pub(crate) fn register_pieces(pieces: &[Var], after: AfterStep) -> Registration {
    let mut map = lock(registry());
    let ids = pieces
        .iter()
        .map(|var| {
            let id = var.as_tensor().id();
            map.insert(id, Role::Piece(after.clone()));
            id
        })
        .collect();
    Registration(ids)
}

/// Fails with [`Error::ShardedParameterInOptimizer`] when one of `vars` is a whole parameter
/// that a sharding wrapper keeps as pieces: an optimizer over it would never see a gradient.
/// This crate's optimizers call it when they are made and at each step.
pub fn check_vars(vars: &[Var]) -> Result<()> {
    let map = lock(registry());
    if map.is_empty() {
        return Ok(());
    }
    for var in vars {
        match map.get(&var.as_tensor().id()) {
            Some(Role::Whole { name, wrapper }) => {
                return Err(Error::ShardedParameterInOptimizer {
                    parameter: name.clone(),
                    wrapper,
                })
            }
            Some(Role::Buffer { name, wrapper }) => {
                return Err(Error::InvalidArgument {
                    what: "optimizer variables",
                    detail: format!(
                        "`{name}` is a buffer of {wrapper} (not trained), whose parameters are \
                         not in the VarMap: make the optimizer over model.parameters() (this \
                         rank's pieces), not over the VarMap's variables"
                    ),
                })
            }
            _ => {}
        }
    }
    Ok(())
}

/// Runs, once each and in the order of `vars`, what the wrappers owning any of `vars` do after
/// a step over them (under ZeRO-2, the gather of the stepped pieces into the model). This
/// crate's optimizers call it at the end of each step; it is a collective when it runs
/// anything, so every rank must step.
pub fn after_step(vars: &[Var]) -> Result<()> {
    let hooks: Vec<AfterStep> = {
        let map = lock(registry());
        if map.is_empty() {
            return Ok(());
        }
        let mut hooks: Vec<AfterStep> = Vec::new();
        for var in vars {
            if let Some(Role::Piece(h)) = map.get(&var.as_tensor().id()) {
                if !hooks.iter().any(|known| Arc::ptr_eq(known, h)) {
                    hooks.push(h.clone());
                }
            }
        }
        hooks
    };
    for h in hooks {
        h()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn whole_parameters_are_refused_and_piece_hooks_run_once_per_step_until_dropped() {
        let var = |n| Var::zeros(n, DType::F32, &Device::Cpu).unwrap();
        let (whole, a, b, other) = (var(4), var(2), var(2), var(3));
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = runs.clone();
        let hook: AfterStep = Arc::new(move || {
            counted.fetch_add(1, Ordering::SeqCst);
            Ok(())
        });
        let w = register_whole(
            &[("l1.weight".to_string(), whole.clone())],
            "a test wrapper",
        );
        let p = register_pieces(&[a.clone(), b.clone()], hook);
        let err = check_vars(&[other.clone(), whole.clone()]).unwrap_err();
        assert!(
            err.to_string()
                .contains("`l1.weight`, a whole parameter of a test wrapper"),
            "{err}"
        );
        check_vars(&[a.clone(), other.clone()]).unwrap();
        after_step(&[a.clone(), b.clone(), other.clone()]).unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        drop((w, p));
        check_vars(std::slice::from_ref(&whole)).unwrap();
        after_step(&[a, b]).unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }
}
