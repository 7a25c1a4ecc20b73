//! Trains the digit-sorting transformer of `transformer_ddp` cut into pipeline stages, one
//! process per stage (`candle_parallel::pipeline`).
//!
//!     cargo run --release --example transformer_pp                          # one process
//!     cargo run --release --example transformer_pp -- --pipeline 2 --schedule 1f1b
//!     cargo run --release --example transformer_pp -- --pipeline 4 --layers 4 --plot pp.svg
//!
//! `--pipeline 1` trains the whole model in one process, exactly as `transformer_ddp` does in
//! one process (same data order, same AdamW, same learning-rate schedule): both print the same
//! `train loss` lines. `--pipeline N` spawns N CPU ranks (or runs under `candle-run`,
//! torchrun); rank r holds stage r: the embeddings and the first blocks on rank 0, the last
//! blocks, the final norm and the head on rank N - 1 ([`transformer::TransformerStage`]).
//! Each batch of `--batch-size` samples is cut into `--microbatches` micro-batches that flow
//! through the stages in the order `--schedule` gives (`gpipe`, `1f1b`, or
//! `interleaved` with `--stages-per-rank` stages per rank), and the step's gradients are the
//! whole batch's: the loss lines equal one process's, to float noise.
//!
//! The run ends with a table per rank (its stages, its parameters against the whole model's,
//! the share of the step it spent waiting against the schedule's theory, (p - 1) / (m + p - 1)
//! for GPipe and 1F1B), and with `memory per rank: parameters P MiB, gradients G MiB, optimizer
//! O MiB, peak RSS R MiB`, each the largest over the ranks. `--plot FILE.svg` draws the last
//! step: each rank's forwards and backwards by time. `--compare` first trains the whole model
//! in one process, alone, with the same flags, and prints the pipeline's tokens/s beside its.
//!
//! `--data-parallel D` and `--tensor-parallel T` add the other two dimensions of a
//! `[dp, pp, tp]` mesh (torchtitan's 3-D parallelism; `--pipeline` × D × T processes): each
//! stage's blocks are cut inside over the T ranks of a "tp" group
//! (`candle_parallel::tensor_parallel`, starting from the one-process weights), and D whole
//! pipelines train on their `DistributedSampler` shares (`--batch-size` each), averaging their
//! gradients along "dp" after each step. The losses stay one process's with the same global
//! batch:
//!
//!     cargo run --release --example transformer_pp -- --pipeline 2 --data-parallel 2 \
//!         --tensor-parallel 2 --batch-size 16     # 8 processes

use anyhow::{Context, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::Optimizer;
use candle_nn::VarMap;
use candle_parallel::distributed::{DeviceMesh, ProcessGroup, ReduceOp};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::launch::{self, LaunchConfig};
use candle_parallel::memory;
use candle_parallel::optim::{AdamW, AdamWConfig};
use candle_parallel::pipeline::{
    all_reduce_gradients, Computation, PipelineSchedule, PipelineStage, Schedule,
};
use candle_parallel::sampler::{DistributedSampler, SamplerConfig};
use clap::{Parser, ValueEnum};
use std::path::PathBuf;
use std::time::Instant;

#[path = "common/transformer.rs"]
mod transformer;

#[path = "common/plot.rs"]
mod plot;

use transformer::{
    parallel_plan, sort_loss, stage_blocks, Config, SortTask, Transformer, TransformerStage, VOCAB,
};

/// Train a small transformer to sort digits, cut into pipeline stages.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Pipeline ranks; 1 with no other parallelism trains the whole model in this process.
    #[arg(long, default_value_t = 1)]
    pipeline: usize,
    /// Whole pipelines training side by side on shares of the data ("dp" of the mesh).
    #[arg(long, default_value_t = 1)]
    data_parallel: usize,
    /// Ranks that share each stage's blocks, cut inside ("tp" of the mesh).
    #[arg(long, default_value_t = 1)]
    tensor_parallel: usize,
    /// The order of the micro-batches' forwards and backwards.
    #[arg(long, value_enum, default_value_t = ScheduleArg::OneFOneB)]
    schedule: ScheduleArg,
    /// Stages per rank under `--schedule interleaved`.
    #[arg(long, default_value_t = 2)]
    stages_per_rank: usize,
    /// Micro-batches per batch.
    #[arg(long, default_value_t = 4)]
    microbatches: usize,
    /// Transformer blocks.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Width of the residual stream.
    #[arg(long, default_value_t = 64)]
    dim: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Digits per sample.
    #[arg(long, default_value_t = 8)]
    digits: usize,
    /// Epochs.
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    /// Samples per batch of each pipeline (cut into micro-batches); the global batch is this
    /// times --data-parallel.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Peak learning rate of AdamW.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// AdamW's weight decay.
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Share of the steps spent warming the learning rate up.
    #[arg(long, default_value_t = 0.05)]
    warmup: f64,
    /// Training samples.
    #[arg(long, default_value_t = 16_384)]
    train_size: usize,
    /// Held-out samples the training set leaves out (as `transformer_ddp`'s, so that both
    /// train on the same samples).
    #[arg(long, default_value_t = 1_000)]
    test_size: usize,
    /// Seed of the data, the initial weights and the shuffling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Draw the last step's schedule (ranks by time) to this SVG file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// First train the whole model in one process with the same flags, alone, and print the
    /// pipeline's tokens/s beside its.
    #[arg(long)]
    compare: bool,
}

/// The one-process run's tokens/s, from the parent of the ranks (`--compare`).
const ONE_PROCESS_VAR: &str = "CP_PP_ONE_PROCESS_TOKENS_PER_S";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ScheduleArg {
    Gpipe,
    #[value(name = "1f1b")]
    OneFOneB,
    Interleaved,
}

impl Args {
    fn config(&self) -> Config {
        Config {
            vocab: VOCAB,
            max_len: 2 * self.digits,
            dim: self.dim,
            heads: self.heads,
            layers: self.layers,
            checkpoint_every: 0,
        }
    }

    fn schedule(&self) -> Schedule {
        match self.schedule {
            ScheduleArg::Gpipe => Schedule::GPipe,
            ScheduleArg::OneFOneB => Schedule::OneFOneB,
            ScheduleArg::Interleaved => Schedule::Interleaved1F1B {
                stages_per_rank: self.stages_per_rank,
            },
        }
    }
}

fn main() -> Result<()> {
    candle_parallel::logging::init();
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
    anyhow::ensure!(
        args.pipeline > 0 && args.data_parallel > 0 && args.tensor_parallel > 0,
        "--pipeline, --data-parallel and --tensor-parallel must be at least 1"
    );
    let t = args.tensor_parallel;
    anyhow::ensure!(
        args.heads % t == 0 && args.dim % t == 0,
        "--tensor-parallel {t} must divide --heads {} and --dim {}: each rank takes a share of \
         the heads and of the MLP's features",
        args.heads,
        args.dim
    );
    anyhow::ensure!(args.epochs > 0, "--epochs must be at least 1");
    anyhow::ensure!(
        args.batch_size >= args.microbatches,
        "--batch-size {} cannot make --microbatches {} of at least one sample",
        args.batch_size,
        args.microbatches
    );
    args.config().check().map_err(anyhow::Error::msg)?;
    if let Some(path) = &args.plot {
        plot::check_path(path)?;
    }
    if args.compare && std::env::var_os("RANK").is_none() {
        let tokens_per_s = one_process_tokens_per_s(&args)?;
        // The ranks inherit it.
        std::env::set_var(ONE_PROCESS_VAR, tokens_per_s.to_string());
    }
    let config = LaunchConfig {
        nproc_per_node: args.pipeline * args.data_parallel * args.tensor_parallel,
        prefix_output: false,
        ..LaunchConfig::default()
    };
    launch::spawn_with_config(&config, |_rank| rank_main(&args))?;
    Ok(())
}

/// Runs this program on the whole model in one process (the same flags otherwise) and returns
/// the tokens/s of its last epoch.
fn one_process_tokens_per_s(args: &Args) -> Result<f64> {
    let exe = std::env::current_exe()?;
    let flags = [
        ("--layers", args.layers.to_string()),
        ("--dim", args.dim.to_string()),
        ("--heads", args.heads.to_string()),
        ("--digits", args.digits.to_string()),
        ("--epochs", args.epochs.to_string()),
        (
            "--batch-size",
            (args.batch_size * args.data_parallel).to_string(),
        ),
        ("--lr", args.lr.to_string()),
        ("--weight-decay", args.weight_decay.to_string()),
        ("--warmup", args.warmup.to_string()),
        ("--train-size", args.train_size.to_string()),
        ("--test-size", args.test_size.to_string()),
        ("--seed", args.seed.to_string()),
    ];
    let mut cmd = std::process::Command::new(exe);
    for (flag, value) in flags {
        cmd.args([flag, value.as_str()]);
    }
    let out = cmd.output().context("running the one-process baseline")?;
    anyhow::ensure!(
        out.status.success(),
        "the one-process baseline failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .lines()
        .rev()
        .find_map(|l| {
            l.strip_suffix(" tokens/s")?
                .rsplit(' ')
                .next()?
                .parse()
                .ok()
        })
        .context("the one-process baseline printed no tokens/s")
}

/// `transformer_ddp`'s schedule: linear warm-up over `warm` steps to `peak`, then a cosine
/// decay to a tenth of it at step `total` (steps count from 1).
fn learning_rate(peak: f64, step: usize, warm: usize, total: usize) -> f64 {
    if step <= warm {
        return peak * step as f64 / warm as f64;
    }
    let progress = (step - warm) as f64 / (total - warm).max(1) as f64;
    let min = 0.1 * peak;
    min + (peak - min) * 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos())
}

/// What one rank trains: the whole model, or its stages of the pipeline.
enum Trainer {
    Whole(Transformer),
    Pipeline {
        stages: Vec<PipelineStage<TransformerStage>>,
        schedule: PipelineSchedule<fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>>,
    },
}

/// What a rank measured over an epoch's steps.
#[derive(Default)]
struct Measured {
    idle: Vec<f64>,
    spans: Vec<plot::Span>,
}

/// This rank's groups along the mesh's three dimensions.
struct Groups {
    /// None without data parallel.
    dp: Option<ProcessGroup>,
    pp: ProcessGroup,
    tp: Option<ProcessGroup>,
}

impl Groups {
    /// `[dp, pp, tp]` over `pg` (the pipelines' ranks along "pp"); without data or tensor
    /// parallel every rank is a pipeline rank.
    fn new(args: &Args, pg: &ProcessGroup) -> Result<Self> {
        let (d, t, world) = (args.data_parallel, args.tensor_parallel, pg.world_size());
        anyhow::ensure!(
            world % (d * t) == 0,
            "{world} processes do not make a [dp {d}, pp, tp {t}] mesh: start --pipeline x \
             --data-parallel x --tensor-parallel of them"
        );
        if d * t == 1 {
            return Ok(Self {
                dp: None,
                pp: pg.clone(),
                tp: None,
            });
        }
        let mesh = DeviceMesh::new(pg, &[("dp", d), ("pp", world / (d * t)), ("tp", t)])?;
        Ok(Self {
            dp: (d > 1).then(|| mesh.get_group("dp").cloned()).transpose()?,
            pp: mesh.get_group("pp")?.clone(),
            tp: (t > 1).then(|| mesh.get_group("tp").cloned()).transpose()?,
        })
    }
}

/// Stage `s` of `n` (of the transformer `config` describes) on this rank: the one-process
/// model's weights, cut over `tp` when there is one.
fn stage_module(
    config: Config,
    s: usize,
    n: usize,
    seed: u64,
    tp: Option<&ProcessGroup>,
    varmap: &VarMap,
) -> Result<TransformerStage> {
    let device = Device::Cpu;
    if let Some(tp) = tp {
        let whole = VarMap::new();
        TransformerStage::new(
            config,
            s,
            n,
            seeded_var_builder(&whole, seed, DType::F32, &device),
        )?;
        let whole = whole.data().lock().unwrap().clone();
        let parts = parallel_plan()
            .shard_all(whole.iter().map(|(n, v)| (n.as_str(), v.as_tensor())), tp)?;
        let mut data = varmap.data().lock().unwrap();
        for (name, part) in parts {
            data.insert(name, candle_core::Var::from_tensor(&part)?);
        }
    }
    let vb = seeded_var_builder(varmap, seed, DType::F32, &device);
    Ok(TransformerStage::new_parallel(config, s, n, vb, tp)?)
}

fn rank_main(args: &Args) -> Result<()> {
    let device = Device::Cpu;
    let world_pg = ProcessGroup::from_env(&device)?;
    let groups = Groups::new(args, &world_pg)?;
    let pg = groups.pp.clone();
    let (rank, world) = (pg.rank(), pg.world_size());
    let config = args.config();
    let (train, _) =
        SortTask::try_generate(args.digits, args.train_size, args.test_size, args.seed)
            .map_err(anyhow::Error::msg)?;
    let varmap = VarMap::new();
    let vb = seeded_var_builder(&varmap, args.seed, DType::F32, &device);
    let schedule = args.schedule();
    let n_stages = world * schedule.stages_per_rank();
    let whole = world == 1 && schedule.stages_per_rank() == 1 && groups.tp.is_none();
    let trainer = if whole {
        Trainer::Whole(Transformer::new(config, vb)?)
    } else {
        let stages = schedule
            .stages_of(world, rank)
            .into_iter()
            .map(|s| {
                let varmap = VarMap::new();
                let module =
                    stage_module(config, s, n_stages, args.seed, groups.tp.as_ref(), &varmap)?;
                Ok(PipelineStage::new(module, &varmap, s, n_stages, &pg)?)
            })
            .collect::<Result<Vec<_>>>()?;
        let loss: fn(&Tensor, &Tensor) -> candle_core::Result<Tensor> = sort_loss;
        let schedule = PipelineSchedule::new(schedule, args.microbatches, loss)?;
        Trainer::Pipeline { stages, schedule }
    };
    let params: Vec<candle_core::Var> = match &trainer {
        Trainer::Whole(_) => {
            let mut all: Vec<_> = varmap.data().lock().unwrap().clone().into_iter().collect();
            all.sort_by(|a, b| a.0.cmp(&b.0));
            all.into_iter().map(|(_, v)| v).collect()
        }
        Trainer::Pipeline { stages, .. } => stages.iter().flat_map(|s| s.parameters()).collect(),
    };
    let holds_last = match &trainer {
        Trainer::Whole(_) => true,
        Trainer::Pipeline { stages, .. } => stages.iter().any(|s| s.is_last()),
    };
    let (dp_size, t) = (args.data_parallel, args.tensor_parallel);
    // The rank that speaks for its pipeline: the first of "dp" and of "tp".
    let first = |g: &Option<ProcessGroup>| g.as_ref().is_none_or(|g| g.rank() == 0);
    let speaks = first(&groups.dp) && first(&groups.tp);
    if world_pg.rank() == 0 {
        let layout = match &trainer {
            Trainer::Whole(_) => "one process".to_string(),
            Trainer::Pipeline { schedule, .. } => format!(
                "{n_stages} stages on {world} processes, {:?}, {} micro-batches",
                schedule.schedule(),
                args.microbatches
            ),
        };
        let layout = match dp_size * t {
            1 => layout,
            _ => format!("mesh [dp {dp_size}, pp {world}, tp {t}]: {layout} per pipeline"),
        };
        println!(
            "Transformer: {} layers, dim {}, {} heads, {} parameters; sorting {} digits, {} \
             training samples; batch {}; {layout}",
            args.layers,
            args.dim,
            args.heads,
            config.parameters(),
            args.digits,
            train.size(),
            args.batch_size * dp_size
        );
    }
    let adamw = AdamWConfig {
        lr: args.lr,
        weight_decay: args.weight_decay,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::new(params.clone(), adamw)?;
    // Every rank takes the same order: the whole batch goes through the pipeline.
    let options = SamplerConfig {
        seed: args.seed,
        ..SamplerConfig::default()
    };
    let mut sampler = match &groups.dp {
        Some(dp) => DistributedSampler::for_group(train.size(), dp, options)?,
        None => DistributedSampler::new(train.size(), 1, 0, options)?,
    };
    let steps_per_epoch = sampler.len().div_ceil(args.batch_size);
    let total = steps_per_epoch * args.epochs;
    let warm = ((args.warmup * total as f64).round() as usize).max(1);
    let mut step = 0;
    let mut measured = Measured::default();
    let mut last_grads = 0;
    let mut last_tokens_per_s = 0.0;
    let started = Instant::now();
    for epoch in 1..=args.epochs {
        sampler.set_epoch(epoch as u64);
        let epoch_started = Instant::now();
        let mut loss_sum = 0f64;
        for chunk in sampler.indices().chunks(args.batch_size) {
            step += 1;
            opt.set_learning_rate(learning_rate(args.lr, step, warm, total));
            let (inputs, answers) = train.batch(chunk, &device)?;
            let grads = match &trainer {
                Trainer::Whole(model) => {
                    let loss = sort_loss(&model.forward(&inputs)?, &answers)?;
                    loss_sum += f64::from(loss.to_scalar::<f32>()?);
                    candle_parallel::nn::backward(&loss)?
                }
                Trainer::Pipeline { stages, schedule } => {
                    let refs: Vec<&PipelineStage<TransformerStage>> = stages.iter().collect();
                    let out = schedule.step(&refs, Some(&inputs), Some(&answers))?;
                    loss_sum += out.loss().map_or(0.0, f64::from);
                    if step > 1 {
                        measured.idle.push(out.idle_fraction());
                    }
                    measured.spans = out
                        .events
                        .iter()
                        .map(|e| plot::Span {
                            rank,
                            forward: e.action.computation == Computation::Forward,
                            microbatch: e.action.microbatch,
                            start_ms: e.start.as_secs_f64() * 1e3,
                            end_ms: e.end.as_secs_f64() * 1e3,
                        })
                        .collect();
                    out.grads
                }
            };
            let mut grads = grads;
            // The pipelines average their gradients along "dp".
            if let Some(dp) = &groups.dp {
                all_reduce_gradients(&mut grads, &params, dp)?;
            }
            last_grads = params
                .iter()
                .filter_map(|p| grads.get(p.as_tensor()))
                .map(|g| g.elem_count() * g.dtype().size_in_bytes())
                .sum();
            opt.step(&grads)?;
        }
        let seconds = epoch_started.elapsed().as_secs_f64();
        let tokens = (sampler.len() * dp_size * train.context()) as f64;
        last_tokens_per_s = tokens / seconds;
        if let (true, Some(dp)) = (holds_last, &groups.dp) {
            // The mean over the pipelines (the ranks of "dp" all hold the last stage).
            let sum = Tensor::new(&[loss_sum], &device)?;
            loss_sum = dp.all_reduce(&sum, ReduceOp::Avg)?.to_vec1::<f64>()?[0];
        }
        if holds_last && speaks {
            println!(
                "Epoch {epoch}/{}: train loss {:.6}, lr {:.2e}, {:.0} tokens/s",
                args.epochs,
                loss_sum / steps_per_epoch as f64,
                opt.learning_rate(),
                tokens / seconds
            );
        }
    }
    if let (true, true, Ok(one)) = (holds_last, speaks, std::env::var(ONE_PROCESS_VAR)) {
        let one: f64 = one.parse()?;
        println!(
            "tokens/s: {last_tokens_per_s:.0} in {} processes against {one:.0} in one \
             process ({:.2}x), the last epoch of each",
            world_pg.world_size(),
            last_tokens_per_s / one
        );
    }
    // Ranks print in turn, after the last loss line.
    world_pg.barrier()?;
    if world_pg.rank() == 0 {
        println!("Finished in {:.1}s", started.elapsed().as_secs_f64());
    }
    // One pipeline's table: the first along "dp" and "tp".
    if speaks {
        report(args, &pg, &trainer, &params, &measured)?;
    }
    let mib = |bytes: usize| bytes as f64 / (1 << 20) as f64;
    let mine = [
        memory::tensor_bytes(params.iter().map(|p| p.as_tensor())),
        last_grads,
        memory::optimizer_state_bytes(&opt),
        memory::peak_rss_bytes().unwrap_or(0),
    ]
    .map(mib);
    let most = world_pg
        .all_reduce(&Tensor::new(&mine, &device)?, ReduceOp::Max)?
        .to_vec1::<f64>()?;
    if world_pg.rank() == 0 {
        println!(
            "memory per rank: parameters {:.2} MiB, gradients {:.2} MiB, optimizer {:.2} MiB, \
             peak RSS {:.1} MiB",
            most[0], most[1], most[2], most[3]
        );
    }
    world_pg.barrier()?;
    Ok(())
}

/// Rank 0 prints a row per rank: its stages and blocks, its share of the parameters, its idle
/// share of a step (mean over the steps after the first) against the schedule's theory; and
/// draws the last step with `--plot`.
fn report(
    args: &Args,
    pg: &ProcessGroup,
    trainer: &Trainer,
    params: &[candle_core::Var],
    measured: &Measured,
) -> Result<()> {
    let Trainer::Pipeline { stages, schedule } = trainer else {
        return Ok(());
    };
    let (rank, world) = (pg.rank(), pg.world_size());
    let device = pg.device();
    let mine_params = params.iter().map(|p| p.elem_count()).sum::<usize>() as f64;
    let idle = measured.idle.iter().sum::<f64>() / measured.idle.len().max(1) as f64;
    let rows = pg.all_gather(&Tensor::new(&[mine_params, idle], device)?)?;
    let whole = args.config().parameters() as f64;
    let theory = schedule
        .schedule()
        .timeline(world, schedule.n_microbatches())?
        .bubble();
    // Every rank has as many computations: their spans travel in one all-gather.
    let flat: Vec<f64> = measured
        .spans
        .iter()
        .flat_map(|s| {
            [
                f64::from(u8::from(s.forward)),
                s.microbatch as f64,
                s.start_ms,
                s.end_ms,
            ]
        })
        .collect();
    let spans = pg.all_gather(&Tensor::from_vec(flat, measured.spans.len() * 4, device)?)?;
    if rank != 0 {
        return Ok(());
    }
    let n_stages = stages[0].num_stages();
    println!(
        "rank | stages | blocks | parameters      | idle (measured) | bubble (theory, {:?}, p {world}, m {})",
        schedule.schedule(),
        schedule.n_microbatches()
    );
    let mut measured_mean = 0.0;
    for (r, row) in rows.iter().enumerate() {
        let row = row.to_vec1::<f64>()?;
        let owned = schedule.schedule().stages_of(world, r);
        let blocks: Vec<String> = owned
            .iter()
            .map(|&s| {
                let b = stage_blocks(args.layers, s, n_stages);
                format!("{}..{}", b.start, b.end)
            })
            .collect();
        println!(
            "{r:>4} | {:>6} | {:>6} | {:>7} ({:>4.1}%) | {:>14.1}% | {:>5.1}%",
            owned
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(","),
            blocks.join(","),
            row[0],
            100.0 * row[0] / whole,
            100.0 * row[1],
            100.0 * theory
        );
        measured_mean += row[1] / world as f64;
    }
    println!(
        "bubble: measured {:.1}% (mean over ranks) against {:.1}% in theory; parameters per \
         rank about 1/{} of {whole}",
        100.0 * measured_mean,
        100.0 * theory,
        world * args.tensor_parallel
    );
    if let Some(path) = &args.plot {
        let mut all = Vec::new();
        for (r, t) in spans.iter().enumerate() {
            let v = t.to_vec1::<f64>()?;
            all.extend(v.chunks(4).map(|c| plot::Span {
                rank: r,
                forward: c[0] > 0.5,
                microbatch: c[1] as usize,
                start_ms: c[2],
                end_ms: c[3],
            }));
        }
        let title = format!(
            "{:?}: {} stages on {world} processes, {} micro-batches",
            schedule.schedule(),
            n_stages,
            schedule.n_microbatches()
        );
        let subtitle = format!(
            "the last training step of transformer_pp ({} layers, dim {}); measured idle {:.0}%, \
             theory {:.0}%; {}",
            args.layers,
            args.dim,
            100.0 * measured_mean,
            100.0 * theory,
            plot::cpu_description()
        );
        plot::schedule_chart(path, &title, &subtitle, &all)
            .with_context(|| format!("drawing {}", path.display()))?;
        println!("Wrote the schedule chart to {}", path.display());
    }
    Ok(())
}
