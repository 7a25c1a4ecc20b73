//! Shared memory as a transport: data frames to a ring neighbour on this machine go through
//! the pair's mapped channels ([`shm`](crate::distributed::transport::shm)) instead of its
//! socket, while control frames stay on the socket. A waiter sleeps on a futex of its channel;
//! the socket reader rings the same doorbell when something happens that the waiter must see
//! (a frame on the socket, an abort, a goodbye). Off Linux there is no such link: the type has
//! no values, and a peer's link is always `None`.

use crate::distributed::transport::wire::Tag;
use std::time::Duration;
#[cfg(target_os = "linux")]
use {
    crate::distributed::transport::shm::{futex_wait, futex_wake, Channel, Region},
    crate::distributed::transport::wire::FrameKind,
    std::sync::atomic::Ordering,
};

/// Shared-memory data channels with one peer on this machine.
#[cfg(target_os = "linux")]
pub(crate) struct ShmLink {
    pub send: Channel,
    pub recv: Channel,
    /// The mapping both channels point into; dropped (unmapped) after them.
    pub _region: Region,
}

/// Shared-memory data channels, which exist on Linux only.
#[cfg(not(target_os = "linux"))]
pub(crate) enum ShmLink {}

/// How long a futex wait sleeps before looking at the mesh's state again.
const WAIT_SLICE: Duration = Duration::from_millis(100);

#[cfg(target_os = "linux")]
impl ShmLink {
    /// Whether this link carries the frame (data that fits a slot), rather than the socket.
    pub fn carries(&self, tag: Tag, len: usize) -> bool {
        tag.kind == FrameKind::Data && len <= self.send.capacity()
    }

    /// The receiving doorbell's count: read it before looking for a frame, so that a frame
    /// arriving after the look ends the wait ([`ShmLink::wait_recv`]).
    pub fn recv_bell(&self) -> u32 {
        self.recv.produced().load(Ordering::Acquire)
    }

    /// The slot holding frame `tag`, if it has arrived.
    pub fn find(&self, tag: Tag) -> Option<usize> {
        self.recv.find(tag)
    }

    /// Runs `f` on the bytes of slot `i` where they lie, then frees the slot.
    pub fn read<R>(&self, i: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        let out = f(self.recv.bytes(i));
        self.recv.release(i);
        out
    }

    /// A frame waiting from a collective before `seq`, which was never consumed.
    pub fn stale(&self, seq: u64) -> Option<Tag> {
        self.recv.stale(seq)
    }

    /// Sleeps until the receiving doorbell moves past `bell`, for `timeout` at most.
    pub fn wait_recv(&self, bell: u32, timeout: Duration) {
        futex_wait(self.recv.produced(), bell, timeout.min(WAIT_SLICE));
    }

    /// The sending doorbell's count, read before trying to send (see [`ShmLink::wait_send`]).
    pub fn send_bell(&self) -> u32 {
        self.send.consumed().load(Ordering::Acquire)
    }

    /// Puts the frame in a free slot, when there is one.
    pub fn try_send(&self, tag: Tag, payload: &[u8]) -> bool {
        self.send.try_send(tag, payload)
    }

    /// Sleeps until the peer frees a slot (the doorbell moves past `bell`), for `timeout` at
    /// most.
    pub fn wait_send(&self, bell: u32, timeout: Duration) {
        futex_wait(self.send.consumed(), bell, timeout.min(WAIT_SLICE));
    }

    /// Wakes this process's waiters on both channels.
    pub fn ring(&self) {
        for word in [self.recv.produced(), self.send.consumed()] {
            word.fetch_add(1, Ordering::Release);
            futex_wake(word);
        }
    }
}

#[cfg(not(target_os = "linux"))]
impl ShmLink {
    pub fn carries(&self, _: Tag, _: usize) -> bool {
        match *self {}
    }
    pub fn recv_bell(&self) -> u32 {
        match *self {}
    }
    pub fn find(&self, _: Tag) -> Option<usize> {
        match *self {}
    }
    pub fn read<R>(&self, _: usize, _: impl FnOnce(&[u8]) -> R) -> R {
        match *self {}
    }
    pub fn stale(&self, _: u64) -> Option<Tag> {
        match *self {}
    }
    pub fn wait_recv(&self, _: u32, _: Duration) {
        match *self {}
    }
    pub fn send_bell(&self) -> u32 {
        match *self {}
    }
    pub fn try_send(&self, _: Tag, _: &[u8]) -> bool {
        match *self {}
    }
    pub fn wait_send(&self, _: u32, _: Duration) {
        match *self {}
    }
    pub fn ring(&self) {
        match *self {}
    }
}
