//! Which variables of a model are cut over the tensor-parallel group, and how (torch's
//! `parallelize_module` plan, Megatron's `tensor_model_parallel` attributes): a
//! [`ParallelPlan`] maps layer names to a [`ParallelStyle`], and from it
//! - [`ParallelPlan::shard`] cuts a one-process model's weights into a rank's parts, so that a
//!   tensor-parallel run starts exactly where a one-process run starts;
//! - [`ParallelPlan::gather`] puts every rank's parts back together into the one-process
//!   model's weights (a collective), so that what a tensor-parallel run saves loads into a
//!   plain candle program;
//! - [`ParallelPlan::is_replicated`] says which variables every rank holds whole (under
//!   sequence parallelism, those whose gradients [`super::sum_sequence_parallel_gradients`]
//!   must sum).
//!
//! ```rust
//! use candle_core::{Device, Tensor};
//! use candle_parallel::distributed;
//! use candle_parallel::tensor_parallel::{ParallelPlan, ParallelStyle};
//! # fn main() -> candle_parallel::Result<()> {
//! let plan = ParallelPlan::new()
//!     .layer("h.*.mlp.fc1", ParallelStyle::Colwise)
//!     .layer("h.*.mlp.fc2", ParallelStyle::Rowwise);
//! let w = Tensor::arange(0f32, 8., &Device::Cpu)?.reshape((4, 2))?;
//! let back = distributed::spawn_threads(2, |tp| {
//!     let mine = plan.shard("h.0.mlp.fc1.weight", &w, &tp)?; // rows 2 r, 2 r + 1
//!     assert_eq!(mine.dims(), [2, 2]);
//!     let whole = plan.gather(&[("h.0.mlp.fc1.weight".to_string(), mine)], &tp)?;
//!     Ok(whole["h.0.mlp.fc1.weight"].to_vec2::<f32>()?)
//! })?;
//! assert_eq!(back[1], w.to_vec2::<f32>()?);
//! # Ok(()) }
//! ```

use crate::ddp::agreement::check_same_descriptions;
use crate::distributed::ProcessGroup;
use crate::error::{Error, Result, TENSOR_PARALLEL_PLAN};
use candle_core::Tensor;
use std::collections::HashMap;

/// How a layer is cut over the group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParallelStyle {
    /// A [`super::ColumnParallelLinear`]: the weight's rows (output features) and the bias
    /// split (torch's `ColwiseParallel`).
    Colwise,
    /// A [`super::RowParallelLinear`]: the weight's columns (input features) split, the bias
    /// whole (torch's `RowwiseParallel`).
    Rowwise,
    /// A [`super::ParallelAttention`]'s packed `qkv` projection: the rows of the queries, the
    /// keys and the values each split, a rank's three parts packed ([`super::shard_qkv`]).
    PackedQkv,
    /// A [`super::VocabParallelEmbedding`]: the weight's rows (the vocabulary) split.
    VocabEmbedding,
}

/// Where one variable lies over the group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Every rank holds it whole.
    Replicate,
    /// Split evenly along this dimension, rank `r` holding the `r`-th part.
    Shard(usize),
    /// Three blocks along dimension 0 (queries, keys, values), each split evenly, rank `r`
    /// holding the `r`-th part of each, packed.
    PackedShard,
}

/// Layer names (dot-separated, `*` standing for any one part: `h.*.attn.qkv`) and how each is
/// cut. A variable is a layer's name and one more part (`h.3.attn.qkv.weight`); variables of no
/// layer of the plan are replicated.
#[derive(Clone, Debug, Default)]
pub struct ParallelPlan {
    layers: Vec<(String, ParallelStyle)>,
}

/// Whether the dot-separated `name` matches `pattern`, part by part (`*` matches any part).
fn matches(pattern: &str, name: &str) -> bool {
    let (mut p, mut n) = (pattern.split('.'), name.split('.'));
    loop {
        match (p.next(), n.next()) {
            (None, None) => return true,
            (Some(a), Some(b)) if a == "*" || a == b => continue,
            _ => return false,
        }
    }
}

impl ParallelPlan {
    /// A plan that replicates everything.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cuts the layers `pattern` names as `style` (a later rule for the same layer wins).
    pub fn layer(mut self, pattern: &str, style: ParallelStyle) -> Self {
        self.layers.push((pattern.to_string(), style));
        self
    }

    /// The style of the layer that holds variable `name`, if the plan cuts it.
    fn style(&self, name: &str) -> Option<ParallelStyle> {
        let layer = name.rsplit_once('.')?.0;
        self.layers
            .iter()
            .rev()
            .find(|(pattern, _)| matches(pattern, layer))
            .map(|(_, style)| *style)
    }

    /// Where variable `name` (a layer's `weight` or `bias`) lies over the group.
    pub fn placement(&self, name: &str) -> Placement {
        let leaf = name.rsplit('.').next().unwrap_or(name);
        match (self.style(name), leaf) {
            (Some(ParallelStyle::Colwise | ParallelStyle::VocabEmbedding), "weight") => {
                Placement::Shard(0)
            }
            (Some(ParallelStyle::Colwise), "bias") => Placement::Shard(0),
            (Some(ParallelStyle::Rowwise), "weight") => Placement::Shard(1),
            (Some(ParallelStyle::PackedQkv), "weight" | "bias") => Placement::PackedShard,
            _ => Placement::Replicate,
        }
    }

    /// Whether every rank holds variable `name` whole.
    pub fn is_replicated(&self, name: &str) -> bool {
        self.placement(name) == Placement::Replicate
    }

    /// This rank's part of the one-process variable `name` whose value is `full`: the
    /// variable a tensor-parallel layer built on `tp` expects under the same name. A size the
    /// group cannot share is an error naming the variable, its shape and the group's size.
    pub fn shard(&self, name: &str, full: &Tensor, tp: &ProcessGroup) -> Result<Tensor> {
        let (ranks, r) = (tp.world_size(), tp.rank());
        let part = |dim: usize, blocks: usize| -> Result<usize> {
            let size = full.dims().get(dim).copied().unwrap_or(0);
            if size == 0 || size % (blocks * ranks) != 0 {
                return Err(Error::InvalidArgument {
                    what: "tensor-parallel plan",
                    detail: format!(
                        "{name} of shape {:?} cannot be split into {blocks} x {ranks} equal parts \
                         along dimension {dim} for {ranks} tensor-parallel ranks; choose sizes \
                         that are multiples of {}",
                        full.dims(),
                        blocks * ranks
                    ),
                });
            }
            Ok(size / blocks / ranks)
        };
        Ok(match self.placement(name) {
            Placement::Replicate => full.clone(),
            Placement::Shard(dim) => {
                let n = part(dim, 1)?;
                full.narrow(dim, r * n, n)?.contiguous()?
            }
            Placement::PackedShard => {
                let n = part(0, 3)?;
                let block = n * ranks;
                let parts = (0..3)
                    .map(|b| full.narrow(0, b * block + r * n, n))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Tensor::cat(&parts, 0)?.contiguous()?
            }
        })
    }

    /// [`ParallelPlan::shard`] of every `(name, value)`, and a warning through the `log`
    /// facade for each layer pattern that matched none of them (probably a misspelt name).
    pub fn shard_all<'a>(
        &self,
        full: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
        tp: &ProcessGroup,
    ) -> Result<HashMap<String, Tensor>> {
        let full: Vec<(&str, &Tensor)> = full.into_iter().collect();
        self.warn_unmatched(full.iter().map(|(n, _)| *n));
        full.into_iter()
            .map(|(name, t)| Ok((name.to_string(), self.shard(name, t, tp)?)))
            .collect()
    }

    /// Every rank's parts of `local` (this rank's `(name, value)`s, the same names on every
    /// rank of `tp`) put back together: the one-process model's variables, on every rank. A
    /// collective over `tp` (one exchange of the names, dtypes and shapes, then one all-gather
    /// per cut variable, in name order); replicated variables are this rank's own. Ranks whose
    /// variables differ, or a part that cannot be the style's, are an error on every rank that
    /// names the variable.
    pub fn gather(
        &self,
        local: &[(String, Tensor)],
        tp: &ProcessGroup,
    ) -> Result<HashMap<String, Tensor>> {
        let mut sorted: Vec<&(String, Tensor)> = local.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        self.warn_unmatched(sorted.iter().map(|(n, _)| n.as_str()));
        if tp.world_size() > 1 {
            // All-gathers of parts with the same shape but different names would pair them.
            let described: Vec<String> = sorted
                .iter()
                .map(|(n, t)| format!("{n} {} {:?}", t.dtype().as_str(), t.dims()))
                .collect();
            check_same_descriptions(tp, &described, tp.device(), TENSOR_PARALLEL_PLAN)?;
            for (name, t) in &sorted {
                self.check_part(name, t)?;
            }
        }
        let mut out = HashMap::with_capacity(sorted.len());
        for (name, t) in sorted {
            let whole = match self.placement(name) {
                Placement::Replicate => t.clone(),
                _ if tp.world_size() == 1 => t.clone(),
                Placement::Shard(dim) => Tensor::cat(&tp.all_gather(&t.contiguous()?)?, dim)?,
                Placement::PackedShard => {
                    let parts = tp.all_gather(&t.contiguous()?)?;
                    let n = t.dim(0)? / 3;
                    let mut rows = Vec::with_capacity(3 * parts.len());
                    for block in 0..3 {
                        for p in &parts {
                            rows.push(p.narrow(0, block * n, n)?);
                        }
                    }
                    Tensor::cat(&rows, 0)?
                }
            };
            out.insert(name.clone(), whole);
        }
        Ok(out)
    }

    /// Whether `part` can be a part of variable `name` as the plan cuts it.
    fn check_part(&self, name: &str, part: &Tensor) -> Result<()> {
        let bad = match self.placement(name) {
            Placement::Replicate => None,
            Placement::Shard(dim) if dim >= part.rank() => Some(format!(
                "has no dimension {dim} to put the parts together along"
            )),
            Placement::Shard(_) => None,
            Placement::PackedShard if part.dims().first().is_none_or(|n| n % 3 != 0) => {
                Some("is not three blocks of rows (queries, keys, values) along dimension 0".into())
            }
            Placement::PackedShard => None,
        };
        match bad {
            Some(why) => Err(Error::InvalidArgument {
                what: "tensor-parallel plan",
                detail: format!(
                    "this rank's part of {name} of shape {:?} {why}: pass the parts that \
                     ParallelPlan::shard cut",
                    part.dims()
                ),
            }),
            None => Ok(()),
        }
    }

    fn warn_unmatched<'a>(&self, names: impl Iterator<Item = &'a str> + Clone) {
        for (pattern, style) in &self.layers {
            let used = names.clone().any(|n| {
                n.rsplit_once('.')
                    .is_some_and(|(layer, _)| matches(pattern, layer))
            });
            if !used {
                log::warn!(
                    "tensor-parallel plan: the layer pattern {pattern:?} ({style:?}) matches no \
                     variable; it is probably misspelt, and those layers stay replicated"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_part_by_part() {
        assert!(matches("h.*.attn.qkv", "h.12.attn.qkv"));
        assert!(!matches("h.*.attn.qkv", "h.1.attn.qkv.x"));
        assert!(!matches("h.*.attn", "h.1.attn.qkv"));
        let plan = ParallelPlan::new()
            .layer("h.*.attn.qkv", ParallelStyle::PackedQkv)
            .layer("h.*.attn.proj", ParallelStyle::Rowwise)
            .layer("emb", ParallelStyle::VocabEmbedding);
        assert_eq!(plan.placement("h.0.attn.qkv.bias"), Placement::PackedShard);
        assert_eq!(plan.placement("h.0.attn.proj.weight"), Placement::Shard(1));
        assert_eq!(plan.placement("h.0.attn.proj.bias"), Placement::Replicate);
        assert_eq!(plan.placement("emb.weight"), Placement::Shard(0));
        assert_eq!(plan.placement("ln.weight"), Placement::Replicate);
    }
}
