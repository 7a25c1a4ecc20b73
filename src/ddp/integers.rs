//! Integers through collectives, which carry float tensors only (see
//! [`SUPPORTED_DTYPES`](crate::distributed::reduce_op::SUPPORTED_DTYPES)): DDP's agreements
//! (the model check's text, the rebuilt bucket order, the map of parameters that got a
//! gradient) travel as f64, which holds every integer below 2^53 exactly, so that sums, maxima
//! and broadcasts of them are exact too.

use crate::error::Result;
use candle_core::{DType, Device, Tensor};

/// `values` as a one-dimensional f64 tensor on `device`, ready for a collective.
pub(crate) fn to_tensor(
    values: impl IntoIterator<Item = usize>,
    device: &Device,
) -> Result<Tensor> {
    let values: Vec<f64> = values.into_iter().map(|v| v as f64).collect();
    let n = values.len();
    Ok(Tensor::from_vec(values, n, &Device::Cpu)?.to_device(device)?)
}

/// The integers a collective handed back in `t`, made by [`to_tensor`] on some rank.
pub(crate) fn from_tensor(t: &Tensor) -> Result<Vec<usize>> {
    Ok(t.to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .to_vec1::<f64>()?
        .into_iter()
        .map(|v| v as usize)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_up_to_2_pow_53_come_back_exactly() {
        let values = [0, 1, 255, 1 << 40, (1 << 53) - 1];
        let t = to_tensor(values, &Device::Cpu).unwrap();
        assert_eq!(t.dtype(), DType::F64);
        assert_eq!(from_tensor(&t).unwrap(), values);
    }

    #[test]
    fn no_integers_make_an_empty_tensor() {
        let t = to_tensor([], &Device::Cpu).unwrap();
        assert_eq!(t.dims(), [0]);
        assert!(from_tensor(&t).unwrap().is_empty());
    }
}
