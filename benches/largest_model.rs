//! The largest transformer that trains on 4 CPU ranks within a per-rank memory budget, and its
//! tokens/s: f32 DistributedDataParallel against bf16 + activation checkpointing + fully
//! sharded, ours beside PyTorch's same recipes (`scripts/torch_largest_model.py`: DDP, and FSDP2
//! `fully_shard` with `MixedPrecisionPolicy(bf16, f32)` and non-reentrant checkpointing, gloo),
//! every trial in processes of its own, ours and PyTorch's in turns within one run.
//!
//!     cargo bench --bench largest_model -- --plot docs/largest_model_loss.svg   # ~12 min
//!     cargo bench --bench largest_model -- --quick             # a smoke test, ~2 min
//!     cargo bench --bench largest_model -- --curves-only --plot FILE.svg   # no search
//!     cargo bench --bench largest_model -- --digits 32 --steps 5 --curve-size 2 \
//!         --curve-steps 300                  # longer sequences: not run on the 2-core machine
//!
//! The defaults are sized for the 2-core development machine, shared with other builds, where
//! 4 ranks already oversubscribe the cores: sequences of 32 tokens (`--digits 16`), 1 untimed
//! and 2 timed steps per trial, a budget of 192 MiB of training memory per rank, and 150 steps
//! of the smallest rung for the loss curves. That budget is the one where the two setups part:
//! f32 DDP fits 3.2 M parameters and stops at 6.3 M (both frameworks), bf16 + checkpointing +
//! fully sharded climbs on, to 6.3 M (PyTorch) and 25.2 M (ours; at 189-194 MiB, the budget's
//! edge: one run of three stopped at 14.2 M). The whole run takes 11-13 minutes; PyTorch's bf16
//! on this CPU is most of it (docs/BENCHMARKS.md has the tables). Longer sequences make the activations, which checkpointing
//! drops, a larger share of the memory, at several times the time.
//!
//! The model is `examples/common/transformer.rs` (GPT-style, pre-norm), the task its digit
//! sorting at `--digits` (sequences of 2 digits tokens), `--batch-size` samples per rank per
//! step. The search walks a ladder of sizes (`LADDER`: width and depth grow together, each rung
//! about 1.5-2x the parameters of the one before); at each rung every setup that still fits
//! runs one short trial (`--warmup` untimed steps, then `--steps` timed ones) in the order ours
//! f32 DDP, PyTorch f32 DDP, ours bf16, PyTorch bf16. A setup stops at its first rung that
//! passes the budget or fails; its largest model is the last rung before.
//!
//! Memory, per rank, from `/proc/self/status` (the table shows the largest over the ranks):
//! `peak RSS` is VmHWM, the process's whole peak; `training memory`, which the budget bounds,
//! is VmHWM minus the file-backed pages resident at the end (RssFile: code and read-only data
//! of the program and its libraries, shared by every rank) minus the anonymous and shared memory
//! resident before the model was built (RssAnon + RssShmem after start-up and the process
//! group). PyTorch's start-up alone takes about 290 MiB of anonymous memory and its libraries
//! 240 MiB more of file pages per rank, ours under 10 MiB: a budget on the whole RSS would
//! measure the interpreter, not the training. What PyTorch's runtime allocates in the first
//! step, whatever the model (about 95 MiB per rank at 0.8 M parameters, against ours 18-55),
//! does count: a real budget pays it too. A trial stops after the first warm-up step whose
//! training memory passes the budget.
//!
//! Then the loss curves: `--curve-steps` steps of the `--curve-size` rung (one every setup fits),
//! on the same batches (written for PyTorch to a safetensors file) from the same initial weights
//! (ours, seeded, saved for PyTorch to load), for each setup and framework, in turns; the
//! losses averaged over the ranks, per step. With `--plot FILE.svg` the four curves go on one
//! chart. Reports; asserts nothing.

#[path = "../examples/common/plot.rs"]
mod plot;
#[path = "../examples/common/transformer.rs"]
mod transformer;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use candle_parallel::amp::MixedPrecision;
use candle_parallel::ddp::DdpConfig;
use candle_parallel::distributed::{ProcessGroup, ReduceOp};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::launch::{self, LaunchConfig};
use candle_parallel::optim::{AdamW, AdamWConfig};
use candle_parallel::{checkpoint, DistributedDataParallel, FsdpConfig, FullyShardedDataParallel};
use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use transformer::{sort_loss, Config, SortTask, Transformer, VOCAB};

/// The trial a rank runs, passed in this variable.
const JOB_VAR: &str = "CP_LARGEST_JOB";
const MIB: f64 = (1 << 20) as f64;

/// The sizes the search walks: (layers, width, heads); the heads are 64 channels wide.
const LADDER: [(usize, usize, usize); 9] = [
    (4, 128, 2),
    (4, 256, 4),
    (8, 256, 4),
    (8, 384, 6),
    (8, 512, 8),
    (12, 512, 8),
    (12, 640, 10),
    (12, 768, 12),
    (16, 768, 12),
];

/// The two ways of training that the benchmark compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Setup {
    /// DistributedDataParallel in f32: every rank keeps everything.
    DdpF32,
    /// Fully sharded, bf16 compute with f32 gradient averaging and f32 master weights, every
    /// block's activations recomputed in backward.
    FsdpBf16Ckpt,
}

impl Setup {
    /// The name on the command line of PyTorch's twin, and in the trial's encoding.
    fn name(self) -> &'static str {
        match self {
            Self::DdpF32 => "ddp-f32",
            Self::FsdpBf16Ckpt => "fsdp-bf16-ckpt",
        }
    }

    fn parse(s: &str) -> Result<Self> {
        match s {
            "ddp-f32" => Ok(Self::DdpF32),
            "fsdp-bf16-ckpt" => Ok(Self::FsdpBf16Ckpt),
            other => bail!("unknown setup {other:?}"),
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::DdpF32 => "f32 DDP",
            Self::FsdpBf16Ckpt => "bf16 + checkpointing + fully sharded",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Framework {
    Ours,
    Torch,
}

/// One training run on `world` ranks.
#[derive(Clone, Debug)]
struct Trial {
    setup: Setup,
    layers: usize,
    dim: usize,
    heads: usize,
    digits: usize,
    /// Samples per rank per step.
    batch: usize,
    warmup: usize,
    steps: usize,
    /// MiB of training memory per rank; 0: none.
    budget: f64,
    world: usize,
    lr: f64,
    seed: u64,
    /// The batches, for PyTorch (ours generates the same from `seed`).
    data: PathBuf,
    /// The initial weights: ours starts from its seeded ones whatever this says, PyTorch loads
    /// them; `None` for the search, where PyTorch starts from its own.
    init: Option<PathBuf>,
    /// Where rank 0 writes the result line, and the losses (`.losses`).
    out: PathBuf,
}

impl Trial {
    fn config(&self) -> Config {
        Config {
            vocab: VOCAB,
            max_len: 2 * self.digits,
            dim: self.dim,
            heads: self.heads,
            layers: self.layers,
            checkpoint_every: usize::from(self.setup == Setup::FsdpBf16Ckpt),
        }
    }

    /// Samples the data file holds: every step's batch of every rank.
    fn samples(&self) -> usize {
        (self.warmup + self.steps) * self.world * self.batch
    }

    fn encode(&self) -> String {
        let init = self
            .init
            .as_ref()
            .map_or(String::new(), |p| p.display().to_string());
        [
            self.setup.name().to_string(),
            self.layers.to_string(),
            self.dim.to_string(),
            self.heads.to_string(),
            self.digits.to_string(),
            self.batch.to_string(),
            self.warmup.to_string(),
            self.steps.to_string(),
            self.budget.to_string(),
            self.world.to_string(),
            self.lr.to_string(),
            self.seed.to_string(),
            self.data.display().to_string(),
            init,
            self.out.display().to_string(),
        ]
        .join("\t")
    }

    fn decode(s: &str) -> Result<Self> {
        let f: Vec<&str> = s.split('\t').collect();
        anyhow::ensure!(f.len() == 15, "bad trial {s:?}");
        Ok(Self {
            setup: Setup::parse(f[0])?,
            layers: f[1].parse()?,
            dim: f[2].parse()?,
            heads: f[3].parse()?,
            digits: f[4].parse()?,
            batch: f[5].parse()?,
            warmup: f[6].parse()?,
            steps: f[7].parse()?,
            budget: f[8].parse()?,
            world: f[9].parse()?,
            lr: f[10].parse()?,
            seed: f[11].parse()?,
            data: f[12].into(),
            init: (!f[13].is_empty()).then(|| f[13].into()),
            out: f[14].into(),
        })
    }
}

/// What a trial measured (rank 0's line; memory the largest over the ranks).
#[derive(Clone, Debug, Default)]
struct Outcome {
    /// "ok", "over" (the budget) or "failed".
    status: String,
    error: String,
    parameters: usize,
    tokens_per_s: f64,
    training_mib: f64,
    peak_rss_mib: f64,
    baseline_mib: f64,
    /// The loss of every step (warm-up included), averaged over the ranks.
    losses: Vec<f64>,
}

impl Outcome {
    fn failed(error: impl std::fmt::Display) -> Self {
        Self {
            status: "failed".into(),
            error: error.to_string(),
            ..Self::default()
        }
    }

    fn fits(&self) -> bool {
        self.status == "ok"
    }

    /// Reads a `RESULT key=value ...` line.
    fn parse(line: &str) -> Result<Self> {
        let mut o = Self::default();
        let fields = line
            .trim()
            .strip_prefix("RESULT ")
            .with_context(|| format!("not a result line: {line:?}"))?;
        for field in fields.split(' ') {
            let (key, value) = field.split_once('=').unwrap_or((field, ""));
            match key {
                "status" => o.status = value.into(),
                "error" => o.error = value.replace('_', " "),
                "parameters" => o.parameters = value.parse()?,
                "tokens_per_s" => o.tokens_per_s = value.parse()?,
                "training_mib" => o.training_mib = value.parse()?,
                "peak_rss_mib" => o.peak_rss_mib = value.parse()?,
                "baseline_mib" => o.baseline_mib = value.parse()?,
                _ => {}
            }
        }
        anyhow::ensure!(!o.status.is_empty(), "no status in {line:?}");
        Ok(o)
    }

    /// The cell of a table: training memory, peak RSS and tokens/s, or why not.
    fn cells(&self) -> [String; 3] {
        match self.status.as_str() {
            "ok" => [
                format!("{:.0}", self.training_mib),
                format!("{:.0}", self.peak_rss_mib),
                format!("{:.0}", self.tokens_per_s),
            ],
            "over" => [
                format!("over ({:.0})", self.training_mib),
                format!("{:.0}", self.peak_rss_mib),
                "-".into(),
            ],
            _ => ["failed".into(), "-".into(), "-".into()],
        }
    }
}

/// The memory lines of `/proc/self/status`, in bytes: VmHWM, RssFile, RssAnon + RssShmem.
#[derive(Clone, Copy, Debug, Default)]
struct ProcMemory {
    peak: f64,
    file: f64,
    anon_and_shared: f64,
}

impl ProcMemory {
    fn now() -> Result<Self> {
        let status = std::fs::read_to_string("/proc/self/status")
            .context("reading /proc/self/status: the benchmark measures memory on Linux")?;
        let mut m = Self::default();
        for line in status.lines() {
            let Some((key, value)) = line.split_once(':') else {
                continue;
            };
            let kib = || -> f64 {
                let n = value.trim().trim_end_matches("kB").trim();
                n.parse::<f64>().unwrap_or(0.0) * 1024.0
            };
            match key {
                "VmHWM" => m.peak = kib(),
                "RssFile" => m.file = kib(),
                "RssAnon" | "RssShmem" => m.anon_and_shared += kib(),
                _ => {}
            }
        }
        Ok(m)
    }

    /// The training memory since `baseline` (the module docs say why it leaves out the file
    /// pages).
    fn training(&self, baseline: &ProcMemory) -> f64 {
        self.peak - self.file - baseline.anon_and_shared
    }
}

/// The model of a trial under its setup.
enum Model {
    Ddp(DistributedDataParallel<Transformer>),
    Full(FullyShardedDataParallel<Transformer>),
}

impl Model {
    fn new(trial: &Trial, pg: &ProcessGroup, device: &Device) -> Result<Self> {
        let config = trial.config();
        let build = move |vb: VarBuilder| Transformer::new(config, vb);
        let varmap = VarMap::new();
        // The loss curves start every run from the same weights; the search lets fully sharded
        // create its own, unit by unit, so that no rank ever holds the whole model.
        if trial.setup == Setup::DdpF32 || trial.init.is_some() {
            build(seeded_var_builder(&varmap, trial.seed, DType::F32, device))?;
        }
        Ok(match trial.setup {
            Setup::DdpF32 => Self::Ddp(DistributedDataParallel::with_config(
                &varmap,
                pg,
                device,
                DdpConfig::default(),
                build,
            )?),
            Setup::FsdpBf16Ckpt => {
                let fsdp = FsdpConfig {
                    seed: Some(trial.seed),
                    mixed_precision: MixedPrecision::bf16(),
                    ..FsdpConfig::default()
                };
                Self::Full(FullyShardedDataParallel::with_config(
                    &varmap, pg, device, fsdp, build,
                )?)
            }
        })
    }

    /// One training step on `inputs`: forward, loss, backward (with the gradients' all-reduce
    /// or reduce-scatter), AdamW. Returns the loss.
    fn step(&self, opt: &mut AdamW, inputs: &Tensor, answers: &Tensor) -> Result<f32> {
        let (loss, grads) = match self {
            Self::Ddp(m) => {
                let logits = m.forward_t(inputs, true)?;
                let loss = sort_loss(&logits, answers)?;
                (loss.clone(), m.backward(&loss)?)
            }
            Self::Full(m) => {
                let logits = m.forward_t(inputs, true)?;
                let loss = sort_loss(&logits, answers)?;
                (loss.clone(), m.backward(&loss)?)
            }
        };
        opt.step(&grads)?;
        Ok(loss.to_scalar::<f32>()?)
    }
}

/// A rank of one of our trials.
fn rank_main(trial: &Trial) -> Result<()> {
    let device = Device::Cpu;
    let pg = ProcessGroup::from_env(&device)?;
    let (rank, world) = (pg.rank(), pg.world_size());
    let baseline = ProcMemory::now()?;
    let model = Model::new(trial, &pg, &device)?;
    let parameters = match &model {
        Model::Ddp(m) => m.parameters(),
        Model::Full(m) => m.parameters(),
    };
    let adamw = AdamWConfig {
        lr: trial.lr,
        weight_decay: 0.01,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::new(parameters, adamw)?;
    let (task, _) = SortTask::generate(trial.digits, trial.samples(), 0, trial.seed);
    let batch = |step: usize| {
        let first = (step * world + rank) * trial.batch;
        let rows: Vec<usize> = (first..first + trial.batch)
            .map(|i| i % task.size())
            .collect();
        task.batch(&rows, &device)
    };
    let mut losses = Vec::new();
    let over = |now: &ProcMemory| -> Result<bool> {
        let mine = Tensor::new(&[now.training(&baseline)], &device)?;
        let worst = pg.all_reduce(&mine, ReduceOp::Max)?.to_vec1::<f64>()?[0];
        Ok(trial.budget > 0.0 && worst > trial.budget * MIB)
    };
    let mut status = "ok";
    for step in 0..trial.warmup {
        let (inputs, answers) = batch(step)?;
        losses.push(model.step(&mut opt, &inputs, &answers)?);
        if over(&ProcMemory::now()?)? {
            status = "over";
            break;
        }
    }
    let mut seconds = 0.0;
    if status == "ok" {
        pg.barrier()?;
        let started = Instant::now();
        for step in trial.warmup..trial.warmup + trial.steps {
            let (inputs, answers) = batch(step)?;
            losses.push(model.step(&mut opt, &inputs, &answers)?);
        }
        pg.barrier()?;
        seconds = started.elapsed().as_secs_f64();
    }
    let end = ProcMemory::now()?;
    if over(&end)? {
        status = "over";
    }
    let mine = [end.training(&baseline), end.peak, baseline.anon_and_shared];
    let most = pg
        .all_reduce(&Tensor::new(&mine, &device)?, ReduceOp::Max)?
        .to_vec1::<f64>()?;
    let losses: Vec<f64> = losses.iter().map(|&l| f64::from(l)).collect();
    let mean = match losses.len() {
        0 => Vec::new(),
        _ => pg
            .all_reduce(&Tensor::new(losses.as_slice(), &device)?, ReduceOp::Avg)?
            .to_vec1::<f64>()?,
    };
    if rank == 0 {
        let tokens = (trial.steps * world * trial.batch * 2 * trial.digits) as f64;
        let line = format!(
            "RESULT status={status} parameters={} tokens_per_s={} training_mib={} \
             peak_rss_mib={} baseline_mib={}\n",
            trial.config().parameters(),
            if seconds > 0.0 { tokens / seconds } else { 0.0 },
            most[0] / MIB,
            most[1] / MIB,
            most[2] / MIB,
        );
        std::fs::write(&trial.out, line)?;
        let curve: String = mean.iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(losses_path(&trial.out), curve)?;
    }
    Ok(())
}

fn losses_path(out: &Path) -> PathBuf {
    out.with_extension("losses")
}

/// Runs `trial` in our ranks, started by the launcher as copies of this program.
fn run_ours(trial: &Trial) -> Outcome {
    let config = LaunchConfig {
        nproc_per_node: trial.world,
        prefix_output: false,
        env: vec![
            (JOB_VAR.into(), trial.encode().into()),
            ("RAYON_NUM_THREADS".into(), "1".into()),
        ],
        ..LaunchConfig::default()
    };
    let _ = std::fs::remove_file(&trial.out);
    let run = || -> Result<Outcome> {
        let exe = std::env::current_exe()?;
        launch::launch(&config, exe.as_os_str(), &[] as &[OsString])?;
        let line = std::fs::read_to_string(&trial.out).context("rank 0 wrote no result")?;
        let mut o = Outcome::parse(&line)?;
        o.losses = read_losses(&losses_path(&trial.out))?;
        Ok(o)
    };
    run().unwrap_or_else(Outcome::failed)
}

fn read_losses(path: &Path) -> Result<Vec<f64>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(text.lines().map(str::parse).collect::<Result<_, _>>()?)
}

/// PyTorch's twin of this bench.
fn torch_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/torch_largest_model.py")
}

/// Whether `python3` imports torch.
fn torch_available() -> bool {
    Command::new("python3")
        .args(["-c", "import torch"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The longest a trial may take before it counts as failed.
const TRIAL_TIMEOUT: Duration = Duration::from_secs(900);

/// Runs `trial` in PyTorch's twin; once more if it failed, saying so (gloo's teardown once
/// aborted a rank after a good run, which must not cost the whole benchmark).
fn run_torch(trial: &Trial) -> Outcome {
    let first = run_torch_once(trial);
    if first.status != "failed" {
        return first;
    }
    eprintln!(
        "  PyTorch's {} trial ({} x {}) failed ({}): running it once more",
        trial.setup.name(),
        trial.layers,
        trial.dim,
        first.error
    );
    run_torch_once(trial)
}

/// Runs `trial` in PyTorch's twin, in a process group of its own that is killed whole if it
/// runs past [`TRIAL_TIMEOUT`].
fn run_torch_once(trial: &Trial) -> Outcome {
    let losses = losses_path(&trial.out);
    let _ = std::fs::remove_file(&losses);
    let mut cmd = Command::new("python3");
    cmd.arg(torch_script())
        .args(["--setup", trial.setup.name()])
        .args(["--world", &trial.world.to_string()])
        .args(["--layers", &trial.layers.to_string()])
        .args(["--dim", &trial.dim.to_string()])
        .args(["--heads", &trial.heads.to_string()])
        .args(["--digits", &trial.digits.to_string()])
        .args(["--batch-size", &trial.batch.to_string()])
        .args(["--warmup", &trial.warmup.to_string()])
        .args(["--steps", &trial.steps.to_string()])
        .args(["--budget", &trial.budget.to_string()])
        .args(["--lr", &trial.lr.to_string()])
        .args(["--seed", &trial.seed.to_string()])
        .arg("--data")
        .arg(&trial.data)
        .arg("--losses")
        .arg(&losses);
    if let Some(init) = &trial.init {
        cmd.arg("--init").arg(init);
    }
    let run = || -> Result<Outcome> {
        let text = run_bounded(cmd, TRIAL_TIMEOUT)?;
        let line = text
            .lines()
            .rev()
            .find(|l| l.starts_with("RESULT "))
            .with_context(|| format!("no result from PyTorch:\n{text}"))?;
        let mut o = Outcome::parse(line)?;
        if o.status != "failed" {
            o.losses = read_losses(&losses)?;
        }
        Ok(o)
    };
    run().unwrap_or_else(Outcome::failed)
}

/// Runs `cmd` in a process group of its own and returns its stdout; kills the whole group
/// (the script's ranks too) when it runs past `limit`.
fn run_bounded(mut cmd: Command, limit: Duration) -> Result<String> {
    use std::io::Read;
    use std::os::unix::process::CommandExt;
    let mut child = cmd
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting python3")?;
    let mut stdout = child.stdout.take().context("no stdout")?;
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        stdout.read_to_string(&mut text).map(|_| text)
    });
    let started = Instant::now();
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if started.elapsed() > limit {
            // SAFETY: kill only sends a signal, to the process group this call created.
            unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
            let _ = child.wait();
            bail!("PyTorch's trial ran past {}s", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    reader
        .join()
        .map_err(|_| anyhow::anyhow!("the reader of PyTorch's output panicked"))?
        .context("reading PyTorch's output")
}

/// Writes the samples of `trial` (every step's batch of every rank) for PyTorch: `tokens`
/// (n, 2 digits) and `answers` (n, digits), int64.
fn write_data(trial: &Trial) -> Result<()> {
    let (task, _) = SortTask::generate(trial.digits, trial.samples(), 0, trial.seed);
    let all: Vec<usize> = (0..task.size()).collect();
    let (tokens, answers) = task.batch(&all, &Device::Cpu)?;
    let tensors = HashMap::from([
        ("tokens".to_string(), tokens.to_dtype(DType::I64)?),
        ("answers".to_string(), answers.to_dtype(DType::I64)?),
    ]);
    checkpoint::save(&tensors, &trial.data)?;
    Ok(())
}

/// Writes our seeded initial weights of `trial`'s model for PyTorch to load.
fn write_init(trial: &Trial, path: &Path) -> Result<()> {
    let varmap = VarMap::new();
    Transformer::new(
        trial.config(),
        seeded_var_builder(&varmap, trial.seed, DType::F32, &Device::Cpu),
    )?;
    checkpoint::save_varmap(&varmap, path)?;
    Ok(())
}

struct Options {
    budget: f64,
    world: usize,
    digits: usize,
    batch: usize,
    warmup: usize,
    steps: usize,
    /// How many rungs of the ladder the search may climb.
    rungs: usize,
    curve_steps: usize,
    /// The rung (from 1) the loss curves train.
    curve_size: usize,
    torch: bool,
    /// Whether to run the search, or only the loss curves (`--curves-only`).
    search: bool,
    plot: Option<PathBuf>,
}

fn parse() -> Result<Options> {
    let mut o = Options {
        budget: 192.0,
        world: 4,
        digits: 16,
        batch: 8,
        warmup: 1,
        steps: 2,
        rungs: LADDER.len(),
        curve_steps: 150,
        curve_size: 1,
        torch: true,
        search: true,
        plot: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |flag: &str| args.next().with_context(|| format!("{flag} needs a value"));
        match a.as_str() {
            "--budget" => o.budget = value("--budget")?.parse()?,
            "--world" => o.world = value("--world")?.parse()?,
            "--digits" => o.digits = value("--digits")?.parse()?,
            "--batch-size" => o.batch = value("--batch-size")?.parse()?,
            "--warmup" => o.warmup = value("--warmup")?.parse()?,
            "--steps" => o.steps = value("--steps")?.parse()?,
            "--rungs" => o.rungs = value("--rungs")?.parse()?,
            "--curve-steps" => o.curve_steps = value("--curve-steps")?.parse()?,
            "--curve-size" => o.curve_size = value("--curve-size")?.parse()?,
            "--no-torch" => o.torch = false,
            "--curves-only" => o.search = false,
            "--quick" => {
                // Two small rungs, one timed step, a short curve: under a minute, PyTorch's
                // start-up most of it.
                o.rungs = 2;
                o.warmup = 1;
                o.steps = 1;
                o.digits = 8;
                o.curve_steps = 10;
                o.curve_size = 1;
            }
            "--plot" => {
                let path = value("--plot")?;
                plot::check_path(path.as_ref())?;
                o.plot = Some(path.into());
            }
            "--bench" => {}
            other => bail!("unknown argument {other:?}"),
        }
    }
    anyhow::ensure!(o.world > 0, "--world must be at least 1");
    anyhow::ensure!(
        o.batch > 0 && o.digits > 0,
        "--batch-size and --digits must be positive"
    );
    anyhow::ensure!(
        o.warmup > 0,
        "--warmup must be at least 1: the budget is checked there"
    );
    anyhow::ensure!(o.steps > 0, "--steps must be at least 1");
    anyhow::ensure!(
        (1..=LADDER.len()).contains(&o.rungs),
        "--rungs is between 1 and {}",
        LADDER.len()
    );
    anyhow::ensure!(
        (1..=LADDER.len()).contains(&o.curve_size),
        "--curve-size is a rung, 1 to {}",
        LADDER.len()
    );
    Ok(o)
}

/// The trials of the search, each setup's and framework's, rung by rung until it stops.
fn search(o: &Options, dir: &Path) -> Result<Vec<Row>> {
    let frameworks: &[Framework] = if o.torch {
        &[Framework::Ours, Framework::Torch]
    } else {
        &[Framework::Ours]
    };
    let mut going: HashMap<(Setup, Framework), bool> = HashMap::new();
    let mut rows = Vec::new();
    for (rung, &(layers, dim, heads)) in LADDER.iter().take(o.rungs).enumerate() {
        for setup in [Setup::DdpF32, Setup::FsdpBf16Ckpt] {
            let mut row = Row {
                rung: rung + 1,
                setup,
                layers,
                dim,
                parameters: 0,
                ours: None,
                torch: None,
            };
            let trial = Trial {
                setup,
                layers,
                dim,
                heads,
                digits: o.digits,
                batch: o.batch,
                warmup: o.warmup,
                steps: o.steps,
                budget: o.budget,
                world: o.world,
                lr: 1e-3,
                seed: 0,
                data: dir.join(format!("data-{rung}.safetensors")),
                init: None,
                out: dir.join("result"),
            };
            row.parameters = trial.config().parameters();
            for &fw in frameworks {
                if !*going.entry((setup, fw)).or_insert(true) {
                    continue;
                }
                if fw == Framework::Torch && !trial.data.exists() {
                    write_data(&trial)?;
                }
                let outcome = match fw {
                    Framework::Ours => run_ours(&trial),
                    Framework::Torch => run_torch(&trial),
                };
                eprintln!(
                    "  rung {} ({layers} x {dim}), {}, {}: {} {}",
                    rung + 1,
                    setup.name(),
                    if fw == Framework::Ours {
                        "ours"
                    } else {
                        "PyTorch"
                    },
                    outcome.status,
                    outcome.cells().join(" / ")
                );
                if !outcome.error.is_empty() {
                    eprintln!("    {}", outcome.error);
                }
                going.insert((setup, fw), outcome.fits());
                match fw {
                    Framework::Ours => row.ours = Some(outcome),
                    Framework::Torch => row.torch = Some(outcome),
                }
            }
            if row.ours.is_some() || row.torch.is_some() {
                rows.push(row);
            }
        }
        if going.values().all(|g| !g) {
            break;
        }
    }
    Ok(rows)
}

/// One rung of one setup: ours and PyTorch's trial, where each still ran.
struct Row {
    rung: usize,
    setup: Setup,
    layers: usize,
    dim: usize,
    parameters: usize,
    ours: Option<Outcome>,
    torch: Option<Outcome>,
}

fn millions(n: usize) -> String {
    format!("{:.1} M", n as f64 / 1e6)
}

fn print_search(o: &Options, rows: &[Row]) {
    println!(
        "\n{} ranks x 1 thread, CPU ({}); batch {} x {} tokens per rank; {} untimed + {} timed \
         steps per trial; budget {:.0} MiB of training memory per rank; MiB are the largest over \
         the ranks\n",
        o.world,
        plot::cpu_description(),
        o.batch,
        2 * o.digits,
        o.warmup,
        o.steps,
        o.budget
    );
    println!(
        "| rung | model | parameters | setup | ours: training MiB | peak RSS | tokens/s | \
         PyTorch: training MiB | peak RSS | tokens/s | ours / PyTorch tokens/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let none = || ["".to_string(), "".into(), "".into()];
    for r in rows {
        let ours = r.ours.as_ref().map_or_else(none, Outcome::cells);
        let torch = r.torch.as_ref().map_or_else(none, Outcome::cells);
        let ratio = match (&r.ours, &r.torch) {
            (Some(a), Some(b)) if a.fits() && b.fits() => {
                format!("{:.2}x", a.tokens_per_s / b.tokens_per_s)
            }
            _ => String::new(),
        };
        println!(
            "| {} | {} x {} | {} | {} | {} | {} | {} | {} | {} | {} | {ratio} |",
            r.rung,
            r.layers,
            r.dim,
            millions(r.parameters),
            r.setup.label(),
            ours[0],
            ours[1],
            ours[2],
            torch[0],
            torch[1],
            torch[2],
        );
    }
    println!("\nThe largest model within {:.0} MiB per rank:\n", o.budget);
    println!("| setup | ours | tokens/s | PyTorch | tokens/s |");
    println!("|---|---|---|---|---|");
    for setup in [Setup::DdpF32, Setup::FsdpBf16Ckpt] {
        let largest = |pick: fn(&Row) -> Option<&Outcome>| {
            rows.iter()
                .rfind(|r| r.setup == setup && pick(r).is_some_and(Outcome::fits))
                .map_or(["none".to_string(), "-".into()], |r| {
                    [
                        format!("{} x {} ({})", r.layers, r.dim, millions(r.parameters)),
                        format!("{:.0}", pick(r).map_or(0.0, |x| x.tokens_per_s)),
                    ]
                })
        };
        let ours = largest(|r| r.ours.as_ref());
        let torch = if o.torch {
            largest(|r| r.torch.as_ref())
        } else {
            ["(--no-torch)".into(), "-".into()]
        };
        println!(
            "| {} | {} | {} | {} | {} |",
            setup.label(),
            ours[0],
            ours[1],
            torch[0],
            torch[1]
        );
    }
}

/// The loss curves: the same model, data and initial weights under each setup and framework.
fn curves(o: &Options, dir: &Path) -> Result<Vec<(Setup, Framework, Outcome)>> {
    let (layers, dim, heads) = LADDER[o.curve_size - 1];
    let init = dir.join("init.safetensors");
    let mut out = Vec::new();
    for setup in [Setup::FsdpBf16Ckpt, Setup::DdpF32] {
        let trial = Trial {
            setup,
            layers,
            dim,
            heads,
            digits: o.digits,
            batch: o.batch,
            warmup: 1,
            steps: o.curve_steps - 1,
            budget: 0.0,
            world: o.world,
            lr: 1e-3,
            seed: 0,
            data: dir.join("curve-data.safetensors"),
            init: Some(init.clone()),
            out: dir.join("curve"),
        };
        if !trial.data.exists() {
            write_data(&trial)?;
            write_init(&trial, &init)?;
        }
        let frameworks: &[Framework] = if o.torch {
            &[Framework::Ours, Framework::Torch]
        } else {
            &[Framework::Ours]
        };
        for &fw in frameworks {
            let outcome = match fw {
                Framework::Ours => run_ours(&trial),
                Framework::Torch => run_torch(&trial),
            };
            if !outcome.fits() {
                bail!(
                    "the loss curve of {} ({fw:?}) failed: {}",
                    setup.name(),
                    outcome.error
                );
            }
            out.push((setup, fw, outcome));
        }
    }
    Ok(out)
}

fn print_curves(o: &Options, runs: &[(Setup, Framework, Outcome)]) {
    let (layers, dim, _) = LADDER[o.curve_size - 1];
    let tail = 20.min(o.curve_steps);
    println!(
        "\nLoss curves: {layers} x {dim}, {} steps, the same batches and initial weights; loss \
         averaged over the ranks; tokens/s over the steps after the first\n",
        o.curve_steps
    );
    println!("| setup | framework | first loss | mean of the last {tail} | tokens/s |");
    println!("|---|---|---|---|---|");
    for (setup, fw, r) in runs {
        let last = &r.losses[r.losses.len().saturating_sub(tail)..];
        println!(
            "| {} | {} | {:.4} | {:.5} | {:.0} |",
            setup.label(),
            if *fw == Framework::Ours {
                "ours"
            } else {
                "PyTorch"
            },
            r.losses.first().copied().unwrap_or(f64::NAN),
            last.iter().sum::<f64>() / last.len().max(1) as f64,
            r.tokens_per_s
        );
    }
    for setup in [Setup::FsdpBf16Ckpt, Setup::DdpF32] {
        let of = |fw| {
            runs.iter()
                .find(|(s, f, _)| *s == setup && *f == fw)
                .map(|r| &r.2)
        };
        if let (Some(a), Some(b)) = (of(Framework::Ours), of(Framework::Torch)) {
            let gap = a
                .losses
                .iter()
                .zip(&b.losses)
                .map(|(x, y)| (x - y).abs())
                .fold(0f64, f64::max);
            println!(
                "{}: ours / PyTorch tokens/s {:.2}x; largest |loss difference| over the steps \
                 {gap:.2e} (first step {:.2e})",
                setup.label(),
                a.tokens_per_s / b.tokens_per_s,
                (a.losses[0] - b.losses[0]).abs()
            );
        }
    }
}

fn draw_curves(o: &Options, path: &Path, runs: &[(Setup, Framework, Outcome)]) -> Result<()> {
    let (layers, dim, _) = LADDER[o.curve_size - 1];
    let curves: Vec<plot::LossCurve> = runs
        .iter()
        .map(|(setup, fw, r)| plot::LossCurve {
            name: format!(
                "{}, {}",
                if *fw == Framework::Ours {
                    "ours"
                } else {
                    "PyTorch 2.15"
                },
                setup.label()
            ),
            losses: r.losses.clone(),
            colour: usize::from(*setup == Setup::DdpF32),
            dashed: *fw == Framework::Torch,
        })
        .collect();
    let params = Config {
        vocab: VOCAB,
        max_len: 2 * o.digits,
        dim,
        heads: 1,
        layers,
        checkpoint_every: 0,
    }
    .parameters();
    let subtitle = format!(
        "{layers} blocks of width {dim} ({}), sorting {} digits; {} ranks x batch {}; AdamW lr \
         1e-3\nthe same batches and initial weights; loss averaged over the ranks; CPU ({})",
        millions(params),
        o.digits,
        o.world,
        o.batch,
        plot::cpu_description()
    );
    plot::loss_chart(
        path,
        "Training loss: ours and PyTorch's",
        &subtitle,
        &curves,
    )
}

fn main() -> Result<()> {
    // Freed tensor memory stays for the next step (see candle_parallel::memory), as in the
    // examples: what a user of the crate runs.
    candle_parallel::memory::keep_freed_memory();
    if let Ok(job) = std::env::var(JOB_VAR) {
        let trial = Trial::decode(&job)?;
        launch::spawn(trial.world, |_| rank_main(&trial))?;
        return Ok(());
    }
    let mut o = parse()?;
    if o.torch && !torch_available() {
        println!("python3 cannot import torch: ours only");
        o.torch = false;
    }
    let dir = std::env::temp_dir().join(format!("cp-largest-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let started = Instant::now();
    let result = (|| -> Result<()> {
        if o.search {
            let rows = search(&o, &dir)?;
            print_search(&o, &rows);
        }
        let runs = curves(&o, &dir)?;
        print_curves(&o, &runs);
        if let Some(path) = &o.plot {
            draw_curves(&o, path, &runs)?;
            println!("Drew the loss curves to {}", path.display());
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "\n(the whole run took {:.0} s)",
        started.elapsed().as_secs_f64()
    );
    result
}
