//! What a mesh is given: how long it waits ([`MeshOptions`]) and whom it tells when it breaks
//! ([`OnLost`]).

use std::sync::Arc;
use std::time::Duration;

/// How long to wait for peers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MeshOptions {
    /// The longest wait for a live peer's part of a collective.
    pub timeout: Duration,
    /// The longest silence after which a peer counts as lost.
    pub peer_timeout: Duration,
}

/// What a mesh calls, once, when it breaks, before anyone sees it broken (under the mesh's
/// lock: it must not use the mesh): with the rank it lost (`None` when it broke for another
/// reason) and how that was noticed. Not called while this rank leaves the mesh. The transport only reports the loss; what to do about it
/// (tell the launcher, say) is decided above it, by whoever connects the mesh.
pub(crate) type OnLost = Arc<dyn Fn(Option<usize>, &str) + Send + Sync>;
