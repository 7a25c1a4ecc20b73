//! Megatron's column- and row-parallel linear layers (torch's `ColwiseParallel` and
//! `RowwiseParallel`), trained with the conjugate collectives of [`comm`](super::comm).

use super::comm::{copy_to, gather_sequence, reduce_from, scatter_sequence};
use crate::distributed::{ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use candle_core::{Module, Tensor};
use candle_nn::{Linear, VarBuilder};

/// `n` split evenly over `tp`, or an error naming both.
fn split(n: usize, tp: &ProcessGroup, what: &str) -> Result<usize> {
    let ranks = tp.world_size();
    if !n.is_multiple_of(ranks) {
        return Err(Error::InvalidArgument {
            what: "tensor-parallel split",
            detail: format!(
                "{what} is {n}, which {ranks} tensor-parallel ranks cannot share evenly; make \
                 it a multiple of {ranks}"
            ),
        });
    }
    Ok(n / ranks)
}

/// A linear layer's variables `weight` of `shape` and `bias` of `bias_len` from `vb`,
/// initialised where new as candle-nn's `linear` of the whole layer (`in_dim` inputs) is.
fn variables(
    vb: &VarBuilder,
    shape: (usize, usize),
    bias_len: usize,
    in_dim: usize,
) -> Result<(Tensor, Tensor)> {
    let weight = vb.get_with_hints(shape, "weight", candle_nn::init::DEFAULT_KAIMING_NORMAL)?;
    let bound = 1. / (in_dim as f64).sqrt();
    let init = candle_nn::Init::Uniform {
        lo: -bound,
        up: bound,
    };
    Ok((weight, vb.get_with_hints(bias_len, "bias", init)?))
}

/// This rank's part of a full layer's `weight` (`out x in`) and `bias` (`out`), as
/// [`ColumnParallelLinear`] (`column`: rows of the weight, the same slice of the bias) or
/// [`RowParallelLinear`] (columns of the weight, the whole bias) holds it: to start a
/// tensor-parallel model from a one-process one (insert them into the rank's `VarMap` under
/// the same names before building the layers).
pub fn shard_linear(
    weight: &Tensor,
    bias: Option<&Tensor>,
    tp: &ProcessGroup,
    column: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let (out, inp) = weight.dims2()?;
    let r = tp.rank();
    if column {
        let rows = split(out, tp, "the layer's output size")?;
        let bias = bias
            .map(|b| b.narrow(0, r * rows, rows)?.contiguous())
            .transpose()?;
        Ok((weight.narrow(0, r * rows, rows)?.contiguous()?, bias))
    } else {
        let cols = split(inp, tp, "the layer's input size")?;
        Ok((
            weight.narrow(1, r * cols, cols)?.contiguous()?,
            bias.cloned(),
        ))
    }
}

/// A linear layer whose output features are split over the tensor-parallel group: rank `r`
/// holds rows `r * out / tp..` of the weight and that slice of the bias, takes the whole input
/// and gives its slice of the output features. Its forward begins with [`copy_to`], so the
/// input's gradient is summed over the group.
#[derive(Clone, Debug)]
pub struct ColumnParallelLinear {
    layer: Linear,
    tp: ProcessGroup,
    /// The input is this rank's positions of the sequence, gathered first.
    sequence_parallel: bool,
}

/// A linear layer whose input features are split over the tensor-parallel group: rank `r`
/// holds columns `r * in / tp..` of the weight and the whole bias, takes its slice of the
/// input features (a column-parallel layer's output) and gives the whole output: the partial
/// products summed by [`reduce_from`], then the bias.
#[derive(Clone, Debug)]
pub struct RowParallelLinear {
    layer: Linear,
    bias: Option<Tensor>,
    tp: ProcessGroup,
    /// The output is this rank's positions of the sequence, reduce-scattered.
    sequence_parallel: bool,
}

impl ColumnParallelLinear {
    /// `in_dim -> out_dim / tp` on this rank, variables `weight` `(out_dim / tp, in_dim)` and
    /// `bias` `(out_dim / tp)` from `vb` (initialised as candle-nn's `linear` where new).
    pub fn new(in_dim: usize, out_dim: usize, vb: VarBuilder, tp: &ProcessGroup) -> Result<Self> {
        let rows = split(out_dim, tp, "the layer's output size")?;
        let (weight, bias) = variables(&vb, (rows, in_dim), rows, in_dim)?;
        Ok(Self {
            layer: Linear::new(weight, Some(bias)),
            tp: tp.clone(),
            sequence_parallel: false,
        })
    }

    /// Under sequence parallelism (`on`), the input `(batch, time / tp, in)` is this rank's
    /// positions, all-gathered first (their gradient reduce-scattered back): Megatron's
    /// `sequence_parallel`.
    pub fn sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }

    /// This rank's slice of the output features of `x` (of the whole sequence).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(crate::nn::linear(&self.input(x)?, &self.layer)?)
    }

    /// The exact GELU of [`ColumnParallelLinear::forward`], the product, the bias and the GELU
    /// as one op ([`crate::nn::linear_gelu`]): a transformer MLP's first layer.
    pub fn forward_gelu(&self, x: &Tensor) -> Result<Tensor> {
        Ok(crate::nn::linear_gelu(&self.input(x)?, &self.layer)?)
    }

    /// `x` as the product takes it: handed on (its gradient summed over the group), or under
    /// sequence parallelism gathered along the sequence.
    fn input(&self, x: &Tensor) -> Result<Tensor> {
        match self.sequence_parallel {
            true => gather_sequence(x, &self.tp),
            false => copy_to(x, &self.tp),
        }
    }

    /// The weight this rank holds.
    pub fn weight(&self) -> &Tensor {
        self.layer.weight()
    }
}

impl RowParallelLinear {
    /// `in_dim / tp -> out_dim` on this rank, variables `weight` `(out_dim, in_dim / tp)` and
    /// `bias` `(out_dim)` from `vb` (initialised as candle-nn's `linear` of the whole layer
    /// where new).
    pub fn new(in_dim: usize, out_dim: usize, vb: VarBuilder, tp: &ProcessGroup) -> Result<Self> {
        let cols = split(in_dim, tp, "the layer's input size")?;
        let (weight, bias) = variables(&vb, (out_dim, cols), out_dim, in_dim)?;
        Ok(Self {
            layer: Linear::new(weight, None),
            bias: Some(bias),
            tp: tp.clone(),
            sequence_parallel: false,
        })
    }

    /// Under sequence parallelism (`on`), the output is this rank's positions `(batch, time /
    /// tp, out)`, the partial products reduce-scattered along the sequence (their gradient
    /// all-gathered back) instead of all-reduced. The bias is then added on each rank's
    /// positions: give it to [`sum_sequence_parallel_gradients`].
    pub fn sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }

    /// The whole output (or, under sequence parallelism, this rank's positions of it), from
    /// this rank's slice `x` of the input features.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let partial = crate::nn::linear(x, &self.layer)?;
        let y = match self.sequence_parallel {
            true => scatter_sequence(&partial, &self.tp)?,
            false => reduce_from(&partial, &self.tp)?,
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    /// The weight this rank holds.
    pub fn weight(&self) -> &Tensor {
        self.layer.weight()
    }
}

impl Module for ColumnParallelLinear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        ColumnParallelLinear::forward(self, x).map_err(Error::into_candle)
    }
}

impl Module for RowParallelLinear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        RowParallelLinear::forward(self, x).map_err(Error::into_candle)
    }
}

/// Sums over the group the gradients of `params` that every rank holds whole but uses on its
/// own positions of the sequence, in one all-reduce: under sequence parallelism, the norms'
/// parameters between the layers and the bias of each sequence-parallel [`RowParallelLinear`]
/// (added after the reduce-scatter), whose gradients on each rank cover its positions only; a parameter without a
/// gradient takes part with zeros. Every rank of `tp` calls it with the same parameters, in the
/// same order, before the optimizer's step.
pub fn sum_sequence_parallel_gradients(
    grads: &mut candle_core::backprop::GradStore,
    params: &[candle_core::Var],
    tp: &ProcessGroup,
) -> Result<()> {
    if tp.world_size() == 1 || params.is_empty() {
        return Ok(());
    }
    let tensors = params
        .iter()
        .map(|p| match grads.get(p.as_tensor()) {
            Some(g) => Ok(g.clone()),
            None => p.as_tensor().zeros_like(),
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    for (p, g) in params
        .iter()
        .zip(tp.all_reduce_many(&tensors, ReduceOp::Sum)?)
    {
        grads.insert(p.as_tensor(), g);
    }
    Ok(())
}
