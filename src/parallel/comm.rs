//! Moving tensors between devices: scatter, gather, broadcast and reduce_add.
//!
//! These are the pieces `DataParallel` is built from, as in `torch.nn.parallel.comm`. Every one is
//! differentiable: they are made of `narrow`, `cat`, `add` and `Tensor::to_device`, all of which
//! candle's autograd tracks, so gradients flow back to the source device.
//!
//! [`scatter`] splits like `torch.chunk`: chunks of `ceil(n / k)` rows, the last one taking the
//! rest, and possibly fewer chunks than devices. 30 rows on 8 devices give 4,4,4,4,4,4,4,2;
//! 10 rows on 8 devices give 2,2,2,2,2 (only 5 devices used); 10 rows on 3 give 4,4,2.
//!
//! ```rust
//! use candle_core::{Device, Tensor};
//! use candle_parallel::comm;
//! # fn main() -> candle_parallel::Result<()> {
//! assert_eq!(comm::chunk_sizes(10, 3), [4, 4, 2]);
//!
//! let devices = vec![Device::Cpu, Device::Cpu, Device::Cpu];
//! let x = Tensor::arange(0f32, 10., &Device::Cpu)?;
//! let chunks = comm::scatter(&x, &devices, 0)?;
//! assert_eq!(chunks[2].to_vec1::<f32>()?, [8., 9.]);
//! let back = comm::gather(&chunks, &Device::Cpu, 0)?;
//! assert_eq!(back.to_vec1::<f32>()?, x.to_vec1::<f32>()?);
//!
//! let sum = comm::reduce_add(&comm::broadcast(&x, &devices)?, &Device::Cpu)?;
//! assert_eq!(sum.to_vec1::<f32>()?[9], 27.);
//! # Ok(()) }
//! ```
//!
//! Tensors that change device are first made compact: candle copies a view's whole underlying
//! storage when it moves it, so a narrowed chunk would otherwise drag the whole batch along.
//! CUDA to CUDA moves are device-to-device copies and never pass through the host; they are
//! ordered on both devices' streams as PyTorch orders its cross-device copies (see
//! `ordered_copy`), which candle's own `to_device` does not do.

use crate::error::{device_name, Error, Result};
use crate::util::ordered_copy::to_device;
use candle_core::{Device, Tensor};

/// The sizes of the chunks `torch.chunk` makes of `len` items asked to split into `chunks`.
///
/// Each chunk has `ceil(len / chunks)` items except the last, which takes the rest, so there
/// may be fewer than `chunks` of them. Returns no chunk when `len` or `chunks` is 0.
///
/// ```rust
/// use candle_parallel::comm::chunk_sizes;
/// assert_eq!(chunk_sizes(30, 8), [4, 4, 4, 4, 4, 4, 4, 2]);
/// assert_eq!(chunk_sizes(10, 8), [2, 2, 2, 2, 2]);
/// ```
pub fn chunk_sizes(len: usize, chunks: usize) -> Vec<usize> {
    if len == 0 || chunks == 0 {
        return Vec::new();
    }
    let size = len.div_ceil(chunks);
    (0..len.div_ceil(size))
        .map(|i| size.min(len - i * size))
        .collect()
}

/// Splits `t` along `dim` into [`chunk_sizes`] chunks, chunk `i` on `devices[i]`.
///
/// When the batch has fewer rows than there are devices, only the first devices get a chunk.
/// Each chunk keeps a differentiable link to `t`.
pub fn scatter(t: &Tensor, devices: &[Device], dim: usize) -> Result<Vec<Tensor>> {
    if devices.is_empty() {
        return Err(Error::NoDevices);
    }
    check_dim(t, dim, "the input")?;
    let len = t.dim(dim)?;
    if len == 0 {
        return Err(Error::EmptyBatch {
            dim,
            shape: t.dims().to_vec(),
        });
    }
    let sizes = chunk_sizes(len, devices.len());
    let whole = sizes.len() == 1;
    let mut start = 0;
    let mut chunks = Vec::with_capacity(sizes.len());
    for (size, device) in sizes.into_iter().zip(devices) {
        let chunk = if whole {
            t.clone()
        } else {
            t.narrow(dim, start, size)?
        };
        chunks.push(to_device(&chunk, device, !whole)?);
        start += size;
    }
    Ok(chunks)
}

/// Concatenates `ts` along `dim` on `device`, the inverse of [`scatter`].
///
/// All tensors must have the same dtype and rank, and agree in every dimension but `dim`.
pub fn gather(ts: &[Tensor], device: &Device, dim: usize) -> Result<Tensor> {
    let first = check_same_kind(ts, "gather")?;
    for (i, t) in ts.iter().enumerate() {
        check_dim(t, dim, &format!("output {i}"))?;
        let (mut want, mut got) = (first.dims().to_vec(), t.dims().to_vec());
        want[dim] = 0;
        got[dim] = 0;
        if want != got {
            return Err(Error::ShapeMismatch {
                op: "gather",
                detail: format!(
                    "tensor {i} has shape {:?} but tensor 0 has shape {:?}; they may differ only \
                     in dimension {dim}",
                    t.dims(),
                    first.dims()
                ),
            });
        }
    }
    let moved = ts
        .iter()
        .map(|t| to_device(t, device, false))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&moved, dim)?)
}

/// Copies `t` to every device in `devices`; on `t`'s own device the result is `t` itself.
///
/// Gradients of the copies sum back into `t`.
pub fn broadcast(t: &Tensor, devices: &[Device]) -> Result<Vec<Tensor>> {
    if devices.is_empty() {
        return Err(Error::NoDevices);
    }
    Ok(devices
        .iter()
        .map(|d| to_device(t, d, false))
        .collect::<candle_core::Result<_>>()?)
}

/// Sums tensors of one shape and dtype, wherever they are, into one tensor on `device`.
///
/// The sum runs in the order of `ts`, so the result is the same on every call.
pub fn reduce_add(ts: &[Tensor], device: &Device) -> Result<Tensor> {
    let first = check_same_kind(ts, "reduce_add")?;
    for (i, t) in ts.iter().enumerate() {
        if t.dims() != first.dims() {
            return Err(Error::ShapeMismatch {
                op: "reduce_add",
                detail: format!(
                    "tensor {i} has shape {:?} but tensor 0 has shape {:?}; all must match",
                    t.dims(),
                    first.dims()
                ),
            });
        }
    }
    let mut sum = to_device(first, device, false)?;
    for t in &ts[1..] {
        sum = (sum + to_device(t, device, false)?)?;
    }
    Ok(sum)
}

fn check_dim(t: &Tensor, dim: usize, what: &str) -> Result<()> {
    if dim >= t.rank() {
        return Err(Error::DimOutOfRange {
            dim,
            rank: t.rank(),
            shape: t.dims().to_vec(),
            what: what.to_string(),
        });
    }
    Ok(())
}

/// Checks that `ts` is not empty and that all tensors share the first one's dtype and rank.
fn check_same_kind<'a>(ts: &'a [Tensor], op: &'static str) -> Result<&'a Tensor> {
    let first = ts.first().ok_or(Error::InvalidArgument {
        what: "tensor list",
        detail: format!("{op} needs at least one tensor, got none"),
    })?;
    for (i, t) in ts.iter().enumerate() {
        if t.dtype() != first.dtype() || t.rank() != first.rank() {
            return Err(Error::ShapeMismatch {
                op,
                detail: format!(
                    "tensor {i} is {:?} with shape {:?} on {}, but tensor 0 is {:?} with shape \
                     {:?}; all must share dtype and rank",
                    t.dtype(),
                    t.dims(),
                    device_name(t.device()),
                    first.dtype(),
                    first.dims()
                ),
            });
        }
    }
    Ok(first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Var};

    fn cpus(n: usize) -> Vec<Device> {
        vec![Device::Cpu; n]
    }

    /// torch.chunk's rule, written the way torch computes it.
    fn torch_chunk(len: usize, chunks: usize) -> Vec<usize> {
        let size = len.div_ceil(chunks);
        let mut out = Vec::new();
        let mut start = 0;
        while start < len {
            out.push(size.min(len - start));
            start += size;
        }
        out
    }

    #[test]
    fn chunk_sizes_match_the_seed_cases() {
        assert_eq!(chunk_sizes(30, 8), [4, 4, 4, 4, 4, 4, 4, 2]);
        assert_eq!(chunk_sizes(10, 8), [2, 2, 2, 2, 2]);
        assert_eq!(chunk_sizes(10, 3), [4, 4, 2]);
        assert_eq!(chunk_sizes(30, 2), [15, 15]);
        assert_eq!(chunk_sizes(10, 2), [5, 5]);
        assert_eq!(chunk_sizes(30, 3), [10, 10, 10]);
        assert_eq!(chunk_sizes(30, 1), [30]);
    }

    #[test]
    fn chunk_sizes_follow_torch_for_every_len_up_to_64_and_chunks_up_to_9() {
        for len in 1..=64 {
            for chunks in 1..=9 {
                let sizes = chunk_sizes(len, chunks);
                assert_eq!(sizes, torch_chunk(len, chunks), "len {len} chunks {chunks}");
                assert_eq!(sizes.iter().sum::<usize>(), len);
                assert!(sizes.len() <= chunks);
                assert!(sizes.iter().all(|&s| s > 0));
            }
        }
        assert!(chunk_sizes(0, 3).is_empty());
        assert!(chunk_sizes(3, 0).is_empty());
    }

    #[test]
    fn scatter_then_gather_round_trips_along_every_dim() -> Result<()> {
        let x = Tensor::arange(0f32, 120., &Device::Cpu)?.reshape((4, 5, 6))?;
        for dim in 0..3 {
            for n in 1..=7 {
                let chunks = scatter(&x, &cpus(n), dim)?;
                let sizes: Vec<usize> = chunks.iter().map(|c| c.dim(dim).unwrap()).collect();
                assert_eq!(sizes, chunk_sizes(x.dim(dim)?, n));
                let back = gather(&chunks, &Device::Cpu, dim)?;
                let diff = (back - &x)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert_eq!(diff, 0.0, "dim {dim} devices {n}");
            }
        }
        Ok(())
    }

    #[test]
    fn scatter_of_a_strided_view_gives_the_right_values() -> Result<()> {
        let x = Tensor::arange(0f32, 12., &Device::Cpu)?.reshape((3, 4))?;
        let xt = x.t()?; // shape (4, 3), not contiguous
        let chunks = scatter(&xt, &cpus(2), 0)?;
        assert_eq!(chunks[1].to_vec2::<f32>()?, [[2., 6., 10.], [3., 7., 11.]]);
        Ok(())
    }

    #[test]
    fn broadcast_and_reduce_add_give_n_times_the_input() -> Result<()> {
        let x = Tensor::new(&[[1f32, -2.], [3., 4.5]], &Device::Cpu)?;
        let copies = broadcast(&x, &cpus(3))?;
        assert_eq!(copies.len(), 3);
        for c in &copies {
            assert_eq!(c.to_vec2::<f32>()?, x.to_vec2::<f32>()?);
        }
        let sum = reduce_add(&copies, &Device::Cpu)?;
        assert_eq!(sum.to_vec2::<f32>()?, [[3., -6.], [9., 13.5]]);
        Ok(())
    }

    #[test]
    fn gradients_flow_back_through_scatter_and_gather() -> Result<()> {
        let x = Var::from_tensor(&Tensor::arange(0f32, 10., &Device::Cpu)?)?;
        // Each chunk i is scaled by (i + 1): the gradient of x is that scale per row.
        let chunks = scatter(x.as_tensor(), &cpus(3), 0)?;
        let scaled: Vec<Tensor> = chunks
            .iter()
            .enumerate()
            .map(|(i, c)| (c * (i as f64 + 1.0)).unwrap())
            .collect();
        let y = gather(&scaled, &Device::Cpu, 0)?;
        let w = Tensor::arange(1f32, 11., &Device::Cpu)?;
        let loss = (y * &w)?.sum_all()?;
        let grads = loss.backward()?;
        let g = grads.get(&x).expect("x has a gradient").to_vec1::<f32>()?;
        let scale = [1., 1., 1., 1., 2., 2., 2., 2., 3., 3.];
        let want: Vec<f32> = (0..10).map(|i| scale[i] * (i as f32 + 1.0)).collect();
        assert_eq!(g, want);
        Ok(())
    }

    #[test]
    fn gradients_flow_back_through_broadcast_and_reduce_add() -> Result<()> {
        let x = Var::from_tensor(&Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?)?;
        let copies = broadcast(x.as_tensor(), &cpus(4))?;
        let weighted: Vec<Tensor> = copies
            .iter()
            .enumerate()
            .map(|(i, c)| (c * (i as f64)).unwrap())
            .collect();
        let loss = reduce_add(&weighted, &Device::Cpu)?.sum_all()?;
        let grads = loss.backward()?;
        // d/dx sum_i i * x = 0 + 1 + 2 + 3 = 6 for every element.
        assert_eq!(grads.get(&x).unwrap().to_vec1::<f32>()?, [6., 6., 6.]);
        Ok(())
    }

    #[test]
    fn bad_inputs_get_typed_errors() -> Result<()> {
        let x = Tensor::zeros((4, 3), DType::F32, &Device::Cpu)?;
        assert!(matches!(scatter(&x, &[], 0), Err(Error::NoDevices)));
        assert!(matches!(
            scatter(&x, &cpus(2), 2),
            Err(Error::DimOutOfRange {
                dim: 2,
                rank: 2,
                ..
            })
        ));
        let empty = Tensor::zeros((0, 3), DType::F32, &Device::Cpu)?;
        assert!(matches!(
            scatter(&empty, &cpus(2), 0),
            Err(Error::EmptyBatch { dim: 0, .. })
        ));
        let y = Tensor::zeros((4, 2), DType::F32, &Device::Cpu)?;
        let err = gather(&[x.clone(), y.clone()], &Device::Cpu, 0).unwrap_err();
        assert!(
            err.to_string().contains("tensor 1 has shape [4, 2]"),
            "{err}"
        );
        assert!(gather(&[x.clone(), y.clone()], &Device::Cpu, 1).is_ok());
        assert!(matches!(
            reduce_add(&[x.clone(), y], &Device::Cpu),
            Err(Error::ShapeMismatch {
                op: "reduce_add",
                ..
            })
        ));
        let z = Tensor::zeros((4, 3), DType::F64, &Device::Cpu)?;
        assert!(matches!(
            reduce_add(&[x, z], &Device::Cpu),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(matches!(
            gather(&[], &Device::Cpu, 0),
            Err(Error::InvalidArgument { .. })
        ));
        Ok(())
    }
}
