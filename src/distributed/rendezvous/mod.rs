//! The rendezvous: how the ranks of a job find each other.
//!
//! - [`Rendezvous`] (here) says where to meet: a rank's place in the job, the master's address
//!   and who serves the store there, from explicit values or a `tcp://` address, or (`env`)
//!   from the environment a launcher gave: torchrun's (and candle-run's), Slurm's, Open MPI's
//!   or MPICH's;
//! - [`store`]: the key-value store where the ranks meet, served by rank 0 or by torchrun's
//!   agent;
//! - `attempt`: a fresh key space for each attempt of a job in a store that outlives them
//!   (torchrun's, across `--max-restarts`);
//! - `join`: hosting or reaching the store, claiming a rank, agreeing on the job;
//! - `connect`: forming a group's mesh through the store;
//! - `group_path`: the name that keys a group's entries in the store and its connections;
//! - `world`: joining the job and connecting the world group's mesh, and the context that
//!   connects every later group's.

pub(crate) mod attempt;
pub(crate) mod connect;
mod env;
pub(crate) mod group_path;
pub(crate) mod join;
pub mod store;
pub(crate) mod world;

pub(crate) use group_path::GroupPath;

use crate::error::{Error, Result};
use std::net::{SocketAddr, ToSocketAddrs};

/// Where a rank is and where to meet the others: what torchrun, `candle-run`, Slurm and
/// mpirun put in the environment ([`Rendezvous::from_env`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendezvous {
    /// Host of the store: rank 0's, or torchrun's agent's (`MASTER_ADDR`).
    pub master_addr: String,
    /// Port of the store (`MASTER_PORT`).
    pub master_port: u16,
    /// This process's rank (`RANK`).
    pub rank: usize,
    /// The number of ranks (`WORLD_SIZE`).
    pub world_size: usize,
    /// The rank on this machine (`LOCAL_RANK`).
    pub local_rank: usize,
    /// The number of ranks on this machine (`LOCAL_WORLD_SIZE`).
    pub local_world_size: usize,
    /// Which launcher's environment this came from, and so who serves the store.
    pub launcher: Launcher,
}

/// The launcher whose environment a [`Rendezvous`] was read from: it decides who serves the
/// store, and what tells this job's store from another's on the same port.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Launcher {
    /// Values given explicitly, by a `tcp://` address, or by torchrun's variables without its
    /// agent's store (`candle-run`, Kubeflow's PyTorchJob, older torch, by hand): rank 0
    /// serves the store at the master's address.
    #[default]
    Given,
    /// torchrun, whose agent serves PyTorch's TCPStore at `MASTER_ADDR:MASTER_PORT`
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`): every rank joins it as a client, in a key space of
    /// the run's (`TORCHELASTIC_RUN_ID`) and attempt's own.
    TorchrunAgent {
        /// `TORCHELASTIC_RUN_ID`.
        run_id: String,
    },
    /// Slurm's `srun` (`SLURM_PROCID`): rank 0 serves the store.
    Slurm {
        /// `SLURM_JOB_ID`.
        job: u64,
        /// `SLURM_STEP_ID`, when set.
        step: Option<u64>,
        /// Whether the port was derived from the job and step ids (no `MASTER_PORT`).
        derived_port: bool,
    },
    /// `mpirun`/`mpiexec`: Open MPI's (`OMPI_COMM_WORLD_RANK`) or MPICH's hydra (`PMI_RANK`);
    /// rank 0 serves the store.
    Mpi {
        /// "Open MPI" or "MPICH".
        flavour: &'static str,
        /// What tells this job from others: Open MPI's job id, or the pid of hydra's proxy.
        job: String,
        /// Whether the port was derived from `job` (no `MASTER_PORT`).
        derived_port: bool,
    },
}

impl Launcher {
    /// The job token ranks present when none is given (`CANDLE_PARALLEL_TOKEN`): the
    /// launcher's job (and step) id, so that the ranks of another job or job step that reach
    /// this job's store on a shared port are refused as strangers, instead of claiming ranks.
    pub fn default_token(&self) -> Option<String> {
        match self {
            Self::Slurm { job, step, .. } => Some(match step {
                Some(s) => format!("slurm-{job}.{s}"),
                None => format!("slurm-{job}"),
            }),
            Self::Mpi { flavour, job, .. } => {
                Some(format!("{}-{job}", flavour.to_lowercase().replace(' ', "")))
            }
            Self::Given | Self::TorchrunAgent { .. } => None,
        }
    }

    /// Where the port came from, when it was derived: "derived from SLURM_JOB_ID=5 and
    /// SLURM_STEP_ID=1", for messages about a taken port.
    pub(crate) fn port_origin(&self) -> Option<String> {
        match self {
            Self::Slurm {
                job,
                step,
                derived_port: true,
            } => Some(match step {
                Some(s) => format!("derived from SLURM_JOB_ID={job} and SLURM_STEP_ID={s}"),
                None => format!("derived from SLURM_JOB_ID={job}"),
            }),
            Self::Mpi {
                flavour,
                job,
                derived_port: true,
            } => Some(format!("derived from {flavour}'s job {job}")),
            _ => None,
        }
    }
}

pub(crate) fn config(what: impl Into<String>, detail: impl Into<String>) -> Error {
    Error::Config {
        what: what.into(),
        detail: detail.into(),
    }
}

/// The most ranks a group may have.
pub const MAX_WORLD_SIZE: usize = 1 << 16;

const START_HINT: &str = "start the program with candle-run, torchrun, srun or mpirun, or set \
                          RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT";

impl Rendezvous {
    /// From `tcp://host:port` (as `init_method` in PyTorch), or `env://` for the environment.
    pub fn from_url(url: &str, rank: usize, world_size: usize) -> Result<Self> {
        if url == "env://" {
            return Self::from_env();
        }
        let rest = url.strip_prefix("tcp://").ok_or_else(|| {
            config(
                format!("init address {url:?}"),
                "use tcp://HOST:PORT (or env:// to read the environment)",
            )
        })?;
        let (host, port) = rest
            .rsplit_once(':')
            .filter(|(h, _)| !h.is_empty())
            .ok_or_else(|| config(format!("init address {url:?}"), "missing :PORT"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let r = Self {
            master_addr: host.to_string(),
            master_port: parse_port(port, &format!("init address {url:?}"))?,
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            launcher: Launcher::Given,
        };
        r.validate()?;
        Ok(r)
    }

    /// Checks that the numbers make sense together.
    pub fn validate(&self) -> Result<()> {
        if self.world_size == 0 {
            return Err(config("world size", "0: a group needs at least one rank"));
        }
        if self.world_size > MAX_WORLD_SIZE {
            return Err(config(
                "world size",
                format!(
                    "{} is above the limit of {MAX_WORLD_SIZE} ranks; check WORLD_SIZE (or \
                     SLURM_NTASKS)",
                    self.world_size
                ),
            ));
        }
        if self.rank >= self.world_size {
            return Err(config(
                format!("RANK {}", self.rank),
                format!(
                    "not below WORLD_SIZE {}: ranks are 0..{}",
                    self.world_size, self.world_size
                ),
            ));
        }
        if self.local_world_size == 0 || self.local_rank >= self.local_world_size {
            return Err(config(
                format!("LOCAL_RANK {}", self.local_rank),
                format!(
                    "not below LOCAL_WORLD_SIZE {}: local ranks are 0..{}",
                    self.local_world_size, self.local_world_size
                ),
            ));
        }
        if self.master_port == 0 {
            return Err(config(
                "master port",
                "0 is not a port to meet on; pick one",
            ));
        }
        Ok(())
    }

    /// The master's socket address (IPv4 preferred).
    pub fn master_socket(&self) -> Result<SocketAddr> {
        let addrs: Vec<SocketAddr> = (self.master_addr.as_str(), self.master_port)
            .to_socket_addrs()
            .map_err(|e| {
                config(
                    format!("MASTER_ADDR {:?}", self.master_addr),
                    format!("cannot be resolved: {e}"),
                )
            })?
            .collect();
        addrs
            .iter()
            .find(|a| a.is_ipv4())
            .or(addrs.first())
            .copied()
            .ok_or_else(|| {
                config(
                    format!("MASTER_ADDR {:?}", self.master_addr),
                    "resolves to no address",
                )
            })
    }
}

fn parse_port(value: &str, what: &str) -> Result<u16> {
    match value.trim().parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(config(what, format!("{value:?} is not a port (1..65535)"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_parsed() {
        let r = Rendezvous::from_url("tcp://127.0.0.1:2345", 1, 3).unwrap();
        assert_eq!(
            (r.master_addr.as_str(), r.master_port, r.rank),
            ("127.0.0.1", 2345, 1)
        );
        let r = Rendezvous::from_url("tcp://[::1]:80", 0, 1).unwrap();
        assert_eq!(r.master_addr, "::1");
        for bad in ["http://x:1", "tcp://nohost", "tcp://:12", "tcp://h:0"] {
            assert!(Rendezvous::from_url(bad, 0, 1).is_err(), "{bad}");
        }
    }
}
