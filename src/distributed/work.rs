//! Asynchronous collectives: the [`Work`] handle (torch's `async_op=True`) and the worker that
//! runs a group's collectives one after the other.
//!
//! Every collective of a group, blocking or not, is numbered and queued when it is issued, and
//! the group's worker thread runs the queue in that order: so the calls of one group run in the
//! order they were issued, a blocking call issued after an asynchronous one runs after it, and
//! the issuing thread is free while data moves. A blocking call is an asynchronous one followed
//! by [`Work::wait`].
//!
//! ```rust
//! use candle_core::{Device, Tensor};
//! use candle_parallel::distributed::{self, ReduceOp};
//! # fn main() -> candle_parallel::Result<()> {
//! let sums = distributed::spawn_threads(2, |pg| {
//!     let x = Tensor::new(&[pg.rank() as f32 + 1.0], &Device::Cpu)?;
//!     let work = pg.all_reduce_async(&x, ReduceOp::Sum)?; // returns at once
//!     let busy = (x.clone() * 2.0)?;                          // compute meanwhile
//!     Ok((work.wait()?.to_vec1::<f32>()?[0], busy.to_vec1::<f32>()?[0]))
//! })?;
//! assert_eq!(sums[0].0, 3.0);
//! assert_eq!(sums[1].0, 3.0);
//! # Ok(()) }
//! ```

use crate::error::{Error, Result};
use crate::util::sync::lock;
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// A collective's completion on a device, for backends whose collectives run on a device queue
/// of their own (NCCL's communication stream): the host is done with the call when the worker
/// has enqueued it, the device when the queue has run it.
pub(crate) trait DeviceCompletion: Send {
    /// Whether the device has finished the collective.
    fn is_complete(&self) -> bool;
    /// Makes the consumer's device queue wait for the collective before anything it runs next
    /// reads the results (no host synchronisation).
    fn order_consumer(self: Box<Self>) -> Result<()>;
}

/// What a backend hands back for one collective.
pub(crate) struct Finished<T> {
    pub value: T,
    /// `None` when the values are ready as they are (host-memory backends).
    pub device: Option<Box<dyn DeviceCompletion>>,
}

impl<T> Finished<T> {
    /// Values that are ready now.
    pub fn ready(value: T) -> Self {
        Self {
            value,
            device: None,
        }
    }
}

enum Outcome<T> {
    Pending,
    Done(Result<Finished<T>>),
    Taken,
}

struct Slot<T> {
    outcome: Mutex<Outcome<T>>,
    filled: Condvar,
}

impl<T> Slot<T> {
    fn fill(&self, result: Result<Finished<T>>) {
        *lock(&self.outcome) = Outcome::Done(result);
        self.filled.notify_all();
    }
}

/// A collective issued with one of the `_async` methods of
/// [`ProcessGroup`](super::ProcessGroup) (torch's `Work`).
///
/// [`Work::wait`] returns the result, or the collective's error (a lost peer, a mismatch, a
/// timeout) on every rank, within the bounds of the blocking calls. Dropping a `Work` without
/// waiting is allowed: the collective still runs, in its place in the group's order, and its
/// result is discarded.
#[must_use = "a collective's result is only available through `wait`"]
pub struct Work<T> {
    pending: Box<dyn Pending<T>>,
    what: String,
}

impl<T: Send + 'static> Work<T> {
    /// Waits for the collective and returns its result. On CUDA devices with NCCL this returns
    /// once the collective is enqueued, and makes the device's stream wait for it: kernels
    /// launched afterwards see the result, and the host never waits for the GPU.
    pub fn wait(self) -> Result<T> {
        let what = self.what;
        // Name the call, which the transport that noticed the failure does not know.
        self.pending.wait().map_err(|e| match e {
            Error::Timeout {
                what: waiting,
                waited,
            } => Error::Timeout {
                what: format!("{waiting} ({what})"),
                waited,
            },
            Error::PeerLost { rank, detail } => Error::PeerLost {
                rank,
                detail: format!("{detail} (this rank was in {what})"),
            },
            other => other,
        })
    }

    /// Whether the collective has finished (successfully or not), on the host and, for device
    /// backends, on the device. Never blocks.
    pub fn is_completed(&self) -> bool {
        self.pending.is_completed()
    }

    /// A `Work` whose result is `f` of this one's, applied by `wait` on the waiting thread
    /// (after the device ordering, so `f` may launch kernels that read the result).
    pub(crate) fn map<U: Send + 'static>(
        self,
        f: impl FnOnce(T) -> Result<U> + Send + 'static,
    ) -> Work<U> {
        Work {
            pending: Box::new(Mapped {
                inner: self.pending,
                f,
            }),
            what: self.what,
        }
    }
}

impl<T> std::fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("collective", &self.what)
            .field("completed", &self.pending.is_completed())
            .finish()
    }
}

/// What `Work` waits on: a slot the worker fills, possibly behind steps that transform it.
trait Pending<T>: Send {
    fn wait(self: Box<Self>) -> Result<T>;
    fn is_completed(&self) -> bool;
}

impl<T: Send> Pending<T> for Arc<Slot<T>> {
    fn wait(self: Box<Self>) -> Result<T> {
        let mut outcome = lock(&self.outcome);
        while matches!(*outcome, Outcome::Pending) {
            outcome = self.filled.wait(outcome).unwrap_or_else(|p| p.into_inner());
        }
        let Outcome::Done(result) = std::mem::replace(&mut *outcome, Outcome::Taken) else {
            unreachable!("a slot is filled once and taken once, by the one Work that owns it")
        };
        drop(outcome);
        let finished = result?;
        if let Some(device) = finished.device {
            device.order_consumer()?;
        }
        Ok(finished.value)
    }

    fn is_completed(&self) -> bool {
        match &*lock(&self.outcome) {
            Outcome::Pending => false,
            Outcome::Done(Ok(f)) => f.device.as_ref().is_none_or(|d| d.is_complete()),
            Outcome::Done(Err(_)) | Outcome::Taken => true,
        }
    }
}

struct Mapped<T, F> {
    inner: Box<dyn Pending<T>>,
    f: F,
}

impl<T, U, F> Pending<U> for Mapped<T, F>
where
    F: FnOnce(T) -> Result<U> + Send,
{
    fn wait(self: Box<Self>) -> Result<U> {
        let value = self.inner.wait()?;
        (self.f)(value)
    }

    fn is_completed(&self) -> bool {
        self.inner.is_completed()
    }
}

type Job = Box<dyn FnOnce() + Send>;

struct Queue {
    jobs: VecDeque<Job>,
    /// The sequence number of the last collective issued.
    issued: u64,
    closed: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    changed: Condvar,
}

/// The thread that runs a group's collectives, in the order they were issued.
pub(crate) struct Worker {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Starts the worker thread, named `name`.
    pub fn start(name: String) -> Result<Self> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                issued: 0,
                closed: false,
            }),
            changed: Condvar::new(),
        });
        let thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(name)
                .spawn(move || run(&shared))
                .map_err(|source| Error::Io {
                    context: "starting a process group's communication thread".into(),
                    source,
                })?
        };
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// Numbers the next collective and queues `job(seq)` behind every collective issued before
    /// it. `what` names the collective in messages.
    pub fn submit<T, F>(&self, what: String, job: F) -> Work<T>
    where
        T: Send + 'static,
        F: FnOnce(u64) -> Result<Finished<T>> + Send + 'static,
    {
        self.enqueue(what, true, job)
    }

    /// Queues `job` behind every call issued before it without numbering it: for what only
    /// some ranks of the group take part in (point-to-point messages), which must not shift
    /// the collectives' numbers. `job` gets the number of the last collective issued.
    pub fn submit_unnumbered<T, F>(&self, what: String, job: F) -> Work<T>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<Finished<T>> + Send + 'static,
    {
        self.enqueue(what, false, move |_| job())
    }

    fn enqueue<T, F>(&self, what: String, numbered: bool, job: F) -> Work<T>
    where
        T: Send + 'static,
        F: FnOnce(u64) -> Result<Finished<T>> + Send + 'static,
    {
        let slot = Arc::new(Slot {
            outcome: Mutex::new(Outcome::Pending),
            filled: Condvar::new(),
        });
        let work = Work {
            pending: Box::new(slot.clone()),
            what: what.clone(),
        };
        let mut queue = lock(&self.shared.queue);
        if numbered {
            queue.issued += 1;
        }
        let seq = queue.issued;
        if queue.closed {
            // Only reachable while the group is being dropped: nobody can issue then.
            slot.fill(Err(Error::Aborted {
                reason: format!("{what} was issued on a process group being shut down"),
            }));
            return work;
        }
        let name = if numbered {
            format!("{what} (collective #{seq})")
        } else {
            what
        };
        queue.jobs.push_back(Box::new(move || {
            let result = catch_unwind(AssertUnwindSafe(|| job(seq))).unwrap_or_else(|panic| {
                Err(Error::Aborted {
                    reason: format!("{name} panicked: {}", panic_message(&*panic)),
                })
            });
            slot.fill(result);
        }));
        drop(queue);
        self.shared.changed.notify_all();
        work
    }
}

impl Drop for Worker {
    /// Runs what was issued to the end (the peers expect every issued collective), then stops.
    fn drop(&mut self) {
        lock(&self.shared.queue).closed = true;
        self.shared.changed.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(shared: &Shared) {
    loop {
        let job = {
            let mut queue = lock(&shared.queue);
            loop {
                if let Some(job) = queue.jobs.pop_front() {
                    break job;
                }
                if queue.closed {
                    return;
                }
                queue = shared
                    .changed
                    .wait(queue)
                    .unwrap_or_else(|p| p.into_inner());
            }
        };
        job();
    }
}

/// The text of a panic's payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn jobs_run_in_issue_order_and_results_reach_their_work() {
        let worker = Worker::start("test-worker".into()).unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let works: Vec<Work<u64>> = (0..20)
            .map(|i| {
                let order = order.clone();
                worker.submit(format!("job {i}"), move |seq| {
                    if i == 0 {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    order.lock().unwrap().push(seq);
                    Ok(Finished::ready(seq * 10))
                })
            })
            .collect();
        for (i, w) in works.into_iter().enumerate().rev() {
            assert_eq!(w.wait().unwrap(), (i as u64 + 1) * 10);
        }
        assert_eq!(*order.lock().unwrap(), (1..=20).collect::<Vec<_>>());
    }

    #[test]
    fn a_panicking_job_fails_its_work_and_the_worker_goes_on() {
        let worker = Worker::start("test-worker".into()).unwrap();
        let bad: Work<()> = worker.submit("bad".into(), |_| panic!("boom"));
        let good = worker.submit("good".into(), |seq| Ok(Finished::ready(seq)));
        let err = bad.wait().unwrap_err().to_string();
        assert!(err.contains("bad (collective #1) panicked: boom"), "{err}");
        assert_eq!(good.wait().unwrap(), 2);
    }

    #[test]
    fn dropping_the_worker_runs_what_was_issued_and_unwaited_work_is_fine() {
        let ran = Arc::new(Mutex::new(0));
        let worker = Worker::start("test-worker".into()).unwrap();
        let kept = {
            let ran = ran.clone();
            worker.submit("kept".into(), move |_| {
                std::thread::sleep(Duration::from_millis(30));
                *ran.lock().unwrap() += 1;
                Ok(Finished::ready(()))
            })
        };
        for _ in 0..3 {
            let ran = ran.clone();
            drop(worker.submit("dropped".into(), move |_| {
                *ran.lock().unwrap() += 1;
                Ok(Finished::ready(()))
            }));
        }
        assert!(!kept.is_completed());
        drop(worker);
        assert_eq!(*ran.lock().unwrap(), 4);
        assert!(kept.is_completed());
        kept.wait().unwrap();
    }
}
