//! Point-to-point messages and all-to-all, over thread ranks and real processes on 127.0.0.1
//! (shared memory, Unix sockets, TCP): exact values in every dtype, uneven splits, receives
//! that expect something else, misuse, and a sender killed while its receiver waits.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_parallel::distributed::{self, ProcessGroup, ReduceOp};
use candle_parallel::Error;
use common::p2p::{check_all_to_all, check_p2p, check_p2p_mismatch, check_p2p_misuse, message};
use common::{done, is_child, join_child, Ranks};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(120);

fn check_all(pg: &ProcessGroup) {
    check_p2p(pg);
    check_p2p_mismatch(pg);
    check_p2p_misuse(pg);
    check_all_to_all(pg);
}

#[test]
fn messages_and_all_to_all_are_exact_over_2_and_3_thread_ranks() {
    for n in [2, 3] {
        distributed::spawn_threads(n, |pg| {
            check_all(&pg);
            // And on a group made from the world, whose numbering is its own.
            if let Some(pair) = pg.new_group(&[n - 1, 0])? {
                check_p2p(&pair);
            }
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn a_group_of_one_refuses_messages_and_all_to_all_is_a_copy() {
    distributed::spawn_threads(1, |pg| {
        check_p2p_misuse(&pg);
        let x = message(0, 1, &[3, 2], DType::F32);
        let got = pg.all_to_all(std::slice::from_ref(&x))?;
        assert_eq!(got[0].to_vec2::<f32>()?, x.to_vec2::<f32>()?);
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_thread_rank_that_leaves_is_named_by_its_receiver() {
    let results = distributed::spawn_threads_with_error(2, |pg| -> Result<(), Error> {
        if pg.rank() == 0 {
            return Ok(()); // leaves without sending
        }
        let err = pg.recv(0, 3, DType::F32).unwrap_err();
        assert!(matches!(err, Error::PeerLost { rank: 0, .. }), "{err}");
        Ok(())
    });
    results.unwrap();
}

fn processes_child() {
    let pg = join_child();
    check_all(&pg);
    done();
}

#[test]
fn messages_and_all_to_all_are_exact_over_2_processes() {
    if is_child() {
        return processes_child();
    }
    Ranks::world("messages_and_all_to_all_are_exact_over_2_processes", 2).assert_all_pass(LIMIT);
}

#[test]
fn messages_and_all_to_all_are_exact_over_3_processes_on_tcp() {
    if is_child() {
        return processes_child();
    }
    let port = common::free_port();
    let envs = (0..3)
        .map(|r| {
            let mut env = common::rank_env(r, 3, port);
            env.push(("CANDLE_PARALLEL_UNIX_SOCKETS".into(), "0".into()));
            env
        })
        .collect();
    Ranks::start(
        "messages_and_all_to_all_are_exact_over_3_processes_on_tcp",
        envs,
    )
    .assert_all_pass(LIMIT);
}

#[test]
fn a_sender_killed_while_its_receiver_waits_is_named() {
    if is_child() {
        let pg = join_child();
        if pg.rank() == 2 {
            println!("ready");
            std::thread::sleep(Duration::from_secs(60));
            return;
        }
        // Rank 0 waits on a message from rank 2, rank 1 on an all-to-all with it.
        let err = if pg.rank() == 0 {
            let pending = pg.recv_async(2, 4, DType::F32).unwrap();
            println!("entering");
            pending.wait().unwrap_err()
        } else {
            let x: Vec<Tensor> = (0..3)
                .map(|_| Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap())
                .collect();
            println!("entering");
            pg.all_to_all(&x).unwrap_err()
        };
        assert!(matches!(err, Error::PeerLost { rank: 2, .. }), "{err}");
        let kill_seen = Instant::now();
        let again = pg
            .all_reduce(
                &Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap(),
                ReduceOp::Sum,
            )
            .unwrap_err();
        assert!(again.to_string().contains("rank 2 was lost"), "{again}");
        assert!(kill_seen.elapsed() < Duration::from_secs(1));
        return done();
    }
    Ranks::kill_rank_2_during(
        "a_sender_killed_while_its_receiver_waits_is_named",
        "entering",
        LIMIT,
    );
}

#[test]
fn a_sender_that_leaves_without_sending_is_named_with_the_message_it_owes() {
    if is_child() {
        let pg = join_child();
        if pg.rank() == 0 {
            drop(pg);
            return done();
        }
        let err = pg.recv(0, 4, DType::F32).unwrap_err();
        assert!(matches!(err, Error::PeerLost { rank: 0, .. }), "{err}");
        assert!(
            err.to_string()
                .contains("without sending message #1 to rank 1"),
            "{err}"
        );
        return done();
    }
    Ranks::world(
        "a_sender_that_leaves_without_sending_is_named_with_the_message_it_owes",
        2,
    )
    .assert_all_pass(LIMIT);
}
