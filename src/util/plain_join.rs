//! Whether this thread runs the training loop of a plain `DistributedDataParallel::join`: there
//! a rank that has run out of batches mirrors only forward, backward and `opt.step`, so a
//! collective that a lower layer issues on a group of its own (a group's GradScaler) would
//! wait for a partner that never comes. Such layers ask here and refuse at once, pointing to
//! `join_with`, which mirrors the loop's whole step.

use std::cell::Cell;

thread_local! {
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as inside a plain join until the guard drops.
pub(crate) fn enter() -> Guard {
    let was = INSIDE.with(|c| c.replace(true));
    Guard { was }
}

/// Whether this thread is inside a plain join's training loop.
pub(crate) fn inside() -> bool {
    INSIDE.with(Cell::get)
}

/// Restores the mark as it was when dropped.
pub(crate) struct Guard {
    was: bool,
}

impl Drop for Guard {
    fn drop(&mut self) {
        INSIDE.with(|c| c.set(self.was));
    }
}
