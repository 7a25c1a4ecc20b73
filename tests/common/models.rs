//! A small model and its data, the same on every rank, for the training tests.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Linear, VarBuilder, VarMap};
use candle_parallel::optim::SgdConfig;
use candle_parallel::rng::Rng;

pub const IN: usize = 8;
pub const CLASSES: usize = 4;
pub const SGD: SgdConfig = SgdConfig {
    lr: 0.05,
    momentum: 0.9,
    dampening: 0.0,
    weight_decay: 0.0,
    nesterov: false,
    maximize: false,
};

/// A three-layer perceptron.
pub struct Mlp {
    l1: Linear,
    l2: Linear,
    l3: Linear,
}

/// The perceptron with 16 hidden units.
pub fn mlp(vb: VarBuilder) -> candle_core::Result<Mlp> {
    mlp_with(vb, 16)
}

/// The perceptron with 13 hidden units: 355 elements, which no world of 2 or 3 divides.
pub fn mlp_uneven(vb: VarBuilder) -> candle_core::Result<Mlp> {
    mlp_with(vb, 13)
}

fn mlp_with(vb: VarBuilder, hidden: usize) -> candle_core::Result<Mlp> {
    Ok(Mlp {
        l1: linear(IN, hidden, vb.pp("l1"))?,
        l2: linear(hidden, hidden, vb.pp("l2"))?,
        l3: linear(hidden, CLASSES, vb.pp("l3"))?,
    })
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.apply(&self.l1)?
            .relu()?
            .apply(&self.l2)?
            .relu()?
            .apply(&self.l3)
    }
}

/// Step `step`'s whole batch of `rows` rows, the same on every rank.
pub fn batch(step: usize, rows: usize) -> (Tensor, Tensor) {
    let mut rng = Rng::new(1000 + step as u64);
    let xs: Vec<f32> = (0..rows * IN).map(|_| rng.normal() as f32).collect();
    let ys: Vec<u32> = (0..rows)
        .map(|_| rng.below(CLASSES as u64) as u32)
        .collect();
    (
        Tensor::from_vec(xs, (rows, IN), &Device::Cpu).unwrap(),
        Tensor::from_vec(ys, rows, &Device::Cpu).unwrap(),
    )
}

/// Rank `rank`'s share (rows `rank * per..`) of step `step`'s batch of `world * per` rows.
pub fn share(step: usize, world: usize, per: usize, rank: usize) -> (Tensor, Tensor) {
    let (x, y) = batch(step, world * per);
    (
        x.narrow(0, rank * per, per).unwrap(),
        y.narrow(0, rank * per, per).unwrap(),
    )
}

/// Variables by name, as flat f32 vectors.
pub type Values = Vec<(String, Vec<f32>)>;

/// The variables of `varmap`, sorted by name, as flat f32 vectors.
pub fn values(varmap: &VarMap) -> Values {
    let mut all: Vec<(String, Vec<f32>)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            let flat = v.flatten_all().unwrap().to_dtype(DType::F32).unwrap();
            (k.clone(), flat.to_vec1::<f32>().unwrap())
        })
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

pub fn max_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|((na, va), (nb, vb))| {
            assert_eq!(na, nb);
            va.iter().zip(vb).map(|(x, y)| (x - y).abs())
        })
        .fold(0.0, f32::max)
}
