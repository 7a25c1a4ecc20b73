//! Joining a job: rank 0 hosts the store, every rank reaches it, claims its rank and agrees on
//! the job. The backends then connect the ranks to each other.

use super::store::{Store, StoreServer};
use super::Rendezvous;
use crate::distributed::config::InitConfig;
use crate::error::{Error, Result};
use crate::rng::fresh_seed;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

/// This rank's place in a job it joined: the store, reached (and on rank 0 hosted), and the
/// job's id.
pub(crate) struct Joined {
    pub store: Arc<Store>,
    pub server: Option<Arc<StoreServer>>,
    pub job: u64,
}

/// Hosts (rank 0) or reaches the store, claims this rank, and agrees on the job.
pub(crate) fn join(r: &Rendezvous, options: &InitConfig) -> Result<Joined> {
    let master = r.master_socket()?;
    let token = options.token.as_str();
    let server = if r.rank == 0 {
        let bind_ip = if master.ip().is_loopback() {
            master.ip()
        } else {
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        };
        match StoreServer::bind(SocketAddr::new(bind_ip, master.port()), token) {
            Ok(s) => Some(Arc::new(s)),
            Err(Error::PortInUse { addr }) => return Err(explain_port_in_use(master, token, addr)),
            Err(e) => return Err(e),
        }
    } else {
        None
    };
    let store = Arc::new(Store::connect(
        master,
        token,
        r.rank,
        options.rendezvous_timeout,
    )?);
    let nonce = fresh_seed().to_le_bytes();
    let owner = store.compare_set(&format!("rank/{}", r.rank), None, &nonce)?;
    if owner != nonce {
        return Err(Error::Rendezvous {
            detail: format!(
                "rank {} is already claimed by another process: two processes were started \
                 with RANK={}",
                r.rank, r.rank
            ),
        });
    }
    let world = r.world_size.to_string();
    let agreed = store.compare_set("world_size", None, world.as_bytes())?;
    if agreed != world.as_bytes() {
        let detail = format!(
            "rank {} has WORLD_SIZE={} but an earlier rank has {}",
            r.rank,
            world,
            String::from_utf8_lossy(&agreed)
        );
        // The job cannot form: tell the ranks waiting for this one.
        store.abort(&detail);
        return Err(Error::Rendezvous { detail });
    }
    let job = store.compare_set("job", None, &fresh_seed().to_le_bytes())?;
    let job = u64::from_le_bytes(job.as_slice().try_into().map_err(|_| Error::Rendezvous {
        detail: "the store holds an invalid job id".into(),
    })?);
    Ok(Joined { store, server, job })
}

/// A taken master port is either another program's, or a second rank 0 of this job's: only
/// this job's store answers the probe at once.
fn explain_port_in_use(master: SocketAddr, token: &str, addr: String) -> Error {
    let probe = Store::probe(master, token, std::time::Duration::from_millis(500));
    let claimed = probe
        .and_then(|s| s.wait(&["rank/0"], std::time::Duration::ZERO).ok())
        .is_some_and(|missing| missing.is_empty());
    if claimed {
        Error::Rendezvous {
            detail: "rank 0 is already claimed by another process: two processes were started \
                     with RANK=0"
                .into(),
        }
    } else {
        Error::PortInUse { addr }
    }
}
