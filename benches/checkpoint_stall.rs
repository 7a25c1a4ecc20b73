//! How long a checkpoint stops training: the consolidated save (gathered to rank 0, one file),
//! the distributed checkpoint saved synchronously (every rank writes its own pieces), and the
//! distributed checkpoint saved asynchronously (the pieces copied to host memory, written by a
//! thread while training goes on).
//!
//!     cargo bench --bench checkpoint_stall
//!     cargo bench --bench checkpoint_stall -- --layout zero2 --world 2 --saves 3 --steps 4
//!
//! Starts `--world` ranks (default 2) on 127.0.0.1, each on one thread, training the 25.2 M
//! parameter MLP of `benches/common` (100 MB of f32 weights, 200 MB of AdamW state) fully
//! sharded (`--layout full`, default) or under ZeRO-2 (`--layout zero2`), batch 32 per rank.
//! For each kind of save, `--saves` times: the save's stall (the slowest rank's time inside the
//! call; medians reported), then `--steps` training steps (their time per step, beside the
//! steps of a run that does not save), then, for the asynchronous save, the time `wait` still
//! blocks. Files go to `--dir` (default: a folder in the temp directory, removed after).
//! Reports; asserts nothing.

mod common;
#[path = "common/timing.rs"]
#[allow(dead_code)] // its `time` is for the phase benches
mod timing;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::{loss, Optimizer, VarMap};
use candle_parallel::checkpoint::distributed::Checkpointer;
use candle_parallel::ddp::{DdpConfig, Sharding};
use candle_parallel::distributed::{ProcessGroup, ReduceOp};
use candle_parallel::fsdp::{FsdpConfig, FullyShardedDataParallel};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::launch::{self, LaunchConfig};
use candle_parallel::optim::{AdamW, AdamWConfig};
use candle_parallel::DistributedDataParallel;
use std::path::PathBuf;
use std::time::Instant;
use timing::median;

struct Options {
    world: usize,
    saves: usize,
    steps: usize,
    full: bool,
    dir: Option<PathBuf>,
}

fn parse() -> Result<Options> {
    let mut o = Options {
        world: 2,
        saves: 3,
        steps: 4,
        full: true,
        dir: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |flag: &str| -> Result<String> {
            args.next().with_context(|| format!("{flag} needs a value"))
        };
        match a.as_str() {
            "--world" => o.world = value("--world")?.parse()?,
            "--saves" => o.saves = value("--saves")?.parse()?,
            "--steps" => o.steps = value("--steps")?.parse()?,
            "--dir" => o.dir = Some(value("--dir")?.into()),
            "--layout" => {
                o.full = match value("--layout")?.as_str() {
                    "full" => true,
                    "zero2" => false,
                    other => bail!("--layout {other:?}: full or zero2"),
                }
            }
            "--bench" => {}
            other => bail!("unknown argument {other:?}"),
        }
    }
    if o.saves == 0 || o.steps == 0 {
        bail!("--saves and --steps must be at least 1");
    }
    Ok(o)
}

/// The model under either layout, behind one face.
enum Model {
    Full(FullyShardedDataParallel<common::Big>),
    Zero2(DistributedDataParallel<common::Big>),
}

impl Model {
    fn new(pg: &ProcessGroup, full: bool) -> Result<Model> {
        let cpu = Device::Cpu;
        Ok(match full {
            true => {
                let config = FsdpConfig {
                    seed: Some(1),
                    ..FsdpConfig::default()
                };
                Model::Full(FullyShardedDataParallel::with_config(
                    &VarMap::new(),
                    pg,
                    &cpu,
                    config,
                    common::big,
                )?)
            }
            false => {
                let varmap = VarMap::new();
                common::big(seeded_var_builder(&varmap, 1, DType::F32, &cpu))?;
                let config = DdpConfig {
                    sharding: Sharding::Zero2,
                    ..DdpConfig::default()
                };
                Model::Zero2(DistributedDataParallel::with_config(
                    &varmap,
                    pg,
                    &cpu,
                    config,
                    common::big,
                )?)
            }
        })
    }

    fn parameters(&self) -> Vec<candle_core::Var> {
        match self {
            Model::Full(m) => m.parameters(),
            Model::Zero2(m) => m.parameters(),
        }
    }

    fn step(&self, opt: &mut AdamW, x: &Tensor, y: &Tensor) -> Result<()> {
        let grads = match self {
            Model::Full(m) => m.backward(&loss::cross_entropy(&m.forward_t(x, true)?, y)?)?,
            Model::Zero2(m) => m.backward(&loss::cross_entropy(&m.forward_t(x, true)?, y)?)?,
        };
        opt.step(&grads)?;
        Ok(())
    }

    fn state_dict(
        &self,
        opt: &AdamW,
    ) -> candle_parallel::Result<candle_parallel::checkpoint::distributed::StateDict> {
        match self {
            Model::Full(m) => m.state_dict(opt),
            Model::Zero2(m) => m.state_dict(opt),
        }
    }

    fn save_consolidated(&self, opt: &AdamW, path: &std::path::Path) -> Result<()> {
        match self {
            Model::Full(m) => m.save_checkpoint(opt, path)?,
            Model::Zero2(m) => m.save_checkpoint(opt, path)?,
        }
        Ok(())
    }
}

/// The largest of every rank's `x`.
fn slowest(pg: &ProcessGroup, x: f64) -> Result<f64> {
    let t = Tensor::new(&[x], &Device::Cpu)?;
    Ok(pg.all_reduce(&t, ReduceOp::Max)?.to_vec1::<f64>()?[0])
}

fn rank_main(o: &Options, dir: &std::path::Path) -> Result<()> {
    let pg = ProcessGroup::from_env(&Device::Cpu)?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let model = Model::new(&pg, o.full)?;
    let mut opt = AdamW::new(model.parameters(), AdamWConfig::default())?;
    let (x, y) = common::big_batch(32, &Device::Cpu)?;
    // Warm up: the optimizer's state exists from the first step on.
    model.step(&mut opt, &x, &y)?;
    let steps = |opt: &mut AdamW| -> Result<f64> {
        let t = Instant::now();
        for _ in 0..o.steps {
            model.step(opt, &x, &y)?;
        }
        slowest(&pg, t.elapsed().as_secs_f64() / o.steps as f64)
    };
    let plain = median(
        (0..o.saves)
            .map(|_| steps(&mut opt))
            .collect::<Result<_>>()?,
    );
    let mut rows = Vec::new();
    for kind in [
        "consolidated, rank 0 writes",
        "distributed, sync",
        "distributed, async",
    ] {
        let mut checkpoints = Checkpointer::for_group(dir.join("dcp"), &pg, &Device::Cpu);
        let (mut stalls, mut during, mut waits) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..o.saves {
            pg.barrier()?;
            let t = Instant::now();
            match kind {
                "consolidated, rank 0 writes" => {
                    model.save_consolidated(&opt, &dir.join("whole.safetensors"))?
                }
                "distributed, sync" => checkpoints.save(&model.state_dict(&opt)?)?,
                _ => checkpoints.save_async(&model.state_dict(&opt)?)?,
            }
            stalls.push(slowest(&pg, t.elapsed().as_secs_f64())?);
            during.push(steps(&mut opt)?);
            let t = Instant::now();
            checkpoints.wait()?;
            waits.push(slowest(&pg, t.elapsed().as_secs_f64())?);
        }
        rows.push((kind, median(stalls), median(during), median(waits)));
    }
    if pg.rank() == 0 {
        let bytes: usize = model.parameters().iter().map(|v| v.elem_count() * 4).sum();
        println!(
            "\n{} ranks, {}, each rank holding {:.0} MB of weights (and twice that of AdamW \
             state); median of {} saves, {} steps after each",
            pg.world_size(),
            if o.full { "fully sharded" } else { "ZeRO-2" },
            bytes as f64 / 1e6,
            o.saves,
            o.steps
        );
        println!(
            "| save | stall | step after (no save: {:.0} ms) | wait after the steps |",
            plain * 1e3
        );
        println!("|---|---:|---:|---:|");
        for (kind, stall, during, wait) in rows {
            println!(
                "| {kind} | {:.0} ms | {:.0} ms | {:.0} ms |",
                stall * 1e3,
                during * 1e3,
                wait * 1e3
            );
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let o = parse()?;
    let (dir, temporary) = match &o.dir {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("checkpoint-stall-{}", std::process::id())),
            true,
        ),
    };
    // Every rank uses the launcher's folder.
    let dir = match std::env::var_os("CP_STALL_DIR") {
        Some(d) => PathBuf::from(d),
        None => dir,
    };
    let mut env = vec![("CP_STALL_DIR".into(), dir.clone().into_os_string())];
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        env.push(("RAYON_NUM_THREADS".into(), "1".into()));
    }
    let config = LaunchConfig {
        nproc_per_node: o.world,
        env,
        ..LaunchConfig::default()
    };
    let run = launch::spawn_with_config(&config, |_rank| rank_main(&o, &dir));
    if temporary {
        let _ = std::fs::remove_dir_all(&dir);
    }
    run?;
    Ok(())
}
