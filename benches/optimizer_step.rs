//! One optimizer step over the 25.2 M parameters of the MLP's shape, ours beside candle-nn's and
//! PyTorch's, measured side by side in one run.
//!
//!     cargo bench --bench optimizer_step
//!     cargo bench --bench optimizer_step -- --steps 20 --threads 1
//!
//! Four f32 matrices of 2048 x 3072 with fixed gradients; each optimizer runs 3 warm-up steps,
//! then `--steps` timed steps (median reported). Ours: `optim::AdamW` (one in-place pass per
//! parameter on the CPU) and `optim::Sgd` with momentum; candle-nn's `AdamW` (tensor ops). Then
//! `scripts/torch_optimizer_bench.py` times `torch.optim.AdamW` and `SGD` (foreach off and on)
//! with the same shapes and threads, when `python3 -c "import torch"` works. Reports; asserts
//! nothing.

#[path = "common/timing.rs"]
mod timing;

use anyhow::{Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;
use candle_parallel::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
use std::path::PathBuf;
use std::process::Command;
use timing::time;

const SHAPE: (usize, usize) = (2048, 3072);
const MATRICES: usize = 4;

fn setup() -> Result<(Vec<Var>, GradStore)> {
    let vars = (0..MATRICES)
        .map(|i| {
            let t = Tensor::rand(-1f32, 1.0, SHAPE, &Device::Cpu)?.affine(0.1, i as f64 * 0.01)?;
            Ok(Var::from_tensor(&t)?)
        })
        .collect::<Result<Vec<_>>>()?;
    // Gradients as backward makes them: one per variable, in a GradStore.
    let loss = vars
        .iter()
        .try_fold(Tensor::zeros((), DType::F32, &Device::Cpu)?, |acc, v| {
            acc + v.as_tensor().sqr()?.sum_all()?
        })?;
    Ok((vars, loss.backward()?))
}

fn main() -> Result<()> {
    let mut steps = 10;
    let mut threads = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--steps" => steps = args.next().context("--steps N")?.parse()?,
            "--threads" => threads = Some(args.next().context("--threads N")?.parse::<usize>()?),
            "--bench" => {}
            other => anyhow::bail!("unknown argument {other}"),
        }
    }
    if let Some(n) = threads {
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    let n = candle_core::utils::get_num_threads();
    let params = MATRICES * SHAPE.0 * SHAPE.1;
    println!(
        "one optimizer step, {:.1} M f32 parameters in {MATRICES} matrices of {}x{}, {n} threads",
        params as f64 / 1e6,
        SHAPE.0,
        SHAPE.1
    );
    let adamw = AdamWConfig {
        lr: 1e-3,
        weight_decay: 0.01,
        ..Default::default()
    };
    let mut rows: Vec<(String, f64)> = Vec::new();
    {
        let (vars, grads) = setup()?;
        let mut opt = AdamW::new(vars, adamw)?;
        rows.push(("ours AdamW".into(), time(steps, || Ok(opt.step(&grads)?))?));
    }
    {
        let (vars, grads) = setup()?;
        let c = candle_nn::ParamsAdamW {
            lr: adamw.lr,
            beta1: adamw.betas.0,
            beta2: adamw.betas.1,
            eps: adamw.eps,
            weight_decay: adamw.weight_decay,
        };
        let mut opt = candle_nn::AdamW::new(vars, c)?;
        rows.push((
            "candle-nn AdamW".into(),
            time(steps, || Ok(opt.step(&grads)?))?,
        ));
    }
    {
        let (vars, grads) = setup()?;
        let c = SgdConfig {
            lr: 0.01,
            momentum: 0.9,
            ..Default::default()
        };
        let mut opt = Sgd::new(vars, c)?;
        rows.push((
            "ours SGD momentum".into(),
            time(steps, || Ok(opt.step(&grads)?))?,
        ));
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/torch_optimizer_bench.py");
    let torch = Command::new("python3")
        .arg(&script)
        .args(["--steps", &steps.to_string(), "--threads", &n.to_string()])
        .output();
    match torch {
        Ok(out) if out.status.success() => {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                if let Some((name, secs)) =
                    line.strip_prefix("torch ").and_then(|l| l.rsplit_once(' '))
                {
                    rows.push((format!("torch {name}"), secs.parse()?));
                }
            }
        }
        Ok(out) => println!(
            "torch: skipped, {} failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => println!("torch: skipped, python3 does not run ({e})"),
    }
    let ours = rows[0].1;
    println!(
        "{:<28} {:>12} {:>14} {:>16}",
        "optimizer", "ms/step", "GB/s touched", "time / ours AdamW"
    );
    for (name, secs) in &rows {
        // AdamW reads p, g, m, v and writes p, m, v: 7 passes of 4 bytes; SGD 5.
        let passes = if name.contains("SGD") { 5.0 } else { 7.0 };
        println!(
            "{name:<28} {:>12.1} {:>14.2} {:>15.2}x",
            secs * 1e3,
            params as f64 * 4.0 * passes / secs / 1e9,
            secs / ours
        );
    }
    Ok(())
}
