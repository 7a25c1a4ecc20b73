//! The rendezvous: how the ranks of a job find each other.
//!
//! - [`Rendezvous`] (here) says where to meet: a rank's place in the job and the master's
//!   address, from torchrun's or Slurm's environment, a `tcp://` address, or explicit values;
//! - [`store`]: the key-value store rank 0 hosts, where the ranks meet;
//! - `join`: hosting or reaching the store, claiming a rank, agreeing on the job;
//! - `connect`: forming a group's mesh through the store;
//! - `group_path`: the name that keys a group's entries in the store and its connections;
//! - `world`: joining the job and connecting the world group's mesh, and the context that
//!   connects every later group's.

pub(crate) mod connect;
pub(crate) mod group_path;
pub(crate) mod join;
pub mod store;
pub(crate) mod world;

pub(crate) use group_path::GroupPath;

use crate::error::{Error, Result};
use std::net::{SocketAddr, ToSocketAddrs};

/// Where a rank is and where to meet the others: what torchrun, `candle-run` and Slurm put in
/// the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendezvous {
    /// Host of rank 0, which runs the store (`MASTER_ADDR`).
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
}

pub(crate) fn config(what: impl Into<String>, detail: impl Into<String>) -> Error {
    Error::Config {
        what: what.into(),
        detail: detail.into(),
    }
}

/// The most ranks a group may have.
pub const MAX_WORLD_SIZE: usize = 1 << 16;

const START_HINT: &str = "start the program with candle-run, torchrun or srun, or set RANK, \
                          WORLD_SIZE, MASTER_ADDR and MASTER_PORT";

impl Rendezvous {
    /// Reads torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
    /// `MASTER_ADDR`, `MASTER_PORT`) or, when `RANK` is absent, Slurm's (`SLURM_PROCID`,
    /// `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE`). Under Slurm without
    /// `MASTER_ADDR`/`MASTER_PORT`, the master is the job's first node and the port is derived
    /// from `SLURM_JOB_ID`. Without `LOCAL_RANK`/`LOCAL_WORLD_SIZE`, one machine is assumed.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// As [`Rendezvous::from_env`], reading variables through `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let num = |name: &str| -> Result<Option<usize>> {
            get(name)
                .map(|v| {
                    v.trim().parse::<usize>().map_err(|_| {
                        config(
                            format!("environment variable {name}"),
                            format!("{v:?} is not a non-negative integer"),
                        )
                    })
                })
                .transpose()
        };
        let required = |name: &str| -> Result<usize> {
            num(name)?.ok_or_else(|| {
                config(
                    format!("environment variable {name}"),
                    format!("not set; {START_HINT}"),
                )
            })
        };
        let r = if get("RANK").is_some() || get("SLURM_PROCID").is_none() {
            let (rank, world_size) = (required("RANK")?, required("WORLD_SIZE")?);
            let master_addr = get("MASTER_ADDR").ok_or_else(|| {
                config(
                    "environment variable MASTER_ADDR",
                    format!("not set; {START_HINT}"),
                )
            })?;
            let port = get("MASTER_PORT").ok_or_else(|| {
                config(
                    "environment variable MASTER_PORT",
                    format!("not set; {START_HINT}"),
                )
            })?;
            Self {
                master_port: parse_port(&port, "environment variable MASTER_PORT")?,
                master_addr,
                rank,
                world_size,
                local_rank: num("LOCAL_RANK")?.unwrap_or(rank),
                local_world_size: num("LOCAL_WORLD_SIZE")?.unwrap_or(world_size),
            }
        } else {
            let (rank, world_size) = (required("SLURM_PROCID")?, required("SLURM_NTASKS")?);
            let per_node = get("SLURM_NTASKS_PER_NODE")
                .or_else(|| get("SLURM_TASKS_PER_NODE"))
                .and_then(|v| leading_number(&v));
            let master_addr = match get("MASTER_ADDR") {
                Some(a) => a,
                None => get("SLURM_JOB_NODELIST")
                    .or_else(|| get("SLURM_NODELIST"))
                    .and_then(|l| first_slurm_host(&l))
                    .ok_or_else(|| {
                        config(
                            "environment variable MASTER_ADDR",
                            "not set, and no SLURM_JOB_NODELIST to take the first node from",
                        )
                    })?,
            };
            let master_port = match get("MASTER_PORT") {
                Some(p) => parse_port(&p, "environment variable MASTER_PORT")?,
                None => {
                    let job = required("SLURM_JOB_ID")?;
                    20_000 + (job % 20_000) as u16
                }
            };
            Self {
                master_addr,
                master_port,
                rank,
                world_size,
                local_rank: num("SLURM_LOCALID")?.unwrap_or(0),
                local_world_size: per_node.unwrap_or(world_size),
            }
        };
        r.validate()?;
        Ok(r)
    }

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

/// `4` from "4", "4(x2)" or "4,2".
fn leading_number(v: &str) -> Option<usize> {
    let digits: String = v.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The first host of a Slurm node list: "node[03-05,9],gpu1" gives "node03".
pub(crate) fn first_slurm_host(list: &str) -> Option<String> {
    let list = list.trim();
    let end = list
        .char_indices()
        .scan(0i32, |depth, (i, c)| {
            match c {
                '[' => *depth += 1,
                ']' => *depth -= 1,
                _ => {}
            }
            Some((i, c, *depth))
        })
        .find(|&(_, c, depth)| c == ',' && depth == 0)
        .map_or(list.len(), |(i, _, _)| i);
    let first = &list[..end];
    let host = match first.split_once('[') {
        None => first.to_string(),
        Some((prefix, rest)) => {
            let (ranges, suffix) = rest.split_once(']')?;
            let lo = ranges.split([',', '-']).next()?;
            format!("{prefix}{lo}{suffix}")
        }
    };
    (!host.is_empty()).then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::config::test_vars as vars;

    #[test]
    fn torchrun_variables_are_read() {
        let r = Rendezvous::from_vars(vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap();
        assert_eq!(
            r,
            Rendezvous {
                master_addr: "10.0.0.1".into(),
                master_port: 29500,
                rank: 3,
                world_size: 8,
                local_rank: 1,
                local_world_size: 2,
            }
        );
    }

    #[test]
    fn slurm_variables_are_read_when_torchruns_are_absent() {
        let r = Rendezvous::from_vars(vars(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "4(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[07-08],cpu1"),
            ("SLURM_JOB_ID", "123456"),
        ]))
        .unwrap();
        assert_eq!(r.master_addr, "gpu07");
        assert_eq!(r.master_port, 20_000 + (123_456 % 20_000) as u16);
        assert_eq!(
            (r.rank, r.world_size, r.local_rank, r.local_world_size),
            (5, 8, 1, 4)
        );
    }

    #[test]
    fn bad_configuration_is_explained() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[], "RANK: not set; start the program with candle-run"),
            (
                &[("RANK", "x"), ("WORLD_SIZE", "2")],
                "\"x\" is not a non-negative integer",
            ),
            (
                &[
                    ("RANK", "2"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "1"),
                ],
                "RANK 2: not below WORLD_SIZE 2",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "0"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "1"),
                ],
                "world size: 0",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "1")],
                "MASTER_ADDR: not set",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "1"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "99999"),
                ],
                "\"99999\" is not a port",
            ),
        ];
        for (pairs, needle) in cases {
            let err = Rendezvous::from_vars(vars(pairs)).unwrap_err().to_string();
            assert!(err.contains(needle), "{pairs:?}: {err}");
        }
    }

    #[test]
    fn huge_world_sizes_are_refused_with_the_limit() {
        for world in ["65537", "4294967296", "18446744073709551615"] {
            let err = Rendezvous::from_vars(vars(&[
                ("RANK", "0"),
                ("WORLD_SIZE", world),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "1"),
            ]))
            .unwrap_err()
            .to_string();
            assert!(
                err.contains(world) && err.contains("limit of 65536"),
                "{err}"
            );
        }
        let ok = Rendezvous::from_vars(vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "65536"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ]));
        assert!(ok.is_ok());
    }

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

    #[test]
    fn slurm_node_lists_give_their_first_host() {
        assert_eq!(first_slurm_host("n1,n2").as_deref(), Some("n1"));
        assert_eq!(
            first_slurm_host("node[003-005,9]").as_deref(),
            Some("node003")
        );
        assert_eq!(first_slurm_host("a[1,2]-ib,b").as_deref(), Some("a1-ib"));
        assert_eq!(first_slurm_host("").as_deref(), None);
    }
}
