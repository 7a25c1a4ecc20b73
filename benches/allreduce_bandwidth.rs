//! Host all-reduce bandwidth (shared memory / Unix sockets, and TCP only) beside gloo's and
//! the machine's loopback TCP throughput, measured side by side in one run.
//!
//!     cargo bench --bench allreduce_bandwidth
//!     cargo bench --bench allreduce_bandwidth -- --min-kib 1024 --repeat 3
//!     cargo bench --bench allreduce_bandwidth -- --world 3 --max-mib 16 --only tcp --no-gloo
//!
//! Each round first measures loopback TCP (one stream, and two streams in opposite directions
//! at once, the pattern of a two-rank ring). Then it starts `--world` ranks (default 2) on
//! 127.0.0.1 with `launch::spawn_with_config`, twice: once as they run by default (shared
//! memory or Unix-domain sockets between ranks of one machine) and once with TCP only
//! (`CANDLE_PARALLEL_UNIX_SOCKETS=0`). Each job times f32 `all_reduce(sum)` of CPU tensors from
//! `--min-kib` KiB to `--max-mib` MiB (sizes growing 4×): 3 warm-up calls, then 5 trials of
//! clamp(64 MiB / size, 3, 500) calls, the median trial reported as algorithm and bus
//! bandwidth (nccl-tests' definitions: bus = algorithm × 2(n-1)/n). Last it runs gloo, through
//! `scripts/torch_allreduce_bench.py` (torch.distributed, the same sizes and trials), when
//! `python3 -c "import torch"` works; else it says why it skips it.
//!
//! Each job (and the gloo twin) also times point-to-point messages: rank 0 sends rank 1 three
//! 64 MiB f32 tensors, rank 1 answers with one element, 5 trials, the median's throughput
//! (bytes sent / time) reported in the last row of the table.
//!
//! With `--repeat N` it does all that N times, interleaved, and the summary table gives each
//! figure's median over the rounds. Reports; asserts nothing.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_parallel::distributed::{ProcessGroup, ReduceOp};
use candle_parallel::launch::{self, LaunchConfig};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Where rank 0 writes its figures for the launching process: one `SIZE BUSBW` line per size,
/// and a `send SIZE GBPS` line.
const OUT_VAR: &str = "ALLREDUCE_BENCH_OUT";

/// The point-to-point message the bench times.
const SEND_BYTES: usize = 64 << 20;
/// Messages per trial.
const SENDS: usize = 3;

struct Options {
    world: usize,
    min_kib: usize,
    max_mib: usize,
    repeat: usize,
    /// Which of our transports to run: "all", "default" or "tcp".
    only: String,
    gloo: bool,
}

fn parse() -> Result<Options> {
    let mut o = Options {
        world: 2,
        min_kib: 4,
        max_mib: 64,
        repeat: 1,
        only: "all".into(),
        gloo: true,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |flag: &str| -> Result<String> {
            args.next().with_context(|| format!("{flag} needs a value"))
        };
        let number = |flag: &str, v: String| -> Result<usize> {
            v.parse().with_context(|| format!("{flag}: {v:?}"))
        };
        match a.as_str() {
            "--world" => o.world = number("--world", value("--world")?)?,
            "--min-kib" => o.min_kib = number("--min-kib", value("--min-kib")?)?,
            "--max-mib" => o.max_mib = number("--max-mib", value("--max-mib")?)?,
            "--repeat" => o.repeat = number("--repeat", value("--repeat")?)?,
            "--only" => o.only = value("--only")?,
            "--no-gloo" => o.gloo = false,
            "--bench" => {}
            other => bail!(
                "unknown argument {other:?} (known: --world N --min-kib N --max-mib N \
                 --repeat N --only all|default|tcp --no-gloo)"
            ),
        }
    }
    if o.world < 2 || o.max_mib == 0 || o.min_kib == 0 || o.repeat == 0 {
        bail!("--world must be at least 2, --min-kib, --max-mib and --repeat positive");
    }
    if !["all", "default", "tcp"].contains(&o.only.as_str()) {
        bail!("--only must be all, default or tcp, not {:?}", o.only);
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

fn sizes(o: &Options) -> Vec<usize> {
    std::iter::successors(Some(o.min_kib << 10), |s| Some(s * 4))
        .take_while(|&s| s <= o.max_mib << 20)
        .collect()
}

fn label(size: usize) -> String {
    if size >= 1 << 20 {
        format!("{} MiB", size >> 20)
    } else {
        format!("{} KiB", size >> 10)
    }
}

fn rank_main(o: &Options) -> Result<()> {
    let pg = ProcessGroup::from_env(&Device::Cpu)?;
    let n = pg.world_size();
    let mut out = String::new();
    if pg.rank() == 0 {
        let links: Vec<&str> = pg.transports().into_iter().flatten().collect();
        println!(
            "\nall_reduce(sum), f32 CPU tensors, {n} ranks, links: {}",
            links.join(", ")
        );
        println!(
            "{:>10} {:>7} {:>12} {:>12} {:>12} {:>9}",
            "size", "iters", "median/op", "algbw GB/s", "busbw GB/s", "rank0 cpu"
        );
    }
    pg.barrier()?;
    for size in sizes(o) {
        let x = Tensor::ones(size / 4, DType::F32, &Device::Cpu)?;
        let iters = ((64usize << 20) / size).clamp(3, 500);
        for _ in 0..3 {
            pg.all_reduce(&x, ReduceOp::Sum)?;
        }
        // The machine is shared and noisy: the median of several trials.
        let mut trials = Vec::with_capacity(TRIALS);
        let mut y = x.clone();
        let (cpu0, wall0) = (cpu_seconds(), Instant::now());
        for _ in 0..TRIALS {
            pg.barrier()?;
            let started = Instant::now();
            for _ in 0..iters {
                y = pg.all_reduce(&x, ReduceOp::Sum)?;
            }
            trials.push(started.elapsed().as_secs_f64() / iters as f64);
        }
        // This process's CPU time (every thread) over the trials' wall time: near the
        // machine's core count divided by the ranks, the collective is CPU-bound.
        let cpu = (cpu_seconds() - cpu0) / wall0.elapsed().as_secs_f64();
        trials.sort_by(f64::total_cmp);
        let secs = trials[TRIALS / 2];
        anyhow::ensure!(
            y.narrow(0, 0, 1)?.to_vec1::<f32>()?[0] == n as f32,
            "wrong sum"
        );
        pg.barrier()?;
        if pg.rank() == 0 {
            let algbw = size as f64 / secs / 1e9;
            let busbw = algbw * 2.0 * (n - 1) as f64 / n as f64;
            println!(
                "{:>10} {iters:>7} {:>10.1}us {algbw:>12.3} {busbw:>12.3} {:>8.0}%",
                label(size),
                secs * 1e6,
                cpu * 100.0
            );
            out.push_str(&format!("{size} {busbw}\n"));
        }
    }
    if n >= 2 {
        let gbps = send_throughput(&pg)?;
        if pg.rank() == 0 {
            println!(
                "send {}, rank 0 to rank 1: {gbps:.3} GB/s",
                label(SEND_BYTES)
            );
            out.push_str(&format!("send {SEND_BYTES} {gbps}\n"));
        }
    }
    if let (0, Some(path)) = (pg.rank(), std::env::var_os(OUT_VAR)) {
        std::fs::write(&path, out).with_context(|| format!("writing {path:?}"))?;
    }
    Ok(())
}

/// Rank 0 sends rank 1 [`SENDS`] messages of [`SEND_BYTES`], rank 1 answers with one element:
/// the median trial's throughput in GB/s, as rank 0 sees it (other ranks wait).
fn send_throughput(pg: &ProcessGroup) -> Result<f64> {
    let x = Tensor::ones(SEND_BYTES / 4, DType::F32, &Device::Cpu)?;
    let ack = Tensor::ones(1, DType::F32, &Device::Cpu)?;
    let exchange = || -> Result<()> {
        match pg.rank() {
            0 => {
                for _ in 0..SENDS {
                    pg.send(&x, 1)?;
                }
                pg.recv(1, 1, DType::F32)?;
            }
            1 => {
                for _ in 0..SENDS {
                    let got = pg.recv(0, SEND_BYTES / 4, DType::F32)?;
                    anyhow::ensure!(
                        got.narrow(0, 0, 1)?.to_vec1::<f32>()?[0] == 1.0,
                        "wrong data"
                    );
                }
                pg.send(&ack, 0)?;
            }
            _ => {}
        }
        Ok(())
    };
    exchange()?; // warm-up
    let mut trials = Vec::with_capacity(TRIALS);
    for _ in 0..TRIALS {
        pg.barrier()?;
        let started = Instant::now();
        exchange()?;
        trials.push(started.elapsed().as_secs_f64());
    }
    trials.sort_by(f64::total_cmp);
    Ok((SENDS * SEND_BYTES) as f64 / trials[TRIALS / 2] / 1e9)
}

/// The CPU time this process used so far (user and system, every thread), in seconds.
fn cpu_seconds() -> f64 {
    // /proc/self/stat fields 14 and 15: utime and stime, in clock ticks (100 per second on
    // Linux). Elsewhere: nothing to show.
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return f64::NAN;
    };
    let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    // Fields from the third (the state) on: utime and stime are the 12th and 13th.
    let f: Vec<&str> = after_name.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok());
    tick(11)
        .zip(tick(12))
        .map_or(f64::NAN, |(u, s)| (u + s) / 100.0)
}

/// Bus bandwidth by size, from `SIZE BUSBW` lines (after `prefix`, when given).
fn parse_figures(text: &str, prefix: Option<&str>) -> BTreeMap<usize, f64> {
    text.lines()
        .filter_map(|l| match prefix {
            Some(p) => l.strip_prefix(p),
            None => Some(l),
        })
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
        })
        .collect()
}

/// The point-to-point throughput from a `PREFIX SIZE GBPS` line, keyed as the table's last row.
fn parse_send(text: &str, prefix: &str) -> BTreeMap<usize, f64> {
    parse_figures(text, Some(prefix))
        .into_values()
        .map(|gbps| (SEND_ROW, gbps))
        .collect()
}

/// The table's key for the point-to-point row (after every all-reduce size).
const SEND_ROW: usize = usize::MAX;

/// Runs our ranks, by default (`unix` true) or over TCP only, and returns rank 0's figures:
/// bus bandwidth by size, and the send throughput under [`SEND_ROW`].
fn ours(o: &Options, unix: bool, scratch: &Path) -> Result<BTreeMap<usize, f64>> {
    let file = scratch.join(if unix { "default" } else { "tcp" });
    let _ = std::fs::remove_file(&file);
    let config = LaunchConfig {
        nproc_per_node: o.world,
        prefix_output: false,
        env: vec![
            (
                "CANDLE_PARALLEL_UNIX_SOCKETS".into(),
                if unix { "1" } else { "0" }.into(),
            ),
            (OUT_VAR.into(), file.clone().into()),
        ],
        ..LaunchConfig::default()
    };
    launch::spawn_with_config(&config, |_rank| rank_main(o))?;
    let text = std::fs::read_to_string(&file).with_context(|| format!("reading {file:?}"))?;
    let mut figures = parse_figures(&text, None);
    figures.extend(parse_send(&text, "send "));
    Ok(figures)
}

/// Why gloo cannot run here, if it cannot.
fn gloo_missing(script: &Path) -> Option<String> {
    if !script.exists() {
        return Some(format!("{} is missing", script.display()));
    }
    match Command::new("python3")
        .args(["-c", "import torch"])
        .output()
    {
        Ok(out) if out.status.success() => None,
        Ok(_) => Some("python3 cannot import torch".into()),
        Err(e) => Some(format!("python3 does not run ({e})")),
    }
}

/// gloo's figures, from the twin script.
fn gloo(o: &Options, script: &Path) -> Result<BTreeMap<usize, f64>> {
    let out = Command::new("python3")
        .arg(script)
        .args(["--world", &o.world.to_string()])
        .args(["--min-kib", &o.min_kib.to_string()])
        .args(["--max-mib", &o.max_mib.to_string()])
        .output()
        .context("running the gloo twin")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "{} failed ({}): {}",
            script.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    print!(
        "{}",
        text.lines()
            // Not the machine-readable lines.
            .filter(|l| !l.starts_with("gloo-send ") && parse_figures(l, Some("gloo ")).is_empty())
            .map(|l| format!("{l}\n"))
            .collect::<String>()
    );
    let mut figures = parse_figures(&text, Some("gloo "));
    figures.extend(parse_send(&text, "gloo-send "));
    Ok(figures)
}

fn median(mut xs: Vec<f64>) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    xs.sort_by(f64::total_cmp);
    let m = xs.len() / 2;
    Some(if xs.len() % 2 == 1 {
        xs[m]
    } else {
        (xs[m - 1] + xs[m]) / 2.0
    })
}

/// One figure per round, by column and size.
#[derive(Default)]
struct Figures {
    default: BTreeMap<usize, Vec<f64>>,
    tcp: BTreeMap<usize, Vec<f64>>,
    gloo: BTreeMap<usize, Vec<f64>>,
    stream: Vec<f64>,
}

fn add(to: &mut BTreeMap<usize, Vec<f64>>, from: BTreeMap<usize, f64>) {
    for (size, v) in from {
        to.entry(size).or_default().push(v);
    }
}

fn main() -> Result<()> {
    let o = parse()?;
    if std::env::var_os("RANK").is_some() {
        // A rank: runs `rank_main` and exits.
        return launch::spawn_with_config(&LaunchConfig::default(), |_rank| rank_main(&o))
            .map_err(Into::into);
    }
    let scratch = std::env::temp_dir().join(format!("allreduce-bench-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/torch_allreduce_bench.py");
    let gloo_skip = if o.gloo {
        gloo_missing(&script)
    } else {
        Some("--no-gloo".into())
    };
    if let Some(why) = &gloo_skip {
        println!("gloo: skipped, {why}");
    }
    let mut figs = Figures::default();
    for round in 1..=o.repeat {
        if o.repeat > 1 {
            println!("\n=== round {round} of {} ===", o.repeat);
        }
        let (one, two) = (loopback(1)?, loopback(2)?);
        println!(
            "loopback TCP: one stream {one:.2} GB/s; two streams, opposite directions {two:.2} GB/s"
        );
        figs.stream.push(one);
        if o.only != "tcp" {
            add(&mut figs.default, ours(&o, true, &scratch)?);
        }
        if o.only != "default" {
            add(&mut figs.tcp, ours(&o, false, &scratch)?);
        }
        if gloo_skip.is_none() {
            add(&mut figs.gloo, gloo(&o, &script)?);
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    summary(&o, &figs);
    Ok(())
}

fn summary(o: &Options, figs: &Figures) {
    let stream = median(figs.stream.clone()).unwrap_or(f64::NAN);
    let rounds = if o.repeat > 1 {
        format!(", medians of {} rounds", o.repeat)
    } else {
        String::new()
    };
    println!(
        "\nbus bandwidth, GB/s: all_reduce(sum), f32, {} ranks{rounds}; one loopback TCP stream \
         {stream:.2} GB/s; last row: a 64 MiB send's throughput, rank 0 to rank 1",
        o.world
    );
    println!(
        "{:>14} {:>14} {:>14} {:>8} {:>12} {:>14}",
        "size", "ours default", "ours TCP", "gloo", "TCP / gloo", "TCP / stream"
    );
    let get = |m: &BTreeMap<usize, Vec<f64>>, s: usize| m.get(&s).and_then(|v| median(v.clone()));
    let cell = |v: Option<f64>, w: usize, p: usize, unit: &str| match v {
        Some(v) => format!("{:>w$}", format!("{v:.p$}{unit}")),
        None => format!("{:>w$}", "-"),
    };
    let rows = sizes(o)
        .into_iter()
        .chain((o.world >= 2).then_some(SEND_ROW));
    for size in rows {
        let (d, t, g) = (
            get(&figs.default, size),
            get(&figs.tcp, size),
            get(&figs.gloo, size),
        );
        let name = if size == SEND_ROW {
            format!("send {}", label(SEND_BYTES))
        } else {
            label(size)
        };
        println!(
            "{:>14} {} {} {} {} {}",
            name,
            cell(d, 14, 3, ""),
            cell(t, 14, 3, ""),
            cell(g, 8, 3, ""),
            cell(t.zip(g).map(|(t, g)| t / g), 12, 2, "x"),
            cell(t.map(|t| t / stream * 100.0), 14, 0, "%"),
        );
    }
}
