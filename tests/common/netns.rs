//! Two machines of our own: network namespaces joined by a veth pair.
//!
//! Each namespace has its own address, loopback and abstract Unix sockets, so ranks in different
//! namespaces see each other as on different machines: they meet over TCP across the veth pair
//! (our host identity includes the network namespace), while ranks in one namespace use Unix
//! sockets and shared memory as on one machine. Making namespaces needs root and iproute2; where
//! either is missing, [`Machines::new`] says why and the test skips.
//!
//! ```ignore
//! let Some(m) = netns::Machines::new("cifar").or_skip() else { return };
//! let mut cmd = m.command(1, "target/debug/candle-run"); // runs inside machine 1
//! cmd.args(["--nnodes", "2", "--node-rank", "1", "--master-addr", &m.addr(0).to_string()]);
//! m.set_link(false); // a partition: the link goes down, no FIN or RST reaches anyone
//! m.limit_rate(Some("1gbit")); // a slow link (tc tbf on both ends)
//! ```
//!
//! Names carry this process's id and a counter, so that two test runs (or two tests of one
//! run) never collide; namespaces left by a test process that was killed are removed by the next
//! [`Machines::new`]. Dropping a [`Machines`] deletes its namespaces, which also removes the veth
//! pair; processes still inside keep running, so tests stop their children first (their
//! `Ranks` is declared after the `Machines`, and so is dropped before it).

#![allow(dead_code)]

use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The prefix of every namespace these tests make.
const PREFIX: &str = "cpar-test-";
/// The port on machine 0 where the jobs started by [`Machines::launcher`] and
/// [`Machines::rank`] meet (each test has namespaces of its own).
pub const PORT: &str = "29500";
/// The veth end in each namespace.
const DEV: &str = "cpar0";

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// Two network namespaces ("machines") joined by a veth pair, deleted on drop.
pub struct Machines {
    names: [String; 2],
}

/// Why namespaces could not be made.
pub struct Unavailable(pub String);

/// Turns "cannot make namespaces here" into a skip with its reason on stderr.
pub trait OrSkip {
    /// The machines, or `None` after printing why the test skips.
    fn or_skip(self) -> Option<Machines>;
}

impl OrSkip for Result<Machines, Unavailable> {
    fn or_skip(self) -> Option<Machines> {
        match self {
            Ok(m) => Some(m),
            Err(Unavailable(why)) => {
                eprintln!("skipped: {why}");
                None
            }
        }
    }
}

/// Runs `ip` with `args`, returning its stderr as the error when it fails.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Runs `tc` inside namespace `ns`.
fn tc(ns: &str, args: &[&str]) -> Result<(), String> {
    let mut all = vec!["netns", "exec", ns, "tc"];
    all.extend_from_slice(args);
    ip(&all)
}

/// Whether process `pid` is alive.
fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Deletes namespaces that a test process which no longer runs left behind.
fn sweep_stale() {
    let Ok(entries) = std::fs::read_dir("/var/run/netns") else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        if matches!(pid, Some(pid) if !alive(pid)) {
            let _ = ip(&["netns", "del", &name]);
        }
    }
}

impl Machines {
    /// Makes two namespaces named after `test`, joined by a veth pair, with addresses
    /// [`Machines::addr`]`(0)` and `(1)` and loopback up; fails (to skip) where this process is
    /// not root or iproute2 is missing.
    pub fn new(test: &str) -> Result<Machines, Unavailable> {
        let root = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("Uid:"))
                    .and_then(|l| l.split_whitespace().nth(2).map(|u| u == "0"))
            })
            .unwrap_or(false);
        if !root {
            return Err(Unavailable(
                "making network namespaces needs root (this test runs as another user)".into(),
            ));
        }
        if Command::new("ip")
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_err()
        {
            return Err(Unavailable("iproute2's `ip` is not installed".into()));
        }
        sweep_stale();
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let short: String = test
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .take(12)
            .collect();
        let base = format!("{PREFIX}{}-{n}-{short}", std::process::id());
        let m = Machines {
            names: [format!("{base}-a"), format!("{base}-b")],
        };
        m.set_up().map_err(Unavailable)?;
        Ok(m)
    }

    fn set_up(&self) -> Result<(), String> {
        let [a, b] = &self.names;
        ip(&["netns", "add", a])?;
        ip(&["netns", "add", b])?;
        // Both ends are made inside the namespaces, so no name is ever taken in the host's.
        ip(&[
            "-n", a, "link", "add", DEV, "type", "veth", "peer", "name", DEV, "netns", b,
        ])?;
        for (i, ns) in self.names.iter().enumerate() {
            let cidr = format!("{}/24", self.addr(i));
            ip(&["-n", ns, "addr", "add", &cidr, "dev", DEV])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            ip(&["-n", ns, "link", "set", DEV, "up"])?;
        }
        Ok(())
    }

    /// Machine `i`'s address on the link between them.
    pub fn addr(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 231, 0, 1 + i as u8)
    }

    /// Machine `i`'s namespace name.
    pub fn name(&self, i: usize) -> &str {
        &self.names[i]
    }

    /// A command that runs `program` inside machine `i` (`ip netns exec` execs it, so the
    /// child's pid is the program's own).
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.names[i]]).arg(program);
        cmd
    }

    /// `launcher` (the path of `candle-run`) inside machine `node`, as node `node` of 2 with
    /// `nproc` ranks, meeting on [`PORT`] of machine 0,
    /// with launcher options `extra`, then `program`; every machine's launcher gets the same
    /// job token.
    pub fn launcher(
        &self,
        launcher: &str,
        node: usize,
        nproc: usize,
        extra: &[&str],
        program: &std::path::Path,
    ) -> Command {
        let mut cmd = self.command(node, launcher);
        cmd.args(["--nnodes", "2", "--node-rank", &node.to_string()])
            .args(["--nproc-per-node", &nproc.to_string()])
            .args(["--master-addr", &self.addr(0).to_string()])
            .args(["--master-port", PORT, "--grace-period", "2"])
            .args(extra)
            .arg(program)
            .env("CANDLE_PARALLEL_TOKEN", format!("netns-{}", self.names[0]))
            .env("CANDLE_PARALLEL_RENDEZVOUS_TIMEOUT", "60");
        cmd
    }

    /// `program` as rank `rank` of a job with `local` ranks on each machine (ranks in order,
    /// machine 0 first), inside its machine, with torchrun's variables, meeting on [`PORT`] of
    /// machine 0.
    pub fn rank(&self, program: impl AsRef<std::ffi::OsStr>, rank: usize, local: usize) -> Command {
        let mut cmd = self.command(rank / local, program);
        cmd.env("RANK", rank.to_string())
            .env("WORLD_SIZE", (2 * local).to_string())
            .env("LOCAL_RANK", (rank % local).to_string())
            .env("LOCAL_WORLD_SIZE", local.to_string())
            .env("MASTER_ADDR", self.addr(0).to_string())
            .env("MASTER_PORT", PORT)
            .env("CANDLE_PARALLEL_TOKEN", format!("netns-{}", self.names[0]));
        cmd
    }

    /// Takes the link between the machines down (`up = false`) or brings it back: nothing is
    /// sent to anyone when it goes down, so connections across it go silent, with no FIN or RST.
    pub fn set_link(&self, up: bool) {
        for ns in &self.names {
            ip(&["-n", ns, "link", "set", DEV, if up { "up" } else { "down" }])
                .expect("set the link's state");
        }
    }

    /// Limits the link to `rate` in each direction (`tc` token bucket, e.g. `"1gbit"`), or lifts
    /// the limit (`None`).
    pub fn limit_rate(&self, rate: Option<&str>) -> Result<(), String> {
        for ns in &self.names {
            let _ = tc(ns, &["qdisc", "del", "dev", DEV, "root"]);
            if let Some(rate) = rate {
                tc(
                    ns,
                    &[
                        "qdisc", "add", "dev", DEV, "root", "tbf", "rate", rate, "burst", "1mbit",
                        "latency", "200ms",
                    ],
                )?;
            }
        }
        Ok(())
    }
}

impl Machines {
    /// The processes still inside machine `i` (`ip netns pids`).
    pub fn pids(&self, i: usize) -> Vec<String> {
        let out = Command::new("ip")
            .args(["netns", "pids", &self.names[i]])
            .output()
            .expect("ip netns pids");
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(str::to_string)
            .collect()
    }

    /// Waits (up to `limit`) until no process is left in either machine; panics naming those
    /// left.
    pub fn assert_empty(&self, limit: std::time::Duration) {
        let deadline = std::time::Instant::now() + limit;
        loop {
            let left: Vec<String> = (0..2).flat_map(|i| self.pids(i)).collect();
            if left.is_empty() {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "processes left in the machines after {limit:?}: {left:?}"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}

impl Drop for Machines {
    fn drop(&mut self) {
        for ns in &self.names {
            if let Err(e) = ip(&["netns", "del", ns]) {
                eprintln!("could not delete network namespace {ns}: {e}");
            }
        }
    }
}
