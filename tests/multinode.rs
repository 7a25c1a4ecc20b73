//! Two machines of our own: jobs across two network namespaces joined by a veth pair
//! (`common::netns`), each namespace a machine with its own address, loopback and Unix sockets.
//! The tests need root and iproute2 (true on CI); elsewhere they skip, saying why.

mod common;

use candle_parallel::distributed::Algorithm;
use common::collectives::{
    check_async, check_collectives, check_mismatches, check_new_group, check_special_values,
};
use common::netns::{Machines, OrSkip};
use common::{done, is_child, test_lines, Ranks, CHILD};
use std::process::Command;
use std::time::{Duration, Instant};

const RUN: &str = env!("CARGO_BIN_EXE_candle-run");
const LIMIT: Duration = Duration::from_secs(180);
#[test]
fn cifar_ddp_on_two_machines_of_two_ranks_learns_as_cifar_dp_does() {
    let Some(m) = Machines::new("cifar").or_skip() else {
        return;
    };
    // One process with the global batch of 128 ...
    let mut dp = Command::new(common::example("cifar_dp"));
    dp.args(["--cpu", "--epochs", "1", "--batch-size", "128"]);
    let (dp_loss, dp_correct, _) = test_lines(&common::run_ok(dp, LIMIT));

    // ... and 4 ranks of 32 on two machines, started by a launcher on each.
    let example = common::example("cifar_ddp");
    let args = ["--cpu", "--epochs", "1", "--batch-size", "32"];
    let commands = (0..2)
        .map(|node| {
            let mut c = m.launcher(RUN, node, 2, &[], &example);
            c.args(args);
            c
        })
        .collect();
    let ranks = Ranks::spawn(commands);
    let ended = ranks.wait(LIMIT);
    for (node, e) in ended.iter().enumerate() {
        assert!(
            e.status.success(),
            "node {node} ({}):\n{}",
            e.status,
            e.output
        );
    }
    assert!(
        ended[0].output.contains("Let's use 4 processes!"),
        "{}",
        ended[0].output
    );
    let (loss, correct, _) = test_lines(&ended[0].output);
    common::assert_learns_alike((loss, correct), (dp_loss, dp_correct), &ended[0].output);
    m.assert_empty(Duration::from_secs(5));
}

/// A rank of the conformance run: checks that peers on the other machine are reached over TCP
/// and those on this one over Unix sockets or shared memory, and that the all-reduce is
/// hierarchical unless the ring was asked for, then runs the suite.
fn conformance_child() {
    let pg = common::join_child();
    let want = match std::env::var("CANDLE_PARALLEL_ALGORITHM").as_deref() {
        Ok("ring") => Algorithm::Ring,
        _ => Algorithm::Hierarchical,
    };
    assert_eq!(pg.algorithm(), Some(want));
    let local = pg.local_world_size();
    let node = pg.rank() / local;
    for (peer, kind) in pg.transports().iter().enumerate() {
        match kind {
            None => assert_eq!(peer, pg.rank()),
            Some(kind) if peer / local == node => {
                assert!(matches!(*kind, "unix" | "shm"), "rank {peer}: {kind}")
            }
            Some(kind) => assert_eq!(*kind, "tcp", "rank {peer} is on the other machine"),
        }
    }
    check_collectives(&pg);
    check_special_values(&pg);
    check_async(&pg);
    check_mismatches(&pg);
    check_new_group(&pg);
    done();
}

/// Runs the conformance suite on 2 machines of 2 ranks with `algorithm`, as test `test`.
fn conformance_across_two_machines(test: &str, algorithm: &str) {
    let Some(m) = Machines::new(test).or_skip() else {
        return;
    };
    let exe = std::env::current_exe().unwrap();
    let local = 2;
    let commands = (0..2 * local)
        .map(|rank| {
            let mut c = m.rank(&exe, rank, local);
            c.args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env(CHILD, "1")
                .env("RUST_BACKTRACE", "0")
                .env("CANDLE_PARALLEL_ALGORITHM", algorithm);
            c
        })
        .collect();
    Ranks::spawn(commands).assert_all_pass(LIMIT);
}

#[test]
fn the_collectives_conformance_suite_passes_across_two_machines_hierarchically() {
    if is_child() {
        return conformance_child();
    }
    conformance_across_two_machines(
        "the_collectives_conformance_suite_passes_across_two_machines_hierarchically",
        "auto",
    );
}

#[test]
fn the_collectives_conformance_suite_passes_across_two_machines_on_one_ring() {
    if is_child() {
        return conformance_child();
    }
    conformance_across_two_machines(
        "the_collectives_conformance_suite_passes_across_two_machines_on_one_ring",
        "ring",
    );
}

#[test]
fn a_partition_mid_training_fails_every_rank_within_peer_timeout_and_both_launchers() {
    let Some(m) = Machines::new("partition").or_skip() else {
        return;
    };
    let example = common::example("cifar_ddp");
    let commands = (0..2)
        .map(|node| {
            let mut c = m.launcher(RUN, node, 2, &[], &example);
            c.args(["--cpu", "--epochs", "50", "--batch-size", "32"])
                .env("CANDLE_PARALLEL_PEER_TIMEOUT", "3");
            c
        })
        .collect();
    let ranks = Ranks::spawn(commands);
    // Training has begun on both machines: every rank got through the rendezvous and DDP's
    // first broadcast.
    ranks.wait_for(0, "Let's use 4 processes!", LIMIT);
    std::thread::sleep(Duration::from_millis(1500));
    let cut = Instant::now();
    m.set_link(false);
    let ended = ranks.wait(Duration::from_secs(60));
    let took = cut.elapsed();
    for (node, e) in ended.iter().enumerate() {
        assert!(
            !e.status.success(),
            "node {node}'s launcher succeeded:\n{}",
            e.output
        );
        // Both ranks of the node failed naming a lost peer: one on the other machine, or
        // (relayed by a local peer's abort) the same.
        for rank in [2 * node, 2 * node + 1] {
            let line = e
                .output
                .lines()
                .find(|l| l.starts_with(&format!("[rank{rank}]: rank {rank} failed: ")))
                .unwrap_or_else(|| panic!("rank {rank} did not fail:\n{}", e.output));
            let remote = [2 * (1 - node), 2 * (1 - node) + 1];
            assert!(
                remote
                    .iter()
                    .any(|p| line.contains(&format!("rank {p} was lost"))),
                "{line}"
            );
        }
    }
    // 3 s of peer timeout, the launchers' 2 s of grace, and slack for a loaded machine.
    assert!(
        took < Duration::from_secs(20),
        "the launchers took {took:?} after the partition"
    );
    m.assert_empty(Duration::from_secs(10));
}
