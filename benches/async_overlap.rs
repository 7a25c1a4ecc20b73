//! How much of an all-reduce an asynchronous call hides behind compute on the caller's thread.
//!
//!     cargo bench --bench async_overlap
//!     cargo bench --bench async_overlap -- --mib 64 --world 2
//!
//! Starts `--world` ranks (default 2) on 127.0.0.1. Each rank times, as the median of several
//! trials: a blocking f32 `all_reduce(sum)` of `--mib` MiB (default 16) alone; a compute loop
//! alone (256×256 matmuls, sized to take about as long as the all-reduce); the compute then the
//! blocking all-reduce; and `all_reduce_async`, the compute, then `wait`. The hidden share is
//! `(sequential - overlapped) / all-reduce`. The same is done with the caller sleeping instead
//! of computing (what a caller waiting on a GPU sees): the upper bound of what can be hidden
//! when compute and communication do not compete for the CPU. Each rank's compute runs on one
//! thread (`RAYON_NUM_THREADS=1` unless set). Reports; asserts nothing.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_parallel::distributed::{ProcessGroup, ReduceOp};
use candle_parallel::launch::{self, LaunchConfig};
use std::time::{Duration, Instant};

struct Options {
    world: usize,
    mib: usize,
}

fn parse() -> Result<Options> {
    let mut o = Options { world: 2, mib: 16 };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |flag: &str| -> Result<usize> {
            let v = args
                .next()
                .with_context(|| format!("{flag} needs a value"))?;
            v.parse().with_context(|| format!("{flag}: {v:?}"))
        };
        match a.as_str() {
            "--world" => o.world = value("--world")?,
            "--mib" => o.mib = value("--mib")?,
            "--bench" => {}
            other => bail!("unknown argument {other:?}"),
        }
    }
    if o.world < 2 || o.mib == 0 {
        bail!("--world must be at least 2 and --mib positive");
    }
    Ok(o)
}

const TRIALS: usize = 7;

/// The median of `TRIALS` timings of `f`, each started together on every rank.
fn median(pg: &ProcessGroup, mut f: impl FnMut() -> Result<()>) -> Result<Duration> {
    let mut times = Vec::with_capacity(TRIALS);
    for _ in 0..TRIALS {
        pg.barrier()?;
        let started = Instant::now();
        f()?;
        times.push(started.elapsed());
    }
    times.sort();
    Ok(times[TRIALS / 2])
}

/// What the caller does while the all-reduce is in flight.
enum Busy {
    Compute { a: Tensor, steps: usize },
    Sleep(Duration),
}

impl Busy {
    fn run(&self) -> Result<()> {
        match self {
            Busy::Compute { a, steps } => {
                let mut x = a.clone();
                for _ in 0..*steps {
                    x = (x.matmul(a)? * 1e-3)?;
                }
                x.sum_all()?.to_scalar::<f32>()?;
            }
            Busy::Sleep(d) => std::thread::sleep(*d),
        }
        Ok(())
    }
}

fn rank_main(o: &Options) -> Result<()> {
    let pg = ProcessGroup::from_env(&Device::Cpu)?;
    let x = Tensor::ones((o.mib << 20) / 4, DType::F32, &Device::Cpu)?;
    for _ in 0..3 {
        pg.all_reduce(&x, ReduceOp::Sum)?;
    }
    let comm = median(&pg, || {
        pg.all_reduce(&x, ReduceOp::Sum)
            .map(drop)
            .map_err(Into::into)
    })?;
    // Size the compute to take about as long as the all-reduce, the same on every rank.
    let a = Tensor::randn(0f32, 1.0, (256, 256), &Device::Cpu)?;
    let one = median(&pg, || {
        Busy::Compute {
            a: a.clone(),
            steps: 4,
        }
        .run()
    })? / 4;
    let steps = (comm.as_secs_f64() / one.as_secs_f64()).round().max(1.0) as usize;
    let steps = pg
        .all_reduce(&Tensor::new(&[steps as f32], &Device::Cpu)?, ReduceOp::Max)?
        .to_vec1::<f32>()?[0] as usize;
    let loads = [
        ("compute", Busy::Compute { a, steps }),
        ("sleep", Busy::Sleep(comm)),
    ];
    if pg.rank() == 0 {
        println!(
            "\n{} ranks, f32 all_reduce(sum) of {} MiB; all-reduce alone: {:.1} ms",
            pg.world_size(),
            o.mib,
            comm.as_secs_f64() * 1e3
        );
        println!(
            "{:>8} {:>10} {:>22} {:>22} {:>8}",
            "caller", "alone", "then blocking call", "async, then wait", "hidden"
        );
    }
    for (name, busy) in &loads {
        let alone = median(&pg, || busy.run())?;
        let sequential = median(&pg, || {
            busy.run()?;
            pg.all_reduce(&x, ReduceOp::Sum)?;
            Ok(())
        })?;
        let overlapped = median(&pg, || {
            let work = pg.all_reduce_async(&x, ReduceOp::Sum)?;
            busy.run()?;
            work.wait()?;
            Ok(())
        })?;
        let hidden = (sequential.as_secs_f64() - overlapped.as_secs_f64()) / comm.as_secs_f64();
        if pg.rank() == 0 {
            println!(
                "{name:>8} {:>8.1}ms {:>20.1}ms {:>20.1}ms {:>7.0}%",
                alone.as_secs_f64() * 1e3,
                sequential.as_secs_f64() * 1e3,
                overlapped.as_secs_f64() * 1e3,
                100.0 * hidden.clamp(0.0, 1.0)
            );
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let o = parse()?;
    let mut env = Vec::new();
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        env.push(("RAYON_NUM_THREADS".into(), "1".into()));
    }
    let config = LaunchConfig {
        nproc_per_node: o.world,
        prefix_output: false,
        env,
        ..LaunchConfig::default()
    };
    launch::spawn_with(&config, |_rank| rank_main(&o))?;
    Ok(())
}
