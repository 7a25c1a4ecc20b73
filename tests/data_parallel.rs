//! DataParallel gives the plain model's numbers: outputs, gradients and training trajectories.

mod common;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{loss, Optimizer, VarBuilder, VarMap};
use candle_parallel::cifar::Net;
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{Sgd, SgdConfig};
use candle_parallel::rng::Rng;
use candle_parallel::{DataParallel, DataParallelConfig, Error};
use common::max_abs_diff;
use std::collections::HashMap;

const SEED: u64 = 17;

/// A VarMap holding a Net initialised from `SEED`, and the plain Net over it.
fn plain_net() -> (VarMap, Net) {
    let varmap = VarMap::new();
    let net = Net::new(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu)).unwrap();
    (varmap, net)
}

fn dp_net(replicas: usize) -> DataParallel<Net> {
    let (varmap, _) = plain_net();
    DataParallel::new(&varmap, vec![Device::Cpu; replicas], Net::new).unwrap()
}

fn images(batch: usize, seed: u64) -> Tensor {
    let mut rng = Rng::new(seed);
    let v: Vec<f32> = (0..batch * 3 * 32 * 32)
        .map(|_| rng.normal() as f32)
        .collect();
    Tensor::from_vec(v, (batch, 3, 32, 32), &Device::Cpu).unwrap()
}

fn labels(batch: usize, seed: u64) -> Tensor {
    let mut rng = Rng::new(seed ^ 0xABCD);
    let v: Vec<u32> = (0..batch).map(|_| rng.below(10) as u32).collect();
    Tensor::from_vec(v, batch, &Device::Cpu).unwrap()
}

fn by_name(varmap: &VarMap) -> HashMap<String, Var> {
    varmap.data().lock().unwrap().clone()
}

#[test]
fn outputs_and_gradients_equal_the_plain_model_for_1_2_3_and_8_replicas() {
    // 24 rows divide over every replica count, 10 do not over 3 and 8, 5 are fewer than 8.
    for replicas in [1, 2, 3, 8] {
        for batch in [24, 10, 5] {
            let (plain_vars, plain) = plain_net();
            let dp = dp_net(replicas);
            let (x, y) = (images(batch, batch as u64), labels(batch, batch as u64));

            let want = plain.forward(&x).unwrap();
            let got = dp.forward_t(&x, true).unwrap();
            assert_eq!(got.dims(), [batch, 10]);
            let diff = max_abs_diff(&got, &want);
            assert!(
                diff <= 1e-6,
                "{replicas} replicas, batch {batch}: output differs by {diff}"
            );

            let want_grads = loss::cross_entropy(&want, &y).unwrap().backward().unwrap();
            let got_grads = loss::cross_entropy(&got, &y).unwrap().backward().unwrap();
            let plain_vars = by_name(&plain_vars);
            for (name, var) in by_name(dp.varmap()) {
                let g = got_grads
                    .get(&var)
                    .expect("every master variable has a gradient");
                let w = want_grads.get(&plain_vars[&name]).unwrap();
                let diff = max_abs_diff(g, w);
                assert!(
                    diff <= 1e-5,
                    "{replicas} replicas, batch {batch}: gradient of {name} differs by {diff}"
                );
            }
        }
    }
}

#[test]
fn twenty_momentum_sgd_steps_through_data_parallel_match_plain_training() {
    let config = SgdConfig {
        lr: 0.05,
        momentum: 0.9,
        weight_decay: 1e-4,
        ..Default::default()
    };
    let (plain_vars, plain) = plain_net();
    let mut plain_opt = Sgd::new(plain_vars.all_vars(), config).unwrap();
    let dp = dp_net(3);
    let mut dp_opt = Sgd::new(dp.parameters(), config).unwrap();
    for step in 0..20u64 {
        let (x, y) = (images(10, 100 + step), labels(10, 100 + step));
        let plain_loss = loss::cross_entropy(&plain.forward(&x).unwrap(), &y).unwrap();
        plain_opt.backward_step(&plain_loss).unwrap();
        let dp_loss = loss::cross_entropy(&dp.forward_t(&x, true).unwrap(), &y).unwrap();
        dp_opt.backward_step(&dp_loss).unwrap();
    }
    let plain_vars = by_name(&plain_vars);
    let mut moved = 0f32;
    for (name, var) in by_name(dp.varmap()) {
        let diff = max_abs_diff(var.as_tensor(), plain_vars[&name].as_tensor());
        assert!(diff <= 1e-5, "after 20 steps {name} differs by {diff}");
        let init = VarMap::new();
        let start = seeded_var_builder(&init, SEED, DType::F32, &Device::Cpu)
            .get(var.shape(), &name)
            .unwrap();
        moved = moved.max(max_abs_diff(var.as_tensor(), &start));
    }
    assert!(moved > 1e-3, "training did not change the parameters");
}

#[test]
fn outputs_gather_on_the_output_device_along_dim() {
    // Split along dim 1 of a (features, batch) input with a model that works on columns.
    let varmap = VarMap::new();
    let build = |vb: VarBuilder| {
        let w = vb.get((3, 4), "w")?;
        Ok(candle_nn::Func::new(move |x: &Tensor| w.matmul(x)))
    };
    let config = DataParallelConfig {
        dim: 1,
        output_device: Some(Device::Cpu),
        ..Default::default()
    };
    let dp = DataParallel::with_config(&varmap, vec![Device::Cpu; 3], config, build).unwrap();
    let x = images(1, 3)
        .flatten_all()
        .unwrap()
        .narrow(0, 0, 28)
        .unwrap()
        .reshape((4, 7))
        .unwrap();
    let got = dp.forward(&x).unwrap();
    let want = dp.module().forward(&x).unwrap();
    assert_eq!(got.dims(), [3, 7]);
    assert!(max_abs_diff(&got, &want) <= 1e-6);
}

#[test]
fn a_replica_asking_for_a_variable_the_master_lacks_is_refused_by_name() {
    let varmap = VarMap::new();
    let calls = std::sync::atomic::AtomicUsize::new(0);
    let dp = DataParallel::new(&varmap, vec![Device::Cpu; 2], move |vb: VarBuilder| {
        // The master build (call 0) creates `a`; replicas ask for `b`, which does not exist.
        let name = if calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            "a"
        } else {
            "b"
        };
        let w = vb.get(2, name)?;
        Ok(candle_nn::Func::new(move |x: &Tensor| x.broadcast_mul(&w)))
    })
    .unwrap();
    let x = Tensor::ones((4, 2), DType::F32, &Device::Cpu).unwrap();
    let err = dp.forward_t(&x, false).unwrap_err();
    assert!(matches!(err, Error::Replica { index: 1, .. }), "{err}");
    assert!(err.to_string().contains("`b`"), "{err}");
}
