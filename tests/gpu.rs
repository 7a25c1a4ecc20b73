//! Checks that need a GPU (build with `--features cuda`, or `cuda,nccl` for NCCL). Where no
//! GPU is visible each test says so and returns; `scripts/gpu-checks.sh` runs them on a GPU
//! machine. One GPU suffices: several candle devices on GPU 0 are distinct devices.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{loss, Optimizer, VarMap};
use candle_parallel::cifar::Net;
use candle_parallel::distributed::{Backend, InitOptions, ProcessGroup, ReduceOp, Rendezvous};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{Sgd, SgdConfig};
use candle_parallel::{DataParallel, Error};
use common::{is_child, max_abs_diff, solo_rendezvous, Ranks, DONE};
use std::time::Duration;

fn have_gpu() -> bool {
    let n = candle_parallel::devices::gpu_count();
    if n == 0 {
        eprintln!("no GPU visible: skipped");
    }
    n > 0
}

fn images(batch: usize, device: &Device) -> Tensor {
    Tensor::randn(0f32, 1.0, (batch, 3, 32, 32), &Device::Cpu)
        .unwrap()
        .to_device(device)
        .unwrap()
}

#[test]
fn data_parallel_over_two_devices_on_gpu_0_matches_one_device() {
    if !have_gpu() {
        return;
    }
    let d0 = Device::new_cuda_with_stream(0).unwrap();
    let d1 = Device::new_cuda_with_stream(0).unwrap();
    assert!(!d0.same_device(&d1));
    let plain_vars = VarMap::new();
    let plain = Net::new(seeded_var_builder(&plain_vars, 5, DType::F32, &d0)).unwrap();
    let dp_vars = VarMap::new();
    Net::new(seeded_var_builder(&dp_vars, 5, DType::F32, &d0)).unwrap();
    let dp = DataParallel::new(&dp_vars, vec![d0.clone(), d1], Net::new).unwrap();
    let config = SgdConfig {
        lr: 0.05,
        momentum: 0.9,
        ..Default::default()
    };
    let mut plain_opt = Sgd::new(plain_vars.all_vars(), config).unwrap();
    let mut dp_opt = Sgd::new(dp.vars(), config).unwrap();
    for step in 0..20u32 {
        let x = images(10, &d0); // 5 rows per device
        let labels: Vec<u32> = (0..10).map(|i| (i + step) % 10).collect();
        let y = Tensor::from_vec(labels, 10, &d0).unwrap();
        let want = plain.forward(&x).unwrap();
        let got = dp.forward_t(&x, true).unwrap();
        assert!(got.device().same_device(&d0));
        assert!(
            max_abs_diff(&got, &want) <= 1e-5,
            "step {step}: outputs differ"
        );
        plain_opt
            .backward_step(&loss::cross_entropy(&want, &y).unwrap())
            .unwrap();
        dp_opt
            .backward_step(&loss::cross_entropy(&got, &y).unwrap())
            .unwrap();
    }
    let plain_data = plain_vars.data().lock().unwrap().clone();
    for (name, var) in dp_vars.data().lock().unwrap().iter() {
        let diff = max_abs_diff(var.as_tensor(), plain_data[name].as_tensor());
        assert!(diff <= 1e-4, "after 20 steps {name} differs by {diff}");
    }
}

#[test]
fn master_variables_on_another_device_are_refused() {
    if !have_gpu() {
        return;
    }
    let d0 = Device::new_cuda_with_stream(0).unwrap();
    let d1 = Device::new_cuda_with_stream(0).unwrap();
    let varmap = VarMap::new();
    Net::new(seeded_var_builder(&varmap, 0, DType::F32, &d1)).unwrap();
    let err = DataParallel::new(&varmap, vec![d0, d1], Net::new)
        .err()
        .expect("refused");
    assert!(matches!(err, Error::MasterNotOnDevice { .. }), "{err}");
}

#[cfg(feature = "nccl")]
#[test]
fn nccl_collectives_with_one_rank_return_the_input_on_its_gpu() {
    if !have_gpu() {
        return;
    }
    let device = Device::new_cuda_with_stream(0).unwrap();
    let pg = ProcessGroup::new(&solo_rendezvous(), &device, InitOptions::default()).unwrap();
    assert_eq!(pg.backend(), Backend::Nccl);
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let x = Tensor::arange(0f32, 12., &Device::Cpu)
            .unwrap()
            .reshape((4, 3))
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .to_device(&device)
            .unwrap();
        let as_f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        for op in [
            ReduceOp::Sum,
            ReduceOp::Avg,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Product,
        ] {
            let y = pg.all_reduce(&x, op).unwrap();
            assert!(y.device().same_device(&device));
            assert_eq!(
                max_abs_diff(&as_f32(&y), &as_f32(&x)),
                0.0,
                "{op} {dtype:?}"
            );
        }
        let b = pg.broadcast(&x, 0).unwrap();
        assert_eq!(max_abs_diff(&as_f32(&b), &as_f32(&x)), 0.0);
        let g = pg.all_gather(&x).unwrap();
        assert_eq!(g.len(), 1);
        assert_eq!(max_abs_diff(&as_f32(&g[0]), &as_f32(&x)), 0.0);
        let s = pg.reduce_scatter(&x, ReduceOp::Sum).unwrap();
        assert_eq!(max_abs_diff(&as_f32(&s), &as_f32(&x)), 0.0);
        let many = pg
            .all_reduce_many(&[x.clone(), x.clone()], ReduceOp::Sum)
            .unwrap();
        assert_eq!(max_abs_diff(&as_f32(&many[1]), &as_f32(&x)), 0.0);
    }
    pg.barrier().unwrap();
    // A CPU tensor is refused with a reason, not a crash.
    let cpu = Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap();
    let err = pg.all_reduce(&cpu, ReduceOp::Sum).unwrap_err();
    assert!(err.to_string().contains("group's device"), "{err}");
}

#[test]
fn the_tcp_backend_carries_cuda_tensors_between_two_processes() {
    if is_child() {
        let device = Device::new_cuda_with_stream(0).unwrap();
        let options = InitOptions {
            backend: Some(Backend::Tcp),
            ..InitOptions::from_env()
        };
        let pg = ProcessGroup::new(&Rendezvous::from_env().unwrap(), &device, options).unwrap();
        let x = Tensor::new(&[pg.rank() as f32 + 1.0, 10.0], &Device::Cpu)
            .unwrap()
            .to_device(&device)
            .unwrap();
        let y = pg.all_reduce(&x, ReduceOp::Sum).unwrap();
        assert!(y.device().same_device(&device));
        assert_eq!(y.to_vec1::<f32>().unwrap(), [3.0, 20.0]);
        println!("{DONE}");
        return;
    }
    if !have_gpu() {
        return;
    }
    Ranks::world(
        "the_tcp_backend_carries_cuda_tensors_between_two_processes",
        2,
    )
    .assert_all_pass(Duration::from_secs(120));
}
