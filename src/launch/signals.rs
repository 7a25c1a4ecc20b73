//! The few Unix signal operations the launcher needs.

use std::sync::atomic::{AtomicI32, Ordering};

/// The last SIGINT, SIGTERM or SIGHUP the launcher received (0: none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);
/// The same, but never taken back: whether the launcher was ever asked to stop.
static EVER: AtomicI32 = AtomicI32::new(0);

extern "C" fn record(sig: libc::c_int) {
    // Only atomic stores: async-signal-safe.
    RECEIVED.store(sig, Ordering::SeqCst);
    EVER.store(sig, Ordering::SeqCst);
}

/// While alive, SIGINT, SIGTERM and SIGHUP are recorded instead of ending the process; the
/// previous handlers come back on drop.
pub(crate) struct Catch {
    previous: Vec<(libc::c_int, libc::sigaction)>,
}

impl Catch {
    pub fn install() -> Self {
        RECEIVED.store(0, Ordering::SeqCst);
        EVER.store(0, Ordering::SeqCst);
        let mut previous = Vec::new();
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            // SAFETY: plain sigaction calls with zero-initialised structs and a handler that
            // only stores to an atomic.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = record as extern "C" fn(libc::c_int) as libc::sighandler_t;
                libc::sigemptyset(&mut action.sa_mask);
                action.sa_flags = libc::SA_RESTART;
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, &action, &mut old) == 0 {
                    previous.push((sig, old));
                }
            }
        }
        Self { previous }
    }

    /// The signal received since installing, if any.
    pub fn received(&self) -> Option<i32> {
        match RECEIVED.swap(0, Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }

    /// The last signal received since installing, even if [`received`](Self::received) took it
    /// already: a job asked to stop is never restarted.
    pub fn ever(&self) -> Option<i32> {
        match EVER.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }
}

impl Drop for Catch {
    fn drop(&mut self) {
        for (sig, old) in &self.previous {
            // SAFETY: restores the action saved by `install`.
            unsafe { libc::sigaction(*sig, old, std::ptr::null_mut()) };
        }
    }
}

/// Sends `sig` to every process of process group `pgid` (ignoring a group already gone).
pub(crate) fn signal_group(pgid: u32, sig: i32) {
    // SAFETY: kill with a negative pid signals a process group; no memory is involved.
    unsafe { libc::kill(-(pgid as libc::pid_t), sig) };
}

/// To run in a rank between fork and exec: the kernel kills it when the launcher dies.
pub(crate) fn die_with_parent(parent: libc::pid_t) -> std::io::Result<()> {
    // SAFETY: prctl and getppid are async-signal-safe system calls.
    unsafe {
        #[cfg(target_os = "linux")]
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // The launcher may have died before prctl took effect.
        if libc::getppid() != parent {
            return Err(std::io::Error::other("the launcher exited"));
        }
    }
    Ok(())
}

/// The name of a signal, for messages.
pub(crate) fn name(sig: i32) -> String {
    match sig {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGKILL => "SIGKILL".into(),
        libc::SIGSEGV => "SIGSEGV".into(),
        libc::SIGABRT => "SIGABRT".into(),
        libc::SIGBUS => "SIGBUS".into(),
        libc::SIGHUP => "SIGHUP".into(),
        s => format!("signal {s}"),
    }
}
