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
use super::stage::{check_placement, sorted_variables, PipelineStage};
use crate::distributed::ProcessGroup;
use crate::error::{Error, Result};
use crate::shard::{chunk_of, FlatLayout};
use crate::util::sync::lock;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{VarBuilder, VarMap};
use std::collections::{BTreeSet, HashMap};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

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
    /// The variables of the stage the latest [`gather`](Self::gather) made.
    latest: Mutex<Vec<candle_core::TensorId>>,
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
        let params = sorted_variables(varmap);
        let invalid = |detail: String| Error::InvalidArgument {
            what: "fully sharded pipeline stage",
            detail,
        };
        if let Some((name, v)) = params.iter().find(|(_, v)| !v.dtype().is_float()) {
            return Err(invalid(format!(
                "stage {stage_index}: variable `{name}` is {:?}; a fully sharded stage shards \
                 and trains float variables only: keep integer state outside the stage's VarMap",
                v.dtype()
            )));
        }
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
            latest: Mutex::new(Vec::new()),
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
        let vars = whole
            .iter()
            .map(Var::from_tensor)
            .collect::<candle_core::Result<Vec<_>>>()?;
        let asked = Arc::new(Mutex::new(BTreeSet::new()));
        let served = Served {
            vars: self
                .names
                .iter()
                .cloned()
                .zip(vars.iter().cloned())
                .collect(),
            asked: asked.clone(),
            stage: self.stage_index,
        };
        let vb = VarBuilder::from_backend(Box::new(served), self.dtype, self.device.clone());
        let module = (self.build)(vb)?;
        let asked = lock(&asked).clone();
        let missing: Vec<&String> = self.names.iter().filter(|n| !asked.contains(*n)).collect();
        if !missing.is_empty() {
            return Err(Error::InvalidArgument {
                what: "fully sharded pipeline stage",
                detail: format!(
                    "stage {}: its builder did not ask for variables {missing:?}, which the stage \
                     was sharded with (they would never get a gradient); it must build the model \
                     it built over the VarMap given to FullyShardedStage::new",
                    self.stage_index
                ),
            });
        }
        let varmap = VarMap::new();
        lock(varmap.data()).extend(self.names.iter().cloned().zip(vars.iter().cloned()));
        *lock(&self.latest) = vars.iter().map(|v| v.id()).collect();
        PipelineStage::new(module, &varmap, self.stage_index, self.num_stages, &self.pp)
    }

    /// The gradients of the pieces, for the optimizer: the step's gradients of `stage` (the one
    /// the latest [`gather`](Self::gather) gave) in `grads`, averaged over `dp` by one
    /// reduce-scatter (zeros for a parameter without one on this replica), this replica's chunk
    /// of each. A parameter without a gradient on every replica is left out, so the optimizer
    /// skips it as in one process, and said through the `log` facade. Every rank of `dp` calls
    /// it.
    pub fn reduce_scatter(&self, stage: &PipelineStage<M>, grads: &GradStore) -> Result<GradStore> {
        let params = stage.named_parameters();
        let ids: Vec<candle_core::TensorId> = params.iter().map(|(_, v)| v.id()).collect();
        if ids != *lock(&self.latest) {
            return Err(Error::InvalidArgument {
                what: "fully sharded pipeline stage",
                detail: format!(
                    "reduce_scatter of stage {} was given a stage (index {}) that is not the one \
                     its latest gather() made; pass the stage this step ran on",
                    self.stage_index,
                    stage.stage_index()
                ),
            });
        }
        let vars: Vec<Var> = params.iter().map(|(_, v)| v.clone()).collect();
        let names = Some(self.names.as_slice());
        reduce_scatter_to_pieces(&self.dp, &self.layout, &vars, &self.pieces, grads, names)
    }
}

/// Serves a gathered stage's variables to its builder by name, noting which it asked for.
struct Served {
    vars: HashMap<String, Var>,
    asked: Arc<Mutex<BTreeSet<String>>>,
    stage: usize,
}

impl Served {
    fn var(&self, name: &str) -> candle_core::Result<&Var> {
        match self.vars.get(name) {
            Some(v) => {
                lock(&self.asked).insert(name.to_string());
                Ok(v)
            }
            None => candle_core::bail!(
                "fully sharded pipeline stage {}: its builder asked for variable `{name}`, which \
                 the stage was not sharded with; it must build the model it built over the \
                 VarMap given to FullyShardedStage::new",
                self.stage
            ),
        }
    }
}

impl SimpleBackend for Served {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        _: candle_nn::Init,
        _: DType,
        _: &Device,
    ) -> candle_core::Result<Tensor> {
        let v = self.var(name)?;
        if v.shape() != &shape {
            candle_core::bail!(
                "fully sharded pipeline stage {}: its builder asked for `{name}` as {shape:?}, \
                 but it was sharded as {:?}",
                self.stage,
                v.shape()
            )
        }
        Ok(v.as_tensor().clone())
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        Ok(self.var(name)?.as_tensor().clone())
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.vars.contains_key(name)
    }
}
