//! Joining a job: reaching the store (rank 0 hosts ours; under torchrun, its agent serves
//! one), claiming a rank and agreeing on the job. The backends then connect the ranks to each
//! other.

use super::attempt::enter_attempt;
use super::store::{Store, StoreServer};
use super::{Launcher, Rendezvous};
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

/// The key a rank claims in the store.
fn claim_key(rank: usize) -> String {
    format!("rank/{rank}")
}

/// Reaches the job's store (hosting it on rank 0, unless torchrun's agent serves it), claims
/// this rank, and agrees on the job.
pub(crate) fn join(r: &Rendezvous, options: &InitConfig) -> Result<Joined> {
    let master = r.master_socket()?;
    let timeout = options.rendezvous_timeout;
    let (store, server) = match &r.launcher {
        Launcher::TorchrunAgent { run_id } => {
            let agents = Store::connect_torch(master, timeout)?;
            // Our keys apart from torch's (its workers' are under "default_pg/"), per run and
            // per attempt.
            let run = agents.scoped(&format!("candle_parallel/{run_id}/"));
            let (store, attempt) = enter_attempt(&run, r.rank, r.world_size, timeout, &claim_key)?;
            if r.rank == 0 {
                log::debug!("joining attempt {attempt} of torchrun run {run_id:?} at {master}");
            }
            (store, None)
        }
        _ => {
            let server = (r.rank == 0)
                .then(|| host(r, master, options))
                .transpose()?;
            let store = Store::connect(master, &options.token, r.rank, timeout)
                .map_err(|e| name_a_collision(e, r))?;
            (store, server)
        }
    };
    let job = claim(&store, r)?;
    Ok(Joined {
        store: Arc::new(store),
        server,
        job,
    })
}

/// Rank 0: serves the store on the master's port.
fn host(r: &Rendezvous, master: SocketAddr, options: &InitConfig) -> Result<Arc<StoreServer>> {
    let bind_ip = if master.ip().is_loopback() {
        master.ip()
    } else {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    };
    let token = options.token.as_str();
    match StoreServer::bind(SocketAddr::new(bind_ip, master.port()), token) {
        Ok(s) => Ok(Arc::new(s)),
        Err(Error::PortInUse { addr }) => Err(explain_port_in_use(r, master, token, addr)),
        Err(e) => Err(e),
    }
}

/// Claims this rank and agrees on the world size and the job's id.
fn claim(store: &Store, r: &Rendezvous) -> Result<u64> {
    let nonce = fresh_seed().to_le_bytes();
    let owner = store.compare_set(&claim_key(r.rank), None, &nonce)?;
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
    Ok(job)
}

/// "MASTER_PORT 21234 (derived from SLURM_JOB_ID=5 and SLURM_STEP_ID=1)", for messages.
fn port_named(r: &Rendezvous) -> String {
    match r.launcher.port_origin() {
        Some(origin) => format!("MASTER_PORT {} ({origin})", r.master_port),
        None => format!("MASTER_PORT {}", r.master_port),
    }
}

/// A taken master port is either another program's (another job's, when the port was
/// derived), or a second rank 0 of this job's: only this job's store answers the probe at
/// once.
fn explain_port_in_use(r: &Rendezvous, master: SocketAddr, token: &str, addr: String) -> Error {
    let probe = Store::probe(master, token, std::time::Duration::from_millis(500));
    let claimed = probe
        .and_then(|s| s.check(&[&claim_key(0)]).ok())
        .unwrap_or(false);
    if claimed {
        return Error::Rendezvous {
            detail: "rank 0 is already claimed by another process: two processes were started \
                     with RANK=0"
                .into(),
        };
    }
    match r.launcher.port_origin() {
        Some(_) => Error::Rendezvous {
            detail: format!(
                "port collision: rank 0 cannot serve the store on {addr}, {}, because another \
                 program holds that port, probably another job (or job step) whose ids gave \
                 the same port. Set MASTER_PORT to a free port for this job",
                port_named(r)
            ),
        },
        None => Error::PortInUse { addr },
    }
}

/// Under a launcher whose job ids make the token (Slurm, mpirun), a store that refuses this
/// job's token at the master's port is another job's: say that the jobs collided on the port,
/// rather than only that a token differs.
fn name_a_collision(e: Error, r: &Rendezvous) -> Error {
    let tokens_from_job_ids = matches!(r.launcher, Launcher::Slurm { .. } | Launcher::Mpi { .. });
    match e {
        Error::Refused { peer, reason }
            if tokens_from_job_ids && reason.starts_with("wrong job token") =>
        {
            Error::Rendezvous {
                detail: format!(
                    "port collision: {peer} belongs to another job (it refused this job's \
                     token: {reason}). Two jobs meet on {}; give this one another MASTER_PORT",
                    port_named(r)
                ),
            }
        }
        other => other,
    }
}
