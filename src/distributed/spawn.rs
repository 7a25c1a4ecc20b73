//! Starting ranks as threads of one process, each a rank of an in-process group
//! ([`spawn_threads`]). The group's communication is the in-process backend's
//! (`backends::threads`); this is the face that starts its ranks and hands each a
//! [`ProcessGroup`].

use super::backends::threads::Shared;
use super::config::{Backend, InitConfig};
use super::group::{Membership, ProcessGroup};
use super::rendezvous::GroupPath;
use crate::error::{Error, Result};
use candle_core::Device;
use std::any::{Any, TypeId};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Runs `f` on `world_size` threads, each a rank of one in-process group, and returns their
/// results in rank order, or the failure that caused the others (see
/// [`spawn_threads_with_config`]).
///
/// The closure returns this crate's [`Result`](crate::Result), so `?` works on candle's and this
/// crate's errors without annotations. For closures that return another error type
/// (`anyhow::Result`, a `Box<dyn Error>`, your own enum), use [`spawn_threads_with_error`].
///
/// ```rust
/// use candle_core::{Device, Tensor};
/// use candle_parallel::distributed::{self, ReduceOp};
/// # fn main() -> candle_parallel::Result<()> {
/// let sums = distributed::spawn_threads(3, |pg| {
///     let x = Tensor::new(&[pg.rank() as f32 + 1.0], &Device::Cpu)?;
///     Ok(pg.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?[0])
/// })?;
/// assert_eq!(sums, [6.0, 6.0, 6.0]);
/// # Ok(()) }
/// ```
pub fn spawn_threads<T, F>(world_size: usize, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(ProcessGroup) -> Result<T> + Sync,
{
    spawn_threads_with_config(world_size, InitConfig::default(), f)
}

/// As [`spawn_threads`], for a closure that returns its own error type `E`: any type this
/// crate's [`Error`] converts into, such as `anyhow::Error` or `Box<dyn std::error::Error + Send
/// + Sync>`. Failures of the group itself (a rank that panicked, a thread that could not start,
/// a world size of 0) arrive converted into `E`.
///
/// Name the closure's return type (`|pg| -> anyhow::Result<_> { ... }`): Rust cannot infer
/// the error type of a closure that uses `?`.
///
/// ```rust
/// use candle_core::{Device, Tensor};
/// use candle_parallel::distributed::{self, ReduceOp};
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let sums = distributed::spawn_threads_with_error(2, |pg| -> Result<f32, Box<dyn std::error::Error + Send + Sync>> {
///     let x = Tensor::new(&[pg.rank() as f32 + 1.0], &Device::Cpu)?;
///     let steps: u32 = "10".parse()?; // a std error, not one of candle-parallel's
///     Ok(pg.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?[0] * steps as f32)
/// })?;
/// assert_eq!(sums, [30.0, 30.0]);
/// # Ok(()) }
/// ```
pub fn spawn_threads_with_error<T, E, F>(world_size: usize, f: F) -> std::result::Result<Vec<T>, E>
where
    T: Send,
    E: From<Error> + Send + 'static,
    F: Fn(ProcessGroup) -> std::result::Result<T, E> + Sync,
{
    spawn_threads_with_config(world_size, InitConfig::default(), f)
}

/// As [`spawn_threads_with_error`], with a configuration (only `timeout` applies to in-process
/// groups). `E` may be this crate's [`Error`]; name the closure's return type
/// (`|pg| -> candle_parallel::Result<_> { ... }`) when it uses `?`.
///
/// Returns the results in rank order, or the failure that caused the others. An error of this
/// crate that only reports another rank's failure (a lost peer, an aborted group, a timeout)
/// gives way to the lowest rank's own error; other error types cannot be inspected, so the
/// error of the rank whose closure failed first is returned.
pub fn spawn_threads_with_config<T, E, F>(
    world_size: usize,
    config: InitConfig,
    f: F,
) -> std::result::Result<Vec<T>, E>
where
    T: Send,
    E: From<Error> + Send + 'static,
    F: Fn(ProcessGroup) -> std::result::Result<T, E> + Sync,
{
    if world_size == 0 {
        return Err(Error::Config {
            what: "world size".into(),
            detail: "0: a group needs at least one rank".into(),
        }
        .into());
    }
    let shared = Shared::new(world_size, config.timeout);
    // The order in which the ranks' closures failed, for errors that cannot be inspected.
    let failures = AtomicUsize::new(0);
    let results: Vec<Outcome<T, E>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let (shared, f, failures) = (shared.clone(), &f, &failures);
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let (connected, mut leave) = shared.member(rank);
                        let membership = Membership {
                            rank,
                            world_size,
                            local_rank: rank,
                            local_world_size: world_size,
                        };
                        let out = catch_unwind(AssertUnwindSafe(|| {
                            let group = ProcessGroup::assemble(
                                membership,
                                Backend::InProcess,
                                &Device::Cpu,
                                GroupPath::default(),
                                connected,
                            )
                            .map_err(E::from)?;
                            f(group)
                        }));
                        leave.why = match &out {
                            Ok(Ok(_)) => "its closure returned",
                            Ok(Err(_)) => "its closure returned an error",
                            Err(_) => "it panicked",
                        };
                        let order = match out {
                            Ok(Ok(_)) => usize::MAX,
                            _ => failures.fetch_add(1, Ordering::SeqCst),
                        };
                        (out, order)
                    })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Err(e) => Outcome {
                    result: Err(Error::Io {
                        context: format!("starting the thread of rank {rank}"),
                        source: e,
                    }
                    .into()),
                    order: 0,
                },
                Ok(h) => match h.join() {
                    Ok((Ok(r), order)) => Outcome { result: r, order },
                    Ok((Err(_), order)) => Outcome {
                        result: Err(panicked(rank)),
                        order,
                    },
                    Err(_) => Outcome {
                        result: Err(panicked(rank)),
                        order: usize::MAX,
                    },
                },
            })
            .collect()
    });
    first_cause(results)
}

/// As [`spawn_threads`], with options.
#[deprecated(since = "0.1.0", note = "renamed `spawn_threads_with_config`")]
pub fn spawn_threads_with<T, F>(world_size: usize, options: InitConfig, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(ProcessGroup) -> Result<T> + Sync,
{
    spawn_threads_with_config(world_size, options, f)
}

fn panicked<E: From<Error>>(rank: usize) -> E {
    Error::RankFailed {
        rank,
        status: "panicked".into(),
        code: 101,
    }
    .into()
}

/// One rank's result, and its place among the failures (`usize::MAX` when it succeeded).
struct Outcome<T, E> {
    result: std::result::Result<T, E>,
    order: usize,
}

/// All values, or the error that caused the others: a rank's own failure rather than another
/// rank's report of losing it. This crate's errors say which they are (the lowest rank's cause
/// wins); other error types are taken in the order their ranks failed.
fn first_cause<T, E: 'static>(results: Vec<Outcome<T, E>>) -> std::result::Result<Vec<T>, E> {
    let consequence = |e: &E| {
        (e as &dyn Any).downcast_ref::<Error>().is_some_and(|e| {
            matches!(
                e,
                Error::PeerLost { .. } | Error::Aborted { .. } | Error::Timeout { .. }
            )
        })
    };
    let inspectable = TypeId::of::<E>() == TypeId::of::<Error>();
    let cause = results
        .iter()
        .enumerate()
        .filter_map(|(rank, o)| o.result.as_ref().err().map(|e| (rank, o.order, e)))
        .min_by_key(|&(rank, order, e)| (consequence(e), if inspectable { rank } else { order }))
        .map(|(rank, ..)| rank);
    match cause {
        Some(rank) => Err(results
            .into_iter()
            .nth(rank)
            .and_then(|o| o.result.err())
            .expect("the cause is an error")),
        None => results.into_iter().map(|o| o.result).collect(),
    }
}
