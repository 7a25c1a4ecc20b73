//! A TCP key-value store for rendezvous, hosted by rank 0 (`torch.distributed.TCPStore`).
//!
//! Ranks use it to find each other (each publishes its address), to hand out the NCCL unique id,
//! to detect two processes claiming one rank, and for barriers. Values are bytes; [`Store::add`]
//! keeps an 8-byte counter. Waits are bounded: a wait that runs out of time says which keys
//! are still missing.
//!
//! ```rust
//! use candle_parallel::dist::store::{Store, StoreServer};
//! use std::time::Duration;
//! # fn main() -> candle_parallel::Result<()> {
//! let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), "token")?;
//! let store = Store::connect(server.local_addr(), "token", 0, Duration::from_secs(5))?;
//! store.set("greeting", b"hello")?;
//! assert_eq!(store.get("greeting", Duration::from_secs(1))?, b"hello");
//! assert_eq!(store.add("joined", 1)?, 1);
//! let missing = store.wait(&["greeting", "absent"], Duration::from_millis(50))?;
//! assert_eq!(missing, ["absent"]);
//! # Ok(()) }
//! ```

use super::wire::{self, io_err, put_bytes, read_bytes, read_len, read_string, Hello, Purpose};
use crate::error::{Error, Result};
use crate::replicate::lock;
use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const MAX_KEY: usize = 4096;
const MAX_VALUE: usize = 64 << 20;
const MAX_KEYS: usize = 1 << 16;
/// How long a connecting client may take to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

const SET: u8 = 1;
const GET: u8 = 2;
const ADD: u8 = 3;
const WAIT: u8 = 4;
const COMPARE_SET: u8 = 5;
const DELETE: u8 = 6;

const OK: u8 = 0;
const TIMED_OUT: u8 = 1;

#[derive(Default)]
struct Data {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

/// The store's server: a thread accepting connections and one thread per client.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
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
        let clients = Clients::default();
        let data = Arc::new(Data::default());
        let token = token.to_string();
        let accept = {
            let (stop, clients) = (stop.clone(), clients.clone());
            std::thread::Builder::new()
                .name("store-accept".into())
                .spawn(move || accept_loop(listener, token, data, stop, clients))
                .map_err(io_err("starting the store thread"))?
        };
        Ok(Self {
            addr,
            stop,
            clients,
            accept: Some(accept),
        })
    }

    /// The address the store listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
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
    token: String,
    data: Arc<Data>,
    stop: Arc<AtomicBool>,
    clients: Clients,
) {
    let mut next_id = 0u64;
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                let Ok(clone) = stream.try_clone() else {
                    continue;
                };
                next_id += 1;
                let id = next_id;
                lock(&clients).insert(id, clone);
                let (token, data, clients) = (token.clone(), data.clone(), clients.clone());
                let _ = std::thread::Builder::new()
                    .name("store-client".into())
                    .spawn(move || {
                        serve(stream, &token, &data);
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

/// Serves one client until it disconnects. Strangers are refused and dropped.
fn serve(stream: TcpStream, token: &str, data: &Data) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(HELLO_TIMEOUT));
    let Ok(write_half) = stream.try_clone() else {
        return;
    };
    let mut r = BufReader::new(stream);
    let mut w = BufWriter::new(write_half);
    let hello = match Hello::read(&mut r) {
        Ok(h) => h,
        Err(e) => {
            let _ = wire::write_reply(&mut w, Some(&e.to_string()));
            return;
        }
    };
    let refusal = if hello.purpose != Purpose::Store {
        Some("this is the store, not a peer".to_string())
    } else if !wire::token_matches(token, &hello.token) {
        Some("wrong job token (CANDLE_PARALLEL_TOKEN differs)".to_string())
    } else {
        None
    };
    if wire::write_reply(&mut w, refusal.as_deref()).is_err() || refusal.is_some() {
        return;
    }
    let _ = r.get_ref().set_read_timeout(None);
    while let Ok(()) = handle(&mut r, &mut w, data) {}
}

fn handle(r: &mut impl Read, w: &mut impl Write, data: &Data) -> std::io::Result<()> {
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

/// A client of the store. Requests from several threads are served one at a time.
pub struct Store {
    addr: SocketAddr,
    local_addr: SocketAddr,
    conn: Mutex<(BufReader<TcpStream>, BufWriter<TcpStream>)>,
}

impl Store {
    /// Connects to the store at `addr`, retrying until `timeout` while nobody listens yet (rank 0
    /// may start after the others). `rank` only names this client in the store's view.
    pub fn connect(addr: SocketAddr, token: &str, rank: usize, timeout: Duration) -> Result<Self> {
        let started = Instant::now();
        let stream = loop {
            let left = timeout.saturating_sub(started.elapsed());
            let attempt = left.clamp(Duration::from_millis(1), HELLO_TIMEOUT);
            match TcpStream::connect_timeout(&addr, attempt) {
                Ok(s) => break s,
                // Nobody listens yet: rank 0 may still be starting.
                Err(_) if started.elapsed() < timeout => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => {
                    return Err(Error::Unreachable {
                        addr: addr.to_string(),
                        waited: timeout,
                        detail: e.to_string(),
                    })
                }
            }
        };
        stream.set_nodelay(true).map_err(io_err("store socket"))?;
        stream
            .set_read_timeout(Some(HELLO_TIMEOUT))
            .map_err(io_err("store socket"))?;
        let context = format!("handshake with the store at {addr}");
        let mut w = BufWriter::new(stream.try_clone().map_err(io_err(context.clone()))?);
        let hello = Hello {
            purpose: Purpose::Store,
            token: token.to_string(),
            job: 0,
            from_rank: rank as u32,
            to_rank: 0,
            world_size: 0,
        };
        w.write_all(&hello.encode())
            .and_then(|()| w.flush())
            .map_err(io_err(context.clone()))?;
        let mut r = BufReader::new(stream);
        if let Some(reason) = wire::read_reply(&mut r).map_err(io_err(context))? {
            return Err(Error::Refused {
                peer: format!("the store at {addr}"),
                reason,
            });
        }
        r.get_ref()
            .set_read_timeout(None)
            .map_err(io_err("store socket"))?;
        let local_addr = r.get_ref().local_addr().map_err(io_err("store socket"))?;
        Ok(Self {
            addr,
            local_addr,
            conn: Mutex::new((r, w)),
        })
    }

    /// The store's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// This end of the connection: its IP is the interface that reaches the master, which is
    /// where peers can reach this rank too.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Sends `request`, then reads the answer with `read` under a bounded wait.
    fn call<T>(
        &self,
        request: &[u8],
        wait: Duration,
        read: impl FnOnce(&mut BufReader<TcpStream>) -> std::io::Result<T>,
    ) -> Result<T> {
        let mut conn = lock(&self.conn);
        let (r, w) = &mut *conn;
        let lost = |e: std::io::Error| Error::PeerLost {
            rank: 0,
            detail: format!("the store at {} stopped answering ({e})", self.addr),
        };
        w.write_all(request)
            .and_then(|()| w.flush())
            .map_err(lost)?;
        // The server bounds its own waits; allow it time to answer on top.
        r.get_ref()
            .set_read_timeout(Some(wait + Duration::from_secs(30)))
            .map_err(io_err("store socket"))?;
        let status = wire::read_u8(r).map_err(lost)?;
        if status == TIMED_OUT {
            return Err(Error::Timeout {
                what: "waiting for a key in the store".into(),
                waited: wait,
            });
        }
        read(r).map_err(lost)
    }

    /// Sets `key` to `value`.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut req = vec![SET];
        put_key(&mut req, key)?;
        put_value(&mut req, value)?;
        self.call(&req, Duration::ZERO, |_| Ok(()))
    }

    /// The value of `key`, waiting up to `timeout` for it to be set.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let mut req = vec![GET];
        put_key(&mut req, key)?;
        req.extend_from_slice(&millis(timeout).to_le_bytes());
        self.call(&req, timeout, |r| read_bytes(r, MAX_VALUE, "value"))
            .map_err(|e| match e {
                Error::Timeout { waited, .. } => Error::Timeout {
                    what: format!("waiting for store key {key:?}"),
                    waited,
                },
                other => other,
            })
    }

    /// Adds `delta` to the counter `key` (0 when unset) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut req = vec![ADD];
        put_key(&mut req, key)?;
        req.extend_from_slice(&delta.to_le_bytes());
        self.call(&req, Duration::ZERO, |r| Ok(wire::read_u64(r)? as i64))
    }

    /// Waits up to `timeout` for every key to be set; returns the keys still missing (none when
    /// all are there).
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<Vec<String>> {
        let mut req = vec![WAIT];
        req.extend_from_slice(&(keys.len() as u32).to_le_bytes());
        for k in keys {
            put_key(&mut req, k)?;
        }
        req.extend_from_slice(&millis(timeout).to_le_bytes());
        self.call(&req, timeout, |r| {
            let n = read_len(r, MAX_KEYS, "key list")?;
            (0..n).map(|_| read_string(r, MAX_KEY, "key")).collect()
        })
    }

    /// Sets `key` to `desired` if its value is `expected` (`None`: unset); returns the value
    /// after the call, so the caller sees whether it won.
    pub fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<Vec<u8>> {
        let mut req = vec![COMPARE_SET];
        put_key(&mut req, key)?;
        match expected {
            None => req.push(0),
            Some(v) => {
                req.push(1);
                put_value(&mut req, v)?;
            }
        }
        put_value(&mut req, desired)?;
        self.call(&req, Duration::ZERO, |r| read_bytes(r, MAX_VALUE, "value"))
    }

    /// Removes `key`; returns whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool> {
        let mut req = vec![DELETE];
        put_key(&mut req, key)?;
        self.call(&req, Duration::ZERO, |r| Ok(wire::read_u8(r)? != 0))
    }
}

fn millis(d: Duration) -> u64 {
    d.as_millis().min(u128::from(u64::MAX)) as u64
}

fn put_key(req: &mut Vec<u8>, key: &str) -> Result<()> {
    if key.len() > MAX_KEY {
        return Err(Error::InvalidArgument {
            what: "store key",
            detail: format!("{} bytes; keys are at most {MAX_KEY} bytes", key.len()),
        });
    }
    put_bytes(req, key.as_bytes());
    Ok(())
}

fn put_value(req: &mut Vec<u8>, value: &[u8]) -> Result<()> {
    if value.len() > MAX_VALUE {
        return Err(Error::InvalidArgument {
            what: "store value",
            detail: format!(
                "{} bytes; values are at most {MAX_VALUE} bytes",
                value.len()
            ),
        });
    }
    put_bytes(req, value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server() -> StoreServer {
        StoreServer::bind("127.0.0.1:0".parse().unwrap(), "tok").unwrap()
    }

    #[test]
    fn get_waits_for_a_later_set_from_another_client() -> Result<()> {
        let s = server();
        let a = Store::connect(s.local_addr(), "tok", 0, Duration::from_secs(5))?;
        let b = Store::connect(s.local_addr(), "tok", 1, Duration::from_secs(5))?;
        let setter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            b.set("k", b"v").unwrap();
        });
        assert_eq!(a.get("k", Duration::from_secs(5))?, b"v");
        setter.join().unwrap();
        let err = a.get("never", Duration::from_millis(50)).unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        assert!(err.to_string().contains("\"never\""), "{err}");
        Ok(())
    }

    #[test]
    fn counters_and_compare_set_are_atomic_across_clients() -> Result<()> {
        let s = server();
        let addr = s.local_addr();
        let handles: Vec<_> = (0..8)
            .map(|i| {
                std::thread::spawn(move || {
                    let c = Store::connect(addr, "tok", i, Duration::from_secs(5)).unwrap();
                    for _ in 0..50 {
                        c.add("n", 1).unwrap();
                    }
                    c.compare_set("winner", None, &[i as u8]).unwrap()
                })
            })
            .collect();
        let winners: Vec<Vec<u8>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(winners.windows(2).all(|w| w[0] == w[1]), "{winners:?}");
        let c = Store::connect(addr, "tok", 9, Duration::from_secs(5))?;
        assert_eq!(c.add("n", 0)?, 400);
        assert!(c.delete("n")?);
        assert!(!c.delete("n")?);
        Ok(())
    }

    #[test]
    fn a_wrong_token_is_refused_and_the_store_keeps_serving() -> Result<()> {
        let s = server();
        let err = Store::connect(s.local_addr(), "intruder", 0, Duration::from_secs(5))
            .err()
            .expect("refused");
        assert!(err.to_string().contains("wrong job token"), "{err}");
        // A stranger speaking another protocol is dropped too.
        let mut raw = TcpStream::connect(s.local_addr()).unwrap();
        raw.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let ok = Store::connect(s.local_addr(), "tok", 0, Duration::from_secs(5))?;
        ok.set("still", b"fine")?;
        assert_eq!(ok.wait(&["still"], Duration::ZERO)?, Vec::<String>::new());
        Ok(())
    }

    #[test]
    fn connecting_to_nobody_fails_after_the_timeout() {
        let addr = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let started = Instant::now();
        let err = Store::connect(addr, "t", 1, Duration::from_millis(300))
            .err()
            .expect("nobody listens");
        assert!(matches!(err, Error::Unreachable { .. }), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn binding_a_used_port_says_so() {
        let s = server();
        let err = StoreServer::bind(s.local_addr(), "t")
            .err()
            .expect("in use");
        assert!(matches!(err, Error::PortInUse { .. }), "{err}");
    }
}
