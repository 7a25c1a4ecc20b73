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

mod client;
mod server;

pub(crate) use client::ranks_named;
pub use client::Store;
pub use server::StoreServer;

mod protocol;

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
