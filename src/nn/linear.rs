//! A linear layer with its bias and, optionally, a ReLU as one CPU op: [`linear`] and
//! [`linear_relu`], for candle-nn's `Linear`.
//!
//! candle-nn's `Linear` is a matrix product, a broadcast add and (after it) a ReLU: three ops
//! whose backward adds a mask, a multiply and a sum over the batch, and candle runs its product
//! with a transposed weight at a third of the speed measured here for the CIFAR Net's layers.
//! Here, for f32 tensors on the CPU, the forward is one product into the bias with the ReLU
//! applied in place (noting where its gradient passes: where the input is `>= 0`, as candle's),
//! and the backward three products split over candle's thread pool: the input gradient by
//! rows of the batch, the weight gradient by rows of the weight (no partial sums to add). Other
//! dtypes, devices (CUDA) and shapes use candle-nn's `Linear` and candle's ReLU.
//!
//! ```rust
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use candle_parallel::nn;
//! # fn main() -> candle_core::Result<()> {
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let fc = candle_nn::linear(400, 120, vb.pp("fc1"))?;
//! let x = Tensor::randn(0f32, 1.0, (4, 400), &Device::Cpu)?;
//! let y = nn::linear_relu(&x, &fc)?;
//! let apart = fc.forward(&x)?.relu()?;
//! assert!((y - apart)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-5);
//! # Ok(()) }
//! ```

use super::conv_kernel::{f32_slice, with_f32};
use super::kernels::{for_each_chunk, matmul, ours, Mat};
use crate::util::sync::lock;
use candle_core::{CpuStorage, Device, Layout, Module, Result, Shape, Tensor};
use candle_nn::Linear;
use std::sync::Mutex;

/// `layer.forward(x)`: one op with our kernels for a 2-D f32 CPU input and a layer with a bias,
/// candle-nn's `Linear` otherwise.
pub fn linear(x: &Tensor, layer: &Linear) -> Result<Tensor> {
    forward(x, layer, false)
}

/// `layer.forward(x)?.relu()`: one op with our kernels for a 2-D f32 CPU input and a layer with
/// a bias, candle-nn's `Linear` and candle's ReLU otherwise.
pub fn linear_relu(x: &Tensor, layer: &Linear) -> Result<Tensor> {
    forward(x, layer, true)
}

fn forward(x: &Tensor, layer: &Linear, relu: bool) -> Result<Tensor> {
    let w = layer.weight();
    let fused = match layer.bias() {
        Some(b) if ours(&[x, w, b]) && x.rank() == 2 && w.rank() == 2 && b.rank() == 1 => {
            let (n, k) = x.dims2()?;
            let (o, wk) = w.dims2()?;
            if wk != k || b.dims1()? != o {
                candle_core::bail!(
                    "linear: input {:?}, weight {:?} and bias {:?} do not fit: the weight needs \
                     as many columns as the input and the bias one value per weight row",
                    x.dims(),
                    w.dims(),
                    b.dims()
                )
            }
            let op = LinearOp {
                n,
                k,
                o,
                relu,
                passes: Mutex::new(Vec::new()),
            };
            Some(
                x.contiguous()?
                    .apply_op3(&w.contiguous()?, &b.contiguous()?, op)?,
            )
        }
        _ => None,
    };
    match fused {
        Some(y) => Ok(y),
        None if relu => layer.forward(x)?.relu(),
        None => layer.forward(x),
    }
}

/// The fused layer as a candle op over `x` `(n, k)`, `w` `(o, k)` and `b` `(o)`.
struct LinearOp {
    n: usize,
    k: usize,
    o: usize,
    relu: bool,
    /// With the ReLU, whether each output's gradient passes (its input was `>= 0`), set by the
    /// forward.
    passes: Mutex<Vec<bool>>,
}

impl candle_core::CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        if self.relu {
            "linear-relu"
        } else {
            "linear"
        }
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (f32_slice(xs, xl, "input")?, f32_slice(ws, wl, "weight")?);
        let b = f32_slice(bs, bl, "bias")?;
        let (k, o) = (self.k, self.o);
        let mut y = vec![0f32; self.n * o];
        if k > 0 {
            for_each_chunk(&mut y, o, |first, rows| {
                for row in rows.chunks_mut(o) {
                    row.copy_from_slice(b);
                }
                let x_rows = &x[first * k..first * k + rows.len() / o * k];
                // y_rows (r x o) += x_rows (r x k) . wᵀ (k x o)
                matmul(
                    Mat::rows(rows, o),
                    Mat::rows_of(x_rows, k),
                    Mat::transposed(w, k),
                    true,
                );
            });
        } else {
            for row in y.chunks_mut(o.max(1)) {
                row.copy_from_slice(&b[..row.len()]);
            }
        }
        if self.relu {
            // candle's ReLU and its gradient's mask.
            let passes = y.iter().map(|&v| v >= 0.0).collect();
            for v in &mut y {
                *v = v.max(0.0);
            }
            *lock(&self.passes) = passes;
        }
        Ok((CpuStorage::F32(y), Shape::from((self.n, o))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, k, o) = (self.n, self.k, self.o);
        // The gradient at the product (through the ReLU's mask).
        let g: Vec<f32> = with_f32(grad, |g| {
            Ok(if self.relu {
                let passes = lock(&self.passes);
                g.iter()
                    .zip(passes.iter())
                    .map(|(&v, &p)| if p { v } else { 0.0 })
                    .collect()
            } else {
                g.to_vec()
            })
        })?;
        let dx = if x.track_op() {
            let mut dx = vec![0f32; n * k];
            with_f32(w, |w| {
                if o == 0 {
                    return Ok(()); // no outputs: a zero gradient
                }
                for_each_chunk(&mut dx, k, |first, rows| {
                    let g_rows = &g[first * o..first * o + rows.len() / k * o];
                    // dx_rows (r x k) = g_rows (r x o) . w (o x k)
                    matmul(
                        Mat::rows(rows, k),
                        Mat::rows_of(g_rows, o),
                        Mat::rows_of(w, k),
                        false,
                    );
                });
                Ok(())
            })?;
            Some(Tensor::from_vec(dx, (n, k), &Device::Cpu)?)
        } else {
            None
        };
        let dw = if w.track_op() {
            // gᵀ (o x n), so that each thread takes whole rows of the weight's gradient.
            let mut gt = vec![0f32; o * n];
            for (i, row) in g.chunks(o.max(1)).enumerate() {
                for (j, &v) in row.iter().enumerate() {
                    gt[j * n + i] = v;
                }
            }
            let mut dw = vec![0f32; o * k];
            with_f32(x, |x| {
                if n == 0 {
                    return Ok(()); // an empty batch: a zero gradient
                }
                for_each_chunk(&mut dw, k, |first, rows| {
                    let gt_rows = &gt[first * n..first * n + rows.len() / k * n];
                    // dw_rows (r x k) = gtᵀ_rows (r x n) . x (n x k)
                    matmul(
                        Mat::rows(rows, k),
                        Mat::rows_of(gt_rows, n),
                        Mat::rows_of(x, k),
                        false,
                    );
                });
                Ok(())
            })?;
            Some(Tensor::from_vec(dw, (o, k), &Device::Cpu)?)
        } else {
            None
        };
        let db = if b.track_op() {
            let mut db = vec![0f32; o];
            for row in g.chunks(o.max(1)) {
                for (d, &v) in db.iter_mut().zip(row) {
                    *d += v;
                }
            }
            Some(Tensor::from_vec(db, o, &Device::Cpu)?)
        } else {
            None
        };
        Ok((dx, dw, db))
    }
}
