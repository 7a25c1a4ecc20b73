//! Elastic restarts (`candle-run --max-restarts`) with real processes: a rank SIGKILLed
//! mid-epoch, the job restarted, the training resumed from its checkpoint to the weights of a
//! run that never stopped, on one machine and on two (network namespaces, `common::netns`:
//! root and iproute2, else skipped); restarts running out; a stopped launcher that does not
//! restart.

mod common;

use common::netns::{Machines, OrSkip};
use common::Ranks;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const RUN: &str = env!("CARGO_BIN_EXE_candle-run");
const LIMIT: Duration = Duration::from_secs(120);

fn candle_run(args: &[&str]) -> Command {
    let mut cmd = Command::new(RUN);
    cmd.args(args).env("RUST_BACKTRACE", "0");
    cmd
}

/// The process of rank `rank` in round `round` that `launcher` started.
fn rank_pid(launcher: u32, rank: usize, round: usize) -> Option<u32> {
    common::process_with_env(
        Some(launcher),
        &[
            format!("RANK={rank}"),
            format!("TORCHELASTIC_RESTART_COUNT={round}"),
        ],
    )
}

/// `candle-run --nproc-per-node 2 [extra] EXAMPLE args --checkpoint-dir DIR/ckpt --save
/// DIR/weights.safetensors`.
fn job(extra: &[&str], example: &str, args: &[&str], dir: &Path) -> (Command, PathBuf) {
    let weights = dir.join("weights.safetensors");
    let mut cmd = candle_run(&[&["--nproc-per-node", "2"], extra].concat());
    cmd.arg(common::example(example))
        .args(args)
        .arg("--checkpoint-dir")
        .arg(dir.join("ckpt"))
        .arg("--save")
        .arg(&weights);
    (cmd, weights)
}

/// Runs `example` twice under `candle-run` with the same checkpoint interval: once straight
/// through, once with `--max-restarts 2` and rank 1 SIGKILLed as soon as rank 0 reports the
/// checkpoint `after`. The second run must restart once, resume mid-epoch (at a position
/// within `(0, share)`) and end with the same weights, bit for bit.
fn killed_and_resumed_equals_uninterrupted(
    name: &str,
    example: &str,
    args: &[&str],
    after: &str,
    share: usize,
) {
    let dir = common::temp_dir(name);
    let straight = dir.join("straight");
    let (cmd, reference) = job(&[], example, args, &straight);
    common::run_ok(cmd, LIMIT);

    let elastic = dir.join("elastic");
    let (cmd, weights) = job(&["--max-restarts", "2"], example, args, &elastic);
    let ranks = Ranks::spawn(vec![cmd]);
    ranks.wait_for(0, after, LIMIT);
    let victim = rank_pid(ranks.pid(0), 1, 0).expect("rank 1 of round 0 is running");
    let killed = Command::new("kill")
        .args(["-KILL", &victim.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let ended = ranks.wait(LIMIT).remove(0);
    let out = &ended.output;
    assert!(ended.status.success(), "{}\n{out}", ended.status);
    assert!(
        out.contains("rank 1 failed: was killed by SIGKILL")
            && out.contains("restart 1 of 2 (TORCHELASTIC_RESTART_COUNT=1)")
            && !out.contains("restart 2 of 2"),
        "{out}"
    );
    let resumed = out
        .lines()
        .find_map(|l| l.split_once("[rank0]: Resumed at step ").map(|(_, r)| r))
        .unwrap_or_else(|| panic!("no resume line:\n{out}"));
    // "S (epoch E, P images (or samples) of each rank's share in)"
    let words: Vec<&str> = resumed.split_whitespace().collect();
    let position: usize = words[3].parse().unwrap();
    assert!(
        words[2] == "1," && position > 0 && position < share,
        "not mid-epoch: {resumed}"
    );
    let a = std::fs::read(&reference).unwrap();
    let b = std::fs::read(&weights).unwrap();
    assert!(
        a == b,
        "the resumed job's weights differ from the uninterrupted run's\n{out}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_rank_sigkilled_mid_epoch_restarts_and_cifar_ddp_ends_as_if_never_stopped() {
    // 2 ranks of 32 over 3840 images: 60 steps an epoch; the kill comes after step 10.
    let args = [
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
    killed_and_resumed_equals_uninterrupted(
        "elastic-cifar",
        "cifar_ddp",
        &args,
        "[rank0]: Checkpoint at step 10 saved",
        1920,
    );
}

/// `transformer_ddp` on 2 ranks of 16 over 2048 samples (64 steps an epoch, a checkpoint every
/// 4), with `layers` blocks of width 32 and `extra` options, killed after the checkpoint at
/// step 8 and resumed: it must end as the uninterrupted run.
fn transformer_killed_and_resumed(name: &str, layers: &str, extra: &[&str]) {
    let base = [
        "--cpu",
        "--epochs",
        "2",
        "--batch-size",
        "16",
        "--train-size",
        "2048",
        "--test-size",
        "50",
        "--layers",
        layers,
        "--dim",
        "32",
        "--checkpoint-every",
        "4",
    ];
    killed_and_resumed_equals_uninterrupted(
        name,
        "transformer_ddp",
        &[&base[..], extra].concat(),
        "[rank0]: Checkpoint at step 8 saved",
        1024,
    );
}

#[test]
fn a_rank_sigkilled_mid_epoch_restarts_and_transformer_ddp_under_zero2_ends_as_if_never_stopped() {
    // AdamW's sharded state and the learning-rate schedule resume with the step.
    transformer_killed_and_resumed("elastic-transformer", "1", &["--sharding", "zero2"]);
}

#[test]
fn a_rank_sigkilled_mid_epoch_restarts_and_transformer_ddp_fully_sharded_ends_as_if_never_stopped()
{
    // As above, fully sharded: the pieces, AdamW's state of them and the schedule resume.
    transformer_killed_and_resumed("elastic-transformer-full", "2", &["--sharding", "full"]);
}

#[test]
fn exhausted_restarts_exit_with_the_failing_ranks_code_and_ranks_see_their_round() {
    let script = r#"
        echo "round $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS token $CANDLE_PARALLEL_TOKEN"
        if [ "$RANK" = 1 ]; then exit 7; fi
        sleep 30
    "#;
    let out = common::run(
        candle_run(&[
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "sh",
            "-c",
            script,
        ]),
        LIMIT,
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{text}\n{err}");
    let mut tokens = Vec::new();
    for round in 0..3 {
        let seen: Vec<&str> = (0..2)
            .map(|rank| {
                let tag = format!("[rank{rank}]: round {round} of 2 token ");
                text.lines()
                    .find_map(|l| l.strip_prefix(&tag))
                    .unwrap_or_else(|| panic!("no {tag:?}:\n{text}"))
            })
            .collect();
        assert_eq!(seen[0], seen[1], "one token per round");
        tokens.push(seen[0].to_string());
    }
    assert!(!text.contains("round 3"), "{text}");
    tokens.dedup();
    assert_eq!(
        tokens.len(),
        3,
        "every round has a token of its own: {tokens:?}"
    );
    for k in 1..=2 {
        assert!(
            err.contains(&format!(
                "rank 1 failed: exited with status 7; restarting every rank of this machine: \
                 restart {k} of 2"
            )),
            "{err}"
        );
    }
    // The last line says that no restart was left.
    let last = err.lines().last().unwrap_or("");
    assert!(
        last.starts_with("candle-run: rank 1 failed: exited with status 7")
            && last.contains("the last of --max-restarts 2 (the job ran 3 times)"),
        "{err}"
    );
}

#[test]
fn sigterm_to_the_launcher_stops_the_job_without_a_restart() {
    // The ranks fail when asked to stop: that must not count as a failure to restart after.
    let script = r#"trap 'exit 3' TERM; echo "ready $TORCHELASTIC_RESTART_COUNT"; sleep 30 & wait"#;
    let ranks = Ranks::spawn(vec![candle_run(&[
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        "sh",
        "-c",
        script,
    ])]);
    ranks.wait_for(0, "[rank0]: ready 0", LIMIT);
    ranks.wait_for(0, "[rank1]: ready 0", LIMIT);
    ranks.signal(0, "TERM");
    let ended = ranks.wait(LIMIT).remove(0);
    assert_eq!(ended.status.code(), Some(143), "{}", ended.output);
    assert!(!ended.output.contains("restart"), "{}", ended.output);
    assert!(!ended.output.contains("ready 1"), "{}", ended.output);
}

/// `candle-run` on machine `node` of `m` (2 ranks each, meeting at machine 0) running cifar_ddp
/// with `args`, checkpointing into `dir/ckpt` (one folder: the machines share the file system)
/// and saving to `dir/weights.safetensors`.
fn cifar_on_machine(
    m: &Machines,
    node: usize,
    extra: &[&str],
    args: &[&str],
    dir: &Path,
) -> Command {
    let mut cmd = m.launcher(RUN, node, 2, extra, &common::example("cifar_ddp"));
    cmd.args(args)
        .arg("--checkpoint-dir")
        .arg(dir.join("ckpt"))
        .arg("--save")
        .arg(dir.join("weights.safetensors"))
        .env("RUST_BACKTRACE", "0");
    cmd
}

#[test]
fn on_two_machines_a_rank_sigkilled_mid_epoch_restarts_both_launchers_and_ends_as_if_never_stopped()
{
    let Some(m) = Machines::new("elastic").or_skip() else {
        return;
    };
    let dir = common::temp_dir("elastic-machines");
    // 4 ranks of 32 over 7680 images: 60 steps; the kill comes after step 10.
    let args = [
        "--cpu",
        "--epochs",
        "1",
        "--batch-size",
        "32",
        "--train-size",
        "7680",
        "--test-size",
        "200",
        "--checkpoint-every",
        "5",
    ];
    let straight = dir.join("straight");
    let ended = Ranks::spawn(
        (0..2)
            .map(|n| cifar_on_machine(&m, n, &[], &args, &straight))
            .collect(),
    )
    .wait(LIMIT);
    for (node, e) in ended.iter().enumerate() {
        assert!(
            e.status.success(),
            "node {node} ({}):\n{}",
            e.status,
            e.output
        );
    }

    let elastic = dir.join("elastic");
    let restarts = ["--max-restarts", "2"];
    let ranks = Ranks::spawn(
        (0..2)
            .map(|n| cifar_on_machine(&m, n, &restarts, &args, &elastic))
            .collect(),
    );
    ranks.wait_for(0, "[rank0]: Checkpoint at step 10 saved", LIMIT);
    // Rank 3 runs on machine 1, whose launcher is child 1 (`ip netns exec` execs it).
    let victim = rank_pid(ranks.pid(1), 3, 0).expect("rank 3 of round 0 is running");
    assert!(Command::new("kill")
        .args(["-KILL", &victim.to_string()])
        .status()
        .unwrap()
        .success());
    let ended = ranks.wait(LIMIT);
    for (node, e) in ended.iter().enumerate() {
        assert!(
            e.status.success(),
            "node {node} ({}):\n{}",
            e.status,
            e.output
        );
        // Both launchers took exactly one restart: machine 0's ranks lost their peer.
        assert!(
            e.output.contains("restart 1 of 2") && !e.output.contains("restart 2 of 2"),
            "node {node}:\n{}",
            e.output
        );
    }
    assert!(
        ended[1]
            .output
            .contains("rank 3 failed: was killed by SIGKILL"),
        "{}",
        ended[1].output
    );
    assert!(
        ended[0].output.contains("[rank0]: Resumed at step 1"),
        "{}",
        ended[0].output
    );
    let a = std::fs::read(straight.join("weights.safetensors")).unwrap();
    let b = std::fs::read(elastic.join("weights.safetensors")).unwrap();
    assert!(a == b, "the weights differ:\n{}", ended[0].output);
    m.assert_empty(Duration::from_secs(5));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_rank_sigkilled_mid_epoch_restarts_and_transformer_ddp_in_f16_resumes_its_loss_scale() {
    // f16 with the gradient scaler, started at 2^24: the first steps overflow and the scale
    // backs off at each; a run resumed without that state would start again at 2^24 and skip
    // as many steps again.
    transformer_killed_and_resumed(
        "elastic-transformer-f16",
        "1",
        &["--precision", "f16", "--init-scale", "16777216"],
    );
}
