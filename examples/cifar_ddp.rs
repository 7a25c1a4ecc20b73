//! Trains the CIFAR-10 tutorial CNN with DistributedDataParallel: one process per device.
//!
//!     cargo run --release --example cifar_ddp -- --nproc 2              # spawns 2 CPU ranks
//!     candle-run --nproc-per-node 2 target/release/examples/cifar_ddp   # or torchrun, srun
//!     cargo run --release --example cifar_ddp --features cuda,nccl -- --nproc 8  # 8 GPUs, NCCL
//!
//! The model, optimiser and data follow PyTorch's CIFAR-10 tutorial (SGD, lr 0.01, momentum 0.9,
//! images normalised with mean 0.5 and std 0.5), with torch's DDP conventions: `--batch-size`
//! is per rank, each rank trains on its `DistributedSampler` share of the shuffled training set
//! (reshuffled every epoch), and the test set is sharded without padding, so the accuracy counts
//! every test image exactly once. Only rank 0 prints and saves.
//!
//! With `--checkpoint-dir DIR` the run saves a resumable checkpoint there every
//! `--checkpoint-every` steps (the model, SGD's momentum, the epoch and the position in it) and,
//! started again, resumes from the last one by itself: under `candle-run --max-restarts N` a job
//! that lost a rank carries on where it was, and ends with the weights of a run that never
//! stopped.
//!
//!     candle-run --nproc-per-node 2 --max-restarts 3 target/release/examples/cifar_ddp \
//!         --checkpoint-dir ckpt --checkpoint-every 50
//!
//! With `--plot FILE.svg` rank 0 draws the training loss (over every rank's images), the test
//! loss and the test accuracy per epoch; a resumed run draws the epochs it trained in.

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::{loss, ModuleT, Optimizer, VarBuilder, VarMap};
use candle_parallel::checkpoint::resume::{Progress, ResumeDir};
use candle_parallel::cifar::{Net, NetBn, Split};
use candle_parallel::ddp::DdpConfig;
use candle_parallel::devices::gpu_count;
use candle_parallel::distributed::{ProcessGroup, ReduceOp, Rendezvous};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::launch::{self, LaunchConfig};
use candle_parallel::optim::{FiniteLoss, Sgd};
use candle_parallel::sampler::{DistributedSampler, SamplerConfig};
use candle_parallel::{checkpoint, DistributedDataParallel};
use clap::Parser;
use std::path::PathBuf;
use std::time::Instant;

#[path = "common/cifar_cli.rs"]
mod cli;
#[path = "common/plot.rs"]
mod plot;

/// Train the CIFAR-10 tutorial CNN with DistributedDataParallel, one process per device.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    #[command(flatten)]
    train: cli::TrainArgs,
    /// Images per step on each rank (torch's convention: the global batch is this times the
    /// number of processes).
    #[arg(long, default_value_t = 128)]
    batch_size: usize,
    /// Processes to spawn when not started by candle-run, torchrun or srun (then this process
    /// is one rank of the job they started).
    #[arg(long, default_value_t = 1)]
    nproc: usize,
    /// Train on the CPU even when GPUs are available.
    #[arg(long)]
    cpu: bool,
    /// The Net with a BatchNorm after each convolution: candle-nn's BatchNorm in one process,
    /// SyncBatchNorm (statistics over every rank's samples) with several.
    #[arg(long)]
    batch_norm: bool,
    /// Keep resumable checkpoints in this folder (shared by every rank), and resume from the
    /// last one when it holds one.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Optimizer steps between two checkpoints (with --checkpoint-dir).
    #[arg(long, default_value_t = 100)]
    checkpoint_every: u64,
}

const EVAL_BATCH: usize = 1000;

fn main() -> Result<()> {
    // The library's messages (rendezvous progress, DDP's reports) go through `log`.
    candle_parallel::logging::init();
    // Freed tensor memory stays for the next step (see candle_parallel::memory).
    candle_parallel::memory::keep_freed_memory();
    let args = Args::parse();
    anyhow::ensure!(args.batch_size > 0, "--batch-size must be at least 1");
    anyhow::ensure!(args.nproc > 0, "--nproc must be at least 1");
    anyhow::ensure!(
        args.checkpoint_every > 0,
        "--checkpoint-every must be at least 1 step"
    );
    if let Some(path) = &args.train.plot {
        plot::check_path(path)?;
    }
    // Rank 0 alone prints, so the ranks' lines need no prefix.
    let config = LaunchConfig {
        nproc_per_node: args.nproc,
        prefix_output: false,
        ..LaunchConfig::default()
    };
    launch::spawn_with_config(&config, |_rank| rank_main(&args))?;
    Ok(())
}

/// This rank's device: its GPU (`LOCAL_RANK`) when there are GPUs, else the CPU.
fn device(args: &Args) -> Result<Device> {
    let gpus = if args.cpu { 0 } else { gpu_count() };
    if gpus == 0 {
        return Ok(Device::Cpu);
    }
    let local = Rendezvous::from_env()?.local_rank;
    Ok(candle_parallel::devices::cuda_device(local % gpus)?)
}

fn rank_main(args: &Args) -> Result<()> {
    let device = device(args)?;
    let pg = ProcessGroup::from_env(&device)?;
    if pg.rank() == 0 && pg.world_size() > 1 {
        println!("Let's use {} processes!", pg.world_size());
    }
    if args.batch_norm {
        train(args, &pg, &device, NetBn::new)
    } else {
        train(args, &pg, &device, Net::new)
    }
}

/// Trains the model `build` makes, evaluates it after each epoch, and saves it (rank 0).
fn train<M: ModuleT>(
    args: &Args,
    pg: &ProcessGroup,
    device: &Device,
    build: fn(VarBuilder) -> candle_core::Result<M>,
) -> Result<()> {
    let rank = pg.rank();
    let data = args.train.load_data()?;
    let varmap = VarMap::new();
    // Seeded initial weights; DDP makes every rank take rank 0's anyway.
    build(seeded_var_builder(
        &varmap,
        args.train.seed,
        DType::F32,
        device,
    ))?;
    let config = DdpConfig {
        // BatchNorm over every rank's samples when there are several.
        sync_batch_norm: pg.world_size() > 1,
        ..DdpConfig::default()
    };
    let model = DistributedDataParallel::with_config(&varmap, pg, device, config, build)?;
    let mut opt = Sgd::new(model.parameters(), args.train.sgd())?;
    let options = SamplerConfig {
        seed: args.train.seed,
        ..SamplerConfig::default()
    };
    let mut sampler = DistributedSampler::for_group(data.train.len(), pg, options)?;
    let checkpoints = args
        .checkpoint_dir
        .as_ref()
        .map(|dir| ResumeDir::for_group(dir, pg, device));
    let mut at = Progress {
        epoch: 1,
        step: 0,
        position: 0,
        rng: None,
    };
    if let Some(c) = &checkpoints {
        if let Some(p) = c.load(|path| model.load_checkpoint(&mut opt, path))? {
            if rank == 0 {
                println!(
                    "Resumed at step {} (epoch {}, {} images of each rank's share in)",
                    p.step, p.epoch, p.position
                );
            }
            at = p;
        }
    }

    let mut finite = args.train.finite_loss(device)?;
    let started = Instant::now();
    let epochs = args.train.epochs;
    let mut history = Vec::with_capacity(epochs);
    for epoch in at.epoch as usize..=epochs {
        sampler.set_epoch(epoch as u64);
        // A resumed epoch starts where its checkpoint was taken.
        at.position = if epoch as u64 == at.epoch {
            at.position
        } else {
            0
        };
        at.epoch = epoch as u64;
        let mut training = Training {
            checkpoints: checkpoints.as_ref(),
            every: args.checkpoint_every,
            finite: &mut finite,
        };
        let (rate, train_loss) = training.epoch(
            &model,
            &mut opt,
            &data.train,
            &sampler,
            args,
            &mut at,
            device,
        )?;
        // Every rank evaluates with rank 0's running statistics.
        model.sync_buffers()?;
        let (loss, correct, n) = evaluate(&model, pg, &data.test, device)?;
        if rank == 0 {
            match rate {
                Some(rate) => println!("Epoch {epoch}/{epochs}: {rate:.0} images/s"),
                None => println!("Epoch {epoch}/{epochs}: trained before the restart"),
            }
            cli::print_test_line(loss, correct, n);
        }
        history.push(plot::Epoch {
            epoch,
            train_loss,
            test_loss: loss / n.max(1) as f64,
            test_accuracy: 100.0 * correct as f64 / n.max(1) as f64,
        });
    }
    if rank == 0 {
        println!("Finished in {:.1}s", started.elapsed().as_secs_f64());
        if let Some(path) = &args.train.save {
            checkpoint::save_varmap(model.varmap(), path)
                .with_context(|| format!("saving the model to {}", path.display()))?;
            println!("Saved the model to {}", path.display());
        }
        if let Some(path) = &args.train.plot {
            draw(path, args, pg, device, &data, &history)?;
        }
    }
    // Nobody leaves before rank 0 has saved.
    pg.barrier()?;
    Ok(())
}

/// Rank 0's chart of the run's epochs.
fn draw(
    path: &std::path::Path,
    args: &Args,
    pg: &ProcessGroup,
    device: &Device,
    data: &candle_parallel::cifar::Cifar10,
    history: &[plot::Epoch],
) -> Result<()> {
    let world = pg.world_size();
    let s = if world == 1 { "" } else { "es" };
    let on = if device.is_cpu() {
        format!("{world} process{s} on {}", plot::cpu_description())
    } else {
        format!("{world} process{s}, one per {}", plot::gpu_name())
    };
    let net = if args.batch_norm { "NetBn" } else { "Net" };
    let subtitle = format!(
        "{on}, {net}\n{}; batch {} per rank, SGD lr {}, momentum {}",
        args.train.data_name(data),
        args.batch_size,
        args.train.lr,
        args.train.momentum
    );
    let title = "cifar_ddp: the CIFAR-10 tutorial Net under DistributedDataParallel";
    plot::training_chart(path, title, &subtitle, history)?;
    println!("Drew the chart to {}", path.display());
    Ok(())
}

/// How the training loop checkpoints, and watches its losses.
struct Training<'a> {
    checkpoints: Option<&'a ResumeDir>,
    every: u64,
    /// `None` with --allow-non-finite.
    finite: &'a mut Option<FiniteLoss>,
}

impl Training<'_> {
    /// One pass over this rank's share of the training set, from `at.position` on (a resumed
    /// epoch), keeping `at` up to date and checkpointing every `every` steps (after checking
    /// that no loss so far was NaN or infinite, as at the end); returns the whole job's
    /// throughput in images/s (`None` when a resumed epoch had no step left) and the training
    /// loss averaged over the images every rank trained on (NaN then).
    #[allow(clippy::too_many_arguments)]
    fn epoch<M: ModuleT>(
        &mut self,
        model: &DistributedDataParallel<M>,
        opt: &mut Sgd,
        train: &Split,
        sampler: &DistributedSampler,
        args: &Args,
        at: &mut Progress,
        device: &Device,
    ) -> Result<(Option<f64>, f64)> {
        let world = model.process_group().world_size();
        let leader = model.process_group().rank() == 0;
        let indices = sampler.indices();
        let skip = at.position.min(indices.len());
        let bar = cli::progress_bar(sampler.total_size(), at.epoch as usize, args.train.epochs)?;
        if !leader {
            bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        }
        bar.inc((skip * world) as u64);
        let started = Instant::now();
        // This rank's loss summed over its images, kept on the device so no step waits for it.
        let mut loss_sum = Tensor::zeros((), DType::F32, device)?;
        for batch in indices[skip..].chunks(args.batch_size) {
            let (images, labels) = train.batch(batch, device)?;
            let logits = model.forward_t(&images, true)?;
            let loss = loss::cross_entropy(&logits, &labels)?;
            let grads = model.backward(&loss)?;
            opt.step(&grads)?;
            loss_sum = (loss_sum + (loss.detach() * batch.len() as f64)?)?;
            at.step += 1;
            if let Some(f) = self.finite.as_mut() {
                f.observe(&loss, at.step)?;
            }
            at.position += batch.len();
            // Every rank takes a step of the same size: the job's images.
            bar.inc((batch.len() * world) as u64);
            if let Some(c) = self
                .checkpoints
                .filter(|_| at.step.is_multiple_of(self.every))
            {
                if let Some(f) = self.finite.as_ref() {
                    f.check()?;
                }
                let folder = c.save(at, |path| model.save_checkpoint(opt, path))?;
                if leader {
                    bar.suspend(|| {
                        println!(
                            "Checkpoint at step {} saved to {}",
                            at.step,
                            folder.display()
                        )
                    });
                }
            }
        }
        if let Some(f) = self.finite.as_ref() {
            f.check()?;
        }
        // Reading the summed loss waits for the device, so the time covers all the work.
        let loss_sum = f64::from(loss_sum.to_scalar::<f32>()?);
        let seconds = started.elapsed().as_secs_f64();
        bar.finish_and_clear();
        let trained = indices.len() - skip;
        if trained == 0 {
            // Every rank resumed past this epoch's training (their shares are equally long).
            return Ok((None, f64::NAN));
        }
        let sums = Tensor::new(&[loss_sum, trained as f64], device)?;
        let sums = model
            .process_group()
            .all_reduce(&sums, ReduceOp::Sum)?
            .to_vec1::<f64>()?;
        Ok((Some((trained * world) as f64 / seconds), sums[0] / sums[1]))
    }
}

/// The summed cross-entropy, the number classified correctly and the number of test images,
/// over the whole test set: each rank evaluates every `world`-th image (no padding, so none
/// twice), and the sums are all-reduced.
fn evaluate<M: ModuleT>(
    model: &DistributedDataParallel<M>,
    pg: &ProcessGroup,
    test: &Split,
    device: &Device,
) -> Result<(f64, usize, usize)> {
    let (rank, world) = (pg.rank(), pg.world_size());
    let mine: Vec<usize> = (rank..test.len()).step_by(world).collect();
    let (mut loss_sum, mut correct) = (0f64, 0usize);
    for batch in mine.chunks(EVAL_BATCH) {
        let (images, labels) = test.batch(batch, device)?;
        let (l, c) = cli::loss_and_correct(&model.forward_t(&images, false)?, &labels)?;
        loss_sum += l;
        correct += c;
    }
    let sums = Tensor::new(&[loss_sum, correct as f64, mine.len() as f64], device)?;
    let sums = pg.all_reduce(&sums, ReduceOp::Sum)?.to_vec1::<f64>()?;
    Ok((sums[0], sums[1] as usize, sums[2] as usize))
}
