//! torchrun as torch 2.x starts it (the real one, from pip's torch): every rendezvous mode
//! trains `mlp_ddp` to the weights `candle-run` gives; `--max-restarts` with a rank SIGKILLed
//! mid-epoch resumes `cifar_ddp` to the uninterrupted run's weights and final line; torchrun's
//! summary names the rank that failed first and its error (our ranks write
//! `TORCHELASTIC_ERROR_FILE`); `OMP_NUM_THREADS` sizes each rank's compute pool. Skipped,
//! saying so, without PyTorch (see `common::engines`).

mod common;

use candle_core::{Device, Tensor};
use candle_parallel::distributed::{ProcessGroup, ReduceOp};
use common::{engines, free_port, is_child};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const RUN: &str = env!("CARGO_BIN_EXE_candle-run");
const LIMIT: Duration = Duration::from_secs(180);

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Trains `mlp_ddp` on 2 ranks under `torchrun MODE...` (plus `env`) and checks that it prints
/// and saves what `candle-run` does.
fn trains_as_candle_run(name: &str, mode: &[&str], env: &[(&str, &str)]) {
    let dir = common::temp_dir(name);
    let weights = dir.join("torchrun.safetensors");
    let args = [mode, &["--nproc-per-node", "2", "--no-python"]].concat();
    let Some(mut cmd) = engines::torchrun(&args) else {
        return;
    };
    cmd.arg(common::example("mlp_ddp"))
        .arg(&weights)
        .envs(env.iter().copied());
    let desc = format!("{cmd:?}");
    let out = common::run(cmd, LIMIT);
    let all = text(&out);
    assert!(out.status.success(), "{desc} failed:\n{all}");
    let want = engines::mlp_reference(RUN, &dir);
    engines::assert_trained_as_reference(&dir, &want, &all, "torchrun.safetensors");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn torchrun_standalone_trains_as_candle_run_does() {
    trains_as_candle_run("torchrun-standalone", &["--standalone"], &[]);
}

#[test]
fn torchrun_with_a_master_port_trains_as_candle_run_does() {
    // One node and --master-port: the static rendezvous, whose agent serves the store there.
    let port = free_port().to_string();
    trains_as_candle_run(
        "torchrun-master-port",
        &["--master-addr", "127.0.0.1", "--master-port", &port],
        &[],
    );
}

#[test]
fn torchrun_with_the_static_backend_trains_as_candle_run_does() {
    let port = free_port().to_string();
    trains_as_candle_run(
        "torchrun-static",
        &[
            "--rdzv-backend",
            "static",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
            "--node-rank",
            "0",
        ],
        &[],
    );
}

#[test]
fn torchrun_with_the_c10d_backend_trains_as_candle_run_does() {
    let endpoint = format!("127.0.0.1:{}", free_port());
    trains_as_candle_run(
        "torchrun-c10d",
        &["--rdzv-backend", "c10d", "--rdzv-endpoint", &endpoint],
        &[],
    );
}

#[test]
fn torchrun_without_the_shared_store_lets_rank_0_serve_it() {
    // TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: TORCHELASTIC_USE_AGENT_STORE=False, a free port.
    let endpoint = format!("127.0.0.1:{}", free_port());
    trains_as_candle_run(
        "torchrun-unshared",
        &["--rdzv-backend", "c10d", "--rdzv-endpoint", &endpoint],
        &[("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")],
    );
}

/// `cifar_ddp` on 2 ranks of 32 over 3840 images: 60 steps an epoch, a checkpoint every 5.
const CIFAR: &[&str] = &[
    "--cpu",
    "--epochs",
    "2",
    "--batch-size",
    "32",
    "--train-size",
    "3840",
    "--test-size",
    "200",
    "--checkpoint-every",
    "5",
];

#[test]
fn a_rank_sigkilled_under_torchrun_max_restarts_resumes_to_the_uninterrupted_weights() {
    let dir = common::temp_dir("torchrun-restart");
    let marker = format!("torchrun-restart-{}", std::process::id());
    let Some(mut cmd) = engines::torchrun(&[
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--no-python",
    ]) else {
        return;
    };
    let weights = dir.join("torchrun.safetensors");
    cmd.arg(common::example("cifar_ddp"))
        .args(CIFAR)
        .arg("--checkpoint-dir")
        .arg(dir.join("ckpt-torchrun"))
        .arg("--save")
        .arg(&weights)
        .env("CP_TEST_JOB", &marker);
    let ranks = common::Ranks::spawn(vec![cmd]);
    ranks.wait_for(0, "Checkpoint at step 10 saved", LIMIT);
    let vars = [
        "RANK=1".to_string(),
        "TORCHELASTIC_RESTART_COUNT=0".to_string(),
        format!("CP_TEST_JOB={marker}"),
    ];
    let victim = common::process_with_env(None, &vars).expect("rank 1 of attempt 0 runs");
    assert!(Command::new("kill")
        .args(["-KILL", &victim.to_string()])
        .status()
        .unwrap()
        .success());
    let ended = ranks.wait(LIMIT).remove(0);
    let out = &ended.output;
    assert!(ended.status.success(), "{}\n{out}", ended.status);
    assert!(out.contains("Resumed at step "), "no resume:\n{out}");

    let mut straight = Command::new(RUN);
    straight
        .args(["--nproc-per-node", "2"])
        .arg(common::example("cifar_ddp"))
        .args(CIFAR)
        .arg("--checkpoint-dir")
        .arg(dir.join("ckpt-straight"))
        .arg("--save")
        .arg(dir.join("straight.safetensors"));
    let reference = common::run_ok(straight, LIMIT);
    let last_line = |o: &str| {
        o.lines()
            .rev()
            .find_map(|l| l.split_once("Test set: ").map(|(_, t)| t.to_string()))
    };
    assert_eq!(
        last_line(out),
        last_line(&reference),
        "torchrun:\n{out}\ncandle-run:\n{reference}"
    );
    assert!(last_line(out).is_some());
    let a = std::fs::read(dir.join("straight.safetensors")).unwrap();
    let b = std::fs::read(&weights).unwrap();
    assert!(a == b, "the restarted job's weights differ:\n{out}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// torchrun running 2 ranks of this test binary's test `test` (`--standalone`).
fn torchrun_children(test: &str, env: &[(&str, &str)]) -> Option<Command> {
    let mut cmd = engines::torchrun(&["--standalone", "--nproc-per-node", "2", "--no-python"])?;
    cmd.arg(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(common::CHILD, "1")
        .envs(env.iter().copied());
    Some(cmd)
}

/// The "Root Cause" section of torchrun's summary.
fn root_cause(out: &str) -> &str {
    out.split_once("Root Cause (first observed failure):")
        .map_or("", |(_, r)| r)
}

#[test]
fn torchruns_summary_names_the_rank_that_failed_and_its_error() {
    const TEST: &str = "torchruns_summary_names_the_rank_that_failed_and_its_error";
    if is_child() {
        candle_parallel::launch::spawn(2, |rank| {
            let pg = ProcessGroup::from_env(&Device::Cpu)?;
            pg.barrier()?;
            if rank == 1 {
                return Err(candle_parallel::Error::Config {
                    what: "the test's own check".into(),
                    detail: "rank 1 gives up on purpose".into(),
                });
            }
            // Rank 0 goes on, loses rank 1, and fails because of it: a consequence.
            let x = Tensor::new(&[1f32], &Device::Cpu)?;
            loop {
                pg.all_reduce(&x, ReduceOp::Sum)?;
            }
        })
        .unwrap();
        return;
    }
    let Some(cmd) = torchrun_children(TEST, &[]) else {
        return;
    };
    let out = common::run(cmd, LIMIT);
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    let root = root_cause(&all);
    assert!(
        root.contains("rank      : 1 (local_rank: 1)")
            && root.contains("rank 1 gives up on purpose")
            && root.contains("error.json"),
        "{all}"
    );
}

#[test]
fn torchruns_summary_names_a_sigkilled_rank_not_the_rank_that_lost_it() {
    const TEST: &str = "torchruns_summary_names_a_sigkilled_rank_not_the_rank_that_lost_it";
    if is_child() {
        let pg = ProcessGroup::from_env(&Device::Cpu).unwrap();
        println!("rank {} ready", pg.rank());
        let x = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        loop {
            if let Err(e) = pg.all_reduce(&x, ReduceOp::Sum) {
                eprintln!("rank {} failed: {e}", pg.rank());
                std::process::exit(1);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let marker = format!("torchrun-kill-{}", std::process::id());
    let Some(cmd) = torchrun_children(TEST, &[("CP_TEST_JOB", &marker)]) else {
        return;
    };
    let ranks = common::Ranks::spawn(vec![cmd]);
    ranks.wait_for(0, "rank 1 ready", LIMIT);
    ranks.wait_for(0, "rank 0 ready", LIMIT);
    let vars = ["RANK=1".to_string(), format!("CP_TEST_JOB={marker}")];
    let victim = common::process_with_env(None, &vars).expect("rank 1 runs");
    let killed = Instant::now();
    assert!(Command::new("kill")
        .args(["-KILL", &victim.to_string()])
        .status()
        .unwrap()
        .success());
    let ended = ranks.wait(LIMIT).remove(0);
    let out = &ended.output;
    assert!(killed.elapsed() < Duration::from_secs(60), "{out}");
    let root = root_cause(out);
    assert!(
        root.contains("rank      : 1 (local_rank: 1)") && root.contains("SIGKILL"),
        "{out}"
    );
}

#[test]
fn omp_num_threads_from_torchrun_sizes_each_ranks_pool() {
    const TEST: &str = "omp_num_threads_from_torchrun_sizes_each_ranks_pool";
    if is_child() {
        let pg = ProcessGroup::from_env(&Device::Cpu).unwrap();
        println!(
            "rank {} threads: rayon {} candle {}",
            pg.rank(),
            rayon::current_num_threads(),
            candle_core::utils::get_num_threads()
        );
        pg.barrier().unwrap();
        return;
    }
    // torchrun sets OMP_NUM_THREADS=1 for several ranks when it is unset; a value given is
    // passed on; RAYON_NUM_THREADS wins over both.
    for (env, want) in [
        (vec![], 1),
        (vec![("OMP_NUM_THREADS", "2")], 2),
        (
            vec![("OMP_NUM_THREADS", "2"), ("RAYON_NUM_THREADS", "3")],
            3,
        ),
    ] {
        let Some(mut cmd) = torchrun_children(TEST, &env) else {
            return;
        };
        cmd.env_remove("RAYON_NUM_THREADS");
        if env.is_empty() {
            cmd.env_remove("OMP_NUM_THREADS");
        }
        for (k, v) in &env {
            cmd.env(k, v);
        }
        let out = common::run(cmd, LIMIT);
        let all = text(&out);
        assert!(out.status.success(), "{all}");
        for rank in 0..2 {
            let line = format!("rank {rank} threads: rayon {want} candle {want}");
            assert!(all.contains(&line), "{env:?}: want {line:?}:\n{all}");
        }
    }
}
