//! The vocabulary split over the tensor-parallel group (Megatron's `VocabParallelEmbedding` and
//! `vocab_parallel_cross_entropy`; torch's `loss_parallel`): rank `r` holds the embedding rows
//! and the output logits of tokens `r * vocab / tp..(r + 1) * vocab / tp`, and the loss is
//! computed from every rank's logits without gathering them.

use super::comm::reduce_from;
use crate::distributed::{ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use candle_core::{DType, Tensor, D};
use candle_nn::VarBuilder;

/// The tokens `start..end` of a vocabulary of `vocab` this rank holds.
fn range(vocab: usize, tp: &ProcessGroup) -> Result<(usize, usize)> {
    let ranks = tp.world_size();
    if vocab == 0 || !vocab.is_multiple_of(ranks) {
        return Err(Error::InvalidArgument {
            what: "vocabulary-parallel split",
            detail: format!(
                "a vocabulary of {vocab} tokens cannot be split over {ranks} tensor-parallel \
                 ranks; make it a positive multiple of {ranks} (pad it)"
            ),
        });
    }
    let per = vocab / ranks;
    Ok((tp.rank() * per, (tp.rank() + 1) * per))
}

/// `ids` (u32, any shape) as (this rank's local index, 1 where the token is this rank's, 0
/// elsewhere) for the tokens `start..end`.
fn local_ids(ids: &Tensor, (start, end): (usize, usize)) -> Result<(Tensor, Tensor)> {
    let ids = ids.to_dtype(DType::U32)?;
    let mine = ids.ge(start as u32)?.mul(&ids.lt(end as u32)?)?;
    let shifted = ids.to_dtype(DType::I64)?.affine(1.0, -(start as f64))?;
    let local = mine
        .where_cond(&shifted, &shifted.zeros_like()?)?
        .to_dtype(DType::U32)?;
    Ok((local, mine))
}

/// An embedding whose rows (the vocabulary) are split over the group: variable `weight`
/// `(vocab / tp, dim)`. Each rank looks up the tokens it holds, zeros for the others, and one
/// all-reduce ([`reduce_from`]) gives every rank the whole embeddings.
#[derive(Clone, Debug)]
pub struct VocabParallelEmbedding {
    weight: Tensor,
    range: (usize, usize),
    tp: ProcessGroup,
}

impl VocabParallelEmbedding {
    /// `vocab` tokens of `dim` values in all, this rank's rows from `vb` (initialised as
    /// candle-nn's `embedding`, standard normal, where new).
    pub fn new(vocab: usize, dim: usize, vb: VarBuilder, tp: &ProcessGroup) -> Result<Self> {
        let range = range(vocab, tp)?;
        let init = candle_nn::Init::Randn {
            mean: 0.,
            stdev: 1.,
        };
        let weight = vb.get_with_hints((range.1 - range.0, dim), "weight", init)?;
        Ok(Self {
            weight,
            range,
            tp: tp.clone(),
        })
    }

    /// The embeddings of `ids` (u32, any shape): shape `ids.dims() + [dim]`, whole on every rank.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let (local, mine) = local_ids(ids, self.range)?;
        let dim = self.weight.dim(1)?;
        let rows = self.weight.index_select(&local.flatten_all()?, 0)?;
        let mask = mine.flatten_all()?.to_dtype(rows.dtype())?.unsqueeze(1)?;
        let mut shape = ids.dims().to_vec();
        shape.push(dim);
        let partial = rows.broadcast_mul(&mask)?.reshape(shape)?;
        reduce_from(&partial, &self.tp)
    }

    /// The rows this rank holds.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
}

/// The mean cross-entropy of logits split over the group by vocabulary: `logits` is this
/// rank's `(rows, vocab / tp)` part (a column-parallel output layer's output, never gathered),
/// `targets` the `rows` token ids (u32) over the whole vocabulary. Equal to
/// `candle_nn::loss::cross_entropy` of the whole logits, with its gradient; each step moves
/// three numbers per row over the group (the maximum, the sum of exponentials and the target's
/// logit), not the logits.
pub fn vocab_parallel_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    tp: &ProcessGroup,
) -> Result<Tensor> {
    let (rows, per) = logits.dims2()?;
    if targets.dims() != [rows] {
        return Err(Error::InvalidArgument {
            what: "vocabulary-parallel cross-entropy",
            detail: format!(
                "logits of {rows} rows but targets of shape {:?}; give one target per row",
                targets.dims()
            ),
        });
    }
    let range = range(per * tp.world_size(), tp)?;
    let logits = logits.to_dtype(DType::F32)?;
    // The row maxima over the whole vocabulary, for stability only: no gradient.
    let max = tp.all_reduce(&logits.detach().max_keepdim(D::Minus1)?, ReduceOp::Max)?;
    let shifted = logits.broadcast_sub(&max)?;
    let sum_exp = reduce_from(&shifted.exp()?.sum_keepdim(D::Minus1)?, tp)?;
    let (local, mine) = local_ids(targets, range)?;
    let picked = shifted
        .gather(&local.unsqueeze(1)?, D::Minus1)?
        .broadcast_mul(&mine.to_dtype(DType::F32)?.unsqueeze(1)?)?;
    let target = reduce_from(&picked, tp)?;
    Ok((sum_exp.log()? - target)?.mean_all()?)
}
