//! Fully sharded data parallel (torch FSDP2's `fully_shard`): each rank keeps a shard of the
//! parameters, of their gradients and of the optimizer state, and gathers a unit's parameters
//! only while it computes with them.
//!
//! The model marks its units where it builds them, with [`unit`] (each transformer block, say);
//! the parameters outside every unit (embeddings, the final norm and head) are the root. At
//! construction every rank builds the model, the ranks check that they built the same
//! variables, take rank 0's initial values and keep their chunk of every parameter, one flat
//! shard per unit and one for the root, nearly equal whatever the tensor sizes
//! ([`crate::shard`]); the full tensors are freed unit by unit.
//!
//! In training, as with [`crate::DistributedDataParallel`]: [`parameters`] are this rank's
//! pieces of the parameters (give them to the optimizer), `forward_t` computes,
//! `backward(&loss)` returns a `GradStore` holding each piece's part of the world-averaged
//! gradient, and `opt.step` steps the pieces. A training loop is the same under DDP, ZeRO-2 and
//! FSDP. A parameter that got a gradient on no rank (frozen by `detach`, a branch not taken)
//! gets none, so that the optimizer leaves it and its state alone, as in one process.
//!
//! - Forward: in training, rank 0's buffers are broadcast first (as DDP does); the root's
//!   parameters are gathered (they live until backward ends); each unit's use gathers its
//!   parameters, builds the module, computes without a graph and frees them. The output enters
//!   autograd's graph through a custom op. Every training forward since the last backward
//!   belongs to the next backward (two forwards summed into one loss train as in one
//!   process).
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
//!     // Each rank holds half of each parameter: a's weight (32) and bias (8), b's (16, 2).
//!     Ok(model.parameters().iter().map(|p| p.elem_count()).collect::<Vec<_>>())
//! })?;
//! assert_eq!(shards, [vec![16, 4, 8, 1], vec![16, 4, 8, 1]]);
//! # Ok(()) }
//! ```
//!
//! Rules (torch's FSDP has the same): every rank runs the same units in the same order, in
//! forward and in backward (a unit whose output reaches the loss on some ranks only is an
//! [`Error::Mismatch`] naming the units, never a silent mix); a unit computes the same output
//! each time for the same input (no dropout: the backward recomputes it); tensors a unit
//! captures besides its input ([`Unit::forward_with`]) are constants. A unit used twice in one
//! forward (shared weights) gets both uses' gradients; a parameter whose gradient reaches the
//! loss on no rank gets no gradient (`None` in the `GradStore`, so the optimizer leaves it), and
//! rank 0 says so through the `log` facade unless it is declared frozen
//! ([`FsdpConfig::frozen_parameters`]).
//!
//! Buffers (BatchNorm's running statistics, and every variable that is not a float) are not
//! sharded: they are the `VarMap`'s own variables, whole on every rank, updated in place by
//! each training forward (once: a backward's recomputation works on copies), broadcast from
//! rank 0 before each training forward ([`FsdpConfig::broadcast_buffers`]), and part of
//! [`FullyShardedDataParallel::full_parameters`]. The `VarMap`'s parameters keep their initial
//! values: the trained ones are the pieces, which `full_parameters` gathers. An optimizer of
//! this crate made over the `VarMap`'s parameters is refused ([`crate::optim::managed`]).
//!
//! Evaluation (`forward_t(x, false)`) gathers each unit too: every rank must evaluate. A rank
//! that left the group meanwhile makes it fail at once, naming it.
//!
//! [`parameters`]: FullyShardedDataParallel::parameters

mod backend;
mod checkpoint;
mod flat_param;
mod op;
mod unit;

pub use unit::{unit, Unit};

use crate::amp::MixedPrecision;
use crate::ddp::unused::{describe, is_declared};
use crate::distributed::{ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use crate::memory::MemoryReport;
use crate::optim::managed::{self, Registration};
use crate::util::sync::lock;
use backend::{serving, Buffers, Recorded, Recording, Source};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{ModuleT, VarBuilder, VarMap};
use flat_param::{agree_on_buffers, broadcast_buffers, FlatParam, Shared, ROOT};
use op::Seen;
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
    /// Variables whose name ends in one of these path components are buffers, not
    /// parameters: never sharded, never given to the optimizer (default: DDP's, candle-nn's
    /// BatchNorm statistics and torch's `num_batches_tracked`). Variables that are not floats
    /// are buffers whatever their name.
    pub buffer_names: Vec<String>,
    /// Broadcast rank 0's buffers before each training forward (default true, as DDP).
    pub broadcast_buffers: bool,
    /// Parameters frozen on purpose, never reported for having no gradient: names, or
    /// prefixes of a whole path component (as [`crate::DdpConfig::frozen_parameters`]).
    pub frozen_parameters: Vec<String>,
    /// The dtypes units are gathered and compute in, and gradients are averaged in, beside the
    /// pieces' dtype (`dtype`, the master weights' and the optimizer's); default: none.
    pub mixed_precision: MixedPrecision,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        Self {
            dtype: DType::F32,
            seed: None,
            buffer_names: crate::util::BUFFER_NAMES.map(String::from).to_vec(),
            broadcast_buffers: true,
            frozen_parameters: Vec::new(),
            mixed_precision: MixedPrecision::default(),
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
    /// The buffers outside every unit.
    root_buffers: Vec<(String, Var)>,
    units: Arc<Vec<Arc<FlatParam>>>,
    /// The models of the training forwards since the last backward and the root's variables
    /// in each, until backward.
    live: Mutex<Vec<Live<M>>>,
    broadcast_buffers: bool,
    frozen: Vec<String>,
    /// The sets of parameters without a gradient reported so far (each once).
    reported: Mutex<HashSet<Vec<String>>>,
    /// Refuses optimizers over the `VarMap`'s parameters and buffers, for as long as the
    /// wrapper lives.
    _managed: [Registration; 2],
}

/// What a training forward leaves for its backward.
struct Live<M> {
    /// Holds the root's full parameters and the units' handles.
    _model: M,
    root_vars: Vec<Var>,
}

/// Training forwards without a backward after which the wrapper says that it keeps them all.
const PILING_UP: usize = 16;

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
        warn_if_untracked_on_nccl(group, device);
        config.mixed_precision.warn_if_slow_on(device);
        let everyone: Vec<usize> = (0..group.world_size()).collect();
        let own = group
            .new_group(&everyone)?
            .expect("every rank is a member of a group of every rank");
        let shared = Arc::new(Shared::new(own, device.clone(), config.mixed_precision));
        let source = Arc::new(Source {
            varmap: varmap.clone(),
            seed: config.seed,
            buffer_names: config.buffer_names.clone(),
        });
        let recording = Recording::new(source.clone());
        let vb = recording.var_builder("", config.dtype, device);
        let (model, units) = unit::record(&shared, &source, || build(vb));
        let model = model.map_err(|e| shared.take_error().unwrap_or(Error::Candle(e)))?;
        drop(model);
        let root_recorded = recording.take();
        check_disjoint(&root_recorded, &units)?;
        let root = if root_recorded.params.is_empty() {
            None
        } else {
            Some(FlatParam::new(
                &shared,
                ROOT,
                root_recorded.params,
                Vec::new(),
            )?)
        };
        agree_on_buffers(&shared, ROOT, &root_recorded.buffers)?;
        let flat: Vec<&Arc<FlatParam>> = units.iter().chain(root.iter()).collect();
        let in_varmap: Vec<(String, Var)> = {
            let vars = lock(varmap.data());
            flat.iter()
                .flat_map(|p| p.names.iter())
                .filter_map(|n| vars.get(n).map(|v| (n.clone(), v.clone())))
                .collect()
        };
        let buffers: Vec<(String, Var)> = flat
            .iter()
            .flat_map(|p| p.buffers.iter().cloned())
            .chain(root_recorded.buffers.iter().cloned())
            .collect();
        let _managed = [
            managed::register_whole(&in_varmap, "FullyShardedDataParallel"),
            managed::register_buffers(&buffers, "FullyShardedDataParallel"),
        ];
        Ok(Self {
            build: Box::new(build),
            shared,
            root,
            root_buffers: root_recorded.buffers,
            units: Arc::new(units),
            live: Mutex::new(Vec::new()),
            broadcast_buffers: config.broadcast_buffers,
            frozen: config.frozen_parameters,
            reported: Mutex::new(HashSet::new()),
            _managed,
        })
    }

    /// This rank's pieces of the parameters, to give to the optimizer: each unit's in the order
    /// the model asks for the units (and each unit for its variables), then the root's (the
    /// parameters outside every unit). Each is a 1-D chunk of the flattened parameter
    /// ([`crate::shard`]).
    pub fn parameters(&self) -> Vec<Var> {
        self.flat_params()
            .flat_map(|p| p.pieces.iter().cloned())
            .collect()
    }

    /// The names of [`parameters`](Self::parameters), in the same order: the parameters' full
    /// names.
    pub fn parameter_names(&self) -> Vec<String> {
        self.flat_params()
            .flat_map(|p| p.names.iter().cloned())
            .collect()
    }

    /// torch's `clip_grad_norm_` over the gradients `backward` returned, with the whole
    /// model's norm: each rank holds its pieces' gradients, their norms are added over the
    /// ranks (one all-reduce), and every rank scales by the same coefficient. Returns the total
    /// norm. Every rank must call it. See [`crate::optim::clip_grad_norm`].
    pub fn clip_grad_norm(
        &self,
        grads: &mut GradStore,
        max_norm: f64,
        norm_type: f64,
        error_if_nonfinite: bool,
    ) -> Result<f64> {
        crate::optim::clip_grad_norm_over(
            grads,
            &self.parameters(),
            max_norm,
            norm_type,
            error_if_nonfinite,
            Some(&self.shared.group),
        )
    }

    /// The units' prefixes, in the order the model asks for them.
    pub fn units(&self) -> Vec<String> {
        self.units.iter().map(|p| p.name.clone()).collect()
    }

    /// The full names of the parameters of each unit (in the order of
    /// [`units`](Self::units)), then of the root's when the model has parameters outside its
    /// units.
    pub fn variable_names(&self) -> Vec<Vec<String>> {
        self.flat_params().map(|p| p.names.clone()).collect()
    }

    /// The buffers (running statistics, integer variables), by name: the `VarMap`'s variables,
    /// whole on every rank.
    pub fn buffers(&self) -> Vec<(String, Var)> {
        self.flat_params()
            .flat_map(|p| p.buffers.iter().cloned())
            .chain(self.root_buffers.iter().cloned())
            .collect()
    }

    /// FSDP's own process group (a second group over the same ranks as the one given).
    pub fn process_group(&self) -> &ProcessGroup {
        &self.shared.group
    }

    /// The full value of every variable, by name: the parameters gathered from the pieces,
    /// then the buffers (this rank's; the same on every rank after a training forward with
    /// [`FsdpConfig::broadcast_buffers`]). Every rank must call it; every rank gets them all:
    /// what a checkpoint of the whole model holds.
    pub fn full_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        // A gather prefetched by an earlier forward may predate an optimizer step since.
        self.shared.drop_prefetched();
        let mut out = Vec::new();
        for p in self.flat_params() {
            let tensors = p.gather()?;
            out.extend(p.names.iter().cloned().zip(tensors));
        }
        for (name, var) in self.buffers() {
            out.push((name, var.as_tensor().copy()?));
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

    /// Averages the gradients of `loss` over the world, each rank getting its pieces' part:
    /// runs backward (each unit's gradient is reduce-scattered as soon as it is computed), then
    /// reduce-scatters the root's, agrees with the other ranks on which parameters got a
    /// gradient anywhere (one small all-reduce) and waits for all. The returned `GradStore`
    /// holds, under each of [`parameters`](Self::parameters), this rank's piece of the averaged
    /// gradient; a parameter whose gradient reached the loss on no rank has none. Call it once
    /// after the training forwards whose outputs `loss` is made of, on every rank.
    ///
    /// Fails with [`Error::FsdpBackwardWithoutForward`] when no training forward came since the
    /// last backward, and with [`Error::Mismatch`] when the ranks ran different units.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        let live = std::mem::take(&mut *lock(&self.live));
        if live.is_empty() {
            return Err(Error::FsdpBackwardWithoutForward);
        }
        // An evaluation forward since the training one may have left gathers behind.
        self.shared.drop_prefetched();
        let result = self.reduce(loss, live);
        // The graphs of this iteration are done with, whatever happened.
        self.shared.iteration.fetch_add(1, Ordering::SeqCst);
        self.shared.backward_ran.store(false, Ordering::SeqCst);
        self.shared.end_iteration();
        result
    }

    /// Gradient accumulation without communication (torch's `no_sync`): while the guard lives,
    /// backwards sum each unit's (and the root's) full gradients on this rank and return no
    /// gradients for the pieces; the first backward after it reduce-scatters the sums with its
    /// own. For k micro-batches whose losses are divided by k, the result equals one batch k
    /// times larger. The sums take the memory of the full gradients until then.
    pub fn no_sync(&self) -> FsdpNoSync<'_> {
        self.shared.no_sync.fetch_add(1, Ordering::SeqCst);
        FsdpNoSync {
            open: &self.shared.no_sync,
        }
    }

    fn reduce(&self, loss: &Tensor, live: Vec<Live<M>>) -> Result<GradStore> {
        let mut grads = match crate::nn::backward(loss) {
            Ok(g) => g,
            Err(e) => {
                for p in self.flat_params() {
                    p.abandon();
                }
                return Err(self.shared.take_error().unwrap_or(Error::Candle(e)));
            }
        };
        if let Some(root) = &self.root {
            // Each training forward's root variables got their part of the gradient.
            let mut root_grads: Vec<Option<Tensor>> = vec![None; root.names.len()];
            for l in &live {
                for (sum, v) in root_grads.iter_mut().zip(&l.root_vars) {
                    if let Some(g) = grads.remove(v.as_tensor()) {
                        *sum = Some(match sum.take() {
                            Some(s) => (s + g)?,
                            None => g,
                        });
                    }
                }
            }
            root.reduce_scatter(root_grads)?;
        }
        drop(live);
        if self.shared.no_sync.load(Ordering::SeqCst) > 0 {
            // Summed on this rank; the synchronised backward hands the pieces' gradients out.
            return Ok(grads);
        }
        for p in self.flat_params() {
            // Sums of no_sync backwards of a unit this backward did not run.
            if p.holds_local_sums() {
                p.reduce_scatter(vec![None; p.pieces.len()])?;
            }
        }
        let used_here: Vec<bool> = self.flat_params().flat_map(|p| p.take_used()).collect();
        let used_anywhere = self.agree_on_used(&used_here)?;
        let mut without = Vec::new();
        let mut next = 0;
        for p in self.flat_params() {
            let used = &used_anywhere[next..next + p.pieces.len()];
            next += p.pieces.len();
            let Some(shard) = p.take_gradient()? else {
                without.extend(p.names.iter().cloned());
                continue;
            };
            for ((piece, g), (&used, name)) in p
                .pieces
                .iter()
                .zip(p.layout.split_shard(&shard)?)
                .zip(used.iter().zip(&p.names))
            {
                match used {
                    true => {
                        grads.insert(piece.as_tensor(), crate::nn::cast(&g, piece.dtype())?);
                    }
                    false => without.push(name.clone()),
                }
            }
        }
        self.report_without(without);
        Ok(grads)
    }

    /// Which parameters got a gradient on any rank: the maximum of every rank's 0/1 map.
    fn agree_on_used(&self, used_here: &[bool]) -> Result<Vec<bool>> {
        let group = &self.shared.group;
        if group.world_size() == 1 || used_here.is_empty() {
            return Ok(used_here.to_vec());
        }
        let map: Vec<f32> = used_here.iter().map(|&u| f32::from(u8::from(u))).collect();
        let map =
            Tensor::from_vec(map, used_here.len(), &Device::Cpu)?.to_device(&self.shared.device)?;
        let all = group
            .all_reduce(&map, ReduceOp::Max)?
            .to_device(&Device::Cpu)?
            .to_vec1::<f32>()?;
        Ok(all.into_iter().map(|u| u > 0.5).collect())
    }

    /// Says once per distinct set (rank 0) which parameters got no gradient on any rank,
    /// leaving out those declared frozen.
    fn report_without(&self, without: Vec<String>) {
        let mut names: Vec<String> = without
            .into_iter()
            .filter(|n| !is_declared(n, &self.frozen))
            .collect();
        names.sort();
        if names.is_empty() || self.shared.group.rank() != 0 {
            return;
        }
        if lock(&self.reported).insert(names.clone()) {
            log::warn!(
                "FullyShardedDataParallel: {}; the optimizer leaves them as they are (declare \
                 them in FsdpConfig::frozen_parameters if that is meant)",
                describe(&names)
            );
        }
    }
}

impl<M: ModuleT> FullyShardedDataParallel<M> {
    /// The forward pass in training (`train = true`: the output is part of a graph for
    /// [`backward`](Self::backward)) or evaluation mode (no graph; nothing is kept). Every
    /// rank must call it, in either mode: it gathers each unit's parameters.
    ///
    /// Every training forward since the last backward belongs to the next backward: their
    /// root parameters are kept until then (evaluate with `train = false`).
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        self.forward_inner(xs, train).map_err(|e| match e {
            Error::PeerLost { rank, detail } => Error::PeerLost {
                rank,
                detail: format!(
                    "{detail}; FullyShardedDataParallel's forward (in training and evaluation) \
                     gathers each unit's parameters from every rank: run it on every rank, or \
                     take full_parameters() on every rank and evaluate a plain model alone"
                ),
            },
            other => other,
        })
    }

    fn forward_inner(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        if train && self.shared.backward_ran.swap(false, Ordering::SeqCst) {
            // The last forwards' gradients were computed and never averaged nor handed out.
            lock(&self.live).clear();
            for p in self.flat_params() {
                p.abandon();
            }
            self.shared.iteration.fetch_add(1, Ordering::SeqCst);
            return Err(Error::FsdpUnreducedBackward);
        }
        self.shared.drop_prefetched();
        let precision = self.shared.precision;
        let xs = &precision.cast_input(xs)?;
        if train && self.broadcast_buffers {
            broadcast_buffers(&self.shared.group, &self.buffers())?;
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
        let dtype = self.root.as_ref().map_or(DType::F32, |r| r.compute);
        let vb = serving(
            &names,
            served,
            &self.root_buffers,
            Buffers::Live,
            "",
            dtype,
            &self.shared.device,
        )?;
        let model = unit::serve(&self.shared, &self.units, train, || (self.build)(vb))?;
        let out = model
            .forward_t(xs, train)
            .map_err(|e| self.shared.take_error().unwrap_or(Error::Candle(e)))?;
        let out = match train {
            true => out.apply_op1(Seen {
                shared: self.shared.clone(),
            })?,
            false => out,
        };
        if train {
            let mut live = lock(&self.live);
            live.push(Live {
                _model: model,
                root_vars,
            });
            if live.len() == PILING_UP && self.shared.group.rank() == 0 {
                log::warn!(
                    "FullyShardedDataParallel: {PILING_UP} training forwards without a \
                     backward: each is kept (with its copy of the root's parameters) for the \
                     next backward; evaluate with forward_t(x, false)"
                );
            }
        }
        precision.cast_output(out)
    }
}

/// The forward pass in training mode, for code written against candle's `Module`.
impl<M: ModuleT> candle_core::Module for FullyShardedDataParallel<M> {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_t(xs, true).map_err(Error::into_candle)
    }
}

/// While it lives, backwards sum gradients locally ([`FullyShardedDataParallel::no_sync`]).
#[must_use = "no_sync only lasts while its guard lives"]
pub struct FsdpNoSync<'a> {
    open: &'a std::sync::atomic::AtomicUsize,
}

impl Drop for FsdpNoSync<'_> {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Says (once per process) that fully sharded training on NCCL has not yet been seen to train
/// right on a device made without cudarc's event tracking
/// ([`cuda_device`](crate::devices::cuda_device)): on an H200 on 2026-11-27 it trained far from
/// the CPU's numbers with gradient clipping (loss 0.78 against 0.59), where fully sharded over
/// TCP, and DDP and SyncBatchNorm on NCCL in `tests/gpu.rs`, gave the CPU's numbers on such a
/// device.
fn warn_if_untracked_on_nccl(group: &ProcessGroup, device: &Device) {
    #[cfg(feature = "cuda")]
    if let (crate::distributed::Backend::Nccl, Device::Cuda(cuda)) = (group.backend(), device) {
        static SAID: std::sync::Once = std::sync::Once::new();
        if !cuda.is_event_tracking() {
            SAID.call_once(|| {
                log::warn!(
                    "FullyShardedDataParallel on NCCL with a device made by \
                     candle_parallel::devices::cuda_device (cudarc's event tracking off): this \
                     combination trained wrongly on a GPU (2026-11-27, with gradient clipping); \
                     until that is found, make the device with Device::new_cuda_with_stream"
                )
            });
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (group, device);
}

/// Fails when a variable belongs to two units, or to a unit and the root.
fn check_disjoint(root: &Recorded, units: &[Arc<FlatParam>]) -> Result<()> {
    let mut owner: std::collections::HashMap<&str, &str> = std::collections::HashMap::new();
    let root_names = root
        .params
        .iter()
        .map(|(n, _)| n)
        .chain(root.buffers.iter().map(|(n, _)| n));
    let unit_names = units.iter().flat_map(|u| {
        u.names
            .iter()
            .chain(u.buffers.iter().map(|(n, _)| n))
            .map(move |n| (n.as_str(), u.name.as_str()))
    });
    let all = root_names.map(|n| (n.as_str(), ROOT)).chain(unit_names);
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
