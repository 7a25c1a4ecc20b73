//! Bytes and outcomes through collectives, which carry tensors: every rank's bytes (torch's
//! `all_gather_object`, for bytes), and a step every rank took that failed on some (a file one
//! rank writes, a folder every rank reads), so that every rank fails with the same, complete
//! story: which rank, and its own error's words.

use super::group::ProcessGroup;
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};

/// `values` as a one-dimensional f64 tensor on `device` (f64 holds every byte, and every length
/// below 2^53, exactly).
fn to_tensor(values: impl IntoIterator<Item = usize>, device: &Device) -> Result<Tensor> {
    let values: Vec<f64> = values.into_iter().map(|v| v as f64).collect();
    let n = values.len();
    Ok(Tensor::from_vec(values, n, &Device::Cpu)?.to_device(device)?)
}

fn from_tensor(t: &Tensor) -> Result<Vec<usize>> {
    Ok(t.to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .to_vec1::<f64>()?
        .into_iter()
        .map(|v| v as usize)
        .collect())
}

/// Every rank's `bytes`, in rank order: first the lengths, then the bytes padded to the
/// longest. Every rank of `group` must call it; `device` is where the group's collectives run.
pub fn all_gather_bytes(
    group: &ProcessGroup,
    bytes: &[u8],
    device: &Device,
) -> Result<Vec<Vec<u8>>> {
    let lens: Vec<usize> = group
        .all_gather(&to_tensor([bytes.len()], device)?)?
        .iter()
        .map(|t| Ok(from_tensor(t)?.first().copied().unwrap_or(0)))
        .collect::<Result<_>>()?;
    let longest = lens.iter().copied().max().unwrap_or(0);
    if longest == 0 {
        return Ok(vec![Vec::new(); lens.len()]);
    }
    let padded = bytes
        .iter()
        .map(|&b| usize::from(b))
        .chain(std::iter::repeat(0))
        .take(longest);
    group
        .all_gather(&to_tensor(padded, device)?)?
        .iter()
        .zip(&lens)
        .map(|(t, &n)| {
            // Only this function's bytes travel here, each below 256.
            Ok(from_tensor(t)?[..n].iter().map(|&v| v as u8).collect())
        })
        .collect()
}

/// The outcome of a step every rank of `group` took: this rank's own error when it failed;
/// when only other ranks failed, `others(rank, message)` for the lowest of them (its error's
/// words); else this rank's value. Every rank must call it, after the step.
pub(crate) fn agree_on<T>(
    group: &ProcessGroup,
    device: &Device,
    result: Result<T>,
    others: impl FnOnce(usize, String) -> Error,
) -> Result<T> {
    let mine = match &result {
        Ok(_) => Vec::new(),
        Err(e) => {
            let mut b = vec![1u8];
            b.extend(e.to_string().into_bytes());
            b
        }
    };
    let all = all_gather_bytes(group, &mine, device)?;
    match result {
        Err(e) => Err(e),
        Ok(value) => match all.into_iter().enumerate().find(|(_, b)| !b.is_empty()) {
            Some((rank, b)) => {
                // This rank fails because of that one: a launcher names that one as the cause.
                let message = String::from_utf8_lossy(&b[1..]).into_owned();
                super::error_file::note_loss(Some(rank), &format!("it failed: {message}"));
                Err(others(rank, message))
            }
            None => Ok(value),
        },
    }
}
