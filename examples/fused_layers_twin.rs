//! The Rust half of `scripts/torch_layers_check.py`: runs candle_parallel::nn's fused layers on
//! the inputs the script wrote, and writes their outputs and the gradients of every input for
//! the script to compare with PyTorch's.
//!
//!     python3 scripts/torch_layers_check.py        # runs this example itself
//!     cargo run --example fused_layers_twin -- IN.npz OUT.npz
//!
//! Each case in IN.npz is a group of arrays named `CASE.NAME`: `CASE.x` and the layer's other
//! inputs (`w` and `b` for the norms, `cos` and `sin` for rope), and `CASE.g`, the gradient of
//! the output. The layer is the case name up to its first `-` (`layer_norm`, `rms_norm`,
//! `softmax_last_dim`, `rope`, `rope_i`, `rope_thd`, and the CIFAR Net's fused blocks:
//! `conv_relu_pool`, a 2-D convolution with its ReLU and 2x2 max-pooling, and `linear_relu` and
//! `linear`, with `w` and `b`; and `batch_norm`, a SyncBatchNorm over two thread ranks, rank 0
//! taking the first `CASE.rows0` rows, with `w` and `b`). A case named `LAYER-...-DTYPE`, DTYPE
//! one of `f32`, `f64`, `f16` and `bf16`, runs in that dtype (its arrays hold values exactly
//! representable in it); the others run in f32. OUT.npz holds `CASE.y` and `CASE.d_NAME` for
//! each input: the gradient of `sum(y * g)` (zeros for an input that got none), in f32 (f64 for
//! f64 cases).

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor, Var};
use candle_nn::{Linear, ModuleT, VarBuilder, VarMap};
use candle_parallel::distributed::spawn_threads_with_error;
use candle_parallel::nn::{self, ops, rotary_emb};
use std::collections::BTreeMap;

const EPS: f32 = 1e-5;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, input, output] = args.as_slice() else {
        bail!("usage: fused_layers_twin IN.npz OUT.npz");
    };
    let mut cases: BTreeMap<String, BTreeMap<String, Tensor>> = BTreeMap::new();
    for (name, t) in Tensor::read_npz(input).with_context(|| format!("reading {input}"))? {
        let (case, what) = name
            .split_once('.')
            .with_context(|| format!("array `{name}` is not named CASE.NAME"))?;
        cases
            .entry(case.to_string())
            .or_default()
            .insert(what.to_string(), t);
    }
    let mut out: Vec<(String, Tensor)> = Vec::new();
    for (case, arrays) in &cases {
        let layer = case.split('-').next().unwrap_or(case);
        let dtype = match case.rsplit('-').next() {
            Some("f64") => DType::F64,
            Some("f16") => DType::F16,
            Some("bf16") => DType::BF16,
            _ => DType::F32,
        };
        let inputs: &[&str] = match layer {
            "layer_norm" => &["x", "w", "b"],
            "rms_norm" => &["x", "w"],
            "softmax_last_dim" => &["x"],
            "rope" | "rope_i" | "rope_thd" => &["x", "cos", "sin"],
            "conv_relu_pool" | "linear_relu" | "linear" | "batch_norm" => &["x", "w", "b"],
            other => bail!("case {case}: unknown layer {other}"),
        };
        let get = |n: &str| {
            arrays
                .get(n)
                .with_context(|| format!("case {case} lacks {n}"))
        };
        let vars: Vec<Var> = inputs
            .iter()
            .map(|n| Ok(Var::from_tensor(&get(n)?.to_dtype(dtype)?)?))
            .collect::<Result<_>>()?;
        let g = get("g")?.to_dtype(dtype)?;
        let (y, grads) = if layer == "batch_norm" {
            let rows0 = get("rows0")?.to_dtype(DType::F64)?.to_vec1::<f64>()?[0] as usize;
            sync_batch_norm(&vars, &g, rows0)?
        } else {
            let v: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
            let y = match layer {
                "layer_norm" => ops::layer_norm(v[0], v[1], v[2], EPS)?,
                "rms_norm" => ops::rms_norm(v[0], v[1], EPS)?,
                "softmax_last_dim" => ops::softmax_last_dim(v[0])?,
                "rope" => rotary_emb::rope(v[0], v[1], v[2])?,
                "rope_i" => rotary_emb::rope_i(v[0], v[1], v[2])?,
                "conv_relu_pool" => {
                    let conv =
                        nn::Conv2d::new(v[1].clone(), Some(v[2].clone()), Default::default());
                    conv.forward_relu_max_pool2d(v[0], 2)?
                }
                "linear_relu" => {
                    nn::linear_relu(v[0], &Linear::new(v[1].clone(), Some(v[2].clone())))?
                }
                "linear" => nn::linear(v[0], &Linear::new(v[1].clone(), Some(v[2].clone())))?,
                _ => rotary_emb::rope_thd(v[0], v[1], v[2])?,
            };
            let store = (&y * &g)?.sum_all()?.backward()?;
            let grads = vars
                .iter()
                .map(|var| match store.get(var) {
                    Some(grad) => Ok(grad.clone()),
                    None => Ok(var.zeros_like()?),
                })
                .collect::<Result<Vec<_>>>()?;
            (y, grads)
        };
        // Half-precision results go out as f32, exactly.
        let wide = |t: &Tensor| match t.dtype() {
            DType::F16 | DType::BF16 => t.to_dtype(DType::F32),
            _ => Ok(t.clone()),
        };
        out.push((format!("{case}.y"), wide(&y)?));
        for (name, grad) in inputs.iter().zip(&grads) {
            out.push((format!("{case}.d_{name}"), wide(grad)?));
        }
    }
    let refs: Vec<(&str, &Tensor)> = out.iter().map(|(n, t)| (n.as_str(), t)).collect();
    Tensor::write_npz(&refs, output).with_context(|| format!("writing {output}"))?;
    println!("{} cases written to {output}", cases.len());
    Ok(())
}

/// SyncBatchNorm (training) over two thread ranks, rank 0 holding the first `rows0` rows of
/// `vars[0]` and rank 1 the rest, with the weight `vars[1]` and bias `vars[2]`: the output and
/// the input's gradient put back together, the weight's and bias's summed over the ranks (what
/// one process holding the whole batch gets).
fn sync_batch_norm(vars: &[Var], g: &Tensor, rows0: usize) -> Result<(Tensor, Vec<Tensor>)> {
    let (x, w, b) = (
        vars[0].as_tensor(),
        vars[1].as_tensor(),
        vars[2].as_tensor(),
    );
    let n = x.dim(0)?;
    let per_rank = spawn_threads_with_error(2, |pg| -> Result<Vec<Tensor>> {
        let (start, len) = if pg.rank() == 0 {
            (0, rows0)
        } else {
            (rows0, n - rows0)
        };
        let xs = Var::from_tensor(&x.narrow(0, start, len)?.contiguous()?)?;
        let gs = g.narrow(0, start, len)?;
        let mut varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, x.dtype(), x.device());
        let bn = nn::sync_batch_norm(w.dim(0)?, 1e-5, vb, &pg)?;
        varmap.set([("weight", w.copy()?), ("bias", b.copy()?)].into_iter())?;
        let y = bn.forward_t(xs.as_tensor(), true)?;
        let store = (&y * &gs)?.sum_all()?.backward()?;
        nn::finish_backward(&pg)?;
        let data = varmap.data().lock().unwrap();
        let grad = |v: &Var| match store.get(v) {
            Some(t) => Ok(t.clone()),
            None => v.zeros_like(),
        };
        Ok(vec![
            y,
            grad(&xs)?,
            grad(&data["weight"])?,
            grad(&data["bias"])?,
        ])
    })?;
    let (r0, r1) = (&per_rank[0], &per_rank[1]);
    let y = Tensor::cat(&[&r0[0], &r1[0]], 0)?;
    let dx = Tensor::cat(&[&r0[1], &r1[1]], 0)?;
    let sum =
        |i: usize| (r0[i].to_dtype(DType::F64)? + r1[i].to_dtype(DType::F64)?)?.to_dtype(x.dtype());
    Ok((y, vec![dx, sum(2)?, sum(3)?]))
}
