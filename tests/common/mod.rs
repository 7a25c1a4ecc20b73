//! Helpers shared by the integration tests: finding example binaries and running children
//! with a bounded wait.

#![allow(dead_code)]

pub mod collectives;
pub mod engines;
pub mod layouts;
pub mod models;
pub mod netns;
pub mod p2p;
pub mod slurm;

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The path of an example binary built by `cargo test` (which builds every example).
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    // target/<profile>/deps/<test> -> target/<profile>/examples/<name>
    let profile_dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let path = profile_dir.join("examples").join(name);
    assert!(
        path.exists(),
        "example binary {} not found: run the whole suite with `cargo test` (it builds the \
         examples) or `cargo build --examples` first",
        path.display()
    );
    path
}

/// Runs `cmd` to completion, killing it after `limit`; panics with its output on timeout.
pub fn run(mut cmd: Command, limit: Duration) -> Output {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn child");
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stdout.read_to_end(&mut buf);
        buf
    });
    let err_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stderr.read_to_end(&mut buf);
        buf
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for child") {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            let out = String::from_utf8_lossy(&out_reader.join().unwrap()).into_owned();
            let err = String::from_utf8_lossy(&err_reader.join().unwrap()).into_owned();
            panic!("{cmd:?} did not finish within {limit:?}\nstdout:\n{out}\nstderr:\n{err}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: out_reader.join().unwrap(),
        stderr: err_reader.join().unwrap(),
    }
}

/// Runs `cmd`, asserts it succeeded, and returns its standard output.
pub fn run_ok(cmd: Command, limit: Duration) -> String {
    let desc = format!("{cmd:?}");
    let out = run(cmd, limit);
    assert!(
        out.status.success(),
        "{desc} failed with {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// The `Test set` lines a CIFAR example printed (rank 0's, behind a launcher's `[rank0]: ` or
/// not): the last one's average loss and correct count, and how many there were.
pub fn test_lines(out: &str) -> (f64, usize, usize) {
    let lines: Vec<&str> = out
        .lines()
        .filter_map(|l| l.split_once("Test set: Average loss: ").map(|(_, t)| t))
        .collect();
    let line = lines
        .last()
        .unwrap_or_else(|| panic!("no test line in:\n{out}"));
    let parsed = line.split_once(", Accuracy: ").and_then(|(loss, rest)| {
        let correct = rest.split_once('/')?.0;
        Some((loss.parse().ok()?, correct.parse().ok()?))
    });
    let (loss, correct) = parsed.unwrap_or_else(|| panic!("cannot parse {line:?}"));
    (loss, correct, lines.len())
}

/// Asserts that a DDP run's test line `(loss, correct)` is one process's on the same global
/// batch: the same steps, the gradient sums in another order, and on data as hard as
/// CIFAR-10 that rounding moves the loss a little and a test image or two.
pub fn assert_learns_alike(ddp: (f64, usize), one: (f64, usize), context: &str) {
    let ((loss, correct), (one_loss, one_correct)) = (ddp, one);
    assert!(
        (loss - one_loss).abs() < 1e-2 && correct.abs_diff(one_correct) <= 10,
        "DDP: {loss} and {correct}; one process: {one_loss} and {one_correct}\n{context}"
    );
}

/// A fresh temporary directory for one test.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("candle-parallel-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The largest absolute value of a tensor (on any device, of any float dtype), as f32.
pub fn max_abs(t: &candle_core::Tensor) -> f32 {
    t.to_device(&candle_core::Device::Cpu)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// The largest absolute difference between two tensors of one shape (on any device).
pub fn max_abs_diff(a: &candle_core::Tensor, b: &candle_core::Tensor) -> f32 {
    let cpu = candle_core::Device::Cpu;
    let (a, b) = (a.to_device(&cpu).unwrap(), b.to_device(&cpu).unwrap());
    max_abs(&(a - b).unwrap())
}

/// A tensor's values as f64, flattened.
pub fn as_f64(t: &candle_core::Tensor) -> Vec<f64> {
    t.to_dtype(candle_core::DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// A group of one rank meeting on a free port of 127.0.0.1.
pub fn solo_rendezvous() -> candle_parallel::distributed::Rendezvous {
    local_rendezvous(0, 1, free_port())
}

/// Rank `rank` of `world` ranks, all on this machine, meeting at 127.0.0.1:`port`.
pub fn local_rendezvous(
    rank: usize,
    world: usize,
    port: u16,
) -> candle_parallel::distributed::Rendezvous {
    candle_parallel::distributed::Rendezvous {
        master_addr: "127.0.0.1".into(),
        master_port: port,
        rank,
        world_size: world,
        local_rank: rank,
        local_world_size: world,
        launcher: candle_parallel::distributed::Launcher::Given,
    }
}

/// A child rank's options: the environment's, with a rendezvous timeout of 30 s so that a test
/// that goes wrong fails well within its limit.
pub fn child_options() -> candle_parallel::distributed::InitConfig {
    candle_parallel::distributed::InitConfig {
        rendezvous_timeout: Duration::from_secs(30),
        ..candle_parallel::distributed::InitConfig::from_env().unwrap()
    }
}

/// Joins the CPU group of a child rank started by [`Ranks::start`], with [`child_options`].
pub fn join_child() -> candle_parallel::distributed::ProcessGroup {
    candle_parallel::distributed::ProcessGroup::new(
        &candle_parallel::distributed::Rendezvous::from_env().unwrap(),
        &candle_core::Device::Cpu,
        child_options(),
    )
    .unwrap()
}

/// Marks a process as a child rank started by [`Ranks::start`].
pub const CHILD: &str = "CP_TEST_CHILD";

/// Whether this process is a child rank of a multi-process test.
pub fn is_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// torchrun's variables for `rank` of `world` meeting at 127.0.0.1:`port`.
pub fn rank_env(rank: usize, world: usize, port: u16) -> Vec<(String, String)> {
    [
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
        ("CANDLE_PARALLEL_TOKEN", format!("test-token-{port}")),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// Child processes running one test of this test binary as ranks. Dropping it kills the
/// children still running.
pub struct Ranks {
    children: Vec<Option<std::process::Child>>,
    lines: std::sync::mpsc::Receiver<(usize, String)>,
    output: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

/// How one child ended and what it printed.
pub struct Ended {
    pub status: std::process::ExitStatus,
    pub output: String,
}

impl Ranks {
    /// Starts one child per entry of `envs`, each running test `test` of this binary with
    /// `CP_TEST_CHILD` and its environment set.
    pub fn start(test: &str, envs: Vec<Vec<(String, String)>>) -> Ranks {
        let exe = std::env::current_exe().unwrap();
        let commands = envs
            .into_iter()
            .map(|env| {
                let mut cmd = Command::new(&exe);
                cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
                    .env(CHILD, "1")
                    .env("RUST_BACKTRACE", "0")
                    .envs(env);
                cmd
            })
            .collect();
        Self::spawn(commands)
    }

    /// Starts `commands`, collecting the lines each prints on stdout and stderr.
    pub fn spawn(commands: Vec<Command>) -> Ranks {
        let (tx, lines) = std::sync::mpsc::channel();
        let n = commands.len();
        let output = std::sync::Arc::new(std::sync::Mutex::new(vec![String::new(); n]));
        let mut children = Vec::new();
        let mut readers = Vec::new();
        for (i, mut cmd) in commands.into_iter().enumerate() {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
            let mut child = cmd.spawn().expect("spawn a child");
            for pipe in [
                Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>,
                Box::new(child.stderr.take().unwrap()),
            ] {
                let (tx, output) = (tx.clone(), output.clone());
                readers.push(std::thread::spawn(move || {
                    use std::io::BufRead;
                    for line in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
                        output.lock().unwrap()[i].push_str(&format!("{line}\n"));
                        let _ = tx.send((i, line));
                    }
                }));
            }
            children.push(Some(child));
        }
        Ranks {
            children,
            lines,
            output,
            readers,
        }
    }

    /// Starts `world` ranks of `test` meeting on a free port.
    pub fn world(test: &str, world: usize) -> Ranks {
        let port = free_port();
        Self::start(test, (0..world).map(|r| rank_env(r, world, port)).collect())
    }

    /// Waits until child `i` has printed a line containing `needle`.
    pub fn wait_for(&self, i: usize, needle: &str, limit: Duration) {
        let deadline = Instant::now() + limit;
        while !self.output.lock().unwrap()[i].contains(needle) {
            let left = deadline.saturating_duration_since(Instant::now());
            if self
                .lines
                .recv_timeout(left.min(Duration::from_millis(50)))
                .is_err()
                && Instant::now() >= deadline
            {
                panic!(
                    "child {i} did not print {needle:?} within {limit:?}; output:\n{}",
                    self.output.lock().unwrap()[i]
                );
            }
        }
    }

    /// What child `i` printed so far.
    pub fn output(&self, i: usize) -> String {
        while self.lines.try_recv().is_ok() {}
        self.output.lock().unwrap()[i].clone()
    }

    /// The process id of child `i`.
    pub fn pid(&self, i: usize) -> u32 {
        self.children[i].as_ref().expect("running").id()
    }

    /// Kills child `i` (SIGKILL).
    pub fn kill(&mut self, i: usize) {
        if let Some(c) = self.children[i].as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Runs the parent side of a "rank 2 dies mid-call" test: starts 3 ranks of `test`, waits
    /// until rank 2 printed `ready` and ranks 0 and 1 printed `marker` (they are in the call
    /// under test), kills rank 2, and checks that ranks 0 and 1 then pass (print [`DONE`])
    /// within 30 s of the kill.
    pub fn kill_rank_2_during(test: &str, marker: &str, limit: Duration) {
        let mut ranks = Ranks::world(test, 3);
        ranks.wait_for(2, "ready", limit);
        ranks.wait_for(0, marker, limit);
        ranks.wait_for(1, marker, limit);
        std::thread::sleep(Duration::from_millis(200));
        let killed = Instant::now();
        ranks.kill(2);
        let ended = ranks.wait(limit);
        let waited = killed.elapsed();
        for (i, e) in ended.iter().enumerate().take(2) {
            assert!(
                e.status.success() && e.output.contains(DONE),
                "rank {i}:\n{}",
                e.output
            );
        }
        assert!(
            waited < Duration::from_secs(30),
            "the others took {waited:?} to notice"
        );
    }

    /// Waits for every child, killing all after `limit`.
    pub fn wait(mut self, limit: Duration) -> Vec<Ended> {
        let deadline = Instant::now() + limit;
        let mut statuses = Vec::new();
        for i in 0..self.children.len() {
            let mut child = self.children[i].take().expect("not yet waited");
            let status = loop {
                if let Some(s) = child.try_wait().unwrap() {
                    break s;
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let status = child.wait().unwrap();
                    for c in self.children.iter_mut().flatten() {
                        let _ = c.kill();
                        let _ = c.wait();
                    }
                    eprintln!("child {i} was killed after {limit:?}");
                    break status;
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            statuses.push(status);
        }
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        let output = self.output.lock().unwrap().clone();
        statuses
            .into_iter()
            .zip(output)
            .map(|(status, output)| Ended { status, output })
            .collect()
    }

    /// Waits for every child and asserts each passed (printed `done` and exited 0).
    /// Sends child `i` the signal `sig` (`"STOP"`, `"CONT"`, ...) with `kill`.
    pub fn signal(&self, i: usize, sig: &str) {
        let sent = Command::new("kill")
            .args([format!("-{sig}"), self.pid(i).to_string()])
            .status()
            .expect("kill runs");
        assert!(sent.success(), "kill -{sig} child {i}");
    }

    pub fn assert_all_pass(self, limit: Duration) -> Vec<String> {
        let ended = self.wait(limit);
        for (i, e) in ended.iter().enumerate() {
            assert!(
                e.status.success() && e.output.contains(DONE),
                "child {i} failed ({}):\n{}",
                e.status,
                e.output
            );
        }
        ended.into_iter().map(|e| e.output).collect()
    }
}

/// The process (a child of `parent`, when given) whose environment holds every `NAME=value`
/// of `vars`.
pub fn process_with_env(parent: Option<u32>, vars: &[String]) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let ppid: u32 = stat
            .rsplit(')')
            .next()?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        let set: Vec<&[u8]> = environ.split(|&b| b == 0).collect();
        let child = parent.is_none_or(|p| p == ppid);
        (child && vars.iter().all(|v| set.contains(&v.as_bytes()))).then_some(pid)
    })
}

/// What a child prints when its part of the test passed.
pub const DONE: &str = "CHILD-DONE";

/// Says, on a child's stdout, that it got to the end of its part ([`DONE`]).
pub fn done() {
    use std::io::Write;
    println!("{DONE}");
    let _ = std::io::stdout().flush();
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in self.children.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
