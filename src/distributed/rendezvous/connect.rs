//! Forming the mesh: every rank listens, publishes its address in the store, connects to the
//! ranks below it and accepts the ranks above it. Each connection is checked (token, job,
//! ranks, world size) before it joins; a stranger is refused and the wait goes on.

use super::store::{ranks_named, Store};
use crate::distributed::config::RENDEZVOUS_TIMEOUT_VAR;
use crate::distributed::transport::conn::{Conn, Listeners, PeerAddress};
use crate::distributed::transport::mesh::{Mesh, MeshOptions, OnLost, ShmLink};
use crate::distributed::transport::wire::{
    self, io_err, Deadline, Hello, NoAnswer, Purpose, MAX_HANDSHAKES,
};
use crate::error::{Error, Result};
use crate::util::sync::lock;
use std::collections::BTreeSet;
use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a connecting peer may take to say hello or answer one.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often a rank forming its mesh checks that the ranks it waits for are still there.
const WATCH_EVERY: Duration = Duration::from_millis(100);

/// Who this rank is, for forming its mesh.
pub(crate) struct Identity<'a> {
    pub rank: usize,
    pub world: usize,
    pub token: &'a str,
    pub job: u64,
    /// Whether peers on this machine may be reached over Unix-domain sockets.
    pub unix: bool,
    /// Whether ring neighbours on this machine may exchange data through shared memory.
    pub shm: bool,
    /// The group's prefix for its keys in the store ("" for the world).
    pub prefix: &'a str,
}

/// Connects this rank to every other rank of the job.
pub(crate) fn connect_mesh(
    store: &Store,
    local_ip: IpAddr,
    me: &Identity<'_>,
    rendezvous_timeout: Duration,
    options: MeshOptions,
    on_lost: OnLost,
) -> Result<Mesh> {
    let (rank, world) = (me.rank, me.world);
    if world == 1 {
        return Mesh::new(0, 1, vec![None], vec![None], options, on_lost);
    }
    let listeners = Listeners::bind(local_ip, me.job, rank, me.unix)
        .map_err(io_err(format!("listening on {local_ip} for peers")))?;
    let addr = listeners.address().map_err(io_err("peer listener"))?;
    let key = |r: usize| format!("{}addr/{r}", me.prefix);
    store.set(&key(rank), addr.as_bytes())?;
    let keys: Vec<(usize, String)> = (0..world).map(|r| (r, key(r))).collect();
    // Until the world's mesh forms, any other rank leaving means it cannot form. (The store's
    // `gone/<rank>` keys name world ranks: a later group's wait watches as before.)
    let others: Vec<usize> = (0..world).filter(|&r| r != rank).collect();
    let watched = me.prefix.is_empty().then_some(others.as_slice());
    let missing = store.wait_for_ranks(&keys, rank, rendezvous_timeout, watched)?;
    if !missing.is_empty() {
        return Err(Error::Rendezvous {
            detail: format!(
                "{} of {world} ranks joined within {} s; {} never came{}. Check that every rank \
                 was started with this MASTER_ADDR, MASTER_PORT and WORLD_SIZE; if they are only \
                 slow to start, raise {RENDEZVOUS_TIMEOUT_VAR} (InitConfig::rendezvous_timeout)",
                world - missing.len(),
                rendezvous_timeout.as_secs(),
                ranks_named(&missing),
                store.refusal_note()
            ),
        });
    }
    // Whether the world can still form: not when it was aborted, or when a rank this one still
    // waits for left.
    let watch = |waiting: &[usize]| -> Result<()> {
        if me.prefix.is_empty() {
            store.check_not_aborted(waiting)
        } else {
            Ok(())
        }
    };
    let deadline = Instant::now() + rendezvous_timeout;
    let stop = Arc::new(AtomicBool::new(false));
    let waiting_above = Arc::new(Mutex::new((rank + 1..world).collect::<BTreeSet<usize>>()));
    let (done, finished) = mpsc::channel::<()>();
    let acceptor = {
        let (stop, token) = (stop.clone(), me.token.to_string());
        let (job, unix, shm, rdz) = (me.job, me.unix, me.shm, rendezvous_timeout);
        let (prefix, waiting) = (me.prefix.to_string(), waiting_above.clone());
        std::thread::Builder::new()
            .name("accept-peers".into())
            .spawn(move || {
                let me = Identity {
                    rank,
                    world,
                    token: &token,
                    job,
                    unix,
                    shm,
                    prefix: &prefix,
                };
                let accepted = accept_peers(listeners, &me, deadline, rdz, &stop, &waiting);
                // Dropped on a panic too: either way, the wait for the acceptor ends.
                let _ = done.send(());
                accepted
            })
            .map_err(io_err("starting the peer acceptor"))?
    };
    let mut streams: Vec<Option<Conn>> = (0..world).map(|_| None).collect();
    let connected: Result<()> = (0..rank)
        .try_for_each(|peer| {
            let value = store.get(&key(peer), rendezvous_timeout)?;
            let text = String::from_utf8_lossy(&value);
            let addr = PeerAddress::parse(&text).ok_or_else(|| Error::Rendezvous {
                detail: format!("rank {peer} published an invalid address {text:?}"),
            })?;
            streams[peer] = Some(connect_peer(peer, &addr, me, deadline, &|| watch(&[peer]))?);
            Ok(())
        })
        .and_then(|()| {
            // The ranks above connect to this one: while they have not all, check that they
            // still can.
            while let Err(mpsc::RecvTimeoutError::Timeout) = finished.recv_timeout(WATCH_EVERY) {
                let waiting: Vec<usize> = lock(&waiting_above).iter().copied().collect();
                watch(&waiting)?;
            }
            Ok(())
        });
    if connected.is_err() {
        stop.store(true, Ordering::SeqCst);
    }
    let accepted = acceptor.join().map_err(|_| Error::Rendezvous {
        detail: "the peer acceptor thread panicked".into(),
    })?;
    connected?;
    for (peer, stream) in accepted? {
        streams[peer] = Some(stream);
    }
    let shm = share_memory(me, &streams);
    Mesh::new(rank, world, streams, shm, options, on_lost)
}

/// Sets up shared-memory data channels with the ring neighbours reached over Unix sockets
/// (ranks of this machine). Per pair, the lower rank sends one byte, with a region's descriptor
/// when it offers one; the higher rank answers an offer (accept or decline), and the lower rank
/// reads that answer. Offers never wait, so no rank waits in a cycle; every byte sent is read,
/// so the socket is clean for the mesh. Anything that fails leaves that pair on its socket.
#[cfg(target_os = "linux")]
fn share_memory(me: &Identity<'_>, streams: &[Option<Conn>]) -> Vec<Option<ShmLink>> {
    use crate::distributed::algorithms::SEGMENT_BYTES;
    use crate::distributed::transport::shm::{recv_fd, send_fd, Region};
    use std::io::{Read, Write};
    let (n, r) = (me.world, me.rank);
    let mut links: Vec<Option<ShmLink>> = (0..n).map(|_| None).collect();
    let neighbours: BTreeSet<usize> = [(r + 1) % n, (r + n - 1) % n]
        .into_iter()
        .filter(|&p| p != r)
        .collect();
    let unix = |p: usize| match &streams[p] {
        Some(Conn::Unix(s)) => {
            let _ = s.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
            Some(s)
        }
        _ => None,
    };
    let mut offered = Vec::new();
    for &p in neighbours.iter().filter(|&&p| p > r) {
        let Some(s) = unix(p) else { continue };
        let region = me.shm.then(|| Region::create(SEGMENT_BYTES).ok()).flatten();
        match region {
            Some(region) if send_fd(s, region.fd()).is_ok() => offered.push((p, s, region)),
            _ => {
                let _ = (&*s).write_all(&[0]);
            }
        }
    }
    for &p in neighbours.iter().filter(|&&p| p < r) {
        let Some(s) = unix(p) else { continue };
        // Only an offer (a byte with a descriptor) gets an answer.
        let Ok((_, Some(fd))) = recv_fd(s) else {
            continue;
        };
        let opened = me
            .shm
            .then(|| Region::open(fd, SEGMENT_BYTES).ok())
            .flatten();
        if (&*s).write_all(&[u8::from(opened.is_some())]).is_err() {
            continue;
        }
        if let Some(region) = opened {
            links[p] = Some(ShmLink {
                send: region.channel(1, SEGMENT_BYTES),
                recv: region.channel(0, SEGMENT_BYTES),
                _region: region,
            });
        }
    }
    for (p, s, region) in offered {
        let mut answer = [0u8];
        if matches!((&*s).read_exact(&mut answer), Ok(()) if answer[0] == 1) {
            links[p] = Some(ShmLink {
                send: region.channel(0, SEGMENT_BYTES),
                recv: region.channel(1, SEGMENT_BYTES),
                _region: region,
            });
        }
    }
    links
}

#[cfg(not(target_os = "linux"))]
fn share_memory(me: &Identity<'_>, _: &[Option<Conn>]) -> Vec<Option<ShmLink>> {
    (0..me.world).map(|_| None).collect()
}

/// Connects to `peer` and shakes hands. A peer that cannot be reached yet, or whose listener
/// closes the connection during the handshake (it may be dropping strangers that hold its
/// places), is tried again until `deadline`, as long as `watch` says the job can still form.
fn connect_peer(
    peer: usize,
    addr: &PeerAddress,
    me: &Identity<'_>,
    deadline: Instant,
    watch: &dyn Fn() -> Result<()>,
) -> Result<Conn> {
    let at = format!("rank {peer} at {}", addr.tcp);
    loop {
        let why = match handshake(peer, addr, me, deadline) {
            Ok(Ok(stream)) => return Ok(stream),
            Ok(Err(why)) => why,
            Err(fatal) => return Err(fatal),
        };
        if Instant::now() >= deadline {
            return Err(Error::Rendezvous {
                detail: format!(
                    "cannot connect to {at} (tried until the rendezvous timeout): {why}"
                ),
            });
        }
        watch()?;
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One attempt at connecting to `peer`: the connection, or why it is worth another try (in
/// `Ok(Err(..))`), or an error that trying again cannot help.
fn handshake(
    peer: usize,
    addr: &PeerAddress,
    me: &Identity<'_>,
    deadline: Instant,
) -> Result<std::result::Result<Conn, String>> {
    let within = deadline
        .saturating_duration_since(Instant::now())
        .clamp(Duration::from_millis(100), HANDSHAKE_TIMEOUT);
    let stream = match addr.connect(me.unix, within) {
        Ok(s) => s,
        Err(e) => return Ok(Err(e.to_string())),
    };
    let ctx = format!("handshake with rank {peer} at {}", addr.tcp);
    stream
        .set_read_timeout(Some(within))
        .map_err(io_err(ctx.clone()))?;
    let hello = Hello {
        purpose: Purpose::Peer,
        token: me.token.to_string(),
        job: me.job,
        from_rank: me.rank as u32,
        to_rank: peer as u32,
        world_size: me.world as u32,
    };
    let mut s = &stream;
    if let Err(e) = std::io::Write::write_all(&mut s, &hello.encode()) {
        return Ok(Err(format!(
            "the connection closed during the handshake ({e})"
        )));
    }
    match wire::read_reply(&mut s) {
        Ok(None) => Ok(Ok(stream)),
        Ok(Some(reason)) => Err(Error::Refused {
            peer: format!("rank {peer} at {}", addr.tcp),
            reason,
        }),
        Err(no @ NoAnswer::Closed(_)) => Ok(Err(no.to_string())),
        Err(no) => Err(Error::Rendezvous {
            detail: format!("{ctx}: {no}"),
        }),
    }
}

/// What strangers did to a rank's peer listeners while it waited, for its messages.
#[derive(Default)]
struct Strangers {
    refused: usize,
    last_refusal: Option<String>,
    /// Connections closed in their hello to make room for newer ones.
    dropped: usize,
}

impl Strangers {
    /// "; meanwhile rank r refused ..." when strangers came, else "".
    fn note(&self, rank: usize) -> String {
        let mut parts = Vec::new();
        if let Some(last) = &self.last_refusal {
            parts.push(format!(
                "refused {} connection(s) (the last: {last})",
                self.refused
            ));
        }
        if self.dropped > 0 {
            parts.push(format!(
                "closed {} that held a handshake place without finishing their hello",
                self.dropped
            ));
        }
        if parts.is_empty() {
            String::new()
        } else {
            format!("; meanwhile rank {rank} {}", parts.join(" and "))
        }
    }
}

/// Accepts the ranks above this one (`waiting`, emptied as they connect); refuses anything
/// else and keeps waiting.
fn accept_peers(
    listeners: Listeners,
    me: &Identity<'_>,
    deadline: Instant,
    waited: Duration,
    stop: &AtomicBool,
    waiting: &Mutex<BTreeSet<usize>>,
) -> Result<Vec<(usize, Conn)>> {
    let mut accepted = Vec::new();
    let (tx, rx) = mpsc::channel::<(u64, std::io::Result<Hello>, Conn)>();
    // The connections in their hello, oldest first (clones, to close them). At most
    // MAX_HANDSHAKES: a newer connection takes the place of the oldest, so strangers that
    // never finish their hello cannot keep a peer out, whose hello comes at once.
    let mut in_hello: VecDeque<(u64, Conn)> = VecDeque::new();
    let mut next_id = 0u64;
    let mut strangers = Strangers::default();
    while !lock(waiting).is_empty() {
        if stop.load(Ordering::SeqCst) {
            return Ok(accepted);
        }
        for _ in 0..MAX_HANDSHAKES {
            let Some(stream) = listeners.accept() else {
                break;
            };
            let Ok(clone) = stream.try_clone() else {
                stream.shutdown();
                continue;
            };
            if in_hello.len() >= MAX_HANDSHAKES {
                if let Some((_, oldest)) = in_hello.pop_front() {
                    oldest.shutdown();
                    strangers.dropped += 1;
                }
            }
            next_id += 1;
            let (id, tx) = (next_id, tx.clone());
            in_hello.push_back((id, clone));
            // Each handshake on a thread of its own, with one deadline for the whole hello: a
            // silent stranger delays nobody.
            let spawned = std::thread::Builder::new()
                .name("handshake".into())
                .spawn(move || {
                    let _ = stream.set_nonblocking(false);
                    let hello = Hello::read(&mut Deadline::new(&stream, HANDSHAKE_TIMEOUT));
                    let _ = tx.send((id, hello, stream));
                });
            if spawned.is_err() {
                if let Some((_, c)) = in_hello.pop_back() {
                    c.shutdown();
                }
            }
        }
        while let Ok((id, hello, stream)) = rx.try_recv() {
            let Some(at) = in_hello.iter().position(|(i, _)| *i == id) else {
                // Closed to make room: counted already.
                continue;
            };
            in_hello.remove(at);
            let mut expected = lock(waiting);
            let refusal = match &hello {
                Err(e) => Some(e.to_string()),
                Ok(h) => refusal(h, me, &expected),
            };
            let _ = wire::write_reply(&mut &stream, refusal.as_deref());
            match (hello, refusal) {
                (Ok(h), None) => {
                    expected.remove(&(h.from_rank as usize));
                    let _ = stream.set_read_timeout(None);
                    accepted.push((h.from_rank as usize, stream));
                }
                (_, Some(why)) => {
                    strangers.refused += 1;
                    strangers.last_refusal = Some(why);
                }
                (Err(_), None) => {}
            }
        }
        if Instant::now() > deadline {
            let ranks: Vec<usize> = lock(waiting).iter().copied().collect();
            return Err(Error::Rendezvous {
                detail: format!(
                    "{} did not connect to rank {} within {waited:?}{}",
                    ranks_named(&ranks),
                    me.rank,
                    strangers.note(me.rank)
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(accepted)
}

/// Why a hello is refused, or `None` when it is a peer this rank expects.
fn refusal(h: &Hello, me: &Identity<'_>, expected: &BTreeSet<usize>) -> Option<String> {
    let from = h.from_rank as usize;
    if h.purpose != Purpose::Peer {
        Some("this is a peer port, not the store".into())
    } else if !wire::token_matches(me.token, &h.token) {
        Some("wrong job token (CANDLE_PARALLEL_TOKEN differs)".into())
    } else if h.job != me.job {
        Some("the connection belongs to another job".into())
    } else if h.world_size as usize != me.world {
        Some(format!(
            "world size {} but this job has {}",
            h.world_size, me.world
        ))
    } else if h.to_rank as usize != me.rank {
        Some(format!(
            "addressed to rank {} but this is rank {}",
            h.to_rank, me.rank
        ))
    } else if from <= me.rank || from >= me.world {
        Some(format!("rank {from} does not connect to rank {}", me.rank))
    } else if !expected.contains(&from) {
        Some(format!(
            "rank {from} is already connected: two processes claim rank {from}"
        ))
    } else {
        None
    }
}
