//! Starting, watching and stopping the ranks of one machine.

use super::elastic::{Agent, Assignment, Halt};
use super::guardian::Guardian;
use super::{
    free_port, round_token, signals, token, ElasticConfig, LaunchConfig, MAX_RESTARTS_VAR,
    RESTART_COUNT_VAR,
};
use crate::distributed::{OMP_THREADS_VAR, THREADS_VAR, TOKEN_VAR};
use crate::error::{Error, Result};
use std::ffi::{OsStr, OsString};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const POLL: Duration = Duration::from_millis(20);
/// How long ranks may take to end by themselves after another failed.
const SETTLE: Duration = Duration::from_secs(1);

struct Rank {
    rank: usize,
    child: Child,
    status: Option<ExitStatus>,
    /// Where the rank may record why it failed.
    error_file: std::path::PathBuf,
}

impl Rank {
    /// When and why the rank said it failed, and whom its group lost before; see
    /// `launch::record_error` and `launch::note_loss`.
    fn recorded_error(&self) -> Option<Recorded> {
        let text = std::fs::read_to_string(&self.error_file).ok()?;
        let (time, message) = text.split_once('\n')?;
        let mut lost = self.error_file.clone().into_os_string();
        lost.push(".lost");
        let blame = match std::fs::read_to_string(lost) {
            Ok(note) => Blame::Other(note.trim().parse().ok()),
            Err(_) => Blame::Own,
        };
        Some(Recorded {
            time: time.parse().ok()?,
            blame,
            message: message.to_string(),
        })
    }

    /// The rank's process group: its process and everything it started.
    fn group(&self) -> u32 {
        self.child.id()
    }

    fn running(&self) -> bool {
        self.status.is_none()
    }

    /// Records the exit status if the rank has ended, and kills what it left behind.
    fn reap(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            if let Ok(Some(st)) = self.child.try_wait() {
                self.status = Some(st);
                signals::signal_group(self.group(), libc::SIGKILL);
                return Some(st);
            }
        }
        None
    }
}

/// Whom a rank's recorded failure blames.
enum Blame {
    /// The rank failed by itself.
    Own,
    /// It lost another rank (which one, when known).
    Other(Option<usize>),
}

struct Recorded {
    time: u128,
    blame: Blame,
    message: String,
}

/// "exited with status 3" / "killed by SIGKILL", and the shell's exit code for it.
fn describe(st: ExitStatus) -> (String, i32) {
    match (st.code(), st.signal()) {
        (Some(code), _) => (format!("exited with status {code}"), code),
        (None, Some(sig)) => (format!("was killed by {}", signals::name(sig)), 128 + sig),
        (None, None) => ("ended in an unknown way".into(), 1),
    }
}

/// Starts `program args` as this machine's ranks and waits for them, starting them again
/// after a failure up to `config.max_restarts` times; see [`super`].
pub fn launch(config: &LaunchConfig, program: &OsStr, args: &[OsString]) -> Result<()> {
    config.validate()?;
    let threads = config.env.iter().rev().find(|(k, _)| k == THREADS_VAR);
    let threads = match threads {
        Some((_, v)) => Some(v.to_string_lossy().into_owned()),
        None => std::env::var_os(THREADS_VAR).map(|v| v.to_string_lossy().into_owned()),
    };
    crate::distributed::check_threads_var(threads.as_deref())?;
    let token = token(config)?;
    let errors = ErrorDir::create()?;
    // Declared after `errors`, so dropped first: it must not outlive a normal end of the job
    // only to find the folder gone.
    let mut guardian = Guardian::start(config.grace_period, &errors.0);
    let catch = signals::Catch::install();
    let job = Job {
        config,
        program,
        args,
        token: &token,
        errors: &errors,
        catch: &catch,
    };
    match &config.elastic {
        Some(elastic) => job.elastic_rounds(elastic, guardian.as_mut()),
        None => job.fixed_rounds(guardian.as_mut()),
    }
}

/// What every round of a job shares.
struct Job<'a> {
    config: &'a LaunchConfig,
    program: &'a OsStr,
    args: &'a [OsString],
    /// The launcher's job token (each round derives its own).
    token: &'a str,
    errors: &'a ErrorDir,
    catch: &'a signals::Catch,
}

impl Job<'_> {
    /// A fixed world (`--nnodes N`): this machine is `node_rank`, every round has every machine.
    fn fixed_rounds(&self, mut guardian: Option<&mut Guardian>) -> Result<()> {
        let (config, catch) = (self.config, self.catch);
        let mut round = 0;
        loop {
            let port = match config.master_port {
                Some(p) => p,
                None => free_port(&config.master_addr)?,
            };
            let folder = self.errors.round(round)?;
            let job = Round {
                config,
                program: self.program,
                args: self.args,
                place: Assignment {
                    round,
                    group_rank: config.node_rank,
                    nnodes: config.nnodes,
                    rank_offset: config.node_rank * config.nproc_per_node,
                    world: config.nnodes * config.nproc_per_node,
                    master_addr: config.master_addr.clone(),
                    master_port: port,
                },
                token: &round_token(self.token, round),
                restart_count: round,
                errors: &folder,
            };
            let outcome = job
                .run(catch, guardian.as_deref_mut(), &|| None)
                .map(|_| ());
            let failure = match &outcome {
                Err(Error::RankFailed { rank, status, code }) => (*rank, status.clone(), *code),
                _ => return outcome,
            };
            if catch.ever().is_some() {
                return outcome;
            }
            if round >= config.max_restarts {
                return Err(out_of_restarts(config, outcome, failure));
            }
            round += 1;
            log::warn!(
                "rank {} failed: {}; restarting every rank of this machine: restart {round} of {} \
                 ({RESTART_COUNT_VAR}={round})",
                failure.0,
                failure.1,
                config.max_restarts
            );
            if config.node_rank != 0 {
                let previous = round_token(self.token, round - 1);
                wait_for_the_old_store(config, port, &previous, catch);
            }
            if let Some(sig) = catch.ever() {
                return Err(interrupted_by(sig));
            }
        }
    }

    /// Elastic membership (`--nnodes MIN:MAX`): each round is whatever the rendezvous forms;
    /// a failed round counts against `max_restarts`, a restart to admit a machine does not (as
    /// in torchrun).
    fn elastic_rounds(
        &self,
        elastic: &ElasticConfig,
        mut guardian: Option<&mut Guardian>,
    ) -> Result<()> {
        let (config, catch) = (self.config, self.catch);
        let mut agent = Agent::start(config, elastic, self.token)?;
        let mut failures = 0;
        let asked_to_stop = || catch.ever().map(interrupted_by);
        loop {
            let Some(place) = agent.join(&asked_to_stop)? else {
                return Ok(());
            };
            let folder = self.errors.round(place.round)?;
            let token = round_token(self.token, place.round);
            let job = Round {
                config,
                program: self.program,
                args: self.args,
                place,
                token: &token,
                restart_count: failures,
                errors: &folder,
            };
            let outcome = job.run(catch, guardian.as_deref_mut(), &|| agent.halt());
            let failure = match outcome {
                Ok(None) => {
                    agent.finish(&|| asked_to_stop().is_some());
                    return Ok(());
                }
                Ok(Some(Halt::Restart)) => {
                    log::warn!(
                        "a machine is waiting to join: restarting every rank of this machine \
                         so that the next round admits it (not counted against --max-restarts)"
                    );
                    continue;
                }
                Ok(Some(Halt::Lost(why))) => return Err(agent.lost(&why)),
                Err(Error::RankFailed { rank, status, code }) => (rank, status, code),
                Err(e) => return Err(e),
            };
            let outcome = Err(Error::RankFailed {
                rank: failure.0,
                status: failure.1.clone(),
                code: failure.2,
            });
            if catch.ever().is_some() {
                return outcome;
            }
            if failures >= config.max_restarts {
                return Err(out_of_restarts(config, outcome, failure));
            }
            failures += 1;
            log::warn!(
                "rank {} failed: {}; restarting every rank of this machine in the next round of \
                 the rendezvous: restart {failures} of {} ({RESTART_COUNT_VAR}={failures})",
                failure.0,
                failure.1,
                config.max_restarts
            );
        }
    }
}

/// The error to end with when a rank failed and no restart is left: the failure itself
/// without `--max-restarts`, else the failure saying that it was the last.
fn out_of_restarts(
    config: &LaunchConfig,
    outcome: Result<()>,
    failure: (usize, String, i32),
) -> Error {
    match outcome {
        Err(e) if config.max_restarts == 0 => e,
        // The last line of the job must say that no restart is left, not only the failure.
        _ => Error::RankFailed {
            rank: failure.0,
            status: format!(
                "{}; that was the last of --max-restarts {} (the job ran {} times): fix the \
                 cause, or allow more restarts",
                failure.1,
                config.max_restarts,
                config.max_restarts + 1
            ),
            code: failure.2,
        },
    }
}

fn interrupted_by(sig: i32) -> Error {
    Error::Interrupted {
        signal: signals::name(sig),
        code: 128 + sig,
    }
}

/// How long a machine without rank 0 waits, before a new round, for the previous round's
/// store to go away.
const HANDOVER: Duration = Duration::from_secs(60);

/// On a machine without rank 0, before starting a new round: waits (at most [`HANDOVER`])
/// while the previous round's store still answers at the master's address, as it does until
/// the master's ranks have noticed the failure and ended. Ranks of the new round started
/// earlier would reach that store and be refused as strangers (their token is the new
/// round's), and fail the new round at once.
fn wait_for_the_old_store(
    config: &LaunchConfig,
    port: u16,
    previous: &str,
    catch: &signals::Catch,
) {
    use std::net::ToSocketAddrs;
    let Some(addr) = (config.master_addr.as_str(), port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
    else {
        return;
    };
    let started = Instant::now();
    let mut said = false;
    while crate::distributed::store::Store::probe(addr, previous, PROBE).is_some() {
        if started.elapsed() >= HANDOVER || catch.ever().is_some() {
            log::warn!(
                "the previous round's store at {addr} still answers after {} s; starting the \
                 new round anyway",
                started.elapsed().as_secs()
            );
            return;
        }
        if !said {
            log::info!("waiting for the previous round's store at {addr} to close");
            said = true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// How long one probe of the master's store may take.
const PROBE: Duration = Duration::from_millis(500);

/// One round of the job on this machine.
struct Round<'a> {
    config: &'a LaunchConfig,
    program: &'a OsStr,
    args: &'a [OsString],
    /// Where this machine's ranks sit in the round.
    place: Assignment,
    /// The round's job token.
    token: &'a str,
    /// Failed rounds before this one: 0 first, then 1 after the first restart...
    restart_count: usize,
    /// The round's folder for the ranks' error files.
    errors: &'a Path,
}

impl Round<'_> {
    /// Starts the ranks, waits for them, and stops them all when one fails, a signal arrives,
    /// or `halt` says to (then returns why).
    fn run(
        &self,
        catch: &signals::Catch,
        mut guardian: Option<&mut Guardian>,
        halt: &dyn Fn() -> Option<Halt>,
    ) -> Result<Option<Halt>> {
        let (done_tx, done_rx) = mpsc::channel();
        let mut ranks = Vec::with_capacity(self.config.nproc_per_node);
        let mut readers = 0;
        let mut started = Ok(());
        for local in 0..self.config.nproc_per_node {
            match start(self, local, &done_tx) {
                Ok((rank, pipes)) => {
                    if let Some(g) = guardian.as_deref_mut() {
                        g.watch(rank.group());
                    }
                    ranks.push(rank);
                    readers += pipes;
                }
                Err(e) => {
                    started = Err(e);
                    break;
                }
            }
        }
        drop(done_tx);
        let grace = self.config.grace_period;
        let outcome = match started {
            Ok(()) => supervise(&mut ranks, catch, grace, halt),
            Err(e) => {
                stop(&mut ranks, catch, grace);
                Err(e)
            }
        };
        for r in &ranks {
            signals::signal_group(r.group(), libc::SIGKILL);
            if let Some(g) = guardian.as_deref_mut() {
                g.forget(r.group());
            }
        }
        // The output threads end when the last writer closes its end; do not wait on a
        // process that escaped its group and kept a pipe.
        let deadline = Instant::now() + Duration::from_secs(2);
        for _ in 0..readers {
            let left = deadline.saturating_duration_since(Instant::now());
            if done_rx.recv_timeout(left).is_err() {
                break;
            }
        }
        outcome
    }
}

/// The compute threads each rank gets when several share the machine and nobody chose
/// (neither `RAYON_NUM_THREADS` nor `OMP_NUM_THREADS`, which the ranks honour):
/// the cores divided among the local ranks, at least one (torchrun sets `OMP_NUM_THREADS=1`
/// for the same reason: N ranks each running a pool as large as the machine fight over the
/// cores: two ranks of `cifar_ddp` on 2 cores trained slower than one process).
fn compute_threads(config: &LaunchConfig) -> Option<usize> {
    let chosen = [THREADS_VAR, OMP_THREADS_VAR]
        .iter()
        .any(|var| std::env::var_os(var).is_some() || config.env.iter().any(|(k, _)| k == var));
    if chosen || config.nproc_per_node < 2 {
        return None;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Some((cores / config.nproc_per_node).max(1))
}

/// Starts local rank `local` of `round`; returns it and how many output threads it has (each
/// sends on `done` when its pipe closes).
fn start(round: &Round<'_>, local: usize, done: &mpsc::Sender<()>) -> Result<(Rank, usize)> {
    let Round {
        config,
        program,
        args,
        ref place,
        token,
        errors,
        ..
    } = *round;
    let rank = place.rank_offset + local;
    let error_file = errors.join(format!("rank-{rank}.error"));
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", place.world.to_string())
        .env("LOCAL_RANK", local.to_string())
        .env("LOCAL_WORLD_SIZE", config.nproc_per_node.to_string())
        .env("GROUP_RANK", place.group_rank.to_string())
        .env("GROUP_WORLD_SIZE", place.nnodes.to_string())
        .env("MASTER_ADDR", &place.master_addr)
        .env("MASTER_PORT", place.master_port.to_string())
        .env(TOKEN_VAR, token)
        .env(RESTART_COUNT_VAR, round.restart_count.to_string())
        .env(MAX_RESTARTS_VAR, config.max_restarts.to_string())
        .env(super::ERROR_FILE_VAR, &error_file)
        .envs(compute_threads(config).map(|n| (THREADS_VAR, n.to_string())))
        .envs(config.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .process_group(0);
    if config.prefix_output {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    }
    // SAFETY: getpid is always safe; `die_with_parent` only makes async-signal-safe calls,
    // as code between fork and exec must.
    let parent = unsafe { libc::getpid() };
    unsafe {
        cmd.pre_exec(move || signals::die_with_parent(parent));
    }
    let mut child = cmd.spawn().map_err(|source| Error::Io {
        context: format!("starting rank {rank} ({})", program.to_string_lossy()),
        source,
    })?;
    let mut pipes = 0;
    let prefix = format!("[rank{rank}]: ");
    if let Some(out) = child.stdout.take() {
        pipes += forward(out, prefix.clone(), false, done.clone());
    }
    if let Some(err) = child.stderr.take() {
        pipes += forward(err, prefix, true, done.clone());
    }
    Ok((
        Rank {
            rank,
            child,
            status: None,
            error_file,
        },
        pipes,
    ))
}

/// The longest piece of output forwarded at once: a longer line goes out in pieces of this
/// size, each prefixed, so that the launcher's memory stays bounded whatever a rank writes.
const PIECE: usize = 64 << 10;

/// Copies `pipe` line by line to our stdout (or stderr), each line (or piece of a long line)
/// prefixed.
fn forward(
    pipe: impl Read + Send + 'static,
    prefix: String,
    to_stderr: bool,
    done: mpsc::Sender<()>,
) -> usize {
    let spawned = std::thread::Builder::new()
        .name("rank-output".into())
        .spawn(move || {
            let emit = |line: &mut Vec<u8>| {
                if !line.ends_with(b"\n") {
                    line.push(b'\n');
                }
                let mut out: Box<dyn Write> = if to_stderr {
                    Box::new(std::io::stderr().lock())
                } else {
                    Box::new(std::io::stdout().lock())
                };
                let _ = out.write_all(prefix.as_bytes());
                let _ = out.write_all(line);
                let _ = out.flush();
                line.clear();
            };
            let mut r = BufReader::with_capacity(PIECE, pipe);
            let mut line = Vec::with_capacity(256);
            loop {
                let buf = match r.fill_buf() {
                    Ok([]) | Err(_) => break,
                    Ok(buf) => buf,
                };
                let (take, ends) = match buf.iter().position(|&b| b == b'\n') {
                    Some(i) if line.len() + i < PIECE => (i + 1, true),
                    _ => (buf.len().min(PIECE - line.len()), false),
                };
                line.extend_from_slice(&buf[..take]);
                r.consume(take);
                if ends || line.len() >= PIECE {
                    emit(&mut line);
                }
            }
            if !line.is_empty() {
                emit(&mut line);
            }
            let _ = done.send(());
        });
    usize::from(spawned.is_ok())
}

/// Waits for the ranks; stops them all when one fails, a signal arrives or `halt` says to
/// (then returns why).
fn supervise(
    ranks: &mut [Rank],
    catch: &signals::Catch,
    grace: Duration,
    halt: &dyn Fn() -> Option<Halt>,
) -> Result<Option<Halt>> {
    let mut failure: Option<(usize, ExitStatus)> = None;
    let mut interrupted = None;
    let mut halted = None;
    while ranks.iter().any(Rank::running) {
        if let Some(sig) = catch.received() {
            // Forward it: the ranks are in their own process groups, out of the terminal's.
            // A hang-up is a request to stop, like SIGTERM (the ranks have no terminal).
            let forwarded = if sig == libc::SIGHUP {
                libc::SIGTERM
            } else {
                sig
            };
            for r in ranks.iter().filter(|r| r.running()) {
                signals::signal_group(r.group(), forwarded);
            }
            interrupted = Some(sig);
            break;
        }
        for r in ranks.iter_mut() {
            if let Some(st) = r.reap() {
                if !st.success() && failure.is_none() {
                    failure = Some((r.rank, st));
                }
            }
        }
        if failure.is_some() {
            break;
        }
        if let Some(h) = halt() {
            halted = Some(h);
            break;
        }
        std::thread::sleep(POLL);
    }
    if failure.is_some() {
        // Ranks failing together usually fail because of one of them, which may still be on
        // its way out: let them end by themselves for a moment, so that their own statuses and
        // records name the cause.
        let settle = Instant::now() + grace.min(SETTLE);
        while ranks.iter().any(Rank::running) && Instant::now() < settle {
            for r in ranks.iter_mut() {
                r.reap();
            }
            std::thread::sleep(POLL);
        }
    }
    if failure.is_some() || interrupted.is_some() || halted.is_some() {
        stop(ranks, catch, grace);
    }
    if let Some(first_seen) = failure {
        return Err(root_cause(ranks, first_seen));
    }
    if let Some(sig) = interrupted {
        return Err(interrupted_by(sig));
    }
    Ok(halted)
}

/// The failure to report: the earliest recorded failure of a rank's own; else the rank that
/// the earliest recorded loss blames, when it failed; else the earliest recorded; else the first
/// seen to exit unsuccessfully.
fn root_cause(ranks: &[Rank], first_seen: (usize, ExitStatus)) -> Error {
    let failed: Vec<&Rank> = ranks
        .iter()
        .filter(|r| r.status.is_some_and(|s| !s.success()))
        .collect();
    let mut records: Vec<(Recorded, &Rank)> = failed
        .iter()
        .filter_map(|r| r.recorded_error().map(|rec| (rec, *r)))
        .collect();
    records.sort_by_key(|(rec, r)| (rec.time, r.rank));
    let own = records
        .iter()
        .find(|(rec, _)| matches!(rec.blame, Blame::Own));
    let blamed = records.iter().find_map(|(rec, _)| match rec.blame {
        Blame::Other(Some(b)) => failed.iter().find(|r| r.rank == b),
        _ => None,
    });
    let (rank, message) = match (own, blamed, records.first()) {
        (Some((rec, r)), _, _) => (*r, Some(rec.message.clone())),
        (None, Some(r), _) => (*r, r.recorded_error().map(|rec| rec.message)),
        (None, None, Some((rec, r))) => (*r, Some(rec.message.clone())),
        (None, None, None) => {
            let (status, code) = describe(first_seen.1);
            return Error::RankFailed {
                rank: first_seen.0,
                status,
                code,
            };
        }
    };
    let (mut status, code) = describe(rank.status.expect("failed ranks have ended"));
    if let Some(m) = message {
        status = format!("{status}: {m}");
    }
    Error::RankFailed {
        rank: rank.rank,
        status,
        code,
    }
}

/// A private directory for the ranks' error files, removed when dropped.
struct ErrorDir(std::path::PathBuf);

impl ErrorDir {
    /// The folder of round `round`'s error files (created): a round never reads an older
    /// round's records.
    fn round(&self, round: usize) -> Result<std::path::PathBuf> {
        let dir = self.0.join(format!("round-{round}"));
        std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
            context: format!("creating {}", dir.display()),
            source,
        })?;
        Ok(dir)
    }

    fn create() -> Result<Self> {
        let nonce = crate::rng::fresh_seed();
        let dir =
            std::env::temp_dir().join(format!("candle-run-{}-{nonce:016x}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
            context: format!("creating {}", dir.display()),
            source,
        })?;
        Ok(Self(dir))
    }
}

impl Drop for ErrorDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Asks every running rank to stop (SIGTERM), and kills those still running after `grace` (or
/// at a second Ctrl-C).
fn stop(ranks: &mut [Rank], catch: &signals::Catch, grace: Duration) {
    for r in ranks.iter().filter(|r| r.running()) {
        signals::signal_group(r.group(), libc::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    loop {
        for r in ranks.iter_mut() {
            r.reap();
        }
        if !ranks.iter().any(Rank::running) {
            return;
        }
        if Instant::now() >= deadline || catch.received().is_some() {
            break;
        }
        std::thread::sleep(POLL);
    }
    for r in ranks.iter_mut().filter(|r| r.running()) {
        signals::signal_group(r.group(), libc::SIGKILL);
        if let Ok(st) = r.child.wait() {
            r.status = Some(st);
        }
    }
}
