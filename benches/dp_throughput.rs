//! Training throughput of the CIFAR-10 tutorial Net under DataParallel.
//!
//!     cargo bench --bench dp_throughput
//!     cargo bench --bench dp_throughput -- --kernels ours --devices 1 --batches 128
//!     cargo bench --bench dp_throughput --features cuda -- --devices 1,2,4 --steps 50
//!     cargo bench --bench dp_throughput -- --kernels ours --devices 1,2 --plot scaling.svg
//!
//! For each batch size, kernel choice and replica count: warm-up steps, then timed SGD steps
//! (forward, cross-entropy, backward, update) on random CIFAR-shaped data; prints images/s, the
//! ratio to one replica with the same kernels and batch size, and on the CPU the ratio of our
//! convolution and max-pool kernels to candle's (`--kernels candle,ours`, the default there;
//! see `nn::use_own_cpu_kernels`), all measured in this one run. Without GPUs the replicas are
//! CPU replicas (which share the machine's cores). With `--plot FILE.svg`, also draws images/s
//! against the replica count, one line per batch size beside its ideal linear line (our
//! kernels' where both were measured). Reports; asserts nothing.
//!
//! Against PyTorch: `python3 scripts/torch_net_bench.py --rust <this binary> --repeats 5` runs
//! this bench (one CPU replica, our kernels) and PyTorch's twin of the step in turns and prints
//! the medians side by side.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use candle_nn::{loss, Optimizer, VarMap};
use candle_parallel::cifar::Net;
use candle_parallel::devices::replica_devices;
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{Sgd, SgdConfig};
use candle_parallel::DataParallel;
use std::path::PathBuf;
use std::time::Instant;

#[path = "../examples/common/plot.rs"]
mod plot;

struct Options {
    devices: Vec<usize>,
    batches: Vec<usize>,
    steps: usize,
    warmup: usize,
    cpu: bool,
    /// `false` for candle's CPU kernels, `true` for ours, in the order measured.
    kernels: Vec<bool>,
    /// Where to draw the scaling chart.
    plot: Option<PathBuf>,
}

fn kernels(value: Option<String>) -> Result<Vec<bool>> {
    let value = value.context("--kernels needs a value: candle, ours or candle,ours")?;
    value
        .split(',')
        .map(|k| match k.trim() {
            "candle" => Ok(false),
            "ours" => Ok(true),
            other => bail!("--kernels: {other:?} is neither candle nor ours"),
        })
        .collect()
}

fn list(value: Option<String>, flag: &str) -> Result<Vec<usize>> {
    let value = value.with_context(|| format!("{flag} needs a value, e.g. {flag} 1,2,4"))?;
    value
        .split(',')
        .map(|v| {
            v.trim()
                .parse::<usize>()
                .with_context(|| format!("{flag}: {v:?}"))
        })
        .collect()
}

fn parse() -> Result<Options> {
    let mut o = Options {
        devices: vec![1, 2, 4],
        batches: vec![128, 512],
        steps: 20,
        warmup: 3,
        cpu: false,
        kernels: Vec::new(),
        plot: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--devices" => o.devices = list(args.next(), "--devices")?,
            "--batches" => o.batches = list(args.next(), "--batches")?,
            "--steps" => o.steps = list(args.next(), "--steps")?[0],
            "--warmup" => o.warmup = list(args.next(), "--warmup")?[0],
            "--cpu" => o.cpu = true,
            "--kernels" => o.kernels = kernels(args.next())?,
            "--plot" => {
                let path = args
                    .next()
                    .context("--plot needs a file, e.g. --plot scaling.svg")?;
                plot::check_path(path.as_ref())?;
                o.plot = Some(path.into());
            }
            "--bench" => {} // passed by `cargo bench`
            other => bail!("unknown argument {other:?}"),
        }
    }
    if o.kernels.is_empty() {
        // On GPUs candle's kernels run either way.
        let gpu = !o.cpu && candle_parallel::devices::gpu_count() > 0;
        o.kernels = if gpu { vec![true] } else { vec![false, true] };
    }
    if o.devices.contains(&0) || o.batches.contains(&0) || o.steps == 0 {
        bail!("device counts, batch sizes and --steps must be positive");
    }
    Ok(o)
}

/// Images per second for `steps` training steps on `n` replicas at `batch`.
fn measure(n: usize, batch: usize, o: &Options) -> Result<f64> {
    let devices = replica_devices(Some(n), o.cpu)?;
    let device = devices[0].clone();
    let varmap = VarMap::new();
    Net::new(seeded_var_builder(&varmap, 0, DType::F32, &device))?;
    let model = DataParallel::new(&varmap, devices, Net::new)?;
    let config = SgdConfig {
        lr: 0.01,
        momentum: 0.9,
        ..Default::default()
    };
    let mut opt = Sgd::new(model.parameters(), config)?;
    let x = Tensor::randn(0f32, 1.0, (batch, 3, 32, 32), &device)?;
    let labels: Vec<u32> = (0..batch as u32).map(|i| i % 10).collect();
    let y = Tensor::from_vec(labels, batch, &device)?;
    let mut step = || -> Result<Tensor> {
        let loss = loss::cross_entropy(&model.forward_t(&x, true)?, &y)?;
        opt.backward_step(&loss)?;
        Ok(loss)
    };
    for _ in 0..o.warmup {
        step()?.to_scalar::<f32>()?;
    }
    let started = Instant::now();
    let mut last = None;
    for _ in 0..o.steps {
        last = Some(step()?);
    }
    // Reading the loss waits for every queued kernel.
    last.map(|l| l.to_scalar::<f32>()).transpose()?;
    Ok((o.steps * batch) as f64 / started.elapsed().as_secs_f64())
}

fn main() -> Result<()> {
    // Freed tensor memory stays for the next step (see candle_parallel::memory).
    candle_parallel::memory::keep_freed_memory();
    let o = parse()?;
    let gpus = if o.cpu {
        0
    } else {
        candle_parallel::devices::gpu_count()
    };
    let kind = if gpus == 0 {
        "CPU replicas".to_string()
    } else {
        format!("replicas over {gpus} GPU(s)")
    };
    // The chart's lines: our kernels' where both were measured (they are the default).
    let charted = o.kernels.contains(&true);
    let mut series = Vec::new();
    println!(
        "DataParallel training throughput, CIFAR-10 Net, {kind}, {} steps after {} warm-up",
        o.steps, o.warmup
    );
    println!(
        "{:>6} {:>8} {:>8} {:>12} {:>9} {:>10}",
        "batch", "kernels", "devices", "images/s", "vs 1", "vs candle"
    );
    for &batch in &o.batches {
        let mut candle_rates = std::collections::HashMap::new();
        for &own in &o.kernels {
            candle_parallel::nn::use_own_cpu_kernels(own);
            let name = if own { "ours" } else { "candle" };
            let mut base = None;
            let mut points = Vec::new();
            for &n in &o.devices {
                let rate = measure(n, batch, &o)?;
                let base = *base.get_or_insert(if n == 1 { rate } else { measure(1, batch, &o)? });
                if !own {
                    candle_rates.insert(n, rate);
                }
                let vs_candle = match candle_rates.get(&n) {
                    Some(c) if own => format!("{:.2}x", rate / c),
                    _ => "-".to_string(),
                };
                println!(
                    "{batch:>6} {name:>8} {n:>8} {rate:>12.1} {:>8.2}x {vs_candle:>10}",
                    rate / base
                );
                points.push((n as u32, rate));
            }
            if own == charted {
                // The ideal line starts from one replica.
                if let Some(base) = base.filter(|_| !o.devices.contains(&1)) {
                    points.push((1, base));
                }
                series.push(plot::Series {
                    name: format!("batch {batch}"),
                    points,
                });
            }
        }
    }
    candle_parallel::nn::use_own_cpu_kernels(true);
    if let Some(path) = &o.plot {
        let subtitle = if gpus == 0 {
            let kernels = if charted { "our" } else { "candle's" };
            format!(
                "CPU replicas sharing {}: one replica already uses every core\n{kernels} CPU \
                 kernels; {} steps after {} warm-up, random CIFAR-shaped images",
                plot::cpu_description(),
                o.steps,
                o.warmup
            )
        } else {
            format!(
                "replicas over {gpus} x {}\n{} steps after {} warm-up, random CIFAR-shaped \
                 images",
                plot::gpu_name(),
                o.steps,
                o.warmup
            )
        };
        let chart = plot::Scaling {
            title: "DataParallel training throughput, CIFAR-10 tutorial Net",
            subtitle: &subtitle,
            x_label: "devices (replicas)",
            series: &series,
        };
        plot::scaling_chart(path, &chart)?;
        println!("Drew the chart to {}", path.display());
    }
    Ok(())
}
