//! What the transports offer the collective algorithms: point-to-point frames between the
//! ranks of a group ([`Links`]). The mesh implements it; so does the algorithms' in-memory test
//! harness.

use super::wire::Tag;
use crate::error::Result;

/// Point-to-point messaging between the ranks of a group. Frames between two ranks arrive in
/// the order they were sent.
pub(crate) trait Links {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Sends one frame to `peer`.
    fn send(&self, peer: usize, tag: Tag, payload: &[u8]) -> Result<()>;
    /// Waits for the frame tagged `tag` from `peer` and runs `f` on its bytes, where they lie
    /// (frames of one collective may be received in another order than they were sent).
    fn recv_with<R>(&self, peer: usize, tag: Tag, f: impl FnOnce(&[u8]) -> R) -> Result<R>;
    /// Receives the frame tagged `tag` from `peer` as an owned buffer.
    #[cfg(test)]
    fn recv(&self, peer: usize, tag: Tag) -> Result<Vec<u8>> {
        self.recv_with(peer, tag, <[u8]>::to_vec)
    }
}
