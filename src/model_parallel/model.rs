//! [`ModelParallel`]: a model cut into stages, each on a device of this process.

use super::micro_batch::split_sizes;
use super::pipeline;
use super::stage::{compute, failed, Stage};
use crate::error::{Error, Result};
use crate::util::ordered_copy::to_device;
use candle_core::{Device, Module, Tensor};

/// A model whose stages sit on different devices of one process (the tutorial's
/// `ModelParallelResNet50`; with [`ModelParallel::with_split_size`], its
/// `PipelineParallelResNet50`).
///
/// The forward runs the stages in order, moving the activations to each stage's device
/// (ordered on both streams between CUDA devices); the output is on the last stage's device,
/// and a backward from it flows back through every stage, each variable's gradient on its own
/// device.
#[derive(Debug)]
pub struct ModelParallel {
    stages: Vec<Stage>,
    split_size: Option<usize>,
}

impl ModelParallel {
    /// The model made of `stages`, in order. At least one stage.
    pub fn new(stages: Vec<Stage>) -> Result<Self> {
        if stages.is_empty() {
            return Err(Error::NoDevices);
        }
        Ok(Self {
            stages,
            split_size: None,
        })
    }

    /// Pipelines the forward: each batch is cut into micro-batches of `split_size` rows
    /// (`torch.split`: the last one takes the rest) and every stage runs on a thread of its own,
    /// so that stage `i` computes micro-batch `j + 1` while stage `i + 1` computes micro-batch
    /// `j`. The outputs are concatenated along dimension 0. Layers that mix rows (batch norm)
    /// see one micro-batch at a time, as in torch's pipelined tutorial. A batch of at most
    /// `split_size` rows (an epoch's short last batch) is one micro-batch, as `torch.split`
    /// makes it: nothing overlaps, the result is the same.
    pub fn with_split_size(mut self, split_size: usize) -> Result<Self> {
        if split_size == 0 {
            return Err(Error::InvalidArgument {
                what: "split_size",
                detail: "0 rows per micro-batch; give at least 1".into(),
            });
        }
        self.split_size = Some(split_size);
        Ok(self)
    }

    /// The stages, in order.
    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// The micro-batch size, if the forward is pipelined.
    pub fn split_size(&self) -> Option<usize> {
        self.split_size
    }

    /// The device the output is on: the last stage's.
    pub fn output_device(&self) -> &Device {
        &self.stages[self.stages.len() - 1].device
    }

    /// Runs `xs` (on any device) through every stage; the output is on the last stage's
    /// device.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        match self.split_size {
            None => self.forward_sequential(xs),
            Some(split_size) => self.forward_pipelined(xs, split_size),
        }
    }

    fn forward_sequential(&self, xs: &Tensor) -> Result<Tensor> {
        let mut x = xs.clone();
        for (i, stage) in self.stages.iter().enumerate() {
            let input =
                to_device(&x, &stage.device, false).map_err(|e| failed(stage, i, None, e))?;
            x = compute(stage, i, None, &input)?;
        }
        Ok(x)
    }

    fn forward_pipelined(&self, xs: &Tensor, split_size: usize) -> Result<Tensor> {
        let rows = match xs.dims().first() {
            None => {
                return Err(Error::DimOutOfRange {
                    dim: 0,
                    rank: 0,
                    shape: vec![],
                    what: "the batch to cut into micro-batches (a scalar has no rows)".into(),
                })
            }
            Some(&0) => {
                return Err(Error::EmptyBatch {
                    dim: 0,
                    shape: xs.dims().to_vec(),
                })
            }
            Some(&rows) => rows,
        };
        let first = &self.stages[0].device;
        let mut start = 0;
        let mut micro_batches = Vec::new();
        for size in split_sizes(rows, split_size) {
            micro_batches.push(to_device(&xs.narrow(0, start, size)?, first, true)?);
            start += size;
        }
        let outputs = pipeline::run(&self.stages, micro_batches)?;
        Ok(Tensor::cat(&outputs, 0)?)
    }
}

impl Module for ModelParallel {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        ModelParallel::forward(self, xs).map_err(Error::into_candle)
    }
}
