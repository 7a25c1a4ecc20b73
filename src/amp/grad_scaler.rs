//! `GradScaler`: dynamic loss scaling for f16 training, with torch's semantics and defaults
//! (`torch.amp.GradScaler`), made safe for sharded gradients.

use crate::distributed::{ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use crate::optim::managed;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, TensorId, Var};
use candle_nn::Optimizer;
use std::collections::HashSet;

/// Options of [`GradScaler`], with `torch.amp.GradScaler`'s names and defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradScalerConfig {
    /// The scale to start from (default 2^16).
    pub init_scale: f64,
    /// What the scale is multiplied by after `growth_interval` steps without inf or NaN
    /// (default 2).
    pub growth_factor: f64,
    /// What the scale is multiplied by after a step with inf or NaN (default 0.5).
    pub backoff_factor: f64,
    /// Clean steps before the scale grows (default 2000).
    pub growth_interval: u64,
    /// When false, the scaler does nothing: `scale` returns the loss, `step` always steps
    /// (default true).
    pub enabled: bool,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

/// Where the iteration stands for one optimizer (torch's `OptState`; no entry is `READY`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Unscaled,
    Stepped,
}

/// One optimizer's iteration (torch keeps one per optimizer): known by its variables.
#[derive(Debug)]
struct PerOptimizer {
    ids: HashSet<TensorId>,
    stage: Stage,
    found_inf: bool,
}

/// Dynamic loss scaling (`torch.amp.GradScaler`): the loss is multiplied by a large scale
/// before backward, so that small f16 gradients do not underflow; the gradients are divided by
/// it before the optimizer sees them, and a step whose gradients hold an inf or a NaN is
/// skipped and the scale halved; after 2,000 clean steps the scale doubles.
///
/// One iteration, as torch's:
///
/// ```rust
/// use candle_core::{DType, Device, Var};
/// use candle_nn::Optimizer;
/// use candle_parallel::amp::{GradScaler, GradScalerConfig};
/// use candle_parallel::optim::{clip_grad_norm, Sgd, SgdConfig};
/// # fn main() -> candle_parallel::Result<()> {
/// let w = Var::new(&[1f32, 2.], &Device::Cpu)?;
/// let mut opt = Sgd::new(vec![w.clone()], SgdConfig { lr: 0.1, ..Default::default() })?;
/// let mut scaler = GradScaler::new(GradScalerConfig::default())?;
/// let loss = w.as_tensor().sqr()?.sum_all()?;
/// let mut grads = scaler.scale(&loss)?.backward()?;
/// scaler.unscale(&mut grads, &[w.clone()])?; // the true gradients, to clip or inspect
/// clip_grad_norm(&mut grads, &[w.clone()], 1.0, 2.0, false)?;
/// assert!(scaler.step(&mut opt, &mut grads)?); // stepped: no inf or NaN
/// scaler.update();
/// assert_eq!(scaler.scale_factor(), 65536.0);
/// # Ok(()) }
/// ```
///
/// Under sharded data parallel (ZeRO-2, fully sharded) each rank sees the gradients of its
/// pieces only: made with [`GradScaler::for_group`], the scaler agrees with the other ranks on
/// whether any gradient anywhere was inf or NaN (one all-reduce), so that every rank skips the
/// same steps and keeps the same scale. Under plain DDP the averaged gradients are the same on
/// every rank, and either form agrees.
#[derive(Debug)]
pub struct GradScaler {
    config: GradScalerConfig,
    /// Kept as torch keeps it: an f32.
    scale: f32,
    growth_tracker: u64,
    /// The optimizers unscaled or stepped since the last update, in order.
    optimizers: Vec<PerOptimizer>,
    group: Option<(ProcessGroup, Device)>,
}

impl GradScaler {
    /// A scaler for one process (or for gradients that every rank holds whole).
    pub fn new(config: GradScalerConfig) -> Result<Self> {
        let valid = |what, ok: bool, value: f64, allowed: &str| {
            if ok {
                Ok(())
            } else {
                Err(Error::InvalidArgument {
                    what,
                    detail: format!("{value} (must be {allowed})"),
                })
            }
        };
        valid(
            "GradScaler init_scale",
            config.init_scale > 0.0 && config.init_scale.is_finite(),
            config.init_scale,
            "positive and finite",
        )?;
        valid(
            "GradScaler growth_factor",
            config.growth_factor > 1.0,
            config.growth_factor,
            "> 1",
        )?;
        valid(
            "GradScaler backoff_factor",
            config.backoff_factor > 0.0 && config.backoff_factor < 1.0,
            config.backoff_factor,
            "in (0, 1)",
        )?;
        valid(
            "GradScaler growth_interval",
            config.growth_interval > 0,
            config.growth_interval as f64,
            "> 0",
        )?;
        Ok(Self {
            scale: config.init_scale as f32,
            config,
            growth_tracker: 0,
            optimizers: Vec::new(),
            group: None,
        })
    }

    /// A scaler whose decision to skip a step is the same on every rank of `group` (every rank
    /// must call [`unscale`](Self::unscale) or [`step`](Self::step) together); `device` is
    /// where the group's collectives run.
    pub fn for_group(
        config: GradScalerConfig,
        group: &ProcessGroup,
        device: &Device,
    ) -> Result<Self> {
        let mut s = Self::new(config)?;
        s.group = Some((group.clone(), device.clone()));
        Ok(s)
    }

    /// The current scale (torch's `get_scale`).
    pub fn scale_factor(&self) -> f64 {
        if self.config.enabled {
            f64::from(self.scale)
        } else {
            1.0
        }
    }

    /// `loss` multiplied by the scale, in f32 (torch multiplies by an f32 scale, which
    /// promotes an f16 loss): back-propagate this one.
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        if !self.config.enabled {
            return Ok(loss.clone());
        }
        Ok(loss
            .to_dtype(DType::F32)?
            .affine(f64::from(self.scale), 0.0)?)
    }

    /// Divides the gradients in `grads` of `vars` by the scale (torch's `unscale_`), and
    /// notes whether any is inf or NaN (agreed over the group with [`for_group`](Self::for_group)).
    /// Optional: [`step`](Self::step) does it when it was not done; call it first to clip or
    /// inspect the true gradients. Once per iteration for each optimizer: `vars` are the
    /// variables of the optimizer stepped next (several optimizers each unscale and step
    /// their own, as torch's scaler keeps a state per optimizer).
    pub fn unscale(&mut self, grads: &mut GradStore, vars: &[Var]) -> Result<()> {
        if !self.config.enabled {
            return Ok(());
        }
        if crate::util::plain_join::inside() {
            return Err(Error::InvalidArgument {
                what: "GradScaler::unscale",
                detail: "inside DistributedDataParallel::join: a rank that has run out of \
                         batches steps the gradients as they come, still scaled (and would \
                         not take part in a group scaler's all-reduce); give the step \
                         (unscale, step, update) to join_with, which runs it on the joined \
                         ranks too"
                    .into(),
            });
        }
        let ids = id_set(vars);
        if let Some(known) = self.optimizers.iter().find(|o| o.ids == ids) {
            return Err(Error::InvalidArgument {
                what: "GradScaler::unscale",
                detail: match known.stage {
                    Stage::Unscaled => "already called for these variables since the last \
                                        update(): once per optimizer and iteration"
                        .into(),
                    Stage::Stepped => "called after step() for these variables: call update() \
                                       first"
                        .into(),
                },
            });
        }
        if let Some(k) = vars
            .iter()
            .position(|v| self.optimizers.iter().any(|o| o.ids.contains(&v.id())))
        {
            return Err(Error::InvalidArgument {
                what: "GradScaler::unscale",
                detail: format!(
                    "variable {k} of {} {:?} was already unscaled since the last update(), \
                     with another set of variables: each optimizer's variables are unscaled \
                     once, as a whole",
                    vars.len(),
                    vars[k].dims()
                ),
            });
        }
        // torch: the reciprocal in double, then float.
        let inv = (1.0 / f64::from(self.scale)) as f32;
        let mut found = false;
        let mut done = HashSet::new();
        for v in vars {
            // A variable listed twice is divided once.
            if !done.insert(v.id()) {
                continue;
            }
            let Some(g) = grads.get(v.as_tensor()) else {
                continue;
            };
            let unscaled = g.affine(f64::from(inv), 0.0)?;
            if !found && g.elem_count() > 0 {
                // x * 0 is 0 for finite x, NaN for inf and NaN.
                let bad = unscaled
                    .to_dtype(DType::F32)?
                    .affine(0.0, 0.0)?
                    .ne(0f32)?
                    .to_dtype(DType::F32)?
                    .sum_all()?
                    .to_device(&Device::Cpu)?
                    .to_scalar::<f32>()?;
                found = bad > 0.0;
            }
            grads.insert(v.as_tensor(), unscaled);
        }
        if let Some((group, device)) = self.group.as_ref().filter(|(g, _)| g.world_size() > 1) {
            let flag =
                Tensor::new(&[f32::from(u8::from(found))], &Device::Cpu)?.to_device(device)?;
            let any = group
                .all_reduce(&flag, ReduceOp::Max)?
                .to_device(&Device::Cpu)?
                .to_vec1::<f32>()?[0];
            found = any > 0.0;
        }
        self.optimizers.push(PerOptimizer {
            ids,
            stage: Stage::Unscaled,
            found_inf: found,
        });
        Ok(())
    }

    /// Unscales the gradients of `vars` in `grads` (unless [`unscale`](Self::unscale) did),
    /// then steps `opt` with them unless some gradient of these variables was inf or NaN;
    /// returns whether it stepped. `vars` are the variables `opt` steps (for an
    /// [`ElementwiseOptimizer`](crate::optim::ElementwiseOptimizer), `opt.vars()`). A skipped
    /// step still runs what a sharding wrapper does after a step (the gather of ZeRO-2), so
    /// that the model stays consistent on every rank. Each optimizer steps once per
    /// iteration; [`update`](Self::update) comes after the last.
    pub fn step_vars<O: Optimizer>(
        &mut self,
        opt: &mut O,
        grads: &mut GradStore,
        vars: &[Var],
    ) -> Result<bool> {
        if !self.config.enabled {
            opt.step(grads)?;
            return Ok(true);
        }
        let ids = id_set(vars);
        let k = match self.optimizers.iter().position(|o| o.ids == ids) {
            Some(k) if self.optimizers[k].stage == Stage::Stepped => {
                return Err(Error::InvalidArgument {
                    what: "GradScaler::step",
                    detail: "already called for this optimizer since the last update()".into(),
                })
            }
            Some(k) => k,
            None => {
                self.unscale(grads, vars)?;
                self.optimizers.len() - 1
            }
        };
        self.optimizers[k].stage = Stage::Stepped;
        if self.optimizers[k].found_inf {
            managed::after_step(vars)?;
            return Ok(false);
        }
        opt.step(grads)?;
        Ok(true)
    }

    /// [`step_vars`](Self::step_vars) for one of this crate's optimizers, whose variables it
    /// knows.
    pub fn step<O: crate::optim::ElementwiseOptimizer>(
        &mut self,
        opt: &mut O,
        grads: &mut GradStore,
    ) -> Result<bool> {
        let vars = opt.vars().to_vec();
        self.step_vars(opt, grads, &vars)
    }

    /// Ends the iteration (torch's `update`): after an iteration in which some optimizer's
    /// gradients held an inf or a NaN the scale is multiplied by `backoff_factor`; after
    /// `growth_interval` consecutive clean iterations, by `growth_factor`.
    pub fn update(&mut self) {
        if !self.config.enabled {
            return;
        }
        if self.optimizers.is_empty() {
            // Nothing was unscaled: torch refuses; nothing to learn from here either.
            log::warn!("GradScaler::update without a step since the last one: the scale stays");
            return;
        }
        if self.found_inf() {
            self.scale = (f64::from(self.scale) * self.config.backoff_factor) as f32;
            self.growth_tracker = 0;
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == self.config.growth_interval {
                let grown = (f64::from(self.scale) * self.config.growth_factor) as f32;
                // torch grows only to a finite scale.
                if grown.is_finite() {
                    self.scale = grown;
                }
                self.growth_tracker = 0;
            }
        }
        self.optimizers.clear();
    }

    /// Whether an unscale since the last update found an inf or a NaN (on any rank, for a
    /// group's scaler; for any optimizer).
    pub fn found_inf(&self) -> bool {
        self.optimizers.iter().any(|o| o.found_inf)
    }

    /// The state to checkpoint (torch's `state_dict`): `scale`, `growth_tracker`.
    pub fn state(&self) -> (f64, u64) {
        (f64::from(self.scale), self.growth_tracker)
    }

    /// Restores a state from [`state`](Self::state).
    pub fn load_state(&mut self, scale: f64, growth_tracker: u64) -> Result<()> {
        if !(scale > 0.0 && scale.is_finite()) {
            return Err(Error::InvalidArgument {
                what: "GradScaler scale",
                detail: format!("{scale} (must be positive and finite)"),
            });
        }
        self.scale = scale as f32;
        self.growth_tracker = growth_tracker;
        Ok(())
    }
}

/// An optimizer's variables as a set: the same optimizer, whatever order its variables are
/// listed in.
fn id_set(vars: &[Var]) -> HashSet<TensorId> {
    vars.iter().map(|v| v.id()).collect()
}
