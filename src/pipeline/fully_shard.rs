//! Fully sharded data parallel along "dp" for pipeline stages (ZeRO-3: torch's `fully_shard`
//! applied to each stage, as torchtitan composes it with pipelining).
//!
//! Between steps each replica of a stage holds only its piece (1/dp) of every parameter, and
//! the optimizer its state for that piece. A step gathers the whole stage (one all-gather along
//! "dp") into a [`PipelineStage`] built for that step only, runs the schedule over it, averages
//! the summed gradients over the replicas and hands each its piece (one reduce-scatter), and the
//! optimizer steps the pieces. Dropping the step's stage frees the whole parameters. The stage
//! is gathered once per step, not per micro-batch: a schedule runs every micro-batch's forward
//! and backward of a stage between the two (torchtitan turns resharding after the forward off
//! under pipelining for the same reason).
//!
//! [`Zero2`](super::Zero2) keeps whole parameters on every replica and shards the optimizer's
//! work only; this shards the parameters too, at the cost of rebuilding the stage's module from
//! its builder each step.
//!
//! ```rust
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{linear, loss, Optimizer, VarBuilder, VarMap};
//! use candle_parallel::init::seeded_var_builder;
//! use candle_parallel::optim::{Sgd, SgdConfig};
//! use candle_parallel::pipeline::{FullyShardedStage, PipelineSchedule, Schedule};
//! use candle_parallel::distributed::{self, DeviceMesh};
//! # fn main() -> candle_parallel::Result<()> {
//! let x = Tensor::randn(0f32, 1., (8, 4), &Device::Cpu)?;
//! let y = Tensor::randn(0f32, 1., (8, 2), &Device::Cpu)?;
//! // One stage (a pipeline of one rank) with two replicas along "dp", each with half the rows.
//! let pieces = distributed::spawn_threads(2, |world| {
//!     let mesh = DeviceMesh::new(&world, &[("dp", 2), ("pp", 1)])?;
//!     let (dp, pp) = (mesh.get_group("dp")?, mesh.get_group("pp")?);
//!     let build = |vb: VarBuilder| linear(4, 2, vb.pp("layer"));
//!     let varmap = VarMap::new();
//!     build(seeded_var_builder(&varmap, 0, DType::F32, &Device::Cpu))?;
//!     let sharded = FullyShardedStage::new(&varmap, build, 0, 1, pp, dp)?;
//!     drop(varmap); // from here on, each replica holds its pieces only
//!     let mut opt = Sgd::new(sharded.pieces().to_vec(), SgdConfig { lr: 0.1, ..Default::default() })?;
//!     let schedule = PipelineSchedule::new(Schedule::GPipe, 2, loss::mse)?;
//!     let rows = (x.narrow(0, 4 * dp.rank(), 4)?, y.narrow(0, 4 * dp.rank(), 4)?);
//!     let stage = sharded.gather()?; // the whole stage, for this step
//!     let out = schedule.step(&[&stage], Some(&rows.0), Some(&rows.1))?;
//!     opt.step(&sharded.reduce_scatter(&stage, &out.grads)?)?;
//!     drop(stage);
//!     Ok(sharded.pieces().iter().map(|p| p.elem_count()).sum::<usize>())
//! })?;
//! assert_eq!(pieces, [5, 5]); // 8 weights and 2 biases, half each
//! # Ok(()) }
//! ```

use super::data_parallel::{gather_pieces, reduce_scatter_to_pieces};
use super::stage::{check_placement, PipelineStage};
use crate::distributed::ProcessGroup;
use crate::error::{Error, Result};
use crate::shard::{chunk_of, FlatLayout};
use crate::util::sync::lock;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Var};
use candle_nn::{VarBuilder, VarMap};
use std::marker::PhantomData;

/// One pipeline stage, fully sharded over its replicas along "dp". See the
/// [module documentation](self).
pub struct FullyShardedStage<M, B> {
    build: B,
    dp: ProcessGroup,
    pp: ProcessGroup,
    stage_index: usize,
    num_stages: usize,
    /// The stage's float variables, sorted by name (the order of every collective).
    names: Vec<String>,
    shapes: Vec<Vec<usize>>,
    dtype: DType,
    device: Device,
    layout: FlatLayout,
    /// This replica's chunk of each parameter (flattened, padded with zeros).
    pieces: Vec<Var>,
    module: PhantomData<fn() -> M>,
}

impl<M, B> FullyShardedStage<M, B>
where
    B: Fn(VarBuilder) -> candle_core::Result<M>,
{
    /// Shards stage `stage_index` of `num_stages` (see [`PipelineStage::new`] for where stages
    /// run on `pp`) over its replicas `dp`. `varmap` holds the stage's parameters, as built by
    /// `build` (the replicas take dp rank 0's values, as DDP does); `build` makes the stage's
    /// module from a `VarBuilder` and is called again at each [`gather`](Self::gather), where it
    /// must ask for the same variables. Once this returns, `varmap` and any module built over
    /// it may be dropped: the stage lives in its pieces. Every rank of `dp` calls it, with the
    /// same stage.
    pub fn new(
        varmap: &VarMap,
        build: B,
        stage_index: usize,
        num_stages: usize,
        pp: &ProcessGroup,
        dp: &ProcessGroup,
    ) -> Result<Self> {
        check_placement(stage_index, num_stages, pp)?;
        let mut params: Vec<(String, Var)> = lock(varmap.data())
            .iter()
            .filter(|(_, v)| v.dtype().is_float())
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        let invalid = |detail: String| Error::InvalidArgument {
            what: "fully sharded pipeline stage",
            detail,
        };
        let Some((_, first)) = params.first() else {
            return Err(invalid(format!(
                "stage {stage_index}: its VarMap holds no float variable; build the stage's \
                 model over the VarMap given here"
            )));
        };
        let (dtype, device) = (first.dtype(), first.device().clone());
        if let Some((name, v)) = params.iter().find(|(_, v)| v.dtype() != dtype) {
            return Err(invalid(format!(
                "stage {stage_index}: variable `{name}` is {:?} where `{}` is {dtype:?}; the \
                 pieces of a stage are gathered in one buffer, of one dtype",
                v.dtype(),
                params[0].0
            )));
        }
        let (world, rank) = (dp.world_size(), dp.rank());
        let mut pieces = Vec::with_capacity(params.len());
        for (_, v) in &params {
            let whole = dp.broadcast(v.as_tensor(), 0)?;
            pieces.push(Var::from_tensor(&chunk_of(&whole, world, rank)?)?);
        }
        let numels: Vec<usize> = params.iter().map(|(_, v)| v.elem_count()).collect();
        Ok(Self {
            build,
            dp: dp.clone(),
            pp: pp.clone(),
            stage_index,
            num_stages,
            shapes: params.iter().map(|(_, v)| v.dims().to_vec()).collect(),
            names: params.into_iter().map(|(n, _)| n).collect(),
            dtype,
            device,
            layout: FlatLayout::new(&numels, world),
            pieces,
            module: PhantomData,
        })
    }

    /// This replica's pieces of the parameters, sorted by name: give them to the optimizer.
    pub fn pieces(&self) -> &[Var] {
        &self.pieces
    }

    /// The stage's index.
    pub fn stage_index(&self) -> usize {
        self.stage_index
    }

    /// The whole stage for one step (or an evaluation): the parameters gathered from every
    /// replica's pieces (one all-gather over `dp`) into new variables, and the module built over
    /// them. Drop it after the step to free them. Every rank of `dp` calls it.
    pub fn gather(&self) -> Result<PipelineStage<M>> {
        let whole = gather_pieces(&self.dp, &self.layout, &self.pieces, &self.shapes)?;
        let varmap = VarMap::new();
        {
            let mut data = lock(varmap.data());
            for (name, t) in self.names.iter().zip(whole) {
                data.insert(name.clone(), Var::from_tensor(&t)?);
            }
        }
        let module = (self.build)(VarBuilder::from_varmap(&varmap, self.dtype, &self.device))?;
        let mut made: Vec<String> = lock(varmap.data()).keys().cloned().collect();
        made.sort();
        if made != self.names {
            let extra: Vec<&String> = made.iter().filter(|n| !self.names.contains(n)).collect();
            return Err(Error::InvalidArgument {
                what: "fully sharded pipeline stage",
                detail: format!(
                    "stage {}: its builder asked for variables {extra:?} that the stage was not \
                     sharded with; it must build the model it built over the VarMap given to \
                     FullyShardedStage::new",
                    self.stage_index
                ),
            });
        }
        PipelineStage::new(module, &varmap, self.stage_index, self.num_stages, &self.pp)
    }

    /// The gradients of the pieces, for the optimizer: the step's gradients of `stage` (the one
    /// [`gather`](Self::gather) gave) in `grads`, averaged over `dp` by one reduce-scatter
    /// (zeros for a parameter without one), this replica's chunk of each. Every rank of `dp`
    /// calls it.
    pub fn reduce_scatter(&self, stage: &PipelineStage<M>, grads: &GradStore) -> Result<GradStore> {
        let params = stage.named_parameters();
        let same = stage.stage_index() == self.stage_index
            && params.len() == self.names.len()
            && params.iter().zip(&self.names).all(|((n, _), m)| n == m);
        if !same {
            return Err(Error::InvalidArgument {
                what: "fully sharded pipeline stage",
                detail: format!(
                    "reduce_scatter of stage {} was given stage {}, not the one its gather() \
                     made",
                    self.stage_index,
                    stage.stage_index()
                ),
            });
        }
        let vars: Vec<Var> = params.iter().map(|(_, v)| v.clone()).collect();
        reduce_scatter_to_pieces(&self.dp, &self.layout, &vars, &self.pieces, grads)
    }
}
