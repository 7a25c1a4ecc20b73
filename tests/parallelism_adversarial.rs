//! Point-to-point messages, all-to-all, device meshes, in-process model parallel and pipeline
//! parallel used as a careless user would: odd shapes, messages of a group and of its parent
//! interleaved, sends never waited for, meshes with a dimension of one, groups used from two
//! threads at once, short batches, stages that change dtype or panic, evaluation between
//! steps. Every probe runs on thread ranks with a bounded wait: a hang fails as a timeout.

mod common;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, loss, Linear, Optimizer, VarMap};
use candle_parallel::distributed::{self, DeviceMesh, InitConfig, ProcessGroup, ReduceOp};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::model_parallel::{ModelParallel, Stage};
use candle_parallel::pipeline::{PipelineSchedule, PipelineStage, Schedule};
use candle_parallel::Error;
use common::p2p::message;
use std::time::Duration;

/// Thread ranks whose every wait gives up after 20 s: a probe that would hang fails instead.
fn bounded() -> InitConfig {
    InitConfig {
        timeout: Duration::from_secs(20),
        ..InitConfig::default()
    }
}

fn spawn<T: Send>(
    n: usize,
    f: impl Fn(ProcessGroup) -> candle_parallel::Result<T> + Sync,
) -> candle_parallel::Result<Vec<T>> {
    distributed::spawn_threads_with_config(n, bounded(), f)
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1()
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Point-to-point and all-to-all

#[test]
fn all_to_all_single_with_zero_rows_everywhere_gives_zero_rows() {
    let shapes = spawn(3, |pg| {
        let t = Tensor::zeros((0, 5), DType::F32, &Device::Cpu)?;
        let got = pg.all_to_all_single(&t, &[0, 0, 0], &[0, 0, 0])?;
        // The group still lines up afterwards.
        let x = Tensor::new(&[1f32], &Device::Cpu)?;
        let sum = pg.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?[0];
        Ok((got.dims().to_vec(), sum))
    })
    .unwrap();
    assert_eq!(shapes, vec![(vec![0, 5], 3.0); 3]);
}

#[test]
fn all_to_all_single_of_a_transposed_view_sends_the_views_rows() {
    let got = spawn(2, |pg| {
        let me = pg.rank();
        // A [3, 2] view of a [2, 3] tensor: rows 0..1 to rank 0, rows 1..3 to rank 1.
        let t = message(me, 0, &[2, 3], DType::F32).t()?;
        let out = pg.all_to_all_single(&t, &[1, 2], &[[1, 1], [2, 2]][me])?;
        Ok((f32s(&t), f32s(&out)))
    })
    .unwrap();
    let (sent0, sent1) = (&got[0].0, &got[1].0);
    assert_eq!(got[0].1, [&sent0[..2], &sent1[..2]].concat());
    assert_eq!(got[1].1, [&sent0[2..], &sent1[2..]].concat());
}

#[test]
fn all_to_all_single_of_a_scalar_or_wrong_splits_is_refused_on_the_caller() {
    spawn(2, |pg| {
        let scalar = Tensor::new(1f32, &Device::Cpu)?;
        let err = pg.all_to_all_single(&scalar, &[0, 0], &[0, 0]).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        let t = Tensor::zeros((3, 2), DType::F32, &Device::Cpu)?;
        let err = pg.all_to_all_single(&t, &[1, 1], &[1, 1]).unwrap_err();
        assert!(err.to_string().contains("add up to 2 rows"), "{err}");
        // Nothing was issued: the next collective lines up.
        pg.barrier()?;
        Ok(())
    })
    .unwrap();
}

#[test]
fn all_to_all_whose_ranks_disagree_on_the_dtype_fails_on_every_rank_without_a_hang() {
    let results = spawn(2, |pg| {
        let dtype = [DType::F32, DType::F16][pg.rank()];
        let inputs = vec![message(pg.rank(), 0, &[2], dtype); 2];
        Ok(pg
            .all_to_all(&inputs)
            .map(|_| ())
            .err()
            .map(|e| e.to_string()))
    })
    .unwrap();
    for (rank, e) in results.iter().enumerate() {
        let e = e
            .as_ref()
            .unwrap_or_else(|| panic!("rank {rank} took another dtype"));
        assert!(e.contains("f16") && e.contains("f32"), "rank {rank}: {e}");
    }
}

#[test]
fn messages_of_a_subgroup_and_of_its_parent_interleave_without_mixing() {
    spawn(3, |pg| {
        // Ranks 2 and 0 make a pair whose rank 0 is world rank 2.
        let pair = pg.new_group(&[2, 0])?;
        match pg.rank() {
            0 => {
                let pair = pair.expect("rank 0 is in the pair");
                pg.send(&message(0, 1, &[3], DType::F32), 2)?;
                pair.send(&message(0, 2, &[4], DType::I64), 0)?;
                pg.send(&message(0, 3, &[5], DType::F32), 2)?;
                pair.send(&message(0, 4, &[6], DType::BF16), 0)?;
            }
            2 => {
                let pair = pair.expect("rank 2 is in the pair");
                // Received in another order than sent: the pair's first, the world's last.
                let b = pair.recv(1, 4, DType::I64)?;
                let d = pair.recv_as_sent(1)?;
                let c_then_a = [pg.recv_as_sent(0)?, pg.recv_as_sent(0)?];
                assert_eq!(f32s(&b), f32s(&message(0, 2, &[4], DType::I64)));
                assert_eq!(f32s(&d), f32s(&message(0, 4, &[6], DType::BF16)));
                assert_eq!(d.dtype(), DType::BF16);
                assert_eq!(f32s(&c_then_a[0]), f32s(&message(0, 1, &[3], DType::F32)));
                assert_eq!(f32s(&c_then_a[1]), f32s(&message(0, 3, &[5], DType::F32)));
            }
            _ => assert!(pair.is_none()),
        }
        pg.barrier()?;
        Ok(())
    })
    .unwrap();
}

#[test]
fn sends_dropped_without_waiting_still_arrive_in_order() {
    spawn(3, |pg| {
        match pg.rank() {
            r @ (0 | 1) => {
                for k in 0..5 {
                    drop(pg.send_async(&message(r, k, &[k + 1], DType::F32), 2)?);
                }
            }
            _ => {
                // From rank 1 first, though rank 0's messages may be there before.
                let receives: Vec<_> = (0..5)
                    .map(|_| pg.recv_as_sent_async(1))
                    .collect::<candle_parallel::Result<_>>()?;
                for (k, w) in receives.into_iter().enumerate() {
                    assert_eq!(f32s(&w.wait()?), f32s(&message(1, k, &[k + 1], DType::F32)));
                }
                for k in 0..5 {
                    let got = pg.recv(0, k + 1, DType::F32)?;
                    assert_eq!(f32s(&got), f32s(&message(0, k, &[k + 1], DType::F32)));
                }
            }
        }
        pg.barrier()?;
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_receive_nobody_sends_ends_with_a_typed_error_within_the_timeout() {
    let config = InitConfig {
        timeout: Duration::from_secs(2),
        ..InitConfig::default()
    };
    let results = distributed::spawn_threads_with_config(2, config, |pg| {
        if pg.rank() == 1 {
            let err = pg.recv(0, 3, DType::F32).unwrap_err();
            assert!(matches!(err, Error::Timeout { .. }), "{err}");
            let text = err.to_string();
            assert!(text.contains("rank 0") || text.contains("recv"), "{text}");
        } else {
            // Alive but sending nothing, for longer than the timeout.
            std::thread::sleep(Duration::from_secs(4));
        }
        Ok::<_, Error>(())
    });
    results.unwrap();
}

#[test]
fn a_dtype_that_cannot_travel_is_refused_before_anything_is_issued() {
    spawn(2, |pg| {
        let x = Tensor::zeros(4, DType::F8E4M3, &Device::Cpu)?;
        let peer = 1 - pg.rank();
        let err = pg.send(&x, peer).unwrap_err();
        assert!(err.to_string().contains("f8e4m3"), "{err}");
        let err = pg.recv(peer, 4, DType::F8E4M3).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        pg.barrier()?;
        Ok(())
    })
    .unwrap();
}

// ---------------------------------------------------------------------------------------------
// Device meshes

#[test]
fn a_mesh_with_a_dimension_of_one_and_a_one_dimensional_mesh_work() {
    let got = spawn(2, |pg| {
        let mesh = DeviceMesh::new(&pg, &[("dp", 1), ("pp", 2)])?;
        let x = Tensor::new(&[pg.rank() as f32 + 1.], &Device::Cpu)?;
        let dp = mesh.get_group("dp")?;
        assert_eq!(dp.world_size(), 1);
        let alone = dp.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?[0];
        let pp = mesh.get_group("pp")?;
        let both = pp.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?[0];
        // Messages along "pp".
        let other = pp.rank() ^ 1;
        let back = pp
            .batch_isend_irecv(vec![
                candle_parallel::distributed::P2pOp::send(&x, other),
                candle_parallel::distributed::P2pOp::recv(other, 1, DType::F32),
            ])?
            .wait()?
            .remove(1)
            .expect("a receive");
        let line = DeviceMesh::new(&pg, &[("dp", 2)])?;
        let flat = line.flatten(&["dp"])?;
        let third = flat.all_reduce(&x, ReduceOp::Max)?.to_vec1::<f32>()?[0];
        Ok((alone, both, back.to_vec1::<f32>()?[0], third))
    })
    .unwrap();
    assert_eq!(got, [(1., 3., 2., 2.), (2., 3., 1., 2.)]);
}

#[test]
fn two_meshes_on_one_world_keep_their_groups_apart() {
    let got = spawn(4, |pg| {
        let a = DeviceMesh::new(&pg, &[("dp", 2), ("tp", 2)])?;
        let b = DeviceMesh::new(&pg, &[("x", 4), ("y", 1)])?;
        let x = Tensor::new(&[pg.rank() as f32], &Device::Cpu)?;
        // Interleave the meshes' collectives.
        let s1 = a.get_group("tp")?.all_reduce(&x, ReduceOp::Sum)?;
        let s2 = b.get_group("x")?.all_reduce(&x, ReduceOp::Sum)?;
        let s3 = a.get_group("dp")?.all_reduce(&x, ReduceOp::Sum)?;
        let s4 = b.get_group("y")?.all_reduce(&x, ReduceOp::Sum)?;
        Ok([s1, s2, s3, s4].map(|t| t.to_vec1::<f32>().unwrap()[0]))
    })
    .unwrap();
    assert_eq!(
        got,
        [
            [1., 6., 2., 0.],
            [1., 6., 4., 1.],
            [5., 6., 2., 2.],
            [5., 6., 4., 3.]
        ]
    );
}

#[test]
fn a_meshs_groups_used_from_two_threads_at_once_do_not_block_each_other() {
    let got = spawn(4, |pg| {
        let mesh = DeviceMesh::new(&pg, &[("dp", 2), ("pp", 2)])?;
        let x = Tensor::new(&[pg.rank() as f32], &Device::Cpu)?;
        let along = |name: &str| -> candle_parallel::Result<f32> {
            let g = mesh.get_group(name)?;
            let mut last = 0.;
            for _ in 0..20 {
                last = g.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?[0];
            }
            Ok(last)
        };
        std::thread::scope(|s| {
            let dp = s.spawn(|| along("dp"));
            let pp = along("pp")?;
            Ok((dp.join().expect("the dp thread")?, pp))
        })
    })
    .unwrap();
    assert_eq!(got, [(2., 1.), (4., 1.), (2., 5.), (4., 5.)]);
}

#[test]
fn ranks_that_build_different_meshes_fail_without_a_hang() {
    let results = spawn(4, |pg| {
        let dims: &[(&str, usize)] = match pg.rank() {
            0 => &[("dp", 2), ("tp", 2)],
            _ => &[("dp", 4), ("tp", 1)],
        };
        Ok(DeviceMesh::new(&pg, dims).err().map(|e| e.to_string()))
    });
    // Every rank learns of the disagreement at the first group made, never a hang.
    for (r, e) in results.unwrap().iter().enumerate() {
        let e = e
            .as_ref()
            .unwrap_or_else(|| panic!("rank {r} built a mesh"));
        assert!(
            e.contains("mismatch") && e.contains("new_group"),
            "rank {r}: {e}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Model parallel in one process

fn two_layers(varmap: &VarMap) -> (Linear, Linear) {
    let vb = seeded_var_builder(varmap, 5, DType::F32, &Device::Cpu);
    (
        linear(4, 6, vb.pp("a")).unwrap(),
        linear(6, 3, vb.pp("b")).unwrap(),
    )
}

#[test]
fn a_batch_shorter_than_split_size_runs_as_one_micro_batch_as_torch_split_does() {
    let varmap = VarMap::new();
    let (a, b) = two_layers(&varmap);
    let want = {
        let x = Tensor::arange(0f32, 12., &Device::Cpu)
            .unwrap()
            .reshape((3, 4))
            .unwrap();
        b.forward(&a.forward(&x).unwrap()).unwrap()
    };
    let model = ModelParallel::new(vec![
        Stage::new(&Device::Cpu, a),
        Stage::new(&Device::Cpu, b),
    ])
    .unwrap()
    .with_split_size(5)
    .unwrap();
    // The last batch of an epoch, shorter than split_size: torch.split gives one chunk.
    let x = Tensor::arange(0f32, 12., &Device::Cpu)
        .unwrap()
        .reshape((3, 4))
        .unwrap();
    let got = model.forward(&x).unwrap();
    assert_eq!(f32s(&got), f32s(&want));
}

#[test]
fn one_stage_and_uneven_micro_batches_equal_the_plain_model() {
    let varmap = VarMap::new();
    let (a, b) = two_layers(&varmap);
    let x = Tensor::randn(0f32, 1., (7, 4), &Device::Cpu).unwrap();
    let want = f32s(&b.forward(&a.forward(&x).unwrap()).unwrap());
    let one = ModelParallel::new(vec![Stage::new(&Device::Cpu, move |x: &Tensor| {
        b.forward(&a.forward(x)?)
    })])
    .unwrap();
    assert_eq!(f32s(&one.forward(&x).unwrap()), want);
    let piped = one.with_split_size(3).unwrap(); // 3, 3, 1
    let got = f32s(&piped.forward(&x).unwrap());
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() < 1e-6, "{g} vs {w}");
    }
}

#[test]
fn a_stage_that_changes_dtype_hands_the_next_stage_that_dtype_and_gradients_flow() {
    let varmap = VarMap::new();
    let (a, b) = two_layers(&varmap);
    let model = ModelParallel::new(vec![
        Stage::new(&Device::Cpu, move |x: &Tensor| {
            a.forward(x)?.to_dtype(DType::F64)
        }),
        Stage::new(&Device::Cpu, move |x: &Tensor| {
            assert_eq!(x.dtype(), DType::F64);
            b.forward(&x.to_dtype(DType::F32)?)
        }),
    ])
    .unwrap()
    .with_split_size(2)
    .unwrap();
    let x = Tensor::randn(0f32, 1., (5, 4), &Device::Cpu).unwrap();
    let out = model.forward(&x).unwrap();
    let grads = out.sum_all().unwrap().backward().unwrap();
    for var in varmap.all_vars() {
        assert!(
            grads.get(var.as_tensor()).is_some(),
            "a variable without a gradient"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Pipeline parallel

fn pipeline_stage(pg: &ProcessGroup) -> (VarMap, PipelineStage<Linear>) {
    let varmap = VarMap::new();
    let vb = seeded_var_builder(&varmap, 9, DType::F32, &Device::Cpu);
    let (i, o) = [(4, 6), (6, 3)][pg.rank()];
    let layer = linear(i, o, vb.pp(format!("layers.{}", pg.rank()))).unwrap();
    let stage = PipelineStage::new(layer, &varmap, pg.rank(), 2, pg).unwrap();
    (varmap, stage)
}

#[test]
fn a_batch_not_divisible_and_one_row_micro_batches_give_torchs_gradients() {
    // 7 rows in 3 micro-batches (3, 2, 2), and 3 rows in 3 (1, 1, 1): torch's pipelining
    // scales each micro-batch's mean loss by 1 / 3, which is the gradient computed here too.
    for rows in [7, 3] {
        let got = spawn(2, |pg| {
            let (_, stage) = pipeline_stage(&pg);
            let x = Tensor::arange(0f32, (rows * 4) as f32, &Device::Cpu)?
                .reshape((rows, 4))?
                .affine(0.1, -0.5)?;
            let y = Tensor::arange(0f32, (rows * 3) as f32, &Device::Cpu)?
                .reshape((rows, 3))?
                .affine(0.05, 0.)?;
            let schedule = PipelineSchedule::new(Schedule::OneFOneB, 3, loss::mse)?;
            let out = schedule.step(&[&stage], Some(&x), Some(&y))?;
            let grads: Vec<Vec<f32>> = stage
                .parameters()
                .iter()
                .map(|p| f32s(out.grads.get(p.as_tensor()).expect("a gradient")))
                .collect();
            Ok(grads)
        })
        .unwrap();
        // The same in one process: the two layers, the micro-batches' losses summed / 3.
        let (v0, v1) = (VarMap::new(), VarMap::new());
        let l0 = linear(
            4,
            6,
            seeded_var_builder(&v0, 9, DType::F32, &Device::Cpu).pp("layers.0"),
        )
        .unwrap();
        let l1 = linear(
            6,
            3,
            seeded_var_builder(&v1, 9, DType::F32, &Device::Cpu).pp("layers.1"),
        )
        .unwrap();
        let x = Tensor::arange(0f32, (rows * 4) as f32, &Device::Cpu)
            .unwrap()
            .reshape((rows, 4))
            .unwrap()
            .affine(0.1, -0.5)
            .unwrap();
        let y = Tensor::arange(0f32, (rows * 3) as f32, &Device::Cpu)
            .unwrap()
            .reshape((rows, 3))
            .unwrap()
            .affine(0.05, 0.)
            .unwrap();
        let sizes = candle_parallel::pipeline::microbatch::split_sizes(rows, 3).unwrap();
        let mut total: Option<Tensor> = None;
        let mut start = 0;
        for s in sizes {
            let out = l1
                .forward(&l0.forward(&x.narrow(0, start, s).unwrap()).unwrap())
                .unwrap();
            let l = (loss::mse(&out, &y.narrow(0, start, s).unwrap()).unwrap() / 3.).unwrap();
            total = Some(match total {
                Some(t) => (t + l).unwrap(),
                None => l,
            });
            start += s;
        }
        let grads = total.unwrap().backward().unwrap();
        let mut names: Vec<(String, Vec<f32>)> = Vec::new();
        for v in [&v0, &v1] {
            let data = v.data().lock().unwrap();
            let mut vars: Vec<_> = data.iter().collect();
            vars.sort_by(|a, b| a.0.cmp(b.0));
            for (n, var) in vars {
                names.push((n.clone(), f32s(grads.get(var.as_tensor()).unwrap())));
            }
        }
        let flat: Vec<Vec<f32>> = got.concat();
        for ((name, want), g) in names.iter().zip(&flat) {
            for (a, b) in g.iter().zip(want) {
                assert!((a - b).abs() < 1e-5, "{rows} rows, {name}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn more_micro_batches_than_rows_is_a_typed_error_on_every_rank() {
    let results = spawn(2, |pg| {
        let (_, stage) = pipeline_stage(&pg);
        let x = Tensor::zeros((3, 4), DType::F32, &Device::Cpu)?;
        let y = Tensor::zeros((3, 3), DType::F32, &Device::Cpu)?;
        let schedule = PipelineSchedule::new(Schedule::GPipe, 4, loss::mse)?;
        Ok(schedule
            .step(&[&stage], Some(&x), Some(&y))
            .err()
            .map(|e| e.to_string()))
    })
    .unwrap();
    for e in results {
        assert!(e.expect("an error").contains("3 rows cannot make 4"));
    }
}

#[test]
fn a_stage_that_returns_another_dtype_trains() {
    spawn(2, |pg| {
        let (_, stage) = pipeline_stage(&pg);
        let varmap = VarMap::new();
        let vb = seeded_var_builder(&varmap, 9, DType::F32, &Device::Cpu);
        // Stage 0 hands on f64; stage 1 computes in f32.
        struct Cast(Linear, bool);
        impl Module for Cast {
            fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
                if self.1 {
                    return self.0.forward(x)?.to_dtype(DType::F64);
                }
                assert_eq!(x.dtype(), DType::F64);
                self.0.forward(&x.to_dtype(DType::F32)?)
            }
        }
        let (i, o) = [(4, 6), (6, 3)][pg.rank()];
        let l = linear(i, o, vb.pp(format!("layers.{}", pg.rank())))?;
        let module = Cast(l, pg.rank() == 0);
        drop(stage);
        let stage = PipelineStage::new(module, &varmap, pg.rank(), 2, &pg)?;
        let schedule = PipelineSchedule::new(Schedule::OneFOneB, 2, loss::mse)?;
        let x = Tensor::randn(0f32, 1., (4, 4), &Device::Cpu)?;
        let y = Tensor::randn(0f32, 1., (4, 3), &Device::Cpu)?;
        let out = schedule.step(&[&stage], Some(&x), Some(&y))?;
        for p in stage.parameters() {
            assert!(out.grads.get(p.as_tensor()).is_some());
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_nan_loss_is_reported_in_the_losses() {
    let losses = spawn(2, |pg| {
        let (_, stage) = pipeline_stage(&pg);
        let mut x = Tensor::zeros((4, 4), DType::F32, &Device::Cpu)?;
        x = x.slice_assign(&[0..1, 0..1], &Tensor::new(&[[f32::NAN]], &Device::Cpu)?)?;
        let y = Tensor::zeros((4, 3), DType::F32, &Device::Cpu)?;
        let schedule = PipelineSchedule::new(Schedule::GPipe, 2, loss::mse)?;
        let out = schedule.step(&[&stage], Some(&x), Some(&y))?;
        Ok(out.losses)
    })
    .unwrap();
    assert!(
        losses[1][0].is_nan() && losses[1][1].is_finite(),
        "{losses:?}"
    );
}

#[test]
fn a_pipeline_stage_that_panics_fails_every_rank_without_a_hang() {
    struct Panics;
    impl Module for Panics {
        fn forward(&self, _: &Tensor) -> candle_core::Result<Tensor> {
            panic!("stage 1 refuses")
        }
    }
    let result = spawn(2, |pg| {
        let varmap = VarMap::new();
        let vb = seeded_var_builder(&varmap, 9, DType::F32, &Device::Cpu);
        let x = Tensor::randn(0f32, 1., (4, 4), &Device::Cpu)?;
        let y = Tensor::randn(0f32, 1., (4, 6), &Device::Cpu)?;
        let schedule = PipelineSchedule::new(Schedule::OneFOneB, 2, loss::mse)?;
        if pg.rank() == 0 {
            let stage = PipelineStage::new(linear(4, 6, vb)?, &varmap, 0, 2, &pg)?;
            schedule.step(&[&stage], Some(&x), Some(&y)).map(|_| ())
        } else {
            let stage = PipelineStage::new(Panics, &varmap, 1, 2, &pg)?;
            schedule.step(&[&stage], Some(&x), Some(&y)).map(|_| ())
        }
    });
    let err = result.unwrap_err();
    assert!(
        matches!(err, Error::RankFailed { rank: 1, .. }),
        "the panicking rank should be named: {err}"
    );
}

/// A linear layer that records whether it last ran in training mode.
struct Flagged(Linear, std::sync::atomic::AtomicBool);

impl candle_nn::ModuleT for Flagged {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.1.store(train, std::sync::atomic::Ordering::SeqCst);
        self.0.forward(x)
    }
}

#[test]
fn evaluation_between_training_steps_gives_the_whole_models_outputs() {
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        let x = Tensor::randn(0f32, 1., (7, 4), &Device::Cpu).unwrap();
        let y = Tensor::randn(0f32, 1., (7, 3), &Device::Cpu).unwrap();
        let got = spawn(2, |pg| {
            let (varmap, stage) = pipeline_stage(&pg);
            let layer = stage.module().clone();
            let stage =
                PipelineStage::new(Flagged(layer, true.into()), &varmap, pg.rank(), 2, &pg)?;
            let pipeline = PipelineSchedule::new(schedule, 3, loss::mse)?;
            let mut opt = candle_parallel::optim::Sgd::new(
                stage.parameters(),
                candle_parallel::optim::SgdConfig {
                    lr: 0.1,
                    ..Default::default()
                },
            )?;
            let mut evals = Vec::new();
            for _ in 0..3 {
                let out = pipeline.step(&[&stage], Some(&x), Some(&y))?;
                opt.step(&out.grads)?;
                // With a target and without one.
                let with = pipeline.eval(&[&stage], Some(&x), Some(&y))?;
                assert!(!stage.module().1.load(std::sync::atomic::Ordering::SeqCst));
                let without = pipeline.eval(&[&stage], Some(&x), None)?;
                assert!(without.losses.is_empty());
                evals.push((with, without.output));
            }
            let params: Vec<Tensor> = stage
                .parameters()
                .iter()
                .map(|p| p.as_tensor().clone())
                .collect();
            Ok((params, evals))
        })
        .unwrap();
        // The whole model, from the trained parameters of the last round.
        let (w0, b0) = (&got[0].0[1], &got[0].0[0]);
        let (w1, b1) = (&got[1].0[1], &got[1].0[0]);
        let l0 = Linear::new(w0.clone(), Some(b0.clone()));
        let l1 = Linear::new(w1.clone(), Some(b1.clone()));
        let want = l1.forward(&l0.forward(&x).unwrap()).unwrap();
        let (with, without) = &got[1].1[2];
        assert!(got[0].1[2].0.output.is_none() && got[0].1[2].0.losses.is_empty());
        let out = with.output.as_ref().expect("the last stage's output");
        assert_eq!(out.dims(), [7, 3]);
        for (g, w) in f32s(out).iter().zip(f32s(&want)) {
            assert!((g - w).abs() < 1e-5, "{schedule:?}: {g} vs {w}");
        }
        assert_eq!(f32s(without.as_ref().unwrap()), f32s(out));
        // Each micro-batch's loss (3, 2, 2 rows), not divided.
        let mut start = 0;
        for (k, rows) in [3, 2, 2].into_iter().enumerate() {
            let l = loss::mse(
                &want.narrow(0, start, rows).unwrap(),
                &y.narrow(0, start, rows).unwrap(),
            )
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
            assert!((with.losses[k] - l).abs() < 1e-5, "{schedule:?}: loss {k}");
            start += rows;
        }
    }
}

#[test]
fn evaluation_of_an_interleaved_pipeline_and_of_one_rank_holding_every_stage() {
    let x = Tensor::randn(0f32, 1., (8, 4), &Device::Cpu).unwrap();
    let want = {
        let varmap = VarMap::new();
        let vb = seeded_var_builder(&varmap, 2, DType::F32, &Device::Cpu);
        let mut h = x.clone();
        for s in 0..4 {
            h = linear(4, 4, vb.pp(format!("layers.{s}")))
                .unwrap()
                .forward(&h)
                .unwrap();
        }
        f32s(&h)
    };
    for pp in [2, 1] {
        let got = spawn(pp, |pg| {
            let per = 4 / pp;
            let schedule = Schedule::Interleaved1F1B {
                stages_per_rank: per,
            };
            let mine: Vec<PipelineStage<Linear>> = schedule
                .stages_of(pp, pg.rank())
                .into_iter()
                .map(|s| {
                    let varmap = VarMap::new();
                    let vb = seeded_var_builder(&varmap, 2, DType::F32, &Device::Cpu);
                    let layer = linear(4, 4, vb.pp(format!("layers.{s}")))?;
                    PipelineStage::new(layer, &varmap, s, 4, &pg)
                })
                .collect::<candle_parallel::Result<_>>()?;
            let refs: Vec<&PipelineStage<Linear>> = mine.iter().collect();
            let pipeline = PipelineSchedule::new(schedule, 4, loss::mse)?;
            Ok(pipeline
                .eval(&refs, Some(&x), None)?
                .output
                .map(|t| f32s(&t)))
        })
        .unwrap();
        let out = got[pp - 1].as_ref().expect("the last stage's output");
        for (g, w) in out.iter().zip(&want) {
            assert!((g - w).abs() < 1e-5, "pp {pp}: {g} vs {w}");
        }
    }
}

#[test]
fn all_to_all_carries_scalars_and_empty_tensors_of_any_shape() {
    let got = spawn(2, |pg| {
        let me = pg.rank();
        let inputs = match me {
            0 => vec![
                Tensor::new(5f32, &Device::Cpu)?,
                Tensor::zeros((0, 3), DType::F32, &Device::Cpu)?,
            ],
            _ => vec![
                Tensor::zeros((2, 0, 1), DType::F32, &Device::Cpu)?,
                Tensor::new(7f32, &Device::Cpu)?,
            ],
        };
        let out = pg.all_to_all(&inputs)?;
        Ok(out
            .iter()
            .map(|t| (t.dims().to_vec(), f32s(t)))
            .collect::<Vec<_>>())
    })
    .unwrap();
    assert_eq!(got[0], [(vec![], vec![5.]), (vec![2, 0, 1], vec![])]);
    assert_eq!(got[1], [(vec![0, 3], vec![]), (vec![], vec![7.])]);
}

#[test]
fn a_mesh_over_a_subgroup_numbers_its_ranks_as_the_subgroup_does() {
    let got = spawn(4, |pg| {
        // The subgroup's rank i is world rank (i + 1) % 4.
        let sub = pg.new_group(&[1, 2, 3, 0])?.expect("every rank is in it");
        let mesh = DeviceMesh::new(&sub, &[("a", 2), ("b", 2)])?;
        let x = Tensor::new(&[pg.rank() as f32], &Device::Cpu)?;
        let along_b = mesh.get_group("b")?.all_reduce(&x, ReduceOp::Sum)?;
        Ok((mesh.coordinate().to_vec(), along_b.to_vec1::<f32>()?[0]))
    })
    .unwrap();
    // Sub ranks [0, 1] = world [1, 2] and [2, 3] = world [3, 0] share "b".
    assert_eq!(
        got,
        [
            (vec![1, 1], 3.),
            (vec![0, 0], 3.),
            (vec![0, 1], 3.),
            (vec![1, 0], 3.)
        ]
    );
}

#[test]
fn a_scalar_batch_for_a_pipelined_forward_is_said_to_have_no_rows() {
    let varmap = VarMap::new();
    let (a, _) = two_layers(&varmap);
    let model = ModelParallel::new(vec![Stage::new(&Device::Cpu, a)])
        .unwrap()
        .with_split_size(2)
        .unwrap();
    let err = model
        .forward(&Tensor::new(1f32, &Device::Cpu).unwrap())
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::DimOutOfRange {
                dim: 0,
                rank: 0,
                ..
            }
        ) && err.to_string().contains("no rows"),
        "{err}"
    );
}
