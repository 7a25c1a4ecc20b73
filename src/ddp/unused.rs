//! Parameters that get no gradient, and what to say about them.
//!
//! A parameter with no gradient does not train, and nothing else says so: candle 0.11 applies
//! its fused layers without a backward (`candle_nn::ops::{layer_norm, rms_norm,
//! softmax_last_dim}`, `candle_nn::rotary_emb::{rope, rope_i, rope_thd}`, and the `LayerNorm` /
//! `RmsNorm` modules on contiguous input: candle issue #2168), so every parameter upstream of
//! one trains as if frozen. [`DistributedDataParallel`](super::DistributedDataParallel) checks
//! this at each synchronised backward (see [`UnusedReport`]); in one process,
//! [`vars_without_gradient`] does the same check.
//!
//! ```rust
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{layer_norm, linear, VarBuilder, VarMap};
//! use candle_parallel::vars_without_gradient;
//! # fn main() -> candle_core::Result<()> {
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let (l1, ln, l2) = (linear(4, 8, vb.pp("l1"))?, layer_norm(8, 1e-5, vb.pp("ln"))?, linear(8, 2, vb.pp("l2"))?);
//! let x = Tensor::randn(0f32, 1., (3, 4), &Device::Cpu)?;
//! let loss = x.apply(&l1)?.apply(&ln)?.apply(&l2)?.sqr()?.mean_all()?;
//! let grads = loss.backward()?;
//! // candle-nn's layer_norm has no backward: it and everything below it get no gradient.
//! assert_eq!(
//!     vars_without_gradient(&varmap, &grads),
//!     ["l1.bias", "l1.weight", "ln.bias", "ln.weight"]
//! );
//! # Ok(()) }
//! ```

use candle_core::backprop::GradStore;
use candle_core::Var;
use candle_nn::VarMap;

/// What [`DistributedDataParallel`](super::DistributedDataParallel) does when a synchronised
/// backward leaves parameters (other than those declared in
/// [`DdpConfig::frozen_parameters`](super::DdpConfig::frozen_parameters)) with a gradient on no
/// rank at all. Either way such parameters get no gradient in the returned `GradStore`, and
/// [`unused_parameters`](super::DistributedDataParallel::unused_parameters) names them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UnusedReport {
    /// A warning through the `log` facade, from rank 0, once per distinct set of parameters
    /// (default).
    #[default]
    Warn,
    /// `backward` returns [`Error::ParametersWithoutGradient`](crate::Error::ParametersWithoutGradient)
    /// on every rank.
    Error,
}

/// How many names a message lists before it gives a count.
const LISTED: usize = 5;

/// Whether `name` is one of `declared` or below one of them (`"l1"` covers `"l1.weight"`, not
/// `"l10.weight"`).
pub(crate) fn is_declared(name: &str, declared: &[String]) -> bool {
    declared.iter().any(|d| {
        name.strip_prefix(d.as_str()).is_some_and(|rest| {
            rest.is_empty() || rest.starts_with('.') || (!d.is_empty() && d.ends_with('.'))
        })
    })
}

/// "3 parameters got no gradient …": the first few names, then a count, and the likely causes.
pub(crate) fn describe(names: &[String]) -> String {
    let mut listed: Vec<String> = names
        .iter()
        .take(LISTED)
        .map(|n| format!("`{n}`"))
        .collect();
    if names.len() > LISTED {
        listed.push(format!("and {} more", names.len() - LISTED));
    }
    let (count, verb) = match names.len() {
        1 => ("1 parameter".to_string(), "gets"),
        n => (format!("{n} parameters"), "get"),
    };
    format!(
        "{count} got no gradient on any rank in this backward, so {verb} none and will not \
         train: {}. Likely causes: a layer without a backward between them and the loss \
         (candle-nn's fused ops::layer_norm, ops::rms_norm, ops::softmax_last_dim, \
         rotary_emb::rope/rope_i/rope_thd, and its LayerNorm/RmsNorm modules on contiguous \
         input, candle issue #2168: use the drop-ins in candle_parallel::nn, which have one), a \
         detach(), or a parameter the model never uses. Declare parameters frozen on purpose in \
         DdpConfig::frozen_parameters",
        listed.join(", ")
    )
}

/// The names of `vars` that have no gradient in `grads`, sorted: the parameters that a step
/// with `grads` would leave as they are.
pub fn named_vars_without_gradient(vars: &[(String, Var)], grads: &GradStore) -> Vec<String> {
    let mut names: Vec<String> = vars
        .iter()
        .filter(|(_, v)| grads.get(v).is_none())
        .map(|(n, _)| n.clone())
        .collect();
    names.sort();
    names
}

/// The names of `varmap`'s variables that have no gradient in `grads`, sorted: in one process,
/// the check that DistributedDataParallel makes at each backward. Buffers (candle-nn's
/// BatchNorm `running_mean` and `running_var`, which the `VarMap` holds as variables) are left
/// out. See the [module documentation](self).
pub fn vars_without_gradient(varmap: &VarMap, grads: &GradStore) -> Vec<String> {
    let vars: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .filter(|(name, _)| {
            let last = name.rsplit('.').next().unwrap_or(name);
            !crate::util::BUFFER_NAMES.contains(&last)
        })
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    named_vars_without_gradient(&vars, grads)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_declared_prefix_covers_its_children_but_not_a_longer_name() {
        let declared = [
            "l1".to_string(),
            "emb.".to_string(),
            "head.bias".to_string(),
        ];
        assert!(is_declared("l1.weight", &declared));
        assert!(is_declared("l1", &declared));
        assert!(!is_declared("l10.weight", &declared));
        assert!(is_declared("emb.weight", &declared));
        assert!(is_declared("head.bias", &declared));
        assert!(!is_declared("head.weight", &declared));
    }

    #[test]
    fn the_message_lists_five_names_then_a_count() {
        let names: Vec<String> = (0..7).map(|i| format!("p{i}")).collect();
        let m = describe(&names);
        assert!(
            m.starts_with("7 parameters got no gradient on any rank"),
            "{m}"
        );
        assert!(
            m.contains("`p0`, `p1`, `p2`, `p3`, `p4`, and 2 more."),
            "{m}"
        );
        assert!(!m.contains("`p5`"), "{m}");
        assert!(m.contains("#2168") && m.contains("detach()"), "{m}");
        let one = describe(&names[..1]);
        assert!(one.starts_with("1 parameter got"), "{one}");
        assert!(one.contains("gets none"), "{one}");
    }
}
