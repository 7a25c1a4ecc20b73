//! A linear layer with its bias and, optionally, a ReLU or an exact GELU as one CPU op:
//! [`linear`], [`linear_relu`] and [`linear_gelu`], for candle-nn's `Linear`.
//!
//! candle-nn's `Linear` is a matrix product, a broadcast add and (after it) a ReLU: three ops
//! whose backward adds a mask, a multiply and a sum over the batch, and candle runs its product
//! with a transposed weight at a third of the speed measured here for the CIFAR Net's layers.
//! Here, on the CPU, the forward is one product into the bias with the ReLU applied in place
//! (noting where its gradient passes: where the input is `>= 0`, as candle's), and the backward
//! three products split over candle's thread pool (after the GELU's derivative, in place, for
//! [`linear_gelu`], whose forward keeps the layer's output before the GELU for it: the
//! transformer MLP's wide activation then never becomes a node of candle's graph, whose
//! backward would add its gradient to a tensor of zeros): the input gradient by rows of the
//! batch, the weight gradient by rows of the weight (no partial sums to add). A batch of fewer
//! rows than the output (for the input gradient: the input) is wide is split over the weight
//! instead, which each thread would otherwise read whole. Under `nn::backward` the weight and
//! bias gradients go into the store as made. Inputs of any rank from 2 are taken as rows of
//! their last dimension; a layer without a bias adds zeros.
//!
//! f16 and bf16 run the same f32 kernels and round their results once: their products and
//! sums accumulate in f32, as torch's do (the crate's rule, see the [`nn` module docs](super)),
//! where candle sums a bf16 bias gradient over 4096 rows of ones to 256. Where the CPU has AMX
//! tiles, bf16 layers run their products on them where large enough to gain (bf16 operands,
//! f32 sums, as oneDNN does for torch; the gradient at the product, an f32 sum, is rounded to
//! bf16 for the backward's two products, as torch's bf16 backward has it), and so do f32
//! layers under [`MatmulPrecision::Medium`] ([`set_float32_matmul_precision`], torch's
//! `"medium"`). f64, other devices
//! (CUDA) and one-dimensional inputs take candle's product, with the bias added in f32 for f16
//! and bf16 so that its gradient is summed there. A batch of no rows gives the weight and the
//! bias gradients of zeros, as in torch.
//!
//! [`MatmulPrecision::Medium`]: super::MatmulPrecision::Medium
//! [`set_float32_matmul_precision`]: super::set_float32_matmul_precision
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

use super::accumulate::{self, empty_output};
use super::amx;
use super::backward::{hand_over, through, Held};
use super::cast::{f32_values, rounded, storage_in, tensor_in, with_f32_values};
use super::few_rows;
use super::kernels::{for_each_chunk, matmul, matmul_threaded, ours_in_f32, Mat};
use crate::util::sync::lock;
use candle_core::{CpuStorage, DType, Device, Layout, Module, Result, Shape, Tensor};
use candle_nn::Linear;
use std::sync::Mutex;

/// `layer.forward(x)`: our kernels on the CPU (f32, f16, bf16), candle-nn's `Linear` with the
/// bias added in f32 elsewhere.
pub fn linear(x: &Tensor, layer: &Linear) -> Result<Tensor> {
    forward(x, layer, Activation::None)
}

/// `layer.forward(x)?.relu()`: our kernels on the CPU (f32, f16, bf16), candle-nn's `Linear`
/// with the bias added in f32, and candle's ReLU, elsewhere.
pub fn linear_relu(x: &Tensor, layer: &Linear) -> Result<Tensor> {
    forward(x, layer, Activation::Relu)
}

/// `gelu_erf(layer.forward(x))` (the exact GELU, torch's `F.gelu`): one op on the CPU (f32,
/// f16, bf16; the GELU applied in f32 before the one rounding), candle-nn's `Linear` with the
/// bias added in f32 and [`super::ops::gelu_erf`] elsewhere.
pub fn linear_gelu(x: &Tensor, layer: &Linear) -> Result<Tensor> {
    forward(x, layer, Activation::Gelu)
}

/// What follows the product and the bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Activation {
    None,
    Relu,
    Gelu,
}

fn forward(x: &Tensor, layer: &Linear, activation: Activation) -> Result<Tensor> {
    let w = layer.weight();
    let mut inputs = vec![x, w];
    inputs.extend(layer.bias());
    if let (Some(dtype), true) = (ours_in_f32(&inputs), x.rank() >= 2) {
        return fused(x, w, layer.bias(), activation, dtype);
    }
    let product = Linear::new(w.clone(), None).forward(x)?;
    if product.elem_count() == 0 {
        // candle's product of no rows is untracked zeros: the parameters would get no gradient.
        return empty_output(product.shape(), &inputs);
    }
    let y = match layer.bias() {
        Some(b) => accumulate::broadcast_add(&product, b)?,
        None => product,
    };
    match activation {
        Activation::None => Ok(y),
        Activation::Relu => y.relu(),
        Activation::Gelu => super::gelu::gelu_erf(&y),
    }
}

/// The layer by [`LinearOp`]: `x` `(.., k)` as rows, `w` `(o, k)`, `b` `(o)` (zeros when
/// absent), all in `dtype`, computed in f32; the result in `dtype`. Half tensors go to the op as
/// they are: it widens them itself, so no cast of candle's graph stands between (each would
/// cost a conversion and, in backward, a gradient added to a tensor of zeros).
fn fused(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    activation: Activation,
    dtype: DType,
) -> Result<Tensor> {
    let dims = x.dims();
    let k = dims[dims.len() - 1];
    let (o, wk) = w.dims2()?;
    if wk != k || b.is_some_and(|b| b.dims() != [o]) {
        candle_core::bail!(
            "linear: input {:?}, weight {:?} and bias {:?} do not fit: the weight needs as many \
             columns as the input's last dimension and the bias one value per weight row",
            x.dims(),
            w.dims(),
            b.map(|b| b.dims())
        )
    }
    // A watched copy (DistributedDataParallel's) is read through to its variable.
    let mut uses = Vec::new();
    let mut input = |t: &Tensor| -> Result<Tensor> { Ok(through(&t.contiguous()?, &mut uses)) };
    let b = match b {
        Some(b) => input(b)?,
        None => Tensor::zeros(o, dtype, &Device::Cpu)?,
    };
    let n = dims[..dims.len() - 1].iter().product();
    let rows = input(x)?.reshape((n, k))?;
    let w = input(w)?;
    let op = LinearOp {
        n,
        k,
        o,
        dtype,
        activation,
        tiles: amx::tiles_for(dtype),
        saved: Mutex::new(Saved::Nothing),
    };
    let mut out_dims = dims.to_vec();
    *out_dims.last_mut().expect("rank >= 2") = o;
    rows.apply_op3(&w, &b, Held::new(op, uses))?
        .reshape(out_dims)
}

/// What the forward keeps for the activation's backward.
enum Saved {
    Nothing,
    /// After a ReLU, whether each output's gradient passes (its input was `>= 0`).
    Passes(Vec<bool>),
    /// Before a GELU, its input (the product and the bias); and its output in f32 where the
    /// op's output is a half tensor (the backward reads Φ back from it).
    Input(Vec<f32>, Option<Vec<f32>>),
}

/// The fused layer as a candle op over `x` `(n, k)`, `w` `(o, k)` and `b` `(o)`.
struct LinearOp {
    n: usize,
    k: usize,
    o: usize,
    /// The dtype of the inputs and the output (f32, bf16 or f16); the kernels compute in f32.
    dtype: DType,
    activation: Activation,
    /// Whether the products run in bf16 on AMX tiles (a bf16 layer where the CPU has them, or
    /// an f32 one under `MatmulPrecision::Medium`), those large enough to gain
    /// ([`amx::worth`]): bf16 inputs are exact in f32 and rounded back; the gradient at the
    /// product is rounded to bf16 as torch's bf16 backward has it.
    tiles: bool,
    /// Set by the forward.
    saved: Mutex<Saved>,
}

impl candle_core::CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        match self.activation {
            Activation::None => "linear",
            Activation::Relu => "linear-relu",
            Activation::Gelu => "linear-gelu",
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
        let x = f32_values(xs, xl, "linear's input")?;
        let w = f32_values(ws, wl, "linear's weight")?;
        let b = f32_values(bs, bl, "linear's bias")?;
        let (x, w, b) = (&*x, &*w, &*b);
        let (k, o) = (self.k, self.o);
        // Every row starts as the bias (written once, not zeroed first); the products add to it.
        let mut y = Vec::with_capacity(self.n * o);
        for _ in 0..self.n {
            y.extend_from_slice(b);
        }
        if k > 0 && self.tiles && amx::worth(self.n, k, o) {
            // y (n x o) += x (n x k) . wᵀ (k x o), in bf16 on the tiles.
            amx::matmul(
                Mat::rows(&mut y, o),
                Mat::rows_of(x, k),
                Mat::transposed(w, k),
                true,
            );
        } else if k > 0 && self.n < o {
            // Few rows: split over the weight, which each thread would otherwise read whole;
            // our kernel where it is faster than gemm's packing of wᵀ.
            let (mut dst, xs, wt) = (
                Mat::rows(&mut y, o),
                Mat::rows_of(x, k),
                Mat::transposed(w, k),
            );
            if !few_rows::product(&mut dst, &xs, &wt, true) {
                matmul_threaded(dst, xs, wt, true);
            }
        } else if k > 0 {
            for_each_chunk(&mut y, o, |first, rows| {
                let x_rows = &x[first * k..first * k + rows.len() / o * k];
                // y_rows (r x o) += x_rows (r x k) . wᵀ (k x o)
                matmul(
                    Mat::rows(rows, o),
                    Mat::rows_of(x_rows, k),
                    Mat::transposed(w, k),
                    true,
                );
            });
        }
        match self.activation {
            Activation::None => {}
            Activation::Relu => {
                // candle's ReLU and its gradient's mask.
                let passes = y.iter().map(|&v| v >= 0.0).collect();
                for v in &mut y {
                    *v = v.max(0.0);
                }
                *lock(&self.saved) = Saved::Passes(passes);
            }
            Activation::Gelu => {
                let input = y.clone();
                super::gelu::gelu_in_place(&mut y);
                if self.dtype != DType::F32 {
                    // The half output is rounded from `y`, which the backward keeps.
                    let out = rounded(&y, self.dtype)?;
                    *lock(&self.saved) = Saved::Input(input, Some(y));
                    return Ok((out, Shape::from((self.n, o))));
                }
                *lock(&self.saved) = Saved::Input(input, None);
            }
        }
        Ok((storage_in(y, self.dtype)?, Shape::from((self.n, o))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // The gradient at the product: through the activation, or (none) read where it lies.
        let through = |g: &[f32]| -> Result<Option<Vec<f32>>> {
            Ok(match &*lock(&self.saved) {
                Saved::Passes(passes) => Some(
                    g.iter()
                        .zip(passes.iter())
                        .map(|(&v, &p)| if p { v } else { 0.0 })
                        .collect(),
                ),
                Saved::Input(input, output) => {
                    let mut g = g.to_vec();
                    match output {
                        Some(y) => super::gelu::gelu_grad_in_place(input, y, &mut g),
                        None => with_f32_values(y, |y| {
                            super::gelu::gelu_grad_in_place(input, y, &mut g);
                            Ok(())
                        })?,
                    }
                    Some(g)
                }
                Saved::Nothing => None,
            })
        };
        let (dx, dw, db) = with_f32_values(grad, |g| match through(g)? {
            Some(g) => self.products(x, w, b, &g),
            None => self.products(x, w, b, g),
        })?;
        Ok((
            hand_over(y, x, dx),
            hand_over(y, w, dw),
            hand_over(y, b, db),
        ))
    }
}

impl LinearOp {
    /// The gradients of the input, the weight and the bias from `g`, the gradient at the
    /// product, each for the tensors that need one.
    fn products(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        g: &[f32],
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, k, o) = (self.n, self.k, self.o);
        let dx = if x.track_op() {
            let mut dx = vec![0f32; n * k];
            with_f32_values(w, |w| {
                if o == 0 {
                    return Ok(()); // no outputs: a zero gradient
                }
                if self.tiles && amx::worth(n, o, k) {
                    // dx (n x k) = g (n x o) . w (o x k), in bf16 on the tiles.
                    amx::matmul(
                        Mat::rows(&mut dx, k),
                        Mat::rows_of(g, o),
                        Mat::rows_of(w, k),
                        false,
                    );
                    return Ok(());
                }
                if n < k {
                    // Few rows: split over the weight, as in the forward.
                    matmul_threaded(
                        Mat::rows(&mut dx, k),
                        Mat::rows_of(g, o),
                        Mat::rows_of(w, k),
                        false,
                    );
                    return Ok(());
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
            Some(tensor_in(dx, (n, k), self.dtype)?)
        } else {
            None
        };
        let dw = if w.track_op() {
            // Each thread takes whole rows of the weight's gradient: rows of gᵀ, read as
            // columns of g where they lie (gemm packs them; a transposed copy of g cost more
            // than the product at the transformer's sizes).
            let mut dw = crate::memory::zeroed_f32(o * k);
            with_f32_values(x, |x| {
                if n == 0 {
                    return Ok(()); // an empty batch: a zero gradient
                }
                if self.tiles && amx::worth(o, n, k) {
                    // dw (o x k) = gᵀ (o x n) . x (n x k), in bf16 on the tiles.
                    amx::matmul(
                        Mat::rows(&mut dw, k),
                        Mat::transposed(g, o),
                        Mat::rows_of(x, k),
                        false,
                    );
                    return Ok(());
                }
                for_each_chunk(&mut dw, k, |first, rows| {
                    let count = rows.len() / k;
                    // dw_rows (r x k) = gᵀ_rows (r x n) . x (n x k)
                    matmul(
                        Mat::rows(rows, k),
                        Mat::columns_transposed(g, o, first, count),
                        Mat::rows_of(x, k),
                        false,
                    );
                });
                Ok(())
            })?;
            Some(tensor_in(dw, (o, k), self.dtype)?)
        } else {
            None
        };
        let db = if b.track_op() {
            Some(tensor_in(column_sums(g, o), o, self.dtype)?)
        } else {
            None
        };
        Ok((dx, dw, db))
    }
}

/// The sums of the `o` columns of the row-major `g`: row `i` into partial sums `i % 8` over
/// blocks of 256 rows, the blocks added pairwise, so that every partial sum stays short (as
/// the row kernels' lanes, see `rows::lane_sum`).
fn column_sums(g: &[f32], o: usize) -> Vec<f32> {
    const LANES: usize = 8;
    const BLOCK: usize = 32 * LANES;
    let rows = g.len() / o.max(1);
    if rows > BLOCK {
        let half = rows.div_ceil(2 * BLOCK) * BLOCK * o;
        let (mut a, b) = (column_sums(&g[..half], o), column_sums(&g[half..], o));
        for (x, y) in a.iter_mut().zip(b) {
            *x += y;
        }
        return a;
    }
    let mut lanes = vec![0f32; LANES * o];
    for (i, row) in g.chunks(o.max(1)).enumerate() {
        let lane = &mut lanes[(i % LANES) * o..(i % LANES + 1) * o];
        for (l, &v) in lane.iter_mut().zip(row) {
            *l += v;
        }
    }
    let lane = |l: usize, j: usize| lanes[l * o + j];
    (0..o)
        .map(|j| {
            ((lane(0, j) + lane(4, j)) + (lane(1, j) + lane(5, j)))
                + ((lane(2, j) + lane(6, j)) + (lane(3, j) + lane(7, j)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_sums_of_many_rows_hold_to_f32() {
        // 0.1 is not a float: 100 000 of them in order drift by ~1e-4 relative.
        let (n, o) = (100_000, 3);
        let g = vec![0.1f32; n * o];
        let want = n as f64 * 0.1f32 as f64;
        for got in column_sums(&g, o) {
            assert!(
                (got as f64 - want).abs() < want * 1e-6,
                "{got} against {want}"
            );
        }
        assert!(column_sums(&[], 0).is_empty());
        assert_eq!(column_sums(&[1.0, 2.0, 3.0, 4.0], 2), [4.0, 6.0]);
    }
}
