//! How much of an all-reduce an asynchronous call hides behind compute on the caller's thread.
//!
//!     cargo bench --bench async_overlap
//!     cargo bench --bench async_overlap -- --mib 64 --world 2
//!     cargo bench --bench async_overlap --features cuda,nccl -- --cuda
//!
//! Starts `--world` ranks (default 2) on 127.0.0.1. Each rank times, as the median of several
//! trials: a blocking f32 `all_reduce(sum)` of `--mib` MiB (default 16) alone; a compute loop
//! alone (256×256 matmuls, sized to take about as long as the all-reduce); the compute then the
//! blocking all-reduce; and `all_reduce_async`, the compute, then `wait`. The hidden share is
//! `(sequential - overlapped) / all-reduce`. The same is done with the caller sleeping instead
//! of computing (what a caller waiting on a GPU sees): the upper bound of what can be hidden
//! when compute and communication do not compete for the CPU. Each rank's compute runs on one
//! thread (`RAYON_NUM_THREADS=1` unless set).
//!
//! With `--cuda`: one rank on GPU 0 over NCCL, all-reducing a tensor as large as the 25.2 M
//! parameters of the MLP in `benches/common` (bus bandwidth means nothing at world size 1, so
//! the latency per call is reported, and that of a one-element call), and the compute is that
//! MLP's backward (batch 64): how much of the all-reduce hides behind backward when issued
//! before it. Every trial ends by waiting for the GPU. Reports; asserts nothing.

mod common;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{loss, VarMap};
use candle_parallel::distributed::{ProcessGroup, ReduceOp};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::launch::{self, LaunchConfig};
use std::time::{Duration, Instant};

struct Options {
    world: usize,
    mib: usize,
    cuda: bool,
}

fn parse() -> Result<Options> {
    let mut o = Options {
        world: 2,
        mib: 16,
        cuda: false,
    };
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
            "--cuda" => o.cuda = true,
            "--bench" => {}
            other => bail!("unknown argument {other:?}"),
        }
    }
    if o.cuda {
        o.world = 1; // one GPU holds one NCCL rank
    } else if o.world < 2 || o.mib == 0 {
        bail!("--world must be at least 2 and --mib positive");
    }
    Ok(o)
}

const TRIALS: usize = 7;

/// The median of `TRIALS` timings of `f`, each started together on every rank and ended when
/// `device` has run what `f` queued.
fn median(
    pg: &ProcessGroup,
    device: &Device,
    mut f: impl FnMut() -> Result<()>,
) -> Result<Duration> {
    let mut times = Vec::with_capacity(TRIALS);
    for _ in 0..TRIALS {
        pg.barrier()?;
        device.synchronize()?;
        let started = Instant::now();
        f()?;
        device.synchronize()?;
        times.push(started.elapsed());
    }
    times.sort();
    Ok(times[TRIALS / 2])
}

/// What the caller does while the all-reduce is in flight.
enum Busy {
    Compute {
        a: Tensor,
        steps: usize,
    },
    Sleep(Duration),
    /// The backward of this loss.
    Backward(Tensor),
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
            Busy::Backward(l) => drop(l.backward()?),
        }
        Ok(())
    }
}

/// What the caller does while the all-reduce is in flight, after timing the all-reduce alone.
fn cpu_loads(pg: &ProcessGroup, comm: Duration) -> Result<Vec<(&'static str, Busy)>> {
    // Size the compute to take about as long as the all-reduce, the same on every rank.
    let a = Tensor::randn(0f32, 1.0, (256, 256), &Device::Cpu)?;
    let one = median(pg, &Device::Cpu, || {
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
    Ok(vec![
        ("compute", Busy::Compute { a, steps }),
        ("sleep", Busy::Sleep(comm)),
    ])
}

fn rank_main(o: &Options) -> Result<()> {
    let device = if o.cuda {
        candle_parallel::devices::cuda_device(0)?
    } else {
        Device::Cpu
    };
    let pg = ProcessGroup::from_env(&device)?;
    // On the GPU: the MLP's loss, whose backward is the compute, and its parameter count.
    let mlp = if o.cuda {
        let varmap = VarMap::new();
        let model = common::big(seeded_var_builder(&varmap, 0, DType::F32, &device))?;
        let (x, y) = common::big_batch(64, &device)?;
        let count: usize = varmap.all_vars().iter().map(|v| v.elem_count()).sum();
        Some((loss::cross_entropy(&model.forward(&x)?, &y)?, count))
    } else {
        None
    };
    let elements = mlp.as_ref().map_or((o.mib << 20) / 4, |(_, count)| *count);
    let x = Tensor::ones(elements, DType::F32, &device)?;
    let one = Tensor::ones(1, DType::F32, &device)?;
    for _ in 0..3 {
        pg.all_reduce(&x, ReduceOp::Sum)?;
    }
    let reduce = |t: &Tensor| pg.all_reduce(t, ReduceOp::Sum).map(drop);
    let comm = median(&pg, &device, || Ok(reduce(&x)?))?;
    let latency = median(&pg, &device, || Ok(reduce(&one)?))?;
    let loads = match mlp {
        Some((l, _)) => vec![("backward", Busy::Backward(l))],
        None => cpu_loads(&pg, comm)?,
    };
    if pg.rank() == 0 {
        println!(
            "\n{} rank(s) on {}, f32 all_reduce(sum) of {:.1} M elements ({:.1} MiB): {:.3} ms per \
             call alone; of 1 element: {:.1} us",
            pg.world_size(),
            if o.cuda { "GPU 0 (NCCL)" } else { "127.0.0.1" },
            elements as f64 / 1e6,
            (elements * 4) as f64 / f64::from(1 << 20),
            comm.as_secs_f64() * 1e3,
            latency.as_secs_f64() * 1e6
        );
        println!(
            "{:>8} {:>10} {:>22} {:>22} {:>8}",
            "caller", "alone", "then blocking call", "async, then wait", "hidden"
        );
    }
    for (name, busy) in &loads {
        let alone = median(&pg, &device, || busy.run())?;
        let sequential = median(&pg, &device, || {
            busy.run()?;
            reduce(&x)?;
            Ok(())
        })?;
        let overlapped = median(&pg, &device, || {
            let work = pg.all_reduce_async(&x, ReduceOp::Sum)?;
            busy.run()?;
            work.wait()?;
            Ok(())
        })?;
        let hidden = (sequential.as_secs_f64() - overlapped.as_secs_f64()) / comm.as_secs_f64();
        if pg.rank() == 0 {
            println!(
                "{name:>8} {:>8.2}ms {:>20.2}ms {:>20.2}ms {:>7.0}%",
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
    launch::spawn_with_config(&config, |_rank| rank_main(&o))?;
    Ok(())
}
