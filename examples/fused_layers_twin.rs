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
//! `linear`, with `w` and `b`). OUT.npz holds `CASE.y` and `CASE.d_NAME` for each input: the
//! gradient of `sum(y * g)`.

use anyhow::{bail, Context, Result};
use candle_core::{Tensor, Var};
use candle_nn::Linear;
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
        let inputs: &[&str] = match layer {
            "layer_norm" => &["x", "w", "b"],
            "rms_norm" => &["x", "w"],
            "softmax_last_dim" => &["x"],
            "rope" | "rope_i" | "rope_thd" => &["x", "cos", "sin"],
            "conv_relu_pool" | "linear_relu" | "linear" => &["x", "w", "b"],
            other => bail!("case {case}: unknown layer {other}"),
        };
        let vars: Vec<Var> = inputs
            .iter()
            .map(|n| {
                let t = arrays
                    .get(*n)
                    .with_context(|| format!("case {case} lacks {n}"))?;
                Ok(Var::from_tensor(t)?)
            })
            .collect::<Result<_>>()?;
        let v: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
        let y = match layer {
            "layer_norm" => ops::layer_norm(v[0], v[1], v[2], EPS)?,
            "rms_norm" => ops::rms_norm(v[0], v[1], EPS)?,
            "softmax_last_dim" => ops::softmax_last_dim(v[0])?,
            "rope" => rotary_emb::rope(v[0], v[1], v[2])?,
            "rope_i" => rotary_emb::rope_i(v[0], v[1], v[2])?,
            "conv_relu_pool" => {
                let conv = nn::Conv2d::new(v[1].clone(), Some(v[2].clone()), Default::default());
                conv.forward_relu_max_pool2d(v[0], 2)?
            }
            "linear_relu" => nn::linear_relu(v[0], &Linear::new(v[1].clone(), Some(v[2].clone())))?,
            "linear" => nn::linear(v[0], &Linear::new(v[1].clone(), Some(v[2].clone())))?,
            _ => rotary_emb::rope_thd(v[0], v[1], v[2])?,
        };
        let g = arrays
            .get("g")
            .with_context(|| format!("case {case} lacks g"))?;
        let grads = (&y * g)?.sum_all()?.backward()?;
        out.push((format!("{case}.y"), y));
        for (name, var) in inputs.iter().zip(&vars) {
            let grad = grads
                .get(var)
                .with_context(|| format!("case {case}: {name} got no gradient"))?;
            out.push((format!("{case}.d_{name}"), grad.clone()));
        }
    }
    let refs: Vec<(&str, &Tensor)> = out.iter().map(|(n, t)| (n.as_str(), t)).collect();
    Tensor::write_npz(&refs, output).with_context(|| format!("writing {output}"))?;
    println!("{} cases written to {output}", cases.len());
    Ok(())
}
