//! The launchers users already have, for tests that start them for real: PyTorch's torchrun
//! (and its TCPStore, from Python), Open MPI's mpirun and MPICH's mpiexec (Slurm is
//! `common::slurm`).
//!
//! A piece that is missing makes its test say so on stderr and skip; with
//! `CANDLE_PARALLEL_REQUIRE_ENGINES=1` (which `.ci/run` sets, having installed them all) it
//! fails the test instead, so that CI never passes without running them.

#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

/// Set to 1 where every engine must be present (CI).
pub const REQUIRE_VAR: &str = "CANDLE_PARALLEL_REQUIRE_ENGINES";

/// Reports that `what` cannot be had (`why`): a skip, said on stderr, or a failure where the
/// engines are required.
pub fn unavailable(what: &str, why: &str) {
    if std::env::var(REQUIRE_VAR).as_deref() == Ok("1") {
        panic!("{what} is required ({REQUIRE_VAR}=1) but cannot be had: {why}");
    }
    eprintln!("SKIPPED: {what} cannot be had here ({why}); `.ci/run` installs it");
}

/// Runs `cmd` and returns its stdout when it starts and succeeds within `limit`.
fn probe(mut cmd: Command, limit: Duration) -> Result<String, String> {
    let desc = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{desc} cannot start: {e}"))?;
    let started = std::time::Instant::now();
    while child.try_wait().map_err(|e| e.to_string())?.is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{desc} did not finish within {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{desc} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Whether `program` runs at all (is on the PATH).
fn found(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .stdin(Stdio::null())
        .status()
        .is_ok()
}

/// The Python interpreter with PyTorch (`CANDLE_PARALLEL_PYTHON`, else `python3`) and torch's
/// version, or why there is none. Checked once per test binary.
pub fn torch_python() -> Result<(String, String), String> {
    static FOUND: OnceLock<Result<(String, String), String>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            let python =
                std::env::var("CANDLE_PARALLEL_PYTHON").unwrap_or_else(|_| "python3".into());
            let mut cmd = Command::new(&python);
            cmd.args(["-c", "import torch; print(torch.__version__)"]);
            let version = probe(cmd, Duration::from_secs(120))?;
            Ok((python, version.trim().to_string()))
        })
        .clone()
}

/// The Python interpreter with PyTorch, or `None` after [`unavailable`] said why.
pub fn python_or_skip() -> Option<String> {
    match torch_python() {
        Ok((python, _)) => Some(python),
        Err(why) => {
            unavailable("PyTorch (python3 -c 'import torch')", &why);
            None
        }
    }
}

/// A command running torchrun with `args`: the `torchrun` script where it is on the PATH, else
/// `python3 -m torch.distributed.run` (the same program); `None` after saying why when PyTorch
/// is missing.
pub fn torchrun(args: &[&str]) -> Option<Command> {
    let python = python_or_skip()?;
    let mut cmd = if found("torchrun") {
        Command::new("torchrun")
    } else {
        let mut c = Command::new(python);
        c.args(["-m", "torch.distributed.run"]);
        c
    };
    cmd.args(args).env("RUST_BACKTRACE", "0");
    Some(cmd)
}

/// Open MPI's `mpirun`, or `None` after saying why. As root it runs with
/// `OMPI_ALLOW_RUN_AS_ROOT` (Open MPI refuses root otherwise).
pub fn open_mpi(np: usize) -> Option<Command> {
    let program = ["mpirun.openmpi", "mpirun"]
        .into_iter()
        .find(|p| probe_version(p).is_some_and(|v| v.contains("Open MPI")));
    let Some(program) = program else {
        unavailable(
            "Open MPI's mpirun",
            "no mpirun reporting \"Open MPI\" on the PATH",
        );
        return None;
    };
    let mut cmd = Command::new(program);
    cmd.args(["-np", &np.to_string(), "--oversubscribe"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("RUST_BACKTRACE", "0");
    Some(cmd)
}

/// MPICH's hydra `mpiexec`, or `None` after saying why.
pub fn mpich(np: usize) -> Option<Command> {
    let program = ["mpiexec.hydra", "mpiexec.mpich"]
        .into_iter()
        .find(|p| probe_version(p).is_some_and(|v| v.contains("HYDRA")));
    let Some(program) = program else {
        unavailable("MPICH's mpiexec (hydra)", "no mpiexec.hydra on the PATH");
        return None;
    };
    let mut cmd = Command::new(program);
    cmd.args(["-n", &np.to_string()]).env("RUST_BACKTRACE", "0");
    Some(cmd)
}

fn probe_version(program: &str) -> Option<String> {
    let mut cmd = Command::new(program);
    cmd.arg("--version");
    probe(cmd, Duration::from_secs(30)).ok()
}

/// What `mlp_ddp` printed on rank 0 (its losses and its accuracy), without a launcher's
/// `[rank0]: ` prefix.
pub fn mlp_lines(out: &str) -> Vec<String> {
    out.lines()
        .map(|l| l.strip_prefix("[rank0]: ").unwrap_or(l))
        .filter(|l| l.starts_with("epoch ") || l.starts_with("test accuracy"))
        .map(str::to_string)
        .collect()
}

/// Trains `mlp_ddp` on 2 ranks under `candle-run` (`run` is its path) into
/// `dir/reference.safetensors`; returns its lines (6 epochs and the accuracy).
pub fn mlp_reference(run: &str, dir: &Path) -> Vec<String> {
    let mut cmd = Command::new(run);
    cmd.args(["--nproc-per-node", "2"])
        .arg(super::example("mlp_ddp"))
        .arg(dir.join("reference.safetensors"));
    let lines = mlp_lines(&super::run_ok(cmd, Duration::from_secs(180)));
    assert_eq!(lines.len(), 7, "6 epochs and the accuracy: {lines:?}");
    lines
}

/// Asserts that `out` (what a launcher printed) has the reference's lines and that it saved
/// `dir/weights`, byte for byte the reference's.
pub fn assert_trained_as_reference(dir: &Path, reference: &[String], out: &str, weights: &str) {
    assert_eq!(mlp_lines(out), reference, "{weights}:\n{out}");
    let a = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let b = std::fs::read(dir.join(weights))
        .unwrap_or_else(|e| panic!("{weights} was not saved ({e}):\n{out}"));
    assert!(a == b, "{weights} differs from candle-run's weights");
}
