//! Trains the CIFAR-10 tutorial CNN with `DataParallel` on every device it finds.
//!
//!     cargo run --release --example cifar_dp                       # synthetic data, CPU
//!     cargo run --release --example cifar_dp --features cuda       # every GPU
//!     cargo run --release --example cifar_dp -- --data-dir ~/data/cifar-10-batches-bin
//!     cargo run --release --example cifar_dp -- --epochs 3 --plot training.svg
//!
//! The model, optimiser and data pipeline follow PyTorch's CIFAR-10 tutorial: SGD with
//! lr 0.01 and momentum 0.9, batch 128, images normalised with mean 0.5 and std 0.5.

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::{loss, Optimizer, VarMap};
use candle_parallel::cifar::{Net, Split};
use candle_parallel::devices::replica_devices;
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{FiniteLoss, Sgd};
use candle_parallel::rng::Rng;
use candle_parallel::{checkpoint, DataParallel};
use clap::Parser;
use std::time::Instant;

#[path = "common/cifar_cli.rs"]
mod cli;
#[path = "common/plot.rs"]
mod plot;

/// Train the CIFAR-10 tutorial CNN with DataParallel.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    #[command(flatten)]
    train: cli::TrainArgs,
    /// Images per step, split across the devices.
    #[arg(long, default_value_t = 128)]
    batch_size: usize,
    /// Replicas to run: default every GPU (with --features cuda), else 1 CPU replica. More
    /// replicas than GPUs share GPUs; without GPUs they are CPU replicas.
    #[arg(long)]
    devices: Option<usize>,
    /// Use CPU replicas even when GPUs are available.
    #[arg(long)]
    cpu: bool,
}

const EVAL_BATCH: usize = 1000;

fn main() -> Result<()> {
    // The library's messages (rendezvous progress, DDP's reports) go through `log`.
    candle_parallel::logging::init();
    // Freed tensor memory stays for the next step (see candle_parallel::memory).
    candle_parallel::memory::keep_freed_memory();
    let args = Args::parse();
    anyhow::ensure!(args.batch_size > 0, "--batch-size must be at least 1");
    if let Some(path) = &args.train.plot {
        plot::check_path(path)?;
    }
    let data = args.train.load_data()?;
    let devices = replica_devices(args.devices, args.cpu)?;
    let replicas = devices.len();
    if devices.len() > 1 {
        println!("Let's use {} devices!", devices.len());
    }
    let main_device = devices[0].clone();

    let varmap = VarMap::new();
    // Seeded initial weights: the same on every run and every device.
    Net::new(seeded_var_builder(
        &varmap,
        args.train.seed,
        DType::F32,
        &main_device,
    ))?;
    let model = DataParallel::new(&varmap, devices, Net::new)?;
    let mut opt = Sgd::new(model.parameters(), args.train.sgd())?;

    let mut finite = args.train.finite_loss(&main_device)?;
    let started = Instant::now();
    let epochs = args.train.epochs;
    let mut history = Vec::with_capacity(epochs);
    for epoch in 1..=epochs {
        let (rate, train_loss) = train_epoch(
            &model,
            &mut opt,
            &data.train,
            &args,
            epoch,
            &main_device,
            &mut finite,
        )?;
        let (loss, correct) = evaluate(&model, &data.test, &main_device)?;
        println!("Epoch {epoch}/{epochs}: {rate:.0} images/s");
        cli::print_test_line(loss, correct, data.test.len());
        let n = data.test.len() as f64;
        history.push(plot::Epoch {
            epoch,
            train_loss,
            test_loss: loss / n,
            test_accuracy: 100.0 * correct as f64 / n,
        });
    }
    println!("Finished in {:.1}s", started.elapsed().as_secs_f64());
    if let Some(path) = &args.train.plot {
        let s = if replicas == 1 { "" } else { "s" };
        let on = if main_device.is_cpu() {
            format!("{replicas} CPU replica{s} on {}", plot::cpu_description())
        } else {
            format!("{replicas} replica{s} on {}", plot::gpu_name())
        };
        let subtitle = format!(
            "{on}\n{}; batch {}, SGD lr {}, momentum {}",
            args.train.data_name(&data),
            args.batch_size,
            args.train.lr,
            args.train.momentum
        );
        let title = "cifar_dp: the CIFAR-10 tutorial Net under DataParallel";
        plot::training_chart(path, title, &subtitle, &history)?;
        println!("Drew the chart to {}", path.display());
    }
    if let Some(path) = &args.train.save {
        let tensors = model
            .parameter_names()
            .iter()
            .cloned()
            .zip(model.parameters().iter().map(|v| v.as_tensor().clone()))
            .collect();
        checkpoint::save(&tensors, path)
            .with_context(|| format!("saving the model to {}", path.display()))?;
        println!("Saved the model to {}", path.display());
    }
    Ok(())
}

/// One pass over the shuffled training set; returns the training throughput in images/s and
/// the training loss averaged over the epoch's images. Fails, naming the step, when a step's
/// loss was NaN or infinite (unless `finite` is `None`: --allow-non-finite).
fn train_epoch(
    model: &DataParallel<Net>,
    opt: &mut Sgd,
    train: &Split,
    args: &Args,
    epoch: usize,
    device: &Device,
    finite: &mut Option<FiniteLoss>,
) -> Result<(f64, f64)> {
    let seed = args.train.seed;
    let order =
        Rng::new(seed.wrapping_mul(1_000_003).wrapping_add(epoch as u64)).permutation(train.len());
    let bar = cli::progress_bar(train.len(), epoch, args.train.epochs)?;
    let started = Instant::now();
    // The loss summed over the epoch's images, kept on the device so no step waits for it.
    let mut loss_sum = Tensor::zeros((), DType::F32, device)?;
    let steps_before = (epoch - 1) * train.len().div_ceil(args.batch_size);
    for (step, indices) in order.chunks(args.batch_size).enumerate() {
        let (images, labels) = train.batch(indices, device)?;
        let logits = model.forward_t(&images, true)?;
        let loss = loss::cross_entropy(&logits, &labels)?;
        opt.backward_step(&loss)?;
        loss_sum = (loss_sum + (loss.detach() * indices.len() as f64)?)?;
        if let Some(f) = finite.as_mut() {
            f.observe(&loss, (steps_before + step + 1) as u64)?;
        }
        bar.inc(indices.len() as u64);
    }
    if let Some(f) = finite.as_ref() {
        f.check()?;
    }
    // Reading the summed loss waits for the device, so the time covers all the work.
    let loss_sum = f64::from(loss_sum.to_scalar::<f32>()?);
    let seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    Ok((train.len() as f64 / seconds, loss_sum / train.len() as f64))
}

/// Summed cross-entropy over the test images and the number classified correctly.
fn evaluate(model: &DataParallel<Net>, test: &Split, device: &Device) -> Result<(f64, usize)> {
    let mut loss_sum = 0f64;
    let mut correct = 0usize;
    let indices: Vec<usize> = (0..test.len()).collect();
    for batch in indices.chunks(EVAL_BATCH) {
        let (images, labels) = test.batch(batch, device)?;
        let (l, c) = cli::loss_and_correct(&model.forward_t(&images, false)?, &labels)?;
        loss_sum += l;
        correct += c;
    }
    Ok((loss_sum, correct))
}
