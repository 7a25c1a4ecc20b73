//! Integers through collectives, which carry float tensors only (see
//! [`SUPPORTED_DTYPES`](crate::distributed::reduce_op::SUPPORTED_DTYPES)): DDP's agreements
//! (the model check's text, the rebuilt bucket order, the map of parameters that got a
//! gradient) travel as f64, which holds every integer below 2^53 exactly, so that sums, maxima
//! and broadcasts of them are exact too. Integer variables (an index table, a step count: never
//! parameters) travel as f64 too, to be broadcast ([`encode`], [`decode`]): every value of
//! u8, u32, i16 and i32 is exact in f64, and an i64 travels as its high and low 32 bits.

use crate::error::{Error, Result};
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

/// Whether DDP's collectives carry variables of `dtype`: the float dtypes collectives take, and
/// the integer ones (as f64, through [`encode`]).
pub(crate) fn carried(dtype: DType) -> bool {
    dtype.is_int() || crate::distributed::reduce_op::SUPPORTED_DTYPES.contains(&dtype)
}

/// An integer tensor's values as a flat f64 tensor on its device, exactly: one value per
/// element, two (the high and the low 32 bits) for i64.
pub(crate) fn encode(t: &Tensor) -> Result<Tensor> {
    let flat = t.flatten_all()?.to_device(&Device::Cpu)?;
    let values: Vec<f64> = match t.dtype() {
        DType::U8 => flat.to_vec1::<u8>()?.into_iter().map(f64::from).collect(),
        DType::U32 => flat.to_vec1::<u32>()?.into_iter().map(f64::from).collect(),
        DType::I16 => flat.to_vec1::<i16>()?.into_iter().map(f64::from).collect(),
        DType::I32 => flat.to_vec1::<i32>()?.into_iter().map(f64::from).collect(),
        DType::I64 => flat
            .to_vec1::<i64>()?
            .into_iter()
            .flat_map(|v| [(v >> 32) as f64, (v & 0xffff_ffff) as f64])
            .collect(),
        other => return Err(not_an_integer(other)),
    };
    let n = values.len();
    Ok(Tensor::from_vec(values, n, &Device::Cpu)?.to_device(t.device())?)
}

/// How many f64 values [`encode`] makes of a tensor of `dtype` and `elements` elements.
pub(crate) fn encoded_len(dtype: DType, elements: usize) -> usize {
    if dtype == DType::I64 {
        2 * elements
    } else {
        elements
    }
}

/// The tensor of `dtype` and `like`'s shape and device that [`encode`] made `encoded` of.
pub(crate) fn decode(encoded: &Tensor, dtype: DType, like: &Tensor) -> Result<Tensor> {
    let v = encoded.to_device(&Device::Cpu)?.to_vec1::<f64>()?;
    let (shape, cpu) = (like.shape(), &Device::Cpu);
    let t = match dtype {
        DType::U8 => Tensor::from_vec(v.iter().map(|&x| x as u8).collect(), shape, cpu)?,
        DType::U32 => Tensor::from_vec(v.iter().map(|&x| x as u32).collect(), shape, cpu)?,
        DType::I16 => Tensor::from_vec(v.iter().map(|&x| x as i16).collect(), shape, cpu)?,
        DType::I32 => Tensor::from_vec(v.iter().map(|&x| x as i32).collect(), shape, cpu)?,
        DType::I64 => {
            let values = v
                .chunks(2)
                .map(|p| ((p[0] as i64) << 32) | (p[1] as i64))
                .collect();
            Tensor::from_vec(values, shape, cpu)?
        }
        other => return Err(not_an_integer(other)),
    };
    Ok(t.to_device(like.device())?)
}

fn not_an_integer(dtype: DType) -> Error {
    Error::InvalidArgument {
        what: "integer tensor",
        detail: format!("{dtype:?} is not an integer dtype"),
    }
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
    fn integer_tensors_of_every_dtype_come_back_exactly() {
        let dev = Device::Cpu;
        let tensors = [
            Tensor::new(&[[0u8, 255], [7, 1]], &dev).unwrap(),
            Tensor::new(&[0u32, u32::MAX, 12345], &dev).unwrap(),
            Tensor::new(&[i64::MIN, -1, 0, 1, (1 << 53) + 1, i64::MAX], &dev).unwrap(),
            Tensor::zeros((0, 3), DType::I64, &dev).unwrap(),
        ];
        for t in tensors {
            let e = encode(&t).unwrap();
            assert_eq!(e.dtype(), DType::F64);
            assert_eq!(e.elem_count(), encoded_len(t.dtype(), t.elem_count()));
            let back = decode(&e, t.dtype(), &t).unwrap();
            assert_eq!((back.dtype(), back.dims()), (t.dtype(), t.dims()));
            let as_i64 = |t: &Tensor| t.flatten_all().unwrap().to_dtype(DType::I64).unwrap();
            assert_eq!(
                as_i64(&back).to_vec1::<i64>().unwrap(),
                as_i64(&t).to_vec1::<i64>().unwrap()
            );
        }
        assert!(encode(&Tensor::new(&[1f32], &dev).unwrap()).is_err());
    }

    #[test]
    fn no_integers_make_an_empty_tensor() {
        let t = to_tensor([], &Device::Cpu).unwrap();
        assert_eq!(t.dims(), [0]);
        assert!(from_tensor(&t).unwrap().is_empty());
    }
}
