//! Process groups of real processes on 127.0.0.1: each test starts its ranks by running itself
//! again as child processes (see `common::Ranks`), with torchrun's environment.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_parallel::distributed::store::Store;
use candle_parallel::distributed::{Backend, InitConfig, ProcessGroup, ReduceOp, Rendezvous};
use candle_parallel::Error;
use common::collectives::{
    check_async, check_collectives, check_mismatches, check_new_group, check_special_values,
};
use common::{child_options, done, is_child, join_child, Ranks, DONE};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(120);

fn collectives_child() {
    let pg = join_child();
    let r = Rendezvous::from_env().unwrap();
    assert_eq!(pg.backend(), Backend::Tcp);
    assert_eq!((pg.rank(), pg.world_size()), (r.rank, r.world_size));
    assert_eq!(
        (pg.local_rank(), pg.local_world_size()),
        (r.local_rank, r.local_world_size)
    );
    // With 2 or 3 ranks every peer is a ring neighbour, all on this machine.
    let off = |var: &str| std::env::var(var).as_deref() == Ok("0");
    let want = if !cfg!(target_os = "linux") || off("CANDLE_PARALLEL_UNIX_SOCKETS") {
        "tcp"
    } else if off("CANDLE_PARALLEL_SHM") {
        "unix"
    } else {
        "shm"
    };
    // One machine: one ring (the hierarchical all-reduce is for several).
    assert_eq!(
        pg.algorithm(),
        Some(candle_parallel::distributed::Algorithm::Ring)
    );
    let links = pg.transports();
    assert_eq!(links[pg.rank()], None);
    assert!(
        links.iter().flatten().all(|k| *k == want),
        "want {want}: {links:?}"
    );
    check_collectives(&pg);
    check_mismatches(&pg);
    done();
}

#[test]
fn every_collective_matches_local_values_over_2_processes() {
    if is_child() {
        return collectives_child();
    }
    Ranks::world("every_collective_matches_local_values_over_2_processes", 2)
        .assert_all_pass(LIMIT);
}

#[test]
fn every_collective_matches_local_values_over_3_processes() {
    if is_child() {
        return collectives_child();
    }
    Ranks::world("every_collective_matches_local_values_over_3_processes", 3)
        .assert_all_pass(LIMIT);
}

/// Starts 3 ranks of `test` with `var=0` in their environment.
fn three_ranks_with(test: &str, var: &str) -> Ranks {
    let port = common::free_port();
    let envs = (0..3)
        .map(|r| {
            let mut env = common::rank_env(r, 3, port);
            env.push((var.into(), "0".into()));
            env
        })
        .collect();
    Ranks::start(test, envs)
}

#[test]
fn every_collective_matches_local_values_over_tcp_only() {
    if is_child() {
        return collectives_child();
    }
    let test = "every_collective_matches_local_values_over_tcp_only";
    three_ranks_with(test, "CANDLE_PARALLEL_UNIX_SOCKETS").assert_all_pass(LIMIT);
}

#[test]
fn every_collective_matches_local_values_over_unix_sockets_without_shared_memory() {
    if is_child() {
        return collectives_child();
    }
    let test = "every_collective_matches_local_values_over_unix_sockets_without_shared_memory";
    three_ranks_with(test, "CANDLE_PARALLEL_SHM").assert_all_pass(LIMIT);
}

#[test]
fn every_collective_matches_local_values_in_a_tcp_group_of_one() {
    let pg = ProcessGroup::new(&common::solo_rendezvous(), &Device::Cpu, child_options()).unwrap();
    assert_eq!(pg.transports(), [None]);
    check_collectives(&pg);
}

#[test]
fn ranks_meet_through_a_tcp_url_or_explicit_values() {
    if is_child() {
        let env = Rendezvous::from_env().unwrap();
        let pg = if env.rank == 0 {
            let url = format!("tcp://127.0.0.1:{}", env.master_port);
            ProcessGroup::from_url(&url, 0, 2, &Device::Cpu, child_options()).unwrap()
        } else {
            let explicit = Rendezvous {
                master_addr: "localhost".into(),
                master_port: env.master_port,
                rank: 1,
                world_size: 2,
                local_rank: 0,
                local_world_size: 1,
                launcher: candle_parallel::distributed::Launcher::Given,
            };
            ProcessGroup::new(&explicit, &Device::Cpu, child_options()).unwrap()
        };
        let x = Tensor::new(&[pg.rank() as f32 + 1.0], &Device::Cpu).unwrap();
        let y = pg.all_reduce(&x, ReduceOp::Sum).unwrap();
        assert_eq!(y.to_vec1::<f32>().unwrap(), [3.0]);
        return done();
    }
    Ranks::world("ranks_meet_through_a_tcp_url_or_explicit_values", 2).assert_all_pass(LIMIT);
}

#[test]
fn a_missing_rank_is_named_when_the_rendezvous_times_out() {
    if is_child() {
        // Rank 0 hosts the store: it waits longer, so that rank 2 sees its own timeout.
        let rank = Rendezvous::from_env().unwrap().rank;
        let o = InitConfig {
            rendezvous_timeout: Duration::from_millis(if rank == 0 { 3000 } else { 1500 }),
            ..child_options()
        };
        let err = ProcessGroup::new(&Rendezvous::from_env().unwrap(), &Device::Cpu, o)
            .unwrap_err()
            .to_string();
        assert!(err.contains("2 of 3 ranks joined"), "{err}");
        assert!(
            err.contains("rank 1 never came") && err.contains("CANDLE_PARALLEL_RENDEZVOUS_TIMEOUT"),
            "{err}"
        );
        return done();
    }
    let port = common::free_port();
    let envs = vec![common::rank_env(0, 3, port), common::rank_env(2, 3, port)];
    Ranks::start(
        "a_missing_rank_is_named_when_the_rendezvous_times_out",
        envs,
    )
    .assert_all_pass(LIMIT);
}

#[test]
fn strangers_with_a_wrong_token_are_refused_and_do_not_disturb_the_job() {
    if is_child() {
        if Rendezvous::from_env().unwrap().rank == 1 {
            // Give the stranger time to knock while rank 0 waits.
            std::thread::sleep(Duration::from_millis(1500));
        }
        let pg = join_child();
        let y = pg
            .all_reduce(&Tensor::new(&[1f64], &Device::Cpu).unwrap(), ReduceOp::Sum)
            .unwrap();
        assert_eq!(y.to_vec1::<f64>().unwrap(), [2.0]);
        return done();
    }
    let port = common::free_port();
    let envs = (0..2).map(|r| common::rank_env(r, 2, port)).collect();
    let ranks = Ranks::start(
        "strangers_with_a_wrong_token_are_refused_and_do_not_disturb_the_job",
        envs,
    );
    // Knock on the store until it answers: it must refuse us.
    let addr = format!("127.0.0.1:{port}").parse().unwrap();
    let started = Instant::now();
    let refusal = loop {
        match Store::connect(addr, "not-the-token", 9, Duration::from_secs(10)) {
            Err(Error::Refused { reason, .. }) => break reason,
            Err(e) if started.elapsed() < Duration::from_secs(10) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
        }
    };
    assert!(refusal.contains("wrong job token"), "{refusal}");
    // And a connection that speaks another protocol altogether.
    let mut raw = std::net::TcpStream::connect(addr).unwrap();
    std::io::Write::write_all(&mut raw, b"GET / HTTP/1.0\r\n\r\n").unwrap();
    ranks.assert_all_pass(LIMIT);
}

/// Tells the winners through the store that this refused process is done, so that they keep
/// the store up until then.
fn report_refusal(r: &Rendezvous) {
    let addr = r.master_socket().unwrap();
    let store = Store::connect(
        addr,
        &child_options().token,
        r.rank,
        Duration::from_secs(30),
    )
    .unwrap();
    store.set("refused-done", b"1").unwrap();
}

fn wait_for_refusal(pg: &ProcessGroup) {
    pg.store().unwrap().get("refused-done", LIMIT).unwrap();
}

#[test]
fn two_processes_claiming_one_rank_are_told_so() {
    if is_child() {
        let r = Rendezvous::from_env().unwrap();
        match ProcessGroup::new(&r, &Device::Cpu, child_options()) {
            Ok(pg) => {
                pg.barrier().unwrap();
                if pg.rank() == 0 {
                    wait_for_refusal(&pg);
                }
                pg.barrier().unwrap();
            }
            Err(e) => {
                println!("refused: {e}");
                report_refusal(&r);
            }
        }
        return done();
    }
    let port = common::free_port();
    let envs = vec![
        common::rank_env(0, 2, port),
        common::rank_env(1, 2, port),
        common::rank_env(1, 2, port),
    ];
    let outputs =
        Ranks::start("two_processes_claiming_one_rank_are_told_so", envs).assert_all_pass(LIMIT);
    let refused: Vec<&String> = outputs.iter().filter(|o| o.contains("refused:")).collect();
    assert_eq!(refused.len(), 1, "{outputs:?}");
    assert!(
        refused[0].contains("rank 1 is already claimed by another process"),
        "{refused:?}"
    );
}

#[test]
fn a_second_rank_0_is_told_that_rank_0_is_taken() {
    if is_child() {
        let r = Rendezvous::from_env().unwrap();
        if std::env::var("CP_SECOND").is_ok() {
            let err = loop {
                // Until the first rank 0 holds the port, this one would simply take it.
                match Store::connect(r.master_socket().unwrap(), &child_options().token, 0, LIMIT) {
                    Ok(s) if s.wait(&["rank/0"], LIMIT).unwrap().is_empty() => {
                        break ProcessGroup::new(&r, &Device::Cpu, child_options()).unwrap_err()
                    }
                    _ => std::thread::sleep(Duration::from_millis(20)),
                }
            };
            assert!(
                err.to_string().contains("rank 0 is already claimed"),
                "{err}"
            );
            report_refusal(&r);
        } else {
            let pg = join_child();
            if pg.rank() == 0 {
                wait_for_refusal(&pg);
            }
            pg.barrier().unwrap();
        }
        return done();
    }
    let port = common::free_port();
    let mut second = common::rank_env(0, 2, port);
    second.push(("CP_SECOND".into(), "1".into()));
    let envs = vec![
        common::rank_env(0, 2, port),
        second,
        common::rank_env(1, 2, port),
    ];
    Ranks::start("a_second_rank_0_is_told_that_rank_0_is_taken", envs).assert_all_pass(LIMIT);
}

#[test]
fn a_killed_rank_is_named_by_the_others_pending_in_a_collective() {
    if is_child() {
        let pg = join_child();
        if pg.rank() == 2 {
            println!("ready");
            std::thread::sleep(Duration::from_secs(60));
            return;
        }
        println!("entering");
        let x = Tensor::zeros(1 << 20, DType::F32, &Device::Cpu).unwrap();
        let err = pg.all_reduce(&x, ReduceOp::Sum).unwrap_err();
        assert!(matches!(err, Error::PeerLost { rank: 2, .. }), "{err}");
        let kill_seen = Instant::now();
        // Later collectives fail at once too.
        let again = pg.barrier().unwrap_err();
        assert!(again.to_string().contains("rank 2 was lost"), "{again}");
        assert!(kill_seen.elapsed() < Duration::from_secs(1));
        return done();
    }
    Ranks::kill_rank_2_during(
        "a_killed_rank_is_named_by_the_others_pending_in_a_collective",
        "entering",
        LIMIT,
    );
}

#[test]
fn a_rank_killed_during_the_data_phase_is_named_by_its_neighbour() {
    if is_child() {
        // Large all-reduces: most of the time goes to moving data, which between ranks of
        // one machine waits on shared memory rather than on a socket.
        let pg = join_child();
        let x = Tensor::ones(4 << 20, DType::F32, &Device::Cpu).unwrap();
        println!("looping");
        let started = Instant::now();
        let err = loop {
            match pg.all_reduce(&x, ReduceOp::Sum) {
                Ok(_) if started.elapsed() < Duration::from_secs(60) => {}
                Ok(_) => panic!("rank 1 was never killed"),
                Err(e) => break e,
            }
        };
        assert_eq!(pg.rank(), 0);
        assert!(matches!(err, Error::PeerLost { rank: 1, .. }), "{err}");
        return done();
    }
    let mut ranks = Ranks::world(
        "a_rank_killed_during_the_data_phase_is_named_by_its_neighbour",
        2,
    );
    ranks.wait_for(0, "looping", LIMIT);
    ranks.wait_for(1, "looping", LIMIT);
    std::thread::sleep(Duration::from_millis(300));
    let killed = Instant::now();
    ranks.kill(1);
    ranks.wait_for(0, DONE, LIMIT);
    let noticed = killed.elapsed();
    let ended = ranks.wait(LIMIT);
    assert!(ended[0].status.success(), "{}", ended[0].output);
    assert!(
        noticed < Duration::from_secs(10),
        "rank 0 took {noticed:?} to notice"
    );
}

#[test]
fn a_rank_that_panics_is_named_by_the_others() {
    if is_child() {
        let pg = join_child();
        if pg.rank() == 1 {
            panic!("rank 1 crashes before the collective");
        }
        let err = pg.barrier().unwrap_err();
        assert!(matches!(err, Error::PeerLost { rank: 1, .. }), "{err}");
        return done();
    }
    let ended = Ranks::world("a_rank_that_panics_is_named_by_the_others", 2).wait(LIMIT);
    assert!(
        ended[0].status.success() && ended[0].output.contains(DONE),
        "{}",
        ended[0].output
    );
    assert!(!ended[1].status.success());
}

#[test]
fn bad_local_configuration_fails_fast_with_a_clear_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let r = |rank, world, port| Rendezvous {
        master_addr: "127.0.0.1".into(),
        master_port: port,
        rank,
        world_size: world,
        local_rank: 0,
        local_world_size: 1,
        launcher: candle_parallel::distributed::Launcher::Given,
    };
    let quick = InitConfig {
        rendezvous_timeout: Duration::from_millis(500),
        ..Default::default()
    };
    let err = ProcessGroup::new(&r(0, 1, port), &Device::Cpu, quick.clone()).unwrap_err();
    assert!(matches!(err, Error::PortInUse { .. }), "{err}");
    assert!(err.to_string().contains("already in use"), "{err}");

    let nobody = common::free_port();
    let started = Instant::now();
    let err = ProcessGroup::new(&r(1, 2, nobody), &Device::Cpu, quick.clone()).unwrap_err();
    assert!(matches!(err, Error::Unreachable { .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));

    let err = ProcessGroup::new(&r(2, 2, nobody), &Device::Cpu, quick.clone()).unwrap_err();
    assert!(
        err.to_string().contains("RANK 2: not below WORLD_SIZE 2"),
        "{err}"
    );
    let err = ProcessGroup::new(&r(0, 0, nobody), &Device::Cpu, quick).unwrap_err();
    assert!(matches!(err, Error::Config { .. }), "{err}");

    // A group of one works without anybody else.
    let solo = ProcessGroup::new(&r(0, 1, nobody), &Device::Cpu, InitConfig::default()).unwrap();
    let y = solo
        .all_reduce(&Tensor::new(&[4f32], &Device::Cpu).unwrap(), ReduceOp::Avg)
        .unwrap();
    assert_eq!(y.to_vec1::<f32>().unwrap(), [4.0]);
}

#[test]
fn async_calls_in_flight_give_exact_results_over_1_2_and_3_processes() {
    let test = "async_calls_in_flight_give_exact_results_over_1_2_and_3_processes";
    if is_child() {
        check_async(&join_child());
        return done();
    }
    for world in 1..=3 {
        Ranks::world(test, world).assert_all_pass(LIMIT);
    }
}

#[test]
fn nan_infinities_and_signed_zeros_follow_the_one_rule_over_3_processes() {
    let test = "nan_infinities_and_signed_zeros_follow_the_one_rule_over_3_processes";
    if is_child() {
        check_special_values(&join_child());
        return done();
    }
    Ranks::world(test, 3).assert_all_pass(LIMIT);
}

#[test]
fn new_groups_of_processes_run_beside_their_parent() {
    let test = "new_groups_of_processes_run_beside_their_parent";
    if is_child() {
        check_new_group(&join_child());
        return done();
    }
    Ranks::world(test, 3).assert_all_pass(LIMIT);
    Ranks::world(test, 2).assert_all_pass(LIMIT);
}

#[test]
fn a_rank_killed_while_an_async_call_is_in_flight_is_named_by_wait() {
    if is_child() {
        let pg = join_child();
        if pg.rank() == 2 {
            println!("ready");
            std::thread::sleep(Duration::from_secs(60));
            return;
        }
        let x = Tensor::zeros(1 << 20, DType::F32, &Device::Cpu).unwrap();
        let work = pg.all_reduce_async(&x, ReduceOp::Sum).unwrap();
        println!("issued");
        let err = work.wait().unwrap_err();
        assert!(matches!(err, Error::PeerLost { rank: 2, .. }), "{err}");
        // Later calls fail at once too, from wait or from the call itself.
        let again = pg
            .all_reduce_async(&x, ReduceOp::Sum)
            .and_then(|w| w.wait());
        assert!(again.unwrap_err().to_string().contains("rank 2 was lost"));
        return done();
    }
    Ranks::kill_rank_2_during(
        "a_rank_killed_while_an_async_call_is_in_flight_is_named_by_wait",
        "issued",
        LIMIT,
    );
}

#[test]
fn a_rank_that_runs_fewer_steps_is_named_with_the_likely_cause() {
    if is_child() {
        let pg = join_child();
        let x = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        // Rank 1 runs one step fewer and leaves; rank 0 waits for it in its last step.
        let steps = if pg.rank() == 0 { 3 } else { 2 };
        let mut last = Ok(x.clone());
        for _ in 0..steps {
            last = pg.all_reduce(&x, ReduceOp::Sum);
        }
        if pg.rank() == 0 {
            let err = last.unwrap_err().to_string();
            assert!(
                err.contains("rank 1") && err.contains("different numbers of collectives"),
                "{err}"
            );
            assert!(err.contains("join()"), "{err}");
        } else {
            last.unwrap();
        }
        return done();
    }
    Ranks::world(
        "a_rank_that_runs_fewer_steps_is_named_with_the_likely_cause",
        2,
    )
    .assert_all_pass(LIMIT);
}
