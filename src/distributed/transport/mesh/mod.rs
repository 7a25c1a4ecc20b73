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
//! Each peer is reached through one channel ([`peer`]): its socket ([`socket`]: framed I/O),
//! and with a ring neighbour on this machine also shared memory ([`shm_link`], waited on
//! through [`doorbell`]), which carries its data frames; [`transfer`] sends and receives a
//! frame through whichever carries it, and the algorithms see one [`Links`] interface either
//! way. What the handle, the threads and the collectives share is [`state`]'s. Why the mesh
//! broke is [`broken`]'s; how it breaks is [`failure`]'s, which reports it to the [`OnLost`]
//! callback it was given ([`options`]); the threads that watch the peers are [`watch`]'s. This
//! file is the handle, [`Mesh`]: connecting, closing, and the `Links` it offers.

mod broken;
mod doorbell;
mod failure;
mod options;
mod peer;
mod shm_link;
mod socket;
mod state;
mod transfer;
mod watch;

pub(crate) use broken::Broken;
pub(crate) use options::{MeshOptions, OnLost};
pub(crate) use shm_link::ShmLink;

use super::conn::Conn;
use super::links::Links;
use super::wire::{self, encode_header, FrameKind, Tag};
use crate::error::{Error, Result};
use crate::util::sync::lock;
use peer::{Peer, PeerWriter};
use state::{MeshState, State};
use std::collections::VecDeque;
use std::io::Write;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The connected ranks of one process group.
pub(crate) struct Mesh {
    shared: Arc<MeshState>,
    threads: Vec<JoinHandle<()>>,
}

impl Mesh {
    /// Takes over `streams[p]`, a handshaken connection to every peer `p` (`None` for this
    /// rank), and `shm[p]`, shared-memory data channels to some of them. The mesh reports its
    /// breaking to `on_lost`.
    pub fn new(
        rank: usize,
        world: usize,
        streams: Vec<Option<Conn>>,
        shm: Vec<Option<ShmLink>>,
        options: MeshOptions,
        on_lost: OnLost,
    ) -> Result<Self> {
        let mut peers = Vec::with_capacity(world);
        let mut readers = Vec::new();
        for (peer, (stream, shm)) in streams.into_iter().zip(shm).enumerate() {
            let Some(stream) = stream else {
                peers.push(None);
                continue;
            };
            let ctx = || format!("setting up the connection to rank {peer}");
            stream.tune().map_err(wire::io_err(ctx()))?;
            stream.set_read_timeout(None).map_err(wire::io_err(ctx()))?;
            stream
                .set_write_timeout(Some(options.peer_timeout))
                .map_err(wire::io_err(ctx()))?;
            readers.push((peer, stream.try_clone().map_err(wire::io_err(ctx()))?));
            peers.push(Some(Peer {
                kind: if shm.is_some() { "shm" } else { stream.kind() },
                socket: stream.try_clone().map_err(wire::io_err(ctx()))?,
                writer: PeerWriter {
                    stream: Mutex::new(stream),
                    last_sent_ms: AtomicU64::new(0),
                },
                shm,
            }));
        }
        let now = Instant::now();
        let shared = Arc::new(MeshState {
            rank,
            world,
            peers,
            options,
            on_lost,
            epoch: now,
            state: Mutex::new(State {
                inbox: (0..world).map(|_| VecDeque::new()).collect(),
                last_seen: vec![now; world],
                departed: vec![false; world],
                broken: None,
                closing: false,
                leaving: false,
                pool: Vec::new(),
            }),
            changed: Condvar::new(),
            stop: (Mutex::new(false), Condvar::new()),
            last_ran_ms: AtomicU64::new(0),
        });
        let mut threads = Vec::new();
        for (peer, stream) in readers {
            let shared = shared.clone();
            threads.push(start_thread(format!("recv-{peer}"), move || {
                shared.receive(peer, stream)
            })?);
        }
        if world > 1 {
            let hb = shared.clone();
            threads.push(start_thread("heartbeat".into(), move || hb.heartbeat())?);
        }
        Ok(Self { shared, threads })
    }

    /// How each peer is reached ("tcp", "unix", "shm"; `None` for this rank).
    pub fn transports(&self) -> Vec<Option<&'static str>> {
        self.shared
            .peers
            .iter()
            .map(|p| p.as_ref().map(|p| p.kind))
            .collect()
    }

    /// Fails when the mesh is broken.
    #[cfg_attr(not(any(test, feature = "nccl")), allow(dead_code))]
    pub fn usable(&self) -> Result<()> {
        match &lock(&self.shared.state).broken {
            Some(b) => Err(b.error()),
            None => Ok(()),
        }
    }

    /// Breaks the mesh for `reason` (unless already broken), tells every peer, and returns the
    /// error that now describes the mesh.
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub fn fail(&self, reason: Broken) -> Error {
        self.shared.fail(reason)
    }
}

fn start_thread(name: String, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name)
        .spawn(f)
        .map_err(wire::io_err("starting a communication thread"))
}

impl Links for Mesh {
    fn rank(&self) -> usize {
        self.shared.rank
    }
    fn world(&self) -> usize {
        self.shared.world
    }
    fn send(&self, peer: usize, tag: Tag, payload: &[u8]) -> Result<()> {
        self.shared.send(peer, tag, payload)
    }
    fn recv_with<R>(&self, peer: usize, tag: Tag, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        self.shared.recv_with(peer, tag, f)
    }
}

/// How long a closing mesh waits for its peers' goodbyes.
const GOODBYE_WAIT: Duration = Duration::from_secs(2);

impl Drop for Mesh {
    /// Says goodbye to every peer and, unless the mesh is broken, waits (briefly) for theirs:
    /// the ranks of a group leave it together, so that none starts its next group (on the same
    /// master port, say) while another still serves this one.
    fn drop(&mut self) {
        lock(&self.shared.state).leaving = true;
        let bye = encode_header(Tag::control(FrameKind::Bye), 0);
        for w in self.shared.writers() {
            if let Ok(mut s) = w.stream.try_lock() {
                let _ = s.write_all(&bye);
            }
        }
        let deadline = Instant::now() + GOODBYE_WAIT.min(self.shared.options.peer_timeout);
        let mut st = lock(&self.shared.state);
        loop {
            let everyone_left =
                (0..self.shared.world).all(|p| p == self.shared.rank || st.departed[p]);
            let now = Instant::now();
            if st.broken.is_some() || everyone_left || now >= deadline {
                break;
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        st.closing = true;
        drop(st);
        *lock(&self.shared.stop.0) = true;
        self.shared.stop.1.notify_all();
        for p in self.shared.peers.iter().flatten() {
            p.socket.shutdown();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::transport::wire::data;
    use std::net::{TcpListener, TcpStream};

    /// A two-rank mesh over loopback.
    fn pair(options: MeshOptions) -> (Mesh, Mesh) {
        pair_telling(options, ignore())
    }

    /// A pair whose rank 0 tells `on_lost` when it breaks.
    fn pair_telling(options: MeshOptions, on_lost: OnLost) -> (Mesh, Mesh) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (
            Mesh::new(
                0,
                2,
                vec![None, Some(Conn::Tcp(a))],
                no_shm(),
                options,
                on_lost,
            )
            .unwrap(),
            Mesh::new(
                1,
                2,
                vec![Some(Conn::Tcp(b)), None],
                no_shm(),
                options,
                ignore(),
            )
            .unwrap(),
        )
    }

    fn ignore() -> OnLost {
        Arc::new(|_, _| {})
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
    fn a_loss_is_reported_before_any_collective_fails_on_it() {
        // A rank exits as soon as its collective fails: the report (the launcher's error
        // file) must be done by then, however slow.
        let told = Arc::new(std::sync::Mutex::new(None));
        let on_lost: OnLost = {
            let told = told.clone();
            Arc::new(move |rank, detail: &str| {
                std::thread::sleep(Duration::from_millis(300));
                *told.lock().unwrap() = Some((rank, detail.to_string()));
            })
        };
        let (a, b) = pair_telling(options(10_000, 10_000), on_lost);
        drop(b);
        let err = a.recv(1, data(1, 0)).unwrap_err();
        let seen = told.lock().unwrap().clone();
        let (rank, detail) = seen.unwrap_or_else(|| panic!("failed before the report: {err}"));
        assert_eq!(rank, Some(1));
        assert!(err.to_string().contains(&detail), "{err} / {detail}");
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
