//! PyTorch's "Single-Machine Model Parallel Best Practices", in candle.
//!
//!     cargo run --release --example model_parallel                     # two CPU "devices"
//!     cargo run --release --features cuda --example model_parallel      # cuda:0 and cuda:1
//!     cargo run --release --example model_parallel -- --split-sizes 10,20,40 --steps 10
//!
//! First the tutorial's `ToyModel`: `net1` on the first device, `net2` on the second, one
//! step of SGD on MSE. Then its experiment: one model trained on one device, cut in two halves
//! on two devices (`ModelParallelResNet50`'s `seq1` and `seq2`), and pipelined over
//! micro-batches of each `--split-sizes` (`PipelineParallelResNet50`), from the same initial
//! weights on the same batches. A table gives each one's time per step, its final loss and
//! how far its weights are from the one-device model's (the same numbers, up to rounding).
//! With one GPU, both devices are streams of GPU 0 (two distinct candle devices); on the CPU,
//! both are the CPU and the pipelined stages run on threads of their own.

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{linear, loss, Linear, Optimizer, VarBuilder, VarMap};
use candle_parallel::devices::replica_devices;
use candle_parallel::init::seeded_var_builder;
use candle_parallel::model_parallel::{ModelParallel, Stage};
use candle_parallel::optim::{Sgd, SgdConfig};
use candle_parallel::rng::Rng;
use clap::Parser;
use std::time::Instant;

/// The model-parallel tutorial: one model on two devices, plain and pipelined.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Use the CPU even when GPUs are available.
    #[arg(long)]
    cpu: bool,
    /// Training steps per mode.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Rows per batch (the tutorial's 120).
    #[arg(long, default_value_t = 120)]
    batch_size: usize,
    /// Width of the hidden layers.
    #[arg(long, default_value_t = 512)]
    hidden: usize,
    /// Micro-batch sizes to pipeline with.
    #[arg(long, value_delimiter = ',', default_value = "20,40,60")]
    split_sizes: Vec<usize>,
}

/// Variables by name, sorted, on the CPU.
type Named = Vec<(String, Tensor)>;

const INPUT: usize = 64;
const CLASSES: usize = 10;

/// The tutorial's ToyModel: net1 (10 -> 10) on `dev0`, ReLU, net2 (10 -> 5) on `dev1`.
fn toy_model(dev0: &Device, dev1: &Device) -> Result<()> {
    let varmap = VarMap::new();
    let vb = |device: &Device| VarBuilder::from_varmap(&varmap, DType::F32, device);
    let net1 = linear(10, 10, vb(dev0).pp("net1"))?;
    let net2 = linear(10, 5, vb(dev1).pp("net2"))?;
    let model = ModelParallel::new(vec![
        Stage::new(dev0, move |x: &Tensor| net1.forward(x)?.relu()),
        Stage::new(dev1, net2),
    ])?;
    let mut opt = Sgd::new(
        varmap.all_vars(),
        SgdConfig {
            lr: 0.001,
            ..Default::default()
        },
    )?;
    let outputs = model.forward(&Tensor::randn(0f32, 1., (20, 10), dev0)?)?;
    let labels = Tensor::randn(0f32, 1., (20, 5), dev1)?;
    let l = loss::mse(&outputs, &labels)?;
    opt.backward_step(&l)?;
    println!(
        "ToyModel: outputs {:?} on {:?}, loss {:.4}",
        outputs.dims(),
        outputs.device().location(),
        l.to_scalar::<f32>()?
    );
    Ok(())
}

/// The experiment's model in two halves: `seq1` (input -> hidden -> hidden) and `seq2`
/// (hidden -> hidden -> classes), their variables on `dev0` and `dev1`, initialised from one
/// seed and their names, so the same wherever they live.
fn halves(varmap: &VarMap, hidden: usize, dev0: &Device, dev1: &Device) -> Result<[Linear; 4]> {
    let vb = |d: &Device| seeded_var_builder(varmap, 0, DType::F32, d);
    Ok([
        linear(INPUT, hidden, vb(dev0).pp("seq1.0"))?,
        linear(hidden, hidden, vb(dev0).pp("seq1.1"))?,
        linear(hidden, hidden, vb(dev1).pp("seq2.0"))?,
        linear(hidden, CLASSES, vb(dev1).pp("seq2.1"))?,
    ])
}

/// The model as two stages on `dev0` and `dev1` (one device when they are the same).
fn model(varmap: &VarMap, hidden: usize, dev0: &Device, dev1: &Device) -> Result<ModelParallel> {
    let [a, b, c, d] = halves(varmap, hidden, dev0, dev1)?;
    Ok(ModelParallel::new(vec![
        Stage::new(dev0, move |x: &Tensor| {
            b.forward(&a.forward(x)?.relu()?)?.relu()
        }),
        Stage::new(dev1, move |x: &Tensor| d.forward(&c.forward(x)?.relu()?)),
    ])?)
}

/// Step `step`'s batch: inputs on `dev0`, labels on `dev1`.
fn batch(step: usize, rows: usize, dev0: &Device, dev1: &Device) -> Result<(Tensor, Tensor)> {
    let mut rng = Rng::new(step as u64);
    let xs: Vec<f32> = (0..rows * INPUT).map(|_| rng.normal() as f32).collect();
    let ys: Vec<u32> = (0..rows)
        .map(|_| rng.below(CLASSES as u64) as u32)
        .collect();
    Ok((
        Tensor::from_vec(xs, (rows, INPUT), dev0)?,
        Tensor::from_vec(ys, rows, dev1)?,
    ))
}

/// Trains `model` for `steps` steps; returns the seconds per step (the first step, which warms
/// up, left out when there are more), the final loss and the variables by name.
fn train(
    args: &Args,
    varmap: &VarMap,
    model: &ModelParallel,
    dev0: &Device,
    dev1: &Device,
) -> Result<(f64, f32, Named)> {
    let mut opt = Sgd::new(
        varmap.all_vars(),
        SgdConfig {
            lr: 0.01,
            momentum: 0.9,
            ..Default::default()
        },
    )?;
    let (mut seconds, mut last) = (0.0, f32::NAN);
    for step in 0..args.steps {
        let (xs, ys) = batch(step, args.batch_size, dev0, dev1)?;
        let started = Instant::now();
        let l = loss::cross_entropy(&model.forward(&xs)?, &ys)?;
        opt.backward_step(&l)?;
        last = l.to_scalar::<f32>()?; // waits for the device
        if step > 0 || args.steps == 1 {
            seconds += started.elapsed().as_secs_f64();
        }
    }
    let timed = if args.steps > 1 { args.steps - 1 } else { 1 };
    let mut vars: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let vars = vars
        .into_iter()
        .map(|(n, v)| Ok((n, v.as_tensor().to_device(&Device::Cpu)?)))
        .collect::<Result<_>>()?;
    Ok((seconds / timed as f64, last, vars))
}

fn max_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> Result<f32> {
    let mut worst = 0f32;
    for ((na, ta), (nb, tb)) in a.iter().zip(b) {
        anyhow::ensure!(na == nb, "variables {na} and {nb} differ");
        worst = worst.max(
            (ta - tb)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?,
        );
    }
    Ok(worst)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let devices = replica_devices(Some(2), args.cpu)?;
    let (dev0, dev1) = (&devices[0], &devices[1]);
    println!("devices: {:?} and {:?}", dev0.location(), dev1.location());
    toy_model(dev0, dev1)?;

    let one = VarMap::new();
    let (s, loss, want) = train(
        &args,
        &one,
        &model(&one, args.hidden, dev0, dev0)?,
        dev0,
        dev0,
    )?;
    println!(
        "\n| mode | split_size | s/step | final loss | max weight difference from one device |"
    );
    println!("|---|---|---|---|---|");
    println!("| one device | - | {s:.4} | {loss:.6} | 0 |");
    let mut worst = 0f32;
    for split in std::iter::once(None).chain(args.split_sizes.iter().map(|&s| Some(s))) {
        let varmap = VarMap::new();
        let mut mp = model(&varmap, args.hidden, dev0, dev1)?;
        let mode = match split {
            None => "model parallel",
            Some(size) => {
                mp = mp.with_split_size(size)?;
                "pipelined"
            }
        };
        let (s, loss, got) = train(&args, &varmap, &mp, dev0, dev1)?;
        let d = max_diff(&got, &want)?;
        worst = worst.max(d);
        let split = split.map_or("-".to_string(), |s| s.to_string());
        println!("| {mode} | {split} | {s:.4} | {loss:.6} | {d:.2e} |");
    }
    println!("\nmax weight difference from one device: {worst:.2e}");
    Ok(())
}
