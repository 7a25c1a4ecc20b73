//! `torch.optim.SGD`.

use super::{
    check_grads, checked_state, empty_state, managed, sgd_kernel, ElementwiseOptimizer,
    OptimizerState,
};
use crate::error::Error;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::Optimizer;
use std::sync::atomic::{AtomicBool, Ordering};

/// Hyper-parameters of [`Sgd`], with `torch.optim.SGD`'s names and defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    /// Learning rate (torch's default: 0.001).
    pub lr: f64,
    /// Momentum factor (default 0: plain SGD).
    pub momentum: f64,
    /// Dampening of the gradient's share of the momentum (default 0).
    pub dampening: f64,
    /// L2 penalty added to the gradient (default 0).
    pub weight_decay: f64,
    /// Nesterov momentum; needs `momentum > 0` and `dampening == 0` (default false).
    pub nesterov: bool,
    /// Ascend instead of descend (default false).
    pub maximize: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            maximize: false,
        }
    }
}

impl SgdConfig {
    fn validate(&self) -> crate::Result<()> {
        let invalid = |what, detail: String| Err(Error::InvalidArgument { what, detail });
        let negative = |x: f64| x.is_nan() || x < 0.0;
        if negative(self.lr) {
            return invalid("SGD learning rate", format!("{} (must be >= 0)", self.lr));
        }
        if negative(self.momentum) {
            return invalid("SGD momentum", format!("{} (must be >= 0)", self.momentum));
        }
        if negative(self.weight_decay) {
            let detail = format!("{} (must be >= 0)", self.weight_decay);
            return invalid("SGD weight_decay", detail);
        }
        if !self.dampening.is_finite() {
            return invalid(
                "SGD dampening",
                format!("{} (must be finite)", self.dampening),
            );
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            let detail = format!(
                "momentum {} and dampening {}: Nesterov momentum requires momentum > 0 and \
                 dampening = 0",
                self.momentum, self.dampening
            );
            return invalid("SGD nesterov", detail);
        }
        Ok(())
    }
}

/// `torch.optim.SGD` for candle: stochastic gradient descent with PyTorch's semantics: momentum, dampening, weight decay,
/// Nesterov momentum and maximisation.
///
/// candle-nn's `SGD` has no momentum. [`Sgd`] follows `torch.optim.SGD` step for step; for each
/// parameter `p` with gradient `g`:
///
/// ```text
/// g = g + weight_decay * p
/// buf = g                                    (first step)
/// buf = momentum * buf + (1 - dampening) * g (later steps)
/// g = g + momentum * buf  if nesterov, else  g = buf
/// p = p - lr * g
/// ```
///
/// ```rust
/// use candle_core::{Device, Var};
/// use candle_nn::Optimizer;
/// use candle_parallel::optim::{Sgd, SgdConfig};
/// # fn main() -> candle_core::Result<()> {
/// let p = Var::new(&[1f64], &Device::Cpu)?;
/// let config = SgdConfig { lr: 0.1, momentum: 0.9, ..Default::default() };
/// let mut opt = Sgd::new(vec![p.clone()], config)?;
/// for _ in 0..2 {
///     let loss = (p.as_tensor().sqr()? * 0.5)?.sum_all()?; // gradient = p
///     opt.backward_step(&loss)?;
/// }
/// // p: 1 -> 0.9 (buf 1) -> 0.72 (buf 0.9 * 1 + 0.9 = 1.8)
/// assert!((p.to_vec1::<f64>()?[0] - 0.72).abs() < 1e-12);
/// # Ok(()) }
/// ```
///
/// Its state is `momentum_buffer` per variable (once it has one), in the variable's dtype.
///
/// On the CPU a step is one pass over each parameter, its gradient and its buffer, written in
/// place (f32, f64, f16 and bf16; the same bits as the tensor ops it replaces). Buffers that
/// [`state`](ElementwiseOptimizer::state) or [`momentum_buffers`](Sgd::momentum_buffers) handed
/// out, or that [`load_state`](ElementwiseOptimizer::load_state) took in, are never written: the
/// next step copies them first.
#[derive(Debug)]
pub struct Sgd {
    vars: Vec<Var>,
    momentum_buffers: Vec<Option<Tensor>>,
    /// Whether the buffers were handed out since the last step (by `&self` methods).
    handed_out: AtomicBool,
    /// Per buffer, whether it is ours alone, to write in place; else the next step copies it.
    owned: Vec<bool>,
    config: SgdConfig,
}

impl Sgd {
    /// The hyper-parameters in use.
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }

    /// The variables this optimizer updates.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The momentum buffer of each variable, `None` until its first step with momentum. Later
    /// steps leave these tensors as they are.
    pub fn momentum_buffers(&self) -> &[Option<Tensor>] {
        self.handed_out.store(true, Ordering::Relaxed);
        &self.momentum_buffers
    }

    fn update(&mut self, i: usize, grad: &Tensor) -> candle_core::Result<()> {
        let var = &self.vars[i];
        if var.elem_count() == 0 {
            // Nothing to write; its buffer, as torch's, is as empty as it is.
            if self.config.momentum != 0.0 && self.momentum_buffers[i].is_none() {
                self.momentum_buffers[i] = Some(empty_state(var, var.dtype())?);
                self.owned[i] = true;
            }
            return Ok(());
        }
        if self.update_in_place(i, grad)? {
            return Ok(());
        }
        self.update_with_ops(i, grad)
    }

    /// The step of variable `i` by the CPU kernel (or, with the `cuda` feature, the CUDA kernel
    /// for f32), in place; `false` where it does not apply.
    fn update_in_place(&mut self, i: usize, grad: &Tensor) -> candle_core::Result<bool> {
        let (c, var) = (self.config, &self.vars[i]);
        // The kernel writes the buffer in place: ours alone, or a copy.
        let buf = match &self.momentum_buffers[i] {
            _ if c.momentum == 0.0 => None,
            None => Some((var.zeros_like()?, true)),
            Some(b) if self.owned[i] => Some((b.clone(), false)),
            Some(b) => Some((b.copy()?, false)),
        };
        let buf_ref = buf.as_ref().map(|(b, first)| (b, *first));
        let stepped = match var.device() {
            candle_core::Device::Cpu => sgd_kernel::step(var, grad, buf_ref, &c)?,
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(_) => super::cuda::sgd(var, grad, buf_ref, &c)?,
            _ => false,
        };
        if !stepped {
            return Ok(false);
        }
        if let Some((b, _)) = buf {
            self.momentum_buffers[i] = Some(b);
            self.owned[i] = true;
        }
        Ok(true)
    }

    /// The step of variable `i` with tensor ops, on any device: torch's CPU arithmetic, as the
    /// kernel's (see `sgd_kernel`): each torch op in f32 (f64 for f64), rounded to the
    /// variable's dtype once.
    fn update_with_ops(&mut self, i: usize, grad: &Tensor) -> candle_core::Result<()> {
        let c = self.config;
        let var = &self.vars[i];
        let dtype = var.dtype();
        let wide = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let up = |t: &Tensor| t.to_dtype(wide);
        let round = |t: Tensor| t.to_dtype(dtype)?.to_dtype(wide);
        let alpha = |x: f64| sgd_kernel::alpha(x, dtype);
        let mut d = up(grad)?;
        if c.maximize {
            d = d.neg()?;
        }
        if c.weight_decay != 0.0 {
            d = round((d + up(var.as_tensor())?.affine(alpha(c.weight_decay), 0.0)?)?)?;
        }
        if c.momentum != 0.0 {
            let buf = match self.momentum_buffers[i].take() {
                // A copy: `d` may be the gradient itself.
                None => d.copy()?,
                Some(buf) => {
                    let kept = round(up(&buf)?.affine(c.momentum, 0.0)?)?;
                    round((kept + d.affine(alpha(1.0 - c.dampening), 0.0)?)?)?
                }
            };
            d = if c.nesterov {
                round((&d + buf.affine(alpha(c.momentum), 0.0)?)?)?
            } else {
                buf.clone()
            };
            self.momentum_buffers[i] = Some(buf.to_dtype(dtype)?.detach());
            self.owned[i] = true;
        }
        let stepped = (up(var.as_tensor())? + d.affine(alpha(-c.lr), 0.0)?)?;
        var.set(&stepped.to_dtype(dtype)?)
    }
}

impl Drop for Sgd {
    fn drop(&mut self) {
        managed::release(&self.vars);
    }
}

impl Optimizer for Sgd {
    type Config = SgdConfig;

    fn new(vars: Vec<Var>, config: SgdConfig) -> candle_core::Result<Self> {
        config.validate().map_err(Error::into_candle)?;
        let vars: Vec<Var> = vars.into_iter().filter(|v| v.dtype().is_float()).collect();
        managed::check_vars(&vars).map_err(Error::into_candle)?;
        if vars.is_empty() {
            log::warn!("Sgd made over no variables: its steps change nothing");
        }
        managed::hold(&vars);
        Ok(Self {
            momentum_buffers: vec![None; vars.len()],
            handed_out: AtomicBool::new(false),
            owned: vec![true; vars.len()],
            vars,
            config,
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
        check_grads("Sgd", &self.vars, grads).map_err(Error::into_candle)?;
        if std::mem::take(self.handed_out.get_mut()) {
            self.owned.fill(false);
        }
        for i in 0..self.vars.len() {
            if let Some(grad) = grads.get(&self.vars[i]) {
                self.update(i, grad)?;
            }
        }
        managed::after_step(&self.vars).map_err(Error::into_candle)
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr
    }
}

impl ElementwiseOptimizer for Sgd {
    fn vars(&self) -> &[Var] {
        &self.vars
    }

    fn state(&self) -> OptimizerState {
        self.handed_out.store(true, Ordering::Relaxed);
        let per_var = self
            .momentum_buffers
            .iter()
            .map(|buf| {
                buf.iter()
                    .map(|b| (MOMENTUM_BUFFER.to_string(), b.clone()))
                    .collect()
            })
            .collect();
        OptimizerState {
            scalars: Default::default(),
            per_var,
        }
    }

    fn load_state(&mut self, state: &OptimizerState) -> crate::Result<()> {
        let names: &[&str] = if self.config.momentum != 0.0 {
            &[MOMENTUM_BUFFER]
        } else {
            &[]
        };
        let loaded = checked_state("Sgd", &self.vars, state, names, &[], |v| v.dtype())?;
        self.momentum_buffers = loaded
            .into_iter()
            .map(|t| t.and_then(|t| t.into_iter().next()))
            .collect();
        // `checked_state` may return the caller's own tensors.
        self.owned.fill(false);
        Ok(())
    }
}

/// The name of [`Sgd`]'s per-variable state.
const MOMENTUM_BUFFER: &str = "momentum_buffer";

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Runs `steps` steps on the loss `0.5 * p^2` (gradient `p`) from `p = 1` and returns `p`
    /// after each step.
    fn run(config: SgdConfig, steps: usize) -> Vec<f64> {
        let p = Var::new(&[1f64], &Device::Cpu).unwrap();
        let mut opt = Sgd::new(vec![p.clone()], config).unwrap();
        (0..steps)
            .map(|_| {
                let loss = (p.as_tensor().sqr().unwrap() * 0.5)
                    .unwrap()
                    .sum_all()
                    .unwrap();
                opt.backward_step(&loss).unwrap();
                p.to_vec1::<f64>().unwrap()[0]
            })
            .collect()
    }

    /// A tensor of `n` seeded normal values, as f64 (then converted by the caller).
    fn normal(rng: &mut crate::rng::Rng, shape: (usize, usize)) -> candle_core::Result<Tensor> {
        let values: Vec<f64> = (0..shape.0 * shape.1).map(|_| rng.normal()).collect();
        Tensor::from_vec(values, shape, &Device::Cpu)
    }

    /// Every configuration the kernel branches on.
    fn kernel_configs() -> Vec<SgdConfig> {
        let base = SgdConfig {
            lr: 0.03,
            ..Default::default()
        };
        vec![
            base,
            SgdConfig {
                weight_decay: 0.01,
                maximize: true,
                ..base
            },
            SgdConfig {
                momentum: 0.9,
                ..base
            },
            SgdConfig {
                momentum: 0.8,
                dampening: 0.3,
                weight_decay: 0.02,
                ..base
            },
            SgdConfig {
                momentum: 0.9,
                nesterov: true,
                weight_decay: 0.05,
                maximize: true,
                ..base
            },
        ]
    }

    /// The CPU kernel against the tensor ops, bit for bit: every configuration, in f32, f64,
    /// f16 and bf16, over four steps, with a parameter large enough to be split over threads, a
    /// transposed (non-contiguous) gradient, and a small one.
    #[test]
    fn the_cpu_kernel_gives_the_bits_of_the_tensor_ops() -> candle_core::Result<()> {
        use candle_core::DType;
        let mut rng = crate::rng::Rng::new(0x56d);
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            for c in kernel_configs() {
                let shapes = [(300, 200), (3, 5)];
                let start: Vec<Tensor> = shapes
                    .iter()
                    .map(|&s| normal(&mut rng, s)?.to_dtype(dtype))
                    .collect::<candle_core::Result<_>>()?;
                let vars = |_| -> candle_core::Result<Vec<Var>> {
                    start.iter().map(|t| Var::from_tensor(&t.copy()?)).collect()
                };
                let (fast, slow) = (vars(0)?, vars(1)?);
                let mut kernel = Sgd::new(fast.clone(), c)?;
                let mut ops = Sgd::new(slow.clone(), c)?;
                for _ in 0..4 {
                    // The big gradient is the transpose of a (200, 300) tensor.
                    let grads = [
                        normal(&mut rng, (200, 300))?.to_dtype(dtype)?.t()?,
                        normal(&mut rng, (3, 5))?.to_dtype(dtype)?,
                    ];
                    for (i, g) in grads.iter().enumerate() {
                        assert!(kernel.update_in_place(i, g)?, "{dtype:?} {c:?}");
                        ops.update_with_ops(i, g)?;
                    }
                }
                for i in 0..shapes.len() {
                    let bits = |t: &Tensor| t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>();
                    assert_eq!(bits(&fast[i])?, bits(&slow[i])?, "{dtype:?} {c:?}");
                    let (kb, ob) = (&kernel.momentum_buffers[i], &ops.momentum_buffers[i]);
                    assert_eq!(kb.is_some(), ob.is_some());
                    if let (Some(kb), Some(ob)) = (kb, ob) {
                        assert_eq!(bits(kb)?, bits(ob)?, "{dtype:?} {c:?} buffer");
                    }
                }
            }
        }
        Ok(())
    }

    /// The kernel writes buffers in place, but never one that was handed out or loaded: a
    /// snapshot stays as taken, a loaded state stays the caller's, and the run goes on as the
    /// tensor ops would have it.
    #[test]
    fn handed_out_and_loaded_buffers_are_never_written() -> candle_core::Result<()> {
        let c = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..Default::default()
        };
        let p = Var::new(&[1f32, -2.0, 3.0], &Device::Cpu)?;
        let mut opt = Sgd::new(vec![p.clone()], c)?;
        let loss = |p: &Var| (p.as_tensor().sqr()? * 0.5)?.sum_all();
        opt.backward_step(&loss(&p)?)?;
        let snapshot = opt.state();
        let before = snapshot.per_var[0][MOMENTUM_BUFFER].to_vec1::<f32>()?;
        let held = opt.momentum_buffers()[0].clone().unwrap();
        opt.backward_step(&loss(&p)?)?;
        opt.backward_step(&loss(&p)?)?;
        assert_eq!(
            snapshot.per_var[0][MOMENTUM_BUFFER].to_vec1::<f32>()?,
            before
        );
        assert_eq!(held.to_vec1::<f32>()?, before);

        let q = Var::new(&[1f32, -2.0, 3.0], &Device::Cpu)?;
        let mut fresh = Sgd::new(vec![q.clone()], c)?;
        fresh.load_state(&snapshot).map_err(Error::into_candle)?;
        fresh.backward_step(&loss(&q)?)?;
        assert_eq!(
            snapshot.per_var[0][MOMENTUM_BUFFER].to_vec1::<f32>()?,
            before
        );
        // The loaded buffer holds the first gradient, q itself: 0.9 * 1 + 1.
        assert_eq!(
            fresh.momentum_buffers()[0]
                .as_ref()
                .unwrap()
                .to_vec1::<f32>()?[0],
            1.9
        );
        Ok(())
    }

    /// A gradient that shares the variable's storage is stepped by the tensor ops.
    #[test]
    fn a_gradient_in_the_variables_storage_takes_the_tensor_ops() -> candle_core::Result<()> {
        let p = Var::new(&[1f32, 2.0], &Device::Cpu)?;
        let c = SgdConfig {
            lr: 0.5,
            ..Default::default()
        };
        let mut opt = Sgd::new(vec![p.clone()], c)?;
        assert!(!opt.update_in_place(0, p.as_tensor())?);
        opt.update(0, p.as_tensor())?;
        assert_eq!(p.to_vec1::<f32>()?, [0.5, 1.0]);
        Ok(())
    }

    /// torch's CPU SGD on bf16 parameters, one element, written out: each op in f32, rounded to
    /// bf16 once; `mul_`'s factor in f32, every `alpha` rounded to bf16 (through f32).
    fn torch_bf16_step(
        p: &mut half::bf16,
        buf: &mut Option<half::bf16>,
        g: half::bf16,
        c: &SgdConfig,
    ) {
        use half::bf16;
        let round = |x: f32| bf16::from_f32(x).to_f32();
        let alpha = |x: f64| round(x as f32);
        let mut d = g.to_f32();
        d = round(d + alpha(c.weight_decay) * p.to_f32());
        let b = match buf {
            None => d,
            Some(b) => round(round(b.to_f32() * c.momentum as f32) + alpha(1.0 - c.dampening) * d),
        };
        *buf = Some(bf16::from_f32(b));
        *p = bf16::from_f32(p.to_f32() + alpha(-c.lr) * b);
    }

    /// bf16 parameters step as torch's CPU SGD does (the suspicion was that momentum, dampening,
    /// lr and weight decay were rounded to bf16 for the whole computation: momentum 0.99 would
    /// then act as 0.98828).
    #[test]
    fn bf16_steps_are_torchs_momentum_in_f32_and_one_rounding_per_op() -> candle_core::Result<()> {
        use half::bf16;
        let c = SgdConfig {
            lr: 0.01,
            momentum: 0.99,
            dampening: 0.1,
            weight_decay: 0.01,
            ..Default::default()
        };
        let mut rng = crate::rng::Rng::new(7);
        let n = 4096;
        let start: Vec<bf16> = (0..n).map(|_| bf16::from_f64(rng.normal())).collect();
        let grads: Vec<Vec<bf16>> = (0..4)
            .map(|_| (0..n).map(|_| bf16::from_f64(rng.normal())).collect())
            .collect();
        let p = Var::from_tensor(&Tensor::from_slice(&start, n, &Device::Cpu)?)?;
        let mut opt = Sgd::new(vec![p.clone()], c)?;
        let (mut want, mut bufs) = (start.clone(), vec![None; n]);
        for g in &grads {
            opt.update(0, &Tensor::from_slice(g, n, &Device::Cpu)?)?;
            for i in 0..n {
                torch_bf16_step(&mut want[i], &mut bufs[i], g[i], &c);
            }
        }
        assert_eq!(p.to_vec1::<bf16>()?, want);
        // Momentum rounded to bf16 gives other parameters.
        let rounded = SgdConfig {
            momentum: bf16::from_f64(0.99).to_f64(),
            ..c
        };
        let (mut other, mut bufs) = (start, vec![None; n]);
        for g in &grads {
            for i in 0..n {
                torch_bf16_step(&mut other[i], &mut bufs[i], g[i], &rounded);
            }
        }
        assert_ne!(other, want);
        Ok(())
    }

    fn assert_close(got: &[f64], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "got {got:?}, want {want:?}");
        }
    }

    // Expected values below are worked out by hand from torch.optim.SGD's update rule.

    #[test]
    fn plain_sgd_without_momentum() {
        let c = SgdConfig {
            lr: 0.1,
            ..Default::default()
        };
        assert_close(&run(c, 2), &[0.9, 0.81]);
    }

    #[test]
    fn momentum_starts_the_buffer_at_the_first_gradient() {
        // buf: 1, 0.9*1 + 0.9 = 1.8, 0.9*1.8 + 0.72 = 2.34; p: 0.9, 0.72, 0.486
        let c = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..Default::default()
        };
        assert_close(&run(c, 3), &[0.9, 0.72, 0.486]);
    }

    #[test]
    fn dampening_and_weight_decay() {
        // step 1: g = 1 + 0.1*1 = 1.1, buf = 1.1 (no dampening on the first step), p = 0.89
        // step 2: g = 0.89 + 0.089 = 0.979, buf = 0.9*1.1 + 0.5*0.979 = 1.4795, p = 0.74205
        let c = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.5,
            weight_decay: 0.1,
            ..Default::default()
        };
        assert_close(&run(c, 2), &[0.89, 0.74205]);
    }

    #[test]
    fn nesterov_looks_ahead() {
        // step 1: buf = 1, g = 1 + 0.9*1 = 1.9, p = 0.81
        // step 2: buf = 0.9 + 0.81 = 1.71, g = 0.81 + 0.9*1.71 = 2.349, p = 0.5751
        let c = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            nesterov: true,
            ..Default::default()
        };
        assert_close(&run(c, 2), &[0.81, 0.5751]);
    }

    #[test]
    fn maximize_ascends() {
        let c = SgdConfig {
            lr: 0.1,
            maximize: true,
            ..Default::default()
        };
        assert_close(&run(c, 2), &[1.1, 1.21]);
    }

    #[test]
    fn a_variable_without_gradient_is_left_alone() -> candle_core::Result<()> {
        let used = Var::new(&[1f32], &Device::Cpu)?;
        let unused = Var::new(&[5f32], &Device::Cpu)?;
        let c = SgdConfig {
            lr: 0.5,
            momentum: 0.9,
            ..Default::default()
        };
        let mut opt = Sgd::new(vec![used.clone(), unused.clone()], c)?;
        opt.backward_step(&used.as_tensor().sum_all()?)?;
        assert_eq!(used.to_vec1::<f32>()?, [0.5]);
        assert_eq!(unused.to_vec1::<f32>()?, [5.0]);
        assert!(opt.momentum_buffers()[0].is_some());
        assert!(opt.momentum_buffers()[1].is_none());
        Ok(())
    }

    #[test]
    fn a_loaded_momentum_buffer_continues_bit_for_bit() -> candle_core::Result<()> {
        let c = SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 0.01,
            ..Default::default()
        };
        let loss = |p: &Var| (p.as_tensor().powf(3.0)? - p.as_tensor())?.sum_all();
        let p = Var::new(&[0.7f32, -1.3, 2.0], &Device::Cpu)?;
        let mut opt = Sgd::new(vec![p.clone()], c)?;
        for _ in 0..3 {
            opt.backward_step(&loss(&p)?)?;
        }
        let state = opt.state();
        assert_eq!(
            state.per_var[0].keys().collect::<Vec<_>>(),
            ["momentum_buffer"]
        );
        let resumed = Var::from_tensor(&p.as_tensor().copy()?)?;
        let mut fresh = Sgd::new(vec![resumed.clone()], c)?;
        fresh.load_state(&state).map_err(Error::into_candle)?;
        for _ in 0..4 {
            opt.backward_step(&loss(&p)?)?;
            fresh.backward_step(&loss(&resumed)?)?;
        }
        assert_eq!(p.to_vec1::<f32>()?, resumed.to_vec1::<f32>()?);
        Ok(())
    }

    #[test]
    fn a_momentum_buffer_of_another_shape_is_refused() -> candle_core::Result<()> {
        let c = SgdConfig {
            momentum: 0.9,
            ..Default::default()
        };
        let mut opt = Sgd::new(vec![Var::new(&[0f32; 3], &Device::Cpu)?], c)?;
        let mut state = OptimizerState {
            per_var: vec![Default::default()],
            ..Default::default()
        };
        state.per_var[0].insert(
            MOMENTUM_BUFFER.into(),
            Tensor::zeros((3, 1), candle_core::DType::F32, &Device::Cpu)?,
        );
        let err = opt.load_state(&state).unwrap_err();
        assert!(
            matches!(&err, Error::OptimizerStateShape { variable: 0, state, expected, found, .. }
                if *state == "momentum_buffer" && expected == &[3] && found == &[3, 1]),
            "{err}"
        );
        // Without momentum there is no buffer to load.
        let mut plain = Sgd::new(
            vec![Var::new(&[0f32; 3], &Device::Cpu)?],
            Default::default(),
        )?;
        let err = plain.load_state(&state).unwrap_err().to_string();
        assert!(err.contains("momentum_buffer"), "{err}");
        Ok(())
    }

    #[test]
    fn invalid_hyper_parameters_are_refused_with_the_reason() {
        let bad = [
            (
                SgdConfig {
                    lr: -1.0,
                    ..Default::default()
                },
                "learning rate",
            ),
            (
                SgdConfig {
                    lr: f64::NAN,
                    ..Default::default()
                },
                "learning rate",
            ),
            (
                SgdConfig {
                    momentum: -0.1,
                    ..Default::default()
                },
                "momentum",
            ),
            (
                SgdConfig {
                    weight_decay: -1.0,
                    ..Default::default()
                },
                "weight_decay",
            ),
            (
                SgdConfig {
                    nesterov: true,
                    ..Default::default()
                },
                "Nesterov",
            ),
            (
                SgdConfig {
                    nesterov: true,
                    momentum: 0.9,
                    dampening: 0.1,
                    ..Default::default()
                },
                "dampening = 0",
            ),
        ];
        for (config, needle) in bad {
            let err = Sgd::new(vec![], config).unwrap_err();
            assert!(err.to_string().contains(needle), "{config:?}: {err}");
        }
    }
}
