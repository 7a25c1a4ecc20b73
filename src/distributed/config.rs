//! How a process group is made: the backend and the timeouts ([`InitConfig`]).

use crate::error::{Error, Result};
use std::fmt;
use std::time::Duration;

/// The transport under a process group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Sockets and host memory (the gloo analogue): CPU tensors directly, CUDA tensors staged
    /// through the host. TCP across machines, Unix-domain sockets between ranks of one machine.
    Tcp,
    /// Threads of one process sharing memory.
    InProcess,
    /// NVIDIA's NCCL on candle's CUDA stream (feature `nccl`).
    Nccl,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Tcp => "tcp",
            Self::InProcess => "in-process",
            Self::Nccl => "nccl",
        })
    }
}

/// How the TCP backend all-reduces ([`InitConfig::algorithm`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Hierarchical when the group spans at least 2 machines with the same number of ranks on
    /// each, at least 2; the ring otherwise.
    #[default]
    Auto,
    /// One ring through every rank.
    Ring,
    /// Reduce inside each machine, all-reduce between machines (one ring per local index,
    /// striped across the local ranks), gather inside each machine. Needs the same number of
    /// ranks on every machine.
    Hierarchical,
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Ring => "ring",
            Self::Hierarchical => "hierarchical",
        })
    }
}

/// Timeouts and choices for creating a process group. `Default` reads nothing from the
/// environment; [`InitConfig::from_env`] reads `CANDLE_PARALLEL_*` variables (the job token
/// among them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InitConfig {
    /// The backend; `None` picks NCCL for CUDA devices (with the `nccl` feature), else TCP.
    pub backend: Option<Backend>,
    /// The longest a collective waits for a live peer (PyTorch's default: 30 minutes).
    pub timeout: Duration,
    /// The longest a peer may be silent before it counts as lost (default 30 s). Peers send
    /// heartbeats, so only a dead, stopped or unreachable process is ever this silent.
    pub peer_timeout: Duration,
    /// The longest to wait for every rank to join (default 5 minutes).
    pub rendezvous_timeout: Duration,
    /// The job token every connection must present (default: none).
    pub token: String,
    /// Let ranks on the same machine talk over Unix-domain sockets, about twice as fast as TCP
    /// over loopback (default true; `CANDLE_PARALLEL_UNIX_SOCKETS=0` turns it off in
    /// [`InitConfig::from_env`]). Only the TCP backend (and NCCL's control links) use it.
    pub unix_sockets: bool,
    /// Let neighbouring ranks on the same machine exchange collective data through shared
    /// memory instead of sockets (default true, Linux; needs `unix_sockets`;
    /// `CANDLE_PARALLEL_SHM=0` turns it off in [`InitConfig::from_env`]).
    pub shared_memory: bool,
    /// The TCP backend's all-reduce algorithm (default [`Algorithm::Auto`];
    /// `CANDLE_PARALLEL_ALGORITHM=auto|ring|hierarchical` in [`InitConfig::from_env`]). Other
    /// backends choose their own.
    pub algorithm: Algorithm,
}

/// The former name of [`InitConfig`].
#[deprecated(since = "0.1.0", note = "renamed `InitConfig`")]
pub type InitOptions = InitConfig;

impl Default for InitConfig {
    fn default() -> Self {
        Self {
            backend: None,
            timeout: Duration::from_secs(30 * 60),
            peer_timeout: Duration::from_secs(30),
            rendezvous_timeout: Duration::from_secs(300),
            token: String::new(),
            unix_sockets: true,
            shared_memory: true,
            algorithm: Algorithm::Auto,
        }
    }
}

/// The environment variable carrying the job token, set by `candle-run`.
pub const TOKEN_VAR: &str = "CANDLE_PARALLEL_TOKEN";

impl InitConfig {
    /// The defaults, with what the environment sets:
    ///
    /// | variable | sets | values |
    /// |---|---|---|
    /// | `CANDLE_PARALLEL_TOKEN` | `token` | any text (set by `candle-run`) |
    /// | `CANDLE_PARALLEL_BACKEND` | `backend` | `tcp`, `nccl` |
    /// | `CANDLE_PARALLEL_TIMEOUT` | `timeout` | seconds |
    /// | `CANDLE_PARALLEL_PEER_TIMEOUT` | `peer_timeout` | seconds |
    /// | `CANDLE_PARALLEL_RENDEZVOUS_TIMEOUT` | `rendezvous_timeout` | seconds |
    /// | `CANDLE_PARALLEL_UNIX_SOCKETS` | `unix_sockets` | `0`, `1` |
    /// | `CANDLE_PARALLEL_SHM` | `shared_memory` | `0`, `1` |
    /// | `CANDLE_PARALLEL_ALGORITHM` | `algorithm` | `auto`, `ring`, `hierarchical` |
    ///
    /// A value that does not parse is an error naming the variable.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// As [`InitConfig::from_env`], reading variables through `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let bad = |name: &str, value: &str, want: &str| Error::Config {
            what: format!("environment variable {name}"),
            detail: format!("{value:?} is not {want}"),
        };
        let seconds = |name: &str, default: Duration| -> Result<Duration> {
            match get(name) {
                None => Ok(default),
                Some(v) => match v.trim().parse::<f64>() {
                    Ok(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Duration::from_secs_f64(s)),
                    _ => Err(bad(name, &v, "a positive number of seconds")),
                },
            }
        };
        let switch = |name: &str| -> Result<bool> {
            match get(name).as_deref().map(str::trim) {
                None | Some("1") | Some("true") => Ok(true),
                Some("0") | Some("false") => Ok(false),
                Some(v) => Err(bad(name, v, "0 or 1")),
            }
        };
        let backend = match get(BACKEND_VAR).as_deref().map(str::trim) {
            None | Some("") => None,
            Some("tcp") => Some(Backend::Tcp),
            Some("nccl") => Some(Backend::Nccl),
            Some(v) => return Err(bad(BACKEND_VAR, v, "tcp or nccl")),
        };
        let algorithm = match get(ALGORITHM_VAR).as_deref().map(str::trim) {
            None | Some("") | Some("auto") => Algorithm::Auto,
            Some("ring") => Algorithm::Ring,
            Some("hierarchical") => Algorithm::Hierarchical,
            Some(v) => return Err(bad(ALGORITHM_VAR, v, "auto, ring or hierarchical")),
        };
        let d = Self::default();
        Ok(Self {
            backend,
            timeout: seconds("CANDLE_PARALLEL_TIMEOUT", d.timeout)?,
            peer_timeout: seconds("CANDLE_PARALLEL_PEER_TIMEOUT", d.peer_timeout)?,
            rendezvous_timeout: seconds(RENDEZVOUS_TIMEOUT_VAR, d.rendezvous_timeout)?,
            token: get(TOKEN_VAR).unwrap_or_default(),
            unix_sockets: switch("CANDLE_PARALLEL_UNIX_SOCKETS")?,
            shared_memory: switch("CANDLE_PARALLEL_SHM")?,
            algorithm,
        })
    }
}

/// The environment variable choosing the backend (`tcp` or `nccl`).
pub const BACKEND_VAR: &str = "CANDLE_PARALLEL_BACKEND";

/// The variable that sizes candle's CPU thread pool (rayon's), which rayon ignores silently
/// when it is not a number.
pub const THREADS_VAR: &str = "RAYON_NUM_THREADS";

/// OpenMP's thread count, which torchrun sets for its workers (to 1 when it starts several on
/// a machine and it is unset) and which users set under srun and mpirun: it sizes each rank's
/// compute pool when [`THREADS_VAR`] is unset ([`honour_omp_num_threads`]).
pub const OMP_THREADS_VAR: &str = "OMP_NUM_THREADS";

/// Checks `RAYON_NUM_THREADS`'s value (`None`: unset): rayon itself falls back to one thread
/// per core, without a word, when it is not a positive number.
pub fn check_threads_var(value: Option<&str>) -> Result<()> {
    match value.map(str::trim) {
        None => Ok(()),
        Some(v) if v.parse::<usize>().is_ok_and(|n| n > 0) => Ok(()),
        Some(v) => Err(Error::Config {
            what: format!("environment variable {THREADS_VAR}"),
            detail: format!(
                "{v:?} is not a number of threads (rayon would ignore it and use every core); \
                 set a positive integer or unset it"
            ),
        }),
    }
}

/// The threads `OMP_NUM_THREADS` asks for: "4", or "4,2" (a count per nesting level, of which
/// the first sizes the pool).
pub fn omp_threads(value: &str) -> Result<usize> {
    let first = value.split(',').next().unwrap_or("").trim();
    match first.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(Error::Config {
            what: format!("environment variable {OMP_THREADS_VAR}"),
            detail: format!(
                "{value:?} is not a number of threads; set a positive integer (or \
                 {THREADS_VAR}, which wins) or unset it"
            ),
        }),
    }
}

/// Sizes this process's compute pools from `OMP_NUM_THREADS` when `RAYON_NUM_THREADS` is
/// unset, as torch sizes its intra-op pool: sets `RAYON_NUM_THREADS` (which candle reads for its
/// own pool and its matrix products, and rayon for its global pool) and starts rayon's global
/// pool with that many threads. Returns the count when it applied one. [`ProcessGroup::from_env`]
/// and `launch::spawn`'s ranks call it first thing; call it yourself before any tensor work
/// when a program computes before joining its group. A value that is not a number is reported
/// (`log`) and ignored.
///
/// [`ProcessGroup::from_env`]: super::ProcessGroup::from_env
pub fn honour_omp_num_threads() -> Option<usize> {
    if std::env::var_os(THREADS_VAR).is_some() {
        return None;
    }
    let value = std::env::var(OMP_THREADS_VAR).ok()?;
    let n = match omp_threads(&value) {
        Ok(n) => n,
        Err(e) => {
            // Said once: every process group, launch and `threads::in_pool` asks again.
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| log::warn!("{e}; ignored"));
            return None;
        }
    };
    // Before any other thread reads the environment: this runs first thing in a rank.
    std::env::set_var(THREADS_VAR, n.to_string());
    let built = build_global_pool(n);
    if !built && rayon::current_num_threads() != n {
        log::warn!(
            "{OMP_THREADS_VAR}={n}, but rayon's global pool already runs {} threads (tensor work \
             started before the process group was made): it sizes candle's own pool and \
             matrix products only; call distributed::honour_omp_num_threads() first thing in \
             main, or set {THREADS_VAR}",
            rayon::current_num_threads()
        );
    }
    Some(n)
}

/// Whether this crate started rayon's global pool (with [`WORKER_STACK`]).
static POOL_BUILT_HERE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Starts rayon's global pool with `n` workers of [`WORKER_STACK`]; `false` where it runs
/// already.
pub fn build_global_pool(n: usize) -> bool {
    let built = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .stack_size(WORKER_STACK)
        .build_global()
        .is_ok();
    if built {
        POOL_BUILT_HERE.store(true, std::sync::atomic::Ordering::SeqCst);
    }
    built
}

/// Whether [`build_global_pool`] started rayon's global pool (its workers have
/// [`WORKER_STACK`]); `false` where something else started it first.
pub fn global_pool_built_here() -> bool {
    POOL_BUILT_HERE.load(std::sync::atomic::Ordering::SeqCst)
}

/// The stack of each worker of rayon's global pool when this crate builds it: the main thread's
/// 8 MiB, as a training loop may run on a worker ([`crate::threads::in_pool`]) and candle's
/// backward walks the graph recursively. Reserved, not touched, until used.
pub const WORKER_STACK: usize = 8 << 20;

/// The environment variable choosing the TCP backend's all-reduce algorithm (`auto`, `ring`,
/// `hierarchical`).
pub const ALGORITHM_VAR: &str = "CANDLE_PARALLEL_ALGORITHM";

/// The environment variable bounding the wait for every rank to join, in seconds.
pub const RENDEZVOUS_TIMEOUT_VAR: &str = "CANDLE_PARALLEL_RENDEZVOUS_TIMEOUT";

/// An environment made of `pairs`, for the tests of the `from_vars` readers.
#[cfg(test)]
pub(crate) fn test_vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: std::collections::HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| map.get(k).cloned()
}

#[cfg(test)]
mod tests {
    use super::test_vars as vars;
    use super::*;

    #[test]
    fn the_environment_sets_the_options_and_bad_values_are_named() {
        let o = InitConfig::from_vars(vars(&[
            ("CANDLE_PARALLEL_RENDEZVOUS_TIMEOUT", "2.5"),
            ("CANDLE_PARALLEL_BACKEND", "tcp"),
            ("CANDLE_PARALLEL_SHM", "0"),
            ("CANDLE_PARALLEL_TOKEN", "t"),
            ("CANDLE_PARALLEL_ALGORITHM", "hierarchical"),
        ]))
        .unwrap();
        assert_eq!(o.rendezvous_timeout, Duration::from_millis(2500));
        assert_eq!(o.backend, Some(Backend::Tcp));
        assert!(!o.shared_memory && o.unix_sockets);
        assert_eq!(o.token, "t");
        assert_eq!(o.algorithm, Algorithm::Hierarchical);
        assert_eq!(
            InitConfig::from_vars(vars(&[])).unwrap(),
            InitConfig::default()
        );
        for (name, value) in [
            ("CANDLE_PARALLEL_RENDEZVOUS_TIMEOUT", "soon"),
            ("CANDLE_PARALLEL_PEER_TIMEOUT", "-1"),
            ("CANDLE_PARALLEL_BACKEND", "gloo"),
            ("CANDLE_PARALLEL_UNIX_SOCKETS", "yes"),
            ("CANDLE_PARALLEL_ALGORITHM", "tree"),
        ] {
            let err = InitConfig::from_vars(vars(&[(name, value)]))
                .unwrap_err()
                .to_string();
            assert!(err.contains(name) && err.contains(value), "{err}");
        }
    }

    #[test]
    fn omp_thread_counts_are_read_as_openmp_reads_them() {
        assert_eq!(omp_threads("4").unwrap(), 4);
        assert_eq!(omp_threads(" 2,1").unwrap(), 2);
        for v in ["", "0", "many", "-1"] {
            let err = omp_threads(v).unwrap_err().to_string();
            assert!(err.contains("OMP_NUM_THREADS"), "{err}");
        }
    }

    #[test]
    fn a_thread_count_that_rayon_would_ignore_is_named() {
        assert!(check_threads_var(None).is_ok());
        assert!(check_threads_var(Some("4")).is_ok());
        for v in ["x", "0", "-1", ""] {
            let err = check_threads_var(Some(v)).unwrap_err().to_string();
            assert!(
                err.contains("RAYON_NUM_THREADS") && err.contains(&format!("{v:?}")),
                "{err}"
            );
        }
    }
}
