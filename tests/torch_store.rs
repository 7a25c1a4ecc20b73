//! Our client of PyTorch's TCPStore against the real thing (torch's own server, started from
//! Python, with its default libuv backend and with the older one), and ranks meeting in such a
//! store as they do under torchrun's agent (`TORCHELASTIC_USE_AGENT_STORE=True`): attempt after
//! attempt in one store, with the keys of the attempts before still there, as torchrun's
//! restarts leave them. Skipped, saying so, without PyTorch (see `common::engines`).

mod common;

use candle_core::{Device, Tensor};
use candle_parallel::distributed::store::Store;
use candle_parallel::distributed::{ProcessGroup, ReduceOp, Rendezvous};
use candle_parallel::Error;
use common::{engines, is_child, Ranks};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

/// A TCPStore served by torch in a Python child: killed when dropped.
struct TorchServer {
    child: Option<Child>,
    port: u16,
}

impl TorchServer {
    /// Starts `script` (Python, given the backend choice as argv[1]), which must print the
    /// store's port on its first line.
    fn start(python: &str, script: &str, libuv: bool) -> Self {
        let mut child = Command::new(python)
            .args(["-c", script, if libuv { "1" } else { "0" }])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start python");
        let mut first = String::new();
        // One byte at a time: what follows the first line stays in the pipe for `finish`.
        let mut byte = [0u8; 1];
        let out = child.stdout.as_mut().unwrap();
        while std::io::Read::read(out, &mut byte).is_ok_and(|n| n == 1) && byte[0] != b'\n' {
            first.push(byte[0] as char);
        }
        let port = first
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("no port from python: {first:?}"));
        Self {
            child: Some(child),
            port,
        }
    }

    fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Closes the script's stdin and returns what it printed after its first line.
    fn finish(mut self) -> String {
        let mut child = self.child.take().expect("running");
        drop(child.stdin.take());
        let started = std::time::Instant::now();
        while child.try_wait().unwrap().is_none() {
            assert!(started.elapsed() < LIMIT, "the python store did not end");
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "python failed: {}", out.status);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for TorchServer {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Serves a store, waits for our client's key, answers, and at the end reads what our client
/// left, as torch's own client sees it.
const CONVERSATION: &str = r#"
import sys, datetime
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=sys.argv[1] == "1",
             wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
print(s.port, flush=True)
s.wait(["from_rust"])
assert s.get("from_rust") == b"hello python", s.get("from_rust")
s.set("from_python", b"hello rust")
s.wait(["done"])
print("counter", s.get("counter").decode(), "multi", s.get("m2").decode(),
      "deleted-is-there", s.check(["gone"]), "cas", s.get("cas").decode(), flush=True)
sys.stdin.read()
"#;

fn speak_with_torchs_own_server(libuv: bool) {
    let Some(python) = engines::python_or_skip() else {
        return;
    };
    let server = TorchServer::start(&python, CONVERSATION, libuv);
    let store = Store::connect_torch(server.addr(), LIMIT).unwrap();
    store.set("from_rust", b"hello python").unwrap();
    assert_eq!(store.get("from_python", LIMIT).unwrap(), b"hello rust");
    assert_eq!(store.add("counter", 5).unwrap(), 5);
    assert_eq!(store.add("counter", 2).unwrap(), 7);

    // A wait that runs out is cancelled, names what is missing, and leaves the connection
    // usable.
    let missing = store
        .wait(&["from_python", "absent"], Duration::from_millis(200))
        .unwrap();
    assert_eq!(missing, ["absent"]);
    assert!(store.check(&["from_python"]).unwrap());
    assert!(!store.check(&["from_python", "absent"]).unwrap());
    let err = store.get("absent", Duration::from_millis(100)).unwrap_err();
    assert!(
        matches!(err, Error::Timeout { .. }) && err.to_string().contains("absent"),
        "{err}"
    );

    // A wait ends when another client sets the key.
    let other = Store::connect_torch(server.addr(), LIMIT).unwrap();
    let setter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        other.set("late", b"here").unwrap();
    });
    assert!(store.wait(&["late"], LIMIT).unwrap().is_empty());
    setter.join().unwrap();

    assert_eq!(store.compare_set("cas", None, b"one").unwrap(), b"one");
    assert_eq!(store.compare_set("cas", None, b"two").unwrap(), b"one");
    assert_eq!(
        store.compare_set("cas", Some(b"one"), b"three").unwrap(),
        b"three"
    );
    store
        .multi_set(&[("m1", b"1".as_slice()), ("m2", b"22".as_slice())])
        .unwrap();
    assert_eq!(
        store.multi_get(&["m1", "m2"], LIMIT).unwrap(),
        [b"1".to_vec(), b"22".to_vec()]
    );
    store.set("gone", b"x").unwrap();
    assert!(store.delete("gone").unwrap());
    assert!(!store.delete("gone").unwrap());
    store.set("done", b"").unwrap();
    let out = server.finish();
    assert!(
        out.contains("counter 7 multi 22 deleted-is-there False cas three"),
        "python saw: {out}"
    );
}

#[test]
fn our_client_speaks_with_torchs_libuv_store() {
    speak_with_torchs_own_server(true);
}

#[test]
fn our_client_speaks_with_torchs_older_store_backend() {
    speak_with_torchs_own_server(false);
}

#[test]
fn a_program_that_is_not_a_tcpstore_is_named() {
    // Something that accepts and closes at once.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let closer = std::thread::spawn(move || {
        for s in listener.incoming().take(1) {
            drop(s);
        }
    });
    let err = Store::connect_torch(addr, Duration::from_secs(5))
        .err()
        .expect("refused");
    closer.join().unwrap();
    assert!(
        err.to_string()
            .contains("does not answer as PyTorch's TCPStore"),
        "{err}"
    );
}

/// Serves a store until stdin closes, then prints how many attempts our ranks opened in it.
const AGENT: &str = r#"
import sys, datetime
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=sys.argv[1] == "1",
             wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
# torch's workers' keys live beside ours.
s.set("default_pg/0//cpu//rank_0", b"someone else's")
print(s.port, flush=True)
sys.stdin.read()
print("attempts", s.get("candle_parallel/run-7/attempts").decode(), flush=True)
"#;

/// The variables torchrun's agent gives rank `rank` of `world`.
fn agent_env(rank: usize, world: usize, port: u16) -> Vec<(String, String)> {
    [
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
        ("TORCHELASTIC_USE_AGENT_STORE", "True".to_string()),
        ("TORCHELASTIC_RUN_ID", "run-7".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

#[test]
fn ranks_meet_in_the_agents_store_attempt_after_attempt() {
    const TEST: &str = "ranks_meet_in_the_agents_store_attempt_after_attempt";
    if is_child() {
        let r = Rendezvous::from_env().unwrap();
        let pg = ProcessGroup::new(&r, &Device::Cpu, common::child_options()).unwrap();
        let x = Tensor::new(&[pg.rank() as f32 + 1.0], &Device::Cpu).unwrap();
        let sum: Vec<f32> = pg.all_reduce(&x, ReduceOp::Sum).unwrap().to_vec1().unwrap();
        println!("rank {} of {}: sum {}", pg.rank(), pg.world_size(), sum[0]);
        // A group made later connects through the store again.
        let pair = pg.new_group(&[0, 1]).unwrap();
        if let Some(pair) = pair {
            pair.barrier().unwrap();
        }
        common::done();
        return;
    }
    let Some(python) = engines::python_or_skip() else {
        return;
    };
    let server = TorchServer::start(&python, AGENT, true);
    let port = server.port;
    let attempt = |world: usize| {
        let ranks = Ranks::start(
            TEST,
            (0..world).map(|r| agent_env(r, world, port)).collect(),
        );
        let sum = (1..=world).sum::<usize>();
        for out in ranks.assert_all_pass(LIMIT) {
            assert!(out.contains(&format!("of {world}: sum {sum}")), "{out}");
        }
    };
    // The first attempt, then the next in the same store: the first one's claims and addresses
    // are still there.
    attempt(3);
    attempt(3);
    // An attempt whose rank 1 died before rank 0 came leaves a hello nobody answers...
    let mut lone = Ranks::start(TEST, vec![agent_env(1, 2, port)]);
    std::thread::sleep(Duration::from_millis(500));
    lone.kill(0);
    drop(lone);
    // ... and the next attempt, of another world size, is not confused by it; rank 1 comes
    // first here, while the store's newest attempt is still the old one.
    let ranks = Ranks::start(TEST, vec![agent_env(1, 2, port)]);
    std::thread::sleep(Duration::from_millis(500));
    let zero = Ranks::start(TEST, vec![agent_env(0, 2, port)]);
    for out in zero
        .assert_all_pass(LIMIT)
        .into_iter()
        .chain(ranks.assert_all_pass(LIMIT))
    {
        assert!(out.contains("of 2: sum 3"), "{out}");
    }
    let out = server.finish();
    assert!(out.contains("attempts 3"), "python saw: {out}");
}
