//! A mesh's state, which its handle, its threads and its collectives share: the channel to
//! each peer, and under one lock the peers' inboxes, whether they were seen or left, and why
//! the mesh broke.

use super::broken::Broken;
use super::options::{MeshOptions, OnLost};
use super::peer::{Frame, Peer, PeerWriter};
use super::shm_link::ShmLink;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// What the peers' threads and the collectives share, under one lock.
pub(super) struct State {
    pub(super) inbox: Vec<VecDeque<Frame>>,
    pub(super) last_seen: Vec<Instant>,
    pub(super) departed: Vec<bool>,
    pub(super) broken: Option<Broken>,
    pub(super) closing: bool,
    /// This rank is leaving the mesh (its handle is being dropped): a peer's abort or loss
    /// seen from now on is a consequence of its leaving, not a loss to report.
    pub(super) leaving: bool,
    /// Payload buffers for the reader threads to reuse.
    pub(super) pool: Vec<Vec<u8>>,
}

/// A mesh's state, shared by its handle and its threads.
pub(super) struct MeshState {
    pub(super) rank: usize,
    pub(super) world: usize,
    /// The channel to each peer (`None` for this rank).
    pub(super) peers: Vec<Option<Peer>>,
    pub(super) options: MeshOptions,
    pub(super) on_lost: OnLost,
    pub(super) epoch: Instant,
    pub(super) state: Mutex<State>,
    pub(super) changed: Condvar,
    pub(super) stop: (Mutex<bool>, Condvar),
    /// When the heartbeat thread last ran (ms since `epoch`): a process that did not run for
    /// longer than the peer timeout was counted lost by its peers, whatever it notices first.
    pub(super) last_ran_ms: AtomicU64,
}

impl MeshState {
    pub(super) fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// How long ago the heartbeat thread last ran.
    pub(super) fn ran_ago(&self) -> Duration {
        Duration::from_millis(
            self.now_ms()
                .saturating_sub(self.last_ran_ms.load(Ordering::SeqCst)),
        )
    }

    /// Why the mesh broke when this process itself did not run for longer than the peer
    /// timeout (stopped, frozen, starved): its peers count it as lost, so a loss it notices on
    /// resuming (a peer's abort naming it, a peer gone meanwhile) is its own doing.
    pub(super) fn did_not_run(&self) -> Option<Broken> {
        let gap = self.ran_ago();
        (gap > self.options.peer_timeout).then(|| Broken {
            lost: None,
            detail: format!(
                "rank {} itself did not run for {:.1} s (stopped, frozen or starved of CPU), \
                 longer than the peer timeout of {:?}: its peers count it as lost",
                self.rank,
                gap.as_secs_f64(),
                self.options.peer_timeout
            ),
        })
    }

    /// The writing end of every peer's socket.
    pub(super) fn writers(&self) -> impl Iterator<Item = &PeerWriter> {
        self.peers.iter().flatten().map(|p| &p.writer)
    }

    /// The shared-memory channels with `peer`, when there are.
    pub(super) fn shm(&self, peer: usize) -> Option<&ShmLink> {
        self.peers[peer].as_ref().and_then(|p| p.shm.as_ref())
    }
}
