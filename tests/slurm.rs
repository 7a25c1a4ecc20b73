//! Slurm for real: a single-node cluster of the test's own (`common::slurm`: root, Debian's
//! slurm-wlm and munge, else skipped saying why), where `srun -n 2` and `sbatch --ntasks=2`
//! train `mlp_ddp` to the weights `candle-run` gives, two steps of one job run at once (each on
//! its own port), a SIGKILLed task stops the other naming the lost rank, and
//! `OMP_NUM_THREADS` sizes each task's pool. And, without Slurm, a port taken by another job
//! named as a port collision by both ranks.

mod common;

use candle_core::{Device, Tensor};
use candle_parallel::distributed::store::StoreServer;
use candle_parallel::distributed::{ProcessGroup, ReduceOp, Rendezvous};
use common::slurm::Cluster;
use common::{engines, is_child, Ranks};
use std::process::Command;
use std::time::{Duration, Instant};

const RUN: &str = env!("CARGO_BIN_EXE_candle-run");
const LIMIT: Duration = Duration::from_secs(120);

/// Runs `cmd` (srun, sbatch) and returns everything it printed, asserting it succeeded.
fn run_ok(cluster: &Cluster, cmd: Command) -> String {
    let desc = format!("{cmd:?}");
    let out = common::run(cmd, LIMIT);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{desc} failed:\n{text}\n{}",
        cluster.logs()
    );
    text
}

#[test]
fn srun_and_sbatch_train_as_candle_run_and_steps_run_side_by_side() {
    const TEST: &str = "srun_and_sbatch_train_as_candle_run_and_steps_run_side_by_side";
    if is_child() {
        // The task a test kills, and the one that must notice.
        let pg = ProcessGroup::from_env(&Device::Cpu).unwrap();
        println!(
            "rank {} ready, threads: rayon {} candle {}",
            pg.rank(),
            rayon::current_num_threads(),
            candle_core::utils::get_num_threads()
        );
        if std::env::var("CP_TEST_STOP").is_ok() {
            pg.barrier().unwrap();
            return;
        }
        let x = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        loop {
            if let Err(e) = pg.all_reduce(&x, ReduceOp::Sum) {
                eprintln!("rank {} failed: {e}", pg.rank());
                std::process::exit(1);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let cluster = match Cluster::start("steps") {
        Ok(c) => c,
        Err(why) => return engines::unavailable("a Slurm cluster", &why),
    };
    let dir = cluster.dir().to_path_buf();
    let mlp = common::example("mlp_ddp");
    let reference = engines::mlp_reference(RUN, &dir);

    // srun -n 2: nothing exported, the ranks find the master and the port.
    let mut srun = cluster.command("srun");
    srun.args(["-n", "2"])
        .arg(&mlp)
        .arg(dir.join("srun.safetensors"));
    let out = run_ok(&cluster, srun);
    engines::assert_trained_as_reference(&dir, &reference, &out, "srun.safetensors");

    // sbatch --ntasks=2, one step; and a job running two steps at once.
    let script = |steps: &[&str]| {
        let lines: Vec<String> = steps
            .iter()
            .map(|w| {
                format!(
                    "srun -n 2 --overlap {} {} > {} 2>&1 &",
                    mlp.display(),
                    dir.join(format!("{w}.safetensors")).display(),
                    dir.join(format!("{w}.out")).display()
                )
            })
            .collect();
        format!("#!/bin/bash\n{}\nwait\n", lines.join("\n"))
    };
    for (name, steps) in [("one", &["batch"][..]), ("two", &["step-a", "step-b"][..])] {
        let path = dir.join(format!("{name}.sh"));
        std::fs::write(&path, script(steps)).unwrap();
        let mut sbatch = cluster.command("sbatch");
        sbatch
            .args(["--wait", "--ntasks=2", "-o"])
            .arg(dir.join(format!("{name}.batch-out")))
            .arg(&path);
        run_ok(&cluster, sbatch);
        for w in steps {
            let out = std::fs::read_to_string(dir.join(format!("{w}.out"))).unwrap();
            let weights = format!("{w}.safetensors");
            engines::assert_trained_as_reference(&dir, &reference, &out, &weights);
        }
    }

    // OMP_NUM_THREADS, exported to srun, sizes each task's pool.
    let mut srun = cluster.command("srun");
    srun.args(["-n", "2"])
        .arg(std::env::current_exe().unwrap())
        .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env(common::CHILD, "1")
        .env("CP_TEST_STOP", "1")
        .env("OMP_NUM_THREADS", "1")
        .env_remove("RAYON_NUM_THREADS");
    let out = run_ok(&cluster, srun);
    for rank in 0..2 {
        let line = format!("rank {rank} ready, threads: rayon 1 candle 1");
        assert!(out.contains(&line), "{out}");
    }

    // A task SIGKILLed: the other stops, naming it.
    let marker = format!("slurm-kill-{}", std::process::id());
    let mut srun = cluster.command("srun");
    srun.args(["-n", "2"])
        .arg(std::env::current_exe().unwrap())
        .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env(common::CHILD, "1")
        .env("CP_TEST_JOB", &marker);
    let ranks = Ranks::spawn(vec![srun]);
    ranks.wait_for(0, "rank 0 ready", LIMIT);
    ranks.wait_for(0, "rank 1 ready", LIMIT);
    let vars = [
        "SLURM_PROCID=1".to_string(),
        format!("CP_TEST_JOB={marker}"),
    ];
    let victim = common::process_with_env(None, &vars).expect("task 1 runs");
    let killed = Instant::now();
    assert!(Command::new("kill")
        .args(["-KILL", &victim.to_string()])
        .status()
        .unwrap()
        .success());
    let ended = ranks.wait(LIMIT).remove(0);
    let out = &ended.output;
    assert!(!ended.status.success(), "{out}");
    assert!(out.contains("rank 0 failed: rank 1 was lost"), "{out}");
    assert!(
        killed.elapsed() < Duration::from_secs(30),
        "the step took {:?} to end:\n{out}",
        killed.elapsed()
    );
}

/// Slurm's variables for task `rank` of 2 in step `step` of job 4242 on this machine.
fn slurm_env(rank: usize, step: &str) -> Vec<(String, String)> {
    [
        ("SLURM_PROCID", rank.to_string()),
        ("SLURM_NTASKS", "2".into()),
        ("SLURM_LOCALID", rank.to_string()),
        ("SLURM_NODEID", "0".into()),
        ("SLURM_STEP_TASKS_PER_NODE", "2".into()),
        ("SLURM_JOB_ID", "4242".into()),
        ("SLURM_STEP_ID", step.into()),
        ("SLURM_STEP_NODELIST", "localhost".into()),
        ("SLURM_JOB_NODELIST", "localhost".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

#[test]
fn a_derived_port_taken_by_another_jobs_store_is_named_a_port_collision() {
    const TEST: &str = "a_derived_port_taken_by_another_jobs_store_is_named_a_port_collision";
    if is_child() {
        let r = Rendezvous::from_env().unwrap();
        let options = candle_parallel::distributed::InitConfig {
            rendezvous_timeout: Duration::from_secs(5),
            token: r.launcher.default_token().unwrap(),
            ..Default::default()
        };
        let err = ProcessGroup::new(&r, &Device::Cpu, options).unwrap_err();
        println!("rank {}: {err}", r.rank);
        common::done();
        return;
    }
    // Another job's store (another step of the same job) on the port this step derives.
    let vars: std::collections::HashMap<String, String> = slurm_env(0, "3").into_iter().collect();
    let r = Rendezvous::from_vars(|k| vars.get(k).cloned()).unwrap();
    let addr = r.master_socket().unwrap();
    let Ok(_other) = StoreServer::bind(addr, "slurm-4242.2") else {
        eprintln!("SKIPPED: the port this test derives, {addr}, is in use here");
        return;
    };
    let envs = vec![slurm_env(0, "3"), slurm_env(1, "3")];
    let outs = Ranks::start(TEST, envs).assert_all_pass(LIMIT);
    let port = r.master_port;
    assert!(
        outs[0].contains("port collision")
            && outs[0].contains(&format!("MASTER_PORT {port}"))
            && outs[0].contains("SLURM_JOB_ID=4242 and SLURM_STEP_ID=3"),
        "{}",
        outs[0]
    );
    assert!(
        outs[1].contains("port collision") && outs[1].contains("refused this job's token"),
        "{}",
        outs[1]
    );
    assert!(
        !outs.iter().any(|o| o.contains("already claimed")),
        "{outs:?}"
    );
}
