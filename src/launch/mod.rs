//! Starting N ranks: the `candle-run` launcher (torchrun's analogue) and [`spawn`]
//! (`torch.multiprocessing.spawn`'s).
//!
//! The launcher starts one process per rank with torchrun's environment (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) and the job token
//! `CANDLE_PARALLEL_TOKEN` (and, with several ranks and no choice of yours, `RAYON_NUM_THREADS`:
//! the machine's cores divided among them, so that their compute pools do not fight over the
//! cores, as torchrun sets `OMP_NUM_THREADS=1`), prefixes each line of their output with `[rankN]: `, forwards
//! Ctrl-C and SIGTERM to them (SIGHUP as SIGTERM), and when one rank fails stops the others
//! (SIGTERM, then SIGKILL after a grace period) and reports the failing rank's exit status.
//! Every rank runs in its own process group, which is killed as a whole when the rank ends. If
//! the launcher itself dies (SIGKILL, a crash), the kernel kills the ranks and a guardian
//! process kills what they started and removes the launcher's temporary folder: no process
//! outlives the launcher.
//!
//! With `max_restarts` (`--max-restarts N`, torchrun's elastic restarts) a failed job is
//! started again, up to N times: every rank is stopped as above, then a new round starts the
//! same world with a new rendezvous. Each rank learns its round from
//! `TORCHELASTIC_RESTART_COUNT` ([`restart_count`]; 0 in the first round) and resumes from its
//! last checkpoint (see `checkpoint::resume`). Each round's job token is derived from the
//! launcher's and the round's number, so a straggling rank of an old round is refused by the
//! new round's rendezvous. On several machines every launcher restarts when its own ranks fail,
//! which they do when they lose a peer of another machine, so all machines move to the next
//! round together. A Ctrl-C or SIGTERM to the launcher never restarts: the job stops.
//!
//! With elastic membership ([`ElasticConfig`], `--nnodes MIN:MAX`) the launchers meet in a
//! rendezvous hosted by the launcher on the master's address (torchrun's c10d rendezvous): each
//! round runs with the MIN to MAX machines that are there, numbered anew; a round that failed
//! is followed by one with the machines still there, and a machine that arrives while a round
//! runs makes the running launchers restart so that it joins (see docs/LAUNCHING.md).
//!
//! ```no_run
//! use candle_core::{Device, Tensor};
//! use candle_parallel::distributed::{ProcessGroup, ReduceOp};
//! use candle_parallel::launch;
//!
//! fn main() -> candle_parallel::Result<()> {
//!     // Re-runs this program as 4 ranks; in each rank the closure runs, in the parent `spawn`
//!     // waits for them all.
//!     launch::spawn(4, |_rank| {
//!         let pg = ProcessGroup::from_env(&Device::Cpu)?;
//!         let x = Tensor::new(&[pg.rank() as f32], &Device::Cpu)?;
//!         println!("{}", pg.all_reduce(&x, ReduceOp::Sum)?);
//!         Ok::<(), candle_parallel::Error>(())
//!     })
//! }
//! ```

mod cli;
mod elastic;
mod guardian;
mod signals;
mod supervisor;

pub use cli::{parse_args, Parsed, USAGE};
pub use supervisor::launch;

pub use crate::distributed::error_file::{record_error, ERROR_FILE_VAR};
use crate::distributed::TOKEN_VAR;

/// The variable that tells each rank its round: 0 in the first, `k` after the `k`-th restart
/// (torchrun's name).
pub const RESTART_COUNT_VAR: &str = "TORCHELASTIC_RESTART_COUNT";
/// The variable that tells each rank how many restarts the job may take (torchrun's name).
pub const MAX_RESTARTS_VAR: &str = "TORCHELASTIC_MAX_RESTARTS";
use crate::error::{Error, Result};
use std::ffi::OsString;
use std::time::Duration;

/// What to start, and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Ranks on this machine.
    pub nproc_per_node: usize,
    /// Machines in the job.
    pub nnodes: usize,
    /// This machine's index, in `0..nnodes`.
    pub node_rank: usize,
    /// Address of the machine running rank 0.
    pub master_addr: String,
    /// Port of rank 0's store; `None` picks a free port (single machine only).
    pub master_port: Option<u16>,
    /// How long ranks have to exit after SIGTERM before they are killed.
    pub grace_period: Duration,
    /// Prefix each output line with `[rankN]: `.
    pub prefix_output: bool,
    /// The job token; `None` takes `CANDLE_PARALLEL_TOKEN` from the environment or, on a single
    /// machine, makes a random one.
    pub token: Option<String>,
    /// Extra environment variables for every rank.
    pub env: Vec<(OsString, OsString)>,
    /// How many times a failed job is started again (a new round of every rank) before the
    /// launcher gives up and reports the failure; 0, the default, never restarts (torchrun's
    /// `--max-restarts`).
    pub max_restarts: usize,
    /// Elastic membership (`--nnodes MIN:MAX`): machines meet in rounds at the master's
    /// address, each round with the machines that are there; `None` (a plain `--nnodes N`) keeps
    /// a fixed world of `nnodes` machines numbered by `node_rank`. See [`ElasticConfig`].
    pub elastic: Option<ElasticConfig>,
}

/// How the machines of an elastic job (`candle-run --nnodes MIN:MAX`) meet: torchrun's
/// c10d rendezvous. See `launch::elastic`'s docs (docs/LAUNCHING.md, "Elastic membership").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ElasticConfig {
    /// The fewest machines a round runs with.
    pub min_nodes: usize,
    /// The most machines a round runs with; a round closes as soon as this many joined.
    pub max_nodes: usize,
    /// How long a round waits for more machines once `min_nodes` have joined
    /// (`--rdzv-last-call`, torchrun's `last_call_timeout`).
    pub last_call: Duration,
    /// How long a launcher waits for a round to close before it fails
    /// (`--rdzv-join-timeout`, torchrun's `join_timeout`).
    pub join_timeout: Duration,
    /// How long a machine's launcher may be silent before the rendezvous counts it as lost
    /// (`--rdzv-keep-alive`; torchrun: 3 missed heartbeats of 5 s).
    pub keep_alive: Duration,
}

impl Default for ElasticConfig {
    fn default() -> Self {
        Self {
            min_nodes: 1,
            max_nodes: 1,
            last_call: Duration::from_secs(30),
            join_timeout: Duration::from_secs(600),
            keep_alive: Duration::from_secs(15),
        }
    }
}

impl Default for LaunchConfig {
    fn default() -> Self {
        Self {
            nproc_per_node: 1,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            grace_period: Duration::from_secs(5),
            prefix_output: true,
            token: None,
            env: Vec::new(),
            max_restarts: 0,
            elastic: None,
        }
    }
}

impl LaunchConfig {
    /// Checks the numbers before anything starts.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str, detail: String| {
            Err(Error::Config {
                what: what.into(),
                detail,
            })
        };
        if self.nproc_per_node == 0 {
            return bad("--nproc-per-node", "0; start at least one process".into());
        }
        if self.nnodes == 0 {
            return bad("--nnodes", "0; a job has at least one machine".into());
        }
        if self.node_rank >= self.nnodes {
            return bad(
                "--node-rank",
                format!("{} is not below --nnodes {}", self.node_rank, self.nnodes),
            );
        }
        if self.nnodes > 1 && self.master_port.is_none() {
            return bad(
                "--master-port",
                "required with several machines: every machine must use the same port".into(),
            );
        }
        if self.master_port == Some(0) {
            return bad("--master-port", "0 is not a port".into());
        }
        if let Some(e) = &self.elastic {
            if e.min_nodes == 0 || e.min_nodes > e.max_nodes {
                return bad(
                    "--nnodes",
                    format!(
                        "{}:{} is not a range MIN:MAX with 1 <= MIN <= MAX",
                        e.min_nodes, e.max_nodes
                    ),
                );
            }
            if self.master_port.is_none() {
                return bad(
                    "--master-port",
                    "required with --nnodes MIN:MAX: every machine meets at the same port".into(),
                );
            }
            if e.keep_alive < Duration::from_secs(2) {
                return bad(
                    "--rdzv-keep-alive",
                    format!(
                        "{:?} is shorter than 2 s: launchers send a heartbeat every second",
                        e.keep_alive
                    ),
                );
            }
        }
        let max = crate::distributed::MAX_WORLD_SIZE;
        if self.nnodes.saturating_mul(self.nproc_per_node) > max {
            return bad(
                "--nnodes x --nproc-per-node",
                format!(
                    "{} ranks is above the limit of {max}",
                    self.nnodes.saturating_mul(self.nproc_per_node)
                ),
            );
        }
        Ok(())
    }
}

/// Runs `f(rank)` in `nprocs` copies of this program (`torch.multiprocessing.spawn`).
///
/// In the parent, starts the copies with torchrun's environment (ranks meet on a free port of
/// 127.0.0.1) and returns when all have finished: `Ok` when every rank succeeded, else the
/// error of the rank that failed first. In a rank, runs `f` with the rank and exits the process
/// with status 0 (or 1, with the error on stderr and recorded for the launcher) — `spawn` never
/// returns there. A process that already is a rank (started by `candle-run`, torchrun, srun
/// or mpirun: `RANK`, `OMPI_COMM_WORLD_RANK`, `PMI_RANK` or `SLURM_PROCID` is set) runs `f`
/// itself, whatever `nprocs`, so a program works started either way; `OMP_NUM_THREADS` sizes
/// its compute pool first when `RAYON_NUM_THREADS` is unset. Call it early in `main`: each
/// copy runs `main` up to this call.
pub fn spawn<F, E>(nprocs: usize, f: F) -> Result<()>
where
    F: FnOnce(usize) -> std::result::Result<(), E>,
    E: std::fmt::Display,
{
    let config = LaunchConfig {
        nproc_per_node: nprocs,
        ..LaunchConfig::default()
    };
    spawn_with_config(&config, f)
}

/// The old name of [`spawn_with_config`].
#[deprecated(
    since = "0.1.0",
    note = "use `spawn_with_config`, as the crate's `with_config`s"
)]
pub fn spawn_with<F, E>(config: &LaunchConfig, f: F) -> Result<()>
where
    F: FnOnce(usize) -> std::result::Result<(), E>,
    E: std::fmt::Display,
{
    spawn_with_config(config, f)
}

/// As [`spawn`], with the launcher's options (`config.nproc_per_node` ranks).
pub fn spawn_with_config<F, E>(config: &LaunchConfig, f: F) -> Result<()>
where
    F: FnOnce(usize) -> std::result::Result<(), E>,
    E: std::fmt::Display,
{
    if let Some(rank) = rank_given() {
        crate::distributed::honour_omp_num_threads();
        let code = match f(rank) {
            Ok(()) => 0,
            Err(e) => {
                record_error(&e);
                // Not through `log`: this is the process's last word before it exits, what
                // `main` returning `Err` would print, and it must show without a logger.
                eprintln!("rank {rank} failed: {e}");
                1
            }
        };
        std::process::exit(code);
    }
    let exe = std::env::current_exe().map_err(|source| Error::Io {
        context: "finding this program to spawn its ranks".into(),
        source,
    })?;
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    launch(config, exe.as_os_str(), &args)
}

/// This process's rank when a launcher started it: `RANK` (candle-run, torchrun), Open MPI's
/// `OMPI_COMM_WORLD_RANK`, MPICH's `PMI_RANK` or Slurm's `SLURM_PROCID`, in the order
/// `Rendezvous::from_env` reads them.
fn rank_given() -> Option<usize> {
    ["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"]
        .iter()
        .find_map(|name| std::env::var(name).ok().and_then(|v| v.trim().parse().ok()))
}

/// The job token: the configured one, else the environment's, else (one machine) a fresh one.
/// With restarts it must leave room for [`round_token`]'s suffix.
fn token(config: &LaunchConfig) -> Result<String> {
    let token = if let Some(t) = &config.token {
        t.clone()
    } else if let Ok(t) = std::env::var(TOKEN_VAR) {
        t
    } else if config.nnodes > 1 {
        String::new() // machines cannot agree on a random one
    } else {
        let (a, b) = (crate::rng::fresh_seed(), crate::rng::fresh_seed());
        format!("{a:016x}{b:016x}")
    };
    if config.max_restarts > 0 && token.len() > MAX_BASE_TOKEN {
        return Err(Error::Config {
            what: TOKEN_VAR.into(),
            detail: format!(
                "{} bytes, longer than {MAX_BASE_TOKEN}, which leaves no room for the round's \
                 suffix with --max-restarts; use a shorter token",
                token.len()
            ),
        });
    }
    Ok(token)
}

/// The longest launcher token that leaves room for [`round_token`]'s suffix within the wire's
/// limit of 1024 bytes.
const MAX_BASE_TOKEN: usize = 1000;

/// The job token of round `round` (0 first): the launcher's own in the first round, then the
/// launcher's with the round appended, so that every machine derives the same one and a rank
/// of another round is refused as a stranger.
pub fn round_token(token: &str, round: usize) -> String {
    match round {
        0 => token.to_string(),
        k => format!("{token}/restart-{k}"),
    }
}

/// This rank's round: how many times the launcher restarted the job before starting it
/// (`TORCHELASTIC_RESTART_COUNT`, 0 when unset, as in a first round or a job started without
/// a launcher).
pub fn restart_count() -> usize {
    std::env::var(RESTART_COUNT_VAR)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The exit code a launcher should end with for `result`.
pub fn exit_code(result: &Result<()>) -> i32 {
    match result {
        Ok(()) => 0,
        Err(Error::RankFailed { code, .. } | Error::Interrupted { code, .. }) => *code,
        Err(Error::Config { .. }) => 2,
        Err(_) => 1,
    }
}

/// A port nobody listens on at `addr` right now.
fn free_port(addr: &str) -> Result<u16> {
    let listener = std::net::TcpListener::bind((addr, 0)).map_err(|source| Error::Io {
        context: format!("finding a free port on {addr} (is --master-addr this machine?)"),
        source,
    })?;
    Ok(listener
        .local_addr()
        .map_err(|source| Error::Io {
            context: "reading the free port".into(),
            source,
        })?
        .port())
}
