//! What several benches share: the 25.2 M-parameter MLP on which communication matters.

use candle_core::{Device, Module, Tensor};
use candle_nn::{linear, Linear, VarBuilder};
use candle_parallel::optim::SgdConfig;

/// An MLP of 25.2 M parameters: 1024 → 4096 → 4096 → 1024.
pub struct Big {
    layers: [Linear; 3],
}

/// Builds [`Big`] from `vb`.
pub fn big(vb: VarBuilder) -> candle_core::Result<Big> {
    Ok(Big {
        layers: [
            linear(1024, 4096, vb.pp("fc1"))?,
            linear(4096, 4096, vb.pp("fc2"))?,
            linear(4096, 1024, vb.pp("fc3"))?,
        ],
    })
}

impl Module for Big {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = x.apply(&self.layers[0])?.relu()?;
        let h = h.apply(&self.layers[1])?.relu()?;
        h.apply(&self.layers[2])
    }
}

/// [`Big`] after the swap of `docs/CPU_SPEED.md`: the same variables, its layers through
/// `candle_parallel::nn::{linear_relu, linear}`.
#[allow(dead_code)] // not every bench that includes this module uses it
pub struct BigNn(Big);

/// Builds [`BigNn`] from `vb`.
#[allow(dead_code)]
pub fn big_nn(vb: VarBuilder) -> candle_core::Result<BigNn> {
    Ok(BigNn(big(vb)?))
}

impl Module for BigNn {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let layers = &self.0.layers;
        let h = candle_parallel::nn::linear_relu(x, &layers[0])?;
        let h = candle_parallel::nn::linear_relu(&h, &layers[1])?;
        candle_parallel::nn::linear(&h, &layers[2])
    }
}

/// A batch of `n` random inputs for [`Big`] and labels among its 1024 classes, on `device`.
pub fn big_batch(n: usize, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let x = Tensor::randn(0f32, 1.0, (n, 1024), device)?;
    let y = Tensor::from_vec((0..n as u32).map(|i| i % 1024).collect(), n, device)?;
    Ok((x, y))
}

/// The optimizer the MLP benches train with, as PyTorch's twins do: SGD, lr 0.01, momentum 0.9.
#[allow(dead_code)] // not every bench that includes this module uses it
pub const SGD: SgdConfig = SgdConfig {
    lr: 0.01,
    momentum: 0.9,
    dampening: 0.0,
    weight_decay: 0.0,
    nesterov: false,
    maximize: false,
};
