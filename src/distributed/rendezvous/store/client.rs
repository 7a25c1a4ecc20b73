//! The client of our own store ([`server`](super::server)), in our protocol
//! ([`protocol`](super::protocol)).

use super::protocol::{
    millis, put_key, put_value, worth_retrying, ADD, COMPARE_SET, DELETE, GET, HANG_UP_LIMIT,
    HELLO_TIMEOUT, MAX_KEY, MAX_KEYS, MAX_VALUE, SET, TIMED_OUT, WAIT,
};
use super::StoreClient;
use crate::distributed::transport::wire::{
    self, io_err, read_bytes, read_len, read_string, Hello, NoAnswer, Purpose,
};
use crate::error::{Error, Result};
use crate::util::sync::lock;
use std::io::{BufReader, BufWriter, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One connection to our store. Requests from several threads are served one at a time.
pub(crate) struct CandleClient {
    addr: SocketAddr,
    local_addr: SocketAddr,
    /// The job token it presented, to present again on a new connection.
    token: String,
    conn: Mutex<(BufReader<TcpStream>, BufWriter<TcpStream>)>,
}

/// How often a waiting rank says that it is still waiting: every 30 s, or four times in the
/// whole wait when that is shorter.
pub(crate) fn progress_every(timeout: Duration) -> Duration {
    (timeout / 4).clamp(Duration::from_secs(1), Duration::from_secs(30))
}

/// One attempt at reaching the store.
enum Attempt {
    Joined(TcpStream, BufReader<TcpStream>),
    /// Worth another try (nobody listens yet, the store is restarting or busy): why not now.
    Retry(String),
    /// Something listens, and closed the connection without a word: worth another try for a
    /// while (a store caught as it stops), not for long (see [`HANG_UP_LIMIT`]).
    HungUp(String),
    /// Trying again cannot help.
    Fail(Error),
}

/// The error for a program at `addr` that is not this job's store, and `what` it did.
fn foreign(addr: SocketAddr, what: &str) -> Error {
    Error::Refused {
        peer: format!("the program at {addr}"),
        reason: format!(
            "{what}: it is not this job's store, so another program holds MASTER_PORT (or \
             MASTER_ADDR is wrong); pick a free port, or stop that program"
        ),
    }
}

impl CandleClient {
    /// Connects to the store at `addr`, retrying until `timeout` while nobody listens yet (rank 0
    /// may start after the others), while the store of a job that just ended on this port is
    /// shutting down, and while it is busy; says every 30 s (or every quarter of `timeout`, when
    /// shorter) that it is still waiting. A program that is not the store fails it: at once
    /// when it answers, within `HELLO_TIMEOUT` when it is silent, within `HANG_UP_LIMIT`
    /// when it closes every connection without a word. `rank` only names this client in the
    /// store's view and in messages.
    pub fn connect(addr: SocketAddr, token: &str, rank: usize, timeout: Duration) -> Result<Self> {
        let started = Instant::now();
        let mut said = Duration::ZERO;
        // Since when every attempt was closed without a word.
        let mut hung_up_since: Option<Instant> = None;
        let (w, r) = loop {
            let left = timeout.saturating_sub(started.elapsed());
            let attempt = match Self::attempt(addr, token, rank, left, HELLO_TIMEOUT) {
                Attempt::HungUp(why) => {
                    let since = *hung_up_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= HANG_UP_LIMIT {
                        return Err(foreign(
                            addr,
                            &format!(
                                "it accepted every connection for {} s and closed it without \
                                 a word ({why})",
                                HANG_UP_LIMIT.as_secs()
                            ),
                        ));
                    }
                    Attempt::Retry(why)
                }
                other => {
                    hung_up_since = None;
                    other
                }
            };
            match attempt {
                Attempt::Joined(w, r) => break (w, r),
                Attempt::Fail(e) => return Err(e),
                Attempt::Retry(why) | Attempt::HungUp(why) if started.elapsed() < timeout => {
                    let waited = started.elapsed();
                    if waited >= said + progress_every(timeout) {
                        said = waited;
                        log::info!(
                            "rank {rank} is still waiting for the master's store at {addr}, {} s so far ({why}); the rendezvous timeout is {} s",
                            waited.as_secs(),
                            timeout.as_secs()
                        );
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                Attempt::Retry(why) | Attempt::HungUp(why) => {
                    return Err(Error::Unreachable {
                        addr: addr.to_string(),
                        waited: timeout,
                        detail: why,
                    })
                }
            }
        };
        r.get_ref()
            .set_read_timeout(None)
            .map_err(io_err("store socket"))?;
        let local_addr = r.get_ref().local_addr().map_err(io_err("store socket"))?;
        Ok(Self {
            addr,
            local_addr,
            token: token.to_string(),
            conn: Mutex::new((r, BufWriter::new(w))),
        })
    }

    /// One connection to a store that should be up: `None` unless it answers as this job's
    /// store within `within` (so that rank 0 tells a second rank 0 of its job from another
    /// program holding the port at once).
    pub(crate) fn probe(addr: SocketAddr, token: &str, within: Duration) -> Option<Self> {
        match Self::attempt(addr, token, 0, within, within) {
            Attempt::Joined(w, r) => {
                let local_addr = r.get_ref().local_addr().ok()?;
                r.get_ref().set_read_timeout(None).ok()?;
                Some(Self {
                    addr,
                    local_addr,
                    token: token.to_string(),
                    conn: Mutex::new((r, BufWriter::new(w))),
                })
            }
            Attempt::Retry(_) | Attempt::HungUp(_) | Attempt::Fail(_) => None,
        }
    }

    fn attempt(
        addr: SocketAddr,
        token: &str,
        rank: usize,
        left: Duration,
        hello_timeout: Duration,
    ) -> Attempt {
        let within = left.clamp(Duration::from_millis(1), hello_timeout);
        let stream = match TcpStream::connect_timeout(&addr, within) {
            Ok(s) => s,
            Err(e) => return Attempt::Retry(e.to_string()),
        };
        let hello = Hello {
            purpose: Purpose::Store,
            token: token.to_string(),
            job: 0,
            from_rank: rank as u32,
            to_rank: 0,
            world_size: 0,
        };
        let sent = stream
            .set_nodelay(true)
            .and_then(|()| stream.set_read_timeout(Some(hello_timeout)))
            .and_then(|()| (&stream).write_all(&hello.encode()));
        if let Err(e) = sent {
            return Attempt::HungUp(format!("the connection closed during the handshake ({e})"));
        }
        let Ok(read_half) = stream.try_clone() else {
            return Attempt::Retry("could not use the connection".into());
        };
        let mut r = BufReader::new(read_half);
        match wire::read_reply(&mut r) {
            Ok(None) => Attempt::Joined(stream, r),
            Ok(Some(reason)) if worth_retrying(&reason) => Attempt::Retry(reason),
            Ok(Some(reason)) => Attempt::Fail(Error::Refused {
                peer: format!("the store at {addr}"),
                reason,
            }),
            Err(no @ NoAnswer::Closed(_)) => Attempt::HungUp(no.to_string()),
            Err(no) => Attempt::Fail(foreign(addr, &no.to_string())),
        }
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
}

impl StoreClient for CandleClient {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut req = vec![SET];
        put_key(&mut req, key)?;
        put_value(&mut req, value)?;
        self.call(&req, Duration::ZERO, |_| Ok(()))
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
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

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut req = vec![ADD];
        put_key(&mut req, key)?;
        req.extend_from_slice(&delta.to_le_bytes());
        self.call(&req, Duration::ZERO, |r| Ok(wire::read_u64(r)? as i64))
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<Vec<String>> {
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

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>> {
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

    fn delete(&self, key: &str) -> Result<bool> {
        let mut req = vec![DELETE];
        put_key(&mut req, key)?;
        self.call(&req, Duration::ZERO, |r| Ok(wire::read_u8(r)? != 0))
    }

    fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    fn reconnect(&self, rank: usize, timeout: Duration) -> Result<Box<dyn StoreClient>> {
        Ok(Box::new(Self::connect(
            self.addr,
            &self.token,
            rank,
            timeout,
        )?))
    }

    fn writes_notes(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        format!("the store at {}", self.addr)
    }
}
