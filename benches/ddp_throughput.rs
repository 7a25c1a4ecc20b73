//! DistributedDataParallel's training throughput against one process, its overhead, and how
//! much of its communication hides behind backward.
//!
//!     cargo bench --bench ddp_throughput
//!     cargo bench --bench ddp_throughput -- --models net --procs 2,4 --steps 30 --repeat 5
//!     cargo bench --bench ddp_throughput -- --models net,big --plot ddp_scaling.svg
//!     cargo bench --bench ddp_throughput -- --models tf,bignn --in-pool
//!
//! For each model (the CIFAR-10 tutorial `Net`; `big`, an MLP of 25.2 M parameters, where
//! communication matters; `bignn`, the same MLP after the swap of `docs/CPU_SPEED.md`; and
//! `tf`, the transformer of `examples/transformer_ddp.rs` at 8 blocks of width 512, 25.2 M parameters in 102 tensors, where bucketing and overlap matter)
//! and one global batch, every setup runs in processes of its own, one after the other, in
//! this one run:
//!
//! - one plain process (no DDP) with 1 and with 2 compute threads (`RAYON_NUM_THREADS`);
//! - DDP on 1 process (1 thread), and its overhead: plain and DDP steps in one process, in
//!   alternating rounds, the median ratio of their step times;
//! - N plain processes side by side, each on its share of the batch, with no communication:
//!   what N processes could reach on this machine;
//! - DDP on N processes of 1 thread each, the global batch split among them: the job's
//!   images/s against one 2-thread process, and how much of the all-reduce hid behind backward,
//!   measured two ways against the all-reduce alone (every bucket all-reduced as DDP does it,
//!   with nothing else running): the time from the end of autograd until the last bucket is
//!   reduced (which includes waiting for a slower rank), and the step time over that of the N
//!   processes without communication;
//! - for `big`, DDP on 2 processes with other bucket sizes.
//!
//! With `--in-pool` every job runs as `transformer_ddp` does: on a worker of rayon's pool, with
//! candle's elementwise ops on the calling thread (`candle_parallel::threads`).
//! With `--precision bf16` every job is DDP with `MixedPrecision::bf16()` (bf16 compute, f32
//! weights and optimizer): on 1 process with 1 and 2 threads, then on each `--procs` count
//! (`scripts/torch_ddp_bench.py --precision bf16` runs PyTorch's under `torch.autocast`). Build
//! it with the CPU's bf16 features (`docs/CPU_SPEED.md`) where it has them.
//! With `--cuda` (and the `cuda,nccl` features) the jobs compute on GPU 0 and DDP runs on NCCL:
//! only the one-process rows, as one GPU holds one NCCL rank. `scripts/torch_ddp_bench.py`
//! measures PyTorch on the same models and setups. With `--plot FILE.svg`, also draws each
//! model's DDP images/s against the process count (1 process, then `--procs`) beside its ideal
//! linear line. Reports; asserts nothing.

mod common;
#[path = "../examples/common/plot.rs"]
mod plot;
#[path = "../examples/common/transformer.rs"]
mod transformer;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::{loss, ModuleT, Optimizer, VarBuilder, VarMap};
use candle_parallel::amp::MixedPrecision;
use candle_parallel::cifar::{Net, NetBn};
use candle_parallel::ddp::DdpConfig;
use candle_parallel::distributed::{ProcessGroup, ReduceOp};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::launch::{self, LaunchConfig};
use candle_parallel::optim::Sgd;
use candle_parallel::DistributedDataParallel;
use common::{big, big_batch, big_nn, SGD};
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use transformer::{sort_loss, SortTask, Transformer};

/// The job a child process runs, passed in this variable.
const JOB_VAR: &str = "CP_BENCH_JOB";
/// Where rank 0 of a job writes its numbers.
const OUT_VAR: &str = "CP_BENCH_OUT";
/// Set when the jobs run on GPU 0.
const CUDA_VAR: &str = "CP_BENCH_CUDA";
/// Set for the jobs by `--in-pool`.
const IN_POOL_VAR: &str = "CP_BENCH_IN_POOL";

/// The device a job computes on: GPU 0 under `--cuda`, else the CPU.
fn device() -> Result<Device> {
    Ok(if std::env::var_os(CUDA_VAR).is_some() {
        candle_parallel::devices::cuda_device(0)?
    } else {
        Device::Cpu
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Model {
    Net,
    /// The Net with BatchNorm after each convolution (`cifar::NetBn`).
    NetBn,
    Big,
    /// `Big` after the swap to `candle_parallel::nn::{linear_relu, linear}` (docs/CPU_SPEED.md).
    BigNn,
    /// The transformer of `examples/transformer_ddp.rs`, 25.2 M parameters.
    Tf,
}

/// The transformer at 25.2 M parameters: 8 blocks of width 512, on the sorting task's 16
/// positions.
fn tf(vb: VarBuilder) -> candle_core::Result<Transformer> {
    let config = transformer::Config {
        vocab: transformer::VOCAB,
        max_len: 2 * TF_DIGITS,
        dim: 512,
        heads: 8,
        layers: 8,
        checkpoint_every: 0,
    };
    Transformer::new(config, vb)
}

/// Digits per sample of the transformer's sorting task.
const TF_DIGITS: usize = 8;

impl Model {
    fn parse(s: &str) -> Result<Self> {
        match s {
            "net" => Ok(Self::Net),
            "netbn" => Ok(Self::NetBn),
            "big" => Ok(Self::Big),
            "bignn" => Ok(Self::BigNn),
            "tf" => Ok(Self::Tf),
            other => bail!("unknown model {other:?}: net, netbn, big, bignn or tf"),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Net => "net",
            Self::NetBn => "netbn",
            Self::Big => "big",
            Self::BigNn => "bignn",
            Self::Tf => "tf",
        }
    }

    /// The global batch the setups split.
    fn global_batch(self) -> usize {
        match self {
            Self::Net | Self::NetBn => 128,
            Self::Big | Self::BigNn => 64,
            Self::Tf => 16,
        }
    }

    /// A batch of `n` inputs and labels, on `device`.
    fn batch(self, n: usize, device: &Device) -> Result<(Tensor, Tensor)> {
        if matches!(self, Self::Big | Self::BigNn) {
            return Ok(big_batch(n, device)?);
        }
        if self == Self::Tf {
            // Inputs (n, 16) and answers (n, 8) of the sorting task.
            let (task, _) = SortTask::generate(TF_DIGITS, n, 0, 0);
            let all: Vec<usize> = (0..n).collect();
            return Ok(task.batch(&all, device)?);
        }
        let x = Tensor::randn(0f32, 1.0, (n, 3, 32, 32), device)?;
        let y = Tensor::from_vec((0..n as u32).map(|i| i % 10).collect(), n, device)?;
        Ok((x, y))
    }

    /// The training loss of `logits` against `y`: cross-entropy over the classes, or for the
    /// transformer over the answer positions of the sorting task.
    fn loss(self, logits: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Tf => sort_loss(logits, y),
            _ => loss::cross_entropy(logits, y),
        }
    }
}

/// What a child runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Plain training, no DDP (in each process, independently).
    Plain,
    /// DDP training.
    Ddp,
    /// Plain and DDP training on one process, alternately: DDP's overhead.
    Overhead,
}

impl Kind {
    fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "plain" => Self::Plain,
            "ddp" => Self::Ddp,
            "overhead" => Self::Overhead,
            other => bail!("unknown job kind {other:?}"),
        })
    }

    fn name(self) -> &'static str {
        match self {
            Self::Plain => "plain",
            Self::Ddp => "ddp",
            Self::Overhead => "overhead",
        }
    }
}

/// What one child runs.
#[derive(Clone, Debug)]
struct Job {
    model: Model,
    kind: Kind,
    /// Images per process per step.
    batch: usize,
    bucket_mb: f64,
    /// DDP with `sync_batch_norm`.
    sync_bn: bool,
    /// DDP with `MixedPrecision::bf16()` (`--precision bf16`).
    bf16: bool,
    steps: usize,
    warmup: usize,
}

impl Job {
    fn encode(&self) -> String {
        format!(
            "{} {} {} {} {} {} {} {}",
            self.model.name(),
            self.kind.name(),
            self.batch,
            self.bucket_mb,
            self.sync_bn,
            self.bf16,
            self.steps,
            self.warmup
        )
    }

    fn decode(s: &str) -> Result<Self> {
        let f: Vec<&str> = s.split(' ').collect();
        anyhow::ensure!(f.len() == 8, "bad job {s:?}");
        Ok(Self {
            model: Model::parse(f[0])?,
            kind: Kind::parse(f[1])?,
            batch: f[2].parse()?,
            bucket_mb: f[3].parse()?,
            sync_bn: f[4].parse()?,
            bf16: f[5].parse()?,
            steps: f[6].parse()?,
            warmup: f[7].parse()?,
        })
    }
}

/// What rank 0 of a job measured.
#[derive(Clone, Copy, Debug, Default)]
struct Measured {
    /// The job's images per second (all processes).
    images_per_s: f64,
    /// Mean time from the end of autograd until the last bucket was reduced.
    tail: Duration,
    /// Every bucket all-reduced, one after the other, with nothing else running.
    comm_alone: Duration,
    /// DDP's step time over the plain step's, minus one (overhead jobs).
    overhead: f64,
}

impl Measured {
    /// The share of `cost` (of communication) that the all-reduce alone would take and that did
    /// not show.
    fn hidden(&self, cost: Duration) -> f64 {
        if self.comm_alone.is_zero() {
            return 0.0;
        }
        (1.0 - cost.as_secs_f64() / self.comm_alone.as_secs_f64()).clamp(0.0, 1.0)
    }

    /// What DDP's communication cost on top of `apart` (the same processes without any), and
    /// how it compares with the all-reduce alone.
    fn describe_comm(&self, apart: &Measured, batch: usize) -> String {
        let step = |m: &Measured| batch as f64 / m.images_per_s;
        let extra = Duration::from_secs_f64((step(self) - step(apart)).max(0.0));
        format!(
            "    all-reduce alone {:.1} ms; after autograd {:.1} ms (hidden {:.0}%); step time \
             over the processes without communication +{:.1} ms (hidden {:.0}%)",
            self.comm_alone.as_secs_f64() * 1e3,
            self.tail.as_secs_f64() * 1e3,
            100.0 * self.hidden(self.tail),
            extra.as_secs_f64() * 1e3,
            100.0 * self.hidden(extra)
        )
    }
}

/// Times `steps` calls of `step` after `warmup` untimed ones, until the device has run them.
fn timed(warmup: usize, steps: usize, mut step: impl FnMut() -> Result<()>) -> Result<Duration> {
    let device = device()?;
    for _ in 0..warmup {
        step()?;
    }
    device.synchronize()?;
    let started = Instant::now();
    for _ in 0..steps {
        step()?;
    }
    device.synchronize()?;
    Ok(started.elapsed())
}

/// A plain training step of `build`'s model on a fixed batch: forward, loss, backward, SGD.
fn plain_trainer<M: ModuleT>(
    job: &Job,
    build: fn(VarBuilder) -> candle_core::Result<M>,
) -> Result<impl FnMut() -> Result<()>> {
    let device = device()?;
    let varmap = VarMap::new();
    let model = build(seeded_var_builder(&varmap, 0, DType::F32, &device))?;
    let mut opt = Sgd::new(varmap.all_vars(), SGD)?;
    let (x, y) = job.model.batch(job.batch, &device)?;
    let kind = job.model;
    Ok(move || {
        let l = kind.loss(&model.forward_t(&x, true)?, &y)?;
        opt.backward_step(&l)?;
        Ok(())
    })
}

fn plain<M: ModuleT>(
    job: &Job,
    build: fn(VarBuilder) -> candle_core::Result<M>,
) -> Result<Measured> {
    let took = timed(job.warmup, job.steps, plain_trainer(job, build)?)?;
    Ok(Measured {
        images_per_s: (job.steps * job.batch) as f64 / took.as_secs_f64(),
        ..Measured::default()
    })
}

/// Plain and DDP steps on one process, in alternating rounds: the median of DDP's step time
/// over the plain one's.
fn overhead<M: ModuleT>(
    job: &Job,
    build: fn(VarBuilder) -> candle_core::Result<M>,
) -> Result<Measured> {
    let device = device()?;
    let pg = ProcessGroup::from_env(&device)?;
    let mut plain = plain_trainer(job, build)?;
    let varmap = VarMap::new();
    build(seeded_var_builder(&varmap, 0, DType::F32, &device))?;
    let model = DistributedDataParallel::new(&varmap, &pg, &device, build)?;
    let mut opt = Sgd::new(model.parameters(), SGD)?;
    let (x, y) = job.model.batch(job.batch, &device)?;
    let mut ddp = || -> Result<()> {
        let l = job.model.loss(&model.forward_t(&x, true)?, &y)?;
        opt.step(&model.backward(&l)?)?;
        Ok(())
    };
    let rounds = 7;
    let per_round = job.steps.div_ceil(3).max(1);
    let mut ratios = Vec::with_capacity(rounds);
    let (mut plain_total, mut ddp_total) = (Duration::ZERO, Duration::ZERO);
    for round in 0..rounds {
        let warm = if round == 0 { job.warmup } else { 0 };
        let p = timed(warm, per_round, &mut plain)?;
        let d = timed(warm, per_round, &mut ddp)?;
        ratios.push(d.as_secs_f64() / p.as_secs_f64());
        plain_total += p;
        ddp_total += d;
    }
    ratios.sort_by(f64::total_cmp);
    Ok(Measured {
        images_per_s: (rounds * per_round * job.batch) as f64 / ddp_total.as_secs_f64(),
        overhead: ratios[rounds / 2] - 1.0,
        ..Measured::default()
    })
}

fn ddp<M: ModuleT>(job: &Job, build: fn(VarBuilder) -> candle_core::Result<M>) -> Result<Measured> {
    let device = device()?;
    let pg = ProcessGroup::from_env(&device)?;
    let varmap = VarMap::new();
    build(seeded_var_builder(&varmap, 0, DType::F32, &device))?;
    let config = DdpConfig {
        bucket_cap_mb: job.bucket_mb,
        sync_batch_norm: job.sync_bn,
        mixed_precision: match job.bf16 {
            true => MixedPrecision::bf16(),
            false => MixedPrecision::default(),
        },
        ..DdpConfig::default()
    };
    let model = DistributedDataParallel::with_config(&varmap, &pg, &device, config, build)?;
    let mut opt = Sgd::new(model.parameters(), SGD)?;
    let (x, y) = job.model.batch(job.batch, &device)?;
    let mut tail = Duration::ZERO;
    let mut step = |count: bool| -> Result<()> {
        let l = job.model.loss(&model.forward_t(&x, true)?, &y)?;
        opt.step(&model.backward(&l)?)?;
        if count {
            tail += model.last_backward_stats().tail;
        }
        Ok(())
    };
    for _ in 0..job.warmup {
        step(false)?;
    }
    pg.barrier()?;
    let took = timed(0, job.steps, || step(true))?;
    // The buckets' all-reduces as DDP issues them, with nothing else running, over copies of
    // the parameters (tensors of zeros would be read from the kernel's one zero page, from
    // cache, and flatter the all-reduce).
    let buckets: Vec<Vec<Tensor>> = model
        .buckets()
        .iter()
        .map(|names| {
            let vars = varmap.data().lock().unwrap();
            names.iter().map(|n| vars[n].as_tensor().copy()).collect()
        })
        .collect::<candle_core::Result<_>>()?;
    let rounds = 5;
    pg.barrier()?;
    let comm = timed(1, rounds, || {
        let works = buckets
            .iter()
            .map(|b| pg.all_reduce_many_async(b, ReduceOp::Avg))
            .collect::<candle_parallel::Result<Vec<_>>>()?;
        for w in works {
            w.wait()?;
        }
        Ok(())
    })?;
    Ok(Measured {
        images_per_s: (job.steps * job.batch * pg.world_size()) as f64 / took.as_secs_f64(),
        tail: tail / job.steps as u32,
        comm_alone: comm / rounds as u32,
        overhead: 0.0,
    })
}

/// Runs the job named in the environment and writes this process's numbers.
fn child(job: &Job) -> Result<()> {
    let m = match (job.model, job.kind) {
        (Model::Net, Kind::Plain) => plain(job, Net::new)?,
        (Model::NetBn, Kind::Plain) => plain(job, NetBn::new)?,
        (Model::NetBn, Kind::Ddp) => ddp(job, NetBn::new)?,
        (Model::NetBn, Kind::Overhead) => overhead(job, NetBn::new)?,
        (Model::Big, Kind::Plain) => plain(job, big)?,
        (Model::BigNn, Kind::Plain) => plain(job, big_nn)?,
        (Model::Net, Kind::Ddp) => ddp(job, Net::new)?,
        (Model::Big, Kind::Ddp) => ddp(job, big)?,
        (Model::BigNn, Kind::Ddp) => ddp(job, big_nn)?,
        (Model::Net, Kind::Overhead) => overhead(job, Net::new)?,
        (Model::Big, Kind::Overhead) => overhead(job, big)?,
        (Model::BigNn, Kind::Overhead) => overhead(job, big_nn)?,
        (Model::Tf, Kind::Plain) => plain(job, tf)?,
        (Model::Tf, Kind::Ddp) => ddp(job, tf)?,
        (Model::Tf, Kind::Overhead) => overhead(job, tf)?,
    };
    let rank = std::env::var("RANK").map_or(0, |r| r.parse().unwrap_or(0));
    let out = std::env::var(OUT_VAR).context("no output file")?;
    std::fs::write(
        format!("{out}.{rank}"),
        format!(
            "{} {} {} {}",
            m.images_per_s,
            m.tail.as_secs_f64(),
            m.comm_alone.as_secs_f64(),
            m.overhead
        ),
    )?;
    Ok(())
}

/// Runs `job` on `procs` processes of `threads` compute threads each. For DDP, rank 0's
/// numbers (its images/s are the job's); for plain jobs, the processes' images/s summed.
fn run(job: &Job, procs: usize, threads: usize) -> Result<Measured> {
    let cuda = std::env::var_os(CUDA_VAR).is_some();
    let out = std::env::temp_dir().join(format!("cp-ddp-bench-{}", std::process::id()));
    let config = LaunchConfig {
        nproc_per_node: procs,
        prefix_output: false,
        env: vec![
            (JOB_VAR.into(), job.encode().into()),
            (OUT_VAR.into(), out.clone().into()),
            ("RAYON_NUM_THREADS".into(), threads.to_string().into()),
        ]
        .into_iter()
        .chain(cuda.then(|| (CUDA_VAR.into(), "1".into())))
        .collect(),
        ..LaunchConfig::default()
    };
    let exe = std::env::current_exe()?;
    launch::launch(&config, exe.as_os_str(), &[] as &[OsString])?;
    let mut all = Vec::new();
    for rank in 0..procs {
        let file = format!("{}.{rank}", out.display());
        let text = std::fs::read_to_string(&file).context("a process wrote no numbers")?;
        let _ = std::fs::remove_file(&file);
        let v: Vec<f64> = text.split(' ').map(str::parse).collect::<Result<_, _>>()?;
        all.push(Measured {
            images_per_s: v[0],
            tail: Duration::from_secs_f64(v[1]),
            comm_alone: Duration::from_secs_f64(v[2]),
            overhead: v[3],
        });
    }
    let mut m = all[0];
    if job.kind == Kind::Plain {
        m.images_per_s = all.iter().map(|m| m.images_per_s).sum();
    }
    Ok(m)
}

/// The run of `job` with the median images/s of `repeat` runs.
fn median_run(job: &Job, procs: usize, threads: usize, repeat: usize) -> Result<Measured> {
    let mut runs = (0..repeat)
        .map(|_| run(job, procs, threads))
        .collect::<Result<Vec<_>>>()?;
    runs.sort_by(|a, b| a.images_per_s.total_cmp(&b.images_per_s));
    Ok(runs[repeat / 2])
}

struct Options {
    models: Vec<Model>,
    procs: Vec<usize>,
    steps: Option<usize>,
    buckets: Vec<f64>,
    repeat: usize,
    cuda: bool,
    /// Whether the jobs run as `transformer_ddp` does: on a worker of rayon's pool, candle's
    /// elementwise ops on the calling thread (`candle_parallel::threads`).
    in_pool: bool,
    /// `--precision bf16`: every job is DDP with bf16 compute (f32 weights and optimizer), the
    /// one-process rows too; no plain rows (mixed precision lives in the wrappers).
    bf16: bool,
    /// Where to draw the scaling chart.
    plot: Option<PathBuf>,
}

fn parse() -> Result<Options> {
    let mut o = Options {
        models: vec![Model::Net, Model::NetBn, Model::Big, Model::Tf],
        procs: vec![2],
        steps: None,
        buckets: vec![1.0, 5.0, 25.0, 100.0],
        repeat: 3,
        cuda: false,
        in_pool: false,
        bf16: false,
        plot: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |flag: &str| args.next().with_context(|| format!("{flag} needs a value"));
        match a.as_str() {
            "--models" => {
                o.models = value("--models")?
                    .split(',')
                    .map(Model::parse)
                    .collect::<Result<_>>()?
            }
            "--procs" => {
                o.procs = value("--procs")?
                    .split(',')
                    .map(|p| Ok(p.parse::<usize>()?))
                    .collect::<Result<_>>()?
            }
            "--steps" => o.steps = Some(value("--steps")?.parse()?),
            "--repeat" => o.repeat = value("--repeat")?.parse()?,
            "--cuda" => o.cuda = true,
            "--in-pool" => o.in_pool = true,
            "--precision" => {
                o.bf16 = match value("--precision")?.as_str() {
                    "bf16" => true,
                    "f32" => false,
                    other => bail!("--precision is f32 or bf16, got {other:?}"),
                }
            }
            "--plot" => {
                let path = value("--plot")?;
                plot::check_path(path.as_ref())?;
                o.plot = Some(path.into());
            }
            "--buckets" => {
                o.buckets = value("--buckets")?
                    .split(',')
                    .map(|b| Ok(b.parse::<f64>()?))
                    .collect::<Result<_>>()?
            }
            "--bench" => {}
            other => bail!("unknown argument {other:?}"),
        }
    }
    anyhow::ensure!(o.repeat > 0, "--repeat must be at least 1");
    anyhow::ensure!(
        o.procs.iter().all(|&p| p >= 2),
        "--procs lists DDP process counts of at least 2 (1 is always measured)"
    );
    Ok(o)
}

fn main() -> Result<()> {
    // Freed tensor memory stays for the next step (see candle_parallel::memory).
    candle_parallel::memory::keep_freed_memory();
    if let Ok(job) = std::env::var(JOB_VAR) {
        let job = Job::decode(&job)?;
        if std::env::var_os(IN_POOL_VAR).is_some() {
            candle_parallel::threads::one_pool();
            return candle_parallel::threads::in_pool(|| child(&job));
        }
        return child(&job);
    }
    let o = parse()?;
    if o.cuda {
        // The jobs read it; one GPU holds one NCCL rank, so only the one-process rows run.
        std::env::set_var(CUDA_VAR, "1");
    }
    if o.in_pool {
        std::env::set_var(IN_POOL_VAR, "1");
    }
    let mut series = Vec::new();
    for &model in &o.models {
        let global = model.global_batch();
        let (steps, warmup) = match model {
            Model::Net | Model::NetBn => (o.steps.unwrap_or(30), 3),
            Model::Big | Model::BigNn | Model::Tf => (o.steps.unwrap_or(10), 2),
        };
        let job = |kind: Kind, batch: usize, bucket_mb: f64| Job {
            model,
            kind,
            batch,
            bucket_mb,
            sync_bn: false,
            bf16: o.bf16,
            steps,
            warmup,
        };
        let params = match model {
            Model::Net => "62,006",
            Model::NetBn => "62,050",
            Model::Big | Model::BigNn => "25.2 M",
            Model::Tf => "25.2 M",
        };
        println!(
            "\n{} ({params} parameters), global batch {global}, {}, {}; images/s are the \
             median of {} runs",
            model.name(),
            if o.bf16 { "bf16 compute" } else { "f32" },
            if o.cuda { "GPU 0, DDP on NCCL" } else { "CPU" },
            o.repeat
        );
        if model == Model::Tf {
            println!("(an image here is a sequence of {} tokens)", 2 * TF_DIGITS);
        }
        let runs = |kind, batch, procs, threads| {
            median_run(&job(kind, batch, 25.0), procs, threads, o.repeat)
        };
        if o.bf16 {
            // DDP only, on 1 process (1 and 2 threads) and on each process count.
            let one = runs(Kind::Ddp, global, 1, 1)?;
            let two = runs(Kind::Ddp, global, 1, 2)?;
            println!("{:<48} {:>9} {:>10}", "setup", "images/s", "vs 1 proc");
            let row = |label: String, m: &Measured| {
                let ratio = m.images_per_s / two.images_per_s;
                println!("{label:<48} {:>9.0} {ratio:>9.2}x", m.images_per_s);
            };
            row(format!("DDP, 1 process, 1 thread, batch {global}"), &one);
            row(format!("DDP, 1 process, 2 threads, batch {global}"), &two);
            for &p in if o.cuda { &[][..] } else { &o.procs[..] } {
                let each = global / p;
                let m = runs(Kind::Ddp, each, p, 1)?;
                row(
                    format!("DDP, {p} processes x 1 thread, batch {each} each"),
                    &m,
                );
            }
            continue;
        }
        let plain1 = runs(Kind::Plain, global, 1, 1)?;
        let plain2 = runs(Kind::Plain, global, 1, 2)?;
        let overhead = runs(Kind::Overhead, global, 1, 1)?;
        println!("{:<48} {:>9} {:>10}", "setup", "images/s", "vs 1 proc");
        let row = |label: String, m: &Measured| {
            println!(
                "{label:<48} {:>9.0} {:>9.2}x",
                m.images_per_s,
                m.images_per_s / plain2.images_per_s
            );
        };
        row(format!("1 process, 1 thread, batch {global}"), &plain1);
        row(format!("1 process, 2 threads, batch {global}"), &plain2);
        row(
            format!("DDP, 1 process, 1 thread, batch {global}"),
            &overhead,
        );
        let procs: &[usize] = if o.cuda { &[] } else { &o.procs };
        let mut points = vec![(1, overhead.images_per_s)];
        for &p in procs {
            let each = global / p;
            let apart = runs(Kind::Plain, each, p, 1)?;
            row(
                format!("{p} plain processes x 1 thread, {each} each (no comm)"),
                &apart,
            );
            let m = runs(Kind::Ddp, each, p, 1)?;
            row(
                format!("DDP, {p} processes x 1 thread, batch {each} each"),
                &m,
            );
            points.push((p as u32, m.images_per_s));
            println!("{}", m.describe_comm(&apart, global));
        }
        println!(
            "DDP overhead on 1 process: {:+.1}% step time against the plain step (median of 7 \
             alternating rounds in one process)",
            100.0 * overhead.overhead
        );
        series.push(plot::Series {
            name: format!("{}, {params} params, batch {global}", model.name()),
            points,
        });
        if model == Model::NetBn {
            for &p in procs {
                let sync = Job {
                    sync_bn: true,
                    ..job(Kind::Ddp, global / p, 25.0)
                };
                let m = median_run(&sync, p, 1, o.repeat)?;
                row(format!("DDP + SyncBatchNorm, {p} processes x 1 thread"), &m);
            }
        }
        if model == Model::Big && !o.cuda {
            let apart = runs(Kind::Plain, global / 2, 2, 1)?;
            println!("bucket size, DDP on 2 processes:");
            for &mb in &o.buckets {
                let m = median_run(&job(Kind::Ddp, global / 2, mb), 2, 1, o.repeat)?;
                println!("  {mb:>5} MiB: {:>6.0} images/s", m.images_per_s);
                println!("{}", m.describe_comm(&apart, global));
            }
        }
    }
    if let Some(path) = &o.plot {
        let on = if o.cuda {
            format!("GPU 0 ({}), NCCL", plot::gpu_name())
        } else {
            format!("CPU, {}", plot::cpu_description())
        };
        let tf = if o.models.contains(&Model::Tf) {
            format!("; tf's images are sequences of {} tokens", 2 * TF_DIGITS)
        } else {
            String::new()
        };
        let subtitle = format!(
            "{on}; 1 compute thread per process\nthe global batch split among the processes; \
             median of {} runs{tf}",
            o.repeat,
        );
        let chart = plot::Scaling {
            title: "DistributedDataParallel training throughput",
            subtitle: &subtitle,
            x_label: "processes",
            series: &series,
        };
        plot::scaling_chart(path, &chart)?;
        println!("Drew the chart to {}", path.display());
    }
    Ok(())
}
