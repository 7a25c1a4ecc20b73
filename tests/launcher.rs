//! `candle-run` and `launch::spawn`, with real processes.

mod common;

use candle_core::{Device, Tensor};
use candle_parallel::distributed::{ProcessGroup, ReduceOp};
use common::{done, is_child, Ranks, DONE};
use std::process::Command;
use std::time::{Duration, Instant};

const RUN: &str = env!("CARGO_BIN_EXE_candle-run");
const LIMIT: Duration = Duration::from_secs(60);

fn candle_run(args: &[&str]) -> Command {
    let mut cmd = Command::new(RUN);
    cmd.args(args).env("RUST_BACKTRACE", "0");
    cmd
}

/// Whether process `pid` still exists (and is not a zombie awaiting its reaper).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z"),
    }
}

/// Waits (bounded) for every pid to be gone.
fn assert_all_gone(pids: &[u32]) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while pids.iter().any(|&p| alive(p)) {
        assert!(Instant::now() < deadline, "still running: {pids:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn pids(output: &str, tag: &str) -> Vec<u32> {
    output
        .lines()
        .filter_map(|l| {
            l.split_once(tag)
                .map(|(_, rest)| rest.trim().parse().unwrap())
        })
        .collect()
}

#[test]
fn two_and_three_ranks_get_torchruns_environment_and_finish() {
    for n in [2usize, 3] {
        let script = r#"echo "env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT ${#CANDLE_PARALLEL_TOKEN}""#;
        let nproc = n.to_string();
        let cmd = candle_run(&["--nproc-per-node", &nproc, "sh", "-c", script]);
        let out = common::run_ok(cmd, LIMIT);
        let mut ports = Vec::new();
        for r in 0..n {
            let line = out
                .lines()
                .find(|l| l.starts_with(&format!("[rank{r}]: env ")))
                .unwrap_or_else(|| panic!("no line of rank {r} in:\n{out}"));
            let fields: Vec<&str> = line.split_whitespace().skip(2).collect();
            let expect = [r.to_string(), nproc.clone(), r.to_string(), nproc.clone()];
            assert_eq!(&fields[..4], &expect, "{line}");
            assert_eq!(fields[4], "127.0.0.1");
            ports.push(fields[5].to_string());
            assert_eq!(fields[6], "32", "a 32-character token: {line}");
        }
        assert!(ports.windows(2).all(|w| w[0] == w[1]), "{ports:?}");
    }
}

#[test]
fn ranks_sharing_the_machine_share_its_cores_unless_told_otherwise() {
    let script = r#"echo "threads ${RAYON_NUM_THREADS:-unset}""#;
    let threads = |nproc: &str, set: Option<&str>| -> Vec<String> {
        let mut cmd = candle_run(&["--nproc-per-node", nproc, "sh", "-c", script]);
        match set {
            Some(v) => cmd.env("RAYON_NUM_THREADS", v),
            None => cmd.env_remove("RAYON_NUM_THREADS"),
        };
        let out = common::run_ok(cmd, LIMIT);
        let mut seen: Vec<String> = out
            .lines()
            .filter_map(|l| l.split_once("threads ").map(|(_, v)| v.trim().to_string()))
            .collect();
        seen.dedup();
        seen
    };
    let cores = std::thread::available_parallelism().unwrap().get();
    assert_eq!(threads("2", None), [(cores / 2).max(1).to_string()]);
    assert_eq!(threads("3", None), [(cores / 3).max(1).to_string()]);
    // A choice of the user's stands, and one rank keeps the whole machine.
    assert_eq!(threads("2", Some("5")), ["5"]);
    assert_eq!(threads("1", None), ["unset"]);
}

#[test]
fn ranks_started_by_candle_run_form_a_group_and_free_the_port_after() {
    if is_child() {
        let pg = ProcessGroup::from_env(&Device::Cpu).unwrap();
        let x = Tensor::new(&[pg.rank() as f32 + 1.0], &Device::Cpu).unwrap();
        let y = pg.all_reduce(&x, ReduceOp::Sum).unwrap();
        assert_eq!(y.to_vec1::<f32>().unwrap(), [6.0]);
        println!("port {}", std::env::var("MASTER_PORT").unwrap());
        done();
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let test = "ranks_started_by_candle_run_form_a_group_and_free_the_port_after";
    let mut cmd = candle_run(&["--nproc-per-node", "3"]);
    cmd.arg(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(common::CHILD, "1");
    let out = common::run_ok(cmd, LIMIT);
    for r in 0..3 {
        assert!(out.contains(&format!("[rank{r}]: {DONE}")), "{out}");
    }
    let port: u16 = out
        .lines()
        .find_map(|l| {
            l.split_once("port ")
                .map(|(_, p)| p.trim().parse().unwrap())
        })
        .unwrap();
    std::net::TcpListener::bind(("127.0.0.1", port)).expect("the master port is free again");
}

#[test]
fn a_failing_rank_stops_the_others_and_its_status_is_the_launchers() {
    // Ranks 0 and 2 ignore SIGTERM (and so does their child sleep), so they must be killed
    // after the grace period; rank 1 fails with status 7.
    let script = r#"
        echo "pid $$"
        if [ "$RANK" = 1 ]; then sleep 0.3; exit 7; fi
        trap "" TERM
        sleep 60 &
        echo "grandchild $!"
        wait
    "#;
    let started = Instant::now();
    let ranks = Ranks::spawn(vec![candle_run(&[
        "--nproc-per-node",
        "3",
        "--grace-period",
        "1",
        "sh",
        "-c",
        script,
    ])]);
    let ended = ranks.wait(LIMIT).remove(0);
    let took = started.elapsed();
    assert_eq!(ended.status.code(), Some(7), "{}", ended.output);
    assert!(
        ended.output.contains("rank 1 failed: exited with status 7"),
        "{}",
        ended.output
    );
    assert!(took < Duration::from_secs(10), "took {took:?}");
    let mut all = pids(&ended.output, "pid ");
    all.extend(pids(&ended.output, "grandchild "));
    assert_eq!(all.len(), 5, "{}", ended.output);
    assert_all_gone(&all);
}

#[test]
fn a_rank_killed_by_a_signal_gives_128_plus_the_signal() {
    let script = r#"if [ "$RANK" = 0 ]; then kill -9 $$; fi; sleep 60"#;
    let out = common::run(
        candle_run(&["--nproc-per-node", "2", "sh", "-c", script]),
        LIMIT,
    );
    assert_eq!(out.status.code(), Some(137));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("rank 0 failed: was killed by SIGKILL"),
        "{err}"
    );
}

#[test]
fn sigterm_to_the_launcher_reaches_every_rank() {
    let script = r#"trap 'echo "got TERM"; exit 0' TERM; echo ready; sleep 60 & wait"#;
    let ranks = Ranks::spawn(vec![candle_run(&[
        "--nproc-per-node",
        "2",
        "sh",
        "-c",
        script,
    ])]);
    ranks.wait_for(0, "[rank0]: ready", LIMIT);
    ranks.wait_for(0, "[rank1]: ready", LIMIT);
    let pid = ranks.pid(0).to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let ended = ranks.wait(LIMIT).remove(0);
    assert_eq!(ended.status.code(), Some(143), "{}", ended.output);
    assert!(
        ended.output.contains("[rank0]: got TERM"),
        "{}",
        ended.output
    );
    assert!(
        ended.output.contains("[rank1]: got TERM"),
        "{}",
        ended.output
    );
    assert!(
        ended.output.contains("interrupted by SIGTERM"),
        "{}",
        ended.output
    );
}

#[test]
fn bad_arguments_exit_2_with_the_reason() {
    let out = common::run(candle_run(&["--nproc-per-node", "0", "true"]), LIMIT);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("start at least one process"));
    let out = common::run(candle_run(&["--nnodes", "2", "true"]), LIMIT);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--master-port"));
    let out = common::run(
        candle_run(&["--nproc-per-node", "1", "/no/such/program"]),
        LIMIT,
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("starting rank 0"));
    // An unknown option, with the help hint once.
    let out = common::run(candle_run(&["--bogus", "true"]), LIMIT);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        err.contains("--bogus: not an option of candle-run"),
        "{err}"
    );
    assert_eq!(err.matches("candle-run --help").count(), 1, "{err}");
    // A thread count that rayon would silently ignore.
    let mut cmd = candle_run(&["--nproc-per-node", "1", "true"]);
    cmd.env("RAYON_NUM_THREADS", "x");
    let out = common::run(cmd, LIMIT);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("RAYON_NUM_THREADS") && err.contains("\"x\""),
        "{err}"
    );
}

#[test]
fn launch_spawn_runs_every_rank_and_reports_the_one_that_failed() {
    let example = common::example("dist_allreduce");
    let mut cmd = Command::new(&example);
    cmd.args(["--nproc", "3"]).env("RUST_BACKTRACE", "0");
    let out = common::run_ok(cmd, LIMIT);
    for r in 0..3 {
        let want = format!(
            "[rank{r}]: rank {r} of 3: all_reduce(sum) = [6.0, 30.0], all_gather = [1.0, 2.0, 3.0]"
        );
        assert!(out.contains(&want), "{out}");
    }
    // The same program under candle-run: each process is one rank.
    let mut cmd = candle_run(&["--nproc-per-node", "2"]);
    cmd.arg(&example);
    let out = common::run_ok(cmd, LIMIT);
    assert!(
        out.contains("[rank1]: rank 1 of 2: all_reduce(sum) = [3.0, 20.0]"),
        "{out}"
    );

    let mut cmd = Command::new(&example);
    cmd.args(["--nproc", "3", "--fail-rank", "1"])
        .env("RUST_BACKTRACE", "0");
    let out = common::run(cmd, LIMIT);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("rank 1 failed: exited with status 1: rank 1 was asked to fail"),
        "{err}"
    );
}

/// The launcher's temporary folders left in the temporary directory by launcher `pid`.
fn leftover_folders(pid: u32) -> Vec<std::path::PathBuf> {
    let prefix = format!("candle-run-{pid}-");
    std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect()
}

/// Starts two ranks that each start a child and wait; returns the launcher and the children's
/// pids.
fn ranks_with_children() -> (Ranks, Vec<u32>) {
    let script = r#"sleep 301 & echo "child $!"; wait"#;
    let ranks = Ranks::spawn(vec![candle_run(&[
        "--nproc-per-node",
        "2",
        "--grace-period",
        "2",
        "sh",
        "-c",
        script,
    ])]);
    ranks.wait_for(0, "[rank0]: child ", LIMIT);
    ranks.wait_for(0, "[rank1]: child ", LIMIT);
    let children = {
        let deadline = Instant::now() + LIMIT;
        loop {
            let found = pids(&ranks.output(0), "]: child ");
            if found.len() == 2 || Instant::now() > deadline {
                break found;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    assert_eq!(children.len(), 2);
    assert!(children.iter().all(|&p| alive(p)));
    (ranks, children)
}

#[test]
fn nothing_the_job_started_survives_a_sigkilled_launcher() {
    let (mut ranks, children) = ranks_with_children();
    let launcher = ranks.pid(0);
    assert_eq!(
        leftover_folders(launcher).len(),
        1,
        "the launcher's folder exists"
    );
    ranks.kill(0); // SIGKILL
                   // The guardian gives the orphans the grace period after SIGTERM.
    let deadline = Instant::now() + Duration::from_secs(10);
    while children.iter().any(|&p| alive(p)) || !leftover_folders(launcher).is_empty() {
        assert!(
            Instant::now() < deadline,
            "after 10 s: children alive {:?}, folders {:?}",
            children.iter().map(|&p| alive(p)).collect::<Vec<_>>(),
            leftover_folders(launcher)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sighup_stops_the_job_like_sigterm_and_nothing_survives() {
    let (ranks, children) = ranks_with_children();
    let launcher = ranks.pid(0);
    assert!(Command::new("kill")
        .args(["-HUP", &launcher.to_string()])
        .status()
        .unwrap()
        .success());
    let ended = ranks.wait(LIMIT).remove(0);
    assert_eq!(ended.status.code(), Some(129), "{}", ended.output);
    assert!(
        ended.output.contains("interrupted by SIGHUP"),
        "{}",
        ended.output
    );
    assert_all_gone(&children);
    assert!(leftover_folders(launcher).is_empty());
}

/// The peak resident memory of process `pid` so far, in KiB.
fn peak_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

#[test]
fn a_rank_writing_a_huge_line_costs_the_launcher_bounded_memory() {
    // 64 MB without a newline, then time for the test to look at the launcher.
    let script = "head -c 64000000 /dev/zero | tr '\\0' x; echo; echo written; sleep 2";
    let ranks = Ranks::spawn(vec![candle_run(&[
        "--nproc-per-node",
        "1",
        "sh",
        "-c",
        script,
    ])]);
    let launcher = ranks.pid(0);
    let mut peak = 0;
    let deadline = Instant::now() + LIMIT;
    while !ranks.output(0).contains("[rank0]: written") {
        peak = peak.max(peak_kib(launcher).unwrap_or(0));
        assert!(Instant::now() < deadline, "the rank never finished writing");
        std::thread::sleep(Duration::from_millis(50));
    }
    peak = peak.max(peak_kib(launcher).unwrap_or(0));
    let ended = ranks.wait(LIMIT).remove(0);
    assert!(
        ended.status.success(),
        "{}",
        &ended.output[ended.output.len() - 200..]
    );
    assert!(peak < 20_000, "the launcher peaked at {peak} KiB");
    // Forwarded in prefixed pieces, nothing lost.
    let xs: usize = ended
        .output
        .lines()
        .filter_map(|l| l.strip_prefix("[rank0]: "))
        .map(|l| l.bytes().filter(|&b| b == b'x').count())
        .sum();
    assert_eq!(xs, 64_000_000);
    assert!(ended
        .output
        .lines()
        .all(|l| l.starts_with("[rank0]: ") || l.is_empty() || !l.contains('x')));
}
