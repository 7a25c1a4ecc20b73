//! Splitting a batch into micro-batches, as torch's pipelining does (`TensorChunkSpec(0)`,
//! which cuts with `torch.tensor_split`).
//!
//! `n` rows into `m` micro-batches: the first `n % m` get `n / m + 1` rows, the others `n / m`
//! (10 rows into 3: 4, 3, 3). This is `tensor_split`'s rule, not `torch.chunk`'s (4, 4, 2),
//! because torch's pipelining uses it; every micro-batch gets at least one row.
//!
//! ```rust
//! use candle_core::{Device, Tensor};
//! use candle_parallel::pipeline::microbatch::{split_microbatches, split_sizes};
//! # fn main() -> candle_parallel::Result<()> {
//! assert_eq!(split_sizes(10, 3)?, [4, 3, 3]);
//! let x = Tensor::arange(0f32, 10., &Device::Cpu)?;
//! let parts = split_microbatches(&x, 3)?;
//! assert_eq!(parts[2].to_vec1::<f32>()?, [7., 8., 9.]);
//! # Ok(()) }
//! ```

use crate::error::{Error, Result};
use candle_core::Tensor;

/// The rows of each of `n_microbatches` micro-batches cut from `rows` rows (`tensor_split`'s
/// sizes). Fails when a micro-batch would be empty.
pub fn split_sizes(rows: usize, n_microbatches: usize) -> Result<Vec<usize>> {
    if n_microbatches == 0 || rows < n_microbatches {
        return Err(Error::InvalidArgument {
            what: "pipeline micro-batches",
            detail: format!(
                "{rows} rows cannot make {n_microbatches} micro-batches of at least one row; \
                 use a batch of at least {n_microbatches} rows or fewer micro-batches (at \
                 least 1)"
            ),
        });
    }
    let (q, r) = (rows / n_microbatches, rows % n_microbatches);
    Ok((0..n_microbatches)
        .map(|i| q + usize::from(i < r))
        .collect())
}

/// Cuts `t` along dimension 0 into `n_microbatches` micro-batches ([`split_sizes`]).
pub fn split_microbatches(t: &Tensor, n_microbatches: usize) -> Result<Vec<Tensor>> {
    let rows = match t.dims().first() {
        Some(&rows) => rows,
        None => {
            return Err(Error::DimOutOfRange {
                dim: 0,
                rank: 0,
                shape: vec![],
                what: "the batch to split into micro-batches".into(),
            })
        }
    };
    let mut start = 0;
    split_sizes(rows, n_microbatches)?
        .into_iter()
        .map(|len| {
            let part = t.narrow(0, start, len)?;
            start += len;
            Ok(part)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn sizes_follow_tensor_split() {
        assert_eq!(split_sizes(8, 4).unwrap(), [2, 2, 2, 2]);
        assert_eq!(split_sizes(10, 4).unwrap(), [3, 3, 2, 2]);
        assert_eq!(split_sizes(3, 3).unwrap(), [1, 1, 1]);
    }

    #[test]
    fn fewer_rows_than_micro_batches_is_an_error_naming_both() {
        let err = split_sizes(3, 4).unwrap_err().to_string();
        assert!(err.contains("3 rows cannot make 4 micro-batches"), "{err}");
        let scalar = Tensor::new(1f32, &Device::Cpu).unwrap();
        assert!(split_microbatches(&scalar, 1).is_err());
    }

    #[test]
    fn the_micro_batches_put_together_are_the_batch() {
        let x = Tensor::arange(0f32, 22., &Device::Cpu)
            .unwrap()
            .reshape((11, 2))
            .unwrap();
        let parts = split_microbatches(&x, 4).unwrap();
        let rows: Vec<usize> = parts.iter().map(|p| p.dims()[0]).collect();
        assert_eq!(rows, [3, 3, 3, 2]);
        let back = Tensor::cat(&parts, 0).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), x.to_vec2::<f32>().unwrap());
    }
}
