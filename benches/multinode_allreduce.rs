//! All-reduce between two machines of our own: the flat ring against the hierarchical
//! all-reduce, over a fast link and over a slow one.
//!
//!     sudo cargo bench --bench multinode_allreduce
//!     cargo bench --bench multinode_allreduce -- --rate 1gbit --max-mib 64 --local 2
//!
//! Makes two network namespaces joined by a veth pair (the tests' `common/netns.rs`; needs root
//! and iproute2), starts `--local` ranks in each (default 2), and times f32 `all_reduce(sum)` of
//! CPU tensors from 1 MiB to `--max-mib` MiB (median of 5 trials), once with
//! `CANDLE_PARALLEL_ALGORITHM=ring` and once with `hierarchical`: first over the bare link,
//! then with the link limited to `--rate` each way (tc's token bucket). Prints bus bandwidth
//! (nccl-tests' definition) and the hierarchical/ring ratio. Reports; asserts nothing.

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_parallel::distributed::{ProcessGroup, ReduceOp};
use std::process::Stdio;
use std::time::{Duration, Instant};

#[path = "../tests/common/netns.rs"]
mod netns;

const TRIALS: usize = 5;
/// Marks a process as one rank of this bench.
const RANK_VAR: &str = "CP_MULTINODE_BENCH_RANK";

struct Options {
    local: usize,
    max_mib: usize,
    rate: String,
}

fn parse() -> Result<Options> {
    let mut o = Options {
        local: 2,
        max_mib: 64,
        rate: "1gbit".into(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |flag: &str| args.next().with_context(|| format!("{flag} needs a value"));
        match a.as_str() {
            "--local" => o.local = value("--local")?.parse().context("--local")?,
            "--max-mib" => o.max_mib = value("--max-mib")?.parse().context("--max-mib")?,
            "--rate" => o.rate = value("--rate")?,
            "--bench" => {}
            other => bail!("unknown argument {other:?}"),
        }
    }
    ensure!(
        o.local >= 1 && o.max_mib >= 1,
        "--local and --max-mib must be positive"
    );
    Ok(o)
}

/// One rank: times each size and, on rank 0, prints `size_bytes seconds` per size.
fn rank_main(max_mib: usize) -> Result<()> {
    let pg = ProcessGroup::from_env(&Device::Cpu)?;
    let n = pg.world_size();
    let mut size = 1usize << 20;
    while size <= max_mib << 20 {
        let x = Tensor::ones(size / 4, DType::F32, &Device::Cpu)?;
        let iters = ((32usize << 20) / size).clamp(2, 20);
        pg.all_reduce(&x, ReduceOp::Sum)?;
        let mut trials = Vec::with_capacity(TRIALS);
        let mut y = x.clone();
        for _ in 0..TRIALS {
            pg.barrier()?;
            let started = Instant::now();
            for _ in 0..iters {
                y = pg.all_reduce(&x, ReduceOp::Sum)?;
            }
            trials.push(started.elapsed().as_secs_f64() / iters as f64);
        }
        trials.sort_by(f64::total_cmp);
        ensure!(y.to_vec1::<f32>()?[0] == n as f32, "wrong sum");
        if pg.rank() == 0 {
            println!("{size} {}", trials[TRIALS / 2]);
        }
        size *= 4;
    }
    pg.barrier()?;
    Ok(())
}

/// Runs one job of `2 * local` ranks across `m` with `algorithm`; returns (size, seconds) rows.
fn job(m: &netns::Machines, o: &Options, algorithm: &str) -> Result<Vec<(usize, f64)>> {
    let exe = std::env::current_exe()?;
    let world = 2 * o.local;
    let mut children = Vec::new();
    for rank in 0..world {
        let mut c = m.rank(&exe, rank, o.local);
        c.args(["--max-mib", &o.max_mib.to_string()])
            .env(RANK_VAR, "1")
            .env("CANDLE_PARALLEL_ALGORITHM", algorithm)
            .env("CANDLE_PARALLEL_RENDEZVOUS_TIMEOUT", "30")
            .env("RAYON_NUM_THREADS", "1")
            .stdout(if rank == 0 {
                Stdio::piped()
            } else {
                Stdio::null()
            });
        children.push(c.spawn().context("starting a rank")?);
    }
    // Every rank is waited for (and killed past the deadline), whatever happens.
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut output = String::new();
    if let Some(mut out) = children[0].stdout.take() {
        use std::io::Read;
        out.read_to_string(&mut output)?;
    }
    let mut failed = Vec::new();
    for (rank, c) in children.iter_mut().enumerate() {
        let status = loop {
            if let Some(s) = c.try_wait()? {
                break s;
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                break c.wait()?;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if !status.success() {
            failed.push(format!("rank {rank}: {status}"));
        }
    }
    ensure!(failed.is_empty(), "{algorithm}: {}", failed.join(", "));
    output
        .lines()
        .map(|l| {
            let (size, secs) = l.split_once(' ').context("a result line")?;
            Ok((size.parse()?, secs.parse()?))
        })
        .collect()
}

fn main() -> Result<()> {
    let o = parse()?;
    if std::env::var_os(RANK_VAR).is_some() {
        return rank_main(o.max_mib);
    }
    let m = match netns::Machines::new("bench") {
        Ok(m) => m,
        Err(netns::Unavailable(why)) => {
            println!("multinode_allreduce skipped: {why}");
            return Ok(());
        }
    };
    let world = 2 * o.local;
    let bus =
        |size: usize, secs: f64| size as f64 / secs / 1e9 * 2.0 * (world - 1) as f64 / world as f64;
    println!(
        "all_reduce(sum), f32 CPU tensors, 2 machines (network namespaces, veth) x {} ranks; \
         bus bandwidth GB/s, median of {TRIALS} trials",
        o.local
    );
    for rate in [None, Some(o.rate.as_str())] {
        m.limit_rate(rate).map_err(anyhow::Error::msg)?;
        let ring = job(&m, &o, "ring")?;
        let hier = job(&m, &o, "hierarchical")?;
        println!("\nlink: {}", rate.unwrap_or("unlimited"));
        println!(
            "{:>8} {:>10} {:>14} {:>16}",
            "size", "ring", "hierarchical", "hierarchical/ring"
        );
        for ((size, r), (_, h)) in ring.iter().zip(&hier) {
            println!(
                "{:>4} MiB {:>10.3} {:>14.3} {:>15.2}x",
                size >> 20,
                bus(*size, *r),
                bus(*size, *h),
                r / h
            );
        }
    }
    Ok(())
}
