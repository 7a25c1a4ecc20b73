//! A connection between every pair of ranks, with failure detection.
//!
//! One thread per peer reads frames into a mailbox, so a rank never blocks another's sends, and
//! whatever happens on any connection wakes whoever waits:
//!
//! - a peer whose connection closes (it exited, crashed or was killed) is *lost*;
//! - a peer silent for `peer_timeout` (no frame, no heartbeat: hung, stopped, unreachable) is
//!   lost; a heartbeat thread keeps every connection busy so that live peers never are;
//! - a rank that breaks (a lost peer, a timed-out wait) sends `Abort` to every peer, so ranks
//!   waiting on someone else fail at once too, naming the rank that was lost.
//!
//! Once broken, the mesh stays broken: every later operation fails with the first reason.

use super::conn::Conn;
#[cfg(target_os = "linux")]
use super::shm::{futex_wait, futex_wake, Channel, Region};
mod watch;

use crate::distributed::algorithms::Links;
use crate::distributed::wire::{self, encode_header, FrameKind, Tag};
use crate::error::{Error, Result};
use crate::sync::lock;
use std::collections::VecDeque;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long to wait for peers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MeshOptions {
    /// The longest wait for a live peer's part of a collective.
    pub timeout: Duration,
    /// The longest silence after which a peer counts as lost.
    pub peer_timeout: Duration,
}

/// Why the mesh broke.
#[derive(Clone, Debug)]
pub(crate) struct Broken {
    /// The rank that was lost, when one was.
    pub lost: Option<usize>,
    pub detail: String,
}

impl Broken {
    pub fn error(&self) -> Error {
        match self.lost {
            Some(rank) => Error::PeerLost {
                rank,
                detail: self.detail.clone(),
            },
            None => Error::Aborted {
                reason: self.detail.clone(),
            },
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut b = self
            .lost
            .map_or(u32::MAX, |r| r as u32)
            .to_le_bytes()
            .to_vec();
        b.extend_from_slice(self.detail.as_bytes());
        b
    }

    fn decode(payload: &[u8], from: usize) -> Self {
        let lost = payload
            .get(..4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .filter(|&r| r != u32::MAX)
            .map(|r| r as usize);
        let detail = String::from_utf8_lossy(payload.get(4..).unwrap_or(&[])).into_owned();
        Self {
            lost,
            detail: format!("{detail} (reported by rank {from})"),
        }
    }
}

struct Frame {
    tag: Tag,
    payload: Vec<u8>,
}

struct State {
    inbox: Vec<VecDeque<Frame>>,
    last_seen: Vec<Instant>,
    departed: Vec<bool>,
    broken: Option<Broken>,
    closing: bool,
    pool: Vec<Vec<u8>>,
}

struct PeerWriter {
    stream: Mutex<Conn>,
    last_sent_ms: AtomicU64,
}

/// Shared-memory data channels with one peer on this machine.
#[cfg(target_os = "linux")]
pub(crate) struct ShmLink {
    pub send: Channel,
    pub recv: Channel,
    /// The mapping both channels point into; dropped (unmapped) after them.
    pub _region: Region,
}

#[cfg(not(target_os = "linux"))]
pub(crate) enum ShmLink {}

/// How long a futex wait sleeps before looking at the mesh's state again.
#[cfg(target_os = "linux")]
const WAIT_SLICE: Duration = Duration::from_millis(100);

struct Inner {
    rank: usize,
    world: usize,
    /// How each peer is reached ("tcp", "unix", "shm"; `None` for this rank).
    kinds: Vec<Option<&'static str>>,
    /// Shared-memory data channels, with neighbours on this machine.
    shm: Vec<Option<ShmLink>>,
    options: MeshOptions,
    epoch: Instant,
    writers: Vec<Option<PeerWriter>>,
    sockets: Vec<Option<Conn>>,
    state: Mutex<State>,
    changed: Condvar,
    stop: (Mutex<bool>, Condvar),
}

/// The connected ranks of one process group.
pub(crate) struct Mesh {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
}

impl Mesh {
    /// Takes over `streams[p]`, a handshaken connection to every peer `p` (`None` for this
    /// rank), and `shm[p]`, shared-memory data channels to some of them.
    pub fn new(
        rank: usize,
        world: usize,
        streams: Vec<Option<Conn>>,
        shm: Vec<Option<ShmLink>>,
        options: MeshOptions,
    ) -> Result<Self> {
        let kinds = streams
            .iter()
            .zip(&shm)
            .map(|(s, m)| match (s, m) {
                (Some(_), Some(_)) => Some("shm"),
                (s, _) => s.as_ref().map(Conn::kind),
            })
            .collect();
        let mut writers = Vec::with_capacity(world);
        let mut sockets = Vec::with_capacity(world);
        let mut readers = Vec::new();
        for (peer, stream) in streams.into_iter().enumerate() {
            let Some(stream) = stream else {
                writers.push(None);
                sockets.push(None);
                continue;
            };
            let ctx = || format!("setting up the connection to rank {peer}");
            stream.tune().map_err(wire::io_err(ctx()))?;
            stream.set_read_timeout(None).map_err(wire::io_err(ctx()))?;
            stream
                .set_write_timeout(Some(options.peer_timeout))
                .map_err(wire::io_err(ctx()))?;
            readers.push((peer, stream.try_clone().map_err(wire::io_err(ctx()))?));
            sockets.push(Some(stream.try_clone().map_err(wire::io_err(ctx()))?));
            writers.push(Some(PeerWriter {
                stream: Mutex::new(stream),
                last_sent_ms: AtomicU64::new(0),
            }));
        }
        let now = Instant::now();
        let inner = Arc::new(Inner {
            rank,
            world,
            kinds,
            shm,
            options,
            epoch: now,
            writers,
            sockets,
            state: Mutex::new(State {
                inbox: (0..world).map(|_| VecDeque::new()).collect(),
                last_seen: vec![now; world],
                departed: vec![false; world],
                broken: None,
                closing: false,
                pool: Vec::new(),
            }),
            changed: Condvar::new(),
            stop: (Mutex::new(false), Condvar::new()),
        });
        let mut threads = Vec::new();
        for (peer, stream) in readers {
            let inner = inner.clone();
            threads.push(spawn(format!("recv-{peer}"), move || {
                inner.receive(peer, stream)
            })?);
        }
        if world > 1 {
            let hb = inner.clone();
            threads.push(spawn("heartbeat".into(), move || hb.heartbeat())?);
        }
        Ok(Self { inner, threads })
    }

    /// How each peer is reached ("tcp", "unix"; `None` for this rank).
    pub fn transports(&self) -> Vec<Option<&'static str>> {
        self.inner.kinds.clone()
    }

    /// Fails when the mesh is broken.
    #[cfg_attr(not(any(test, feature = "nccl")), allow(dead_code))]
    pub fn usable(&self) -> Result<()> {
        match &lock(&self.inner.state).broken {
            Some(b) => Err(b.error()),
            None => Ok(()),
        }
    }

    /// Breaks the mesh for `reason` (unless already broken), tells every peer, and returns the
    /// error that now describes the mesh.
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub fn fail(&self, reason: Broken) -> Error {
        self.inner.fail(reason)
    }
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name)
        .spawn(f)
        .map_err(wire::io_err("starting a communication thread"))
}

impl Inner {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn fail(&self, reason: Broken) -> Error {
        let (first, fresh) = {
            let mut st = lock(&self.state);
            let fresh = st.broken.is_none();
            (st.broken.get_or_insert(reason).clone(), fresh)
        };
        self.changed.notify_all();
        self.ring_all_doorbells();
        if fresh {
            crate::distributed::error_file::note_loss(first.lost);
            let payload = first.encode();
            let header = encode_header(Tag::control(FrameKind::Abort), payload.len());
            for w in self.writers.iter().flatten() {
                // Best effort; a writer held by a send stuck on the lost peer is skipped.
                if let Ok(mut s) = w.stream.try_lock() {
                    let _ = s.write_all(&header).and_then(|()| s.write_all(&payload));
                }
            }
        }
        first.error()
    }

    /// Wakes this process's waiters on the shared-memory channels with `peer`: a frame from it
    /// arrived on the socket, or something happened that they must look at.
    fn ring_doorbell(&self, peer: usize) {
        #[cfg(target_os = "linux")]
        if let Some(link) = &self.shm[peer] {
            for word in [link.recv.produced(), link.send.consumed()] {
                word.fetch_add(1, Ordering::Release);
                futex_wake(word);
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = peer;
    }

    fn ring_all_doorbells(&self) {
        for p in 0..self.world {
            self.ring_doorbell(p);
        }
    }

    fn send(&self, peer: usize, tag: Tag, payload: &[u8]) -> Result<()> {
        #[cfg(target_os = "linux")]
        if let Some(link) = &self.shm[peer] {
            if tag.kind == FrameKind::Data && payload.len() <= link.send.capacity() {
                return self.send_shm(peer, &link.send, tag, payload);
            }
        }
        if let Some(b) = &lock(&self.state).broken {
            return Err(b.error());
        }
        let writer = self.writers[peer]
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument {
                what: "peer rank",
                detail: format!("rank {peer} is this rank or outside the group"),
            })?;
        let header = encode_header(tag, payload.len());
        let result = {
            let mut s = lock(&writer.stream);
            if payload.len() <= 16 << 10 {
                let mut b = Vec::with_capacity(header.len() + payload.len());
                b.extend_from_slice(&header);
                b.extend_from_slice(payload);
                s.write_all(&b)
            } else {
                s.write_all(&header).and_then(|()| s.write_all(payload))
            }
        };
        writer.last_sent_ms.store(self.now_ms(), Ordering::Relaxed);
        result.map_err(|e| {
            let detail = match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
                    "it stopped reading for {:?} (hung, stopped or unreachable)",
                    self.options.peer_timeout
                ),
                _ => format!("sending to it failed ({e}): the process exited or was killed"),
            };
            self.fail(Broken {
                lost: Some(peer),
                detail,
            })
        })
    }

    /// Puts a frame in a free slot of `ch`, waiting for the peer to free one.
    #[cfg(target_os = "linux")]
    fn send_shm(&self, peer: usize, ch: &Channel, tag: Tag, payload: &[u8]) -> Result<()> {
        let deadline = Instant::now() + self.options.timeout;
        loop {
            // Read before trying, so that a slot freed after the try ends the wait.
            let bell = ch.consumed().load(Ordering::Acquire);
            {
                let st = lock(&self.state);
                if let Some(b) = &st.broken {
                    return Err(b.error());
                }
                if ch.try_send(tag, payload) {
                    return Ok(());
                }
                if st.departed[peer] {
                    drop(st);
                    return Err(self.departed(peer, tag.seq));
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timed_out(peer, tag.seq));
            }
            futex_wait(ch.consumed(), bell, (deadline - now).min(WAIT_SLICE));
        }
    }

    fn departed(&self, peer: usize, seq: u64) -> Error {
        self.fail(Broken {
            lost: Some(peer),
            detail: format!("it shut down its process group before finishing collective #{seq}"),
        })
    }

    fn timed_out(&self, peer: usize, seq: u64) -> Error {
        let waited = self.options.timeout;
        self.fail(Broken {
            lost: None,
            detail: format!(
                "rank {} timed out after {waited:?} waiting for rank {peer} in collective #{seq}",
                self.rank
            ),
        });
        Error::Timeout {
            what: format!("waiting for rank {peer} in collective #{seq}"),
            waited,
        }
    }

    /// Waits for the frame `tag` from `peer`, on its socket or in its shared-memory channel,
    /// and runs `f` on its bytes where they lie.
    fn recv_with<R>(&self, peer: usize, tag: Tag, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        let deadline = Instant::now() + self.options.timeout;
        #[cfg(target_os = "linux")]
        let shm = self.shm[peer].as_ref().map(|l| &l.recv);
        loop {
            // Read before looking, so that a frame arriving after the look ends the wait.
            #[cfg(target_os = "linux")]
            let bell = shm.map(|c| c.produced().load(Ordering::Acquire));
            let mut st = lock(&self.state);
            if let Some(b) = &st.broken {
                return Err(b.error());
            }
            if let Some(i) = st.inbox[peer].iter().position(|fr| fr.tag == tag) {
                let payload = st.inbox[peer].remove(i).expect("found").payload;
                drop(st);
                let out = f(&payload);
                self.recycle(payload);
                return Ok(out);
            }
            #[cfg(target_os = "linux")]
            if let Some(c) = shm {
                if let Some(i) = c.find(tag) {
                    drop(st);
                    let out = f(c.bytes(i));
                    c.release(i);
                    return Ok(out);
                }
            }
            // Frames of one link arrive in collective order: one from an earlier collective
            // was never consumed, so the ranks disagree on what they are doing.
            let stale = st.inbox[peer]
                .iter()
                .find(|fr| fr.tag.seq < tag.seq)
                .map(|fr| fr.tag);
            #[cfg(target_os = "linux")]
            let stale = stale.or_else(|| shm.and_then(|c| c.stale(tag.seq)));
            if let Some(stale) = stale {
                drop(st);
                return Err(self.fail(Broken {
                    lost: None,
                    detail: format!(
                        "protocol error: rank {} waits for {tag:?} from rank {peer} but has an \
                         unconsumed {stale:?}",
                        self.rank
                    ),
                }));
            }
            if st.departed[peer] {
                drop(st);
                return Err(self.departed(peer, tag.seq));
            }
            let now = Instant::now();
            if now >= deadline {
                drop(st);
                return Err(self.timed_out(peer, tag.seq));
            }
            #[cfg(target_os = "linux")]
            if let (Some(c), Some(bell)) = (shm, bell) {
                drop(st);
                futex_wait(c.produced(), bell, (deadline - now).min(WAIT_SLICE));
                continue;
            }
            drop(
                self.changed
                    .wait_timeout(st, deadline - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0,
            );
        }
    }

    fn recycle(&self, buf: Vec<u8>) {
        let mut st = lock(&self.state);
        if st.pool.len() < 32 {
            st.pool.push(buf);
        }
    }
}

impl Links for Mesh {
    fn rank(&self) -> usize {
        self.inner.rank
    }
    fn world(&self) -> usize {
        self.inner.world
    }
    fn send(&self, peer: usize, tag: Tag, payload: &[u8]) -> Result<()> {
        self.inner.send(peer, tag, payload)
    }
    fn recv_with<R>(&self, peer: usize, tag: Tag, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        self.inner.recv_with(peer, tag, f)
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        lock(&self.inner.state).closing = true;
        *lock(&self.inner.stop.0) = true;
        self.inner.stop.1.notify_all();
        let bye = encode_header(Tag::control(FrameKind::Bye), 0);
        for w in self.inner.writers.iter().flatten() {
            if let Ok(mut s) = w.stream.try_lock() {
                let _ = s.write_all(&bye);
            }
        }
        for s in self.inner.sockets.iter().flatten() {
            s.shutdown();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::algorithms::data;
    use std::net::{TcpListener, TcpStream};

    /// A two-rank mesh over loopback.
    fn pair(options: MeshOptions) -> (Mesh, Mesh) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (
            Mesh::new(0, 2, vec![None, Some(Conn::Tcp(a))], no_shm(), options).unwrap(),
            Mesh::new(1, 2, vec![Some(Conn::Tcp(b)), None], no_shm(), options).unwrap(),
        )
    }

    fn no_shm() -> Vec<Option<ShmLink>> {
        vec![None, None]
    }

    fn options(timeout_ms: u64, peer_ms: u64) -> MeshOptions {
        MeshOptions {
            timeout: Duration::from_millis(timeout_ms),
            peer_timeout: Duration::from_millis(peer_ms),
        }
    }

    #[test]
    fn frames_arrive_in_order_and_heartbeats_keep_idle_peers_alive() {
        let (a, b) = pair(options(5_000, 300));
        std::thread::sleep(Duration::from_millis(800)); // idle for over two peer timeouts
        a.send(1, data(1, 0), b"one").unwrap();
        a.send(1, data(1, 1), &vec![7u8; 100_000]).unwrap();
        // Tags pick frames regardless of arrival order.
        assert_eq!(b.recv(0, data(1, 1)).unwrap().len(), 100_000);
        assert_eq!(b.recv(0, data(1, 0)).unwrap(), b"one");
        assert!(a.usable().is_ok() && b.usable().is_ok());
    }

    #[test]
    fn a_peer_that_goes_away_is_lost_and_named() {
        let (a, b) = pair(options(10_000, 10_000));
        drop(b);
        let started = Instant::now();
        let err = a.recv(1, data(1, 0)).unwrap_err();
        assert!(matches!(err, Error::PeerLost { rank: 1, .. }), "{err}");
        assert!(started.elapsed() < Duration::from_secs(2));
        // Broken for good.
        assert!(matches!(a.usable(), Err(Error::PeerLost { rank: 1, .. })));
    }

    #[test]
    fn a_wait_for_a_live_but_idle_peer_times_out_and_aborts_it_too() {
        let (a, b) = pair(options(200, 10_000));
        let err = a.recv(1, data(4, 0)).unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        // The peer learns of it through the abort frame.
        let started = Instant::now();
        while b.usable().is_ok() && started.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let err = b.usable().unwrap_err();
        assert!(err.to_string().contains("reported by rank 0"), "{err}");
    }
}
