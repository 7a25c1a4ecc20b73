//! Meeting: rank 0 hosts the store, every rank reaches it, claims its rank and agrees on the
//! job, then the ranks connect to each other. `ProcessGroup`'s constructors live here.

use super::group::{Backend, InitOptions, Inner, ProcessGroup};
use super::rendezvous::{config, Rendezvous};
use super::store::{Store, StoreServer};
use super::tcp::connect::{connect_mesh, Identity};
use super::tcp::mesh::MeshOptions;
use super::tcp::{Mesh, TcpComm};
use crate::error::{Error, Result};
use crate::rng::fresh_seed;
use candle_core::Device;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};

/// The store, reached (and on rank 0 hosted) for this rendezvous.
pub(crate) struct Meeting {
    pub store: Arc<Store>,
    pub server: Option<StoreServer>,
    pub job: u64,
}

/// Hosts (rank 0) or reaches the store, claims this rank, and agrees on the job.
pub(crate) fn meet(r: &Rendezvous, options: &InitOptions) -> Result<Meeting> {
    let master = r.master_socket()?;
    let token = options.token.as_str();
    let server = if r.rank == 0 {
        let bind_ip = if master.ip().is_loopback() {
            master.ip()
        } else {
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        };
        match StoreServer::bind(SocketAddr::new(bind_ip, master.port()), token) {
            Ok(s) => Some(s),
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
        return Err(Error::Rendezvous {
            detail: format!(
                "rank {} has WORLD_SIZE={} but an earlier rank has {}",
                r.rank,
                world,
                String::from_utf8_lossy(&agreed)
            ),
        });
    }
    let job = store.compare_set("job", None, &fresh_seed().to_le_bytes())?;
    let job = u64::from_le_bytes(job.as_slice().try_into().map_err(|_| Error::Rendezvous {
        detail: "the store holds an invalid job id".into(),
    })?);
    Ok(Meeting { store, server, job })
}

/// A taken master port is either another job's, or a second rank 0 of this one.
fn explain_port_in_use(master: SocketAddr, token: &str, addr: String) -> Error {
    let probe = Store::connect(master, token, 0, std::time::Duration::from_secs(2));
    let claimed = probe
        .ok()
        .and_then(|s| s.wait(&["rank/0"], std::time::Duration::from_secs(2)).ok())
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

/// Creates a TCP process group.
pub(crate) fn tcp_group(r: &Rendezvous, options: &InitOptions) -> Result<ProcessGroup> {
    let meeting = meet(r, options)?;
    let mesh = form_mesh(r, options, &meeting)?;
    Ok(ProcessGroup::from_inner(Inner {
        rank: r.rank,
        world_size: r.world_size,
        local_rank: r.local_rank,
        local_world_size: r.local_world_size,
        backend: Backend::Tcp,
        comm: Box::new(TcpComm { mesh }),
        seq: Mutex::new(0),
        store: Some(meeting.store),
        _server: meeting.server,
    }))
}

/// Connects every pair of ranks met through `meeting`.
pub(crate) fn form_mesh(r: &Rendezvous, options: &InitOptions, meeting: &Meeting) -> Result<Mesh> {
    let me = Identity {
        rank: r.rank,
        world: r.world_size,
        token: &options.token,
        job: meeting.job,
        unix: options.unix_sockets,
        shm: options.shared_memory,
    };
    let mesh_options = MeshOptions {
        timeout: options.timeout,
        peer_timeout: options.peer_timeout,
    };
    connect_mesh(
        &meeting.store,
        meeting.store.local_addr().ip(),
        &me,
        options.rendezvous_timeout,
        mesh_options,
    )
}

impl ProcessGroup {
    /// Joins the group described by torchrun's (or Slurm's) environment, with the job token
    /// from `CANDLE_PARALLEL_TOKEN`; the backend follows `device` (NCCL for CUDA with the `nccl`
    /// feature, else TCP).
    pub fn from_env(device: &Device) -> Result<Self> {
        Self::new(&Rendezvous::from_env()?, device, InitOptions::from_env())
    }

    /// Joins the group at `tcp://host:port` as `rank` of `world_size`.
    pub fn from_url(
        url: &str,
        rank: usize,
        world_size: usize,
        device: &Device,
        options: InitOptions,
    ) -> Result<Self> {
        Self::new(
            &Rendezvous::from_url(url, rank, world_size)?,
            device,
            options,
        )
    }

    /// Joins the group described by `rendezvous`.
    pub fn new(rendezvous: &Rendezvous, device: &Device, options: InitOptions) -> Result<Self> {
        rendezvous.validate()?;
        let backend = options
            .backend
            .unwrap_or(if device.is_cuda() && cfg!(feature = "nccl") {
                Backend::Nccl
            } else {
                Backend::Tcp
            });
        match backend {
            Backend::Tcp => tcp_group(rendezvous, &options),
            Backend::InProcess => Err(config(
                "backend",
                "in-process groups are made by dist::spawn (ranks are threads of one process)",
            )),
            #[cfg(feature = "nccl")]
            Backend::Nccl => super::nccl::nccl_group(rendezvous, device, &options),
            #[cfg(not(feature = "nccl"))]
            Backend::Nccl => Err(config(
                "backend",
                "NCCL needs candle-parallel built with the `nccl` feature",
            )),
        }
    }
}
