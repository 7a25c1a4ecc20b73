//! A pipeline stage: one consecutive part of the model, on the rank that runs it (torch's
//! `PipelineStage`).
//!
//! The user builds the part as any candle model, over a `VarMap` of its own, and hands both
//! over with the stage's index. The stage computes one micro-batch's forward and backward; a
//! schedule ([`crate::pipeline::PipelineSchedule`]) decides their order and moves the
//! activations and gradients between the ranks. Building each stage with the names the whole
//! model gives its variables (`vb.pp("layers.2")` on the stage that holds layer 2) keeps the
//! stages' checkpoints the pieces of the whole model's, and, with
//! [`crate::init::seeded_var_builder`], their initial values the whole model's.
//!
//! ```rust
//! use candle_core::Device;
//! use candle_nn::{linear, VarMap};
//! use candle_parallel::{distributed, pipeline::PipelineStage};
//! # fn main() -> candle_parallel::Result<()> {
//! let counts = distributed::spawn_threads(2, |pg| {
//!     let varmap = VarMap::new();
//!     let vb = candle_nn::VarBuilder::from_varmap(&varmap, candle_core::DType::F32, &Device::Cpu);
//!     // Rank r holds stage r: layer r of a two-layer model.
//!     let layer = linear(4, 4, vb.pp(format!("layers.{}", pg.rank())))?;
//!     let stage = PipelineStage::new(layer, &varmap, pg.rank(), 2, &pg)?;
//!     Ok(stage.parameters().len())
//! })?;
//! assert_eq!(counts, [2, 2]); // a weight and a bias each
//! # Ok(()) }
//! ```

use crate::distributed::ProcessGroup;
use crate::error::{Error, Result};
use candle_core::{Device, Var};
use candle_nn::VarMap;

/// One stage of a pipeline. See the [module documentation](self).
pub struct PipelineStage<M> {
    pub(super) module: M,
    stage_index: usize,
    num_stages: usize,
    group: ProcessGroup,
    /// The stage's trainable variables, sorted by name.
    params: Vec<(String, Var)>,
}

impl<M> PipelineStage<M> {
    /// Stage `stage_index` of `num_stages`, computing with `module`, whose variables are
    /// `varmap`'s (every float variable of it is trained). `group` is the pipeline's process
    /// group: stage `s` runs on its rank `s % group.world_size()`, so this rank must be that
    /// one, and `num_stages` a multiple of the group's size (one stage per rank, or several
    /// for an interleaved schedule). Give each stage a `VarMap` of its own: the stage trains
    /// every variable of it.
    pub fn new(
        module: M,
        varmap: &VarMap,
        stage_index: usize,
        num_stages: usize,
        group: &ProcessGroup,
    ) -> Result<Self> {
        check_placement(stage_index, num_stages, group)?;
        let mut params = sorted_variables(varmap);
        params.retain(|(_, v)| v.dtype().is_float());
        if params.is_empty() {
            log::warn!(
                "pipeline stage {stage_index}: its VarMap holds no float variable, so the stage \
                 trains nothing; build the stage's model over the VarMap given here"
            );
        }
        Ok(Self {
            module,
            stage_index,
            num_stages,
            group: group.clone(),
            params,
        })
    }

    /// The stage's index (0 is the first, `num_stages() - 1` computes the loss).
    pub fn stage_index(&self) -> usize {
        self.stage_index
    }

    /// How many stages the pipeline has.
    pub fn num_stages(&self) -> usize {
        self.num_stages
    }

    /// Whether this is the first stage (which takes the batch).
    pub fn is_first(&self) -> bool {
        self.stage_index == 0
    }

    /// Whether this is the last stage (which computes the loss).
    pub fn is_last(&self) -> bool {
        self.stage_index + 1 == self.num_stages
    }

    /// The pipeline's process group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Where received activations and gradients arrive (the group's device).
    pub fn device(&self) -> &Device {
        self.group.device()
    }

    /// The rank (in the pipeline group) that runs stage `stage`.
    pub(super) fn rank_of(&self, stage: usize) -> usize {
        stage % self.group.world_size()
    }

    /// The stage's trainable variables, sorted by name: give them to the optimizer.
    pub fn parameters(&self) -> Vec<Var> {
        self.params.iter().map(|(_, v)| v.clone()).collect()
    }

    /// The stage's trainable variables with their names, sorted by name.
    pub fn named_parameters(&self) -> &[(String, Var)] {
        &self.params
    }

    /// The model part the stage computes with.
    pub fn module(&self) -> &M {
        &self.module
    }
}

/// Checks that stage `stage_index` of `num_stages` runs on this rank of the pipeline `group`
/// (stage `s` on rank `s % group.world_size()`).
pub(super) fn check_placement(
    stage_index: usize,
    num_stages: usize,
    group: &ProcessGroup,
) -> Result<()> {
    let pp = group.world_size();
    let bad = |detail: String| {
        Err(Error::InvalidArgument {
            what: "pipeline stage",
            detail,
        })
    };
    if num_stages == 0 || !num_stages.is_multiple_of(pp) {
        return bad(format!(
            "{num_stages} stages over a pipeline group of {pp} ranks; the number of stages \
             must be a positive multiple of the group's size"
        ));
    }
    if stage_index >= num_stages || stage_index % pp != group.rank() {
        return bad(format!(
            "stage {stage_index} of {num_stages} on rank {} of {pp}; stage s runs on rank \
             s % {pp} and must be below {num_stages}",
            group.rank()
        ));
    }
    Ok(())
}

/// Every variable of `varmap` with its name, sorted by name (one order on every rank).
pub(super) fn sorted_variables(varmap: &VarMap) -> Vec<(String, Var)> {
    let mut vars: Vec<(String, Var)> = crate::util::sync::lock(varmap.data())
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}
