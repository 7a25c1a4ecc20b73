//! The crate's rule for reductions (see the [`nn` module docs](super)) where a layer is made of
//! candle ops, and torch's zero gradients for empty batches.
//!
//! candle sums a half-precision tensor in its own dtype: a bias's gradient over 4096 rows of
//! ones comes out 256 in bf16 (2048 in f16). The layers here therefore add a bias, and apply
//! any other op whose backward sums over rows, in f32 ([`wide`]) and round the result once.
//!
//! candle also returns an empty operand itself from an op on empty tensors (or untracked
//! zeros, from a product), which cuts the layer's parameters out of the graph: a batch of no
//! rows leaves them without a gradient, where torch gives them zeros. [`empty_output`] is the
//! output such a layer gives instead.

use super::rows::{self, lane_sum, values, with_float_slices, Elem};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// The dtype a reduction over values of `dtype` runs in: f64 for f64, f32 otherwise.
pub(super) fn wide(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// `t` in its [`wide`] dtype (itself for f32 and f64).
pub(super) fn widen(t: &Tensor) -> Result<Tensor> {
    super::cast::cast(t, wide(t.dtype()))
}

/// `y + bias` (broadcast): for f16 and bf16 computed in f32 and rounded once, so that the
/// bias's gradient, a sum over every dimension it is broadcast along, accumulates in f32.
pub(super) fn broadcast_add(y: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let dtype = y.dtype();
    if wide(dtype) == dtype {
        return y.broadcast_add(bias);
    }
    super::cast::cast(&widen(y)?.broadcast_add(&widen(bias)?)?, dtype)
}

/// The sums of the rows of a `(R, M)` tensor, as `(R)`, without a backward: on the CPU each row
/// in f32 lanes (f64 for f64, see [`lane_sum`]) rounded once, which holds its error near a
/// pairwise sum's where candle adds one value after another; elsewhere candle's sum.
pub(super) fn sum_rows(t: &Tensor) -> Result<Tensor> {
    let (r, m) = t.dims2()?;
    if !t.device().is_cpu() || r == 0 || m == 0 {
        return t.sum(1);
    }
    t.contiguous()?.apply_op1_no_bwd(&SumRows)
}

/// The op of [`sum_rows`] on the CPU.
struct SumRows;

impl candle_core::CustomOp1 for SumRows {
    fn name(&self) -> &'static str {
        "cp-sum-rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (r, m) = l.shape().dims2()?;
        let out = with_float_slices!(&[s], |v: T| {
            let x = values(v[0], l, "the tensor")?;
            let sums: Vec<T> = x
                .par_chunks(m)
                .map(|row| T::down(lane_sum(row, T::up)))
                .collect();
            rows::storage(sums)
        });
        Ok((out, Shape::from(r)))
    }
}

/// An empty tensor of `shape` (of the dtype and device of `inputs[0]`) computed from the one to
/// three `inputs`, whose backward gives every input a gradient of zeros, as torch does for a
/// layer applied to an empty batch.
pub(super) fn empty_output(shape: &Shape, inputs: &[&Tensor]) -> Result<Tensor> {
    if shape.elem_count() != 0 {
        candle_core::bail!("empty_output: {shape:?} is not empty");
    }
    let op = Empty {
        shape: shape.clone(),
    };
    match inputs {
        [a] => a.apply_op1(op),
        [a, b] => a.apply_op2(b, op),
        [a, b, c] => a.apply_op3(b, c, op),
        _ => candle_core::bail!("empty_output takes one to three inputs"),
    }
}

/// The op of [`empty_output`].
struct Empty {
    shape: Shape,
}

impl Empty {
    fn zeros(&self, inputs: &[&Tensor]) -> Result<Vec<Option<Tensor>>> {
        inputs.iter().map(|t| Ok(Some(t.zeros_like()?))).collect()
    }

    fn cpu(&self, s: &CpuStorage) -> Result<(CpuStorage, Shape)> {
        Ok((
            s.device().zeros_impl(&self.shape, s.dtype())?,
            self.shape.clone(),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, s: &candle_core::CudaStorage) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            s.device().zeros_impl(&self.shape, s.dtype())?,
            self.shape.clone(),
        ))
    }
}

impl candle_core::CustomOp1 for Empty {
    fn name(&self) -> &'static str {
        "cp-empty"
    }

    fn cpu_fwd(&self, s: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.cpu(s)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda(s)
    }

    fn bwd(&self, a: &Tensor, _: &Tensor, _: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(a.zeros_like()?))
    }
}

impl candle_core::CustomOp2 for Empty {
    fn name(&self) -> &'static str {
        "cp-empty"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu(s)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda(s)
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _: &Tensor,
        _: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut z = self.zeros(&[a, b])?.into_iter();
        Ok((z.next().flatten(), z.next().flatten()))
    }
}

impl candle_core::CustomOp3 for Empty {
    fn name(&self) -> &'static str {
        "cp-empty"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu(s)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda(s)
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        _: &Tensor,
        _: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut z = self.zeros(&[a, b, c])?.into_iter();
        Ok((z.next().flatten(), z.next().flatten(), z.next().flatten()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn a_bf16_bias_added_over_4096_rows_gets_the_gradient_4096() -> Result<()> {
        for dtype in [DType::BF16, DType::F16, DType::F32, DType::F64] {
            let b = Var::from_tensor(&Tensor::zeros(3, dtype, &Device::Cpu)?)?;
            let y = Tensor::ones((4096, 3), dtype, &Device::Cpu)?;
            let out = broadcast_add(&y, &b)?;
            assert_eq!(out.dtype(), dtype);
            let grads = out.sum_all()?.backward()?;
            let db = grads
                .get(&b)
                .unwrap()
                .to_dtype(DType::F64)?
                .to_vec1::<f64>()?;
            assert_eq!(db, [4096.0; 3], "{dtype:?}");
        }
        Ok(())
    }

    #[test]
    fn rows_of_a_million_values_sum_as_f64_would_round_them() -> Result<()> {
        // 0.1 is not a float: a sum in order drifts by ~1e-3 relative over a million of them.
        let t = Tensor::full(0.1f32, (2, 1 << 20), &Device::Cpu)?;
        let want = (1u64 << 20) as f64 * 0.1f32 as f64;
        for got in sum_rows(&t)?.to_vec1::<f32>()? {
            assert!(
                (got as f64 - want).abs() <= want * 1e-6,
                "{got} against {want}"
            );
        }
        let sequential = t.sum(1)?.to_vec1::<f32>()?[0] as f64;
        assert!(
            (sequential - want).abs() > want * 1e-5,
            "candle's sum: {sequential}"
        );
        Ok(())
    }

    #[test]
    fn every_input_of_an_empty_output_gets_zeros() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::zeros((0, 4), DType::BF16, &dev)?)?;
        let w = Var::from_tensor(&Tensor::ones((3, 4), DType::BF16, &dev)?)?;
        let b = Var::from_tensor(&Tensor::ones(3, DType::BF16, &dev)?)?;
        let shape = Shape::from((0, 3));
        for inputs in [vec![&x], vec![&x, &w], vec![&x, &w, &b]] {
            let ts: Vec<&Tensor> = inputs.iter().map(|v| v.as_tensor()).collect();
            let y = empty_output(&shape, &ts)?;
            assert_eq!((y.dims(), y.dtype()), (&[0, 3][..], DType::BF16));
            let grads = y.sum_all()?.backward()?;
            for v in inputs {
                let g = grads.get(v).expect("every input gets a gradient");
                assert_eq!(g.dims(), v.dims());
                let g = g.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
                assert!(g.iter().all(|&v| v == 0.0));
            }
        }
        Ok(())
    }
}
