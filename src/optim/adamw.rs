//! `torch.optim.AdamW`.

use super::adamw_kernel::{self, Scalars, State};
use super::{
    check_grads, checked_state, empty_state, managed, ElementwiseOptimizer, OptimizerState,
};
use crate::error::Error;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::Optimizer;
use std::sync::atomic::{AtomicBool, Ordering};

/// Hyper-parameters of [`AdamW`], with `torch.optim.AdamW`'s names and defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Decay rates of the first and second moment averages (default (0.9, 0.999)).
    pub betas: (f64, f64),
    /// Added to the denominator for numerical stability (default 1e-8).
    pub eps: f64,
    /// Decoupled weight decay: each step multiplies the parameter by `1 - lr * weight_decay`
    /// (default 1e-2).
    pub weight_decay: f64,
    /// The AMSGrad variant: normalise by the largest second moment seen (default false).
    pub amsgrad: bool,
    /// Ascend instead of descend (default false).
    pub maximize: bool,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 1e-2,
            amsgrad: false,
            maximize: false,
        }
    }
}

impl AdamWConfig {
    /// torch's checks: `0 <= lr`, `0 <= eps`, `0 <= beta < 1`, `0 <= weight_decay` (NaN fails).
    fn validate(&self) -> crate::Result<()> {
        let invalid = |what, value: f64, allowed: &str| {
            Err(Error::InvalidArgument {
                what,
                detail: format!("{value} (must be {allowed})"),
            })
        };
        let non_negative = |x: f64| x >= 0.0;
        let beta = |x: f64| (0.0..1.0).contains(&x);
        if !non_negative(self.lr) {
            return invalid("AdamW learning rate", self.lr, ">= 0");
        }
        if !non_negative(self.eps) {
            return invalid("AdamW eps", self.eps, ">= 0");
        }
        if !beta(self.betas.0) {
            return invalid("AdamW betas.0", self.betas.0, "in [0, 1)");
        }
        if !beta(self.betas.1) {
            return invalid("AdamW betas.1", self.betas.1, "in [0, 1)");
        }
        if !non_negative(self.weight_decay) {
            return invalid("AdamW weight_decay", self.weight_decay, ">= 0");
        }
        Ok(())
    }
}

/// `torch.optim.AdamW` for candle: Adam with decoupled weight decay, optionally AMSGrad.
///
/// Each step, for each variable `p` that has a gradient `g` (variables without one are left
/// alone, their state too), in the order of torch's single-tensor implementation
/// (`foreach=False`), so that results agree with torch's to rounding:
///
/// ```text
/// t = t + 1                                     (one count shared by all variables)
/// g = -g                                        if maximize
/// p = p * (1 - lr * weight_decay)
/// m = m + (g - m) * (1 - beta1)                 (torch's lerp; m, v start at 0)
/// v = v * beta2 + (1 - beta2) * g * g
/// v_max = max(v_max, v)                         if amsgrad; it replaces v below
/// denom = sqrt(v) / sqrt(1 - beta2^t) + eps
/// p = p - (lr / (1 - beta1^t)) * m / denom
/// ```
///
/// State: `exp_avg` (m), `exp_avg_sq` (v) and with AMSGrad `max_exp_avg_sq` per variable, and
/// the scalar `step` (t). f32 and f64 variables keep their state, and compute, in their own
/// dtype. f16 and bf16 variables keep their state in f32 and compute in f32: each step reads the
/// variable and its gradient as f32 and rounds the result back once (torch would keep bf16
/// state for bf16 parameters; f32 state loses far less to rounding).
///
/// Differences from torch: `step` is one count for all variables, the number of steps that
/// updated any variable (torch keeps one per parameter). They differ only for a variable that
/// misses gradients while others get theirs; the optimizer says so once through the `log`
/// facade. A shared count is what lets a sharded optimizer step flat slices of many variables.
///
/// ```rust
/// use candle_core::{Device, Var};
/// use candle_nn::Optimizer;
/// use candle_parallel::optim::{AdamW, AdamWConfig};
/// # fn main() -> candle_core::Result<()> {
/// let p = Var::new(&[1f32], &Device::Cpu)?;
/// let mut opt = AdamW::new(vec![p.clone()], AdamWConfig { lr: 0.1, ..Default::default() })?;
/// opt.backward_step(&p.as_tensor().sum_all()?)?; // gradient 1
/// // Decay to 1 - 0.1 * 0.01 = 0.999, then Adam's first step of lr: 0.899.
/// assert!((p.to_vec1::<f32>()?[0] - 0.899).abs() < 1e-6);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct AdamW {
    vars: Vec<Var>,
    moments: Vec<Option<Moments>>,
    /// Set when [`ElementwiseOptimizer::state`] hands the moments out: the next step stops
    /// writing them in place.
    handed_out: AtomicBool,
    /// Whether `moments[i]` are ours alone, for the CPU kernel to write in place (not handed
    /// out, not loaded from the caller's tensors).
    owned: Vec<bool>,
    step: u64,
    config: AdamWConfig,
    warned_shared_step: bool,
}

/// One variable's state.
#[derive(Clone, Debug)]
struct Moments {
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    /// With AMSGrad only.
    max_exp_avg_sq: Option<Tensor>,
}

const EXP_AVG: &str = "exp_avg";
const EXP_AVG_SQ: &str = "exp_avg_sq";
const MAX_EXP_AVG_SQ: &str = "max_exp_avg_sq";
const STEP: &str = "step";

/// The dtype a variable's state is kept and computed in.
fn state_dtype(var: &Var) -> DType {
    match var.dtype() {
        DType::F16 | DType::BF16 => DType::F32,
        other => other,
    }
}

/// `t / x` as a true division, as torch divides by a Python scalar on the CPU (candle's
/// `t / x` multiplies by `1 / x`).
fn div_scalar(t: &Tensor, x: f64) -> candle_core::Result<Tensor> {
    let x = Tensor::new(x, t.device())?.to_dtype(t.dtype())?;
    t.broadcast_div(&x)
}

/// A `lerp` weight as torch computes with it for tensors of `dtype`: rounded to the dtype
/// (through f32 for the half types).
fn lerp_weight(weight: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F64 => weight,
        _ => weight as f32 as f64,
    }
}

/// torch's `start.lerp(end, weight)` with a scalar weight, in its two branches.
fn lerp(start: &Tensor, end: &Tensor, weight: f64) -> candle_core::Result<Tensor> {
    // torch computes in the tensor's dtype: round the weight to it first.
    let weight = lerp_weight(weight, start.dtype());
    let diff = (end - start)?;
    if weight.abs() < 0.5 {
        start + diff.affine(weight, 0.0)?
    } else {
        end - diff.affine(1.0 - weight, 0.0)?
    }
}

impl AdamW {
    /// The hyper-parameters in use.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// The variables this optimizer updates.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// Says once, through the log facade, where the shared step count departs from torch's
    /// per-parameter counts.
    fn note_shared_step(&mut self, has_grad: &[bool]) {
        if self.warned_shared_step || !has_grad.iter().any(|&g| g) {
            return;
        }
        let skipped = (0..self.vars.len()).find(|&i| !has_grad[i] && self.moments[i].is_some());
        let late = (0..self.vars.len()).find(|&i| has_grad[i] && self.moments[i].is_none());
        let detail = match (skipped, late) {
            (Some(i), _) => format!("variable {i} got no gradient while others did"),
            (None, Some(i)) if self.step > 0 => {
                format!(
                    "variable {i} got its first gradient at step {}",
                    self.step + 1
                )
            }
            _ => return,
        };
        self.warned_shared_step = true;
        log::warn!(
            "AdamW: {detail}; its bias correction uses the step count shared by all variables, \
             where torch.optim.AdamW counts steps per parameter, so its updates differ from \
             torch's (said once per optimizer)"
        );
    }

    fn update(
        &mut self,
        i: usize,
        grad: &Tensor,
        step_size: f64,
        bias_correction2_sqrt: f64,
        kernel: bool,
    ) -> candle_core::Result<()> {
        let c = self.config;
        let var = &self.vars[i];
        let dtype = state_dtype(var);
        if var.elem_count() == 0 {
            // Nothing to write; its state, as torch's, is as empty as it is.
            if self.moments[i].is_none() {
                self.moments[i] = Some(Moments {
                    exp_avg: empty_state(var, dtype)?,
                    exp_avg_sq: empty_state(var, dtype)?,
                    max_exp_avg_sq: c.amsgrad.then(|| empty_state(var, dtype)).transpose()?,
                });
                self.owned[i] = true;
            }
            return Ok(());
        }
        if kernel && self.update_in_place(i, grad, step_size, bias_correction2_sqrt)? {
            return Ok(());
        }
        self.update_with_ops(i, grad, step_size, bias_correction2_sqrt)
    }

    /// The step of variable `i` by the CPU kernel (or, with the `cuda` feature, the CUDA kernel
    /// for f32), in place; `false` where it does not apply.
    fn update_in_place(
        &mut self,
        i: usize,
        grad: &Tensor,
        step_size: f64,
        bias_correction2_sqrt: f64,
    ) -> candle_core::Result<bool> {
        let (c, var) = (self.config, &self.vars[i]);
        if state_dtype(var) != var.dtype() {
            return Ok(false);
        }
        // The kernel writes the moments in place: ours alone, or copies.
        let moments = match &self.moments[i] {
            None => Moments {
                exp_avg: var.zeros_like()?,
                exp_avg_sq: var.zeros_like()?,
                max_exp_avg_sq: c.amsgrad.then(|| var.zeros_like()).transpose()?,
            },
            Some(m) if self.owned[i] => m.clone(),
            Some(m) => Moments {
                exp_avg: m.exp_avg.copy()?,
                exp_avg_sq: m.exp_avg_sq.copy()?,
                max_exp_avg_sq: m.max_exp_avg_sq.as_ref().map(Tensor::copy).transpose()?,
            },
        };
        let scalars = Scalars {
            decay: (c.weight_decay != 0.0).then_some(1.0 - c.lr * c.weight_decay),
            maximize: c.maximize,
            lerp_weight: lerp_weight(1.0 - c.betas.0, var.dtype()),
            beta2: c.betas.1,
            step_size,
            bias_correction2_sqrt,
            eps: c.eps,
            amsgrad: c.amsgrad,
        };
        let state = State {
            exp_avg: &moments.exp_avg,
            exp_avg_sq: &moments.exp_avg_sq,
            max_exp_avg_sq: moments.max_exp_avg_sq.as_ref(),
        };
        let stepped = match var.device() {
            candle_core::Device::Cpu => adamw_kernel::step(var, grad, state, &scalars)?,
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(_) => super::cuda::adamw(var, grad, &state, &scalars)?,
            _ => false,
        };
        if !stepped {
            return Ok(false);
        }
        self.moments[i] = Some(moments);
        self.owned[i] = true;
        Ok(true)
    }

    /// The step of variable `i` with tensor ops, on any device: torch's arithmetic, as the
    /// kernel's.
    fn update_with_ops(
        &mut self,
        i: usize,
        grad: &Tensor,
        step_size: f64,
        bias_correction2_sqrt: f64,
    ) -> candle_core::Result<()> {
        let c = self.config;
        let (beta1, beta2) = c.betas;
        let var = &self.vars[i];
        let dtype = state_dtype(var);
        let mut p = var.as_tensor().to_dtype(dtype)?;
        let mut g = grad.to_dtype(dtype)?;
        if c.maximize {
            g = g.neg()?;
        }
        if c.weight_decay != 0.0 {
            p = p.affine(1.0 - c.lr * c.weight_decay, 0.0)?;
        }
        let Moments {
            exp_avg,
            exp_avg_sq,
            max_exp_avg_sq,
        } = match self.moments[i].take() {
            Some(m) => m,
            None => {
                let zeros = g.zeros_like()?;
                Moments {
                    exp_avg: zeros.clone(),
                    exp_avg_sq: zeros.clone(),
                    max_exp_avg_sq: c.amsgrad.then_some(zeros),
                }
            }
        };
        let exp_avg = lerp(&exp_avg, &g, 1.0 - beta1)?;
        let exp_avg_sq = (exp_avg_sq.affine(beta2, 0.0)? + (g.affine(1.0 - beta2, 0.0)? * &g)?)?;
        let max_exp_avg_sq = match max_exp_avg_sq {
            Some(max) => Some(max.maximum(&exp_avg_sq)?),
            None => None,
        };
        let second = max_exp_avg_sq.as_ref().unwrap_or(&exp_avg_sq);
        let denom = (div_scalar(&second.sqrt()?, bias_correction2_sqrt)? + c.eps)?;
        let p = (p - (exp_avg.affine(step_size, 0.0)? / denom)?)?;
        var.set(&p.to_dtype(var.dtype())?)?;
        self.moments[i] = Some(Moments {
            exp_avg,
            exp_avg_sq,
            max_exp_avg_sq,
        });
        self.owned[i] = true;
        Ok(())
    }
}

impl Drop for AdamW {
    fn drop(&mut self) {
        managed::release(&self.vars);
    }
}

impl Optimizer for AdamW {
    type Config = AdamWConfig;

    fn new(vars: Vec<Var>, config: AdamWConfig) -> candle_core::Result<Self> {
        config.validate().map_err(Error::into_candle)?;
        let vars: Vec<Var> = vars.into_iter().filter(|v| v.dtype().is_float()).collect();
        managed::check_vars(&vars).map_err(Error::into_candle)?;
        if vars.is_empty() {
            log::warn!("AdamW made over no variables: its steps change nothing");
        }
        managed::hold(&vars);
        Ok(Self {
            moments: vec![None; vars.len()],
            handed_out: AtomicBool::new(false),
            owned: vec![true; vars.len()],
            vars,
            step: 0,
            config,
            warned_shared_step: false,
        })
    }

    /// `step` over [`crate::nn::backward`]'s gradients of `loss` (candle's `loss.backward()`,
    /// with this crate's layers' variable gradients stored as made).
    fn backward_step(&mut self, loss: &Tensor) -> candle_core::Result<()> {
        let grads = crate::nn::backward(loss)?;
        self.step(&grads)
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        managed::check_vars(&self.vars).map_err(Error::into_candle)?;
        self.step_vars(grads)?;
        managed::after_step(&self.vars).map_err(Error::into_candle)
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr
    }
}

impl AdamW {
    /// One step of every variable that has a gradient in `grads`.
    fn step_vars(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.step_vars_with(grads, true)
    }

    /// [`step_vars`](Self::step_vars), through the CPU kernel where it applies (`kernel`) or
    /// with tensor ops only.
    fn step_vars_with(&mut self, grads: &GradStore, kernel: bool) -> candle_core::Result<()> {
        if std::mem::take(self.handed_out.get_mut()) {
            self.owned.fill(false);
        }
        let has_grad: Vec<bool> = self.vars.iter().map(|v| grads.get(v).is_some()).collect();
        if !has_grad.contains(&true) {
            return Ok(());
        }
        check_grads("AdamW", &self.vars, grads).map_err(Error::into_candle)?;
        self.note_shared_step(&has_grad);
        self.step += 1;
        // As torch: Python floats (f64) for the scalars, `**` for the powers.
        let (beta1, beta2) = self.config.betas;
        let t = self.step as f64;
        let step_size = self.config.lr / (1.0 - beta1.powf(t));
        let bias_correction2_sqrt = (1.0 - beta2.powf(t)).powf(0.5);
        for i in 0..self.vars.len() {
            if let Some(grad) = grads.get(&self.vars[i]) {
                self.update(i, grad, step_size, bias_correction2_sqrt, kernel)?;
            }
        }
        Ok(())
    }
}

impl ElementwiseOptimizer for AdamW {
    fn vars(&self) -> &[Var] {
        &self.vars
    }

    fn state(&self) -> OptimizerState {
        self.handed_out.store(true, Ordering::Relaxed);
        let per_var = self
            .moments
            .iter()
            .map(|m| {
                let Some(m) = m else {
                    return Default::default();
                };
                let mut map = std::collections::BTreeMap::new();
                map.insert(EXP_AVG.to_string(), m.exp_avg.clone());
                map.insert(EXP_AVG_SQ.to_string(), m.exp_avg_sq.clone());
                if let Some(max) = &m.max_exp_avg_sq {
                    map.insert(MAX_EXP_AVG_SQ.to_string(), max.clone());
                }
                map
            })
            .collect();
        OptimizerState {
            scalars: [(STEP.to_string(), self.step as f64)].into(),
            per_var,
        }
    }

    fn load_state(&mut self, state: &OptimizerState) -> crate::Result<()> {
        let names: &[&str] = if self.config.amsgrad {
            &[EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ]
        } else {
            &[EXP_AVG, EXP_AVG_SQ]
        };
        let loaded = checked_state("AdamW", &self.vars, state, names, &[STEP], state_dtype)?;
        let mismatch = |detail: String| Error::OptimizerStateMismatch {
            optimizer: "AdamW",
            detail,
        };
        let step = match state.scalars.get(STEP) {
            Some(&s) if s >= 0.0 && s.fract() == 0.0 && s <= u64::MAX as f64 => s as u64,
            Some(s) => return Err(mismatch(format!("`step` is {s}, not a count"))),
            None if loaded.iter().all(Option::is_none) => 0,
            None => {
                return Err(mismatch(
                    "the state has moments but no scalar `step`".to_string(),
                ))
            }
        };
        if step == 0 && loaded.iter().any(Option::is_some) {
            return Err(mismatch(
                "the state has moments but `step` is 0".to_string(),
            ));
        }
        self.moments = loaded
            .into_iter()
            .map(|t| {
                // In the order of `names`.
                let mut t = t?.into_iter();
                Some(Moments {
                    exp_avg: t.next()?,
                    exp_avg_sq: t.next()?,
                    max_exp_avg_sq: t.next(),
                })
            })
            .collect();
        self.step = step;
        // `checked_state` may return the caller's own tensors.
        self.owned.fill(false);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    const START: [f64; 4] = [1.0, -0.3, 0.0, 2.0];

    /// The loss `sum(p^4 / 4 - p / 2)`: gradient `p^3 - 1/2`.
    fn loss(p: &Var) -> candle_core::Result<Tensor> {
        ((p.as_tensor().powf(4.0)? * 0.25)? - (p.as_tensor() * 0.5)?)?.sum_all()
    }

    /// torch.optim.AdamW's update as its documentation writes it, for one f64 element.
    fn reference(c: AdamWConfig, mut p: f64, steps: i32) -> f64 {
        let (b1, b2) = c.betas;
        let (mut m, mut v, mut v_max) = (0.0, 0.0, 0.0f64);
        for t in 1..=steps {
            let mut g = p.powi(3) - 0.5;
            if c.maximize {
                g = -g;
            }
            p *= 1.0 - c.lr * c.weight_decay;
            m = b1 * m + (1.0 - b1) * g;
            v = b2 * v + (1.0 - b2) * g * g;
            v_max = v_max.max(v);
            let m_hat = m / (1.0 - b1.powi(t));
            let v_hat = if c.amsgrad { v_max } else { v } / (1.0 - b2.powi(t));
            p -= c.lr * m_hat / (v_hat.sqrt() + c.eps);
        }
        p
    }

    fn run(c: AdamWConfig, dtype: DType, steps: usize) -> candle_core::Result<(Var, AdamW)> {
        let p = Var::from_tensor(&Tensor::new(&START, &Device::Cpu)?.to_dtype(dtype)?)?;
        let mut opt = AdamW::new(vec![p.clone()], c)?;
        for _ in 0..steps {
            opt.backward_step(&loss(&p)?)?;
        }
        Ok((p, opt))
    }

    fn configs() -> Vec<AdamWConfig> {
        let d = AdamWConfig {
            lr: 0.05,
            ..Default::default()
        };
        vec![
            d,
            AdamWConfig {
                weight_decay: 0.0,
                ..d
            },
            AdamWConfig {
                weight_decay: 0.1,
                amsgrad: true,
                ..d
            },
            AdamWConfig {
                maximize: true,
                ..d
            },
            // beta1 < 0.5 takes lerp's other branch; a large eps matters.
            AdamWConfig {
                betas: (0.3, 0.9),
                eps: 0.1,
                ..d
            },
        ]
    }

    /// The CPU kernel against the tensor ops, bit for bit: every configuration, f32 and f64,
    /// a parameter large enough to be split over threads and one that is not, values of both
    /// signs and zeros, over steps whose gradients change.
    #[test]
    fn the_cpu_kernel_gives_the_bits_of_the_tensor_ops() -> candle_core::Result<()> {
        let n = 3 * super::super::sgd_kernel::PARALLEL_MIN + 7;
        let values: Vec<f64> = (0..n)
            .map(|i| match i % 5 {
                0 => 0.0,
                k => ((i * 7919) % 1000) as f64 / 250.0 - 2.0 + k as f64 * 1e-3,
            })
            .collect();
        for dtype in [DType::F32, DType::F64] {
            for c in configs() {
                let make = |len: usize| -> candle_core::Result<Vec<Var>> {
                    [len, 5]
                        .iter()
                        .map(|&k| {
                            Var::from_tensor(
                                &Tensor::new(&values[..k], &Device::Cpu)?.to_dtype(dtype)?,
                            )
                        })
                        .collect()
                };
                let (fast, slow) = (make(n)?, make(n)?);
                let mut kernel = AdamW::new(fast.clone(), c)?;
                let mut ops = AdamW::new(slow.clone(), c)?;
                for _ in 0..4 {
                    let total = |vs: &[Var]| -> candle_core::Result<Tensor> {
                        let mut sum = Tensor::zeros((), dtype, &Device::Cpu)?;
                        for v in vs {
                            sum = (sum + loss(v)?)?;
                        }
                        Ok(sum)
                    };
                    let (gk, go) = (total(&fast)?.backward()?, total(&slow)?.backward()?);
                    kernel.step_vars_with(&gk, true)?;
                    ops.step_vars_with(&go, false)?;
                    for (a, b) in fast.iter().zip(&slow) {
                        let (a, b) = (
                            a.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?,
                            b.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?,
                        );
                        let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
                        assert!(same, "{dtype:?} {c:?}");
                    }
                }
                let (sk, so) = (kernel.state(), ops.state());
                for (k, o) in sk.per_var.iter().zip(&so.per_var) {
                    for (name, t) in k {
                        let (a, b) = (
                            t.to_vec1::<f64>()
                                .or_else(|_| t.to_dtype(DType::F64)?.to_vec1::<f64>())?,
                            o[name].to_dtype(DType::F64)?.to_vec1::<f64>()?,
                        );
                        assert_eq!(a, b, "{dtype:?} {c:?} {name}");
                    }
                }
            }
        }
        Ok(())
    }

    /// The kernel writes moments in place, but never ones handed out or loaded: a snapshot stays
    /// as taken, a loaded state stays the caller's.
    #[test]
    fn handed_out_and_loaded_moments_are_never_written() -> candle_core::Result<()> {
        let c = AdamWConfig {
            lr: 0.05,
            amsgrad: true,
            ..Default::default()
        };
        let (p, mut opt) = run(c, DType::F32, 1)?;
        let snapshot = opt.state();
        let taken = |s: &OptimizerState| -> candle_core::Result<Vec<Vec<f32>>> {
            [EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ]
                .iter()
                .map(|n| s.per_var[0][*n].to_vec1::<f32>())
                .collect()
        };
        let before = taken(&snapshot)?;
        let p_then = p.as_tensor().copy()?;
        opt.backward_step(&loss(&p)?)?;
        opt.backward_step(&loss(&p)?)?;
        assert_eq!(taken(&snapshot)?, before);
        let q = Var::from_tensor(&p_then)?;
        let mut fresh = AdamW::new(vec![q.clone()], c)?;
        fresh.load_state(&snapshot).map_err(Error::into_candle)?;
        fresh.backward_step(&loss(&q)?)?;
        fresh.backward_step(&loss(&q)?)?;
        assert_eq!(taken(&snapshot)?, before);
        // And the loaded run went on as the original did from the snapshot.
        assert_eq!(q.to_vec1::<f32>()?, p.to_vec1::<f32>()?);
        Ok(())
    }

    /// A gradient that shares the variable's storage is stepped by the tensor ops.
    #[test]
    fn a_gradient_in_the_variables_storage_takes_the_tensor_ops() -> candle_core::Result<()> {
        let c = AdamWConfig {
            lr: 0.1,
            ..Default::default()
        };
        let p = Var::new(&[1f32, -2.0], &Device::Cpu)?;
        let mut opt = AdamW::new(vec![p.clone()], c)?;
        assert!(!opt.update_in_place(0, p.as_tensor(), 0.1, 1.0)?);
        let q = Var::new(&[1f32, -2.0], &Device::Cpu)?;
        let mut ops = AdamW::new(vec![q.clone()], c)?;
        opt.update(0, p.as_tensor(), 0.1, 1.0, true)?;
        ops.update(0, &q.as_tensor().copy()?, 0.1, 1.0, false)?;
        assert_eq!(p.to_vec1::<f32>()?, q.to_vec1::<f32>()?);
        Ok(())
    }

    #[test]
    fn f64_steps_follow_torchs_formulas() -> candle_core::Result<()> {
        for c in configs() {
            let (p, _) = run(c, DType::F64, 15)?;
            for (got, start) in p.to_vec1::<f64>()?.iter().zip(START) {
                let want = reference(c, start, 15);
                assert!((got - want).abs() < 1e-12, "{c:?}: got {got}, want {want}");
            }
        }
        Ok(())
    }

    #[test]
    fn half_precision_variables_keep_f32_state_and_track_the_f32_run() -> candle_core::Result<()> {
        let c = configs()[2];
        let (full, _) = run(c, DType::F32, 10)?;
        let (half, opt) = run(c, DType::BF16, 10)?;
        assert_eq!(half.dtype(), DType::BF16);
        let state = opt.state();
        for t in state.per_var[0].values() {
            assert_eq!(t.dtype(), DType::F32);
        }
        let full = full.to_vec1::<f32>()?;
        let half = half.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        for (f, h) in full.iter().zip(&half) {
            // bf16 keeps 8 bits of mantissa; its gradients are computed in bf16 too.
            assert!(
                (f - h).abs() < 0.02 * f.abs().max(1.0),
                "{full:?} vs {half:?}"
            );
        }
        Ok(())
    }

    #[test]
    fn a_variable_without_gradient_is_left_alone_with_its_state() -> candle_core::Result<()> {
        let used = Var::new(&[1f32], &Device::Cpu)?;
        let unused = Var::new(&[5f32], &Device::Cpu)?;
        let mut opt = AdamW::new(vec![used.clone(), unused.clone()], Default::default())?;
        opt.backward_step(&used.as_tensor().sum_all()?)?;
        assert_ne!(used.to_vec1::<f32>()?, [1.0]);
        assert_eq!(unused.to_vec1::<f32>()?, [5.0]);
        let state = opt.state();
        assert_eq!(state.per_var[0].len(), 2);
        assert!(state.per_var[1].is_empty());
        Ok(())
    }

    #[test]
    fn stepping_slices_equals_stepping_the_whole() -> candle_core::Result<()> {
        let c = configs()[2];
        let (whole, _) = run(c, DType::F32, 7)?;
        let start = Tensor::new(&START, &Device::Cpu)?.to_dtype(DType::F32)?;
        let parts = [
            Var::from_tensor(&start.narrow(0, 0, 3)?)?,
            Var::from_tensor(&start.narrow(0, 3, 1)?)?,
        ];
        let mut opts = [
            AdamW::new(vec![parts[0].clone()], c)?,
            AdamW::new(vec![parts[1].clone()], c)?,
        ];
        for _ in 0..7 {
            for (p, opt) in parts.iter().zip(&mut opts) {
                opt.backward_step(&loss(p)?)?;
            }
        }
        let sliced = Tensor::cat(&[parts[0].as_tensor(), parts[1].as_tensor()], 0)?;
        assert_eq!(sliced.to_vec1::<f32>()?, whole.to_vec1::<f32>()?);
        Ok(())
    }

    #[test]
    fn a_loaded_state_continues_bit_for_bit() -> candle_core::Result<()> {
        for c in configs() {
            let (p, mut opt) = run(c, DType::F32, 4)?;
            let resumed = Var::from_tensor(&p.as_tensor().copy()?)?;
            let mut fresh = AdamW::new(vec![resumed.clone()], c)?;
            fresh.load_state(&opt.state()).map_err(Error::into_candle)?;
            for _ in 0..5 {
                opt.backward_step(&loss(&p)?)?;
                fresh.backward_step(&loss(&resumed)?)?;
            }
            assert_eq!(p.to_vec1::<f32>()?, resumed.to_vec1::<f32>()?, "{c:?}");
            let (a, b) = (opt.state(), fresh.state());
            assert_eq!(a.scalars, b.scalars);
            for (name, t) in &a.per_var[0] {
                let u = &b.per_var[0][name];
                assert_eq!(t.to_vec1::<f32>()?, u.to_vec1::<f32>()?, "{name}");
            }
        }
        Ok(())
    }

    #[test]
    fn a_state_that_does_not_fit_is_refused_naming_what() -> candle_core::Result<()> {
        let (_, opt) = run(configs()[2], DType::F32, 1)?; // amsgrad: three states
        let good = opt.state();
        let fresh = || {
            AdamW::new(
                vec![Var::new(&[0f32; 4], &Device::Cpu).unwrap()],
                configs()[2],
            )
        };

        let mut bad = good.clone();
        bad.per_var[0].insert(
            "exp_avg_sq".into(),
            Tensor::zeros(5, DType::F32, &Device::Cpu)?,
        );
        match fresh()?.load_state(&bad) {
            Err(Error::OptimizerStateShape {
                variable: 0,
                state,
                expected,
                found,
                ..
            }) => {
                assert_eq!((state, expected, found), ("exp_avg_sq", vec![4], vec![5]))
            }
            other => panic!("{other:?}"),
        }

        let mut bad = good.clone();
        bad.per_var[0].remove("max_exp_avg_sq");
        let err = fresh()?.load_state(&bad).unwrap_err().to_string();
        assert!(
            err.contains("variable 0") && err.contains("max_exp_avg_sq"),
            "{err}"
        );

        let err = AdamW::new(vec![Var::new(&[0f32; 4], &Device::Cpu)?], configs()[0])?
            .load_state(&good)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`max_exp_avg_sq`"), "{err}");

        let mut bad = good.clone();
        bad.per_var.push(Default::default());
        let err = fresh()?.load_state(&bad).unwrap_err().to_string();
        assert!(err.contains("2 variables, the optimizer 1"), "{err}");

        let mut bad = good.clone();
        bad.scalars.clear();
        let err = fresh()?.load_state(&bad).unwrap_err().to_string();
        assert!(err.contains("no scalar `step`"), "{err}");

        let mut bad = good;
        bad.scalars.insert("step".into(), 1.5);
        let err = fresh()?.load_state(&bad).unwrap_err().to_string();
        assert!(err.contains("1.5"), "{err}");
        Ok(())
    }

    #[test]
    fn invalid_hyper_parameters_are_refused_with_the_reason() {
        let d = AdamWConfig::default();
        let bad = [
            (AdamWConfig { lr: -1.0, ..d }, "learning rate"),
            (AdamWConfig { lr: f64::NAN, ..d }, "learning rate"),
            (AdamWConfig { eps: -1e-8, ..d }, "eps"),
            (
                AdamWConfig {
                    betas: (1.0, 0.999),
                    ..d
                },
                "betas.0",
            ),
            (
                AdamWConfig {
                    betas: (0.9, -0.1),
                    ..d
                },
                "betas.1",
            ),
            (
                AdamWConfig {
                    weight_decay: -0.1,
                    ..d
                },
                "weight_decay",
            ),
        ];
        for (config, needle) in bad {
            let err = AdamW::new(vec![], config).unwrap_err();
            assert!(err.to_string().contains(needle), "{config:?}: {err}");
        }
    }
}
