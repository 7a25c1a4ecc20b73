//! Starting ranks as threads of one process, each a rank of an in-process group
//! ([`spawn_threads`]). The group's communication is the in-process backend's
//! (`backends::threads`); this is the face that starts its ranks and hands each a
//! [`ProcessGroup`].

use super::backends::threads::Shared;
use super::config::{Backend, InitConfig};
use super::group::{Membership, ProcessGroup};
use super::rendezvous::GroupPath;
use crate::error::{Error, Result};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs `f` on `world_size` threads, each a rank of one in-process group, and returns their
/// results in rank order, or the first failure (lowest rank).
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

/// As [`spawn_threads`], with a configuration (only `timeout` applies to in-process groups).
pub fn spawn_threads_with_config<T, F>(
    world_size: usize,
    config: InitConfig,
    f: F,
) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(ProcessGroup) -> Result<T> + Sync,
{
    if world_size == 0 {
        return Err(Error::Config {
            what: "world size".into(),
            detail: "0: a group needs at least one rank".into(),
        });
    }
    let shared = Shared::new(world_size, config.timeout);
    let results: Vec<Result<T>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let (shared, f) = (shared.clone(), &f);
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
                                GroupPath::default(),
                                connected,
                            )?;
                            f(group)
                        }));
                        leave.why = match &out {
                            Ok(Ok(_)) => "its closure returned",
                            Ok(Err(_)) => "its closure returned an error",
                            Err(_) => "it panicked",
                        };
                        out
                    })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Err(e) => Err(Error::Io {
                    context: format!("starting the thread of rank {rank}"),
                    source: e,
                }),
                Ok(h) => match h.join() {
                    Ok(Ok(r)) => r,
                    Ok(Err(_)) | Err(_) => Err(Error::RankFailed {
                        rank,
                        status: "panicked".into(),
                        code: 101,
                    }),
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

/// All values, or the error that caused the others: a rank's own failure rather than another
/// rank's report of losing it.
fn first_cause<T>(results: Vec<Result<T>>) -> Result<Vec<T>> {
    let consequence = |e: &Error| {
        matches!(
            e,
            Error::PeerLost { .. } | Error::Aborted { .. } | Error::Timeout { .. }
        )
    };
    if let Some(i) = results
        .iter()
        .position(|r| r.as_ref().is_err_and(|e| !consequence(e)))
    {
        return Err(results
            .into_iter()
            .nth(i)
            .expect("index")
            .err()
            .expect("error"));
    }
    results.into_iter().collect()
}
