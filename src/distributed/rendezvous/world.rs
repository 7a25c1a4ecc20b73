//! The world of a job: joining it and connecting its mesh ([`join_world`]), and what it takes
//! to connect the mesh of every group made from it later ([`MeshContext`]).

use super::connect::{connect_mesh, Identity};
use super::group_path::GroupPath;
use super::join::{join, Joined};
use super::store::{ranks_named, Store};
use super::Rendezvous;
use crate::distributed::config::InitConfig;
use crate::distributed::transport::mesh::{Mesh, MeshOptions, OnLost};
use crate::error::{Error, Result};
use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What it takes to connect a mesh of this job: for the world group, and again for every group
/// made from it.
#[derive(Clone)]
pub(crate) struct MeshContext {
    /// The world group's store, which every later group connects to again.
    pub store: Arc<Store>,
    /// The interface that reaches the master, where peers reach this rank too.
    pub local_ip: IpAddr,
    pub options: InitConfig,
    /// The job's id (the world group's).
    pub job: u64,
    /// This rank in the world group, which names it to the store.
    pub world_rank: usize,
    /// What the backend does when a mesh of this job loses a peer.
    pub on_lost: OnLost,
}

impl MeshContext {
    /// Connects `rank` of the `world` ranks of group `path` through `store`.
    pub fn connect(
        &self,
        store: &Store,
        path: &GroupPath,
        rank: usize,
        world: usize,
    ) -> Result<Mesh> {
        let prefix = path.store_prefix();
        let me = Identity {
            rank,
            world,
            token: &self.options.token,
            job: path.id_within(self.job),
            unix: self.options.unix_sockets,
            shm: self.options.shared_memory,
            prefix: &prefix,
        };
        let mesh_options = MeshOptions {
            timeout: self.options.timeout,
            peer_timeout: self.options.peer_timeout,
        };
        connect_mesh(
            store,
            self.local_ip,
            &me,
            self.options.rendezvous_timeout,
            mesh_options,
            self.on_lost.clone(),
        )
    }

    /// Connects this rank as `rank` of the `world` ranks of group `path`: the group's own
    /// store connection (so that another group's long store waits never delay this one's) and
    /// its mesh.
    pub fn connect_group(
        &self,
        rank: usize,
        world: usize,
        path: &GroupPath,
    ) -> Result<(Arc<Store>, Mesh)> {
        let store = Arc::new(
            self.store
                .reconnect(self.world_rank, self.options.rendezvous_timeout)?,
        );
        let mesh = self.connect(&store, path, rank, world)?;
        Ok((store, mesh))
    }
}

/// Joins the job described by `r` and connects the world group's mesh, which the socket
/// backends stand on (the host backend carries its data over it; NCCL its agreement and
/// failure detection). A rank that cannot connect tells the others through the store. Every
/// mesh of the job reports a lost peer to `on_lost`.
pub(crate) fn join_world(
    r: &Rendezvous,
    options: &InitConfig,
    on_lost: OnLost,
) -> Result<(Joined, MeshContext, Mesh)> {
    let deadline = Instant::now() + options.rendezvous_timeout;
    let joined = join(r, options)?;
    let context = MeshContext {
        store: joined.store.clone(),
        local_ip: joined.store.local_addr().ip(),
        options: options.clone(),
        job: joined.job,
        world_rank: r.rank,
        on_lost,
    };
    let mesh = context
        .connect(&joined.store, &GroupPath::default(), r.rank, r.world_size)
        .inspect_err(|e| {
            joined
                .store
                .abort(&format!("rank {} could not join: {e}", r.rank));
            if joined.server.is_some() {
                let_waiting_ranks_read_why(&joined.store, r.world_size, deadline, e);
            }
        })?;
    Ok((joined, context, mesh))
}

/// How long rank 0 keeps the store up after its rendezvous failed, for the ranks still in it.
const LINGER: Duration = Duration::from_secs(5);

/// How long rank 0 keeps the store up after its rendezvous failed for ranks that have not
/// arrived yet (never past the rendezvous deadline): a rank started a little later reads why
/// at once instead of waiting its whole rendezvous timeout for a store that is gone.
const LATE_GRACE: Duration = Duration::from_secs(10);

/// Rank 0 hosts the store, and its going would leave the ranks still waiting in it with "the
/// store stopped answering", and the ranks still to start with `Unreachable` at the end of their
/// rendezvous timeout, rather than the reason. It keeps the store up until every rank has
/// claimed its place, read the abort and left: at most [`LINGER`] for ranks already in, and
/// [`LATE_GRACE`] (never past `deadline`, when they would have timed out anyway) for ranks yet
/// to come. It says so at once, so that its own reason is not held back with it.
fn let_waiting_ranks_read_why(store: &Store, world: usize, deadline: Instant, why: &Error) {
    let failed = Instant::now();
    let late_until = deadline.min(failed + LATE_GRACE).max(failed);
    // A rank that arrives at the last moment gets a second to read the abort.
    let until = (failed + LINGER).max(late_until + Duration::from_secs(1));
    let keys: Vec<String> = (1..world)
        .flat_map(|r| [format!("rank/{r}"), format!("gone/{r}")])
        .collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut said = false;
    while Instant::now() < until {
        let Ok(missing) = store.wait(&refs, Duration::ZERO) else {
            return;
        };
        let missing: HashSet<&str> = missing.iter().map(String::as_str).collect();
        let present = |k: &str| !missing.contains(k);
        let still_in = refs
            .chunks(2)
            .any(|pair| present(pair[0]) && !present(pair[1]));
        let to_come: Vec<usize> = (1..world).filter(|r| !present(refs[2 * (r - 1)])).collect();
        let waits_for_late = !to_come.is_empty() && Instant::now() < late_until;
        if !still_in && !waits_for_late {
            return;
        }
        if waits_for_late && !said {
            said = true;
            log::error!(
                "rank 0 cannot form the job: {why}; it keeps the store up for {} s more so that \
                 the ranks yet to arrive ({}) read why",
                late_until
                    .saturating_duration_since(Instant::now())
                    .as_secs_f32()
                    .ceil(),
                ranks_named(&to_come)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
