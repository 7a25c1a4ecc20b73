//! TCP backend all-reduce bandwidth, beside the machine's loopback TCP throughput.
//!
//!     cargo bench --bench allreduce_bandwidth
//!     cargo bench --bench allreduce_bandwidth -- --world 3 --min-kib 1024 --max-mib 16
//!
//! First measures loopback TCP (one stream, and two streams in opposite directions at once, the
//! pattern of a two-rank ring). Then, twice, starts `--world` ranks (default 2) on 127.0.0.1
//! with `launch::spawn_with_config`: once as they run by default (Unix-domain sockets between ranks of
//! one machine) and once with TCP only (`CANDLE_PARALLEL_UNIX_SOCKETS=0`). Each job times f32
//! `all_reduce(sum)` of CPU tensors from 4 KiB to `--max-mib` MiB and prints algorithm and bus
//! bandwidth (nccl-tests' definitions: bus = algorithm × 2(n-1)/n). Reports; asserts nothing.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_parallel::distributed::{ProcessGroup, ReduceOp};
use candle_parallel::launch::{self, LaunchConfig};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

struct Options {
    world: usize,
    min_kib: usize,
    max_mib: usize,
}

fn parse() -> Result<Options> {
    let mut o = Options {
        world: 2,
        min_kib: 4,
        max_mib: 64,
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
            "--min-kib" => o.min_kib = value("--min-kib")?,
            "--max-mib" => o.max_mib = value("--max-mib")?,
            "--bench" => {}
            other => bail!("unknown argument {other:?}"),
        }
    }
    if o.world < 2 || o.max_mib == 0 || o.min_kib == 0 {
        bail!("--world must be at least 2, --min-kib and --max-mib positive");
    }
    Ok(o)
}

const STREAM_BYTES: usize = 2 << 30;
/// Timed trials per size; the median is reported.
const TRIALS: usize = 5;
const BLOCK: usize = 1 << 20;

/// Sends `bytes` through `w` in 1 MiB writes.
fn pump(mut w: TcpStream, bytes: usize) -> std::io::Result<()> {
    let block = vec![7u8; BLOCK];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(BLOCK);
        w.write_all(&block[..n])?;
        left -= n;
    }
    Ok(())
}

/// Reads until the peer closes.
fn drain(mut r: TcpStream) -> std::io::Result<usize> {
    let mut buf = vec![0u8; BLOCK];
    let mut total = 0;
    loop {
        match r.read(&mut buf)? {
            0 => return Ok(total),
            n => total += n,
        }
    }
}

/// GB/s of `streams` loopback connections, half of them in each direction, all at once.
fn loopback(streams: usize) -> Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let pairs: Vec<(TcpStream, TcpStream)> = (0..streams)
        .map(|_| -> Result<_> {
            let a = TcpStream::connect(addr)?;
            let (b, _) = listener.accept()?;
            Ok((a, b))
        })
        .collect::<Result<_>>()?;
    let per = STREAM_BYTES / streams;
    let started = Instant::now();
    let received: usize = std::thread::scope(|s| -> Result<usize> {
        let mut readers = Vec::new();
        for (i, (a, b)) in pairs.into_iter().enumerate() {
            let (tx, rx) = if i % 2 == 0 { (a, b) } else { (b, a) };
            s.spawn(move || pump(tx, per));
            readers.push(s.spawn(move || drain(rx)));
        }
        let mut total = 0;
        for r in readers {
            total += r.join().expect("reader thread")?;
        }
        Ok(total)
    })?;
    Ok(received as f64 / started.elapsed().as_secs_f64() / 1e9)
}

fn rank_main(o: &Options) -> Result<()> {
    let pg = ProcessGroup::from_env(&Device::Cpu)?;
    let n = pg.world_size();
    if pg.rank() == 0 {
        let links: Vec<&str> = pg.transports().into_iter().flatten().collect();
        println!(
            "\nall_reduce(sum), f32 CPU tensors, {n} ranks, links: {}",
            links.join(", ")
        );
        println!(
            "{:>10} {:>7} {:>12} {:>12} {:>12}",
            "size", "iters", "median/op", "algbw GB/s", "busbw GB/s"
        );
    }
    pg.barrier()?;
    let mut size = o.min_kib << 10;
    while size <= o.max_mib << 20 {
        let x = Tensor::ones(size / 4, DType::F32, &Device::Cpu)?;
        let iters = ((64usize << 20) / size).clamp(3, 500);
        for _ in 0..3 {
            pg.all_reduce(&x, ReduceOp::Sum)?;
        }
        // The machine is shared and noisy: the median of several trials.
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
        let secs = trials[TRIALS / 2];
        anyhow::ensure!(y.to_vec1::<f32>()?[0] == n as f32, "wrong sum");
        pg.barrier()?;
        if pg.rank() == 0 {
            let algbw = size as f64 / secs / 1e9;
            let busbw = algbw * 2.0 * (n - 1) as f64 / n as f64;
            let label = if size >= 1 << 20 {
                format!("{} MiB", size >> 20)
            } else {
                format!("{} KiB", size >> 10)
            };
            println!(
                "{label:>10} {iters:>7} {:>10.1}us {algbw:>12.3} {busbw:>12.3}",
                secs * 1e6
            );
        }
        size *= 4;
    }
    Ok(())
}

fn main() -> Result<()> {
    let o = parse()?;
    if std::env::var_os("RANK").is_none() {
        println!(
            "loopback TCP: one stream {:.2} GB/s; two streams, opposite directions {:.2} GB/s",
            loopback(1)?,
            loopback(2)?
        );
    }
    for unix in ["1", "0"] {
        let config = LaunchConfig {
            nproc_per_node: o.world,
            prefix_output: false,
            env: vec![("CANDLE_PARALLEL_UNIX_SOCKETS".into(), unix.into())],
            ..LaunchConfig::default()
        };
        launch::spawn_with_config(&config, |_rank| rank_main(&o))?;
    }
    Ok(())
}
