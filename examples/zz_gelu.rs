use candle_core::{Device, Tensor, Var};
use std::time::Instant;
fn main() -> anyhow::Result<()> {
    let n = 32 * 16 * 256;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1., n, &Device::Cpu)?)?;
    let g = Tensor::randn(0f32, 1., n, &Device::Cpu)?;
    for _ in 0..3 {
        let _ = candle_parallel::nn::ops::gelu_erf(&x)?;
    }
    let t = Instant::now();
    for _ in 0..200 {
        let _ = candle_parallel::nn::ops::gelu_erf(&x)?;
    }
    println!("fwd {:.3} ms", t.elapsed().as_secs_f64() * 1e3 / 200.0);
    let t = Instant::now();
    for _ in 0..100 {
        let y = candle_parallel::nn::ops::gelu_erf(&x)?;
        let _ = (y * &g)?.sum_all()?.backward()?;
    }
    println!("fwd+bwd {:.3} ms", t.elapsed().as_secs_f64() * 1e3 / 100.0);
    let t = Instant::now();
    for _ in 0..100 {
        let y = x.as_tensor().relu()?;
        let _ = (y * &g)?.sum_all()?;
    }
    println!(
        "relu+mul+sum {:.3} ms",
        t.elapsed().as_secs_f64() * 1e3 / 100.0
    );
    Ok(())
}
