//! The store's server: a thread accepting connections and one thread per client.

use super::protocol::{
    ADD, BUSY, COMPARE_SET, DELETE, GET, HELLO_TIMEOUT, MAX_KEY, MAX_KEYS, MAX_VALUE, OK,
    REFUSED_KEY, SET, SHUTTING_DOWN, TIMED_OUT, WAIT,
};
use crate::distributed::transport::wire::{
    self, io_err, put_bytes, read_bytes, read_len, read_string, Deadline, HandshakeSlot,
    HandshakeSlots, Hello, Purpose,
};
use crate::error::{Error, Result};
use crate::util::sync::lock;
use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Default)]
struct Data {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

/// The store's server: a thread accepting connections and one thread per client.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    /// Set when the job is ending: new connections are refused, to be retried (by the next job
    /// on this port, whose server is not up yet).
    closing: Arc<AtomicBool>,
    clients: Clients,
    accept: Option<JoinHandle<()>>,
}

/// Open client connections by id, so that stopping the server can close them.
type Clients = Arc<Mutex<HashMap<u64, TcpStream>>>;

impl StoreServer {
    /// Listens on `addr` (port 0 picks a free port). Only clients presenting `token` are served.
    pub fn bind(addr: SocketAddr, token: &str) -> Result<Self> {
        let listener = TcpListener::bind(addr).map_err(|source| {
            if source.kind() == std::io::ErrorKind::AddrInUse {
                Error::PortInUse {
                    addr: addr.to_string(),
                }
            } else {
                Error::Io {
                    context: format!("listening on {addr} for the store"),
                    source,
                }
            }
        })?;
        let addr = listener.local_addr().map_err(io_err("store address"))?;
        listener
            .set_nonblocking(true)
            .map_err(io_err("store listener"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let closing = Arc::new(AtomicBool::new(false));
        let clients = Clients::default();
        let shared = Arc::new(Shared {
            data: Data::default(),
            token: token.to_string(),
            closing: closing.clone(),
            handshakes: Arc::new(HandshakeSlots::default()),
        });
        let accept = {
            let (stop, clients) = (stop.clone(), clients.clone());
            std::thread::Builder::new()
                .name("store-accept".into())
                .spawn(move || accept_loop(listener, shared, stop, clients))
                .map_err(io_err("starting the store thread"))?
        };
        Ok(Self {
            addr,
            stop,
            closing,
            clients,
            accept: Some(accept),
        })
    }

    /// The address the store listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// From now on, refuses new connections as "shutting down" (clients retry): the job is
    /// ending, and a client connecting now belongs to the next job on this port. Connections
    /// already made are served to the end.
    pub fn begin_closing(&self) {
        self.closing.store(true, Ordering::SeqCst);
    }
}

/// What the server's threads share.
struct Shared {
    data: Data,
    token: String,
    closing: Arc<AtomicBool>,
    handshakes: Arc<HandshakeSlots>,
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for (_, c) in lock(&self.clients).drain() {
            let _ = c.shutdown(Shutdown::Both);
        }
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    clients: Clients,
) {
    let mut next_id = 0u64;
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                // Strangers that never finish their hello hold at most this many places.
                let Some(slot) = shared.handshakes.take() else {
                    turn_away(&stream);
                    continue;
                };
                let Ok(clone) = stream.try_clone() else {
                    continue;
                };
                next_id += 1;
                let id = next_id;
                lock(&clients).insert(id, clone);
                let (shared, clients) = (shared.clone(), clients.clone());
                let _ = std::thread::Builder::new()
                    .name("store-client".into())
                    .spawn(move || {
                        serve(stream, &shared, slot);
                        lock(&clients).remove(&id);
                    });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Tells a connection that the store is busy (it retries), without waiting on it: this runs on
/// the accepting thread. Its hello, when already here, is read first, so that closing does not
/// reset the connection and lose the answer.
fn turn_away(stream: &TcpStream) {
    if stream.set_nonblocking(true).is_err() {
        return;
    }
    let mut buf = [0u8; 4096];
    let _ = (&*stream).read(&mut buf);
    let _ = wire::write_reply(&mut &*stream, Some(BUSY));
    let _ = stream.shutdown(Shutdown::Write);
}

/// Serves one client until it disconnects. Strangers are refused and dropped. When a client
/// that claimed ranks disconnects, `gone/<rank>` records it, for ranks still waiting on them.
fn serve(stream: TcpStream, shared: &Shared, slot: HandshakeSlot) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let Ok(write_half) = stream.try_clone() else {
        return;
    };
    let mut w = BufWriter::new(write_half);
    // One deadline for the whole hello.
    let hello = match Hello::read(&mut Deadline::new(&stream, HELLO_TIMEOUT)) {
        Ok(h) => h,
        Err(e) => {
            let _ = wire::write_reply(&mut w, Some(&e.to_string()));
            return;
        }
    };
    let refusal = if hello.purpose != Purpose::Store {
        Some("this is the store, not a peer".to_string())
    } else if !wire::token_matches(&shared.token, &hello.token) {
        Some("wrong job token (CANDLE_PARALLEL_TOKEN differs)".to_string())
    } else if shared.closing.load(Ordering::SeqCst) {
        Some(SHUTTING_DOWN.to_string())
    } else {
        None
    };
    if let Some(why) = &refusal {
        if why.starts_with("wrong job token") {
            // Bounded: one note, the last; waiting ranks mention it.
            let note = format!(
                "refused a connection as rank {} from {}: {why}",
                hello.from_rank,
                stream
                    .peer_addr()
                    .map_or_else(|_| "?".into(), |a| a.to_string())
            );
            lock(&shared.data.map).insert(REFUSED_KEY.into(), note.into_bytes());
        }
    }
    if wire::write_reply(&mut w, refusal.as_deref()).is_err() || refusal.is_some() {
        return;
    }
    drop(slot);
    let _ = stream.set_read_timeout(None);
    let mut r = BufReader::new(stream);
    let mut claimed = Vec::new();
    while let Ok(()) = handle(&mut r, &mut w, &shared.data, &mut claimed) {}
    if !shared.closing.load(Ordering::SeqCst) && !claimed.is_empty() {
        let mut map = lock(&shared.data.map);
        for rank in claimed {
            map.insert(
                format!("gone/{rank}"),
                b"its connection to the store closed: the process exited or was killed".to_vec(),
            );
        }
        drop(map);
        shared.data.changed.notify_all();
    }
}

/// Serves one request. A won claim of `rank/<n>` is added to `claimed`.
fn handle(
    r: &mut impl Read,
    w: &mut impl Write,
    data: &Data,
    claimed: &mut Vec<usize>,
) -> std::io::Result<()> {
    let op = wire::read_u8(r)?;
    let mut out = Vec::new();
    match op {
        SET => {
            let key = read_string(r, MAX_KEY, "key")?;
            let value = read_bytes(r, MAX_VALUE, "value")?;
            lock(&data.map).insert(key, value);
            data.changed.notify_all();
            out.push(OK);
        }
        GET => {
            let key = read_string(r, MAX_KEY, "key")?;
            let timeout = Duration::from_millis(wire::read_u64(r)?);
            let map = wait_for(data, std::slice::from_ref(&key), timeout);
            match map.get(&key) {
                Some(v) => {
                    out.push(OK);
                    put_bytes(&mut out, v);
                }
                None => out.push(TIMED_OUT),
            }
        }
        ADD => {
            let key = read_string(r, MAX_KEY, "key")?;
            let delta = wire::read_u64(r)? as i64;
            let mut map = lock(&data.map);
            let current = map.get(&key).map_or(0, |v| counter(v));
            let new = current.wrapping_add(delta);
            map.insert(key, new.to_le_bytes().to_vec());
            drop(map);
            data.changed.notify_all();
            out.push(OK);
            out.extend_from_slice(&new.to_le_bytes());
        }
        WAIT => {
            let n = read_len(r, MAX_KEYS, "key list")?;
            let keys = (0..n)
                .map(|_| read_string(r, MAX_KEY, "key"))
                .collect::<std::io::Result<Vec<_>>>()?;
            let timeout = Duration::from_millis(wire::read_u64(r)?);
            let map = wait_for(data, &keys, timeout);
            let missing: Vec<&String> = keys.iter().filter(|k| !map.contains_key(*k)).collect();
            out.push(OK);
            out.extend_from_slice(&(missing.len() as u32).to_le_bytes());
            for k in missing {
                put_bytes(&mut out, k.as_bytes());
            }
        }
        COMPARE_SET => {
            let key = read_string(r, MAX_KEY, "key")?;
            let expected = read_optional(r)?;
            let desired = read_bytes(r, MAX_VALUE, "value")?;
            let mut map = lock(&data.map);
            if map.get(&key) == expected.as_ref() {
                if let Some(rank) = key.strip_prefix("rank/").and_then(|r| r.parse().ok()) {
                    claimed.push(rank);
                }
                map.insert(key.clone(), desired);
                data.changed.notify_all();
            }
            out.push(OK);
            put_bytes(&mut out, map.get(&key).map_or(&[][..], |v| v));
        }
        DELETE => {
            let key = read_string(r, MAX_KEY, "key")?;
            let existed = lock(&data.map).remove(&key).is_some();
            out.push(OK);
            out.push(u8::from(existed));
        }
        other => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("unknown store request {other}"),
            ))
        }
    }
    w.write_all(&out)?;
    w.flush()
}

fn read_optional(r: &mut impl Read) -> std::io::Result<Option<Vec<u8>>> {
    Ok(match wire::read_u8(r)? {
        0 => None,
        _ => Some(read_bytes(r, MAX_VALUE, "value")?),
    })
}

fn counter(v: &[u8]) -> i64 {
    v.try_into().map(i64::from_le_bytes).unwrap_or(0)
}

/// Waits until every key exists or `timeout` passes; returns the map locked.
fn wait_for<'a>(
    data: &'a Data,
    keys: &[String],
    timeout: Duration,
) -> std::sync::MutexGuard<'a, HashMap<String, Vec<u8>>> {
    let deadline = Instant::now() + timeout;
    let mut map = lock(&data.map);
    loop {
        if keys.iter().all(|k| map.contains_key(k)) {
            return map;
        }
        let now = Instant::now();
        if now >= deadline {
            return map;
        }
        map = data
            .changed
            .wait_timeout(map, deadline - now)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}
