//! Small helpers shared by the crate's layers.

use std::sync::{Mutex, MutexGuard};

/// Locks a mutex, also after another thread panicked while holding it. Every mutex of this
/// crate guards data that none of our operations leaves half-written (names, handles, queues,
/// connection state), so the data is still good after such a panic.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
