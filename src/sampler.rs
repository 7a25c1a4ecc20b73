//! `DistributedSampler`: each rank's share of a dataset's indices, as in PyTorch.
//!
//! Every rank builds the same (optionally shuffled) list of indices, pads it by wrapping around
//! to a multiple of the number of replicas (or, with `drop_last`, truncates it), and takes every
//! `num_replicas`-th index starting at its rank. Shuffling is seeded by `seed + epoch`, so call
//! [`DistributedSampler::set_epoch`] at the start of each epoch to reshuffle. The permutation
//! comes from this crate's own [`Rng`]: identical on every rank and platform,
//! but not the same permutation as PyTorch's.
//!
//! ```rust
//! use candle_parallel::sampler::{DistributedSampler, SamplerConfig};
//! # fn main() -> candle_parallel::Result<()> {
//! let in_order = SamplerConfig { shuffle: false, ..Default::default() };
//! let shares: Vec<Vec<usize>> = (0..3)
//!     .map(|rank| Ok(DistributedSampler::new(10, 3, rank, in_order)?.indices()))
//!     .collect::<candle_parallel::Result<_>>()?;
//! assert_eq!(shares, [vec![0, 3, 6, 9], vec![1, 4, 7, 0], vec![2, 5, 8, 1]]);
//! # Ok(()) }
//! ```

use crate::distributed::ProcessGroup;
use crate::error::{Error, Result};
use crate::rng::Rng;

/// Options of [`DistributedSampler`]; `Default` gives PyTorch's defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SamplerConfig {
    /// Shuffle the indices (default true).
    pub shuffle: bool,
    /// The seed, the same on every rank (default 0).
    pub seed: u64,
    /// Drop the tail so that every rank gets the same number of distinct samples, instead of
    /// padding with samples from the start (default false).
    pub drop_last: bool,
}

/// The old name of [`SamplerConfig`].
#[deprecated(
    since = "0.1.0",
    note = "use `SamplerConfig`: the crate's options are `*Config`"
)]
pub type SamplerOptions = SamplerConfig;

impl Default for SamplerConfig {
    fn default() -> Self {
        Self {
            shuffle: true,
            seed: 0,
            drop_last: false,
        }
    }
}

/// One rank's share of the indices `0..len` of a dataset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistributedSampler {
    dataset_len: usize,
    num_replicas: usize,
    rank: usize,
    options: SamplerConfig,
    epoch: u64,
    num_samples: usize,
}

impl DistributedSampler {
    /// The share of `rank` of `num_replicas` ranks in a dataset of `len` samples.
    pub fn new(
        len: usize,
        num_replicas: usize,
        rank: usize,
        options: SamplerConfig,
    ) -> Result<Self> {
        let invalid = |detail: String| {
            Err(Error::InvalidArgument {
                what: "DistributedSampler",
                detail,
            })
        };
        if num_replicas == 0 {
            return invalid("num_replicas is 0; it must be the number of ranks (>= 1)".into());
        }
        if rank >= num_replicas {
            return invalid(format!(
                "rank {rank} is not below num_replicas {num_replicas}: ranks are 0..{num_replicas}"
            ));
        }
        if len == 0 {
            return invalid("the dataset is empty: there is nothing to sample".into());
        }
        let num_samples = if options.drop_last && !len.is_multiple_of(num_replicas) {
            // ceil((len - R) / R), 0 when len < R.
            len.saturating_sub(num_replicas).div_ceil(num_replicas)
        } else {
            len.div_ceil(num_replicas)
        };
        if num_samples == 0 {
            return invalid(format!(
                "drop_last with {len} samples and {num_replicas} replicas leaves no sample for \
                 any rank; use drop_last = false or fewer replicas"
            ));
        }
        Ok(Self {
            dataset_len: len,
            num_replicas,
            rank,
            options,
            epoch: 0,
            num_samples,
        })
    }

    /// This rank's share, with the group's rank and world size.
    pub fn for_group(len: usize, group: &ProcessGroup, options: SamplerConfig) -> Result<Self> {
        Self::new(len, group.world_size(), group.rank(), options)
    }

    /// Sets the epoch: the shuffle of epoch `e` is seeded by `seed + e`.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The number of indices this rank gets per epoch (the same on every rank).
    pub fn len(&self) -> usize {
        self.num_samples
    }

    /// Always false: an empty sampler cannot be built.
    pub fn is_empty(&self) -> bool {
        self.num_samples == 0
    }

    /// The padded (or truncated) total over all ranks.
    pub fn total_size(&self) -> usize {
        self.num_samples * self.num_replicas
    }

    /// This rank's indices for the current epoch.
    pub fn indices(&self) -> Vec<usize> {
        let mut indices: Vec<usize> = if self.options.shuffle {
            Rng::new(self.options.seed.wrapping_add(self.epoch)).permutation(self.dataset_len)
        } else {
            (0..self.dataset_len).collect()
        };
        let total = self.total_size();
        if total > indices.len() {
            // Pad by wrapping around from the start, as often as needed.
            let padding: Vec<usize> = indices
                .iter()
                .copied()
                .cycle()
                .take(total - self.dataset_len)
                .collect();
            indices.extend(padding);
        } else {
            indices.truncate(total);
        }
        indices
            .into_iter()
            .skip(self.rank)
            .step_by(self.num_replicas)
            .collect()
    }
}

impl DistributedSampler {
    /// This rank's indices for the current epoch in batches of `batch_size`, as PyTorch's
    /// `BatchSampler(sampler, batch_size, drop_last)`: the last, shorter batch is dropped with
    /// `drop_last`, else kept. Every rank gets the same number of batches (each rank's share has
    /// the same length).
    ///
    /// ```rust
    /// use candle_parallel::sampler::{DistributedSampler, SamplerConfig};
    /// # fn main() -> candle_parallel::Result<()> {
    /// let in_order = SamplerConfig { shuffle: false, ..Default::default() };
    /// let sampler = DistributedSampler::new(10, 2, 0, in_order)?; // indices 0, 2, 4, 6, 8
    /// let batches: Vec<Vec<usize>> = sampler.batches(2, true)?.collect();
    /// assert_eq!(batches, [vec![0, 2], vec![4, 6]]);
    /// assert_eq!(sampler.batches(2, false)?.len(), 3); // [8] too
    /// # Ok(()) }
    /// ```
    pub fn batches(&self, batch_size: usize, drop_last: bool) -> Result<Batches> {
        if batch_size == 0 {
            return Err(Error::InvalidArgument {
                what: "DistributedSampler::batches",
                detail: "batch_size is 0; a batch holds at least one index".into(),
            });
        }
        let mut indices = self.indices();
        if drop_last {
            indices.truncate(indices.len() / batch_size * batch_size);
        }
        Ok(Batches {
            indices,
            batch_size,
            next: 0,
        })
    }
}

/// One epoch of a rank's indices in batches ([`DistributedSampler::batches`]).
#[derive(Clone, Debug)]
pub struct Batches {
    indices: Vec<usize>,
    batch_size: usize,
    next: usize,
}

impl Iterator for Batches {
    type Item = Vec<usize>;

    fn next(&mut self) -> Option<Vec<usize>> {
        if self.next >= self.indices.len() {
            return None;
        }
        let end = (self.next + self.batch_size).min(self.indices.len());
        let batch = self.indices[self.next..end].to_vec();
        self.next = end;
        Some(batch)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = (self.indices.len() - self.next).div_ceil(self.batch_size);
        (n, Some(n))
    }
}

impl ExactSizeIterator for Batches {}

impl IntoIterator for &DistributedSampler {
    type Item = usize;
    type IntoIter = std::vec::IntoIter<usize>;

    fn into_iter(self) -> Self::IntoIter {
        self.indices().into_iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shares(len: usize, replicas: usize, options: SamplerConfig) -> Vec<Vec<usize>> {
        (0..replicas)
            .map(|r| {
                DistributedSampler::new(len, replicas, r, options)
                    .unwrap()
                    .indices()
            })
            .collect()
    }

    const IN_ORDER: SamplerConfig = SamplerConfig {
        shuffle: false,
        seed: 0,
        drop_last: false,
    };

    #[test]
    fn torchs_worked_example() {
        assert_eq!(
            shares(10, 3, IN_ORDER),
            [vec![0, 3, 6, 9], vec![1, 4, 7, 0], vec![2, 5, 8, 1]]
        );
        let drop = SamplerConfig {
            drop_last: true,
            ..IN_ORDER
        };
        assert_eq!(
            shares(10, 3, drop),
            [vec![0, 3, 6], vec![1, 4, 7], vec![2, 5, 8]]
        );
    }

    #[test]
    fn padding_wraps_around_more_than_once_when_needed() {
        // 2 samples on 5 replicas: total 5, padded 0,1,0,1,0.
        assert_eq!(
            shares(2, 5, IN_ORDER),
            [vec![0], vec![1], vec![0], vec![1], vec![0]]
        );
    }

    #[test]
    fn shuffled_shares_partition_the_dataset_and_agree_across_ranks() {
        for (len, replicas) in [(10, 3), (64, 4), (7, 8), (100, 7)] {
            let s = shares(len, replicas, SamplerConfig::default());
            let per = len.div_ceil(replicas);
            assert!(s.iter().all(|share| share.len() == per));
            let mut all: Vec<usize> = s.concat();
            all.sort();
            let mut distinct = all.clone();
            distinct.dedup();
            assert_eq!(
                distinct,
                (0..len).collect::<Vec<_>>(),
                "every sample is used"
            );
            assert_eq!(
                all.len() - len,
                per * replicas - len,
                "only padding repeats"
            );
            // Every rank would compute the same permutation: a fresh sampler agrees.
            assert_eq!(s, shares(len, replicas, SamplerConfig::default()));
        }
        let drop = SamplerConfig {
            drop_last: true,
            ..Default::default()
        };
        let s = shares(100, 7, drop);
        let mut all = s.concat();
        assert_eq!(all.len(), 98);
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 98, "drop_last shares are disjoint");
    }

    #[test]
    fn epochs_and_seeds_shuffle_differently_and_reproducibly() {
        let mut a = DistributedSampler::new(50, 2, 1, SamplerConfig::default()).unwrap();
        let e0 = a.indices();
        a.set_epoch(1);
        let e1 = a.indices();
        assert_ne!(e0, e1);
        a.set_epoch(0);
        assert_eq!(a.indices(), e0);
        let seeded = SamplerConfig {
            seed: 7,
            ..Default::default()
        };
        let b = DistributedSampler::new(50, 2, 1, seeded).unwrap();
        assert_ne!(b.indices(), e0);
        // seed + epoch: seed 6 at epoch 1 shuffles as seed 7 at epoch 0.
        let mut c = DistributedSampler::new(50, 2, 1, SamplerConfig { seed: 6, ..seeded }).unwrap();
        c.set_epoch(1);
        assert_eq!(c.indices(), b.indices());
    }

    #[test]
    fn batches_cut_the_share_as_torch_s_batch_sampler_does() {
        let shuffled = SamplerConfig::default();
        let sampler = DistributedSampler::new(23, 2, 1, shuffled).unwrap();
        let share = sampler.indices(); // 12 indices
        let kept: Vec<Vec<usize>> = sampler.batches(5, false).unwrap().collect();
        assert_eq!(kept.concat(), share);
        assert_eq!(kept.iter().map(Vec::len).collect::<Vec<_>>(), [5, 5, 2]);
        let dropped: Vec<Vec<usize>> = sampler.batches(5, true).unwrap().collect();
        assert_eq!(dropped, kept[..2]);
        let mut it = sampler.batches(5, false).unwrap();
        assert_eq!(it.len(), 3);
        it.next();
        assert_eq!(it.len(), 2);
        let err = sampler.batches(0, false).unwrap_err().to_string();
        assert!(err.contains("batch_size is 0"), "{err}");
    }

    #[test]
    fn bad_arguments_are_refused_with_the_reason() {
        let err = |len, n, r, o| {
            DistributedSampler::new(len, n, r, o)
                .unwrap_err()
                .to_string()
        };
        assert!(err(10, 3, 3, IN_ORDER).contains("rank 3 is not below num_replicas 3"));
        assert!(err(10, 0, 0, IN_ORDER).contains("num_replicas is 0"));
        assert!(err(0, 2, 0, IN_ORDER).contains("empty"));
        let drop = SamplerConfig {
            drop_last: true,
            ..IN_ORDER
        };
        assert!(err(2, 3, 0, drop).contains("leaves no sample"));
        assert_eq!(DistributedSampler::new(2, 3, 0, IN_ORDER).unwrap().len(), 1);
    }
}
