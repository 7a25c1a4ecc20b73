//! What the job promises under failure and abuse, with real processes on 127.0.0.1: groups
//! re-created on one port, strangers on the store port, frozen ranks, another program on the
//! master port, and configuration errors that one rank knows about.

mod common;

use candle_core::{Device, Tensor};
use candle_parallel::distributed::store::Store;
use candle_parallel::distributed::{InitConfig, ProcessGroup, ReduceOp, Rendezvous};
use candle_parallel::Error;
use common::{child_options, done, is_child, join_child, rank_env, Ranks, DONE};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const LIMIT: Duration = Duration::from_secs(120);

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

#[test]
fn a_group_recreated_twenty_times_on_one_port_never_fails() {
    let test = "a_group_recreated_twenty_times_on_one_port_never_fails";
    if is_child() {
        for round in 0..20 {
            let pg = ProcessGroup::new(
                &Rendezvous::from_env().unwrap(),
                &Device::Cpu,
                child_options(),
            )
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
            let x = Tensor::new(&[round as f32], &Device::Cpu).unwrap();
            let y = pg.all_reduce(&x, ReduceOp::Sum).unwrap();
            assert_eq!(
                y.to_vec1::<f32>().unwrap(),
                [round as f32 * pg.world_size() as f32]
            );
        }
        done();
        return;
    }
    for world in [2, 3] {
        Ranks::world(test, world).assert_all_pass(LIMIT);
    }
}

#[test]
fn strangers_on_the_store_port_hold_no_more_than_a_few_descriptors_and_the_job_goes_on() {
    let test =
        "strangers_on_the_store_port_hold_no_more_than_a_few_descriptors_and_the_job_goes_on";
    if is_child() {
        let r = Rendezvous::from_env().unwrap();
        if r.rank == 1 {
            // Join once the strangers are in.
            std::thread::sleep(Duration::from_millis(1500));
        }
        let pg = join_child();
        println!("joined");
        // The job's own work, its file opens included, is unaffected.
        let path = std::env::temp_dir().join(format!("cp-strangers-{}", std::process::id()));
        std::fs::write(&path, b"ok").unwrap();
        std::fs::remove_file(&path).unwrap();
        let y = pg
            .all_reduce(&Tensor::new(&[1f32], &Device::Cpu).unwrap(), ReduceOp::Sum)
            .unwrap();
        assert_eq!(y.to_vec1::<f32>().unwrap(), [2.0]);
        // Stay up while the test counts descriptors.
        pg.store().unwrap().get("counted", LIMIT).unwrap();
        done();
        return;
    }
    let port = common::free_port();
    // Rank 0 runs with few descriptors: 200 strangers would exhaust them uncapped.
    let exe = std::env::current_exe().unwrap();
    let mut commands = Vec::new();
    for r in 0..2 {
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", "ulimit -n 256 && exec \"$@\"", "sh"])
            .arg(&exe)
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(common::CHILD, "1")
            .envs(rank_env(r, 2, port));
        commands.push(cmd);
    }
    let ranks = Ranks::spawn(commands);
    // Strangers: connected, silent or trickling one byte a second.
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let deadline = Instant::now() + LIMIT;
    let mut strangers = Vec::new();
    while strangers.len() < 200 && Instant::now() < deadline {
        match TcpStream::connect(addr) {
            Ok(s) => strangers.push(s),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    let trickle = std::thread::spawn({
        let mut some: Vec<TcpStream> = strangers
            .iter()
            .take(20)
            .map(|s| s.try_clone().unwrap())
            .collect();
        move || {
            for _ in 0..6 {
                for s in &mut some {
                    let _ = s.write_all(b"C");
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        }
    });
    ranks.wait_for(0, "joined", LIMIT);
    ranks.wait_for(1, "joined", LIMIT);
    let fds = std::fs::read_dir(format!("/proc/{}/fd", ranks.pid(0)))
        .map(|d| d.count())
        .unwrap_or(0);
    assert!(
        fds < 150,
        "rank 0 holds {fds} descriptors with 200 strangers connected"
    );
    let store = Store::connect(addr, &format!("test-token-{port}"), 9, LIMIT).unwrap();
    store.set("counted", b"1").unwrap();
    ranks.assert_all_pass(LIMIT);
    trickle.join().unwrap();
}

#[test]
fn a_stranger_trickling_its_hello_is_dropped_after_one_deadline() {
    let server = candle_parallel::distributed::store::StoreServer::bind(
        "127.0.0.1:0".parse().unwrap(),
        "token",
    )
    .unwrap();
    let mut s = TcpStream::connect(server.local_addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    // The beginning of a well-formed hello (magic, version 2, store, a 5-byte token), one byte
    // every 2 s: every read is quick, the whole hello never ends.
    let mut hello = b"CPAR\x02\x00\x01\x05\x00\x00\x00token".to_vec();
    hello.extend_from_slice(&[0; 20]);
    let started = Instant::now();
    for byte in hello {
        if s.write_all(&[byte]).is_err() {
            break;
        }
        let mut buf = [0u8; 64];
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => break, // the refusal: dropped
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
        std::thread::sleep(Duration::from_millis(1500));
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(15),
        "dropped after {took:?}, not one 10 s deadline"
    );
}

/// A child's group with a peer timeout of 3 s, once joined (it says "joined").
fn join_with_a_3_s_peer_timeout() -> ProcessGroup {
    let o = InitConfig {
        peer_timeout: Duration::from_secs(3),
        ..child_options()
    };
    let pg = ProcessGroup::new(&Rendezvous::from_env().unwrap(), &Device::Cpu, o).unwrap();
    println!("joined");
    pg
}

#[test]
fn a_stopped_rank_is_lost_within_the_peer_timeout_and_blames_itself_when_resumed() {
    // Also: an idle rank is kept alive by heartbeats past the peer timeout.
    let test = "a_stopped_rank_is_lost_within_the_peer_timeout_and_blames_itself_when_resumed";
    if is_child() {
        let pg = join_with_a_3_s_peer_timeout();
        if pg.rank() == 1 {
            // Stopped here by the test, then resumed.
            std::thread::sleep(Duration::from_secs(12));
            let err = pg.barrier().unwrap_err();
            println!("resumed rank: {err}");
            assert!(
                !matches!(err, Error::PeerLost { rank: 0, .. }),
                "the frozen rank blames rank 0: {err}"
            );
            done();
            return;
        }
        // Idle first, longer than the peer timeout: heartbeats must keep rank 1 alive.
        std::thread::sleep(Duration::from_secs(4));
        println!("waiting");
        let started = Instant::now();
        let err = pg.barrier().unwrap_err();
        println!("lost at {}", now_ms());
        assert!(matches!(err, Error::PeerLost { rank: 1, .. }), "{err}");
        assert!(err.to_string().contains("no message or heartbeat"), "{err}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        done();
        return;
    }
    let ranks = Ranks::world(test, 2);
    ranks.wait_for(0, "joined", LIMIT);
    ranks.wait_for(1, "joined", LIMIT);
    ranks.wait_for(0, "waiting", LIMIT);
    std::thread::sleep(Duration::from_millis(500));
    let stopped_at = now_ms();
    ranks.signal(1, "STOP");
    ranks.wait_for(0, "lost at ", LIMIT);
    let out = ranks.output(0);
    let lost_at: u128 = out
        .lines()
        .find_map(|l| l.strip_prefix("lost at "))
        .and_then(|t| t.trim().parse().ok())
        .unwrap();
    let took = Duration::from_millis((lost_at - stopped_at) as u64);
    // The documented bound: the peer timeout (3 s) from the last frame; some slack for a
    // loaded machine.
    assert!(took < Duration::from_millis(4500), "noticed after {took:?}");
    ranks.signal(1, "CONT");
    let out = ranks.assert_all_pass(LIMIT);
    assert!(
        out[1].contains("rank 1 itself did not run") || out[1].contains("rank 1 was lost"),
        "{}",
        out[1]
    );
}

/// A listener that accepts connections and never answers (a hung program).
fn silent_holder() -> (TcpListener, u16, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let clone = l.try_clone().unwrap();
    let h = std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in clone.incoming().take(8).flatten() {
            held.push(s);
        }
    });
    (l, port, h)
}

#[test]
fn another_program_on_the_master_port_is_named_as_such_on_every_rank() {
    let quick = InitConfig {
        rendezvous_timeout: Duration::from_secs(20),
        ..InitConfig::default()
    };
    // A silent holder: rank 0 says the port is taken at once; rank 1 that something else
    // answers there.
    let (_l, port, _h) = silent_holder();
    let started = Instant::now();
    let err = ProcessGroup::new(
        &common::local_rendezvous(0, 2, port),
        &Device::Cpu,
        quick.clone(),
    )
    .unwrap_err();
    assert!(matches!(err, Error::PortInUse { .. }), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    let err = ProcessGroup::new(
        &common::local_rendezvous(1, 2, port),
        &Device::Cpu,
        quick.clone(),
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("another program holds MASTER_PORT"), "{msg}");
    assert!(msg.contains("never answered"), "{msg}");
    // An HTTP server.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut s in l.incoming().take(4).flatten() {
            let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n");
        }
    });
    let err =
        ProcessGroup::new(&common::local_rendezvous(1, 2, port), &Device::Cpu, quick).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("\"HTTP\"") && msg.contains("MASTER_PORT"),
        "{msg}"
    );
}

#[test]
fn a_program_on_the_master_port_that_hangs_up_at_once_is_named_as_such_within_10_s() {
    let test = "a_program_on_the_master_port_that_hangs_up_at_once_is_named_as_such_within_10_s";
    if is_child() {
        let started = Instant::now();
        let err = ProcessGroup::from_env(&Device::Cpu).unwrap_err();
        let took = started.elapsed();
        println!("rank 1 reports after {:.1} s: {err}", took.as_secs_f64());
        let msg = err.to_string();
        assert!(msg.contains("another program holds MASTER_PORT"), "{msg}");
        assert!(msg.contains("closed"), "{msg}");
        assert!(took < Duration::from_secs(10), "{took:?}");
        done();
        return;
    }
    // It accepts every connection and closes it without a word; our own store says "shutting
    // down" or "busy" before it closes one.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    l.set_nonblocking(true).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let holder = std::thread::spawn({
        let stop = stop.clone();
        move || {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                match l.accept() {
                    Ok((s, _)) => drop(s),
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        }
    });
    // A rendezvous timeout far above the bound: the wait must end on what the holder does.
    let mut env = rank_env(1, 2, port);
    env.push(("CANDLE_PARALLEL_RENDEZVOUS_TIMEOUT".into(), "60".into()));
    let out = Ranks::start(test, vec![env]).assert_all_pass(LIMIT);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    holder.join().unwrap();
    println!("{}", out[0]);
}

#[test]
fn a_frozen_rank_0_once_resumed_says_that_it_itself_did_not_run() {
    let test = "a_frozen_rank_0_once_resumed_says_that_it_itself_did_not_run";
    if is_child() {
        let pg = join_with_a_3_s_peer_timeout();
        if pg.rank() == 0 {
            // Stopped here by the test, then resumed.
            std::thread::sleep(Duration::from_secs(12));
            let err = pg.barrier().unwrap_err();
            println!("resumed rank: {err}");
            assert!(matches!(err, Error::Aborted { .. }), "{err}");
            assert!(
                err.to_string().contains("rank 0 itself did not run"),
                "{err}"
            );
            done();
            return;
        }
        println!("waiting");
        let err = pg.barrier().unwrap_err();
        println!("lost at {}", now_ms());
        assert!(matches!(err, Error::PeerLost { rank: 0, .. }), "{err}");
        done();
        return;
    }
    let ranks = Ranks::world(test, 2);
    ranks.wait_for(0, "joined", LIMIT);
    ranks.wait_for(1, "waiting", LIMIT);
    std::thread::sleep(Duration::from_millis(300));
    ranks.signal(0, "STOP");
    ranks.wait_for(1, "lost at ", LIMIT);
    // Frozen well past the peer timeout (3 s), whatever the machine's load.
    std::thread::sleep(Duration::from_secs(1));
    ranks.signal(0, "CONT");
    let out = ranks.assert_all_pass(LIMIT);
    let said = out[0].lines().find(|l| l.starts_with("resumed rank"));
    println!("{}", said.unwrap_or_default());
}

#[test]
fn a_rank_with_another_world_size_fails_the_others_at_once_with_its_reason() {
    let test = "a_rank_with_another_world_size_fails_the_others_at_once_with_its_reason";
    if is_child() {
        if std::env::var_os("CP_DELAY").is_some() {
            std::thread::sleep(Duration::from_secs(1));
        }
        let started = Instant::now();
        let err = ProcessGroup::new(
            &Rendezvous::from_env().unwrap(),
            &Device::Cpu,
            child_options(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("WORLD_SIZE=3 but an earlier rank has 2"),
            "{err}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        done();
        return;
    }
    let port = common::free_port();
    let envs = vec![rank_env(0, 2, port), {
        // Joins after rank 0, so that rank 0's world size is the one agreed.
        let mut e = rank_env(1, 3, port);
        e.push(("CP_DELAY".into(), "1".into()));
        e
    }];
    Ranks::start(test, envs).assert_all_pass(LIMIT);
}

/// A stand-in for rank 1: claims the rank in the job's store, as a joining rank does, and
/// returns the connection.
fn claim_rank_1_by_hand(r: &Rendezvous) -> Store {
    let store =
        Store::connect(r.master_socket().unwrap(), &child_options().token, 1, LIMIT).unwrap();
    store.compare_set("rank/1", None, b"mine").unwrap();
    store
}

#[test]
fn a_rank_killed_during_the_rendezvous_is_named_by_rank_0_and_by_a_rank_that_starts_later() {
    // The order: ranks 0 and 1 of 3 start, rank 1 claims its rank and is killed, and
    // only then does rank 2 start.
    let test =
        "a_rank_killed_during_the_rendezvous_is_named_by_rank_0_and_by_a_rank_that_starts_later";
    if is_child() {
        candle_parallel::logging::init();
        let r = Rendezvous::from_env().unwrap();
        if r.rank == 1 {
            let _store = claim_rank_1_by_hand(&r);
            println!("claimed");
            std::thread::sleep(Duration::from_secs(60));
            return;
        }
        let started = Instant::now();
        let err = ProcessGroup::new(&r, &Device::Cpu, child_options())
            .unwrap_err()
            .to_string();
        println!("rank {} after {:?}: {err}", r.rank, started.elapsed());
        assert!(err.contains("rank 1 left during the rendezvous"), "{err}");
        done();
        return;
    }
    let port = common::free_port();
    let mut first = Ranks::start(test, vec![rank_env(0, 3, port), rank_env(1, 3, port)]);
    first.wait_for(1, "claimed", LIMIT);
    std::thread::sleep(Duration::from_millis(300));
    let killed = Instant::now();
    first.kill(1);
    // Rank 0 says at once why the job cannot form, though it keeps the store up for rank 2.
    first.wait_for(0, "rank 1 left during the rendezvous", LIMIT);
    let named = killed.elapsed();
    let late = Instant::now();
    let second = Ranks::start(test, vec![rank_env(2, 3, port)]);
    let ended = second.wait(LIMIT);
    let late_took = late.elapsed();
    let first_ended = first.wait(LIMIT);
    eprintln!(
        "rank 0 named rank 1 in {named:?}, rank 2 in {late_took:?}:\n{}{}",
        first_ended[0].output, ended[0].output
    );
    for (who, e) in [("rank 0", &first_ended[0]), ("rank 2", &ended[0])] {
        assert!(
            e.status.success() && e.output.contains(DONE),
            "{who}:\n{}",
            e.output
        );
    }
    assert!(named < Duration::from_secs(5), "rank 0 took {named:?}");
    assert!(
        late_took < Duration::from_secs(5),
        "rank 2 took {late_took:?}"
    );
}

#[test]
fn a_rank_waiting_for_an_unreachable_master_says_so_and_the_wait_is_set_from_the_environment() {
    let test =
        "a_rank_waiting_for_an_unreachable_master_says_so_and_the_wait_is_set_from_the_environment";
    if is_child() {
        // The progress lines go through `log`: show them on stderr.
        candle_parallel::logging::init();
        let started = Instant::now();
        let err = ProcessGroup::from_env(&Device::Cpu).unwrap_err();
        assert!(matches!(err, Error::Unreachable { .. }), "{err}");
        let took = started.elapsed();
        assert!(
            took >= Duration::from_secs(4) && took < Duration::from_secs(15),
            "{took:?}"
        );
        done();
        return;
    }
    let port = common::free_port();
    let mut env = rank_env(1, 2, port);
    env.push(("CANDLE_PARALLEL_RENDEZVOUS_TIMEOUT".into(), "4".into()));
    let ranks = Ranks::start(test, vec![env]);
    let out = ranks.assert_all_pass(LIMIT);
    assert!(
        out[0].contains(&format!(
            "still waiting for the master's store at 127.0.0.1:{port}"
        )),
        "{}",
        out[0]
    );
}

#[test]
fn a_rank_with_the_wrong_token_is_refused_and_named_by_the_rank_that_waited_for_it() {
    let test = "a_rank_with_the_wrong_token_is_refused_and_named_by_the_rank_that_waited_for_it";
    if is_child() {
        let o = InitConfig {
            rendezvous_timeout: Duration::from_secs(3),
            ..child_options()
        };
        let r = Rendezvous::from_env().unwrap();
        let err = ProcessGroup::new(&r, &Device::Cpu, o).unwrap_err();
        let text = err.to_string();
        if r.rank == 1 {
            assert!(matches!(err, Error::Refused { .. }), "{err}");
            assert!(text.contains("wrong job token"), "{err}");
        } else {
            assert!(text.contains("rank 1 never came"), "{err}");
            assert!(
                text.contains("refused a connection as rank 1") && text.contains("wrong job token"),
                "{err}"
            );
        }
        done();
        return;
    }
    let port = common::free_port();
    let mut envs: Vec<_> = (0..2).map(|r| rank_env(r, 2, port)).collect();
    envs[1].push(("CANDLE_PARALLEL_TOKEN".into(), "another-job".into()));
    Ranks::start(test, envs).assert_all_pass(LIMIT);
}

/// The address a rank published in the store, field by field ("tcp=", "unix=").
fn published(store: &Store, rank: usize, field: &str) -> Option<String> {
    let value = store.get(&format!("addr/{rank}"), LIMIT).unwrap();
    String::from_utf8(value)
        .unwrap()
        .split_whitespace()
        .find_map(|f| f.strip_prefix(field).map(str::to_string))
}

#[test]
fn idle_strangers_on_the_peer_listeners_never_keep_a_rank_out() {
    let test = "idle_strangers_on_the_peer_listeners_never_keep_a_rank_out";
    if is_child() {
        let started = Instant::now();
        let pg = join_child();
        println!("joined in {} ms", started.elapsed().as_millis());
        let y = pg
            .all_reduce(&Tensor::new(&[1f32], &Device::Cpu).unwrap(), ReduceOp::Sum)
            .unwrap();
        assert_eq!(y.to_vec1::<f32>().unwrap(), [3.0]);
        done();
        return;
    }
    let port = common::free_port();
    let first = Ranks::start(test, vec![rank_env(0, 3, port), rank_env(1, 3, port)]);
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let store = Store::connect(addr, &format!("test-token-{port}"), 9, LIMIT).unwrap();
    // More idle strangers than a listener has handshake places, on both of its sockets.
    let mut tcp = Vec::new();
    #[cfg(target_os = "linux")]
    let mut unix = Vec::new();
    for rank in 0..2 {
        let at = published(&store, rank, "tcp=").unwrap();
        tcp.extend((0..50).filter_map(|_| TcpStream::connect(&at).ok()));
        #[cfg(target_os = "linux")]
        if let Some(name) = published(&store, rank, "unix=") {
            use std::os::linux::net::SocketAddrExt;
            let a = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
            unix.extend(
                (0..50).filter_map(|_| std::os::unix::net::UnixStream::connect_addr(&a).ok()),
            );
        }
    }
    let second = Ranks::start(test, vec![rank_env(2, 3, port)]);
    let mut ended = first.wait(Duration::from_secs(60));
    ended.extend(second.wait(Duration::from_secs(60)));
    for (i, e) in ended.iter().enumerate() {
        assert!(
            e.status.success() && e.output.contains(DONE),
            "rank {i} failed ({}):\n{}",
            e.status,
            e.output
        );
    }
    // Rank 2 gets in at once, not once the strangers' handshakes time out (10 s).
    let ms: u64 = ended[2]
        .output
        .split("joined in ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap();
    eprintln!("rank 2 joined in {ms} ms");
    assert!(ms < 9000, "rank 2 took {ms} ms to join");
    drop((tcp, store));
}

#[test]
fn a_rank_killed_after_publishing_its_address_is_named_by_rank_0_within_seconds() {
    let test = "a_rank_killed_after_publishing_its_address_is_named_by_rank_0_within_seconds";
    if is_child() {
        candle_parallel::logging::init();
        if Rendezvous::from_env().unwrap().rank == 1 {
            let _ = join_child();
            return;
        }
        let err = ProcessGroup::new(
            &Rendezvous::from_env().unwrap(),
            &Device::Cpu,
            child_options(),
        )
        .unwrap_err()
        .to_string();
        println!("rank 0: {err}");
        assert!(err.contains("rank 1 left during the rendezvous"), "{err}");
        done();
        return;
    }
    let port = common::free_port();
    let mut ranks = Ranks::start(test, vec![rank_env(0, 3, port), rank_env(1, 3, port)]);
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let store = Store::connect(addr, &format!("test-token-{port}"), 9, LIMIT).unwrap();
    published(&store, 1, "tcp=");
    drop(store);
    let killed = Instant::now();
    ranks.kill(1);
    // Rank 0 says so at once; it returns its error once rank 2 (never started) had its chance.
    ranks.wait_for(0, "rank 1 left during the rendezvous", LIMIT);
    let took = killed.elapsed();
    let ended = ranks.wait(LIMIT);
    assert!(
        ended[0].status.success() && ended[0].output.contains(DONE),
        "rank 0:\n{}",
        ended[0].output
    );
    eprintln!("rank 0 reported in {took:?}:\n{}", ended[0].output);
    assert!(took < Duration::from_secs(10), "rank 0 took {took:?}");
}

#[test]
fn a_rank_killed_while_its_peers_connect_to_it_is_named_by_every_survivor() {
    let test = "a_rank_killed_while_its_peers_connect_to_it_is_named_by_every_survivor";
    if is_child() {
        let r = Rendezvous::from_env().unwrap();
        if r.rank == 1 {
            // Claims its rank and publishes a listener that never answers: its peers wait on
            // it, and the mesh cannot form before it is killed.
            let store = claim_rank_1_by_hand(&r);
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let at = format!("tcp={}", listener.local_addr().unwrap());
            store.set("addr/1", at.as_bytes()).unwrap();
            println!("published");
            std::thread::sleep(Duration::from_secs(60));
            return;
        }
        let err = ProcessGroup::new(&r, &Device::Cpu, child_options())
            .unwrap_err()
            .to_string();
        println!("rank {}: {err}", r.rank);
        assert!(err.contains("rank 1 left during the rendezvous"), "{err}");
        done();
        return;
    }
    let port = common::free_port();
    let mut ranks = Ranks::start(test, (0..3).map(|r| rank_env(r, 3, port)).collect());
    ranks.wait_for(1, "published", LIMIT);
    // Once ranks 0 and 2 published their addresses, they are connecting their mesh (rank 2 to
    // rank 1, which never answers).
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let store = Store::connect(addr, &format!("test-token-{port}"), 9, LIMIT).unwrap();
    published(&store, 0, "tcp=");
    published(&store, 2, "tcp=");
    drop(store);
    std::thread::sleep(Duration::from_millis(300));
    let killed = Instant::now();
    ranks.kill(1);
    let ended = ranks.wait(LIMIT);
    let took = killed.elapsed();
    for i in [0, 2] {
        assert!(
            ended[i].status.success() && ended[i].output.contains(DONE),
            "rank {i}:\n{}",
            ended[i].output
        );
    }
    eprintln!(
        "reported in {took:?}:\n{}{}",
        ended[0].output, ended[2].output
    );
    assert!(
        took < Duration::from_secs(10),
        "the survivors took {took:?}"
    );
}
