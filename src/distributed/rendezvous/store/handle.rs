//! [`Store`]: the face of a store, whoever serves it, and the waits the rendezvous builds on
//! it.

use super::client::{progress_every, CandleClient};
use super::protocol::REFUSED_KEY;
use super::torch_client::TorchClient;
use super::StoreClient;
use crate::error::{Error, Result};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A connection to the rendezvous store: rank 0's ([`StoreServer`](super::StoreServer), our
/// protocol) or the one torchrun's agent serves (PyTorch's TCPStore). Keys may live under a
/// prefix (as torch's `PrefixStore`), which the store's own keys (`gone/<rank>`, `refused`)
/// never do. Requests from several threads are served one at a time.
pub struct Store {
    client: Arc<dyn StoreClient>,
    prefix: String,
}

/// The key where a rank that cannot go on writes why, for the others.
pub(crate) const ABORT_KEY: &str = "abort";

/// How long one store wait of a rank waiting for others lasts, before it checks that they
/// are still there.
const WAIT_SLICE: Duration = Duration::from_millis(500);

/// "rank 1" or "ranks 1, 2", for messages.
pub(crate) fn ranks_named(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match list.len() {
        1 => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    }
}

impl Store {
    fn new(client: impl StoreClient + 'static) -> Self {
        Self {
            client: Arc::new(client),
            prefix: String::new(),
        }
    }

    /// Connects to rank 0's store at `addr`, retrying until `timeout` while nobody listens yet
    /// (rank 0 may start after the others), while the store of a job that just ended on this
    /// port is shutting down, and while it is busy; says every 30 s (or every quarter of
    /// `timeout`, when shorter) that it is still waiting. A program that is not the store fails
    /// it: at once when it answers, within 10 s when it is silent or closes every connection
    /// without a word. `rank` only names this client in the store's view and in messages.
    pub fn connect(addr: SocketAddr, token: &str, rank: usize, timeout: Duration) -> Result<Self> {
        CandleClient::connect(addr, token, rank, timeout).map(Self::new)
    }

    /// Connects to PyTorch's TCPStore at `addr` (torch ≥ 2.2; the store torchrun's agent
    /// serves), retrying until `timeout` while nobody listens yet.
    pub fn connect_torch(addr: SocketAddr, timeout: Duration) -> Result<Self> {
        TorchClient::connect(addr, timeout).map(Self::new)
    }

    /// One connection to rank 0's store that should be up: `None` unless it answers as this
    /// job's store within `within`.
    pub(crate) fn probe(addr: SocketAddr, token: &str, within: Duration) -> Option<Self> {
        CandleClient::probe(addr, token, within).map(Self::new)
    }

    /// This connection, with its keys under `prefix` (after this store's own prefix).
    pub(crate) fn scoped(&self, prefix: &str) -> Self {
        Self {
            client: self.client.clone(),
            prefix: format!("{}{prefix}", self.prefix),
        }
    }

    /// A new connection to the same store, with the same prefix, naming `rank`.
    pub(crate) fn reconnect(&self, rank: usize, timeout: Duration) -> Result<Self> {
        Ok(Self {
            client: Arc::from(self.client.reconnect(rank, timeout)?),
            prefix: self.prefix.clone(),
        })
    }

    fn key(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// The store's address.
    pub fn addr(&self) -> SocketAddr {
        self.client.addr()
    }

    /// This end of the connection: its IP is the interface that reaches the master, which is
    /// where peers can reach this rank too.
    pub fn local_addr(&self) -> SocketAddr {
        self.client.local_addr()
    }

    /// Who serves the store and where, for messages.
    pub(crate) fn describe(&self) -> String {
        self.client.describe()
    }

    /// Sets `key` to `value`.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.client.set(&self.key(key), value)
    }

    /// The value of `key`, waiting up to `timeout` for it to be set.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.client.get(&self.key(key), timeout)
    }

    /// Adds `delta` to the counter `key` (0 when unset) and returns the new value. Read a
    /// counter with `add(key, 0)`: stores keep it differently (ours as 8 bytes, torch's as
    /// decimal text).
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.client.add(&self.key(key), delta)
    }

    /// Waits up to `timeout` for every key to be set; returns the keys still missing (none when
    /// all are there).
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<Vec<String>> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        let missing = self.client.wait(&refs, timeout)?;
        Ok(missing
            .into_iter()
            .map(|k| k.strip_prefix(&self.prefix).unwrap_or(&k).to_string())
            .collect())
    }

    /// Whether every key is set, without waiting (one request, whoever serves the store).
    pub fn check(&self, keys: &[&str]) -> Result<bool> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.client.check(&refs)
    }

    /// Sets `key` to `desired` if its value is `expected` (`None`: unset); returns the value
    /// after the call, so the caller sees whether it won. (Torch's store cannot tell an empty
    /// value from none, and answers `expected` when the key is unset: expect non-empty values.)
    pub fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<Vec<u8>> {
        self.client.compare_set(&self.key(key), expected, desired)
    }

    /// The values of `keys`, in order, waiting up to `timeout` for all of them (one request to
    /// torch's store).
    pub fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.client.multi_get(&refs, timeout)
    }

    /// Sets every key of `pairs` to its value (one request to torch's store).
    pub fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()> {
        let full: Vec<(String, &[u8])> = pairs.iter().map(|(k, v)| (self.key(k), *v)).collect();
        let refs: Vec<(&str, &[u8])> = full.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        self.client.multi_set(&refs)
    }

    /// Removes `key`; returns whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool> {
        self.client.delete(&self.key(key))
    }

    /// Waits up to `timeout` for `keys`, each published by a rank (`(rank, key)`), and returns
    /// the ranks whose keys are still missing (none when all are there). Fails at once when the
    /// job was aborted or one of the `watched` ranks left (by default those it waits for; see
    /// [`Store::check_not_aborted`]); says every 30 s (or quarter of `timeout`), naming rank
    /// `me`, whom it waits for.
    pub(crate) fn wait_for_ranks(
        &self,
        keys: &[(usize, String)],
        me: usize,
        timeout: Duration,
        watched: Option<&[usize]>,
    ) -> Result<Vec<usize>> {
        let started = Instant::now();
        let mut said = Duration::ZERO;
        loop {
            let refs: Vec<&str> = keys.iter().map(|(_, k)| k.as_str()).collect();
            let left = timeout.saturating_sub(started.elapsed());
            // In slices: a rank that left is noticed within two (our store notices the close
            // once the left rank's own wait ends, this wait then ends too).
            let missing = self.wait(&refs, left.min(WAIT_SLICE))?;
            let ranks: Vec<usize> = keys
                .iter()
                .filter(|(_, k)| missing.contains(k))
                .map(|(r, _)| *r)
                .collect();
            if ranks.is_empty() {
                return Ok(ranks);
            }
            self.check_not_aborted(watched.unwrap_or(&ranks))?;
            let waited = started.elapsed();
            if waited >= timeout {
                return Ok(ranks);
            }
            if waited >= said + progress_every(timeout) {
                said = waited;
                log::info!(
                    "rank {me} is still waiting for {} to join, {} s so far; \
                     the rendezvous timeout is {} s{}",
                    ranks_named(&ranks),
                    waited.as_secs(),
                    timeout.as_secs(),
                    self.refusal_note()
                );
            }
        }
    }

    /// Fails when the job was aborted (a rank wrote why in `abort`) or one of `ranks` left
    /// (`gone/<rank>`, written by our store when the connection that claimed the rank closed;
    /// torch's store notes no departures, and torchrun stops every rank when one ends).
    pub(crate) fn check_not_aborted(&self, ranks: &[usize]) -> Result<()> {
        if self.check(&[ABORT_KEY])? {
            let why = self.get(ABORT_KEY, Duration::ZERO)?;
            return Err(Error::Rendezvous {
                detail: String::from_utf8_lossy(&why).into_owned(),
            });
        }
        if !self.client.writes_notes() || ranks.is_empty() {
            return Ok(());
        }
        let keys: Vec<String> = ranks.iter().map(|r| format!("gone/{r}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let missing = self.client.wait(&refs, Duration::ZERO)?;
        if let Some((rank, k)) = ranks.iter().zip(&keys).find(|(_, k)| !missing.contains(k)) {
            let why = String::from_utf8_lossy(&self.client.get(k, Duration::ZERO)?).into_owned();
            return Err(Error::Rendezvous {
                detail: format!("rank {rank} left during the rendezvous: {why}"),
            });
        }
        Ok(())
    }

    /// Tells every rank of the job that it cannot form, and why (the first reason stays).
    pub(crate) fn abort(&self, why: &str) {
        let _ = self.compare_set(ABORT_KEY, None, why.as_bytes());
    }

    /// "; meanwhile the store refused ..." when it refused a connection of this job's shape.
    pub(crate) fn refusal_note(&self) -> String {
        if !self.client.writes_notes() {
            return String::new();
        }
        match self.client.wait(&[REFUSED_KEY], Duration::ZERO) {
            Ok(missing) if missing.is_empty() => {
                match self.client.get(REFUSED_KEY, Duration::ZERO) {
                    Ok(v) => format!("; meanwhile the store {}", String::from_utf8_lossy(&v)),
                    Err(_) => String::new(),
                }
            }
            _ => String::new(),
        }
    }
}
