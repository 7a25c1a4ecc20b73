//! The Rust half of `scripts/torch_optim_check.py`: trains the script's small MLP with our
//! `AdamW` and `Sgd` on the script's data, and writes the weights after every step for the
//! script to compare with `torch.optim.AdamW` and `torch.optim.SGD`.
//!
//!     python3 scripts/torch_optim_check.py        # runs this example itself
//!     cargo run --example optim_twin -- IN.npz OUT.npz
//!
//! IN.npz holds the initial weights `w1` (hidden, in), `b1`, `w2` (out, hidden), `b2`; the
//! batches `x` (steps, batch, in) and `y` (steps, batch, out); and one `cfg.NAME` per case: the
//! f64 vector `[kind (0 AdamW, 1 SGD), lr, beta1, beta2, eps, weight_decay, amsgrad, maximize,
//! momentum, dampening, nesterov]`. Each case trains `y ≈ w2 tanh(w1 x + b1) + b2` (mean
//! squared error) for every step of `x`, in f32 and in f64; OUT.npz holds
//! `NAME.DTYPE.STEP.PARAM`, the parameters after each step.
//!
//! IN.npz also holds, per DTYPE (`f32`, `f64`, `f16`, `bf16`), parameters `open.DTYPE.pJ` and
//! the gradients of every step `open.DTYPE.gS.J` (values exact in DTYPE, stored as f32, f64 for
//! f64; one parameter has no elements): each case also steps those parameters with those
//! gradients in DTYPE, and OUT.npz holds `open.NAME.DTYPE.STEP.pJ` (in f32, f64 for f64).

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor, Var};
use candle_nn::Optimizer;
use candle_parallel::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
use std::collections::HashMap;

/// The dtypes of the open-loop runs, by the names the script gives them.
const OPEN_DTYPES: [(DType, &str); 4] = [
    (DType::F32, "f32"),
    (DType::F64, "f64"),
    (DType::F16, "f16"),
    (DType::BF16, "bf16"),
];

/// The optimizer of a case (`c`, the script's 11 numbers) over `vars`.
fn optimizer(c: &[f64], vars: &[Var]) -> Result<Step> {
    let [kind, lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, momentum, dampening, nesterov] =
        c[..]
    else {
        bail!("a case has {} numbers, not 11", c.len());
    };
    Ok(if kind == 0.0 {
        let config = AdamWConfig {
            lr,
            betas: (beta1, beta2),
            eps,
            weight_decay,
            amsgrad: amsgrad != 0.0,
            maximize: maximize != 0.0,
        };
        let mut o = AdamW::new(vars.to_vec(), config)?;
        Box::new(move |loss| o.backward_step(loss))
    } else {
        let config = SgdConfig {
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov: nesterov != 0.0,
            maximize: maximize != 0.0,
        };
        let mut o = Sgd::new(vars.to_vec(), config)?;
        Box::new(move |loss| o.backward_step(loss))
    })
}

const PARAMS: [&str; 4] = ["w1", "b1", "w2", "b2"];

/// One optimizer step from a loss: AdamW's or Sgd's `backward_step`.
type Step = Box<dyn FnMut(&Tensor) -> candle_core::Result<()>>;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, input, output] = args.as_slice() else {
        bail!("usage: optim_twin IN.npz OUT.npz");
    };
    let arrays: HashMap<String, Tensor> = Tensor::read_npz(input)
        .with_context(|| format!("reading {input}"))?
        .into_iter()
        .collect();
    let get = |name: &str| {
        arrays
            .get(name)
            .with_context(|| format!("{input} lacks `{name}`"))
    };
    let mut out: Vec<(String, Tensor)> = Vec::new();
    for (key, cfg) in &arrays {
        let Some(case) = key.strip_prefix("cfg.") else {
            continue;
        };
        let c = cfg.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        for (dtype, dname) in OPEN_DTYPES {
            let param = |j: usize| arrays.get(&format!("open.{dname}.p{j}"));
            let vars: Vec<Var> = (0..)
                .map_while(param)
                .map(|t| Ok(Var::from_tensor(&t.to_dtype(dtype)?)?))
                .collect::<Result<_>>()?;
            let mut opt = optimizer(&c, &vars)?;
            for step in 0.. {
                let Some(grads) = (0..vars.len())
                    .map(|j| arrays.get(&format!("open.{dname}.g{step}.{j}")))
                    .collect::<Option<Vec<_>>>()
                else {
                    break;
                };
                // sum(p * g) has the gradient g, exactly, for every parameter.
                let mut loss = Tensor::zeros((), dtype, &candle_core::Device::Cpu)?;
                for (v, g) in vars.iter().zip(grads) {
                    loss = (loss + (v.as_tensor() * g.to_dtype(dtype)?)?.sum_all()?)?;
                }
                opt(&loss)?;
                for (j, v) in vars.iter().enumerate() {
                    // A copy: the optimizer writes the variable in place.
                    let wide = match dtype {
                        DType::F64 => v.as_tensor().copy()?,
                        _ => v.as_tensor().copy()?.to_dtype(DType::F32)?,
                    };
                    out.push((format!("open.{case}.{dname}.{step}.p{j}"), wide));
                }
            }
        }
        for (dtype, dname) in [(DType::F32, "f32"), (DType::F64, "f64")] {
            let vars: Vec<Var> = PARAMS
                .iter()
                .map(|p| Ok(Var::from_tensor(&get(p)?.to_dtype(dtype)?)?))
                .collect::<Result<_>>()?;
            let mut opt = optimizer(&c, &vars)?;
            let (x, y) = (get("x")?.to_dtype(dtype)?, get("y")?.to_dtype(dtype)?);
            for step in 0..x.dim(0)? {
                let (xs, ys) = (x.get(step)?, y.get(step)?);
                let [w1, b1, w2, b2] = [0, 1, 2, 3].map(|i| vars[i].as_tensor());
                let h = xs.matmul(&w1.t()?)?.broadcast_add(b1)?.tanh()?;
                let pred = h.matmul(&w2.t()?)?.broadcast_add(b2)?;
                opt(&(pred - ys)?.sqr()?.mean_all()?)?;
                for (p, v) in PARAMS.iter().zip(&vars) {
                    out.push((format!("{case}.{dname}.{step}.{p}"), v.as_tensor().copy()?));
                }
            }
        }
    }
    let refs: Vec<(&str, &Tensor)> = out.iter().map(|(k, t)| (k.as_str(), t)).collect();
    Tensor::write_npz(&refs, output).with_context(|| format!("writing {output}"))?;
    Ok(())
}
