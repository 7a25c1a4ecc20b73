//! A client of PyTorch's TCPStore ([`torch_protocol`](super::torch_protocol)): how ranks
//! started by torchrun reach the store its agent serves (`TORCHELASTIC_USE_AGENT_STORE=True`).

use super::torch_protocol::{
    read_code, read_int, read_value, Request, ADD, CANCEL_WAIT, CHECK, COMPARE_SET, DELETE_KEY,
    GET, MULTI_GET, MULTI_SET, NOT_READY, READY, SET, STOP_WAITING, WAIT, WAIT_CANCELED,
};
use super::StoreClient;
use crate::distributed::transport::wire::io_err;
use crate::error::{Error, Result};
use crate::util::sync::lock;
use std::io::{BufReader, BufWriter, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long the store may take to answer a request that does not wait for keys.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a connected program may take to answer the first request before it counts as not
/// being a TCPStore.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// One connection to a TCPStore. Requests from several threads are served one at a time.
pub(crate) struct TorchClient {
    addr: SocketAddr,
    local_addr: SocketAddr,
    conn: Mutex<(BufReader<TcpStream>, BufWriter<TcpStream>)>,
}

impl TorchClient {
    /// Connects to the TCPStore at `addr`, retrying until `timeout` while nobody listens yet,
    /// and checks that it answers as a TCPStore (the validation, then a `CHECK`).
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<Self> {
        let started = Instant::now();
        let mut said = Duration::ZERO;
        let stream = loop {
            let left = timeout.saturating_sub(started.elapsed());
            match TcpStream::connect_timeout(
                &addr,
                left.clamp(Duration::from_millis(1), HELLO_TIMEOUT),
            ) {
                Ok(s) => break s,
                Err(e) if started.elapsed() >= timeout => {
                    return Err(Error::Unreachable {
                        addr: addr.to_string(),
                        waited: timeout,
                        detail: format!(
                            "{e}; TORCHELASTIC_USE_AGENT_STORE=True says that torchrun's agent \
                             serves a TCPStore there"
                        ),
                    })
                }
                Err(e) => {
                    let waited = started.elapsed();
                    if waited >= said + Duration::from_secs(30) {
                        said = waited;
                        log::info!(
                            "still waiting for torchrun's store at {addr}, {} s so far ({e})",
                            waited.as_secs()
                        );
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        };
        let local_addr = stream.local_addr().map_err(io_err("store socket"))?;
        stream.set_nodelay(true).map_err(io_err("store socket"))?;
        let read_half = stream.try_clone().map_err(io_err("store socket"))?;
        let client = Self {
            addr,
            local_addr,
            conn: Mutex::new((BufReader::new(read_half), BufWriter::new(stream))),
        };
        client.send(&Request::validate())?;
        // The validation has no answer: a CHECK shows that a TCPStore is listening.
        let check = Request::new(CHECK).count(1)?.key("")?;
        client
            .call(&check, HELLO_TIMEOUT, |r| read_code(r, &[READY, NOT_READY], "CHECK"))
            .map_err(|e| Error::Refused {
                peer: format!("the program at {addr}"),
                reason: format!(
                    "it does not answer as PyTorch's TCPStore ({e}). TORCHELASTIC_USE_AGENT_STORE=True \
                     says that torchrun's agent serves one at MASTER_ADDR:MASTER_PORT; torch \
                     older than 2.2 speaks an older protocol (unset the variable there, and give \
                     the ranks a MASTER_PORT of their own)"
                ),
            })?;
        Ok(client)
    }

    /// The error for a connection that broke.
    fn lost(&self, e: std::io::Error) -> Error {
        Error::Rendezvous {
            detail: format!(
                "torchrun's store at {} stopped answering ({e}): the agent ended, or the \
                 connection broke",
                self.addr
            ),
        }
    }

    /// Sends a request that has no answer.
    fn send(&self, request: &Request) -> Result<()> {
        let mut conn = lock(&self.conn);
        let w = &mut conn.1;
        w.write_all(request.bytes())
            .and_then(|()| w.flush())
            .map_err(|e| self.lost(e))
    }

    /// Sends `request` and reads its answer with `read`, within `within`.
    fn call<T>(
        &self,
        request: &Request,
        within: Duration,
        read: impl FnOnce(&mut BufReader<TcpStream>) -> std::io::Result<T>,
    ) -> Result<T> {
        let mut conn = lock(&self.conn);
        let (r, w) = &mut *conn;
        w.write_all(request.bytes())
            .and_then(|()| w.flush())
            .map_err(|e| self.lost(e))?;
        r.get_ref()
            .set_read_timeout(Some(within))
            .map_err(io_err("store socket"))?;
        read(r).map_err(|e| self.lost(e))
    }

    /// Whether every key exists, asked once.
    fn check_all(&self, keys: &[&str]) -> Result<bool> {
        if keys.is_empty() {
            return Ok(true);
        }
        let mut req = Request::new(CHECK).count(keys.len())?;
        for k in keys {
            req = req.key(k)?;
        }
        let code = self.call(&req, ANSWER_TIMEOUT, |r| {
            read_code(r, &[READY, NOT_READY], "CHECK")
        })?;
        Ok(code == READY)
    }

    /// The keys that do not exist (asked one by one: `CHECK` only answers for all at once).
    fn missing(&self, keys: &[&str]) -> Result<Vec<String>> {
        if keys.is_empty() || self.check_all(keys)? {
            return Ok(Vec::new());
        }
        if keys.len() == 1 {
            return Ok(vec![keys[0].to_string()]);
        }
        let mut missing = Vec::new();
        for k in keys {
            if !self.check_all(&[k])? {
                missing.push(k.to_string());
            }
        }
        Ok(missing)
    }

    /// Waits up to `timeout` for every key; whether they all came.
    fn wait_all(&self, keys: &[&str], timeout: Duration) -> Result<bool> {
        if keys.is_empty() {
            return Ok(true);
        }
        if timeout.is_zero() {
            return self.check_all(keys);
        }
        let mut req = Request::new(WAIT).count(keys.len())?;
        for k in keys {
            req = req.key(k)?;
        }
        let mut conn = lock(&self.conn);
        let (r, w) = &mut *conn;
        w.write_all(req.bytes())
            .and_then(|()| w.flush())
            .map_err(|e| self.lost(e))?;
        r.get_ref()
            .set_read_timeout(Some(timeout))
            .map_err(io_err("store socket"))?;
        let mut answer = [0u8; 1];
        match r.read(&mut answer) {
            Ok(1) if answer[0] == STOP_WAITING => return Ok(true),
            Ok(1) => {
                return Err(self.lost(std::io::Error::new(
                    ErrorKind::InvalidData,
                    format!("WAIT answered {}", answer[0]),
                )))
            }
            Ok(_) => return Err(self.lost(ErrorKind::UnexpectedEof.into())),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => return Err(self.lost(e)),
        }
        // Out of time: cancel. The keys may have come meanwhile, and then STOP_WAITING comes
        // before WAIT_CANCELED.
        let cancel = Request::new(CANCEL_WAIT);
        w.write_all(cancel.bytes())
            .and_then(|()| w.flush())
            .map_err(|e| self.lost(e))?;
        r.get_ref()
            .set_read_timeout(Some(ANSWER_TIMEOUT))
            .map_err(io_err("store socket"))?;
        let what = "WAIT after CANCEL_WAIT";
        let first = read_code(r, &[STOP_WAITING, WAIT_CANCELED], what).map_err(|e| self.lost(e))?;
        if first == STOP_WAITING {
            read_code(r, &[WAIT_CANCELED], what).map_err(|e| self.lost(e))?;
            return Ok(true);
        }
        Ok(false)
    }
}

impl StoreClient for TorchClient {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.send(&Request::new(SET).key(key)?.value(value)?)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        if !self.wait_all(&[key], timeout)? {
            return Err(Error::Timeout {
                what: format!("waiting for store key {key:?}"),
                waited: timeout,
            });
        }
        self.call(&Request::new(GET).key(key)?, ANSWER_TIMEOUT, read_value)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.call(
            &Request::new(ADD).key(key)?.int(delta),
            ANSWER_TIMEOUT,
            read_int,
        )
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<Vec<String>> {
        if self.wait_all(keys, timeout)? {
            Ok(Vec::new())
        } else {
            self.missing(keys)
        }
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        self.check_all(keys)
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>> {
        let req = Request::new(COMPARE_SET)
            .key(key)?
            .value(expected.unwrap_or_default())?
            .value(desired)?;
        self.call(&req, ANSWER_TIMEOUT, read_value)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let deleted = self.call(
            &Request::new(DELETE_KEY).key(key)?,
            ANSWER_TIMEOUT,
            read_int,
        )?;
        Ok(deleted == 1)
    }

    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let missing = self.wait(keys, timeout)?;
        if !missing.is_empty() {
            return Err(Error::Timeout {
                what: format!("waiting for store keys {missing:?}"),
                waited: timeout,
            });
        }
        let mut req = Request::new(MULTI_GET).count(keys.len())?;
        for k in keys {
            req = req.key(k)?;
        }
        self.call(&req, ANSWER_TIMEOUT, |r| {
            keys.iter().map(|_| read_value(r)).collect()
        })
    }

    fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()> {
        let mut req = Request::new(MULTI_SET).count(pairs.len())?;
        for (k, v) in pairs {
            req = req.key(k)?.value(v)?;
        }
        self.send(&req)
    }

    fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    fn reconnect(&self, _rank: usize, timeout: Duration) -> Result<Box<dyn StoreClient>> {
        Ok(Box::new(Self::connect(self.addr, timeout)?))
    }

    fn writes_notes(&self) -> bool {
        false
    }

    fn describe(&self) -> String {
        format!("torchrun's store at {}", self.addr)
    }
}
