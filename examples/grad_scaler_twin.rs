//! The Rust half of `scripts/torch_grad_scaler_check.py`: one f32 parameter trained with SGD
//! under `amp::GradScaler`, the loss made infinite at the steps given, printing after each step
//! whether it stepped, the scale and the parameter, for the script to compare with
//! `torch.amp.GradScaler` doing the same.
//!
//!     cargo run --example grad_scaler_twin -- STEPS GROWTH_INTERVAL OVERFLOW_STEPS
//!     (e.g. 12 3 2,3,7: twelve steps, growth every 3 clean ones, overflows at steps 2, 3, 7)

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor, Var};
use candle_nn::Optimizer;
use candle_parallel::amp::{GradScaler, GradScalerConfig};
use candle_parallel::optim::{Sgd, SgdConfig};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, steps, interval, overflows] = args.as_slice() else {
        bail!("usage: grad_scaler_twin STEPS GROWTH_INTERVAL OVERFLOW_STEPS");
    };
    let steps: usize = steps.parse().context("STEPS")?;
    let overflows: Vec<usize> = overflows
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().context("OVERFLOW_STEPS"))
        .collect::<Result<_>>()?;
    let config = GradScalerConfig {
        growth_interval: interval.parse().context("GROWTH_INTERVAL")?,
        ..Default::default()
    };
    let w = Var::new(&[0.5f32, -1.5], &Device::Cpu)?;
    let mut opt = Sgd::new(
        vec![w.clone()],
        SgdConfig {
            lr: 0.01,
            ..Default::default()
        },
    )?;
    let mut scaler = GradScaler::new(config)?;
    let x = Tensor::new(&[0.25f32, 2.0], &Device::Cpu)?;
    for step in 1..=steps {
        let factor = if overflows.contains(&step) {
            f64::INFINITY
        } else {
            1.0
        };
        let loss = (w.as_tensor() * &x)?
            .sqr()?
            .sum_all()?
            .affine(factor, 0.0)?;
        let mut grads = scaler.scale(&loss)?.backward()?;
        let stepped = scaler.step(&mut opt, &mut grads)?;
        scaler.update();
        let w = w.to_vec1::<f32>()?;
        println!(
            "step {step}: stepped {stepped} scale {} w {:.9} {:.9}",
            scaler.scale_factor(),
            w[0],
            w[1]
        );
    }
    Ok(())
}
