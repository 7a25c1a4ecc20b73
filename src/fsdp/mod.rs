//! Fully sharded data parallel (torch FSDP2's `fully_shard`): each rank keeps a shard of the
//! parameters, of their gradients and of the optimizer state, and gathers a unit's parameters
//! only while it computes with them.
//!
//! The model marks its units where it builds them, with [`unit`] (each transformer block, say);
//! the parameters outside every unit (embeddings, the final norm and head) are the root. At
//! construction every rank builds the model, the ranks check that they built the same
//! variables, take rank 0's initial values and keep one flat shard per unit and one for the
//! root, nearly equal whatever the tensor sizes ([`crate::shard::FlatLayout`]); the full
//! tensors are freed unit by unit.
//!
//! In training, as with [`crate::DistributedDataParallel`]: [`parameters`] are this rank's
//! shards (give them to the optimizer), `forward_t` computes, `backward(&loss)` returns a
//! `GradStore` holding each shard's part of the world-averaged gradient, and `opt.step` steps
//! the shards. A training loop is the same under DDP, ZeRO-2 and FSDP.
//!
//! - Forward: the root's parameters are gathered (they live until backward ends); each unit's
//!   use gathers its parameters, builds the module, computes without a graph and frees them.
//!   The output enters autograd's graph through a custom op.
//! - Backward: that op gathers the unit's parameters again, rebuilds it over fresh variables,
//!   recomputes its forward with a graph and back-propagates through it, then reduce-scatters
//!   the unit's gradient (asynchronously: backward goes on with the unit before it). `backward`
//!   ends by reduce-scattering the root's gradient and waiting for every shard's.
//!
//! So a rank holds, beside its shards, the root's parameters, one unit's full parameters and
//! gradients at a time, and the activations at the units' boundaries (each unit's internal
//! activations live only during its forward and its backward: FSDP with activation
//! checkpointing, in torch's terms).
//!
//! ```rust
//! use candle_core::{Device, Module, Tensor};
//! use candle_nn::{linear, Linear, Optimizer, VarBuilder, VarMap};
//! use candle_parallel::fsdp::{self, FsdpConfig, Unit};
//! use candle_parallel::optim::{Sgd, SgdConfig};
//! use candle_parallel::{distributed, FullyShardedDataParallel};
//!
//! struct Mlp { a: Unit<Linear>, b: Unit<Linear> }
//! impl Module for Mlp {
//!     fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
//!         self.b.forward(&self.a.forward(x)?.relu()?)
//!     }
//! }
//! fn mlp(vb: VarBuilder) -> candle_core::Result<Mlp> {
//!     Ok(Mlp {
//!         a: fsdp::unit(vb.pp("a"), |vb| linear(4, 8, vb))?,
//!         b: fsdp::unit(vb.pp("b"), |vb| linear(8, 2, vb))?,
//!     })
//! }
//! # fn main() -> candle_parallel::Result<()> {
//! let shards = distributed::spawn_threads(2, |pg| {
//!     let config = FsdpConfig { seed: Some(0), ..Default::default() };
//!     let model = FullyShardedDataParallel::with_config(&VarMap::new(), &pg, &Device::Cpu, config, mlp)?;
//!     let mut opt = Sgd::new(model.parameters(), SgdConfig { lr: 0.1, ..Default::default() })?;
//!     let x = Tensor::ones((3, 4), candle_core::DType::F32, &Device::Cpu)?;
//!     let loss = model.forward_t(&x, true)?.sqr()?.sum_all()?;
//!     let grads = model.backward(&loss)?; // this rank's shard of the averaged gradient
//!     opt.step(&grads)?;
//!     // a: 40 parameters, b: 18; two shards of 20 and two of 9 per rank.
//!     Ok(model.parameters().iter().map(|p| p.elem_count()).collect::<Vec<_>>())
//! })?;
//! assert_eq!(shards, [vec![20, 9], vec![20, 9]]);
//! # Ok(()) }
//! ```
//!
//! Rules (torch's FSDP has the same): every rank runs the same units in the same order, in
//! forward and in backward (a unit whose output reaches the loss on some ranks only is an
//! [`Error::Mismatch`] naming the units, never a silent mix); a unit computes the same output
//! each time for the same input (no dropout: the backward recomputes it); tensors a unit
//! captures besides its input ([`Unit::forward_with`]) are constants. A unit used twice in one
//! forward (shared weights) gets both uses' gradients; a unit whose output reaches the loss on
//! no rank gets no gradient (`None` in the `GradStore`, so the optimizer leaves it), and rank 0
//! says so through the `log` facade. Parameters of the root that get no gradient contribute
//! zeros (they share one flat gradient). Buffers (BatchNorm's running statistics) are not
//! supported.
//!
//! [`parameters`]: FullyShardedDataParallel::parameters

mod backend;
mod flat_param;
mod op;
mod unit;

pub use unit::{unit, Unit};

use crate::distributed::ProcessGroup;
use crate::error::{Error, Result};
use crate::memory::MemoryReport;
use crate::util::sync::lock;
use backend::{serving, Recording, Source};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{ModuleT, VarBuilder, VarMap};
use flat_param::{FlatParam, Shared, ROOT};
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// Options of [`FullyShardedDataParallel`].
#[derive(Clone, Debug, PartialEq)]
pub struct FsdpConfig {
    /// The dtype variables are created with (default f32).
    pub dtype: DType,
    /// Initial values of the variables the `VarMap` lacks: from this seed and each variable's
    /// name (the values of [`crate::init::seeded_var_builder`]), or, without a seed (the
    /// default), from candle's random initialisation. Rank 0's are taken either way.
    pub seed: Option<u64>,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        Self {
            dtype: DType::F32,
            seed: None,
        }
    }
}

type BuildModel<M> = Box<dyn Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync>;

/// Fully sharded data parallelism over processes (torch's `fully_shard`). See the
/// [module documentation](self).
pub struct FullyShardedDataParallel<M> {
    build: BuildModel<M>,
    shared: Arc<Shared>,
    /// The root's flat parameter, when the model has parameters outside its units.
    root: Option<Arc<FlatParam>>,
    units: Arc<Vec<Arc<FlatParam>>>,
    /// The model of the last training forward and the root's variables in it, until backward.
    live: Mutex<Option<Live<M>>>,
}

/// What a training forward leaves for its backward.
struct Live<M> {
    /// Holds the root's full parameters and the units' handles.
    _model: M,
    root_vars: Vec<Var>,
}

impl<M> FullyShardedDataParallel<M> {
    /// Shards the model that `build` constructs, with default options. Every rank of `group`
    /// must call it, at the same point of its program.
    ///
    /// `build` is called at construction and again at each forward (it must build the same
    /// model each time: it is cheap, as units build nothing until used). The variables
    /// `varmap` has give the initial values (rank 0's); the others are initialised as
    /// [`FsdpConfig::seed`] says. The wrapper never writes `varmap`: the trained parameters are
    /// the shards.
    pub fn new<F>(varmap: &VarMap, group: &ProcessGroup, device: &Device, build: F) -> Result<Self>
    where
        F: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
    {
        Self::with_config(varmap, group, device, FsdpConfig::default(), build)
    }

    /// As [`FullyShardedDataParallel::new`], with options.
    pub fn with_config<F>(
        varmap: &VarMap,
        group: &ProcessGroup,
        device: &Device,
        config: FsdpConfig,
        build: F,
    ) -> Result<Self>
    where
        F: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
    {
        let everyone: Vec<usize> = (0..group.world_size()).collect();
        let own = group
            .new_group(&everyone)?
            .expect("every rank is a member of a group of every rank");
        let shared = Arc::new(Shared::new(own, device.clone()));
        let source = Arc::new(Source {
            varmap: varmap.clone(),
            seed: config.seed,
        });
        let recording = Recording::new(source.clone());
        let vb = recording.var_builder("", config.dtype, device);
        let (model, units) = unit::record(&shared, &source, || build(vb));
        let model = model.map_err(|e| shared.take_error().unwrap_or(Error::Candle(e)))?;
        drop(model);
        let root_entries = recording.take();
        check_disjoint(&root_entries, &units)?;
        let root = if root_entries.is_empty() {
            None
        } else {
            Some(FlatParam::new(&shared, ROOT, root_entries)?)
        };
        Ok(Self {
            build: Box::new(build),
            shared,
            root,
            units: Arc::new(units),
            live: Mutex::new(None),
        })
    }

    /// This rank's shards, to give to the optimizer: one per unit in the order the model asks
    /// for them, then the root's (when the model has parameters outside its units).
    pub fn parameters(&self) -> Vec<Var> {
        self.flat_params().map(|p| p.shard.clone()).collect()
    }

    /// The names of [`parameters`](Self::parameters), in the same order: `"{unit}.flat_param"`
    /// and `"flat_param"` for the root.
    pub fn parameter_names(&self) -> Vec<String> {
        self.flat_params()
            .map(|p| {
                if p.id == 0 {
                    "flat_param".to_string()
                } else {
                    format!("{}.flat_param", p.name)
                }
            })
            .collect()
    }

    /// The units' prefixes, in the order the model asks for them.
    pub fn units(&self) -> Vec<String> {
        self.units.iter().map(|p| p.name.clone()).collect()
    }

    /// The full names of the variables in each of [`parameters`](Self::parameters), in flat
    /// order.
    pub fn variable_names(&self) -> Vec<Vec<String>> {
        self.flat_params().map(|p| p.names.clone()).collect()
    }

    /// FSDP's own process group (a second group over the same ranks as the one given).
    pub fn process_group(&self) -> &ProcessGroup {
        &self.shared.group
    }

    /// The full value of every variable, by name, gathered from the shards (every rank must
    /// call it; every rank gets them all): what a checkpoint of the whole model holds.
    pub fn full_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for p in self.flat_params() {
            let tensors = p.gather()?;
            out.extend(p.names.iter().cloned().zip(tensors));
        }
        Ok(out)
    }

    /// The bytes this rank keeps between steps: its parameter shards and their gradients (the
    /// optimizer's state is the optimizer's: fill [`MemoryReport::optimizer`] in), and the
    /// process's peak resident memory so far.
    pub fn memory_report(&self) -> MemoryReport {
        let shards: usize = self.flat_params().map(|p| p.shard_bytes()).sum();
        MemoryReport {
            parameters: shards,
            gradients: shards,
            optimizer: 0,
            peak_rss: crate::memory::peak_rss_bytes(),
        }
    }

    fn flat_params(&self) -> impl Iterator<Item = &Arc<FlatParam>> {
        self.units.iter().chain(self.root.iter())
    }

    /// Averages the gradients of `loss` over the world, each rank getting its shards' part:
    /// runs backward (each unit's gradient is reduce-scattered as soon as it is computed), then
    /// reduce-scatters the root's and waits for all. The returned `GradStore` holds, under each
    /// of [`parameters`](Self::parameters), this rank's shard of the averaged gradient; a unit
    /// whose output reached the loss on no rank has none. Call it once after each training
    /// forward, on every rank.
    ///
    /// Fails with [`Error::FsdpBackwardWithoutForward`] when no training forward came since the
    /// last backward, and with [`Error::Mismatch`] when the ranks ran different units.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        let live = lock(&self.live)
            .take()
            .ok_or(Error::FsdpBackwardWithoutForward)?;
        let mut grads = match loss.backward() {
            Ok(g) => g,
            Err(e) => {
                for p in self.flat_params() {
                    p.abandon();
                }
                return Err(self.shared.take_error().unwrap_or(Error::Candle(e)));
            }
        };
        if let Some(root) = &self.root {
            let root_grads = live
                .root_vars
                .iter()
                .map(|v| grads.remove(v.as_tensor()))
                .collect();
            root.reduce_scatter(root_grads)?;
        }
        drop(live);
        let mut without = Vec::new();
        for p in self.flat_params() {
            match p.take_gradient()? {
                Some(g) => {
                    grads.insert(p.shard.as_tensor(), g);
                }
                None => without.push(p.name.clone()),
            }
        }
        if !without.is_empty() && self.shared.group.rank() == 0 {
            log::warn!(
                "FullyShardedDataParallel: unit(s) {} got no gradient: their output did not \
                 reach the loss; the optimizer leaves them as they are",
                without.join(", ")
            );
        }
        Ok(grads)
    }
}

impl<M: ModuleT> FullyShardedDataParallel<M> {
    /// The forward pass in training (`train = true`: the output is part of a graph for
    /// [`backward`](Self::backward)) or evaluation mode (no graph; nothing is kept).
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        if train {
            // A training forward not followed by a backward is forgotten.
            lock(&self.live).take();
            self.shared.iteration.fetch_add(1, Ordering::SeqCst);
        }
        let (names, tensors) = match &self.root {
            Some(root) => (root.names.clone(), root.gather()?),
            None => (Vec::new(), Vec::new()),
        };
        let root_vars = if train {
            tensors
                .iter()
                .map(Var::from_tensor)
                .collect::<candle_core::Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        let served = if train {
            root_vars.iter().map(|v| v.as_tensor().clone()).collect()
        } else {
            tensors
        };
        let dtype = self.root.as_ref().map_or(DType::F32, |r| r.dtype);
        let vb = serving(&names, served, "", dtype, &self.shared.device);
        let model = unit::serve(&self.shared, &self.units, train, || (self.build)(vb))?;
        let out = model
            .forward_t(xs, train)
            .map_err(|e| self.shared.take_error().unwrap_or(Error::Candle(e)))?;
        if train {
            *lock(&self.live) = Some(Live {
                _model: model,
                root_vars,
            });
        }
        Ok(out)
    }
}

/// The forward pass in training mode, for code written against candle's `Module`.
impl<M: ModuleT> candle_core::Module for FullyShardedDataParallel<M> {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_t(xs, true).map_err(Error::into_candle)
    }
}

/// Fails when a variable belongs to two units, or to a unit and the root.
fn check_disjoint(root: &[(String, Tensor)], units: &[Arc<FlatParam>]) -> Result<()> {
    let mut owner: std::collections::HashMap<&str, &str> = std::collections::HashMap::new();
    let all = root.iter().map(|(n, _)| (n.as_str(), ROOT)).chain(
        units
            .iter()
            .flat_map(|u| u.names.iter().map(move |n| (n.as_str(), u.name.as_str()))),
    );
    let mut seen = HashSet::new();
    for (name, unit) in all {
        if !seen.insert(name) {
            return Err(Error::FsdpUnit {
                unit: unit.to_string(),
                detail: format!(
                    "variable `{name}` belongs to `{}` too: a variable belongs to one unit (or \
                     to the root); share a unit, not its variables",
                    owner[name]
                ),
            });
        }
        owner.insert(name, unit);
    }
    Ok(())
}
