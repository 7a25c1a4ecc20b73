//! The store's client.

use super::{
    millis, put_key, put_value, ADD, COMPARE_SET, DELETE, GET, HELLO_TIMEOUT, MAX_KEY, MAX_KEYS,
    MAX_VALUE, SET, TIMED_OUT, WAIT,
};
use crate::distributed::wire::{self, io_err, read_bytes, read_len, read_string, Hello, Purpose};
use crate::error::{Error, Result};
use crate::sync::lock;
use std::io::{BufReader, BufWriter, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

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
