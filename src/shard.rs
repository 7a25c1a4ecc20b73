//! Flat shards: tensors laid end to end in one flat buffer, padded to a multiple of the world
//! size and cut into equal shards, one per rank, as ZeRO and FSDP cut theirs.
//!
//! Cutting along the flat buffer rather than tensor by tensor gives every rank a share within
//! one element of the others' whatever the tensor sizes. The padding (fewer than `world`
//! elements, at the end) is zeros and never part of a tensor.
//!
//! ```rust
//! use candle_core::{Device, Tensor};
//! use candle_parallel::shard::FlatLayout;
//! # fn main() -> candle_parallel::Result<()> {
//! // Two tensors of 3 and 4 elements over 3 ranks: 7 elements, padded to 9, 3 per rank.
//! let layout = FlatLayout::new(&[3, 4], 3);
//! assert_eq!((layout.shard_len(), layout.padded_len()), (3, 9));
//! assert_eq!(layout.shard_range(2), 6..9);
//! let a = Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?;
//! let b = Tensor::new(&[[4f32, 5.], [6., 7.]], &Device::Cpu)?;
//! let flat = layout.flatten(&[a, b])?;
//! assert_eq!(flat.to_vec1::<f32>()?, [1., 2., 3., 4., 5., 6., 7., 0., 0.]);
//! // Rank 1 holds the first three elements of b.
//! let pieces = layout.pieces(1);
//! assert_eq!((pieces[0].tensor, pieces[0].within.clone()), (1, 0..3));
//! let back = layout.unflatten(&flat, &[vec![3], vec![2, 2]])?;
//! assert_eq!(back[1].to_vec2::<f32>()?, [[4., 5.], [6., 7.]]);
//! # Ok(()) }
//! ```

use crate::error::{Error, Result};
use candle_core::Tensor;
use std::ops::Range;

/// Where tensors of given sizes lie in a flat buffer cut into `world` equal shards.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatLayout {
    /// Each tensor's first element in the flat buffer.
    offsets: Vec<usize>,
    /// Each tensor's number of elements.
    numels: Vec<usize>,
    total: usize,
    world: usize,
    shard_len: usize,
}

/// The part of one tensor that falls in one shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The tensor's index in the layout.
    pub tensor: usize,
    /// The elements of the (flattened) tensor.
    pub within: Range<usize>,
    /// Where they lie in the shard.
    pub in_shard: Range<usize>,
}

impl FlatLayout {
    /// Lays out tensors of `numels` elements end to end for `world` shards (a world of 0 is
    /// taken as 1).
    pub fn new(numels: &[usize], world: usize) -> Self {
        let world = world.max(1);
        let mut offsets = Vec::with_capacity(numels.len());
        let mut total = 0;
        for &n in numels {
            offsets.push(total);
            total += n;
        }
        Self {
            offsets,
            numels: numels.to_vec(),
            total,
            world,
            shard_len: total.div_ceil(world),
        }
    }

    /// The number of shards.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The number of tensors laid out.
    pub fn len(&self) -> usize {
        self.numels.len()
    }

    /// Whether no tensor is laid out.
    pub fn is_empty(&self) -> bool {
        self.numels.is_empty()
    }

    /// The elements of every tensor together, without padding.
    pub fn total_len(&self) -> usize {
        self.total
    }

    /// The flat buffer's length, padding included: `world * shard_len`.
    pub fn padded_len(&self) -> usize {
        self.shard_len * self.world
    }

    /// The length of each shard.
    pub fn shard_len(&self) -> usize {
        self.shard_len
    }

    /// Tensor `i`'s elements in the flat buffer.
    pub fn tensor_range(&self, i: usize) -> Range<usize> {
        self.offsets[i]..self.offsets[i] + self.numels[i]
    }

    /// Rank `rank`'s shard of the flat buffer.
    pub fn shard_range(&self, rank: usize) -> Range<usize> {
        rank * self.shard_len..(rank + 1) * self.shard_len
    }

    /// The parts of tensors that fall in rank `rank`'s shard, in flat order (padding has none).
    pub fn pieces(&self, rank: usize) -> Vec<Piece> {
        self.pieces_of(self.shard_range(rank))
    }

    /// The parts of tensors that fall in `range` of the flat buffer, in flat order; `in_shard`
    /// counts from `range.start`.
    pub fn pieces_of(&self, range: Range<usize>) -> Vec<Piece> {
        (0..self.len())
            .filter_map(|i| {
                let t = self.tensor_range(i);
                let (start, end) = (t.start.max(range.start), t.end.min(range.end));
                (start < end).then(|| Piece {
                    tensor: i,
                    within: start - t.start..end - t.start,
                    in_shard: start - range.start..end - range.start,
                })
            })
            .collect()
    }

    /// The tensors, flattened and laid end to end, padded with zeros to
    /// [`padded_len`](Self::padded_len): a 1-D tensor of their (common) dtype and device.
    pub fn flatten(&self, tensors: &[Tensor]) -> Result<Tensor> {
        let Some(first) = tensors.first() else {
            return Err(Error::InvalidArgument {
                what: "FlatLayout::flatten",
                detail: "no tensors: a flat buffer needs at least one for its dtype and device"
                    .into(),
            });
        };
        self.check_count(tensors.len(), "flatten")?;
        let mut parts = Vec::with_capacity(tensors.len() + 1);
        for (i, t) in tensors.iter().enumerate() {
            if t.elem_count() != self.numels[i] || t.dtype() != first.dtype() {
                return Err(Error::InvalidArgument {
                    what: "FlatLayout::flatten",
                    detail: format!(
                        "tensor {i} has shape {:?} ({} elements, {:?}); the layout expects {} \
                         elements of {:?}",
                        t.dims(),
                        t.elem_count(),
                        t.dtype(),
                        self.numels[i],
                        first.dtype()
                    ),
                });
            }
            parts.push(t.flatten_all()?);
        }
        let pad = self.padded_len() - self.total;
        if pad > 0 {
            parts.push(Tensor::zeros(pad, first.dtype(), first.device())?);
        }
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// Cuts a flat buffer of [`padded_len`](Self::padded_len) (or [`total_len`](Self::total_len))
    /// elements back into the tensors, with `shapes`.
    pub fn unflatten(&self, flat: &Tensor, shapes: &[Vec<usize>]) -> Result<Vec<Tensor>> {
        self.check_count(shapes.len(), "unflatten")?;
        let len = flat.elem_count();
        if flat.rank() != 1 || (len != self.padded_len() && len != self.total) {
            return Err(Error::InvalidArgument {
                what: "FlatLayout::unflatten",
                detail: format!(
                    "a flat buffer of shape {:?}; the layout expects 1-D, {} elements (or {} \
                     without padding)",
                    flat.dims(),
                    self.padded_len(),
                    self.total
                ),
            });
        }
        shapes
            .iter()
            .enumerate()
            .map(|(i, shape)| {
                let numel: usize = shape.iter().product();
                if numel != self.numels[i] {
                    return Err(Error::InvalidArgument {
                        what: "FlatLayout::unflatten",
                        detail: format!(
                            "shape {shape:?} for tensor {i}, which has {} elements",
                            self.numels[i]
                        ),
                    });
                }
                Ok(flat
                    .narrow(0, self.offsets[i], numel)?
                    .reshape(shape.as_slice())?)
            })
            .collect()
    }

    fn check_count(&self, given: usize, what: &str) -> Result<()> {
        if given != self.len() {
            return Err(Error::InvalidArgument {
                what: "FlatLayout",
                detail: format!("{what} got {given} tensors; the layout has {}", self.len()),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn every_element_lies_in_exactly_one_piece_and_shards_differ_by_padding_only() {
        for numels in [vec![7, 1, 13], vec![1], vec![5, 5], vec![0, 3, 0]] {
            for world in 1..6 {
                let l = FlatLayout::new(&numels, world);
                assert!(l.padded_len() - l.total_len() < world);
                let mut seen: Vec<Vec<bool>> = numels.iter().map(|&n| vec![false; n]).collect();
                for rank in 0..world {
                    for p in l.pieces(rank) {
                        assert_eq!(p.within.len(), p.in_shard.len());
                        assert!(p.in_shard.end <= l.shard_len());
                        for e in p.within {
                            assert!(!seen[p.tensor][e], "{numels:?} over {world}: twice");
                            seen[p.tensor][e] = true;
                        }
                    }
                }
                assert!(seen.iter().flatten().all(|&s| s), "{numels:?} over {world}");
            }
        }
    }

    #[test]
    fn bad_input_is_an_error_that_names_the_tensor() {
        let l = FlatLayout::new(&[3, 4], 2);
        let a = Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu).unwrap();
        let err = l.flatten(&[a.clone(), a.clone()]).unwrap_err().to_string();
        assert!(err.contains("tensor 1 has shape [3]"), "{err}");
        let err = l.flatten(std::slice::from_ref(&a)).unwrap_err().to_string();
        assert!(err.contains("got 1 tensors"), "{err}");
        let err = l
            .unflatten(&a, &[vec![3], vec![4]])
            .unwrap_err()
            .to_string();
        assert!(err.contains("expects 1-D, 8 elements"), "{err}");
    }
}
