//! The synthetic CIFAR-10 stand-in is learnable by the tutorial's Net in a short run.
//!
//! The Net sits on its initial plateau for its first ~60-90 steps; 150 steps take it past, to
//! about 40% on this data (CIFAR-10's figure after its first few hundred steps), so a trainer
//! that does not learn fails far from the threshold, and one that learns passes far above it.

use candle_core::{DType, Device, Module, D};
use candle_nn::{loss, Optimizer, VarMap};
use candle_parallel::cifar::{self, Net};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{Sgd, SgdConfig};
use candle_parallel::rng::Rng;
use candle_parallel::DataParallel;

#[test]
fn the_synthetic_dataset_is_learnt_well_above_chance_in_150_steps() {
    let device = Device::Cpu;
    let data = cifar::synthetic(6400, 500, 0);
    let varmap = VarMap::new();
    Net::new(seeded_var_builder(&varmap, 0, DType::F32, &device)).unwrap();
    let model = DataParallel::new(&varmap, vec![device.clone(); 2], Net::new).unwrap();
    let config = SgdConfig {
        lr: 0.01,
        momentum: 0.9,
        ..Default::default()
    };
    let mut opt = Sgd::new(model.parameters(), config).unwrap();
    for epoch in 0..3 {
        for batch in Rng::new(epoch).permutation(data.train.len()).chunks(128) {
            let (x, y) = data.train.batch(batch, &device).unwrap();
            let loss = loss::cross_entropy(&model.forward_t(&x, true).unwrap(), &y).unwrap();
            opt.backward_step(&loss).unwrap();
        }
    }
    let all: Vec<usize> = (0..data.test.len()).collect();
    let (x, y) = data.test.batch(&all, &device).unwrap();
    let predicted = model
        .module()
        .forward(&x)
        .unwrap()
        .argmax(D::Minus1)
        .unwrap();
    let correct = predicted
        .eq(&y)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .mean_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(
        correct > 0.25,
        "test accuracy {correct} after 150 steps; chance is 0.1"
    );
}
