//! Tensor-parallel parts in the distributed checkpoint ([`crate::checkpoint::distributed`]):
//! each rank's part of a cut variable is saved as the box it is of the one-process variable
//! (a packed `qkv` part as three boxes), so the checkpoint is the one-process model's, and any
//! layout (another tensor-parallel size, data parallel, one process) loads it.
//!
//! ```rust
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{Optimizer, VarMap};
//! use candle_parallel::checkpoint::distributed::Checkpointer;
//! use candle_parallel::distributed;
//! use candle_parallel::optim::{Sgd, SgdConfig};
//! use candle_parallel::tensor_parallel::{ParallelPlan, ParallelStyle};
//! # fn main() -> candle_parallel::Result<()> {
//! let dir = std::env::temp_dir().join(format!("tp-dcp-doc-{}", std::process::id()));
//! # let _ = std::fs::remove_dir_all(&dir);
//! let plan = ParallelPlan::new().layer("fc1", ParallelStyle::Colwise);
//! let w = Tensor::arange(0f32, 8., &Device::Cpu)?.reshape((4, 2))?;
//! distributed::spawn_threads(2, |tp| {
//!     // Each rank holds its rows of `fc1.weight` ...
//!     let varmap = VarMap::new();
//!     let part = plan.shard("fc1.weight", &w, &tp)?;
//!     varmap.data().lock().unwrap().insert("fc1.weight".into(), candle_core::Var::from_tensor(&part)?);
//!     let opt = Sgd::new(varmap.all_vars(), SgdConfig::default())?;
//!     let mut checkpoints = Checkpointer::for_group(&dir, &tp, &Device::Cpu);
//!     checkpoints.save(&plan.state_dict(&varmap, &opt, &tp)?)?;
//!     Ok(())
//! })?;
//! // ... and one process reads the whole weight.
//! let index = candle_parallel::checkpoint::distributed::Index::read(&dir)?;
//! assert_eq!(index.shape("fc1.weight"), Some(&[4usize, 2][..]));
//! # std::fs::remove_dir_all(&dir).unwrap();
//! # Ok(()) }
//! ```

use super::plan::{ParallelPlan, Placement};
use crate::checkpoint::distributed::{
    insert_scalars, optimizer_state, optimizer_wanted, Checkpointer, Region, ShardedTensor,
    StateDict, Wanted,
};
use crate::checkpoint::{var_names, LoadOptions, OPTIMIZER_STATE};
use crate::distributed::ProcessGroup;
use crate::error::{Error, Result};
use crate::optim::ElementwiseOptimizer;
use crate::util::sync::lock;
use candle_core::{Tensor, Var};
use candle_nn::VarMap;
use std::collections::BTreeMap;

impl ParallelPlan {
    /// The one-process shape of variable `name` whose part on this rank of `tp` has shape
    /// `part`, and the regions of it the part holds (one box; a packed part, three).
    fn regions(
        &self,
        name: &str,
        part: &[usize],
        tp: &ProcessGroup,
    ) -> Result<(Vec<usize>, Vec<Region>)> {
        let (ranks, r) = (tp.world_size(), tp.rank());
        let mut whole = part.to_vec();
        let boxed = |offsets: Vec<usize>, sizes: Vec<usize>| Region::Box { offsets, sizes };
        let regions = match self.placement(name) {
            Placement::Replicate => vec![Region::whole(part)],
            Placement::Shard(dim) => {
                let Some(n) = part.get(dim).copied() else {
                    return Err(bad_part(name, part, &format!("has no dimension {dim}")));
                };
                whole[dim] = n * ranks;
                let mut offsets = vec![0; part.len()];
                offsets[dim] = r * n;
                vec![boxed(offsets, part.to_vec())]
            }
            Placement::PackedShard => {
                let rows = part.first().copied().unwrap_or(0);
                if rows % 3 != 0 || rows == 0 {
                    return Err(bad_part(name, part, "is not three blocks of rows"));
                }
                let n = rows / 3;
                whole[0] = rows * ranks;
                (0..3)
                    .map(|b| {
                        let mut offsets = vec![0; part.len()];
                        offsets[0] = b * n * ranks + r * n;
                        let mut sizes = part.to_vec();
                        sizes[0] = n;
                        boxed(offsets, sizes)
                    })
                    .collect()
            }
        };
        Ok((whole, regions))
    }

    /// This rank's part `part` of variable `name` (or of one of its optimizer states) as a
    /// piece of the one-process tensor.
    pub fn sharded_tensor(
        &self,
        name: &str,
        part: &Tensor,
        tp: &ProcessGroup,
    ) -> Result<ShardedTensor> {
        let (whole, regions) = self.regions(name, part.dims(), tp)?;
        let rows = regions.first().map_or(0, |r| r.dims()[0]);
        let pieces = regions
            .into_iter()
            .enumerate()
            .map(|(b, region)| {
                let t = match self.placement(name) {
                    Placement::PackedShard => part.narrow(0, b * rows, rows)?,
                    _ => part.clone(),
                };
                Ok((region, t))
            })
            .collect::<Result<Vec<_>>>()?;
        ShardedTensor::new(&whole, part.dtype(), pieces)
    }

    /// The training state of a tensor-parallel model for the distributed checkpoint: each
    /// variable of `varmap` (this rank's parts) and its optimizer states as pieces of the
    /// one-process tensors, the optimizer's scalars. Ranks of other data-parallel replicas
    /// hold the same pieces, which are written once. Every rank of the job calls it with its
    /// own `tp` group, then [`Checkpointer::save`].
    pub fn state_dict(
        &self,
        varmap: &VarMap,
        opt: &impl ElementwiseOptimizer,
        tp: &ProcessGroup,
    ) -> Result<StateDict> {
        let names = var_names(varmap, opt.vars())?;
        let mut out = StateDict::new();
        for (name, var) in lock(varmap.data()).iter() {
            out.insert(
                name.clone(),
                self.sharded_tensor(name, var.as_tensor(), tp)?,
            );
        }
        let state = opt.state();
        for (name, states) in names.iter().zip(&state.per_var) {
            for (s, t) in states {
                out.insert(
                    format!("{OPTIMIZER_STATE}{name}.{s}"),
                    self.sharded_tensor(name, t, tp)?,
                );
            }
        }
        insert_scalars(&mut out, state.scalars)?;
        Ok(out)
    }

    /// Loads a distributed checkpoint (of any layout: one process, data parallel, another
    /// tensor-parallel size) into this rank's parts in `varmap` and into `opt`: each rank reads
    /// only the boxes of its parts. Every rank calls it; nothing changes on any rank unless
    /// every rank could load.
    pub fn load_state_dict(
        &self,
        checkpoints: &Checkpointer,
        varmap: &VarMap,
        opt: &mut impl ElementwiseOptimizer,
        tp: &ProcessGroup,
        options: LoadOptions,
    ) -> Result<()> {
        let vars: Vec<(String, Var)> = lock(varmap.data())
            .iter()
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        // Checked on every rank together: a rank that gave up here would leave the others
        // waiting in the load.
        let checked = var_names(varmap, opt.vars()).and_then(|names| {
            let regions = vars
                .iter()
                .map(|(name, var)| self.regions(name, var.dims(), tp))
                .collect::<Result<Vec<_>>>()?;
            Ok((names, regions))
        });
        let (names, regions) = checkpoints.agree(checked)?;
        let index = checkpoints.index()?;
        let mut wanted = BTreeMap::new();
        let mut parts = BTreeMap::new();
        for ((name, var), (shape, regions)) in vars.iter().zip(regions) {
            parts.insert(name.clone(), (var.dims().to_vec(), regions.clone()));
            let want = Wanted {
                shape,
                dtype: Some(var.dtype()),
                device: var.device().clone(),
                regions,
            };
            wanted.insert(name.clone(), want);
        }
        let device = vars
            .first()
            .map_or(candle_core::Device::Cpu, |(_, v)| v.device().clone());
        wanted.extend(optimizer_wanted(&index, &names, &device, |i, _| {
            parts
                .get(&names[i])
                .map_or_else(Vec::new, |(_, r)| r.clone())
        }));
        let loaded = checkpoints.load_indexed(&index, &wanted, options)?;
        // A packed part's three boxes are laid back end to end.
        let state = optimizer_state(&loaded, &names, |_, t| Ok(t.clone()))?;
        opt.load_state(&state)?;
        for (name, var) in &vars {
            if let Some(t) = loaded.get(name) {
                var.set(&t.joined()?)?;
            }
        }
        Ok(())
    }
}

fn bad_part(name: &str, part: &[usize], why: &str) -> Error {
    Error::InvalidArgument {
        what: "tensor-parallel plan",
        detail: format!(
            "this rank's part of {name} of shape {part:?} {why}: pass the parts that \
             ParallelPlan::shard cut"
        ),
    }
}
