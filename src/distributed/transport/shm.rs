//! Shared-memory data channels between ranks of one machine (Linux).
//!
//! Sockets cost two copies per byte in the kernel and a TCP stack besides. Between neighbours
//! on one machine, data frames instead go through a region both processes map: the sender
//! copies a frame into a free slot and marks it full; the receiver finds the slot by its tag,
//! reduces straight out of it, and marks it free. Waiting is a futex on a shared counter, woken
//! by the other side, and also by this process's socket reader when the mesh breaks, so a lost
//! peer ends every wait. Control traffic stays on the sockets.
//!
//! The region is a `memfd` passed over the pair's Unix socket (`SCM_RIGHTS`): it has no name,
//! so nothing is left behind when a process dies.

#![cfg(target_os = "linux")]

use crate::distributed::transport::wire::{FrameKind, Tag};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// Frames in flight per direction: more than the ring's look-ahead (its window plus one
/// forward), so a sender never waits for a slot the receiver cannot free yet.
pub(crate) const SLOTS: usize = 8;
const MAGIC: u64 = 0x4350_5348_4d31_0001; // "CPSHM1", version 1

const FREE: u32 = 0;
const FULL: u32 = 1;

/// The shared header of one direction.
#[repr(C, align(64))]
struct ChannelHeader {
    magic: AtomicU64,
    /// Bumped by the sender after filling a slot; the receiver's futex word.
    produced: AtomicU32,
    _pad1: [u8; 52],
    /// Bumped by the receiver after freeing a slot; the sender's futex word.
    consumed: AtomicU32,
    _pad2: [u8; 60],
}

/// The shared header of one slot.
#[repr(C, align(64))]
struct SlotHeader {
    state: AtomicU32,
    len: AtomicU32,
    seq: AtomicU64,
    part: AtomicU64,
    kind: AtomicU32,
}

/// One direction of a shared region: `SLOTS` slots of `slot_bytes` each.
pub(crate) struct Channel {
    base: *mut u8,
    slot_bytes: usize,
}

// SAFETY: the region is only accessed through atomics and through slots owned, by the slot
// protocol, by exactly one side at a time; the pointer stays valid as long as the `Region`
// owning the mapping, which every `Channel` is kept beside.
unsafe impl Send for Channel {}
unsafe impl Sync for Channel {}

fn channel_bytes(slot_bytes: usize) -> usize {
    std::mem::size_of::<ChannelHeader>()
        + SLOTS * std::mem::size_of::<SlotHeader>()
        + SLOTS * slot_bytes
}

impl Channel {
    fn header(&self) -> &ChannelHeader {
        // SAFETY: `base` points at a mapped, 64-byte aligned `ChannelHeader`.
        unsafe { &*(self.base as *const ChannelHeader) }
    }

    fn slot(&self, i: usize) -> &SlotHeader {
        // SAFETY: the slot headers follow the channel header, each 64-byte aligned.
        unsafe {
            let p = self.base.add(std::mem::size_of::<ChannelHeader>()) as *const SlotHeader;
            &*p.add(i)
        }
    }

    fn data(&self, i: usize) -> *mut u8 {
        let start = std::mem::size_of::<ChannelHeader>()
            + SLOTS * std::mem::size_of::<SlotHeader>()
            + i * self.slot_bytes;
        // SAFETY: in bounds of the mapping by construction.
        unsafe { self.base.add(start) }
    }

    /// The word the receiver of this direction waits on.
    pub fn produced(&self) -> &AtomicU32 {
        &self.header().produced
    }

    /// The word the sender of this direction waits on.
    pub fn consumed(&self) -> &AtomicU32 {
        &self.header().consumed
    }

    /// The largest frame a slot holds.
    pub fn capacity(&self) -> usize {
        self.slot_bytes
    }

    /// Puts a frame in a free slot; returns `false` (and sends nothing) when none is free.
    pub fn try_send(&self, tag: Tag, payload: &[u8]) -> bool {
        debug_assert!(payload.len() <= self.slot_bytes);
        let Some(i) = (0..SLOTS).find(|&i| self.slot(i).state.load(Ordering::Acquire) == FREE)
        else {
            return false;
        };
        let s = self.slot(i);
        // SAFETY: slot `i` is free, so it is ours until we mark it full; `payload` fits.
        unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), self.data(i), payload.len()) };
        s.len.store(payload.len() as u32, Ordering::Relaxed);
        s.seq.store(tag.seq, Ordering::Relaxed);
        s.part.store(tag.part, Ordering::Relaxed);
        s.kind.store(tag.kind as u32, Ordering::Relaxed);
        s.state.store(FULL, Ordering::Release);
        self.header().produced.fetch_add(1, Ordering::Release);
        futex_wake(self.produced());
        true
    }

    /// The full slot holding the frame `tag`, if any.
    pub fn find(&self, tag: Tag) -> Option<usize> {
        (0..SLOTS).find(|&i| {
            let s = self.slot(i);
            s.state.load(Ordering::Acquire) == FULL
                && s.seq.load(Ordering::Relaxed) == tag.seq
                && s.part.load(Ordering::Relaxed) == tag.part
                && s.kind.load(Ordering::Relaxed) == tag.kind as u32
        })
    }

    /// The bytes of full slot `i` (from [`Channel::find`]), valid until [`Channel::release`].
    pub fn bytes(&self, i: usize) -> &[u8] {
        let len = self.slot(i).len.load(Ordering::Relaxed) as usize;
        // SAFETY: the slot is full, so the sender does not touch it until we free it; the
        // Acquire load of its state in `find` made the sender's writes visible.
        unsafe { std::slice::from_raw_parts(self.data(i), len.min(self.slot_bytes)) }
    }

    /// Frees slot `i` for the sender.
    pub fn release(&self, i: usize) {
        self.slot(i).state.store(FREE, Ordering::Release);
        self.header().consumed.fetch_add(1, Ordering::Release);
        futex_wake(self.consumed());
    }

    /// If a full slot holds the frame `tag`, runs `f` on its bytes and frees the slot.
    #[cfg(test)]
    pub fn try_recv<R>(&self, tag: Tag, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
        let i = self.find(tag)?;
        let out = f(self.bytes(i));
        self.release(i);
        Some(out)
    }

    /// Whether a full slot holds a frame of a collective before `seq` (which nobody will take).
    pub fn stale(&self, seq: u64) -> Option<Tag> {
        (0..SLOTS).find_map(|i| {
            let s = self.slot(i);
            (s.state.load(Ordering::Acquire) == FULL && s.seq.load(Ordering::Relaxed) < seq).then(
                || Tag {
                    kind: FrameKind::Data,
                    seq: s.seq.load(Ordering::Relaxed),
                    part: s.part.load(Ordering::Relaxed),
                },
            )
        })
    }
}

/// A mapped region holding two channels, one per direction.
pub(crate) struct Region {
    base: *mut u8,
    len: usize,
    _fd: OwnedFd,
}

// SAFETY: the mapping is plain shared memory, accessed as described for `Channel`.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `map` mapped; channels are dropped with the mesh, before
        // or together with their region (the mesh owns both).
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

impl Region {
    /// Creates a region for slots of `slot_bytes` (the creator's side).
    pub fn create(slot_bytes: usize) -> std::io::Result<Self> {
        // SAFETY: memfd_create with a static name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"candle-parallel".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let len = 2 * channel_bytes(slot_bytes);
        // SAFETY: plain ftruncate on our descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let region = Self::map(fd, len)?;
        for c in 0..2 {
            region
                .channel(c, slot_bytes)
                .header()
                .magic
                .store(MAGIC, Ordering::Release);
        }
        Ok(region)
    }

    /// Maps a region received from the creator and checks it.
    pub fn open(fd: OwnedFd, slot_bytes: usize) -> std::io::Result<Self> {
        let len = 2 * channel_bytes(slot_bytes);
        // SAFETY: fstat into a zeroed struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if (st.st_size as usize) < len {
            return Err(std::io::Error::other("shared region too small"));
        }
        let region = Self::map(fd, len)?;
        for c in 0..2 {
            if region
                .channel(c, slot_bytes)
                .header()
                .magic
                .load(Ordering::Acquire)
                != MAGIC
            {
                return Err(std::io::Error::other("shared region has a foreign layout"));
            }
        }
        Ok(region)
    }

    fn map(fd: OwnedFd, len: usize) -> std::io::Result<Self> {
        // SAFETY: a shared read-write mapping of `len` bytes of our descriptor; checked.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            base: base.cast(),
            len,
            _fd: fd,
        })
    }

    /// Channel `c` (0 or 1) of this region.
    pub fn channel(&self, c: usize, slot_bytes: usize) -> Channel {
        Channel {
            // SAFETY: channel `c` lies within the mapping.
            base: unsafe { self.base.add(c * channel_bytes(slot_bytes)) },
            slot_bytes,
        }
    }

    pub fn fd(&self) -> RawFd {
        self._fd.as_raw_fd()
    }
}

/// Waits until `word` differs from `seen` or `timeout` passes (spurious wake-ups allowed).
pub(crate) fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: a futex wait on a valid, aligned u32 of a shared mapping (hence not PRIVATE).
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            seen,
            &ts as *const libc::timespec,
        );
    }
}

/// Wakes every waiter on `word`.
pub(crate) fn futex_wake(word: &AtomicU32) {
    // SAFETY: a futex wake on a valid, aligned u32 of a shared mapping.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

/// Runs `f` with a message header for one byte of payload (`byte`) and room for one
/// descriptor in its control buffer.
fn with_message<R>(byte: &mut [u8; 1], f: impl FnOnce(&mut libc::msghdr) -> R) -> R {
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: an all-zero msghdr is valid; it points at `iov` and `control`, which outlive `f`.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    f(&mut msg)
}

/// Sends `fd` over `stream` (SCM_RIGHTS) with one byte of payload.
pub(crate) fn send_fd(stream: &UnixStream, fd: RawFd) -> std::io::Result<()> {
    with_message(&mut [1u8], |msg| {
        // SAFETY: the control buffer has room for one descriptor's message, which is filled
        // through the CMSG accessors.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
            if libc::sendmsg(stream.as_raw_fd(), msg, 0) != 1 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    })
}

/// Receives one byte and, if it came with one, a descriptor sent by [`send_fd`].
pub(crate) fn recv_fd(stream: &UnixStream) -> std::io::Result<(u8, Option<OwnedFd>)> {
    let mut byte = [0u8];
    let fd = with_message(&mut byte, |msg| {
        // SAFETY: recvmsg into the message's live buffers; the descriptor is taken only from a
        // well-formed SCM_RIGHTS control message.
        unsafe {
            if libc::recvmsg(stream.as_raw_fd(), msg, libc::MSG_CMSG_CLOEXEC) != 1 {
                return Err(std::io::Error::last_os_error());
            }
            let cmsg = libc::CMSG_FIRSTHDR(msg);
            if cmsg.is_null()
                || (*cmsg).cmsg_level != libc::SOL_SOCKET
                || (*cmsg).cmsg_type != libc::SCM_RIGHTS
            {
                return Ok(None);
            }
            let fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>());
            Ok(Some(OwnedFd::from_raw_fd(fd)))
        }
    })?;
    Ok((byte[0], fd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::transport::wire::data;

    #[test]
    fn frames_cross_between_two_mappings_of_a_passed_descriptor_in_any_order() {
        let slot = 1 << 10;
        let creator = Region::create(slot).unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        send_fd(&a, creator.fd()).unwrap();
        let (byte, fd) = recv_fd(&b).unwrap();
        assert_eq!(byte, 1);
        let opener = Region::open(fd.expect("a descriptor"), slot).unwrap();
        let (tx, rx) = (creator.channel(0, slot), opener.channel(0, slot));
        for k in 0..SLOTS as u64 {
            assert!(tx.try_send(data(1, k), &[k as u8; 100]));
        }
        assert!(!tx.try_send(data(1, 99), b"full"), "all slots taken");
        // Taken by tag, not in order.
        assert_eq!(
            rx.try_recv(data(1, 5), |b| b.to_vec()),
            Some(vec![5u8; 100])
        );
        assert_eq!(rx.try_recv(data(1, 5), |b| b.len()), None);
        assert!(tx.try_send(data(2, 0), b"next"), "a freed slot is reused");
        assert_eq!(rx.stale(2).map(|t| t.seq), Some(1));
        for k in (0..SLOTS as u64).filter(|&k| k != 5) {
            assert_eq!(rx.try_recv(data(1, k), |b| b[0]), Some(k as u8));
        }
        assert_eq!(
            rx.try_recv(data(2, 0), |b| b.to_vec()),
            Some(b"next".to_vec())
        );
        assert_eq!(rx.stale(2), None);
    }

    #[test]
    fn a_waiter_is_woken_by_a_send_from_another_thread() {
        let slot = 64;
        let region = Region::create(slot).unwrap();
        let ch = region.channel(1, slot);
        let seen = ch.produced().load(Ordering::Acquire);
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(50));
                assert!(ch.try_send(data(3, 0), b"hi"));
            });
            let started = std::time::Instant::now();
            while ch.produced().load(Ordering::Acquire) == seen {
                futex_wait(ch.produced(), seen, Duration::from_secs(5));
            }
            assert!(started.elapsed() < Duration::from_secs(4));
        });
        assert_eq!(
            ch.try_recv(data(3, 0), |b| b.to_vec()),
            Some(b"hi".to_vec())
        );
    }
}
