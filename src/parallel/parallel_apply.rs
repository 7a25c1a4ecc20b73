//! Running one piece of work per device, each on its own thread.
//!
//! As `torch.nn.parallel.parallel_apply`: input `i` is processed for device `i`; the first on
//! the calling thread, the others on scoped threads, so a replica's kernels on one device do not
//! wait for another's. A failure names the replica and its device; a panicking replica becomes
//! an error too. When several replicas fail, the lowest index is reported.
//!
//! ```rust
//! use candle_core::{Device, Tensor};
//! use candle_parallel::parallel_apply::parallel_apply;
//! # fn main() -> candle_parallel::Result<()> {
//! let devices = [Device::Cpu, Device::Cpu];
//! let inputs = [Tensor::new(&[1f32], &Device::Cpu)?, Tensor::new(&[2f32], &Device::Cpu)?];
//! let out = parallel_apply(&inputs, &devices, |x| x * 10.0, |_, x| x * 100.0)?;
//! assert_eq!(out[0].to_vec1::<f32>()?, [10.]);
//! assert_eq!(out[1].to_vec1::<f32>()?, [200.]);
//! # Ok(()) }
//! ```

use crate::error::{device_name, Error, Result};
use candle_core::{Device, Tensor};
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Applies `first` to `inputs[0]` on the calling thread and `rest(i, &inputs[i])` to every other
/// input on a thread of its own; returns the outputs in input order.
///
/// `first` needs no `Sync` bound, so it may use state that must stay on the calling thread
/// (the master model). `devices[i]` only names replica `i` in errors.
pub fn parallel_apply<F0, F>(
    inputs: &[Tensor],
    devices: &[Device],
    first: F0,
    rest: F,
) -> Result<Vec<Tensor>>
where
    F0: FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    F: Fn(usize, &Tensor) -> candle_core::Result<Tensor> + Sync,
{
    if inputs.is_empty() {
        return Ok(Vec::new());
    }
    if devices.len() < inputs.len() {
        return Err(Error::InvalidArgument {
            what: "parallel_apply devices",
            detail: format!(
                "{} inputs but only {} devices; give one device per input",
                inputs.len(),
                devices.len()
            ),
        });
    }
    let results: Vec<std::thread::Result<candle_core::Result<Tensor>>> =
        std::thread::scope(|scope| {
            let rest = &rest;
            let handles: Vec<_> = inputs
                .iter()
                .enumerate()
                .skip(1)
                .map(|(i, x)| {
                    std::thread::Builder::new()
                        .name(format!("replica-{i}"))
                        .spawn_scoped(scope, move || rest(i, x))
                })
                .collect();
            let mut results = vec![catch_unwind(AssertUnwindSafe(|| first(&inputs[0])))];
            for handle in handles {
                results.push(match handle {
                    Ok(h) => h.join(),
                    Err(e) => Ok(Err(candle_core::Error::wrap(e))),
                });
            }
            results
        });
    results
        .into_iter()
        .enumerate()
        .map(|(index, r)| {
            let device = || device_name(&devices[index]);
            match r {
                Ok(Ok(t)) => Ok(t),
                Ok(Err(source)) => Err(Error::Replica {
                    index,
                    device: device(),
                    source,
                }),
                Err(payload) => Err(Error::ReplicaPanicked {
                    index,
                    device: device(),
                    message: panic_message(payload.as_ref()),
                }),
            }
        })
        .collect()
}

/// The message of a panic's payload.
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(a panic without a message)".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(n: usize) -> Vec<Tensor> {
        (0..n)
            .map(|i| Tensor::new(&[i as f32], &Device::Cpu).unwrap())
            .collect()
    }

    #[test]
    fn outputs_come_back_in_input_order_from_distinct_threads() -> Result<()> {
        let main = std::thread::current().id();
        let seen = std::sync::Mutex::new(Vec::new());
        let out = parallel_apply(
            &inputs(5),
            &vec![Device::Cpu; 5],
            |x| x + 1.0,
            |_, x| {
                seen.lock().unwrap().push(std::thread::current().id());
                x + 1.0
            },
        )?;
        let values: Vec<f32> = out.iter().map(|t| t.to_vec1::<f32>().unwrap()[0]).collect();
        assert_eq!(values, [1., 2., 3., 4., 5.]);
        let seen = seen.into_inner().unwrap();
        assert_eq!(seen.len(), 4);
        assert!(seen.iter().all(|id| *id != main));
        Ok(())
    }

    #[test]
    fn a_failing_replica_is_named_with_its_index() {
        let err = parallel_apply(
            &inputs(3),
            &vec![Device::Cpu; 3],
            |x| Ok(x.clone()),
            |i, x| {
                if i == 2 {
                    candle_core::bail!("no memory left")
                }
                Ok(x.clone())
            },
        )
        .unwrap_err();
        assert!(matches!(err, Error::Replica { index: 2, .. }));
        assert!(
            err.to_string().starts_with("replica 2 on cpu failed"),
            "{err}"
        );
    }

    #[test]
    fn a_panicking_replica_becomes_an_error() {
        let err = parallel_apply(
            &inputs(2),
            &vec![Device::Cpu; 2],
            |x| Ok(x.clone()),
            |_, _| panic!("layer exploded"),
        )
        .unwrap_err();
        match err {
            Error::ReplicaPanicked { index, message, .. } => {
                assert_eq!(index, 1);
                assert_eq!(message, "layer exploded");
            }
            other => panic!("unexpected {other}"),
        }
        let err = parallel_apply(
            &inputs(1),
            &[Device::Cpu],
            |_| panic!("master exploded"),
            |_, x| Ok(x.clone()),
        )
        .unwrap_err();
        assert!(matches!(err, Error::ReplicaPanicked { index: 0, .. }));
    }
}
