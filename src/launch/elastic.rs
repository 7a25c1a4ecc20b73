//! Elastic membership (`candle-run --nnodes MIN:MAX`): the rendezvous where the machines'
//! launchers meet, round after round (torchrun's c10d rendezvous, `dynamic_rendezvous.py`).
//!
//! The launcher that can listen on `--master-addr:--master-port` hosts the agents' store there
//! and runs the [`Coordinator`], a thread that forms the rounds; every launcher (the host's
//! too) is an [`Agent`] of the rendezvous, a client of that store:
//! - it registers once (a node id, in arrival order), then sends a heartbeat every
//!   [`HEARTBEAT`] on a connection of its own, and on it looks for a request to restart;
//! - to run, it joins the next round (with a free port of its own, in case its machine hosts
//!   rank 0) and waits, at most `join_timeout`, for its place in it.
//! - when it stops without success (out of restarts, interrupted, its join timed out), it
//!   withdraws, and the coordinator counts it out at once rather than after `keep_alive`.
//!
//! The coordinator closes a round when `max_nodes` have joined, or when `min_nodes` have and
//! `last_call` has passed since; a round never closes while a machine of the round before still
//! runs (it has not rejoined, left, or been silent for `keep_alive`). Machines are numbered in
//! order of their node ids, so the host, the first to register, is machine 0. A machine that
//! joins while a round runs with fewer than `max_nodes` waits, and the coordinator asks the
//! running launchers to restart (they see it at their next heartbeat), as torchrun's agents do
//! when `num_nodes_waiting()` is above 0. A launcher whose job succeeded leaves and closes
//! the rendezvous: machines still waiting then end too, with nothing to run.
//!
//! The rendezvous lives in the host launcher: when that machine is lost the others lose their
//! store within a heartbeat (or within the store's read timeout when its link went silent) and
//! the job ends, as with torchrun's c10d backend.

use super::{ElasticConfig, LaunchConfig};
use crate::distributed::store::{Store, StoreServer};
use crate::error::{Error, Result};
use crate::util::sync::lock;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often a launcher says that it is alive and looks for a request to restart: a machine
/// that arrives while a round runs is admitted within about this long (plus the ranks' grace
/// period).
pub(super) const HEARTBEAT: Duration = Duration::from_secs(1);
/// How often the coordinator looks at the store.
const TICK: Duration = Duration::from_millis(100);
/// The longest one look at the store for a place in a round waits, so that a join notices
/// Ctrl-C and a lost store in time.
const POLL: Duration = Duration::from_secs(1);

/// The store's keys, all under `elastic/`.
mod key {
    pub const NODES: &str = "nodes";
    pub const STATE: &str = "state";
    pub const CLOSED: &str = "closed";
    pub fn alive(id: i64) -> String {
        format!("alive/{id}")
    }
    pub fn joins(id: i64) -> String {
        format!("join/{id}")
    }
    pub fn join_info(id: i64, k: i64) -> String {
        format!("join-info/{id}/{k}")
    }
    pub fn place(id: i64, k: i64) -> String {
        format!("place/{id}/{k}")
    }
    pub fn left(id: i64) -> String {
        format!("left/{id}")
    }
    pub fn lost(id: i64) -> String {
        format!("lost/{id}")
    }
    pub fn restart(round: usize) -> String {
        format!("restart/{round}")
    }
    pub fn members(round: usize) -> String {
        format!("round/{round}/nodes")
    }
}

/// This machine's place in one round (of an elastic job, or of a fixed one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Assignment {
    /// The rendezvous round, 0 first (each round has its own job token).
    pub round: usize,
    /// Machines in the round.
    pub nnodes: usize,
    /// This machine's index among them.
    pub group_rank: usize,
    /// The global rank of this machine's local rank 0.
    pub rank_offset: usize,
    /// Ranks in the round.
    pub world: usize,
    /// Where the round's rank 0 serves its store.
    pub master_addr: String,
    /// Its port.
    pub master_port: u16,
}

impl Assignment {
    fn encode(&self) -> String {
        format!(
            "{} {} {} {} {} {} {}",
            self.round,
            self.nnodes,
            self.group_rank,
            self.rank_offset,
            self.world,
            self.master_addr,
            self.master_port
        )
    }

    fn decode(text: &str) -> Option<Self> {
        let w: Vec<&str> = text.split_whitespace().collect();
        let [round, nnodes, group_rank, rank_offset, world, addr, port] = w[..] else {
            return None;
        };
        Some(Self {
            round: round.parse().ok()?,
            nnodes: nnodes.parse().ok()?,
            group_rank: group_rank.parse().ok()?,
            rank_offset: rank_offset.parse().ok()?,
            world: world.parse().ok()?,
            master_addr: addr.to_string(),
            master_port: port.parse().ok()?,
        })
    }
}

/// What a launcher sends with a join: its ranks, and where its rank 0 would serve the round's
/// store if its machine comes first.
#[derive(Clone, Debug)]
struct JoinInfo {
    nproc: usize,
    addr: IpAddr,
    port: u16,
}

impl JoinInfo {
    fn decode(text: &str) -> Option<Self> {
        let mut w = text.split_whitespace();
        Some(Self {
            nproc: w.next()?.parse().ok()?,
            port: w.next()?.parse().ok()?,
            addr: w.next()?.parse().ok()?,
        })
    }
}

/// Why the launcher stopped its ranks from outside, besides a signal.
pub(super) enum Halt {
    /// A machine waits to join: restart so that the next round admits it.
    Restart,
    /// The rendezvous's store is gone (the host's machine was lost): the job ends.
    Lost(String),
}

/// The store's address from `--master-addr` and `--master-port`.
fn rendezvous_addr(config: &LaunchConfig) -> Result<SocketAddr> {
    let port = config.master_port.ok_or_else(|| Error::Config {
        what: "--master-port".into(),
        detail: "required with --nnodes MIN:MAX".into(),
    })?;
    (config.master_addr.as_str(), port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| Error::Config {
            what: "--master-addr".into(),
            detail: format!("{:?} does not resolve to an address", config.master_addr),
        })
}

/// The agents' store's token: the job's, marked, so that no rank mistakes it for its round's.
fn rendezvous_token(token: &str) -> String {
    format!("{token}/rendezvous")
}

/// A thread that sends this launcher's heartbeats and watches for a request to restart its
/// round.
struct Watch {
    stop: Arc<AtomicBool>,
    /// The running round plus one; 0 between rounds.
    round: Arc<AtomicUsize>,
    restart: Arc<AtomicBool>,
    lost: Arc<Mutex<Option<String>>>,
    thread: Option<JoinHandle<()>>,
}

impl Watch {
    fn start(store: Store, id: i64) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let round = Arc::new(AtomicUsize::new(0));
        let restart = Arc::new(AtomicBool::new(false));
        let lost = Arc::new(Mutex::new(None));
        let thread = {
            let (stop, round, restart, lost) =
                (stop.clone(), round.clone(), restart.clone(), lost.clone());
            std::thread::Builder::new()
                .name("rdzv-heartbeat".into())
                .spawn(move || {
                    while !stop.load(Ordering::SeqCst) {
                        let beat = store.add(&key::alive(id), 1).and_then(|_| {
                            match round.load(Ordering::SeqCst) {
                                0 => Ok(false),
                                r => store.check(&[&key::restart(r - 1)]),
                            }
                        });
                        match beat {
                            Ok(true) => restart.store(true, Ordering::SeqCst),
                            Ok(false) => {}
                            Err(e) => {
                                *lock(&lost) = Some(e.to_string());
                                return;
                            }
                        }
                        let next = Instant::now() + HEARTBEAT;
                        while !stop.load(Ordering::SeqCst) && Instant::now() < next {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                    }
                })
                .map_err(|source| Error::Io {
                    context: "starting the rendezvous heartbeat thread".into(),
                    source,
                })?
        };
        Ok(Self {
            stop,
            round,
            restart,
            lost,
            thread: Some(thread),
        })
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The host's part: the agents' store and the coordinator thread.
struct Host {
    stop: Arc<AtomicBool>,
    coordinator: Option<JoinHandle<()>>,
    // Dropped after the coordinator stopped (fields drop in order, after `Drop::drop`).
    _server: StoreServer,
}

impl Drop for Host {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.coordinator.take() {
            let _ = t.join();
        }
    }
}

/// This launcher's side of the rendezvous; see the [module docs](self).
pub(super) struct Agent {
    store: Store,
    addr: SocketAddr,
    id: i64,
    joins: i64,
    nproc: usize,
    config: ElasticConfig,
    /// The last round this launcher ran in.
    round: Option<usize>,
    /// Whether it left after its job succeeded ([`finish`](Self::finish)).
    finished: bool,
    // Declared before `host`: the heartbeats stop before the store does.
    watch: Watch,
    host: Option<Host>,
}

impl Agent {
    /// Hosts the rendezvous when this machine has `--master-addr` (and nobody listens on the
    /// port yet), connects to it, and registers this launcher.
    pub(super) fn start(
        config: &LaunchConfig,
        elastic: &ElasticConfig,
        token: &str,
    ) -> Result<Self> {
        let addr = rendezvous_addr(config)?;
        let token = rendezvous_token(token);
        let server = match StoreServer::bind(addr, &token) {
            Ok(s) => Some(s),
            Err(e) => {
                // Another machine's address, or another launcher of this machine hosts it.
                log::debug!("not hosting the rendezvous at {addr}: {e}");
                None
            }
        };
        let connect = |timeout| {
            Store::connect(addr, &token, 0, timeout).map_err(|e| Error::Rendezvous {
                detail: format!(
                    "cannot reach the elastic rendezvous at {addr} (hosted by the launcher on \
                     --master-addr; start it there, or check --master-addr and --master-port): \
                     {e}"
                ),
            })
        };
        let store = connect(elastic.join_timeout)?.scoped("elastic/");
        let id = store.add(key::NODES, 1)?;
        let host = match server {
            Some(server) => {
                let stop = Arc::new(AtomicBool::new(false));
                let coordinator = Coordinator::new(connect(elastic.join_timeout)?, elastic);
                let thread = {
                    let stop = stop.clone();
                    std::thread::Builder::new()
                        .name("rdzv-coordinator".into())
                        .spawn(move || coordinator.run(&stop))
                        .map_err(|source| Error::Io {
                            context: "starting the rendezvous coordinator".into(),
                            source,
                        })?
                };
                log::info!("hosting the elastic rendezvous at {addr}");
                Some(Host {
                    stop,
                    coordinator: Some(thread),
                    _server: server,
                })
            }
            None => None,
        };
        let watch = Watch::start(connect(elastic.join_timeout)?.scoped("elastic/"), id)?;
        log::info!(
            "joined the elastic rendezvous at {addr} as node {id} (--nnodes {}:{})",
            elastic.min_nodes,
            elastic.max_nodes
        );
        Ok(Self {
            store,
            addr,
            id,
            joins: 0,
            nproc: config.nproc_per_node,
            config: elastic.clone(),
            round: None,
            finished: false,
            watch,
            host,
        })
    }

    /// What stops this launcher's running ranks from outside: a machine waiting to join, or
    /// the rendezvous lost.
    pub(super) fn halt(&self) -> Option<Halt> {
        if let Some(why) = lock(&self.watch.lost).clone() {
            return Some(Halt::Lost(why));
        }
        self.watch
            .restart
            .load(Ordering::SeqCst)
            .then_some(Halt::Restart)
    }

    /// The error for a lost rendezvous.
    pub(super) fn lost(&self, why: &str) -> Error {
        Error::Rendezvous {
            detail: format!(
                "lost the elastic rendezvous at {} ({why}): the launcher on --master-addr, which \
                 hosts it, is gone or unreachable, and the job ends with it",
                self.addr
            ),
        }
    }

    /// Joins the next round and waits (at most `join_timeout`) for this machine's place in
    /// it; `None` when the job has finished meanwhile (another machine's launcher succeeded
    /// and closed the rendezvous). `interrupted` is asked every second.
    pub(super) fn join(
        &mut self,
        interrupted: &dyn Fn() -> Option<Error>,
    ) -> Result<Option<Assignment>> {
        self.watch.round.store(0, Ordering::SeqCst);
        self.watch.restart.store(false, Ordering::SeqCst);
        let ip = self.store.local_addr().ip();
        let port = super::free_port(&ip.to_string())?;
        let k = self.joins + 1;
        let info = format!("{} {port} {ip}", self.nproc);
        self.joins = self
            .store
            .set(&key::join_info(self.id, k), info.as_bytes())
            .and_then(|()| self.store.add(&key::joins(self.id), 1))
            .map_err(|e| self.lost(&e.to_string()))?;
        let started = Instant::now();
        let mut said = Duration::ZERO;
        loop {
            if let Some(e) = interrupted() {
                return Err(e);
            }
            if let Some(why) = lock(&self.watch.lost).clone() {
                return Err(self.lost(&why));
            }
            let closed = self.store.check(&[key::CLOSED]);
            if closed.map_err(|e| self.lost(&e.to_string()))? {
                log::info!("the job finished on the other machines: nothing left to run here");
                return Ok(None);
            }
            // Counted out (silent past `keep_alive`): no round will ever place this machine.
            let counted_out = self.store.check(&[&key::lost(self.id)]);
            if counted_out.map_err(|e| self.lost(&e.to_string()))? {
                return Err(Error::Rendezvous {
                    detail: format!(
                        "the elastic rendezvous at {} counted this machine (node {}) as lost:                          its launcher was silent for more than --rdzv-keep-alive {} s, and the                          job went on without it; start its launcher again to rejoin (as a new                          node), or raise --rdzv-keep-alive if the machine was only slow",
                        self.addr,
                        self.id,
                        self.config.keep_alive.as_secs_f64()
                    ),
                });
            }
            let left = self.config.join_timeout.saturating_sub(started.elapsed());
            match self.store.get(&key::place(self.id, k), left.min(POLL)) {
                Ok(text) => {
                    let text = String::from_utf8_lossy(&text).into_owned();
                    let a = Assignment::decode(&text).ok_or_else(|| Error::Rendezvous {
                        detail: format!("the rendezvous sent a malformed place: {text:?}"),
                    })?;
                    self.watch.round.store(a.round + 1, Ordering::SeqCst);
                    self.round = Some(a.round);
                    log::info!(
                        "round {} of the elastic rendezvous: machine {} of {}, ranks {}..{} of \
                         {}",
                        a.round,
                        a.group_rank,
                        a.nnodes,
                        a.rank_offset,
                        a.rank_offset + self.nproc,
                        a.world
                    );
                    return Ok(Some(a));
                }
                Err(Error::Timeout { .. }) => {}
                Err(e) => return Err(self.lost(&e.to_string())),
            }
            let waited = started.elapsed();
            if waited >= self.config.join_timeout {
                let state = self
                    .store
                    .get(key::STATE, Duration::ZERO)
                    .map(|s| String::from_utf8_lossy(&s).into_owned())
                    .unwrap_or_else(|_| "no round formed yet".into());
                return Err(Error::Rendezvous {
                    detail: format!(
                        "no round of the elastic rendezvous at {} closed within \
                         --rdzv-join-timeout {} s ({state}; a round needs {} to {} machines): \
                         start the missing machines' launchers, or lower MIN in --nnodes MIN:MAX",
                        self.addr,
                        self.config.join_timeout.as_secs_f64(),
                        self.config.min_nodes,
                        self.config.max_nodes
                    ),
                });
            }
            if waited >= said + Duration::from_secs(30) {
                said = waited;
                log::info!(
                    "waiting for a round of the elastic rendezvous at {}, {} s so far",
                    self.addr,
                    waited.as_secs()
                );
            }
        }
    }

    /// Leaves the rendezvous after this machine's ranks succeeded, which closes it (the job is
    /// done); the host waits for the round's other machines to leave too (or to be counted
    /// lost, `keep_alive` after their last heartbeat), so that its store outlives their last
    /// look at it even when they finish long after it: at most `join_timeout`, and not past a
    /// signal (`stop`).
    pub(super) fn finish(&mut self, stop: &dyn Fn() -> bool) {
        self.finished = true;
        if let Err(e) = self.store.set(&key::left(self.id), b"done") {
            log::debug!("could not leave the rendezvous: {e}");
            return;
        }
        let (Some(_), Some(round)) = (&self.host, self.round) else {
            return;
        };
        let members: Vec<i64> = self
            .store
            .get(&key::members(round), Duration::ZERO)
            .map(|m| {
                String::from_utf8_lossy(&m)
                    .split_whitespace()
                    .filter_map(|id| id.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        let deadline = Instant::now() + self.config.join_timeout;
        for id in members {
            while Instant::now() < deadline && !stop() {
                match self.store.check(&[&key::left(id)]) {
                    Ok(false) if !self.store.check(&[&key::lost(id)]).unwrap_or(true) => {
                        std::thread::sleep(TICK)
                    }
                    _ => break,
                }
            }
        }
    }
}

impl Drop for Agent {
    /// A launcher that stops without success (out of restarts, interrupted, a join that timed
    /// out) withdraws at once: else the coordinator would count its pending join, or its place
    /// in the running round, until `keep_alive` passed, and could close a round with a machine
    /// whose ranks never start.
    fn drop(&mut self) {
        // Not when the rendezvous is known lost: a store that went silent would hold this
        // launcher's exit for the store's read timeout.
        if !self.finished && lock(&self.watch.lost).is_none() {
            if let Err(e) = self.store.set(&key::lost(self.id), b"withdrew") {
                log::debug!("could not withdraw from the rendezvous: {e}");
            }
        }
    }
}

/// What the coordinator knows of one launcher.
struct Node {
    /// Its heartbeat counter, and when it last changed (on this machine's clock: the
    /// rendezvous never compares two machines' clocks).
    beats: i64,
    heard: Instant,
    /// Joins answered (or being answered).
    joins_seen: i64,
    /// A join waiting for a round: its number and what it sent.
    pending: Option<(i64, JoinInfo)>,
    /// Left after its job succeeded, or counted as lost.
    gone: bool,
}

/// The host's thread that forms the rounds; see the [module docs](self).
struct Coordinator {
    store: Store,
    config: ElasticConfig,
    nodes: BTreeMap<i64, Node>,
    /// The round being formed, or running.
    round: usize,
    /// The running round's machines still running it.
    running: Option<Vec<i64>>,
    /// The machines the running round started with.
    started_with: Vec<i64>,
    /// When the round being formed reached `min_nodes`.
    min_reached: Option<Instant>,
    closed: bool,
    state: String,
}

impl Coordinator {
    fn new(store: Store, config: &ElasticConfig) -> Self {
        Self {
            store: store.scoped("elastic/"),
            config: config.clone(),
            nodes: BTreeMap::new(),
            round: 0,
            running: None,
            started_with: Vec::new(),
            min_reached: None,
            closed: false,
            state: String::new(),
        }
    }

    fn run(mut self, stop: &AtomicBool) {
        while !stop.load(Ordering::SeqCst) {
            if let Err(e) = self.tick() {
                // The store is this process's own: only its end makes it fail.
                log::debug!("the rendezvous coordinator stops: {e}");
                return;
            }
            std::thread::sleep(TICK);
        }
    }

    fn tick(&mut self) -> Result<()> {
        let now = Instant::now();
        let registered = self.store.add(key::NODES, 0)?;
        for id in 1..=registered {
            self.nodes.entry(id).or_insert(Node {
                beats: -1,
                heard: now,
                joins_seen: 0,
                pending: None,
                gone: false,
            });
        }
        for (&id, node) in self.nodes.iter_mut().filter(|(_, n)| !n.gone) {
            let beats = self.store.add(&key::alive(id), 0)?;
            if beats != node.beats {
                (node.beats, node.heard) = (beats, now);
            }
            if self.store.check(&[&key::left(id)])? {
                node.gone = true;
                self.closed = true;
                self.store.set(key::CLOSED, b"1")?;
                log::info!("node {id} finished its job: the rendezvous is closed");
                continue;
            }
            if self.store.check(&[&key::lost(id)])? {
                node.gone = true;
                log::info!("the launcher of node {id} stopped: it leaves the rendezvous");
                continue;
            }
            if now.duration_since(node.heard) > self.config.keep_alive {
                node.gone = true;
                self.store.set(&key::lost(id), b"1")?;
                log::warn!(
                    "the launcher of node {id} was silent for {} s (--rdzv-keep-alive): its \
                     machine counts as lost",
                    self.config.keep_alive.as_secs_f64()
                );
                continue;
            }
            let joins = self.store.add(&key::joins(id), 0)?;
            if joins > node.joins_seen && node.pending.is_none() {
                let text = self.store.get(&key::join_info(id, joins), POLL)?;
                let text = String::from_utf8_lossy(&text);
                match JoinInfo::decode(&text) {
                    Some(info) => node.pending = Some((joins, info)),
                    None => log::warn!("node {id} sent a malformed join: {text:?}"),
                }
                node.joins_seen = joins;
            }
        }
        if self.closed {
            return Ok(());
        }
        match self.running.take() {
            Some(members) => self.watch_running(members),
            None => self.form(now),
        }
    }

    /// While a round runs: drops the machines that rejoined, left or were lost; when none is
    /// left, the next round forms. A newcomer waiting makes the running machines restart.
    fn watch_running(&mut self, members: Vec<i64>) -> Result<()> {
        let members: Vec<i64> = members
            .into_iter()
            .filter(|id| {
                let n = &self.nodes[id];
                !n.gone && n.pending.is_none()
            })
            .collect();
        if members.is_empty() {
            self.round += 1;
            self.min_reached = None;
            return self.form(Instant::now());
        }
        let size = self.started_with.len();
        // Newcomers: a machine of the round that rejoined is on its way to the next round.
        let waiting = self
            .nodes
            .iter()
            .filter(|(id, n)| n.pending.is_some() && !self.started_with.contains(id))
            .count();
        if waiting > 0 && size < self.config.max_nodes {
            let restart = key::restart(self.round);
            if !self.store.check(&[&restart])? {
                log::warn!(
                    "{waiting} machine(s) waiting to join while round {} runs with {size} of at \
                     most {}: asking the running launchers to restart",
                    self.round,
                    self.config.max_nodes
                );
                self.store.set(&restart, b"1")?;
            }
        }
        self.say(format!(
            "round {} running with {} machine(s), {waiting} waiting",
            self.round,
            members.len()
        ))?;
        self.running = Some(members);
        Ok(())
    }

    /// Between rounds: closes the next one when it can.
    fn form(&mut self, now: Instant) -> Result<()> {
        let joined: Vec<i64> = self
            .nodes
            .iter()
            .filter(|(_, n)| !n.gone && n.pending.is_some())
            .map(|(&id, _)| id)
            .collect();
        let (min, max) = (self.config.min_nodes, self.config.max_nodes);
        if joined.len() < min {
            self.min_reached = None;
        } else {
            self.min_reached.get_or_insert(now);
        }
        let last_call_over = self
            .min_reached
            .is_some_and(|t| now.duration_since(t) >= self.config.last_call);
        if joined.len() < max && !last_call_over {
            return self.say(format!(
                "round {} forming: {} of {min}:{max} machines joined",
                self.round,
                joined.len()
            ));
        }
        let members: Vec<i64> = joined.into_iter().take(max).collect();
        let infos: Vec<(i64, JoinInfo)> = members
            .iter()
            .map(|id| {
                let (k, info) = self.nodes[id].pending.clone().expect("joined");
                (k, info)
            })
            .collect();
        let world: usize = infos.iter().map(|(_, i)| i.nproc).sum();
        let first = &infos[0].1;
        let ids: Vec<String> = members.iter().map(i64::to_string).collect();
        self.store
            .set(&key::members(self.round), ids.join(" ").as_bytes())?;
        let mut offset = 0;
        for (group_rank, (id, (k, info))) in members.iter().zip(&infos).enumerate() {
            let place = Assignment {
                round: self.round,
                nnodes: members.len(),
                group_rank,
                rank_offset: offset,
                world,
                master_addr: first.addr.to_string(),
                master_port: first.port,
            };
            offset += info.nproc;
            self.store
                .set(&key::place(*id, *k), place.encode().as_bytes())?;
            if let Some(n) = self.nodes.get_mut(id) {
                n.pending = None;
            }
        }
        log::info!(
            "round {} of the elastic rendezvous closed: {} machine(s) (nodes {}), {world} ranks",
            self.round,
            members.len(),
            ids.join(", ")
        );
        self.started_with = members.clone();
        self.running = Some(members);
        self.min_reached = None;
        Ok(())
    }

    /// Publishes what the rendezvous is doing (for a launcher's timeout message).
    fn say(&mut self, state: String) -> Result<()> {
        if state != self.state {
            self.store.set(key::STATE, state.as_bytes())?;
            self.state = state;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_place_survives_its_encoding() {
        let a = Assignment {
            round: 3,
            nnodes: 2,
            group_rank: 1,
            rank_offset: 2,
            world: 4,
            master_addr: "10.0.0.1".into(),
            master_port: 41234,
        };
        assert_eq!(Assignment::decode(&a.encode()), Some(a));
        assert_eq!(Assignment::decode("3 2 1"), None);
    }

    /// A launcher's configuration whose rendezvous is on a free port of 127.0.0.1.
    fn loopback() -> Result<LaunchConfig> {
        Ok(LaunchConfig {
            master_addr: "127.0.0.1".into(),
            master_port: Some(super::super::free_port("127.0.0.1")?),
            ..Default::default()
        })
    }

    #[test]
    fn the_host_that_finishes_first_keeps_the_store_until_a_slower_machine_leaves() -> Result<()> {
        let config = loopback()?;
        // The other machine finishes 3 s after the host, well past `keep_alive` (1 s), while
        // its heartbeats go on.
        let elastic = ElasticConfig {
            min_nodes: 2,
            max_nodes: 2,
            last_call: Duration::from_millis(200),
            join_timeout: Duration::from_secs(20),
            keep_alive: Duration::from_secs(1),
        };
        let mut host = Agent::start(&config, &elastic, "slow")?;
        let other = std::thread::spawn({
            let (config, elastic) = (config.clone(), elastic.clone());
            move || -> Result<Duration> {
                let mut other = Agent::start(&config, &elastic, "slow")?;
                other.join(&|| None)?.expect("a place");
                std::thread::sleep(Duration::from_secs(3));
                other.finish(&|| false);
                Ok(Duration::ZERO)
            }
        });
        host.join(&|| None)?.expect("a place");
        let started = Instant::now();
        host.finish(&|| false);
        let waited = started.elapsed();
        other.join().expect("the other launcher's thread")?;
        assert!(
            waited >= Duration::from_millis(2500),
            "the host left after {waited:?}, before the other machine did"
        );
        Ok(())
    }

    #[test]
    fn a_launcher_that_stops_while_waiting_is_left_out_of_the_next_round() -> Result<()> {
        let config = loopback()?;
        let elastic = ElasticConfig {
            min_nodes: 1,
            max_nodes: 2,
            last_call: Duration::from_millis(500),
            join_timeout: Duration::from_secs(20),
            keep_alive: Duration::from_secs(60),
        };
        let mut host = Agent::start(&config, &elastic, "withdraw")?;
        assert!(host.host.is_some());
        // A second launcher joins, then stops (as at its join timeout, or on Ctrl-C) long
        // before `keep_alive` would count it as lost.
        let other = Agent::start(&config, &elastic, "withdraw")?;
        let info = format!("1 {} 127.0.0.1", super::super::free_port("127.0.0.1")?);
        other
            .store
            .set(&key::join_info(other.id, 1), info.as_bytes())?;
        other.store.add(&key::joins(other.id), 1)?;
        drop(other);
        // The round must not count it: it closes at the last call with the host alone.
        let place = host.join(&|| None)?.expect("a place");
        assert_eq!((place.nnodes, place.world, place.group_rank), (1, 1, 0));
        host.finish(&|| false);
        Ok(())
    }

    #[test]
    fn a_launcher_counted_as_lost_is_told_so_at_its_next_join_not_at_the_join_timeout() -> Result<()>
    {
        let config = loopback()?;
        let elastic = ElasticConfig {
            min_nodes: 2,
            max_nodes: 2,
            join_timeout: Duration::from_secs(30),
            ..Default::default()
        };
        let mut host = Agent::start(&config, &elastic, "counted-out")?;
        // As the coordinator marks a launcher silent for longer than `keep_alive`.
        host.store.set(&key::lost(host.id), b"1")?;
        let started = Instant::now();
        let err = host.join(&|| None).unwrap_err().to_string();
        assert!(started.elapsed() < Duration::from_secs(10), "{err}");
        assert!(
            err.contains("counted this machine (node 1) as lost") && err.contains("keep-alive"),
            "{err}"
        );
        host.finished = true;
        Ok(())
    }
}
