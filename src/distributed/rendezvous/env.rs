//! Reading where to meet from the environment a launcher gave ([`Rendezvous::from_env`]).
//!
//! | launcher | recognised by | rank, world, local rank and size | master and port |
//! |---|---|---|---|
//! | torchrun, candle-run, by hand | `RANK` | `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE` | `MASTER_ADDR`, `MASTER_PORT`; torchrun's agent serves the store when `TORCHELASTIC_USE_AGENT_STORE=True` |
//! | Open MPI's `mpirun` | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}` | see below |
//! | MPICH's `mpiexec` (hydra) | `PMI_RANK` and `MPI_LOCALRANKID` | `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`, `MPI_LOCALNRANKS` | see below |
//! | Slurm's `srun` | `SLURM_PROCID` | `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, this node's share of `SLURM_STEP_TASKS_PER_NODE` | `MASTER_ADDR` or the step's first node (`SLURM_STEP_NODELIST`); `MASTER_PORT` or one derived from `SLURM_JOB_ID` and `SLURM_STEP_ID` |
//!
//! MPI is looked at before Slurm: `mpirun` inside an allocation leaves the batch step's
//! `SLURM_PROCID` (0 in every rank) in its ranks' environment.
//!
//! mpirun tells its ranks nothing about where rank 0 runs, and calling MPI to find out would
//! tie the crate to an MPI library. So, without `MASTER_ADDR`, the ranks meet on 127.0.0.1
//! when they all run on one machine (the local size is the world size), and the job fails with
//! what to export when they do not (`mpirun -x MASTER_ADDR=<rank 0's host>`). Without
//! `MASTER_PORT`, the port is derived from what all ranks of the job share: Open MPI's job id
//! (`OMPI_MCA_ess_base_jobid`, else `PMIX_NAMESPACE`), or, under hydra on one machine, the pid
//! of its proxy (`hydra_pmi_proxy`, every rank's parent). The same id makes the job token
//! (see [`Launcher::default_token`]), so another job that lands on the port is refused.

use super::{config, parse_port, Launcher, Rendezvous, START_HINT};
use crate::error::Result;

/// The ports a derived port is taken from: above the usual services, below Linux's ephemeral
/// range (32768 and up), so that it rarely meets a port the kernel handed out.
const DERIVED_PORTS: (u16, u16) = (20_000, 32_000);

/// A port in [`DERIVED_PORTS`] for the job named `key`.
fn derived_port(key: &str) -> u16 {
    let span = u64::from(DERIVED_PORTS.1 - DERIVED_PORTS.0);
    DERIVED_PORTS.0 + (crate::rng::fnv1a(key.as_bytes()) % span) as u16
}

/// The port of Slurm step `step` of job `job`: steps of one job get different ports (for fewer
/// than 12000 steps), so that two steps run at the same time meet on their own stores.
fn slurm_port(job: u64, step: u64) -> u16 {
    let span = u64::from(DERIVED_PORTS.1 - DERIVED_PORTS.0);
    let spread = crate::rng::fnv1a(&job.to_le_bytes());
    DERIVED_PORTS.0 + (spread.wrapping_add(step) % span) as u16
}

/// The environment, read through `get`.
struct Vars<G>(G);

impl<G: Fn(&str) -> Option<String>> Vars<G> {
    fn get(&self, name: &str) -> Option<String> {
        (self.0)(name).filter(|v| !v.trim().is_empty())
    }

    fn num(&self, name: &str) -> Result<Option<usize>> {
        self.get(name)
            .map(|v| {
                v.trim().parse::<usize>().map_err(|_| {
                    config(
                        format!("environment variable {name}"),
                        format!("{v:?} is not a non-negative integer"),
                    )
                })
            })
            .transpose()
    }

    fn required(&self, name: &str) -> Result<usize> {
        self.num(name)?.ok_or_else(|| {
            config(
                format!("environment variable {name}"),
                format!("not set; {START_HINT}"),
            )
        })
    }

    fn port(&self) -> Result<Option<u16>> {
        self.get("MASTER_PORT")
            .map(|p| parse_port(&p, "environment variable MASTER_PORT"))
            .transpose()
    }
}

impl Rendezvous {
    /// Reads the environment of the launcher that started this process: torchrun's variables
    /// (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`,
    /// and `TORCHELASTIC_USE_AGENT_STORE`), else Open MPI's or MPICH's (`mpirun`), else Slurm's
    /// (`srun`); see the table in this module. Without `LOCAL_RANK`/`LOCAL_WORLD_SIZE`, one
    /// machine is assumed.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// As [`Rendezvous::from_env`], reading variables through `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let v = Vars(get);
        let r = if v.get("RANK").is_some() {
            torchrun(&v)?
        } else if v.get("OMPI_COMM_WORLD_RANK").is_some() {
            open_mpi(&v)?
        } else if v.get("PMI_RANK").is_some() && v.get("MPI_LOCALRANKID").is_some() {
            hydra(&v)?
        } else if v.get("SLURM_PROCID").is_some() {
            slurm(&v)?
        } else {
            torchrun(&v)?
        };
        r.validate()?;
        Ok(r)
    }
}

/// torchrun's variables (also candle-run's, Kubeflow's, or set by hand).
fn torchrun<G: Fn(&str) -> Option<String>>(v: &Vars<G>) -> Result<Rendezvous> {
    let (rank, world_size) = (v.required("RANK")?, v.required("WORLD_SIZE")?);
    let missing = |name: &str| {
        config(
            format!("environment variable {name}"),
            format!("not set; {START_HINT}"),
        )
    };
    let master_addr = v.get("MASTER_ADDR").ok_or_else(|| missing("MASTER_ADDR"))?;
    let master_port = v.port()?.ok_or_else(|| missing("MASTER_PORT"))?;
    // torch's own test (`_torchelastic_use_agent_store`): exactly "True".
    let launcher = if v.get("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Some("True") {
        Launcher::TorchrunAgent {
            run_id: v
                .get("TORCHELASTIC_RUN_ID")
                .unwrap_or_else(|| "none".into()),
        }
    } else {
        Launcher::Given
    };
    Ok(Rendezvous {
        master_addr,
        master_port,
        rank,
        world_size,
        local_rank: v.num("LOCAL_RANK")?.unwrap_or(rank),
        local_world_size: v.num("LOCAL_WORLD_SIZE")?.unwrap_or(world_size),
        launcher,
    })
}

/// Slurm's variables, for a task started by `srun`.
fn slurm<G: Fn(&str) -> Option<String>>(v: &Vars<G>) -> Result<Rendezvous> {
    let (rank, world_size) = (v.required("SLURM_PROCID")?, v.required("SLURM_NTASKS")?);
    let job = v.required("SLURM_JOB_ID")? as u64;
    let step = v
        .num("SLURM_STEP_ID")?
        .or(v.num("SLURM_STEPID")?)
        .map(|s| s as u64);
    let node = v.num("SLURM_NODEID")?.unwrap_or(0);
    let local_world_size = ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]
        .iter()
        .find_map(|name| v.get(name))
        .and_then(|list| tasks_on_node(&list, node))
        .or(v.num("SLURM_NTASKS_PER_NODE")?)
        .unwrap_or(world_size);
    let master_addr = match v.get("MASTER_ADDR") {
        Some(a) => a,
        None => [
            "SLURM_STEP_NODELIST",
            "SLURM_JOB_NODELIST",
            "SLURM_NODELIST",
        ]
        .iter()
        .find_map(|name| v.get(name))
        .and_then(|list| first_slurm_host(&list))
        .ok_or_else(|| {
            config(
                "environment variable MASTER_ADDR",
                "not set, and no SLURM_STEP_NODELIST or SLURM_JOB_NODELIST to take the \
                     first node from",
            )
        })?,
    };
    let given_port = v.port()?;
    Ok(Rendezvous {
        master_addr,
        master_port: given_port.unwrap_or_else(|| slurm_port(job, step.unwrap_or(0))),
        rank,
        world_size,
        local_rank: v.num("SLURM_LOCALID")?.unwrap_or(0),
        local_world_size,
        launcher: Launcher::Slurm {
            job,
            step,
            derived_port: given_port.is_none(),
        },
    })
}

/// Open MPI's variables, for a rank started by its `mpirun`.
fn open_mpi<G: Fn(&str) -> Option<String>>(v: &Vars<G>) -> Result<Rendezvous> {
    let rank = v.required("OMPI_COMM_WORLD_RANK")?;
    let world_size = v.required("OMPI_COMM_WORLD_SIZE")?;
    let local_rank = v.num("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(rank);
    let local_world_size = v.num("OMPI_COMM_WORLD_LOCAL_SIZE")?.unwrap_or(world_size);
    let job = v
        .get("OMPI_MCA_ess_base_jobid")
        .or_else(|| v.get("PMIX_NAMESPACE"));
    mpi(
        v,
        "Open MPI",
        job,
        rank,
        world_size,
        local_rank,
        local_world_size,
    )
}

/// MPICH's hydra variables, for a rank started by its `mpiexec`.
fn hydra<G: Fn(&str) -> Option<String>>(v: &Vars<G>) -> Result<Rendezvous> {
    let rank = v.required("PMI_RANK")?;
    let world_size = v.required("PMI_SIZE")?;
    let local_rank = v.required("MPI_LOCALRANKID")?;
    let local_world_size = v.num("MPI_LOCALNRANKS")?.unwrap_or(world_size);
    // The proxy is only shared by the ranks of one machine.
    let job = (local_world_size == world_size)
        .then(hydra_proxy)
        .flatten()
        .map(|pid| pid.to_string());
    mpi(
        v,
        "MPICH",
        job,
        rank,
        world_size,
        local_rank,
        local_world_size,
    )
}

/// An MPI job's rendezvous: the master and the port as the module says.
fn mpi<G: Fn(&str) -> Option<String>>(
    v: &Vars<G>,
    flavour: &'static str,
    job: Option<String>,
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
) -> Result<Rendezvous> {
    let one_machine = local_world_size == world_size;
    let master_addr = match v.get("MASTER_ADDR") {
        Some(a) => a,
        None if one_machine => "127.0.0.1".into(),
        None => {
            return Err(config(
                "environment variable MASTER_ADDR",
                format!(
                    "not set, and this {flavour} job's {world_size} ranks run on several \
                     machines ({local_world_size} on this one): mpirun does not tell them \
                     where rank 0 runs. Export it to every rank, e.g. `mpirun -x \
                     MASTER_ADDR=<rank 0's host> ...` (Open MPI) or `mpiexec -genv MASTER_ADDR \
                     <host> ...` (MPICH)"
                ),
            ))
        }
    };
    let given_port = v.port()?;
    let master_port = match (given_port, &job) {
        (Some(p), _) => p,
        (None, Some(job)) => derived_port(&format!("{flavour}/{job}")),
        (None, None) => {
            return Err(config(
                "environment variable MASTER_PORT",
                format!(
                    "not set, and this {flavour} job gives its ranks no id they all share to \
                     derive one from; export MASTER_PORT to every rank"
                ),
            ))
        }
    };
    Ok(Rendezvous {
        master_addr,
        master_port,
        rank,
        world_size,
        local_rank,
        local_world_size,
        launcher: Launcher::Mpi {
            flavour,
            job: job.unwrap_or_default(),
            derived_port: given_port.is_none(),
        },
    })
}

/// The pid of hydra's proxy (`hydra_pmi_proxy`), the nearest such ancestor of this process
/// (a rank may run under a wrapper script); its parent when there is none.
fn hydra_proxy() -> Option<u32> {
    let parent_of = |pid: u32| -> Option<(String, u32)> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let (head, tail) = stat.rsplit_once(')')?;
        let comm = head.split_once('(')?.1.to_string();
        let ppid = tail.split_whitespace().nth(1)?.parse().ok()?;
        Some((comm, ppid))
    };
    let me = std::process::id();
    let parent = parent_of(me)?.1;
    let mut pid = parent;
    for _ in 0..16 {
        let (comm, ppid) = parent_of(pid)?;
        if comm.starts_with("hydra_pmi_proxy") {
            return Some(pid);
        }
        if ppid <= 1 {
            break;
        }
        pid = ppid;
    }
    Some(parent)
}

/// How many tasks node `node` runs, from a Slurm task count list: "2(x3),1" gives 2 for nodes
/// 0 to 2 and 1 for node 3.
fn tasks_on_node(list: &str, node: usize) -> Option<usize> {
    let mut first = 0;
    for part in list.trim().split(',') {
        let (count, repeat) = match part.split_once("(x") {
            Some((c, r)) => (c, r.trim_end_matches(')').parse::<usize>().ok()?),
            None => (part, 1),
        };
        let count: usize = count.trim().parse().ok()?;
        if node < first + repeat {
            return Some(count);
        }
        first += repeat;
    }
    None
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
                launcher: Launcher::Given,
            }
        );
    }

    #[test]
    fn torchruns_agent_store_is_used_only_when_it_says_true() {
        let base = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RUN_ID", "abc"),
        ];
        let with = |flag: &str| {
            let mut pairs = base.to_vec();
            pairs.push(("TORCHELASTIC_USE_AGENT_STORE", flag));
            Rendezvous::from_vars(vars(&pairs)).unwrap().launcher
        };
        assert_eq!(
            with("True"),
            Launcher::TorchrunAgent {
                run_id: "abc".into()
            }
        );
        assert_eq!(with("False"), Launcher::Given);
        assert_eq!(with("1"), Launcher::Given);
        assert_eq!(
            Rendezvous::from_vars(vars(&base)).unwrap().launcher,
            Launcher::Given
        );
    }

    #[test]
    fn slurm_variables_are_read_when_torchruns_are_absent() {
        let r = Rendezvous::from_vars(vars(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_STEP_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[07-09],cpu1"),
            ("SLURM_STEP_NODELIST", "gpu[08-09]"),
            ("SLURM_JOB_ID", "123456"),
            ("SLURM_STEP_ID", "2"),
        ]))
        .unwrap();
        assert_eq!(
            r.master_addr, "gpu08",
            "the step's first node, not the job's"
        );
        assert_eq!(r.master_port, slurm_port(123_456, 2));
        assert_eq!(
            (r.rank, r.world_size, r.local_rank, r.local_world_size),
            (5, 8, 1, 4)
        );
        assert_eq!(r.launcher.default_token().unwrap(), "slurm-123456.2");
        let origin = r.launcher.port_origin().unwrap();
        assert!(origin.contains("SLURM_STEP_ID=2"), "{origin}");
    }

    #[test]
    fn the_steps_of_one_slurm_job_meet_on_different_ports() {
        for job in [1u64, 77, 123_456, 9_999_999] {
            let ports: std::collections::BTreeSet<u16> =
                (0..64).map(|step| slurm_port(job, step)).collect();
            assert_eq!(ports.len(), 64, "job {job}");
            assert!(ports
                .iter()
                .all(|p| (DERIVED_PORTS.0..DERIVED_PORTS.1).contains(p)));
        }
    }

    #[test]
    fn a_slurm_task_count_list_gives_each_nodes_share() {
        assert_eq!(tasks_on_node("2(x3),1", 0), Some(2));
        assert_eq!(tasks_on_node("2(x3),1", 2), Some(2));
        assert_eq!(tasks_on_node("2(x3),1", 3), Some(1));
        assert_eq!(tasks_on_node("2(x3),1", 4), None);
        assert_eq!(tasks_on_node("4", 0), Some(4));
    }

    #[test]
    fn open_mpi_ranks_on_one_machine_meet_on_loopback_at_a_port_of_their_job() {
        let env = |rank: &'static str| {
            vars(&[
                ("OMPI_COMM_WORLD_RANK", rank),
                ("OMPI_COMM_WORLD_SIZE", "2"),
                ("OMPI_COMM_WORLD_LOCAL_RANK", rank),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
                ("OMPI_MCA_ess_base_jobid", "858521601"),
                // mpirun inside an allocation: the batch step's variables stay.
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_JOB_ID", "7"),
            ])
        };
        let (a, b) = (
            Rendezvous::from_vars(env("0")).unwrap(),
            Rendezvous::from_vars(env("1")).unwrap(),
        );
        assert_eq!((a.rank, b.rank, b.local_rank, b.world_size), (0, 1, 1, 2));
        assert_eq!(a.master_addr, "127.0.0.1");
        assert_eq!(a.master_port, b.master_port);
        assert!((DERIVED_PORTS.0..DERIVED_PORTS.1).contains(&a.master_port));
        assert_eq!(a.launcher.default_token().unwrap(), "openmpi-858521601");
    }

    #[test]
    fn mpi_ranks_on_several_machines_are_told_to_export_the_master() {
        let err = Rendezvous::from_vars(vars(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("PMIX_NAMESPACE", "prterun-h-1@1"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("MASTER_ADDR") && err.contains("mpirun -x"),
            "{err}"
        );
        let r = Rendezvous::from_vars(vars(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("PMIX_NAMESPACE", "prterun-h-1@1"),
            ("MASTER_ADDR", "node1"),
        ]))
        .unwrap();
        assert_eq!((r.master_addr.as_str(), r.local_world_size), ("node1", 2));
        // The port is the job's, the same on every machine.
        assert_eq!(r.master_port, derived_port("Open MPI/prterun-h-1@1"));
        // Hydra's proxy is one machine's: several need the port too.
        let err = Rendezvous::from_vars(vars(&[
            ("PMI_RANK", "3"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
            ("MASTER_ADDR", "node1"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(err.contains("MASTER_PORT"), "{err}");
    }

    #[test]
    fn mpich_ranks_on_one_machine_meet_at_a_port_of_their_proxy() {
        let r = Rendezvous::from_vars(vars(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
        ]))
        .unwrap();
        assert_eq!((r.rank, r.world_size, r.local_rank), (1, 2, 1));
        assert_eq!(r.master_addr, "127.0.0.1");
        let Launcher::Mpi { flavour, job, .. } = &r.launcher else {
            panic!("{:?}", r.launcher)
        };
        // Outside hydra, the parent stands in for the proxy.
        assert_eq!(*flavour, "MPICH");
        assert_eq!(job.parse::<u32>().ok(), hydra_proxy());
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
            (
                &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")],
                "SLURM_JOB_ID: not set",
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
