//! The pipelined forward: a thread per stage, micro-batches flowing between them through
//! channels, so that stage `i` computes micro-batch `j + 1` while stage `i + 1` computes
//! micro-batch `j` (the overlap of the tutorial's `PipelineParallelResNet50`). Each output
//! moves to the next stage's device on the thread that made it.

use super::stage::{compute, failed, Stage};
use crate::error::{device_name, Error, Result};
use crate::parallel::parallel_apply::panic_message;
use crate::util::ordered_copy::to_device;
use candle_core::Tensor;
use std::sync::mpsc;

/// One micro-batch between two stages: its index and its activations.
type Item = (usize, Tensor);

/// Runs `micro_batches` (on the first stage's device) through `stages`, each stage on a thread
/// of its own; returns the last stage's outputs in order, on its device. The first stage that
/// fails is reported, naming the stage, its device and the micro-batch; the stages after it
/// stop when their input ends, the stages before it when their output is no longer taken.
pub(super) fn run(stages: &[Stage], micro_batches: Vec<Tensor>) -> Result<Vec<Tensor>> {
    let count = micro_batches.len();
    std::thread::scope(|scope| {
        let (feed, mut input) = mpsc::channel::<Item>();
        let mut handles = Vec::with_capacity(stages.len());
        for (i, stage) in stages.iter().enumerate() {
            let (output, next_input) = mpsc::channel::<Item>();
            let input = std::mem::replace(&mut input, next_input);
            let next = stages.get(i + 1).map(|s| &s.device);
            let handle = std::thread::Builder::new()
                .name(format!("stage-{i}"))
                .spawn_scoped(scope, move || -> Result<()> {
                    for (j, x) in input {
                        let y = compute(stage, i, Some(j), &x)?;
                        let y = match next {
                            Some(device) => to_device(&y, device, false)
                                .map_err(|source| failed(stage, i, Some(j), source))?,
                            None => y,
                        };
                        if output.send((j, y)).is_err() {
                            break; // a later stage failed; it reports why
                        }
                    }
                    Ok(())
                })
                .map_err(|e| Error::Io {
                    context: format!("starting the thread of stage {i}"),
                    source: e,
                })?;
            handles.push(handle);
        }
        for item in micro_batches.into_iter().enumerate() {
            if feed.send(item).is_err() {
                break; // the first stage failed
            }
        }
        drop(feed);
        let outputs: Vec<Tensor> = input.iter().map(|(_, y)| y).collect();
        let mut first_error = None;
        for (i, handle) in handles.into_iter().enumerate() {
            let result = handle.join().unwrap_or_else(|payload| {
                Err(Error::Stage {
                    stage: i,
                    device: device_name(&stages[i].device),
                    micro_batch: None,
                    source: Box::new(candle_core::Error::Msg(format!(
                        "its thread panicked: {}",
                        panic_message(payload.as_ref())
                    ))),
                })
            });
            if let Err(e) = result {
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None if outputs.len() == count => Ok(outputs),
            None => unreachable!("every stage ran every micro-batch without an error"),
        }
    })
}
