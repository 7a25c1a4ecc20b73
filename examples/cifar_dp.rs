//! Trains the CIFAR-10 tutorial CNN with `DataParallel` on every device it finds.
//!
//!     cargo run --release --example cifar_dp                       # synthetic data, CPU
//!     cargo run --release --example cifar_dp --features cuda       # every GPU
//!     cargo run --release --example cifar_dp -- --data-dir ~/data/cifar-10-batches-bin
//!
//! The model, optimiser and data pipeline follow PyTorch's CIFAR-10 tutorial: SGD with
//! lr 0.01 and momentum 0.9, batch 128, images normalised with mean 0.5 and std 0.5.

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::{loss, Optimizer, VarMap};
use candle_parallel::cifar::{self, Cifar10, Net, Split};
use candle_parallel::devices::replica_devices;
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{Sgd, SgdConfig};
use candle_parallel::rng::Rng;
use candle_parallel::{checkpoint, DataParallel};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::time::Instant;

/// Train the CIFAR-10 tutorial CNN with DataParallel.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Folder with the CIFAR-10 binary files (data_batch_1.bin .. test_batch.bin); without it
    /// an embedded synthetic CIFAR-shaped dataset is used.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Passes over the training set.
    #[arg(long, default_value_t = 10)]
    epochs: usize,
    /// Images per step, split across the devices.
    #[arg(long, default_value_t = 128)]
    batch_size: usize,
    /// SGD learning rate.
    #[arg(long, default_value_t = 0.01)]
    lr: f64,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    momentum: f64,
    /// Replicas to run: default every GPU (with --features cuda), else 1 CPU replica. More
    /// replicas than GPUs share GPUs; without GPUs they are CPU replicas.
    #[arg(long)]
    devices: Option<usize>,
    /// Use CPU replicas even when GPUs are available.
    #[arg(long)]
    cpu: bool,
    /// Use only the first N training images (synthetic default: 12800).
    #[arg(long)]
    train_size: Option<usize>,
    /// Use only the first N test images (synthetic default: 1000).
    #[arg(long)]
    test_size: Option<usize>,
    /// Seed of the initial weights, the shuffling and the synthetic data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Save the trained weights here (safetensors, written atomically); they load into a
    /// plain `Net`.
    #[arg(long)]
    save: Option<PathBuf>,
}

/// The synthetic default: 100 steps of 128 per epoch, so the first epoch ends past the initial
/// loss plateau; 10 epochs take about two and a half minutes on 2 CPU cores.
const SYNTHETIC_TRAIN: usize = 12_800;
const SYNTHETIC_TEST: usize = 1_000;
const EVAL_BATCH: usize = 1000;

fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.batch_size > 0, "--batch-size must be at least 1");
    let data = load_data(&args)?;
    anyhow::ensure!(!data.train.is_empty(), "the training set is empty");
    let devices = replica_devices(args.devices, args.cpu)?;
    if devices.len() > 1 {
        println!("Let's use {} devices!", devices.len());
    }
    let main_device = devices[0].clone();

    let varmap = VarMap::new();
    // Seeded initial weights: the same on every run and every device.
    Net::new(seeded_var_builder(
        &varmap,
        args.seed,
        DType::F32,
        &main_device,
    ))?;
    let model = DataParallel::new(&varmap, devices, Net::new)?;
    let config = SgdConfig {
        lr: args.lr,
        momentum: args.momentum,
        ..Default::default()
    };
    let mut opt = Sgd::new(model.vars(), config)?;

    let started = Instant::now();
    for epoch in 1..=args.epochs {
        let rate = train_epoch(&model, &mut opt, &data.train, &args, epoch, &main_device)?;
        let (loss, correct) = evaluate(&model, &data.test, &main_device)?;
        let n = data.test.len();
        println!("Epoch {epoch}/{}: {rate:.0} images/s", args.epochs);
        println!(
            "Test set: Average loss: {loss:.4}, Accuracy: {correct}/{n} ({:.0}%)",
            100.0 * correct as f64 / n.max(1) as f64
        );
    }
    println!("Finished in {:.1}s", started.elapsed().as_secs_f64());
    if let Some(path) = &args.save {
        let tensors = model
            .var_names()
            .iter()
            .cloned()
            .zip(model.vars().iter().map(|v| v.as_tensor().clone()))
            .collect();
        checkpoint::save(&tensors, path)
            .with_context(|| format!("saving the model to {}", path.display()))?;
        println!("Saved the model to {}", path.display());
    }
    Ok(())
}

fn load_data(args: &Args) -> Result<Cifar10> {
    let data = match &args.data_dir {
        Some(dir) => cifar::load(dir)?,
        None => cifar::synthetic(
            args.train_size.unwrap_or(SYNTHETIC_TRAIN),
            args.test_size.unwrap_or(SYNTHETIC_TEST),
            args.seed,
        ),
    };
    let take = |split: &Split, n: Option<usize>| n.map_or_else(|| split.clone(), |n| split.take(n));
    Ok(Cifar10 {
        train: take(&data.train, args.train_size),
        test: take(&data.test, args.test_size),
    })
}

/// One pass over the shuffled training set; returns the training throughput in images/s.
fn train_epoch(
    model: &DataParallel<Net>,
    opt: &mut Sgd,
    train: &Split,
    args: &Args,
    epoch: usize,
    device: &Device,
) -> Result<f64> {
    let order = Rng::new(args.seed.wrapping_mul(1_000_003).wrapping_add(epoch as u64))
        .permutation(train.len());
    let bar = ProgressBar::new(train.len() as u64).with_style(
        ProgressStyle::with_template(
            "epoch {msg} [{bar:30}] {pos}/{len} images, {per_sec}, eta {eta}",
        )?
        .progress_chars("=> "),
    );
    bar.set_message(format!("{epoch}/{}", args.epochs));
    let started = Instant::now();
    let mut last_loss = Tensor::zeros((), DType::F32, device)?;
    for indices in order.chunks(args.batch_size) {
        let (images, labels) = train.batch(indices, device)?;
        let logits = model.forward_t(&images, true)?;
        let loss = loss::cross_entropy(&logits, &labels)?;
        opt.backward_step(&loss)?;
        last_loss = loss;
        bar.inc(indices.len() as u64);
    }
    // Reading the last loss waits for the device, so the time covers all the work.
    last_loss.to_scalar::<f32>()?;
    let seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    Ok(train.len() as f64 / seconds)
}

/// Mean cross-entropy per test image and the number classified correctly.
fn evaluate(model: &DataParallel<Net>, test: &Split, device: &Device) -> Result<(f64, usize)> {
    let mut loss_sum = 0f64;
    let mut correct = 0usize;
    let indices: Vec<usize> = (0..test.len()).collect();
    for batch in indices.chunks(EVAL_BATCH) {
        let (images, labels) = test.batch(batch, device)?;
        let logits = model.forward_t(&images, false)?;
        let loss = loss::cross_entropy(&logits, &labels)?.to_scalar::<f32>()?;
        loss_sum += f64::from(loss) * batch.len() as f64;
        let predicted = logits.argmax(D::Minus1)?;
        correct += predicted
            .eq(&labels)?
            .to_dtype(DType::U32)?
            .sum_all()?
            .to_scalar::<u32>()? as usize;
    }
    Ok((loss_sum / test.len().max(1) as f64, correct))
}
