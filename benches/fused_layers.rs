//! The speed of candle_parallel::nn's fused layers beside candle-nn's, at transformer sizes.
//!
//!     cargo bench --bench fused_layers
//!     cargo bench --bench fused_layers --features cuda -- --cuda --reps 50
//!
//! For each layer: the forward of candle-nn's fused op (no backward) and of ours; then a
//! training step's forward and backward of `sum(layer(x) * g)`: ours with our kernels, ours with
//! the backward built from candle ops (what runs on CUDA; on the CPU,
//! `use_own_cpu_kernels(false)`), and candle-nn's differentiable references built from
//! elementary ops (`layer_norm_slow`, `rms_norm_slow`, `softmax`, `rope_slow`), the only way to
//! train through these layers with candle-nn alone. Medians over `--reps` runs, in ms.
//! Reports; asserts nothing.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var, D};
use candle_parallel::nn::{ops, rotary_emb, use_own_cpu_kernels};
use std::time::Instant;

/// A layer: its inputs and three ways to compute it.
struct Case {
    name: String,
    inputs: Vec<Tensor>,
    candle_fused: fn(&[Tensor]) -> candle_core::Result<Tensor>,
    ours: fn(&[Tensor]) -> candle_core::Result<Tensor>,
    reference: fn(&[Tensor]) -> candle_core::Result<Tensor>,
}

fn median_ms(dev: &Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    dev.synchronize()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        f()?;
        dev.synchronize()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[reps / 2])
}

/// Forward and backward of `sum(layer(inputs) * g)` over variables.
fn step(
    layer: fn(&[Tensor]) -> candle_core::Result<Tensor>,
    vars: &[Var],
    g: &Tensor,
) -> Result<()> {
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let grads = (layer(&ts)? * g)?.sum_all()?.backward()?;
    anyhow::ensure!(
        grads.get(&vars[0]).is_some(),
        "no gradient reached the input"
    );
    Ok(())
}

fn cases(dev: &Device, dtype: DType) -> Result<Vec<Case>> {
    let randn = |shape: &[usize]| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1., shape, dev)?.to_dtype(dtype)?)
    };
    let (tokens, dim) = (16 * 256, 512);
    let (b, h, t, d) = (16, 8, 256, 64);
    let angles = Tensor::randn(0f32, 1., (t, d / 2), dev)?;
    let (cos, sin) = (
        angles.cos()?.to_dtype(dtype)?,
        angles.sin()?.to_dtype(dtype)?,
    );
    Ok(vec![
        Case {
            name: format!("layer_norm ({tokens}, {dim})"),
            inputs: vec![randn(&[tokens, dim])?, randn(&[dim])?, randn(&[dim])?],
            candle_fused: |t| candle_nn::ops::layer_norm(&t[0], &t[1], &t[2], 1e-5),
            ours: |t| ops::layer_norm(&t[0], &t[1], &t[2], 1e-5),
            reference: |t| candle_nn::ops::layer_norm_slow(&t[0], &t[1], &t[2], 1e-5),
        },
        Case {
            name: format!("rms_norm ({tokens}, {dim})"),
            inputs: vec![randn(&[tokens, dim])?, randn(&[dim])?],
            candle_fused: |t| candle_nn::ops::rms_norm(&t[0], &t[1], 1e-5),
            ours: |t| ops::rms_norm(&t[0], &t[1], 1e-5),
            reference: |t| candle_nn::ops::rms_norm_slow(&t[0], &t[1], 1e-5),
        },
        Case {
            name: format!("softmax_last_dim ({}, {t})", b * h * t),
            inputs: vec![randn(&[b * h * t, t])?],
            candle_fused: |t| candle_nn::ops::softmax_last_dim(&t[0]),
            ours: |t| ops::softmax_last_dim(&t[0]),
            reference: |t| candle_nn::ops::softmax(&t[0], D::Minus1),
        },
        Case {
            name: format!("rope ({b}, {h}, {t}, {d})"),
            inputs: vec![randn(&[b, h, t, d])?, cos, sin],
            candle_fused: |t| candle_nn::rotary_emb::rope(&t[0], &t[1], &t[2]),
            ours: |t| rotary_emb::rope(&t[0], &t[1], &t[2]),
            reference: |t| candle_nn::rotary_emb::rope_slow(&t[0], &t[1], &t[2]),
        },
    ])
}

fn main() -> Result<()> {
    candle_parallel::memory::keep_freed_memory();
    let (mut reps, mut cuda, mut dtype) = (20usize, false, DType::F32);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--reps" => reps = args.next().context("--reps needs a value")?.parse()?,
            "--cuda" => cuda = true,
            "--dtype" => {
                dtype = match args.next().context("--dtype needs a value")?.as_str() {
                    "f32" => DType::F32,
                    "bf16" => DType::BF16,
                    "f16" => DType::F16,
                    other => bail!("--dtype takes f32, bf16 or f16, not {other}"),
                }
            }
            "--bench" => {}
            other => bail!("unknown argument {other}; use --reps N, --cuda, --dtype"),
        }
    }
    let dev = if cuda {
        candle_parallel::devices::cuda_device(0)?
    } else {
        Device::Cpu
    };
    println!(
        "fused layers on {}, {dtype:?}, medians of {reps} runs (ms)",
        if cuda { "CUDA" } else { "the CPU" }
    );
    println!(
        "{:<34} {:>13} {:>9} {:>7}   {:>11} {:>14} {:>16}",
        "layer",
        "candle fused",
        "ours",
        "ratio",
        "step, ours",
        "ours, ops bwd",
        "candle elementary"
    );
    for case in cases(&dev, dtype)? {
        let fused = median_ms(&dev, reps, || {
            Ok((case.candle_fused)(&case.inputs).map(drop)?)
        })?;
        let ours = median_ms(&dev, reps, || Ok((case.ours)(&case.inputs).map(drop)?))?;
        let vars: Vec<Var> = case
            .inputs
            .iter()
            .map(Var::from_tensor)
            .collect::<candle_core::Result<_>>()?;
        let out_shape = (case.ours)(&case.inputs)?.shape().clone();
        let g = Tensor::randn(0f32, 1., out_shape, &dev)?.to_dtype(dtype)?;
        let step_ours = median_ms(&dev, reps, || step(case.ours, &vars, &g))?;
        let step_ops = if cuda {
            step_ours
        } else {
            use_own_cpu_kernels(false);
            let t = median_ms(&dev, reps, || step(case.ours, &vars, &g));
            use_own_cpu_kernels(true);
            t?
        };
        let step_reference = median_ms(&dev, reps, || step(case.reference, &vars, &g))?;
        println!(
            "{:<34} {:>13.3} {:>9.3} {:>6.2}x   {:>11.3} {:>14.3} {:>16.3}",
            case.name,
            fused,
            ours,
            ours / fused,
            step_ours,
            step_ops,
            step_reference
        );
    }
    println!("ratio: ours / candle fused (forward); a step is forward + backward of sum(y * g)");
    Ok(())
}
