//! Checks that need a GPU (build with `--features cuda`, or `cuda,nccl` for NCCL). Where no
//! GPU is visible each test says so and returns; `scripts/gpu-checks.sh` runs them on a GPU
//! machine. One GPU suffices: several candle devices on GPU 0 are distinct devices.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{loss, Optimizer, VarMap};
use candle_parallel::cifar::Net;
use candle_parallel::distributed::{Backend, InitConfig, ProcessGroup, ReduceOp, Rendezvous};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{Sgd, SgdConfig};
use candle_parallel::{comm, distributed, DataParallel, Error};
use common::models::SGD;
use common::{done, is_child, max_abs, max_abs_diff, solo_rendezvous, Ranks};
use std::time::Duration;

fn have_gpu() -> bool {
    let n = candle_parallel::devices::gpu_count();
    if n == 0 {
        eprintln!("no GPU visible: skipped");
    }
    n > 0
}

/// `batch` images of standard normal values, the same for a `seed` on every run (the crate's
/// seeded generator), so that a failure of the checks that compare trainings repeats with its
/// data (once, with random images, DDP with SyncBatchNorm on NCCL left the plain model by
/// 0.0028; see docs/BENCHMARKS.md).
fn images(batch: usize, seed: u64, device: &Device) -> Tensor {
    let mut rng = candle_parallel::rng::Rng::new(seed);
    let values: Vec<f32> = (0..batch * 3 * 32 * 32)
        .map(|_| rng.normal() as f32)
        .collect();
    Tensor::from_vec(values, (batch, 3, 32, 32), &Device::Cpu)
        .unwrap()
        .to_device(device)
        .unwrap()
}

#[test]
fn data_parallel_over_two_devices_on_gpu_0_matches_one_device() {
    if !have_gpu() {
        return;
    }
    let d0 = candle_parallel::devices::cuda_device(0).unwrap();
    let d1 = candle_parallel::devices::cuda_device(0).unwrap();
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
    let mut dp_opt = Sgd::new(dp.parameters(), config).unwrap();
    for step in 0..20u32 {
        let x = images(10, 1, &d0); // 5 rows per device
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

/// Model parallel over two devices of GPU 0 (the tutorial's `seq1` on one, `seq2` on the
/// other), plain and pipelined over micro-batches of 3 (4 of them, the last of 1): outputs,
/// then the weights after 20 SGD steps, against the same model on one device. The first stage
/// ends in a large matmul, so that its stream is still busy when the activations are copied.
#[test]
fn model_parallel_over_two_devices_of_gpu_0_matches_one_device() {
    use candle_nn::{linear, Linear};
    use candle_parallel::model_parallel::{ModelParallel, Stage};
    if !have_gpu() {
        return;
    }
    let d0 = candle_parallel::devices::cuda_device(0).unwrap();
    let d1 = candle_parallel::devices::cuda_device(0).unwrap();
    let layers = |varmap: &VarMap, a: &Device, b: &Device| -> [Linear; 3] {
        let vb = |d: &Device| seeded_var_builder(varmap, 5, DType::F32, d);
        [
            linear(3 * 32 * 32, 1024, vb(a).pp("l1")).unwrap(),
            linear(1024, 1024, vb(a).pp("l2")).unwrap(),
            linear(1024, 10, vb(b).pp("l3")).unwrap(),
        ]
    };
    let model = |varmap: &VarMap, a: &Device, b: &Device, split: Option<usize>| {
        let [l1, l2, l3] = layers(varmap, a, b);
        let seq1 = move |x: &Tensor| {
            l2.forward(&l1.forward(&x.flatten_from(1)?)?.relu()?)?
                .relu()
        };
        let m = ModelParallel::new(vec![Stage::new(a, seq1), Stage::new(b, l3)]).unwrap();
        match split {
            Some(s) => m.with_split_size(s).unwrap(),
            None => m,
        }
    };
    for split in [None, Some(3)] {
        let (one_vars, mp_vars) = (VarMap::new(), VarMap::new());
        let one = model(&one_vars, &d0, &d0, None);
        let mp = model(&mp_vars, &d0, &d1, split);
        let mut one_opt = Sgd::new(one_vars.all_vars(), SGD).unwrap();
        let mut mp_opt = Sgd::new(mp_vars.all_vars(), SGD).unwrap();
        for step in 0..20u32 {
            let x = images(10, 2 + u64::from(step), &d0);
            let labels: Vec<u32> = (0..10).map(|i| (i + step) % 10).collect();
            let want = one.forward(&x).unwrap();
            let got = mp.forward(&x).unwrap();
            assert!(got.device().same_device(&d1));
            // Through the host: a copy to the CPU waits for the source's stream.
            let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
            let diff = max_abs_diff(&cpu(&got), &cpu(&want));
            // Micro-batches are products of fewer rows, for which cuBLAS picks other kernels
            // that round apart (on 2026-11-26, 1.5e-5 at step 4, outputs of order 10).
            let limit = if split.is_some() { 1e-5 } else { 1e-6 } * max_abs(&want).max(1.0);
            assert!(
                diff <= limit,
                "split {split:?}, step {step}: outputs differ by {diff} (limit {limit})"
            );
            let y0 = Tensor::from_vec(labels.clone(), 10, &d0).unwrap();
            let y1 = Tensor::from_vec(labels, 10, &d1).unwrap();
            one_opt
                .backward_step(&loss::cross_entropy(&want, &y0).unwrap())
                .unwrap();
            mp_opt
                .backward_step(&loss::cross_entropy(&got, &y1).unwrap())
                .unwrap();
        }
        let one_data = one_vars.data().lock().unwrap().clone();
        for (name, var) in mp_vars.data().lock().unwrap().iter() {
            let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
            let diff = max_abs_diff(&cpu(var.as_tensor()), &cpu(one_data[name].as_tensor()));
            // cuBLAS picks its kernels by the number of rows, so micro-batches round apart.
            assert!(
                diff <= 1e-4,
                "split {split:?}: after 20 steps {name} differs by {diff}"
            );
        }
    }
}

/// `t` through eight chained matmuls: slow on purpose, so that the stream computing it is still
/// busy when a copy is enqueued on another stream. Scaled to keep the values near 1.
fn busy(t: &Tensor) -> Tensor {
    let scale = (t.dim(0).unwrap() as f64).sqrt();
    (0..8).fold(t.clone(), |y, _| (y.matmul(t).unwrap() / scale).unwrap())
}

/// candle's kernels register their output as a read argument, so cudarc's per-buffer events do
/// not order a copy on another stream after the kernel that fills its source; our copies
/// order the two streams themselves (`src/ordered_copy.rs`). Forward and backward, each round
/// computes on device `a`, moves to device `b` at once, and must match the same computation
/// done on `a` alone.
#[test]
fn copies_between_two_devices_of_gpu_0_wait_for_the_kernels_that_fill_them() {
    if !have_gpu() {
        return;
    }
    let a = candle_parallel::devices::cuda_device(0).unwrap();
    let b = candle_parallel::devices::cuda_device(0).unwrap();
    let x0 = Tensor::randn(0f32, 1.0, (1024, 1024), &Device::Cpu).unwrap();
    let w0 = Tensor::randn(0f32, 1.0, (1024, 1024), &Device::Cpu).unwrap();
    for round in 0..10 {
        let x = Var::from_tensor(&x0.to_device(&a).unwrap()).unwrap();
        let y = (busy(x.as_tensor()) + f64::from(round)).unwrap();
        let moved = comm::broadcast(&y, std::slice::from_ref(&b))
            .unwrap()
            .remove(0);
        assert!(moved.device().same_device(&b));
        assert_eq!(
            max_abs_diff(&moved, &y),
            0.0,
            "round {round}: the copy read its source before the kernels that fill it had run"
        );
        // The gradient of `moved` is made on `b` and moved back to `a` by the copy's backward.
        let w = busy(&w0.to_device(&b).unwrap());
        let grads = (moved * w).unwrap().sum_all().unwrap().backward().unwrap();
        let x1 = Var::from_tensor(&x0.to_device(&a).unwrap()).unwrap();
        let y1 = (busy(x1.as_tensor()) + f64::from(round)).unwrap();
        let w1 = busy(&w0.to_device(&a).unwrap());
        let want = (y1 * w1).unwrap().sum_all().unwrap().backward().unwrap();
        let (got, want) = (grads.get(&x).unwrap(), want.get(&x1).unwrap());
        let scale = max_abs(want);
        let diff = max_abs_diff(got, want);
        assert!(
            diff <= 1e-4 * scale,
            "round {round}: the gradient moved back differs by {diff} (scale {scale})"
        );
    }
}

/// The in-process backend hands ranks each other's tensors: with each rank on its own device of
/// GPU 0, what arrives must be what the other rank's kernels computed.
#[test]
fn in_process_ranks_on_two_devices_of_gpu_0_gather_what_the_others_computed() {
    if !have_gpu() {
        return;
    }
    let x0 = Tensor::randn(0f32, 1.0, (512, 512), &Device::Cpu).unwrap();
    let diffs = distributed::spawn_threads(2, |pg| {
        let device = candle_parallel::devices::cuda_device(0)?;
        let rank = pg.rank() as f64;
        let mine = (busy(&x0.to_device(&device)?) + rank)?;
        let all = pg.all_gather(&mine)?;
        let from_root = pg.broadcast(&mine, 0)?;
        // Every rank computed the same `busy(x0)`, offset by its rank.
        let base = (&mine - rank)?;
        let mut worst = max_abs_diff(&from_root, &base);
        for (j, t) in all.iter().enumerate() {
            assert!(t.device().same_device(&device));
            worst = worst.max(max_abs_diff(&(t - j as f64)?, &base));
        }
        Ok(worst)
    })
    .unwrap();
    for (rank, diff) in diffs.iter().enumerate() {
        assert!(
            *diff <= 1e-4,
            "rank {rank}: gathered tensors differ by {diff}"
        );
    }
}

#[test]
fn master_variables_on_another_device_are_refused() {
    if !have_gpu() {
        return;
    }
    let d0 = candle_parallel::devices::cuda_device(0).unwrap();
    let d1 = candle_parallel::devices::cuda_device(0).unwrap();
    let varmap = VarMap::new();
    Net::new(seeded_var_builder(&varmap, 0, DType::F32, &d1)).unwrap();
    let err = DataParallel::new(&varmap, vec![d0, d1], Net::new)
        .err()
        .expect("refused");
    assert!(matches!(err, Error::VariableNotOnDevice { .. }), "{err}");
}

#[cfg(feature = "nccl")]
#[test]
fn nccl_collectives_with_one_rank_return_the_input_on_its_gpu() {
    if !have_gpu() {
        return;
    }
    let device = candle_parallel::devices::cuda_device(0).unwrap();
    let pg = ProcessGroup::new(&solo_rendezvous(), &device, InitConfig::default()).unwrap();
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
    // Collectives, messages and all-to-all. (NCCL's messages need two GPUs: NCCL refuses two
    // ranks on one device.)
    if is_child() {
        let device = candle_parallel::devices::cuda_device(0).unwrap();
        let options = InitConfig {
            backend: Some(Backend::Tcp),
            ..InitConfig::from_env().unwrap()
        };
        let pg = ProcessGroup::new(&Rendezvous::from_env().unwrap(), &device, options).unwrap();
        let x = Tensor::new(&[pg.rank() as f32 + 1.0, 10.0], &Device::Cpu)
            .unwrap()
            .to_device(&device)
            .unwrap();
        let y = pg.all_reduce(&x, ReduceOp::Sum).unwrap();
        assert!(y.device().same_device(&device));
        assert_eq!(y.to_vec1::<f32>().unwrap(), [3.0, 20.0]);
        // Messages of CUDA tensors, a transposed view and integers among them, land on the
        // group's device; so do all-to-all's uneven blocks.
        let peer = 1 - pg.rank();
        let m = Tensor::arange(0f32, 12.0, &device)
            .unwrap()
            .reshape((3, 4))
            .unwrap()
            .affine(1.0, pg.rank() as f64)
            .unwrap();
        let ids = Tensor::new(&[7u32 + pg.rank() as u32, 9], &device).unwrap();
        let got = pg
            .batch_isend_irecv(vec![
                distributed::P2pOp::send(&m.t().unwrap(), peer),
                distributed::P2pOp::send(&ids, peer),
                distributed::P2pOp::recv(peer, (4, 3), DType::F32),
                distributed::P2pOp::recv_as_sent(peer),
            ])
            .unwrap()
            .wait()
            .unwrap();
        let (got_m, got_ids) = (got[2].clone().unwrap(), got[3].clone().unwrap());
        assert!(got_m.device().same_device(&device) && got_ids.device().same_device(&device));
        let want = Tensor::arange(0f32, 12.0, &Device::Cpu)
            .unwrap()
            .reshape((3, 4))
            .unwrap()
            .affine(1.0, peer as f64)
            .unwrap()
            .t()
            .unwrap();
        assert_eq!(
            got_m.to_vec2::<f32>().unwrap(),
            want.to_vec2::<f32>().unwrap()
        );
        assert_eq!(got_ids.to_vec1::<u32>().unwrap(), [7 + peer as u32, 9]);
        let blocks: Vec<Tensor> = (0..2)
            .map(|p| Tensor::ones((pg.rank() + p + 1, 2), DType::F32, &device).unwrap())
            .collect();
        let back = pg.all_to_all(&blocks).unwrap();
        for (r, b) in back.iter().enumerate() {
            assert_eq!(b.dims(), [r + pg.rank() + 1, 2]);
            assert!(b.device().same_device(&device));
        }
        done();
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

/// The variables of `varmap` by name, as f32 tensors on the CPU.
fn snapshot(varmap: &VarMap) -> std::collections::BTreeMap<String, Tensor> {
    varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            let t = v
                .to_dtype(DType::F32)
                .unwrap()
                .to_device(&Device::Cpu)
                .unwrap();
            (k.clone(), t)
        })
        .collect()
}

fn labels(n: usize, step: u32, device: &Device) -> Tensor {
    let v: Vec<u32> = (0..n as u32).map(|i| (i + step) % 10).collect();
    Tensor::from_vec(v, n, device).unwrap()
}

/// SGD steps of `build`'s model on one device over the whole `batches`; its variables.
fn train_plain<M: candle_nn::ModuleT>(
    device: &Device,
    build: fn(candle_nn::VarBuilder) -> candle_core::Result<M>,
    batches: &[Tensor],
) -> std::collections::BTreeMap<String, Tensor> {
    let vars = VarMap::new();
    let model = build(seeded_var_builder(&vars, 9, DType::F32, device)).unwrap();
    let mut opt = Sgd::new(vars.all_vars(), SGD).unwrap();
    for (step, x) in batches.iter().enumerate() {
        let y = labels(x.dim(0).unwrap(), step as u32, device);
        let l = loss::cross_entropy(&model.forward_t(x, true).unwrap(), &y).unwrap();
        opt.backward_step(&l).unwrap();
    }
    snapshot(&vars)
}

/// SGD steps of DDP on `pg` over this rank's share (`per` rows) of each of `batches`; its
/// variables.
fn train_ddp<M: candle_nn::ModuleT>(
    pg: &ProcessGroup,
    device: &Device,
    build: fn(candle_nn::VarBuilder) -> candle_core::Result<M>,
    batches: &[Tensor],
    per: usize,
    sync_batch_norm: bool,
) -> std::collections::BTreeMap<String, Tensor> {
    let vars = VarMap::new();
    build(seeded_var_builder(&vars, 9, DType::F32, device)).unwrap();
    let ddp_config = candle_parallel::DdpConfig {
        sync_batch_norm,
        ..Default::default()
    };
    let ddp =
        candle_parallel::DistributedDataParallel::with_config(&vars, pg, device, ddp_config, build)
            .unwrap();
    let mut opt = Sgd::new(ddp.parameters(), SGD).unwrap();
    for (step, x) in batches.iter().enumerate() {
        let r = pg.rank();
        let x = x.narrow(0, r * per, per).unwrap();
        let y = labels(pg.world_size() * per, step as u32, device)
            .narrow(0, r * per, per)
            .unwrap();
        let l = loss::cross_entropy(&ddp.forward_t(&x, true).unwrap(), &y).unwrap();
        opt.step(&ddp.backward(&l).unwrap()).unwrap();
    }
    snapshot(&vars)
}

fn largest_difference(
    a: &std::collections::BTreeMap<String, Tensor>,
    b: &std::collections::BTreeMap<String, Tensor>,
) -> f32 {
    a.iter()
        .map(|(k, t)| max_abs_diff(t, &b[k]))
        .fold(0.0, f32::max)
}

/// `steps` SGD steps of `build`'s model on one device over the whole batches, and of DDP on
/// `pg` over this rank's share of them (`per` rows); the largest difference of the variables.
fn ddp_against_one_process<M: candle_nn::ModuleT>(
    pg: &ProcessGroup,
    device: &Device,
    build: fn(candle_nn::VarBuilder) -> candle_core::Result<M>,
    per: usize,
    steps: u32,
    sync_batch_norm: bool,
) -> f32 {
    let world = pg.world_size();
    let batches: Vec<Tensor> = (0..steps)
        .map(|s| images(world * per, 100 + u64::from(s), device))
        .collect();
    // Every rank uses rank 0's batches.
    let batches: Vec<Tensor> = batches
        .iter()
        .map(|b| pg.broadcast(b, 0).unwrap())
        .collect();
    let plain = train_plain(device, build, &batches);
    let ddp = train_ddp(pg, device, build, &batches, per, sync_batch_norm);
    largest_difference(&plain, &ddp)
}

/// The GPU trains the same numbers run after run: the plain Net and NetBn, and DDP (with
/// SyncBatchNorm for NetBn) on NCCL with one rank, each twice from the same seed over the
/// same batches. A difference is a race between candle's stream and NCCL's, or a kernel that
/// sums in no fixed order.
#[cfg(feature = "nccl")]
#[test]
fn training_on_the_gpu_repeats_bit_for_bit() {
    if !have_gpu() {
        return;
    }
    let device = candle_parallel::devices::cuda_device(0).unwrap();
    let pg = ProcessGroup::new(&solo_rendezvous(), &device, InitConfig::default()).unwrap();
    let batches: Vec<Tensor> = (0..10).map(|s| images(16, 200 + s, &device)).collect();
    type Run<'a> = Box<dyn Fn() -> std::collections::BTreeMap<String, Tensor> + 'a>;
    let runs: [(&str, Run); 4] = [
        (
            "plain Net",
            Box::new(|| train_plain(&device, Net::new, &batches)),
        ),
        (
            "plain NetBn",
            Box::new(|| train_plain(&device, candle_parallel::cifar::NetBn::new, &batches)),
        ),
        (
            "DDP Net",
            Box::new(|| train_ddp(&pg, &device, Net::new, &batches, 16, false)),
        ),
        (
            "DDP NetBn with SyncBatchNorm",
            Box::new(|| {
                train_ddp(
                    &pg,
                    &device,
                    candle_parallel::cifar::NetBn::new,
                    &batches,
                    16,
                    true,
                )
            }),
        ),
    ];
    let mut differ = Vec::new();
    for (name, run) in &runs {
        let d = largest_difference(&run(), &run());
        eprintln!("{name}: two runs differ by {d}");
        if d != 0.0 {
            differ.push(format!("{name} by {d}"));
        }
    }
    assert!(differ.is_empty(), "runs differ: {}", differ.join(", "));
}

#[cfg(feature = "nccl")]
#[test]
fn nccl_async_collectives_and_a_new_group_with_one_rank_give_exact_numbers() {
    if !have_gpu() {
        return;
    }
    let device = candle_parallel::devices::cuda_device(0).unwrap();
    let pg = ProcessGroup::new(&solo_rendezvous(), &device, InitConfig::default()).unwrap();
    let xs: Vec<Tensor> = [1usize, 1000, 1 << 22]
        .iter()
        .map(|&n| Tensor::randn(0f32, 1.0, n, &device).unwrap())
        .collect();
    let works: Vec<_> = xs
        .iter()
        .map(|x| pg.all_reduce_async(x, ReduceOp::Avg).unwrap())
        .collect();
    // A kernel launched on the compute stream after the calls, while they may be in flight.
    let a = Tensor::randn(0f32, 1.0, (1024, 1024), &device).unwrap();
    let product = a.matmul(&a).unwrap();
    for (x, w) in xs.iter().zip(works).rev() {
        assert_eq!(max_abs_diff(&w.wait().unwrap(), x), 0.0);
    }
    let on_cpu = a.to_device(&Device::Cpu).unwrap();
    let want = on_cpu.matmul(&on_cpu).unwrap();
    assert!(max_abs_diff(&product, &want) < 1e-2);
    // Max with NaN: the mask that carries NaN past NCCL's kernels.
    let nan = Tensor::new(&[1f32, f32::NAN, -0.5], &Device::Cpu)
        .unwrap()
        .to_device(&device)
        .unwrap();
    let m = pg
        .all_reduce(&nan, ReduceOp::Max)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert!(m[0] == 1.0 && m[1].is_nan() && m[2] == -0.5, "{m:?}");
    let sub = pg.new_group(&[0]).unwrap().expect("a member");
    assert_eq!(sub.backend(), Backend::Nccl);
    let y = sub.all_reduce(&xs[1], ReduceOp::Sum).unwrap();
    assert_eq!(max_abs_diff(&y, &xs[1]), 0.0);
}

#[cfg(feature = "nccl")]
#[test]
fn ddp_and_sync_batch_norm_on_nccl_with_one_rank_equal_the_plain_model() {
    if !have_gpu() {
        return;
    }
    let device = candle_parallel::devices::cuda_device(0).unwrap();
    let pg = ProcessGroup::new(&solo_rendezvous(), &device, InitConfig::default()).unwrap();
    let d = ddp_against_one_process(&pg, &device, Net::new, 16, 10, false);
    eprintln!("DDP against the plain Net: {d}");
    assert!(d <= 1e-5, "DDP differs from the plain Net by {d}");
    let d = ddp_against_one_process(
        &pg,
        &device,
        candle_parallel::cifar::NetBn::new,
        16,
        10,
        true,
    );
    eprintln!("DDP with SyncBatchNorm against the plain NetBn: {d}");
    assert!(
        d <= 1e-4,
        "DDP with SyncBatchNorm differs from the plain NetBn by {d}"
    );
}

#[test]
fn ddp_and_sync_batch_norm_over_tcp_with_cuda_tensors_on_two_processes_equal_one_process() {
    if is_child() {
        let device = candle_parallel::devices::cuda_device(0).unwrap();
        let options = InitConfig {
            backend: Some(Backend::Tcp),
            ..InitConfig::from_env().unwrap()
        };
        let pg = ProcessGroup::new(&Rendezvous::from_env().unwrap(), &device, options).unwrap();
        let d = ddp_against_one_process(&pg, &device, Net::new, 8, 10, false);
        assert!(d <= 1e-4, "DDP differs from one process by {d}");
        let d = ddp_against_one_process(
            &pg,
            &device,
            candle_parallel::cifar::NetBn::new,
            8,
            10,
            true,
        );
        assert!(
            d <= 1e-4,
            "DDP with SyncBatchNorm differs from one process by {d}"
        );
        done();
        return;
    }
    if !have_gpu() {
        return;
    }
    Ranks::world(
        "ddp_and_sync_batch_norm_over_tcp_with_cuda_tensors_on_two_processes_equal_one_process",
        2,
    )
    .assert_all_pass(Duration::from_secs(300));
}

#[test]
fn the_nets_loss_and_gradients_on_the_gpu_equal_those_of_our_cpu_kernels() {
    if !have_gpu() {
        return;
    }
    // On CUDA the convolutions are candle's and the max-pool candle's ops composed for a
    // right gradient; on the CPU both are our kernels. The same Net must train the same.
    let gpu = Device::new_cuda(0).unwrap();
    let x = images(16, 3, &Device::Cpu);
    let run = |device: &Device| {
        let varmap = VarMap::new();
        let net = Net::new(seeded_var_builder(&varmap, 3, DType::F32, device)).unwrap();
        let logits = net.forward(&x.to_device(device).unwrap()).unwrap();
        let loss = loss::cross_entropy(&logits, &labels(16, 0, device)).unwrap();
        let grads = loss.backward().unwrap();
        let mut by_name: Vec<(String, Tensor)> = varmap
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), grads.get(v).expect(k).clone()))
            .collect();
        by_name.sort_by(|a, b| a.0.cmp(&b.0));
        (loss, by_name)
    };
    let (cpu_loss, cpu_grads) = run(&Device::Cpu);
    let (gpu_loss, gpu_grads) = run(&gpu);
    assert!(max_abs_diff(&cpu_loss, &gpu_loss) <= 1e-4);
    assert_eq!(cpu_grads.len(), 10);
    for ((name, c), (_, g)) in cpu_grads.iter().zip(&gpu_grads) {
        let scale = max_abs(c);
        let d = max_abs_diff(c, g);
        assert!(
            d <= 1e-4 * scale.max(1.0),
            "{name}: the GPU's gradient is off by {d}"
        );
    }
}

/// Our CUDA kernels for the Net's convolution block and for max-pooling (`nn/conv_cuda.rs`)
/// against our CPU kernels and against candle's ops composed on the GPU
/// (`use_own_cuda_kernels(false)`): the output, and the gradient of `sum(y * g)` for the input
/// (where it needs one), the weight and the bias. The Net's two blocks, padding, stride,
/// dilation, outputs whose last row and column no window covers, and small integers, whose
/// ties must go to the same (first) position.
#[test]
fn our_cuda_conv_block_and_max_pool_equal_the_cpu_kernels_and_candles_ops() {
    use candle_nn::Conv2dConfig;
    use candle_parallel::nn::{max_pool2d, use_own_cuda_kernels, Conv2d};
    if !have_gpu() {
        return;
    }
    let gpu = candle_parallel::devices::cuda_device(0).unwrap();
    let mut rng = candle_parallel::rng::Rng::new(11);
    let mut values = |shape: &[usize], integers: bool| {
        let n = shape.iter().product::<usize>();
        let v: Vec<f32> = (0..n)
            .map(|_| match integers {
                true => (rng.normal() * 2.0).round() as f32,
                false => rng.normal() as f32,
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    };
    let cfg = |padding, stride, dilation| Conv2dConfig {
        padding,
        stride,
        dilation,
        groups: 1,
        cudnn_fwd_algo: None,
    };
    // (name, input, weight, config, pool, the input needs a gradient, integers)
    let cases = [
        (
            "the Net's first block",
            [5, 3, 32, 32],
            [6, 3, 5, 5],
            cfg(0, 1, 1),
            2,
            false,
            false,
        ),
        (
            "the Net's second block",
            [5, 6, 14, 14],
            [16, 6, 5, 5],
            cfg(0, 1, 1),
            2,
            true,
            false,
        ),
        (
            "padding 1, stride 2",
            [3, 2, 11, 9],
            [4, 2, 3, 2],
            cfg(1, 2, 1),
            2,
            true,
            false,
        ),
        (
            "dilation 2, pool 3",
            [2, 3, 13, 12],
            [5, 3, 3, 3],
            cfg(0, 1, 2),
            3,
            true,
            false,
        ),
        (
            "small integers (ties)",
            [4, 2, 9, 8],
            [3, 2, 2, 2],
            cfg(0, 1, 1),
            2,
            true,
            true,
        ),
    ];
    // Output and gradients (input's if wanted, weight's, bias's) on `device`.
    let block = |x: &Tensor,
                 w: &Tensor,
                 b: &Tensor,
                 g: &Tensor,
                 c: &Conv2dConfig,
                 k,
                 dx,
                 device: &Device|
     -> candle_core::Result<Vec<Tensor>> {
        let to = |t: &Tensor| Var::from_tensor(&t.to_device(device)?);
        let (x, w, b) = (to(x)?, to(w)?, to(b)?);
        let conv = Conv2d::new(w.as_tensor().clone(), Some(b.as_tensor().clone()), *c);
        let input = if dx {
            x.as_tensor().clone()
        } else {
            x.as_tensor().detach()
        };
        let y = conv.forward_relu_max_pool2d(&input, k)?;
        let grads = (&y * g.to_device(device)?)?.sum_all()?.backward()?;
        let mut out = vec![y];
        if dx {
            out.push(grads.get(&x).expect("the input's gradient").clone());
        }
        out.push(grads.get(&w).expect("the weight's gradient").clone());
        out.push(grads.get(&b).expect("the bias's gradient").clone());
        Ok(out)
    };
    let compare = |name: &str, what: &str, ours: &[Tensor], theirs: &[Tensor]| {
        assert_eq!(ours.len(), theirs.len());
        for (i, (o, t)) in ours.iter().zip(theirs).enumerate() {
            assert_eq!(o.dims(), t.dims(), "{name}, {what}, result {i}");
            let d = max_abs_diff(o, t);
            let limit = 1e-4 * max_abs(t).max(1.0);
            assert!(
                d <= limit,
                "{name}: result {i} is {d} off {what} (limit {limit})"
            );
        }
    };
    for (name, xs, ws, c, k, dx, integers) in cases {
        let (x, w, b) = (
            values(&xs, integers),
            values(&ws, integers),
            values(&ws[..1], integers),
        );
        let probe = Conv2d::new(w.clone(), Some(b.clone()), c);
        let dims = probe
            .forward_relu_max_pool2d(&x, k)
            .unwrap()
            .dims()
            .to_vec();
        let g = values(&dims, integers);
        let ours = block(&x, &w, &b, &g, &c, k, dx, &gpu).unwrap();
        let cpu = block(&x, &w, &b, &g, &c, k, dx, &Device::Cpu).unwrap();
        compare(name, "our CPU kernels'", &ours, &cpu);
        use_own_cuda_kernels(false);
        let composed = block(&x, &w, &b, &g, &c, k, dx, &gpu);
        use_own_cuda_kernels(true);
        match composed {
            // Ties: candle's composed max-pool sends the gradient to the position its CUDA
            // `argmax` picks, not always the first (2026-11-26: the input gradient 4 off);
            // ours picks the first, as the CPU kernels and PyTorch, and equals them above.
            Ok(_) if integers => {
                eprintln!("{name}: ours on the GPU equal the CPU kernels (ties: not candle's)")
            }
            Ok(composed) => {
                compare(name, "candle's ops on the GPU", &ours, &composed);
                eprintln!("{name}: ours on the GPU equal the CPU kernels and candle's ops");
            }
            // candle 0.11's convolution backward pads the input gradient by what the height
            // needs and applies it to the width too (2026-11-26: "shape mismatch in add, lhs:
            // [3, 2, 11, 9], rhs: [3, 2, 11, 8]" for padding 1, stride 2): ours has no such
            // limit; it must equal the CPU kernels there, which it did above.
            Err(e) => {
                eprintln!("{name}: ours on the GPU equal the CPU kernels; candle's ops fail: {e}")
            }
        }
    }
    // max_pool2d alone, small integers (ties) and an odd size, with a NaN in one window.
    let mut x = values(&[3, 4, 9, 7], true);
    let mut v = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    v[10] = f32::NAN;
    x = Tensor::from_vec(v, x.shape(), &Device::Cpu).unwrap();
    let g = values(&[3, 4, 4, 3], true);
    let pool = |device: &Device| {
        let x = Var::from_tensor(&x.to_device(device).unwrap()).unwrap();
        let y = max_pool2d(x.as_tensor(), 2).unwrap();
        let loss = (&y * g.to_device(device).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        let dx = loss.backward().unwrap().get(&x).unwrap().clone();
        // NaN is not equal to itself: compare where it is, then the rest.
        let y = y.to_device(&Device::Cpu).unwrap().flatten_all().unwrap();
        let nan = y
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.is_nan())
            .collect::<Vec<_>>();
        let y = y
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| if v.is_nan() { 0. } else { *v })
            .collect::<Vec<_>>();
        (nan, Tensor::new(y, &Device::Cpu).unwrap(), dx)
    };
    let (nan_gpu, y_gpu, dx_gpu) = pool(&gpu);
    let (nan_cpu, y_cpu, dx_cpu) = pool(&Device::Cpu);
    assert_eq!(
        nan_gpu, nan_cpu,
        "max_pool2d: the NaN must win its window on both"
    );
    assert!(nan_gpu.iter().any(|&n| n));
    compare(
        "max_pool2d",
        "our CPU kernel's",
        &[y_gpu, dx_gpu],
        &[y_cpu, dx_cpu],
    );
}

/// The optimizers' CUDA kernels for f32 (`optim/cuda.rs`) against the tensor ops on the GPU
/// (`use_own_cuda_kernels(false)`) and the CPU kernels: three steps of Sgd (with and without
/// momentum, dampening, Nesterov, weight decay, maximize) and of AdamW (weight decay, AMSGrad,
/// maximize, both branches of its `lerp`), over a parameter of odd size and a matrix, each
/// step's gradient new. Their arithmetic is the same op for op, so they should agree bit for
/// bit (said per case); the test asserts 1e-6 of the largest value.
#[test]
fn the_optimizers_cuda_kernels_give_the_tensor_ops_and_the_cpu_kernels_numbers() {
    use candle_parallel::nn::use_own_cuda_kernels;
    use candle_parallel::optim::{AdamW, AdamWConfig};
    if !have_gpu() {
        return;
    }
    let gpu = candle_parallel::devices::cuda_device(0).unwrap();
    let start = [
        Tensor::randn(0f32, 1., 1001, &Device::Cpu).unwrap(),
        Tensor::randn(0f32, 1., (37, 61), &Device::Cpu).unwrap(),
    ];
    let grads: Vec<Vec<Tensor>> = (0..3)
        .map(|_| {
            start
                .iter()
                .map(|t| t.randn_like(0., 1.).unwrap())
                .collect()
        })
        .collect();
    type Stepper = Box<dyn FnMut(&candle_core::backprop::GradStore) -> candle_core::Result<()>>;
    type Make = Box<dyn Fn(Vec<Var>) -> Stepper>;
    fn stepper<O: Optimizer + 'static>(mut o: O) -> Stepper {
        Box::new(move |grads| o.step(grads))
    }
    let sgd = |c: SgdConfig| -> (String, Make) {
        let make: Make = Box::new(move |vars| stepper(Sgd::new(vars, c).unwrap()));
        (format!("{c:?}"), make)
    };
    let adamw = |c: AdamWConfig| -> (String, Make) {
        let make: Make = Box::new(move |vars| stepper(AdamW::new(vars, c).unwrap()));
        (format!("{c:?}"), make)
    };
    let cases = [
        sgd(SgdConfig {
            lr: 0.1,
            ..SgdConfig::default()
        }),
        sgd(SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            ..SgdConfig::default()
        }),
        sgd(SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.3,
            weight_decay: 0.01,
            ..SgdConfig::default()
        }),
        sgd(SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            nesterov: true,
            weight_decay: 0.1,
            maximize: true,
            ..SgdConfig::default()
        }),
        adamw(AdamWConfig {
            lr: 0.01,
            ..AdamWConfig::default()
        }),
        adamw(AdamWConfig {
            lr: 0.01,
            weight_decay: 0.1,
            amsgrad: true,
            ..AdamWConfig::default()
        }),
        adamw(AdamWConfig {
            lr: 0.01,
            betas: (0.3, 0.5),
            maximize: true,
            eps: 1e-3,
            ..AdamWConfig::default()
        }),
    ];
    let train = |device: &Device, make: &Make| -> Vec<Vec<f32>> {
        let vars: Vec<Var> = start
            .iter()
            .map(|t| Var::from_tensor(&t.to_device(device).unwrap()).unwrap())
            .collect();
        let mut step_with = make(vars.clone());
        for step in &grads {
            let loss = vars
                .iter()
                .zip(step)
                .map(|(v, g)| {
                    (v.as_tensor() * g.to_device(device).unwrap())
                        .unwrap()
                        .sum_all()
                        .unwrap()
                })
                .reduce(|a, b| (a + b).unwrap())
                .unwrap();
            step_with(&loss.backward().unwrap()).unwrap();
        }
        vars.iter()
            .map(|v| {
                v.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            })
            .collect()
    };
    let off = |a: &[Vec<f32>], b: &[Vec<f32>]| {
        a.iter()
            .flatten()
            .zip(b.iter().flatten())
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    for (name, make) in &cases {
        let kernel = train(&gpu, make);
        use_own_cuda_kernels(false);
        let ops = train(&gpu, make);
        use_own_cuda_kernels(true);
        let cpu = train(&Device::Cpu, make);
        let scale = kernel.iter().flatten().fold(1f32, |m, x| m.max(x.abs()));
        for (what, other) in [
            ("the tensor ops on the GPU", &ops),
            ("the CPU kernel", &cpu),
        ] {
            let d = off(&kernel, other);
            eprintln!(
                "{name}: the CUDA kernel is {d:e} off {what}{}",
                if d == 0.0 { " (bit for bit)" } else { "" }
            );
            assert!(
                d <= 1e-6 * scale,
                "{name}: the CUDA kernel is {d} off {what}"
            );
        }
    }
}

/// The fused layers on the GPU (our CUDA kernels for the normalisations and softmax, candle's
/// for rope, and the backwards of candle ops) against our CPU kernels: the output and every
/// input's gradient of `sum(layer(x) * g)`, in f32, f64, f16 and bf16 (rope in f32 and bf16),
/// on ordinary inputs and on the adversarial ones (rows of mean 1e3 and spread 0.1, of 4096
/// values and more, no rows); and rope's forward equal to candle-nn's on the GPU bit for bit.
#[test]
fn the_fused_layers_on_the_gpu_equal_their_cpu_kernels() {
    use candle_parallel::nn::{ops, rotary_emb};
    if !have_gpu() {
        return;
    }
    let gpu = candle_parallel::devices::cuda_device(0).unwrap();
    type Layer = fn(&[Tensor]) -> candle_core::Result<Tensor>;
    let angles = Tensor::randn(0f32, 1., (9, 4), &Device::Cpu).unwrap();
    let table = [angles.cos().unwrap(), angles.sin().unwrap()];
    let randn = |shape: &[usize]| Tensor::randn(0f32, 1., shape, &Device::Cpu).unwrap();
    let around = |shape: &[usize], mean: f64| ((randn(shape) * 0.1).unwrap() + mean).unwrap();
    let layer_norm: Layer = |t| ops::layer_norm(&t[0], &t[1], &t[2], 1e-5);
    let rms_norm: Layer = |t| ops::rms_norm(&t[0], &t[1], 1e-5);
    let softmax: Layer = |t| ops::softmax_last_dim(&t[0]);
    // (name, inputs, ours, candle-nn's forward where it must equal ours)
    let mut cases: Vec<(&str, Vec<Tensor>, Layer, Option<Layer>)> = vec![
        (
            "layer_norm",
            vec![randn(&[6, 37]), randn(&[37]), randn(&[37])],
            layer_norm,
            None,
        ),
        (
            "layer_norm, 1536 wide",
            vec![randn(&[3, 1536]), randn(&[1536]), randn(&[1536])],
            layer_norm,
            None,
        ),
        (
            "layer_norm, mean 1e3 and spread 0.1, 4096 wide",
            vec![around(&[4, 4096], 1e3), randn(&[4096]), randn(&[4096])],
            layer_norm,
            None,
        ),
        (
            "layer_norm, no rows",
            vec![randn(&[0, 16]), randn(&[16]), randn(&[16])],
            layer_norm,
            None,
        ),
        (
            "rms_norm",
            vec![randn(&[6, 37]), randn(&[37])],
            rms_norm,
            None,
        ),
        (
            "rms_norm, mean 1e3, 4096 wide",
            vec![around(&[4, 4096], 1e3), randn(&[4096])],
            rms_norm,
            None,
        ),
        ("softmax_last_dim", vec![randn(&[5, 3, 70])], softmax, None),
        (
            "softmax_last_dim, zeros 4096 wide",
            vec![Tensor::zeros((2, 4096), DType::F32, &Device::Cpu).unwrap()],
            softmax,
            None,
        ),
        (
            "softmax_last_dim, 16384 wide",
            vec![(randn(&[2, 16384]) * 3.0).unwrap()],
            softmax,
            None,
        ),
    ];
    let rope: [(&str, Layer, Layer); 3] = [
        (
            "rope",
            |t| rotary_emb::rope(&t[0], &t[1], &t[2]),
            |t| candle_nn::rotary_emb::rope(&t[0], &t[1], &t[2]),
        ),
        (
            "rope_i",
            |t| rotary_emb::rope_i(&t[0], &t[1], &t[2]),
            |t| candle_nn::rotary_emb::rope_i(&t[0], &t[1], &t[2]),
        ),
        (
            "rope_thd",
            |t| rotary_emb::rope_thd(&t[0], &t[1], &t[2]),
            |t| candle_nn::rotary_emb::rope_thd(&t[0], &t[1], &t[2]),
        ),
    ];
    for (name, ours, candle) in rope {
        let x = if name == "rope_thd" {
            randn(&[2, 9, 3, 8])
        } else {
            randn(&[2, 3, 9, 8])
        };
        cases.push((
            name,
            vec![x, table[0].clone(), table[1].clone()],
            ours,
            Some(candle),
        ));
    }
    for (name, inputs, ours, candle) in cases {
        let dtypes: &[(DType, f32)] = if candle.is_some() {
            &[(DType::F32, 1e-5), (DType::BF16, 2e-2)]
        } else {
            &[
                (DType::F32, 1e-5),
                (DType::F64, 1e-9),
                (DType::F16, 4e-3),
                (DType::BF16, 2e-2),
            ]
        };
        for &(dtype, tol) in dtypes {
            let run = |dev: &Device| {
                let vars: Vec<Var> = inputs
                    .iter()
                    .map(|t| Var::from_tensor(&t.to_dtype(dtype).unwrap().to_device(dev).unwrap()))
                    .collect::<candle_core::Result<_>>()
                    .unwrap();
                let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
                let y = ours(&ts).unwrap();
                if dev.is_cuda() && y.elem_count() == 0 {
                    // candle's CUDA kernels cannot launch over no elements (a grid of 0
                    // blocks is CUDA_ERROR_INVALID_VALUE: ones_like, mul and casts all fail,
                    // as the GPU sitting of 2026-11-26 saw), so no loss can be built on an
                    // empty tensor there: ours must give the empty output, and that is all.
                    return (vec![y.to_device(&Device::Cpu).unwrap()], None);
                }
                let g = Tensor::ones_like(&y).unwrap().cumsum(y.rank() - 1).unwrap();
                let g = (g / 50.).unwrap().sin().unwrap();
                let grads = (&y * g).unwrap().sum_all().unwrap().backward().unwrap();
                let host = |t: &Tensor| {
                    t.to_dtype(DType::F64)
                        .unwrap()
                        .to_device(&Device::Cpu)
                        .unwrap()
                };
                let mut out = vec![host(&y)];
                for v in &vars {
                    let grad = grads
                        .get(v)
                        .unwrap_or_else(|| panic!("{name}: no gradient"));
                    out.push(host(grad));
                }
                let fused = candle.map(|c| host(&c(&ts).unwrap()));
                (out, fused)
            };
            let (cpu, _) = run(&Device::Cpu);
            let (cuda, candle_fused) = run(&gpu);
            if cuda.len() == 1 {
                assert_eq!(
                    cuda[0].dims(),
                    cpu[0].dims(),
                    "{name} {dtype:?}: the output"
                );
                continue;
            }
            if let Some(fused) = candle_fused {
                assert_eq!(
                    max_abs_diff(&cuda[0], &fused),
                    0.0,
                    "{name} {dtype:?}: our CUDA forward is candle-nn's"
                );
            }
            for (i, (a, b)) in cuda.iter().zip(&cpu).enumerate() {
                assert_eq!(a.dims(), b.dims(), "{name} {dtype:?}: result {i}");
                if b.elem_count() == 0 {
                    continue;
                }
                let diff = common::as_f64(&(a - b).unwrap().abs().unwrap())
                    .into_iter()
                    .fold(0.0, f64::max);
                let size = common::as_f64(&b.abs().unwrap())
                    .into_iter()
                    .fold(0.0, f64::max);
                assert!(
                    diff <= tol as f64 * size.max(1.0),
                    "{name} {dtype:?}: result {i} (0 the output, then each input's gradient) \
                     differs by {diff} on the GPU (largest {size})"
                );
            }
        }
    }
}

/// The distributed checkpoint with the state on the GPU: a ZeRO-2 DDP of the Net on NCCL (one
/// rank) saved synchronously and asynchronously (the commit then waits for `wait`, as the
/// collectives run on the GPU), loaded back onto the GPU by a fresh model and by one process on
/// the CPU: the same numbers.
#[test]
fn the_distributed_checkpoint_saves_gpu_state_and_loads_it_on_gpu_and_cpu() {
    use candle_parallel::checkpoint::distributed::{self as dcp, Checkpointer};
    use candle_parallel::checkpoint::LoadOptions;
    if !have_gpu() {
        return;
    }
    let device = candle_parallel::devices::cuda_device(0).unwrap();
    let pg = ProcessGroup::new(&solo_rendezvous(), &device, InitConfig::default()).unwrap();
    let dir = common::temp_dir("gpu-dcp");
    let build = |seed| {
        let vars = VarMap::new();
        Net::new(seeded_var_builder(&vars, seed, DType::F32, &device)).unwrap();
        let config = candle_parallel::DdpConfig {
            sharding: candle_parallel::ddp::Sharding::Zero2,
            ..Default::default()
        };
        let ddp = candle_parallel::DistributedDataParallel::with_config(
            &vars,
            &pg,
            &device,
            config,
            Net::new,
        )
        .unwrap();
        let opt = Sgd::new(ddp.parameters(), SGD).unwrap();
        (vars, ddp, opt)
    };
    let (vars, ddp, mut opt) = build(9);
    let x = images(8, 1, &device);
    let y = labels(8, 0, &device);
    let l = loss::cross_entropy(&ddp.forward_t(&x, true).unwrap(), &y).unwrap();
    opt.step(&ddp.backward(&l).unwrap()).unwrap();
    ddp.gather_parameters().unwrap();
    let saved = snapshot(&vars);
    for asynchronous in [false, true] {
        let mut c = Checkpointer::for_group(dir.join(format!("{asynchronous}")), &pg, &device);
        let state = ddp.state_dict(&opt).unwrap();
        match asynchronous {
            true => c.save_async(&state).unwrap(),
            false => c.save(&state).unwrap(),
        }
        c.wait().unwrap();
        let (back, again, mut again_opt) = build(3);
        again
            .load_state_dict(&mut again_opt, &c, LoadOptions::default())
            .unwrap();
        again.gather_parameters().unwrap();
        assert_eq!(largest_difference(&snapshot(&back), &saved), 0.0);
        let one = VarMap::new();
        Net::new(seeded_var_builder(&one, 5, DType::F32, &Device::Cpu)).unwrap();
        let mut one_opt = Sgd::new(one.all_vars(), SGD).unwrap();
        let c = Checkpointer::new(c.dir());
        dcp::load_training_state(&c, &one, &mut one_opt, LoadOptions::default()).unwrap();
        assert_eq!(largest_difference(&snapshot(&one), &saved), 0.0);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
