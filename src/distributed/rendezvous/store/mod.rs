//! The key-value store where ranks meet (`torch.distributed.Store`).
//!
//! Ranks use it to find each other (each publishes its address), to hand out the NCCL unique id,
//! to detect two processes claiming one rank, and for barriers. Values are bytes; waits are
//! bounded: a wait that runs out of time says which keys are still missing.
//!
//! [`Store`] is the one face, whoever serves the store:
//! - rank 0's [`StoreServer`], in our own protocol (`protocol`, `server`, `client`): it checks
//!   the job token, notes a rank whose connection closed (`gone/<rank>`) and the last refused
//!   connection;
//! - torchrun's agent, which serves PyTorch's TCPStore (`torch_protocol`, `torch_client`;
//!   [`Store::connect_torch`]).
//!
//! Each client implements `StoreClient`; the waits the rendezvous builds on them (for ranks,
//! for an abort) are written once, on [`Store`].
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

mod client;
mod handle;
mod protocol;
mod server;
mod torch_client;
mod torch_protocol;

pub(crate) use handle::ranks_named;
pub use handle::Store;
pub use server::StoreServer;

use crate::error::Result;
use std::net::SocketAddr;
use std::time::Duration;

/// One connection to a store, in the protocol of whoever serves it. Keys are full keys (any
/// prefix applied by [`Store`]).
pub(crate) trait StoreClient: Send + Sync {
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// The value of `key`, waiting up to `timeout` for it (else `Error::Timeout`).
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    fn add(&self, key: &str, delta: i64) -> Result<i64>;
    /// Waits up to `timeout` for every key; the keys still missing.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<Vec<String>>;
    /// Whether every key is set, asked once.
    fn check(&self, keys: &[&str]) -> Result<bool> {
        Ok(self.wait(keys, Duration::ZERO)?.is_empty())
    }
    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>>;
    fn delete(&self, key: &str) -> Result<bool>;
    /// The values of `keys`, waiting up to `timeout` for all of them.
    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let missing = self.wait(keys, timeout)?;
        if !missing.is_empty() {
            return Err(crate::error::Error::Timeout {
                what: format!("waiting for store keys {missing:?}"),
                waited: timeout,
            });
        }
        keys.iter().map(|k| self.get(k, Duration::ZERO)).collect()
    }
    fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()> {
        pairs.iter().try_for_each(|(k, v)| self.set(k, v))
    }
    fn addr(&self) -> SocketAddr;
    /// This end of the connection.
    fn local_addr(&self) -> SocketAddr;
    /// A new connection to the same store, naming `rank`.
    fn reconnect(&self, rank: usize, timeout: Duration) -> Result<Box<dyn StoreClient>>;
    /// Whether the store writes notes of its own: `gone/<rank>` when the connection that
    /// claimed a rank closes, `refused` when it refuses one (ours does; torch's does not).
    fn writes_notes(&self) -> bool;
    /// Who serves the store, and where, for messages.
    fn describe(&self) -> String;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{Error, Result};
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;
    use std::time::Instant;

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
    fn a_store_whose_handshakes_are_all_held_by_strangers_says_it_is_busy() {
        use crate::distributed::transport::wire::{self, Hello, Purpose, MAX_HANDSHAKES};
        let s = server();
        let strangers: Vec<TcpStream> = (0..MAX_HANDSHAKES)
            .map(|_| TcpStream::connect(s.local_addr()).unwrap())
            .collect();
        // Accepted after the strangers, which hold every place.
        let mut c = TcpStream::connect(s.local_addr()).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let hello = Hello {
            purpose: Purpose::Store,
            token: "tok".into(),
            job: 0,
            from_rank: 1,
            to_rank: 0,
            world_size: 0,
        };
        c.write_all(&hello.encode()).unwrap();
        let reason = wire::read_reply(&mut c).unwrap().expect("refused");
        assert!(protocol::worth_retrying(&reason), "{reason}");
        assert!(reason.contains("busy"), "{reason}");
        drop(strangers);
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
