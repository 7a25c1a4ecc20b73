//! Cutting a batch into micro-batches as `torch.split(x, split_size)` does: chunks of
//! `split_size` rows, the last one taking the rest.
//!
//! ```rust
//! use candle_parallel::model_parallel::micro_batch::split_sizes;
//! assert_eq!(split_sizes(10, 3), [3, 3, 3, 1]);
//! assert_eq!(split_sizes(120, 20), [20; 6]);
//! ```

/// The sizes of the micro-batches `torch.split` makes of `len` rows with `split_size` rows
/// each: `split_size` each, the last the remainder. None for `len` or `split_size` 0.
pub fn split_sizes(len: usize, split_size: usize) -> Vec<usize> {
    if len == 0 || split_size == 0 {
        return Vec::new();
    }
    (0..len.div_ceil(split_size))
        .map(|i| split_size.min(len - i * split_size))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_sizes_cover_the_batch_with_a_smaller_last_micro_batch() {
        assert_eq!(split_sizes(7, 7), [7]);
        assert_eq!(split_sizes(7, 2), [2, 2, 2, 1]);
        assert_eq!(split_sizes(1, 1), [1]);
        assert!(split_sizes(0, 4).is_empty());
        assert!(split_sizes(4, 0).is_empty());
        for (len, split) in [(10, 3), (64, 5), (9, 9), (100, 1)] {
            let sizes = split_sizes(len, split);
            assert_eq!(sizes.iter().sum::<usize>(), len);
            assert!(sizes[..sizes.len() - 1].iter().all(|&s| s == split));
        }
    }
}
