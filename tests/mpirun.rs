//! mpirun for real: Open MPI's `mpirun -np 2` (two jobs at once on one machine, each meeting
//! on a port of its job id) and MPICH's `mpiexec -n 2` (hydra; the ranks behind a wrapper
//! shell, as job scripts often start them) train `mlp_ddp` to the weights `candle-run` gives,
//! with nothing exported. Skipped, saying so, without them (see `common::engines`).

mod common;

use common::engines;
use std::path::Path;
use std::process::Output;
use std::time::Duration;

const RUN: &str = env!("CARGO_BIN_EXE_candle-run");
const LIMIT: Duration = Duration::from_secs(120);

fn assert_trained_alike(dir: &Path, reference: &[String], out: &Output, weights: &str) {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{weights}: {}\n{text}", out.status);
    engines::assert_trained_as_reference(dir, reference, &text, weights);
}

#[test]
fn two_open_mpi_jobs_at_once_train_as_candle_run_does() {
    let (Some(mut first), Some(mut second)) = (engines::open_mpi(2), engines::open_mpi(2)) else {
        return;
    };
    let dir = common::temp_dir("mpirun-openmpi");
    let want = engines::mlp_reference(RUN, &dir);
    let mlp = common::example("mlp_ddp");
    // Each job its own session folder: two mpiruns starting at once race to create the shared
    // /tmp/ompi.<host>.<uid> ("mkdir ... File exists", seen once in CI), a race of Open MPI's
    // own that users avoid the same way.
    for (cmd, name) in [(&mut first, "first"), (&mut second, "second")] {
        let tmp = dir.join(format!("{name}-tmp"));
        std::fs::create_dir_all(&tmp).unwrap();
        cmd.env("TMPDIR", &tmp)
            .arg(&mlp)
            .arg(dir.join(format!("{name}.safetensors")));
    }
    let other = std::thread::spawn(move || common::run(second, LIMIT));
    let out = common::run(first, LIMIT);
    assert_trained_alike(&dir, &want, &out, "first.safetensors");
    assert_trained_alike(&dir, &want, &other.join().unwrap(), "second.safetensors");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn mpich_mpiexec_trains_as_candle_run_does_behind_a_wrapper_shell() {
    let Some(mut cmd) = engines::mpich(2) else {
        return;
    };
    let dir = common::temp_dir("mpirun-mpich");
    let want = engines::mlp_reference(RUN, &dir);
    // Not `exec`: each rank's parent is its shell, hydra's proxy is the grandparent.
    let line = format!(
        "{} {}; exit $?",
        common::example("mlp_ddp").display(),
        dir.join("mpich.safetensors").display()
    );
    cmd.args(["sh", "-c", &line]);
    let out = common::run(cmd, LIMIT);
    assert_trained_alike(&dir, &want, &out, "mpich.safetensors");
    std::fs::remove_dir_all(dir).unwrap();
}
