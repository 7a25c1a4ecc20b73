//! How a process group is made: the backend and the timeouts ([`InitOptions`]).

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

/// Timeouts and choices for creating a process group. `Default` reads nothing from the
/// environment; [`InitOptions::from_env`] takes the job token from `CANDLE_PARALLEL_TOKEN`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InitOptions {
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
    /// [`InitOptions::from_env`]). Only the TCP backend (and NCCL's control links) use it.
    pub unix_sockets: bool,
    /// Let neighbouring ranks on the same machine exchange collective data through shared
    /// memory instead of sockets (default true, Linux; needs `unix_sockets`;
    /// `CANDLE_PARALLEL_SHM=0` turns it off in [`InitOptions::from_env`]).
    pub shared_memory: bool,
}

impl Default for InitOptions {
    fn default() -> Self {
        Self {
            backend: None,
            timeout: Duration::from_secs(30 * 60),
            peer_timeout: Duration::from_secs(30),
            rendezvous_timeout: Duration::from_secs(300),
            token: String::new(),
            unix_sockets: true,
            shared_memory: true,
        }
    }
}

/// The environment variable carrying the job token, set by `candle-run`.
pub const TOKEN_VAR: &str = "CANDLE_PARALLEL_TOKEN";

impl InitOptions {
    /// The defaults, with the token from `CANDLE_PARALLEL_TOKEN` when it is set, and Unix
    /// sockets (or shared memory) off when `CANDLE_PARALLEL_UNIX_SOCKETS` (`CANDLE_PARALLEL_SHM`)
    /// is `0`.
    pub fn from_env() -> Self {
        Self {
            token: std::env::var(TOKEN_VAR).unwrap_or_default(),
            unix_sockets: std::env::var("CANDLE_PARALLEL_UNIX_SOCKETS").map_or(true, |v| v != "0"),
            shared_memory: std::env::var("CANDLE_PARALLEL_SHM").map_or(true, |v| v != "0"),
            ..Self::default()
        }
    }
}
