//! Trains a small decoder-only transformer to sort digits, with DistributedDataParallel: one
//! process per device.
//!
//!     cargo run --release --example transformer_ddp                     # one process
//!     cargo run --release --example transformer_ddp -- --nproc 2         # spawns 2 CPU ranks
//!     candle-run --nproc-per-node 2 target/release/examples/transformer_ddp   # or torchrun, srun
//!     cargo run --release --example transformer_ddp --features cuda,nccl -- --nproc 8
//!
//! The task is embedded: each sample is 8 random digits, a separator, and the same digits in
//! ascending order (`examples/common/transformer.rs`); the training and held-out sets come from
//! `--seed` and share no sample. The model reads the digits and learns to write the sorted
//! ones; after each epoch rank 0 prints the mean training loss over the epoch (all ranks) and
//! the exact-match accuracy on the held-out set, by greedy decoding: the model writes all 8
//! digits from its own previous ones, and a sample counts only if all 8 are right.
//!
//! Training follows torch's DDP conventions: `--batch-size` is per rank, each rank trains on its
//! `DistributedSampler` share (reshuffled every epoch), `--accumulate K` sums K micro-batches
//! under `no_sync` before one all-reduce and one step. The optimizer is candle-nn's AdamW with a
//! linear warm-up and a cosine decay of the learning rate, per step. One process and N processes
//! with the same global batch (`--batch-size` times N times K) take the same steps and print the
//! same losses, to float noise.
//!
//! `--sharding` chooses what each rank keeps: everything (`none`, DDP), a shard of the gradients
//! and optimizer state (`zero2`, ZeRO-2 inside DDP), or a shard of the parameters too (`full`,
//! FullyShardedDataParallel, each block a unit). The training loop is the same for all three.
//! The run ends with `memory per rank: parameters P MiB, gradients G MiB, optimizer O MiB, peak
//! RSS R MiB`, each the largest over the ranks. `--memory-budget MIB` checks first that what a
//! rank keeps (parameters, gradients, AdamW's two moments) fits: on 4 ranks,
//!
//!     cargo run --release --example transformer_ddp -- --nproc 4 --sharding full \
//!         --layers 8 --dim 256 --memory-budget 40 --epochs 1 --train-size 1024
//!
//! trains a model whose unsharded AdamW state (97 MiB) would not fit 40 MiB per rank.
//!
//! With `--checkpoint-dir DIR` (any sharding; under `--tensor-parallel`, none) the run saves a resumable checkpoint there every
//! `--checkpoint-every` steps (the model and AdamW's state as a distributed checkpoint, each
//! rank writing its own pieces, which any sharding at any world size loads; under f16 the
//! gradient scaler's; the epoch, the step and the position in the epoch) and, started again,
//! resumes from the last one by itself, so that under `candle-run --max-restarts N` a job that lost a rank ends with the
//! weights of a run that never stopped. With `--global-batch G` it also resumes at another
//! world size (an elastic job, `candle-run --nnodes MIN:MAX`, that lost or gained a machine):
//! the accumulation makes up for fewer ranks, the checkpoint's position is translated to the
//! new world (`ResumeDir::load_at_any_world`), and the run takes the same steps on the same
//! samples as one that never changed size, to float noise.
//!
//! `--tensor-parallel T` lays the processes out as a `[dp, tp]` mesh (`--nproc` a multiple of
//! T): each block's attention heads and MLP hidden features are cut over the T ranks of a
//! "tp" group (`candle_parallel::tensor_parallel`), and DDP (or ZeRO-2) runs along "dp", each
//! "dp" rank taking its share of the data. `--sequence-parallel` also splits the residual
//! stream along the sequence between those layers (the norms, the embeddings and the head run
//! on 1/T of the positions). The cut model starts from the one-process weights, takes the same
//! steps and prints the same losses, to float noise; `--save` puts the parts back together
//! into the one-process model's weights:
//!
//!     cargo run --release --example transformer_ddp -- --nproc 4 --tensor-parallel 2 \
//!         --sequence-parallel --batch-size 16
//!
//! For `scripts/torch_transformer_bench.py`: `--dump-step FILE` writes the initial weights, one
//! batch, its loss and every gradient, and exits; `--time-steps N` times N training steps (with
//! `--precision bf16`, through DDP on the one process, where mixed precision lives).

use anyhow::{Context, Result};
use candle_core::backprop::GradStore;
use candle_core::Var;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use candle_parallel::amp::{GradScaler, GradScalerConfig, MixedPrecision};
use candle_parallel::checkpoint::distributed::Checkpointer;
use candle_parallel::checkpoint::resume::{Progress, ResumeDir, Resumed};
use candle_parallel::checkpoint::LoadOptions;
use candle_parallel::ddp::{Compression, DdpConfig, NoSync, Sharding};
use candle_parallel::devices::gpu_count;
use candle_parallel::distributed::{DeviceMesh, ProcessGroup, ReduceOp, Rendezvous};
use candle_parallel::fsdp::FsdpNoSync;
use candle_parallel::init::seeded_var_builder;
use candle_parallel::launch::{self, LaunchConfig};
use candle_parallel::memory::{self, MemoryReport};
use candle_parallel::nn;
use candle_parallel::optim::{clip_grad_norm_parts, AdamW, AdamWConfig, FiniteLoss};
use candle_parallel::sampler::{DistributedSampler, SamplerConfig};
use candle_parallel::tensor_parallel::sum_sequence_parallel_gradients;
use candle_parallel::{checkpoint, DistributedDataParallel, FsdpConfig, FullyShardedDataParallel};
use clap::{Parser, ValueEnum};
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

#[path = "common/transformer.rs"]
mod transformer;

use transformer::{
    parallel_plan, sort_loss, sort_loss_at, Config, SortTask, TensorParallel, Transformer, Whole,
    VOCAB,
};

/// Train a small transformer to sort digits, with DistributedDataParallel.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Transformer blocks.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Width of the residual stream.
    #[arg(long, default_value_t = 64)]
    dim: usize,
    /// Attention heads (a divisor of --dim).
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Digits to sort per sample.
    #[arg(long, default_value_t = 8)]
    digits: usize,
    /// Passes over the training set.
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    /// Samples per micro-batch on each rank (torch's convention: the global batch is this times
    /// the number of processes times --accumulate).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Micro-batches whose gradients are summed (under `no_sync`) before each optimizer step.
    #[arg(long, default_value_t = 1)]
    accumulate: usize,
    /// Fix the global batch instead: each step accumulates G / (--batch-size x data-parallel
    /// ranks) micro-batches, so that a job resumed at another world size (`candle-run --nnodes
    /// MIN:MAX`) takes the same steps on the same samples (an error unless it divides).
    #[arg(long, value_name = "G", conflicts_with = "accumulate")]
    global_batch: Option<usize>,
    /// Peak learning rate of AdamW.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// AdamW's weight decay.
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Share of the optimizer steps spent warming the learning rate up linearly; a cosine decay
    /// to a tenth of --lr follows.
    #[arg(long, default_value_t = 0.05)]
    warmup: f64,
    /// Training samples.
    #[arg(long, default_value_t = 16_384)]
    train_size: usize,
    /// Held-out samples.
    #[arg(long, default_value_t = 1_000)]
    test_size: usize,
    /// Seed of the data, the initial weights and the shuffling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// How gradients travel between processes.
    #[arg(long, value_enum, default_value_t = Compress::None)]
    compression: Compress,
    /// What each rank keeps: everything (DDP), a shard of the gradients and optimizer state
    /// (ZeRO-2), or a shard of the parameters too (fully sharded, each block a unit).
    #[arg(long, value_enum, default_value_t = ShardingArg::None)]
    sharding: ShardingArg,
    /// Per-rank memory budget in MiB for what training keeps (parameters, gradients and AdamW's
    /// two moments): checked before training, which stops when the chosen sharding does not fit.
    #[arg(long)]
    memory_budget: Option<f64>,
    /// Ranks that share each block, cut inside (tensor parallel): the processes form a
    /// `[dp, tp]` mesh, DDP along "dp" (`--batch-size` is per "dp" rank).
    #[arg(long, default_value_t = 1)]
    tensor_parallel: usize,
    /// With --tensor-parallel: split the residual stream along the sequence between the cut
    /// layers (Megatron's sequence parallel; the sequence, 2 x --digits, must be a multiple of
    /// --tensor-parallel).
    #[arg(long)]
    sequence_parallel: bool,
    /// Processes to spawn when not started by candle-run, torchrun or srun (then this process
    /// is one rank of the job they started).
    #[arg(long, default_value_t = 1)]
    nproc: usize,
    /// Train on the CPU even when GPUs are available.
    #[arg(long)]
    cpu: bool,
    /// Keep resumable checkpoints in this folder (shared by every rank), and resume from the
    /// last one when it holds one (every sharding).
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Optimizer steps between two checkpoints (with --checkpoint-dir).
    #[arg(long, default_value_t = 100)]
    checkpoint_every: usize,
    /// Go on training when a step's loss is NaN or infinite (by default the run stops with an
    /// error naming the step, before it saves anything).
    #[arg(long)]
    allow_non_finite: bool,
    /// The dtype the model computes in (mixed precision: the weights and AdamW's state stay
    /// f32; f16 trains with a gradient scaler).
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    precision: Precision,
    /// The precision of the linear layers' f32 products (torch's
    /// `set_float32_matmul_precision`): `medium` lets them round their operands to bf16, on
    /// AMX tiles where the CPU has them (see candle_parallel::nn::MatmulPrecision).
    #[arg(long, value_enum, default_value_t = MatmulArg::Highest)]
    matmul_precision: MatmulArg,
    /// Clip the gradients' total 2-norm (over every rank's shard) to this before each step.
    #[arg(long, value_name = "N")]
    clip_grad_norm: Option<f64>,
    /// The gradient scaler's initial scale under f16 (torch's `init_scale`).
    #[arg(long, default_value_t = 65536.0)]
    init_scale: f64,
    /// Drop each block's activations in forward and recompute them in backward (activation
    /// checkpointing); with K, every K-th block only.
    #[arg(long, value_name = "K", num_args = 0..=1, default_missing_value = "1")]
    activation_checkpointing: Option<usize>,
    /// Save the trained weights here (safetensors, plain variable names; rank 0).
    #[arg(long)]
    save: Option<PathBuf>,
    /// Write the initial weights (`param.NAME`), the first batch (`tokens`, `answers`), its loss
    /// (`loss`) and every gradient (`grad.NAME`) to this safetensors file, and exit (one
    /// process only). `scripts/torch_transformer_bench.py --parity FILE` checks them.
    #[arg(long)]
    dump_step: Option<PathBuf>,
    /// Time this many training steps on one batch (one process, no DDP), print the tokens/s,
    /// and exit.
    #[arg(long)]
    time_steps: Option<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ShardingArg {
    None,
    Zero2,
    Full,
}

impl std::fmt::Display for ShardingArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::None => "none",
            Self::Zero2 => "zero2",
            Self::Full => "full",
        })
    }
}

/// The dtype the model computes in; the weights and AdamW's state stay f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Precision {
    F32,
    /// bf16 compute, f32 gradient averaging (torchtitan's default).
    Bf16,
    /// f16 compute, f32 gradient averaging, with a gradient scaler.
    F16,
}

/// `--matmul-precision`, torch's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum MatmulArg {
    Highest,
    Medium,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Compress {
    None,
    Bf16,
    F16,
}

const EVAL_BATCH: usize = 500;

fn main() -> Result<()> {
    // The library's messages (rendezvous progress, DDP's warnings) go to stderr.
    candle_parallel::logging::init();
    // Freed tensor memory stays for the next step (see candle_parallel::memory).
    candle_parallel::memory::keep_freed_memory();
    // candle's elementwise ops on the calling thread, and the program on a worker of rayon's
    // pool, so that each split of a product starts on the training thread
    // (see candle_parallel::threads).
    candle_parallel::threads::one_pool();
    candle_parallel::threads::in_pool(run)
}

/// The program, on a worker of rayon's pool.
fn run() -> Result<()> {
    let args = Args::parse();
    nn::set_float32_matmul_precision(match args.matmul_precision {
        MatmulArg::Highest => nn::MatmulPrecision::Highest,
        MatmulArg::Medium => nn::MatmulPrecision::Medium,
    });
    anyhow::ensure!(args.batch_size > 0, "--batch-size must be at least 1");
    anyhow::ensure!(args.accumulate > 0, "--accumulate must be at least 1");
    anyhow::ensure!(args.nproc > 0, "--nproc must be at least 1");
    anyhow::ensure!(args.digits > 0, "--digits must be at least 1");
    anyhow::ensure!(args.train_size > 0, "--train-size must be at least 1");
    anyhow::ensure!(args.test_size > 0, "--test-size must be at least 1");
    anyhow::ensure!(
        (0.0..1.0).contains(&args.warmup),
        "--warmup {} is a share of the steps: at least 0, below 1",
        args.warmup
    );
    args.config().check().map_err(anyhow::Error::msg)?;
    args.check_tensor_parallel()?;
    anyhow::ensure!(
        args.checkpoint_every > 0,
        "--checkpoint-every must be at least 1 step"
    );
    // Rank 0 alone prints, so the ranks' lines need no prefix.
    let config = LaunchConfig {
        nproc_per_node: args.nproc,
        prefix_output: false,
        ..LaunchConfig::default()
    };
    launch::spawn_with_config(&config, |_rank| rank_main(&args))?;
    Ok(())
}

impl Args {
    fn config(&self) -> Config {
        Config {
            vocab: VOCAB,
            max_len: 2 * self.digits,
            dim: self.dim,
            heads: self.heads,
            layers: self.layers,
            checkpoint_every: self.activation_checkpointing.unwrap_or(0),
        }
    }

    /// The flags that tensor parallel needs, or what to change.
    fn check_tensor_parallel(&self) -> Result<()> {
        let t = self.tensor_parallel;
        anyhow::ensure!(t > 0, "--tensor-parallel must be at least 1");
        anyhow::ensure!(
            !self.sequence_parallel || t > 1,
            "--sequence-parallel splits the sequence over the --tensor-parallel ranks: give \
             --tensor-parallel 2 or more"
        );
        if t == 1 {
            return Ok(());
        }
        anyhow::ensure!(
            self.heads.is_multiple_of(t) && self.dim.is_multiple_of(t),
            "--tensor-parallel {t} must divide --heads {} and --dim {}: each rank takes a share \
             of the heads and of the MLP's features",
            self.heads,
            self.dim
        );
        anyhow::ensure!(
            !self.sequence_parallel || (2 * self.digits).is_multiple_of(t),
            "--sequence-parallel over {t} ranks needs a sequence (2 x --digits = {}) that is a \
             multiple of {t}",
            2 * self.digits
        );
        anyhow::ensure!(
            self.sharding != ShardingArg::Full,
            "--tensor-parallel runs with --sharding none or zero2; fully sharded blocks that \
             are also cut inside (FSDP over \"dp\" of tensor-parallel parts) are not built yet"
        );
        anyhow::ensure!(
            self.checkpoint_dir.is_none() || self.sharding == ShardingArg::None,
            "--checkpoint-dir under --tensor-parallel takes --sharding none (a ZeRO-2 chunk \
             of a cut weight is no region of the whole one); or use --save, which puts the \
             parts back together"
        );
        anyhow::ensure!(
            self.dump_step.is_none() && self.time_steps.is_none(),
            "--dump-step and --time-steps run one process: drop --tensor-parallel"
        );
        Ok(())
    }

    fn mixed_precision(&self) -> MixedPrecision {
        match self.precision {
            Precision::F32 => MixedPrecision::default(),
            Precision::Bf16 => MixedPrecision::bf16(),
            Precision::F16 => MixedPrecision::f16(),
        }
    }

    fn compression(&self) -> Compression {
        match self.compression {
            Compress::None => Compression::None,
            Compress::Bf16 => Compression::Bf16,
            Compress::F16 => Compression::F16,
        }
    }

    fn adamw(&self) -> AdamWConfig {
        AdamWConfig {
            lr: self.lr,
            weight_decay: self.weight_decay,
            ..AdamWConfig::default()
        }
    }
}

/// This rank's device: its GPU (`LOCAL_RANK`) when there are GPUs, else the CPU.
fn device(args: &Args) -> Result<Device> {
    let gpus = if args.cpu { 0 } else { gpu_count() };
    if gpus == 0 {
        return Ok(Device::Cpu);
    }
    let local = Rendezvous::from_env()?.local_rank;
    // Without cudarc's per-buffer events (faster), except under full sharding: on NCCL it has
    // trained wrongly on such a device (issue 29; FullyShardedDataParallel warns).
    Ok(match args.sharding {
        ShardingArg::Full => Device::new_cuda_with_stream(local % gpus)?,
        _ => candle_parallel::devices::cuda_device(local % gpus)?,
    })
}

/// Linear warm-up over `warm` steps to `peak`, then a cosine decay to a tenth of it at step
/// `total` (steps count from 1).
fn learning_rate(peak: f64, step: usize, warm: usize, total: usize) -> f64 {
    if step <= warm {
        return peak * step as f64 / warm as f64;
    }
    let progress = (step - warm) as f64 / (total - warm).max(1) as f64;
    let min = 0.1 * peak;
    min + (peak - min) * 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos())
}

fn rank_main(args: &Args) -> Result<()> {
    let device = device(args)?;
    let pg = ProcessGroup::from_env(&device)?;
    let (rank, world) = (pg.rank(), pg.world_size());
    let (train, test) =
        SortTask::try_generate(args.digits, args.train_size, args.test_size, args.seed)
            .map_err(anyhow::Error::msg)?;
    let config = args.config();
    let t = args.tensor_parallel;
    anyhow::ensure!(
        world % t == 0,
        "--tensor-parallel {t} must divide the {world} processes: the mesh is [dp {world} / {t}, \
         tp {t}]"
    );
    // DDP along "dp"; each block cut over "tp".
    let (dp, tp) = match t {
        1 => (pg.clone(), None),
        _ => {
            let mesh = DeviceMesh::new(&pg, &[("dp", world / t), ("tp", t)])?;
            let tp = TensorParallel {
                group: mesh.get_group("tp")?.clone(),
                sequence_parallel: args.sequence_parallel,
            };
            (mesh.get_group("dp")?.clone(), Some(tp))
        }
    };
    let replicas = dp.world_size();
    let accumulate = match args.global_batch {
        None => args.accumulate,
        Some(g) => {
            let per_step = args.batch_size * replicas;
            anyhow::ensure!(
                g > 0 && g % per_step == 0,
                "--global-batch {g} is not a multiple of --batch-size {} x {replicas} \
                 data-parallel ranks = {per_step}: pick a global batch that every world size the \
                 job may run at divides",
                args.batch_size
            );
            g / per_step
        }
    };
    if let Some(steps) = args.time_steps {
        anyhow::ensure!(
            world == 1,
            "--time-steps measures one process: drop --nproc"
        );
        return time_steps(args, &pg, &train, steps, &device);
    }
    if rank == 0 {
        if world > 1 {
            println!("Let's use {world} processes!");
        }
        if t > 1 {
            let sp = match args.sequence_parallel {
                true => ", sequence parallel",
                false => "",
            };
            println!("Mesh [dp {replicas}, tp {t}]: each block cut over {t} ranks{sp}");
        }
        println!(
            "Transformer: {} layers, dim {}, {} heads, {} parameters; sorting {} digits, {} \
             training and {} held-out samples; global batch {}",
            args.layers,
            args.dim,
            args.heads,
            config.parameters(),
            args.digits,
            train.size(),
            test.size(),
            args.batch_size * replicas * accumulate
        );
    }
    check_budget(args, per_rank_parameters(&config, t), replicas, rank)?;
    let model = Model::new(args, &dp, tp.as_ref(), &device)?;
    if let (Model::Ddp(m), true, 0) = (&model, t > 1, rank) {
        let mine: usize = m
            .named_parameters()
            .iter()
            .map(|(_, v)| v.elem_count())
            .sum();
        println!(
            "Parameters per rank: {mine} of {} ({:.1}%)",
            config.parameters(),
            100.0 * mine as f64 / config.parameters() as f64
        );
    }
    let mut opt = AdamW::new(model.parameters(), args.adamw())?;
    let zero2 = args.sharding == ShardingArg::Zero2;
    let cut = Cut::new(&model, tp.as_ref(), &pg, &dp, zero2);
    // Under sequence parallel, the first of this rank's positions.
    let sp_start = match &tp {
        Some(tp) if tp.sequence_parallel => Some(tp.group.rank() * train.context() / t),
        _ => None,
    };
    let options = SamplerConfig {
        seed: args.seed,
        ..SamplerConfig::default()
    };
    let mut sampler = DistributedSampler::for_group(train.size(), &dp, options)?;
    if let Some(path) = &args.dump_step {
        anyhow::ensure!(
            world == 1,
            "--dump-step writes one process's step: drop --nproc"
        );
        let Model::Ddp(model) = &model else {
            anyhow::bail!("--dump-step writes a DDP step: drop --sharding");
        };
        return dump_step(model, &train, &sampler, args, path, &device);
    }

    let micro = args.batch_size;
    let steps_per_epoch = sampler.len().div_ceil(micro * accumulate);
    let total = steps_per_epoch * args.epochs;
    let warm = ((args.warmup * total as f64).round() as usize).max(1);
    let checkpoints = args
        .checkpoint_dir
        .as_ref()
        .map(|dir| ResumeDir::for_group(dir, &pg, &device));
    let mut at = Progress {
        epoch: 1,
        step: 0,
        position: 0,
        rng: None,
    };
    let mut scaler = match args.precision {
        Precision::F16 => Some(GradScaler::for_group(
            GradScalerConfig {
                init_scale: args.init_scale,
                ..GradScalerConfig::default()
            },
            &pg,
            &device,
        )?),
        _ => None,
    };
    if let Some(c) = &checkpoints {
        let load = |path: &std::path::Path| {
            model.load_checkpoint(&mut opt, path, tp.as_ref(), &pg, &device)?;
            match scaler.as_mut() {
                Some(s) => load_scaler(s, path),
                None => Ok(()),
            }
        };
        // With a fixed global batch, a checkpoint of another world size continues the same
        // steps; without, it is refused (the steps would differ).
        let resumed = match args.global_batch {
            Some(_) => c.load_at_any_world(load)?,
            None => c.load(load)?.map(|progress| Resumed {
                progress,
                saved_world: world,
            }),
        };
        if let Some(Resumed {
            progress: p,
            saved_world,
        }) = resumed
        {
            if rank == 0 {
                let from = match saved_world == world {
                    true => String::new(),
                    false => format!(", from a checkpoint of {saved_world} ranks"),
                };
                println!(
                    "Resumed at step {} (epoch {}, {} samples of each rank's share in{from})",
                    p.step, p.epoch, p.position
                );
            }
            at = p;
        }
    }
    let mut finite = match args.allow_non_finite {
        true => None,
        false => Some(FiniteLoss::new(&device)?),
    };
    let started = Instant::now();
    for epoch in at.epoch as usize..=args.epochs {
        sampler.set_epoch(epoch as u64);
        // A resumed epoch starts where its checkpoint was taken.
        at.position = if epoch as u64 == at.epoch {
            at.position
        } else {
            0
        };
        at.epoch = epoch as u64;
        let epoch_started = Instant::now();
        let indices = sampler.indices();
        let skip = at.position.min(indices.len());
        // Summed on the device: reading a loss each step would wait for the device each step.
        let mut loss_sum = Tensor::zeros((), DType::F32, &device)?;
        for chunk in indices[skip..].chunks(micro * accumulate) {
            at.step += 1;
            let step = at.step as usize;
            opt.set_learning_rate(learning_rate(args.lr, step, warm, total));
            let micros: Vec<&[usize]> = chunk.chunks(micro).collect();
            let k = micros.len() as f64;
            let mut grads = None;
            for (i, batch) in micros.iter().enumerate() {
                let (inputs, answers) = train.batch(batch, &device)?;
                // All but the last micro-batch sum their gradients locally.
                let _local = (i + 1 < micros.len()).then(|| model.no_sync());
                let logits = model.forward_t(&inputs, true)?;
                let loss = match sp_start {
                    Some(start) => sort_loss_at(&logits, &answers, start)?,
                    None => sort_loss(&logits, &answers)?,
                };
                let loss = (loss / k)?;
                let scaled = match &scaler {
                    Some(s) => s.scale(&loss)?,
                    None => loss.clone(),
                };
                grads = Some(model.backward(&scaled)?);
                loss_sum = (loss_sum + loss.detach())?;
                // Under f16 the scaler skips the steps whose gradients overflow instead.
                if let (Some(f), None) = (finite.as_mut(), &scaler) {
                    f.observe(&loss, at.step)?;
                }
            }
            let mut grads = grads.expect("a step has at least one micro-batch");
            let vars = opt.vars().to_vec();
            if let Some(s) = scaler.as_mut() {
                s.unscale(&mut grads, &vars)?;
            }
            cut.sum_sequence_parallel_gradients(&mut grads)?;
            if let Some(max) = args.clip_grad_norm {
                cut.clip_grad_norm(&model, &mut grads, max)?;
            }
            match scaler.as_mut() {
                Some(s) => {
                    s.step(&mut opt, &mut grads)?;
                    s.update();
                }
                None => opt.step(&grads)?,
            }
            at.position += chunk.len();
            if let Some(c) = &checkpoints {
                if step.is_multiple_of(args.checkpoint_every) {
                    if let Some(f) = finite.as_ref() {
                        f.check()?;
                    }
                    let folder = c.save(&at, |path| {
                        model.save_checkpoint(&opt, path, tp.as_ref(), &pg, &device)?;
                        match (&scaler, rank) {
                            (Some(s), 0) => save_scaler(s, path, &device),
                            _ => Ok(()),
                        }
                    })?;
                    if rank == 0 {
                        println!("Checkpoint at step {step} saved to {}", folder.display());
                    }
                }
            }
        }
        if let Some(f) = finite.as_ref() {
            f.check()?;
        }
        let loss_sum = f64::from(loss_sum.to_scalar::<f32>()?);
        // The steps and tokens of this epoch that this run trained (a resumed epoch has fewer;
        // every rank's share is equally long, so they agree).
        let steps = (indices.len() - skip).div_ceil(micro * accumulate);
        // Under sequence parallel each "tp" rank's loss covers its positions: they add up.
        let parts = if sp_start.is_some() { t as f64 } else { 1.0 };
        let loss = parts * all_reduce_mean(&pg, loss_sum / steps.max(1) as f64, &device)?;
        let seconds = epoch_started.elapsed().as_secs_f64();
        let tokens = ((indices.len() - skip) * replicas * train.context()) as f64;
        let (correct, n) = evaluate(&model, &dp, &test, &device)?;
        if rank == 0 {
            let lr = opt.learning_rate();
            match steps {
                0 => println!(
                    "Epoch {epoch}/{}: trained before the restart, lr {lr:.2e}",
                    args.epochs
                ),
                s if s < steps_per_epoch => println!(
                    "Epoch {epoch}/{}: train loss {loss:.6} over its last {s} of \
                     {steps_per_epoch} steps (resumed), lr {lr:.2e}, {:.0} tokens/s",
                    args.epochs,
                    tokens / seconds
                ),
                _ => println!(
                    "Epoch {epoch}/{}: train loss {loss:.6}, lr {lr:.2e}, {:.0} tokens/s",
                    args.epochs,
                    tokens / seconds
                ),
            }
            println!(
                "Held-out: exact match {correct}/{n} ({:.1}%), greedy decoding",
                100.0 * correct as f64 / n as f64
            );
        }
    }
    if rank == 0 {
        println!("Finished in {:.1}s", started.elapsed().as_secs_f64());
    }
    if let Some(path) = &args.save {
        // Every rank takes part in gathering the weights; rank 0 writes them.
        let weights = model.full_weights(tp.as_ref())?;
        if rank == 0 {
            checkpoint::save(&weights, path)
                .with_context(|| format!("saving the model to {}", path.display()))?;
            println!("Saved the model to {}", path.display());
        }
    }
    let report = MemoryReport {
        optimizer: memory::optimizer_state_bytes(&opt),
        ..model.memory_report()
    };
    let mib = |bytes: usize| bytes as f64 / (1 << 20) as f64;
    let mine = [
        report.parameters,
        report.gradients,
        report.optimizer,
        report.peak_rss.unwrap_or(0),
    ]
    .map(mib);
    let most = pg
        .all_reduce(&Tensor::new(&mine, &device)?, ReduceOp::Max)?
        .to_vec1::<f64>()?;
    if rank == 0 {
        println!(
            "memory per rank: parameters {:.2} MiB, gradients {:.2} MiB, optimizer {:.2} MiB, \
             peak RSS {:.1} MiB",
            most[0], most[1], most[2], most[3]
        );
    }
    // Nobody leaves before rank 0 has saved.
    pg.barrier()?;
    Ok(())
}

/// The mean of `value` over the ranks.
/// The gradient scaler's state beside a checkpoint's training state (`path`): without it an
/// f16 run would resume at the initial scale of 65536 and skip steps until it backed off again.
const SCALER_FILE: &str = "grad_scaler.safetensors";
/// The tensor-parallel parts of DDP's model, as a `VarMap` of its variables (the same ones).
fn parts_of(m: &DistributedDataParallel<Transformer>) -> VarMap {
    let varmap = VarMap::new();
    varmap
        .data()
        .lock()
        .expect("a fresh VarMap")
        .extend(m.named_parameters());
    varmap
}

/// The distributed checkpoint's folder in a checkpoint of `--checkpoint-dir`.
const STATE_DIR: &str = "state";

fn save_scaler(
    scaler: &GradScaler,
    path: &std::path::Path,
    device: &Device,
) -> candle_parallel::Result<()> {
    let (scale, growth) = scaler.state();
    let state = Tensor::new(&[scale, growth as f64], device)?;
    checkpoint::save(
        &HashMap::from([("scale_and_growth_tracker".to_string(), state)]),
        path.with_file_name(SCALER_FILE),
    )
}

fn load_scaler(scaler: &mut GradScaler, path: &std::path::Path) -> candle_parallel::Result<()> {
    let file = path.with_file_name(SCALER_FILE);
    if !file.exists() {
        log::warn!(
            "{} has no gradient scaler state (it was saved by a run without --precision f16): \
             the scale starts at its initial value",
            file.display()
        );
        return Ok(());
    }
    let tensors = checkpoint::read(&file)?;
    let state = tensors
        .get("scale_and_growth_tracker")
        .ok_or_else(|| candle_parallel::Error::InvalidArgument {
            what: "gradient scaler checkpoint",
            detail: format!("{} lacks scale_and_growth_tracker", file.display()),
        })?
        .to_device(&Device::Cpu)?
        .to_vec1::<f64>()?;
    match state[..] {
        [scale, growth] => scaler.load_state(scale, growth as u64),
        _ => Err(candle_parallel::Error::InvalidArgument {
            what: "gradient scaler checkpoint",
            detail: format!(
                "{}: expected 2 values, found {}",
                file.display(),
                state.len()
            ),
        }),
    }
}

fn all_reduce_mean(pg: &ProcessGroup, value: f64, device: &Device) -> Result<f64> {
    let t = Tensor::new(&[value], device)?;
    Ok(pg.all_reduce(&t, ReduceOp::Avg)?.to_vec1::<f64>()?[0])
}

/// While it lives, backwards sum gradients on this rank (DDP's or FSDP's `no_sync` guard).
#[allow(dead_code)] // held for its drop
enum Accumulating<'a> {
    Ddp(NoSync<'a>),
    Full(FsdpNoSync<'a>),
}

/// The model under the chosen sharding: DDP (none, ZeRO-2) or fully sharded. The training loop
/// is the same for each.
enum Model {
    Ddp(DistributedDataParallel<Transformer>),
    Full(FullyShardedDataParallel<Transformer>),
}

impl Model {
    fn new(
        args: &Args,
        pg: &ProcessGroup,
        tp: Option<&TensorParallel>,
        device: &Device,
    ) -> Result<Self> {
        let config = args.config();
        let cut = tp.cloned();
        let build = move |vb: VarBuilder| Transformer::new_parallel(config, vb, cut.clone());
        let varmap = VarMap::new();
        if args.sharding == ShardingArg::Full {
            // The same seeded weights, created unit by unit: no rank ever holds the whole model.
            let fsdp = FsdpConfig {
                seed: Some(args.seed),
                mixed_precision: args.mixed_precision(),
                ..FsdpConfig::default()
            };
            return Ok(Self::Full(FullyShardedDataParallel::with_config(
                &varmap, pg, device, fsdp, build,
            )?));
        }
        // Seeded initial weights; DDP makes every rank take rank 0's anyway.
        match tp {
            None => drop(build(seeded_var_builder(
                &varmap,
                args.seed,
                DType::F32,
                device,
            ))?),
            // The one-process model's, each rank keeping its parts.
            Some(tp) => {
                let whole = VarMap::new();
                Transformer::new(
                    config,
                    seeded_var_builder(&whole, args.seed, DType::F32, device),
                )?;
                let whole = whole.data().lock().unwrap().clone();
                let parts = parallel_plan().shard_all(
                    whole.iter().map(|(n, v)| (n.as_str(), v.as_tensor())),
                    &tp.group,
                )?;
                let mut data = varmap.data().lock().unwrap();
                for (name, part) in parts {
                    data.insert(name, Var::from_tensor(&part)?);
                }
            }
        }
        let ddp_config = DdpConfig {
            compression: args.compression(),
            sharding: match args.sharding {
                ShardingArg::Zero2 => Sharding::Zero2,
                _ => Sharding::None,
            },
            mixed_precision: args.mixed_precision(),
            ..DdpConfig::default()
        };
        Ok(Self::Ddp(DistributedDataParallel::with_config(
            &varmap, pg, device, ddp_config, build,
        )?))
    }

    fn parameters(&self) -> Vec<Var> {
        match self {
            Self::Ddp(m) => m.parameters(),
            Self::Full(m) => m.parameters(),
        }
    }

    fn forward_t(&self, xs: &Tensor, train: bool) -> candle_parallel::Result<Tensor> {
        match self {
            Self::Ddp(m) => m.forward_t(xs, train),
            Self::Full(m) => m.forward_t(xs, train),
        }
    }

    fn backward(&self, loss: &Tensor) -> candle_parallel::Result<GradStore> {
        match self {
            Self::Ddp(m) => m.backward(loss),
            Self::Full(m) => m.backward(loss),
        }
    }

    /// Clips the gradients' total 2-norm over the whole model (every rank's shard).
    fn clip_grad_norm(&self, grads: &mut GradStore, max: f64) -> candle_parallel::Result<f64> {
        match self {
            Self::Ddp(m) => m.clip_grad_norm(grads, max, 2.0, false),
            Self::Full(m) => m.clip_grad_norm(grads, max, 2.0, false),
        }
    }

    /// Local gradient accumulation.
    fn no_sync(&self) -> Accumulating<'_> {
        match self {
            Self::Ddp(m) => Accumulating::Ddp(m.no_sync()),
            Self::Full(m) => Accumulating::Full(m.no_sync()),
        }
    }

    /// Saves the training state as a distributed checkpoint in the folder `state` beside
    /// `path` (each rank its own pieces: nothing is gathered, and any layout at any world size
    /// loads it; under `--tensor-parallel`, each part as the box it is of the one-process
    /// weight).
    fn save_checkpoint(
        &self,
        opt: &AdamW,
        path: &std::path::Path,
        tp: Option<&TensorParallel>,
        pg: &ProcessGroup,
        device: &Device,
    ) -> candle_parallel::Result<()> {
        let state = match (self, tp) {
            (Self::Ddp(m), Some(tp)) => parallel_plan().state_dict(&parts_of(m), opt, &tp.group)?,
            (Self::Ddp(m), None) => m.state_dict(opt)?,
            (Self::Full(m), _) => m.state_dict(opt)?,
        };
        Checkpointer::for_group(path.with_file_name(STATE_DIR), pg, device).save(&state)
    }

    /// Loads what [`Model::save_checkpoint`] saved beside `path` (under any layout, at any
    /// world size), or the consolidated file at `path` that earlier versions saved.
    fn load_checkpoint(
        &self,
        opt: &mut AdamW,
        path: &std::path::Path,
        tp: Option<&TensorParallel>,
        pg: &ProcessGroup,
        device: &Device,
    ) -> candle_parallel::Result<()> {
        let checkpoints = Checkpointer::for_group(path.with_file_name(STATE_DIR), pg, device);
        if !checkpoints.exists() && path.exists() && tp.is_none() {
            return match self {
                Self::Ddp(m) => m.load_checkpoint(opt, path),
                Self::Full(m) => m.load_checkpoint(opt, path),
            };
        }
        let options = LoadOptions::default();
        match (self, tp) {
            (Self::Ddp(m), Some(tp)) => {
                parallel_plan().load_state_dict(&checkpoints, &parts_of(m), opt, &tp.group, options)
            }
            (Self::Ddp(m), None) => m.load_state_dict(opt, &checkpoints, options),
            (Self::Full(m), _) => m.load_state_dict(opt, &checkpoints, options),
        }
    }

    /// Every weight by name, whole: the one-process model's (every rank must call it).
    fn full_weights(&self, tp: Option<&TensorParallel>) -> Result<HashMap<String, Tensor>> {
        Ok(match self {
            Self::Ddp(m) => {
                m.gather_parameters()?;
                let named: Vec<(String, Tensor)> = m
                    .named_parameters()
                    .into_iter()
                    .map(|(n, v)| (n, v.as_tensor().clone()))
                    .collect();
                match tp {
                    Some(tp) => parallel_plan().gather(&named, &tp.group)?,
                    None => named.into_iter().collect(),
                }
            }
            Self::Full(m) => m.full_parameters()?.into_iter().collect(),
        })
    }

    /// What this rank keeps for the parameters and gradients, and its peak memory.
    fn memory_report(&self) -> MemoryReport {
        match self {
            Self::Full(m) => m.memory_report(),
            Self::Ddp(m) => {
                let full =
                    memory::tensor_bytes(m.named_parameters().iter().map(|(_, v)| v.as_tensor()));
                // Under ZeRO-2 the optimizer steps shards of their own, beside the model's
                // full parameters; the gradients it gets are the shards'.
                let stepped = memory::tensor_bytes(m.parameters().iter().map(|v| v.as_tensor()));
                let sharded = stepped != full;
                MemoryReport {
                    parameters: if sharded { full + stepped } else { full },
                    gradients: stepped,
                    optimizer: 0,
                    peak_rss: memory::peak_rss_bytes(),
                }
            }
        }
    }
}

/// The parameters each rank holds when each block is cut over `t` ranks: the replicated ones
/// whole, a `t`-th of each block's attention and MLP weights (the row-parallel biases whole).
fn per_rank_parameters(config: &Config, t: usize) -> usize {
    let d = config.dim;
    let cut = config.layers * (3 * d * d + 3 * d + d * d + 4 * d * d + 4 * d + 4 * d * d);
    config.parameters() - cut + cut / t
}

/// How the parameters lie over the "tp" ranks, for what tensor parallel adds to a step.
enum Cut {
    /// No tensor parallel.
    Whole,
    Parallel {
        tp: TensorParallel,
        /// The cut parameters (or, under ZeRO-2, their pieces) and the group over which their
        /// gradients are pieces: "tp", or under ZeRO-2 the whole mesh.
        cut: (Vec<Var>, ProcessGroup),
        /// The replicated ones, and the group over which their gradients are pieces: none, or
        /// under ZeRO-2 "dp".
        replicated: (Vec<Var>, Option<ProcessGroup>),
    },
}

impl Cut {
    fn new(
        model: &Model,
        tp: Option<&TensorParallel>,
        world: &ProcessGroup,
        dp: &ProcessGroup,
        zero2: bool,
    ) -> Self {
        let (Some(tp), Model::Ddp(m)) = (tp, model) else {
            return Self::Whole;
        };
        let plan = parallel_plan();
        let (mut cut, mut replicated) = (Vec::new(), Vec::new());
        for (name, var) in m.parameter_names().iter().zip(m.parameters()) {
            match plan.is_replicated(name) {
                true => replicated.push(var),
                false => cut.push(var),
            }
        }
        Self::Parallel {
            tp: tp.clone(),
            cut: (
                cut,
                if zero2 {
                    world.clone()
                } else {
                    tp.group.clone()
                },
            ),
            replicated: (replicated, zero2.then(|| dp.clone())),
        }
    }

    /// Under sequence parallel, sums the replicated parameters' gradients over "tp": each
    /// rank's covers its positions only.
    fn sum_sequence_parallel_gradients(&self, grads: &mut GradStore) -> Result<()> {
        if let Self::Parallel { tp, replicated, .. } = self {
            if tp.sequence_parallel {
                sum_sequence_parallel_gradients(grads, &replicated.0, &tp.group)?;
            }
        }
        Ok(())
    }

    /// Clips the gradients' total 2-norm over the whole model: under tensor parallel the cut
    /// parameters' pieces added over their group, the replicated ones counted once.
    fn clip_grad_norm(&self, model: &Model, grads: &mut GradStore, max: f64) -> Result<f64> {
        let Self::Parallel {
            cut, replicated, ..
        } = self
        else {
            return Ok(model.clip_grad_norm(grads, max)?);
        };
        let parts = [
            (&cut.0[..], Some(&cut.1)),
            (&replicated.0[..], replicated.1.as_ref()),
        ];
        Ok(clip_grad_norm_parts(grads, &parts, max, 2.0, false)?)
    }
}

/// What a rank keeps for training, in bytes, by sharding: parameters, gradients and AdamW's two
/// moments, f32, for `n` parameters over `world` ranks.
fn kept_bytes(sharding: ShardingArg, n: usize, world: usize) -> f64 {
    let (n, world) = (n as f64 * 4.0, world as f64);
    match sharding {
        ShardingArg::None => 4.0 * n,
        ShardingArg::Zero2 => n + 3.0 * n / world,
        ShardingArg::Full => 4.0 * n / world,
    }
}

/// Checks `--memory-budget` against what each sharding keeps per rank, says so (rank 0), and
/// fails when the chosen one does not fit.
fn check_budget(args: &Args, parameters: usize, world: usize, rank: usize) -> Result<()> {
    let Some(budget) = args.memory_budget else {
        return Ok(());
    };
    let mib = |b: f64| b / (1 << 20) as f64;
    let unsharded = mib(kept_bytes(ShardingArg::None, parameters, 1));
    let chosen = mib(kept_bytes(args.sharding, parameters, world));
    let fits = |need: f64| {
        if need <= budget {
            "fits"
        } else {
            "does not fit"
        }
    };
    if rank == 0 {
        println!(
            "Memory budget {budget:.2} MiB per rank: the full AdamW state (parameters, gradients, \
             2 moments) takes {unsharded:.2} MiB and {}; with --sharding {} over {world} \
             ranks each keeps {chosen:.2} MiB, which {}",
            fits(unsharded),
            args.sharding,
            fits(chosen)
        );
    }
    anyhow::ensure!(
        chosen <= budget,
        "--sharding {} keeps {chosen:.2} MiB per rank, over the --memory-budget of {budget:.2} \
         MiB: shard more (--sharding full), or use more ranks",
        args.sharding
    );
    Ok(())
}

/// The model in evaluation mode, for code written against `Module`.
struct Eval<'a>(&'a Model);

impl Module for Eval<'_> {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.0
            .forward_t(xs, false)
            .map_err(candle_parallel::Error::into_candle)
    }
}

/// How many held-out samples the model sorts exactly, and how many there are: each rank of
/// `pg` (the data-parallel ranks; the "tp" ranks of one decode the same samples together)
/// decodes every `world`-th sample (none twice), and the counts are all-reduced.
fn evaluate(
    model: &Model,
    pg: &ProcessGroup,
    test: &SortTask,
    device: &Device,
) -> Result<(usize, usize)> {
    let (rank, world) = (pg.rank(), pg.world_size());
    let mine: Vec<usize> = (rank..test.size()).step_by(world).collect();
    let mut correct = 0;
    // Every position, whatever the training forward splits.
    let whole = match model {
        Model::Ddp(m) => Some(m.module()),
        Model::Full(_) => None,
    };
    for batch in mine.chunks(EVAL_BATCH) {
        let (inputs, answers) = test.batch(batch, device)?;
        correct += match whole {
            Some(m) => test.exact_matches(&Whole(m), &inputs, &answers)?,
            None => test.exact_matches(&Eval(model), &inputs, &answers)?,
        };
    }
    let sums = Tensor::new(&[correct as f64, mine.len() as f64], device)?;
    let sums = pg.all_reduce(&sums, ReduceOp::Sum)?.to_vec1::<f64>()?;
    Ok((sums[0] as usize, sums[1] as usize))
}

/// One forward and backward on the first batch of epoch 1, written with the initial weights
/// for the PyTorch twin to redo.
fn dump_step(
    model: &DistributedDataParallel<Transformer>,
    train: &SortTask,
    sampler: &DistributedSampler,
    args: &Args,
    path: &PathBuf,
    device: &Device,
) -> Result<()> {
    let mut sampler = sampler.clone();
    sampler.set_epoch(1);
    let indices = sampler.indices();
    let batch = &indices[..args.batch_size.min(indices.len())];
    let (inputs, answers) = train.batch(batch, device)?;
    let mut out = HashMap::new();
    for (name, var) in model.parameter_names().iter().zip(model.parameters()) {
        out.insert(format!("param.{name}"), var.as_tensor().copy()?);
    }
    let loss = sort_loss(&model.forward_t(&inputs, true)?, &answers)?;
    let grads = model.backward(&loss)?;
    for (name, var) in model.parameter_names().iter().zip(model.parameters()) {
        let grad = grads
            .get(var.as_tensor())
            .with_context(|| format!("no gradient for {name}"))?;
        out.insert(format!("grad.{name}"), grad.clone());
    }
    // The shape, which the weights alone do not tell (the heads): layers, dim, heads, digits.
    let config = [args.layers, args.dim, args.heads, args.digits].map(|v| v as i64);
    out.insert("config".into(), Tensor::new(&config, device)?);
    out.insert("tokens".into(), inputs.to_dtype(DType::I64)?);
    out.insert("answers".into(), answers.to_dtype(DType::I64)?);
    out.insert("loss".into(), loss);
    checkpoint::save(&out, path).with_context(|| format!("writing {}", path.display()))?;
    println!(
        "Wrote the initial weights, a batch of {}, its loss {:.6} and {} gradients to {}",
        batch.len(),
        out["loss"].to_scalar::<f32>()?,
        model.parameters().len(),
        path.display()
    );
    Ok(())
}

/// Times `steps` training steps on one batch, after 3 untimed ones: plain steps (no DDP) in
/// f32; under `--precision bf16` or `f16`, DDP on this one process (`pg`) with that mixed
/// precision, which is where this crate's mixed precision lives (f32 weights and AdamW, bf16
/// compute, as `torch.autocast`). f16 runs without a loss scaler here.
fn time_steps(
    args: &Args,
    pg: &ProcessGroup,
    train: &SortTask,
    steps: usize,
    device: &Device,
) -> Result<()> {
    let varmap = VarMap::new();
    let config = args.config();
    let build = |vb: VarBuilder| Transformer::new(config, vb);
    let model = build(seeded_var_builder(&varmap, args.seed, DType::F32, device))?;
    let mixed = match args.precision {
        Precision::F32 => None,
        _ => Some(DistributedDataParallel::with_config(
            &varmap,
            pg,
            device,
            DdpConfig {
                mixed_precision: args.mixed_precision(),
                ..DdpConfig::default()
            },
            build,
        )?),
    };
    let mut opt = AdamW::new(varmap.all_vars(), args.adamw())?;
    let batch: Vec<usize> = (0..args.batch_size.min(train.size())).collect();
    let (inputs, answers) = train.batch(&batch, device)?;
    let mut step = || -> Result<Tensor> {
        match &mixed {
            None => {
                let loss = sort_loss(&model.forward(&inputs)?, &answers)?;
                opt.backward_step(&loss)?;
                Ok(loss)
            }
            Some(ddp) => {
                let loss = sort_loss(&ddp.forward_t(&inputs, true)?, &answers)?;
                opt.step(&ddp.backward(&loss)?)?;
                Ok(loss)
            }
        }
    };
    for _ in 0..3 {
        step()?;
    }
    let started = Instant::now();
    let mut loss = None;
    for _ in 0..steps {
        loss = Some(step()?);
    }
    if let Some(loss) = loss {
        loss.to_scalar::<f32>()?; // waits for the device
    }
    let seconds = started.elapsed().as_secs_f64();
    let tokens = (steps * batch.len() * train.context()) as f64;
    println!(
        "candle: {:.0} tokens/s training ({steps} steps of {} x {} tokens, {:.2} ms/step, {:?})",
        tokens / seconds,
        batch.len(),
        train.context(),
        1e3 * seconds / steps.max(1) as f64,
        args.precision
    );
    Ok(())
}
