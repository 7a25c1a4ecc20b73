//! Flat shards: each tensor cut into `world` equal chunks (the last one padded with zeros), rank
//! `r` holding chunk `r` of every tensor, the chunks laid end to end: torch FSDP2's
//! per-parameter sharding, flattened. ZeRO-2 and fully sharded training cut parameters,
//! gradients and optimizer state this way.
//!
//! Cutting each tensor (rather than one buffer of all of them) gives every rank a piece of
//! every tensor, so that an optimizer steps each parameter's piece on its own: a parameter
//! without a gradient is left out of a step on every rank, as in one process. A chunk has
//! `max(1, ceil(n / world))` elements, so no piece is ever empty; the padding (fewer than
//! `world` elements per tensor, and one per empty tensor) is zeros and never part of a tensor.
//!
//! The flat buffer a collective moves is rank-major: rank 0's shard, then rank 1's, and so on,
//! so that a reduce-scatter of it hands each rank its own shard and an all-gather of the shards
//! rebuilds it.
//!
//! ```rust
//! use candle_core::{Device, Tensor};
//! use candle_parallel::shard::FlatLayout;
//! # fn main() -> candle_parallel::Result<()> {
//! // Two tensors of 3 and 4 elements over 2 ranks: chunks of 2 and 2, a shard of 4 per rank.
//! let layout = FlatLayout::new(&[3, 4], 2);
//! assert_eq!((layout.shard_len(), layout.padded_len()), (4, 8));
//! let a = Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?;
//! let b = Tensor::new(&[[4f32, 5.], [6., 7.]], &Device::Cpu)?;
//! let flat = layout.flatten(&[a.clone(), b.clone()])?;
//! // Rank 0 holds [1, 2] of a and [4, 5] of b; rank 1 holds [3] of a (padded) and [6, 7].
//! assert_eq!(flat.to_vec1::<f32>()?, [1., 2., 4., 5., 3., 0., 6., 7.]);
//! assert_eq!(layout.shard(&[a, b], 1)?.to_vec1::<f32>()?, [3., 0., 6., 7.]);
//! let pieces = layout.pieces(1);
//! assert_eq!((pieces[0].tensor, pieces[0].within.clone()), (0, 2..3));
//! let back = layout.unflatten(&flat, &[vec![3], vec![2, 2]])?;
//! assert_eq!(back[1].to_vec2::<f32>()?, [[4., 5.], [6., 7.]]);
//! # Ok(()) }
//! ```

use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};
use std::ops::Range;

/// The length of each rank's chunk of a tensor of `numel` elements over `world` ranks:
/// `max(1, ceil(numel / world))` (a world of 0 is taken as 1).
pub fn chunk_len(numel: usize, world: usize) -> usize {
    numel.div_ceil(world.max(1)).max(1)
}

/// The elements of a tensor of `numel` elements that rank `rank`'s chunk holds (possibly
/// none: the chunk is then all padding).
pub fn chunk_elements(numel: usize, world: usize, rank: usize) -> Range<usize> {
    let c = chunk_len(numel, world);
    (rank * c).min(numel)..((rank + 1) * c).min(numel)
}

/// Rank `rank`'s chunk of `tensor` (flattened), padded with zeros to
/// [`chunk_len`]`(numel, world)` elements: a 1-D tensor of its dtype and device.
pub fn chunk_of(tensor: &Tensor, world: usize, rank: usize) -> Result<Tensor> {
    let n = tensor.elem_count();
    let c = chunk_len(n, world);
    let real = chunk_elements(n, world, rank);
    let mut parts = Vec::with_capacity(2);
    if !real.is_empty() {
        parts.push(tensor.flatten_all()?.narrow(0, real.start, real.len())?);
    }
    if real.len() < c {
        parts.push(Tensor::zeros(
            c - real.len(),
            tensor.dtype(),
            tensor.device(),
        )?);
    }
    Ok(match parts.len() {
        1 => parts.pop().expect("one part").contiguous()?,
        _ => Tensor::cat(&parts, 0)?,
    })
}

/// Where tensors of given sizes lie in flat shards, one per rank (see the
/// [module documentation](self)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatLayout {
    /// Each tensor's number of elements.
    numels: Vec<usize>,
    /// Each tensor's chunk length.
    chunks: Vec<usize>,
    /// Where each tensor's chunk starts in a shard.
    offsets: Vec<usize>,
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
    /// Lays out tensors of `numels` elements for `world` shards (a world of 0 is taken as 1).
    pub fn new(numels: &[usize], world: usize) -> Self {
        let world = world.max(1);
        let chunks: Vec<usize> = numels.iter().map(|&n| chunk_len(n, world)).collect();
        let mut offsets = Vec::with_capacity(numels.len());
        let mut shard_len = 0;
        for &c in &chunks {
            offsets.push(shard_len);
            shard_len += c;
        }
        Self {
            numels: numels.to_vec(),
            chunks,
            offsets,
            world,
            shard_len,
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
        self.numels.iter().sum()
    }

    /// The flat buffer's length, padding included: `world * shard_len`.
    pub fn padded_len(&self) -> usize {
        self.shard_len * self.world
    }

    /// The length of each shard.
    pub fn shard_len(&self) -> usize {
        self.shard_len
    }

    /// Where tensor `i`'s chunk lies in every shard.
    pub fn chunk_range(&self, i: usize) -> Range<usize> {
        self.offsets[i]..self.offsets[i] + self.chunks[i]
    }

    /// Rank `rank`'s shard of the flat buffer.
    pub fn shard_range(&self, rank: usize) -> Range<usize> {
        rank * self.shard_len..(rank + 1) * self.shard_len
    }

    /// The parts of tensors that fall in rank `rank`'s shard, in shard order (padding has
    /// none, and a chunk of padding only gives no piece).
    pub fn pieces(&self, rank: usize) -> Vec<Piece> {
        (0..self.len())
            .filter_map(|i| {
                let within = chunk_elements(self.numels[i], self.world, rank);
                (!within.is_empty()).then(|| Piece {
                    tensor: i,
                    in_shard: self.offsets[i]..self.offsets[i] + within.len(),
                    within,
                })
            })
            .collect()
    }

    /// Rank `rank`'s shard of `tensors`: each one's chunk, padded, laid end to end (a 1-D
    /// tensor of their common dtype and device).
    pub fn shard(&self, tensors: &[Tensor], rank: usize) -> Result<Tensor> {
        let (dtype, device) = self.check_tensors(tensors, "shard")?;
        let chunks = tensors
            .iter()
            .map(|t| chunk_of(t, self.world, rank))
            .collect::<Result<Vec<_>>>()?;
        cat_or_empty(&chunks, dtype, &device)
    }

    /// Every rank's shard of `tensors`, rank after rank: the buffer a reduce-scatter cuts.
    pub fn flatten(&self, tensors: &[Tensor]) -> Result<Tensor> {
        let (dtype, device) = self.check_tensors(tensors, "flatten")?;
        let world = self.world;
        let rows = tensors
            .iter()
            .zip(&self.chunks)
            .map(|(t, &c)| {
                let flat = t.flatten_all()?;
                let pad = world * c - t.elem_count();
                let padded = match pad {
                    0 => flat,
                    _ => Tensor::cat(&[flat, Tensor::zeros(pad, t.dtype(), t.device())?], 0)?,
                };
                Ok(padded.reshape((world, c))?)
            })
            .collect::<Result<Vec<_>>>()?;
        if rows.is_empty() {
            return Ok(Tensor::zeros(0, dtype, &device)?);
        }
        Ok(Tensor::cat(&rows, 1)?.flatten_all()?)
    }

    /// Each tensor's chunk in `shard` (a shard of this layout), as views, in layout order.
    pub fn split_shard(&self, shard: &Tensor) -> Result<Vec<Tensor>> {
        self.check_flat(shard, self.shard_len, "split_shard")?;
        (0..self.len())
            .map(|i| Ok(shard.narrow(0, self.offsets[i], self.chunks[i])?))
            .collect()
    }

    /// The tensors, with `shapes`, from every rank's shard (in rank order).
    pub fn from_shards(&self, shards: &[Tensor], shapes: &[Vec<usize>]) -> Result<Vec<Tensor>> {
        self.check_count(shapes.len(), "from_shards")?;
        if shards.len() != self.world {
            return Err(Error::InvalidArgument {
                what: "FlatLayout::from_shards",
                detail: format!(
                    "{} shards for a layout of {} ranks",
                    shards.len(),
                    self.world
                ),
            });
        }
        for s in shards {
            self.check_flat(s, self.shard_len, "from_shards")?;
        }
        shapes
            .iter()
            .enumerate()
            .map(|(i, shape)| {
                let numel: usize = shape.iter().product();
                if numel != self.numels[i] {
                    return Err(Error::InvalidArgument {
                        what: "FlatLayout",
                        detail: format!(
                            "shape {shape:?} for tensor {i}, which has {} elements",
                            self.numels[i]
                        ),
                    });
                }
                let chunks = shards
                    .iter()
                    .map(|s| s.narrow(0, self.offsets[i], self.chunks[i]))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Ok(Tensor::cat(&chunks, 0)?
                    .narrow(0, 0, numel)?
                    .reshape(shape.as_slice())?)
            })
            .collect()
    }

    /// Cuts a flat buffer of [`padded_len`](Self::padded_len) elements (every rank's shard,
    /// rank after rank) back into the tensors, with `shapes`.
    pub fn unflatten(&self, flat: &Tensor, shapes: &[Vec<usize>]) -> Result<Vec<Tensor>> {
        self.check_flat(flat, self.padded_len(), "unflatten")?;
        let shards = (0..self.world)
            .map(|r| Ok(flat.narrow(0, r * self.shard_len, self.shard_len)?))
            .collect::<Result<Vec<_>>>()?;
        self.from_shards(&shards, shapes)
    }

    fn check_flat(&self, t: &Tensor, len: usize, what: &str) -> Result<()> {
        if t.rank() != 1 || t.elem_count() != len {
            return Err(Error::InvalidArgument {
                what: "FlatLayout",
                detail: format!(
                    "{what} got a tensor of shape {:?}; the layout expects 1-D, {len} elements",
                    t.dims()
                ),
            });
        }
        Ok(())
    }

    /// Checks that `tensors` fit the layout (count, sizes, one dtype and device) and returns
    /// their dtype and device.
    fn check_tensors(&self, tensors: &[Tensor], what: &str) -> Result<(DType, Device)> {
        self.check_count(tensors.len(), what)?;
        let Some(first) = tensors.first() else {
            return Err(Error::InvalidArgument {
                what: "FlatLayout",
                detail: format!("{what}: no tensors, so no dtype or device for the shard"),
            });
        };
        for (i, t) in tensors.iter().enumerate() {
            if t.elem_count() != self.numels[i] || t.dtype() != first.dtype() {
                return Err(Error::InvalidArgument {
                    what: "FlatLayout",
                    detail: format!(
                        "{what}: tensor {i} has shape {:?} ({} elements, {:?}); the layout \
                         expects {} elements of {:?}",
                        t.dims(),
                        t.elem_count(),
                        t.dtype(),
                        self.numels[i],
                        first.dtype()
                    ),
                });
            }
        }
        Ok((first.dtype(), first.device().clone()))
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

/// `parts` laid end to end (an empty 1-D tensor of `dtype` when there are none).
fn cat_or_empty(parts: &[Tensor], dtype: DType, device: &Device) -> Result<Tensor> {
    Ok(match parts {
        [] => Tensor::zeros(0, dtype, device)?,
        [one] => one.clone(),
        _ => Tensor::cat(parts, 0)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn counting(numels: &[usize]) -> Vec<Tensor> {
        let mut next = 1f32;
        numels
            .iter()
            .map(|&n| {
                let values: Vec<f32> = (0..n)
                    .map(|_| {
                        next += 1.0;
                        next
                    })
                    .collect();
                Tensor::from_vec(values, n, &Device::Cpu).unwrap()
            })
            .collect()
    }

    #[test]
    fn every_element_lies_in_exactly_one_piece_and_every_rank_holds_a_chunk_of_every_tensor() {
        for numels in [vec![7, 1, 13], vec![1], vec![5, 5], vec![0, 3, 0]] {
            for world in 1..6 {
                let l = FlatLayout::new(&numels, world);
                assert_eq!(l.padded_len(), world * l.shard_len());
                let mut seen: Vec<Vec<bool>> = numels.iter().map(|&n| vec![false; n]).collect();
                for rank in 0..world {
                    for p in l.pieces(rank) {
                        assert_eq!(p.within.len(), p.in_shard.len());
                        assert!(p.in_shard.end <= l.shard_len());
                        assert_eq!(p.in_shard.start, l.chunk_range(p.tensor).start);
                        for e in p.within {
                            assert!(!seen[p.tensor][e], "{numels:?} over {world}: twice");
                            seen[p.tensor][e] = true;
                        }
                    }
                }
                assert!(seen.iter().flatten().all(|&s| s), "{numels:?} over {world}");
                // Padding: fewer than `world` elements per tensor, one for an empty tensor.
                for (i, &n) in numels.iter().enumerate() {
                    let padding = world * l.chunk_range(i).len() - n;
                    assert!(padding < world || (n == 0 && padding == world));
                }
            }
        }
    }

    #[test]
    fn flatten_shard_and_unflatten_agree_for_sizes_no_world_divides() {
        for numels in [vec![7, 1, 13], vec![0, 3, 0], vec![2]] {
            let tensors = counting(&numels);
            let shapes: Vec<Vec<usize>> = numels.iter().map(|&n| vec![n]).collect();
            for world in 1..6 {
                let l = FlatLayout::new(&numels, world);
                let flat = l.flatten(&tensors).unwrap();
                assert_eq!(flat.dims(), [l.padded_len()]);
                let shards: Vec<Tensor> =
                    (0..world).map(|r| l.shard(&tensors, r).unwrap()).collect();
                for (r, s) in shards.iter().enumerate() {
                    let range = l.shard_range(r);
                    let from_flat = flat.narrow(0, range.start, range.len()).unwrap();
                    assert_eq!(
                        s.to_vec1::<f32>().unwrap(),
                        from_flat.to_vec1::<f32>().unwrap()
                    );
                    // Each piece holds exactly the tensor's elements it names.
                    for p in l.pieces(r) {
                        let want = tensors[p.tensor]
                            .narrow(0, p.within.start, p.within.len())
                            .unwrap();
                        let got = s.narrow(0, p.in_shard.start, p.in_shard.len()).unwrap();
                        assert_eq!(
                            got.to_vec1::<f32>().unwrap(),
                            want.to_vec1::<f32>().unwrap()
                        );
                    }
                    let chunks = l.split_shard(s).unwrap();
                    assert_eq!(chunks.len(), numels.len());
                }
                for (t, back) in tensors.iter().zip(l.unflatten(&flat, &shapes).unwrap()) {
                    assert_eq!(t.to_vec1::<f32>().unwrap(), back.to_vec1::<f32>().unwrap());
                }
                for (t, back) in tensors.iter().zip(l.from_shards(&shards, &shapes).unwrap()) {
                    assert_eq!(t.to_vec1::<f32>().unwrap(), back.to_vec1::<f32>().unwrap());
                }
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
