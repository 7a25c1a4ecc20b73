//! Where a training step of the 25.2 M-parameter MLP (`ddp_throughput`'s `big`: 1024 → 4096 →
//! 4096 → 1024, ReLU, cross-entropy, SGD with momentum) spends its time, ours beside PyTorch's:
//! forward with the loss, backward ([`candle_parallel::nn::backward`]) and the SGD step, for the
//! model as candle-nn's `Linear` runs it and after the one-line swap to
//! [`candle_parallel::nn::linear_relu`] and [`candle_parallel::nn::linear`] (the same
//! variables).
//!
//!     cargo bench --bench mlp_phases
//!     cargo bench --bench mlp_phases -- --threads 1 --batch 64 --steps 10 --models nn
//!     cargo bench --bench mlp_phases -- --threads 2 --in-pool   # as transformer_ddp runs
//!     cargo bench --bench mlp_phases -- --matmul-precision medium  # bf16 products, both sides
//!
//! Medians over `--steps` repetitions after 3 warm-up ones. `scripts/torch_mlp_phases.py`
//! times the same in PyTorch with the same threads; this bench runs it when `python3 -c
//! "import torch"` works and prints the ratios. Reports; asserts nothing.

mod common;

#[path = "common/timing.rs"]
mod timing;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Module};
use candle_nn::{loss, Optimizer, VarBuilder, VarMap};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::nn;
use candle_parallel::optim::Sgd;
use std::path::PathBuf;
use std::process::Command;
use timing::time;

struct Options {
    batch: usize,
    steps: usize,
    threads: Option<usize>,
    models: String,
    in_pool: bool,
    /// `highest` or `medium` (torch's `set_float32_matmul_precision`, for both sides).
    matmul_precision: String,
}

fn parse() -> Result<Options> {
    let mut o = Options {
        batch: 64,
        steps: 10,
        threads: None,
        models: "candle-nn,nn".into(),
        in_pool: false,
        matmul_precision: "highest".into(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |flag: &str| -> Result<usize> {
            Ok(args
                .next()
                .with_context(|| format!("{flag} needs a value"))?
                .parse()?)
        };
        match a.as_str() {
            "--batch" => o.batch = value("--batch")?,
            "--steps" => o.steps = value("--steps")?,
            "--threads" => o.threads = Some(value("--threads")?),
            "--models" => o.models = args.next().context("--models needs a value")?,
            "--in-pool" => o.in_pool = true,
            "--matmul-precision" => {
                o.matmul_precision = args.next().context("--matmul-precision needs a value")?
            }
            "--bench" => {}
            other => anyhow::bail!("unknown argument {other}"),
        }
    }
    Ok(o)
}

/// Forward with the loss, backward, and SGD step times of the model `build` makes.
fn phases<M: Module>(
    o: &Options,
    build: fn(VarBuilder) -> candle_core::Result<M>,
) -> Result<[f64; 3]> {
    let varmap = VarMap::new();
    let model = build(seeded_var_builder(&varmap, 0, DType::F32, &Device::Cpu))?;
    let (x, y) = common::big_batch(o.batch, &Device::Cpu)?;
    let mut opt = Sgd::new(varmap.all_vars(), common::SGD)?;
    let forward = time(o.steps, || {
        loss::cross_entropy(&model.forward(&x)?, &y)?;
        Ok(())
    })?;
    let backward = time(o.steps, || {
        nn::backward(&loss::cross_entropy(&model.forward(&x)?, &y)?)?;
        Ok(())
    })? - forward;
    let grads = nn::backward(&loss::cross_entropy(&model.forward(&x)?, &y)?)?;
    let step = time(o.steps, || Ok(opt.step(&grads)?))?;
    Ok([forward, backward.max(0.0), step])
}

fn main() -> Result<()> {
    // As the examples do: freed tensor memory stays for the next step.
    candle_parallel::memory::keep_freed_memory();
    let o = parse()?;
    if let Some(n) = o.threads {
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    nn::set_float32_matmul_precision(match o.matmul_precision.as_str() {
        "highest" => nn::MatmulPrecision::Highest,
        "medium" => nn::MatmulPrecision::Medium,
        other => anyhow::bail!("--matmul-precision {other:?}: highest or medium"),
    });
    let threads = candle_core::utils::get_num_threads();
    println!(
        "the 25.2 M MLP, batch {}, {threads} threads, matmul precision {} (bf16 tiles: {}), ms \
         (median of {})",
        o.batch,
        o.matmul_precision,
        nn::bf16_tiles_available(),
        o.steps
    );
    let measure = || -> Result<Vec<(&str, [f64; 3])>> {
        let mut rows = Vec::new();
        for model in o.models.split(',') {
            rows.push(match model {
                "candle-nn" => ("candle-nn Linear", phases(&o, common::big)?),
                "nn" => ("nn::linear_relu", phases(&o, common::big_nn)?),
                other => anyhow::bail!("unknown model {other:?}: candle-nn or nn"),
            });
        }
        Ok(rows)
    };
    let rows = if o.in_pool {
        candle_parallel::threads::one_pool();
        candle_parallel::threads::in_pool(measure)?
    } else {
        measure()?
    };

    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/torch_mlp_phases.py");
    let torch = Command::new("python3")
        .arg(&script)
        .args(["--batch", &o.batch.to_string()])
        .args(["--steps", &o.steps.to_string()])
        .args(["--threads", &threads.to_string()])
        .args(["--matmul-precision", &o.matmul_precision])
        .output();
    let torch: Option<[f64; 3]> = match torch {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("torch "))
            .and_then(|rest| {
                let v: Vec<f64> = rest.split(' ').filter_map(|s| s.parse().ok()).collect();
                v.try_into().ok()
            }),
        Ok(out) => {
            println!(
                "(PyTorch's twin failed: {})",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            None
        }
        Err(e) => {
            println!("(no PyTorch: {e})");
            None
        }
    };
    println!(
        "| model | forward + loss | backward | SGD step | step | images/s |\n|---|---|---|---|---|---|"
    );
    let print = |name: &str, t: [f64; 3]| {
        let total: f64 = t.iter().sum();
        println!(
            "| {name} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} |",
            t[0] * 1e3,
            t[1] * 1e3,
            t[2] * 1e3,
            total * 1e3,
            o.batch as f64 / total
        );
    };
    for (name, t) in rows {
        print(name, t);
    }
    if let Some(t) = torch {
        print("PyTorch 2.15", t);
    }
    Ok(())
}
