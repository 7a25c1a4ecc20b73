//! Which gradients travel together: DistributedDataParallel's bucket assignment (torch's
//! `compute_bucket_assignment_by_size`).
//!
//! Parameters are taken in the order their gradients are expected to become ready (the reverse
//! of the order the model uses them, or, after the first iteration, the order observed). Each
//! dtype fills buckets of its own: a parameter joins the open bucket of its dtype, and a bucket
//! closes once it holds at least its limit: `first_bytes` for a dtype's first bucket (small,
//! so that the first all-reduce starts early in backward), `cap_bytes` after. A parameter
//! larger than the limit gets a bucket to itself. Buckets come out in the order of their first
//! parameter, the order they become ready and are all-reduced in.
//!
//! ```rust
//! use candle_core::DType;
//! use candle_parallel::ddp::bucket::{assign_buckets, BucketParam};
//! const MIB: usize = 1 << 20;
//! let p = |index, mib| BucketParam { index, bytes: mib * MIB, dtype: DType::F32 };
//! // A 1 MiB first bucket, then 25 MiB ones.
//! let params = [p(5, 1), p(4, 10), p(3, 10), p(2, 10), p(1, 30), p(0, 2)];
//! assert_eq!(assign_buckets(&params, MIB, 25 * MIB), [vec![5], vec![4, 3, 2], vec![1], vec![0]]);
//! ```

use candle_core::DType;

/// One parameter as bucketing sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketParam {
    /// The parameter's index (what the buckets list).
    pub index: usize,
    /// Its size in bytes.
    pub bytes: usize,
    /// Its dtype: buckets never mix dtypes.
    pub dtype: DType,
}

/// Groups `params` (in expected ready order) into buckets of at least `first_bytes` (each
/// dtype's first bucket) or `cap_bytes` (the others), closing a bucket as soon as it reaches
/// its limit; returns the parameters' indices per bucket, buckets in the order of their first
/// parameter.
pub fn assign_buckets(
    params: &[BucketParam],
    first_bytes: usize,
    cap_bytes: usize,
) -> Vec<Vec<usize>> {
    struct Open {
        dtype: DType,
        /// Position (in `params`) of the bucket's first parameter.
        first: usize,
        members: Vec<usize>,
        bytes: usize,
        /// Buckets of this dtype closed so far.
        closed: usize,
    }
    let mut open: Vec<Open> = Vec::new();
    let mut done: Vec<(usize, Vec<usize>)> = Vec::new();
    for (pos, p) in params.iter().enumerate() {
        let i = match open.iter().position(|o| o.dtype == p.dtype) {
            Some(i) => i,
            None => {
                open.push(Open {
                    dtype: p.dtype,
                    first: pos,
                    members: Vec::new(),
                    bytes: 0,
                    closed: 0,
                });
                open.len() - 1
            }
        };
        let o = &mut open[i];
        if o.members.is_empty() {
            o.first = pos;
        }
        o.members.push(p.index);
        o.bytes += p.bytes;
        let limit = if o.closed == 0 {
            first_bytes
        } else {
            cap_bytes
        };
        if o.bytes >= limit {
            done.push((o.first, std::mem::take(&mut o.members)));
            o.bytes = 0;
            o.closed += 1;
        }
    }
    for o in open {
        if !o.members.is_empty() {
            done.push((o.first, o.members));
        }
    }
    done.sort_by_key(|(first, _)| *first);
    done.into_iter().map(|(_, members)| members).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn p(index: usize, bytes: usize, dtype: DType) -> BucketParam {
        BucketParam {
            index,
            bytes,
            dtype,
        }
    }

    #[test]
    fn a_small_model_fits_in_the_first_bucket_and_the_rest_in_one() {
        let params: Vec<_> = (0..10).rev().map(|i| p(i, 4000, DType::F32)).collect();
        assert_eq!(
            assign_buckets(&params, MIB, 25 * MIB),
            [(0..10).rev().collect::<Vec<_>>()]
        );
    }

    #[test]
    fn the_first_bucket_closes_at_1_mib_and_later_ones_at_25_mib() {
        // 26 parameters of 1 MiB: [0], then 25 of them, then none left.
        let params: Vec<_> = (0..27).map(|i| p(i, MIB, DType::F32)).collect();
        let buckets = assign_buckets(&params, MIB, 25 * MIB);
        assert_eq!(buckets.len(), 3);
        assert_eq!(buckets[0], [0]);
        assert_eq!(buckets[1], (1..26).collect::<Vec<_>>());
        assert_eq!(buckets[2], [26]);
    }

    #[test]
    fn a_parameter_larger_than_the_cap_has_a_bucket_of_its_own() {
        let params = [
            p(0, 100, DType::F32),
            p(1, 2 * MIB, DType::F32),
            p(2, 40 * MIB, DType::F32),
            p(3, 100, DType::F32),
        ];
        assert_eq!(
            assign_buckets(&params, MIB, 25 * MIB),
            [vec![0, 1], vec![2], vec![3]]
        );
    }

    #[test]
    fn dtypes_never_share_a_bucket_and_buckets_follow_their_first_parameter() {
        let params = [
            p(7, MIB / 2, DType::F32),
            p(6, MIB, DType::BF16),
            p(5, MIB / 2, DType::F32),
            p(4, 10, DType::BF16),
            p(3, 10, DType::F32),
        ];
        assert_eq!(
            assign_buckets(&params, MIB, 25 * MIB),
            [vec![7, 5], vec![6], vec![4], vec![3]]
        );
    }

    #[test]
    fn no_parameters_no_buckets() {
        assert!(assign_buckets(&[], MIB, 25 * MIB).is_empty());
    }
}
