//! DistributedDataParallel's parameters as this crate's layers see them: in the variables' own
//! dtype (f32, and bf16 below) they compute from the variable behind DDP's copy and hand its gradient to the reducer as they make it
//! (no zeros to add to). These tests use a weight several ways at once (twice by our layers,
//! once by a candle op through the copy), forwards whose outputs are not in the loss, two
//! forwards in one loss, evaluation between steps, two wrappers over one `VarMap` and a plain
//! `loss.backward()`, over 2 thread ranks, and over 2 and 3 processes (where each lone
//! gradient is averaged in its own storage), against one process's plain backward.

mod common;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Linear, VarBuilder, VarMap};
use candle_parallel::ddp::DdpConfig;
use candle_parallel::distributed::{self, ProcessGroup};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::{nn, DistributedDataParallel, Error};
use common::{done, is_child, join_child, Ranks};
use std::time::Duration;

/// A weight used three ways (twice by `nn::linear`, once by candle's `matmul` through the
/// copy), a head used by `nn::linear_gelu` and by candle-nn's `Linear::forward`, and a layer
/// norm (whose weight and bias gradients are views of one buffer with the input's).
struct Tied {
    a: Linear,
    b: Linear,
    ln: nn::LayerNorm,
}

impl Module for Tied {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = &self.ln.forward(x)?;
        let h = nn::linear_relu(x, &self.a)?;
        let h2 = nn::linear(&h, &self.a)?;
        let h3 = h2.matmul(&self.a.weight().t()?)?;
        nn::linear_gelu(&(h3 + &h)?, &self.b)? + self.b.forward(&h)?
    }
}

fn tied(vb: VarBuilder) -> candle_core::Result<Tied> {
    Ok(Tied {
        a: candle_nn::linear(8, 8, vb.pp("a"))?,
        b: candle_nn::linear(8, 4, vb.pp("b"))?,
        ln: nn::layer_norm(8, 1e-5, vb.pp("ln"))?,
    })
}

/// Only our layers, each weight once.
struct Mlp {
    a: Linear,
    b: Linear,
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        nn::linear(&nn::linear_relu(x, &self.a)?, &self.b)
    }
}

fn mlp(vb: VarBuilder) -> candle_core::Result<Mlp> {
    Ok(Mlp {
        a: candle_nn::linear(8, 8, vb.pp("a"))?,
        b: candle_nn::linear(8, 4, vb.pp("b"))?,
    })
}

const SEED: u64 = 11;
const ROWS: usize = 12;

fn batch() -> Tensor {
    let v: Vec<f32> = (0..ROWS * 8)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
        .collect();
    Tensor::from_vec(v, (ROWS, 8), &Device::Cpu).unwrap()
}

fn loss(out: &Tensor) -> candle_core::Result<Tensor> {
    out.sqr()?.mean_all()
}

type Grads = Vec<(String, Vec<f64>)>;

/// Each variable's gradient in `grads`, by name (empty when it has none).
fn by_name(varmap: &VarMap, grads: &candle_core::backprop::GradStore) -> Grads {
    let mut out: Grads = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| {
            let g = grads.get(v.as_tensor()).map(common::as_f64);
            (n.clone(), g.unwrap_or_default())
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// One process's plain backward of `make(model, whole batch)`.
fn reference<M: Module>(
    build: fn(VarBuilder) -> candle_core::Result<M>,
    make: impl Fn(&M, &Tensor) -> candle_core::Result<Tensor>,
) -> Grads {
    reference_on(build, &batch(), make)
}

/// One process's plain backward of `make(model, x)`.
fn reference_on<M: Module>(
    build: fn(VarBuilder) -> candle_core::Result<M>,
    x: &Tensor,
    make: impl Fn(&M, &Tensor) -> candle_core::Result<Tensor>,
) -> Grads {
    let varmap = VarMap::new();
    let model = build(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu)).unwrap();
    let grads = make(&model, x).unwrap().backward().unwrap();
    by_name(&varmap, &grads)
}

/// DDP over 2 thread ranks with one bucket per parameter; `run` gets the model and this rank's
/// half of the batch and returns the gradients it wants compared.
fn on_two_ranks<M: Module + 'static>(
    build: fn(VarBuilder) -> candle_core::Result<M>,
    run: impl Fn(&DistributedDataParallel<M>, &VarMap, &Tensor) -> candle_parallel::Result<Grads>
        + Send
        + Sync,
) -> Vec<Grads> {
    let x = batch();
    distributed::spawn_threads(2, |pg: ProcessGroup| {
        let varmap = VarMap::new();
        build(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu))?;
        let config = DdpConfig {
            bucket_cap_mb: 1e-4,
            first_bucket_mb: 1e-4,
            ..DdpConfig::default()
        };
        let model =
            DistributedDataParallel::with_config(&varmap, &pg, &Device::Cpu, config, build)?;
        let half = ROWS / 2;
        run(&model, &varmap, &x.narrow(0, half * pg.rank(), half)?)
    })
    .unwrap()
}

fn assert_close(got: &[Grads], want: &Grads) {
    for (rank, grads) in got.iter().enumerate() {
        assert_eq!(grads.len(), want.len());
        for ((name, g), (wname, w)) in grads.iter().zip(want) {
            assert_eq!(name, wname);
            assert_eq!(g.len(), w.len(), "rank {rank}, {name}: no gradient");
            for (p, q) in g.iter().zip(w) {
                assert!(
                    (p - q).abs() <= 1e-5 * (1.0 + q.abs()),
                    "rank {rank}, {name}: {p} against {q}"
                );
            }
        }
    }
}

#[test]
fn a_weight_used_by_our_layers_and_by_a_candle_op_averages_like_one_process() {
    let want = reference(tied, |m, x| loss(&m.forward(x)?));
    let got = on_two_ranks(tied, |model, varmap, x| {
        let g = model.backward(&loss(&model.forward_t(x, true)?)?)?;
        Ok(by_name(varmap, &g))
    });
    assert_close(&got, &want);
}

/// A bf16 `VarMap` (its own dtype, no mixed precision): DDP's copies are watched as in f32, and
/// the half layers, which take bf16 tensors into their ops as they are, read through them to
/// the variables. Every gradient must still be one process's (in bf16, within a few of its
/// roundings of each variable's largest gradient: a gradient counted twice or lost is far off).
#[test]
fn in_bf16_our_layers_read_through_the_copy_like_one_process() {
    let dtype = DType::BF16;
    let x = batch().to_dtype(dtype).unwrap();
    let varmap = VarMap::new();
    let model = tied(seeded_var_builder(&varmap, SEED, dtype, &Device::Cpu)).unwrap();
    let want = by_name(
        &varmap,
        &loss(&model.forward(&x).unwrap())
            .unwrap()
            .backward()
            .unwrap(),
    );
    let got = distributed::spawn_threads(2, |pg: ProcessGroup| {
        let varmap = VarMap::new();
        tied(seeded_var_builder(&varmap, SEED, dtype, &Device::Cpu))?;
        let config = DdpConfig {
            bucket_cap_mb: 1e-4,
            first_bucket_mb: 1e-4,
            ..DdpConfig::default()
        };
        let model = DistributedDataParallel::with_config(&varmap, &pg, &Device::Cpu, config, tied)?;
        let half = ROWS / 2;
        let out = model.forward_t(&x.narrow(0, half * pg.rank(), half)?, true)?;
        let g = model.backward(&loss(&out)?)?;
        Ok(by_name(&varmap, &g))
    })
    .unwrap();
    for (rank, grads) in got.iter().enumerate() {
        assert_eq!(grads.len(), want.len());
        for ((name, g), (wname, w)) in grads.iter().zip(&want) {
            assert_eq!(name, wname);
            assert_eq!(g.len(), w.len(), "rank {rank}, {name}: no gradient");
            let scale = w.iter().fold(0f64, |m, v| m.max(v.abs()));
            assert!(
                scale > 0.0,
                "{name}: a zero reference gradient tests nothing"
            );
            for (p, q) in g.iter().zip(w) {
                assert!(
                    (p - q).abs() <= 2e-2 * scale,
                    "rank {rank}, {name}: {p} against {q} (largest {scale})"
                );
            }
        }
    }
}

/// Over real processes the host backend averages each bucket's lone gradient in place, in the
/// gradient's own storage: the ranks' results (and what they then train) must still be one
/// process's. Two steps, so that the second runs on the rebuilt buckets.
#[test]
fn over_2_and_3_processes_lone_gradients_are_averaged_in_place_like_one_process() {
    let test = "over_2_and_3_processes_lone_gradients_are_averaged_in_place_like_one_process";
    if is_child() {
        let pg = join_child();
        let world = pg.world_size();
        let x = Tensor::cat(&(0..world).map(|_| batch()).collect::<Vec<_>>(), 0).unwrap();
        let want = reference_on(tied, &x, |m, x| loss(&m.forward(x)?));
        let varmap = VarMap::new();
        tied(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu)).unwrap();
        // A bucket per parameter: each travels alone.
        let config = DdpConfig {
            bucket_cap_mb: 1e-4,
            first_bucket_mb: 1e-4,
            ..DdpConfig::default()
        };
        let model =
            DistributedDataParallel::with_config(&varmap, &pg, &Device::Cpu, config, tied).unwrap();
        let mine = x.narrow(0, ROWS * pg.rank(), ROWS).unwrap();
        for _ in 0..2 {
            let l = loss(&model.forward_t(&mine, true).unwrap()).unwrap();
            let got = by_name(&varmap, &model.backward(&l).unwrap());
            assert_close(&[got], &want);
        }
        done();
        return;
    }
    for world in [2, 3] {
        Ranks::world(test, world).assert_all_pass(Duration::from_secs(120));
    }
}

#[test]
fn a_forward_left_out_of_the_loss_and_two_forwards_in_one_loss() {
    // The whole batch's first and last halves of each rank's rows, as two forwards.
    let want = reference(tied, |m, x| {
        let (a, b) = (x.narrow(0, 0, 3)?, x.narrow(0, 3, 3)?);
        let (c, d) = (x.narrow(0, 6, 3)?, x.narrow(0, 9, 3)?);
        let first = Tensor::cat(&[&a, &c], 0)?;
        let second = Tensor::cat(&[&b, &d], 0)?;
        loss(&m.forward(&first)?)? + loss(&m.forward(&second)?)?
    });
    let got = on_two_ranks(tied, |model, varmap, x| {
        // A forward whose output no loss uses, kept alive: its uses of the weights are
        // counted, and their gradients must still come out whole (at the end of the walk).
        let kept = model.forward_t(x, true)?;
        let first = model.forward_t(&x.narrow(0, 0, 3)?, true)?;
        let second = model.forward_t(&x.narrow(0, 3, 3)?, true)?;
        let l = (loss(&first)? + loss(&second)?)?;
        let grads = model.backward(&l)?;
        drop(kept);
        Ok(by_name(varmap, &grads))
    });
    assert_close(&got, &want);
}

#[test]
fn evaluation_through_module_between_backwards_changes_no_gradient() {
    let want = reference(mlp, |m, x| loss(&m.forward(x)?));
    let got = on_two_ranks(mlp, |model, varmap, x| {
        let first = model.backward(&loss(&model.forward_t(x, true)?)?)?;
        // Evaluation between steps, with a graph that is never back-propagated.
        model.module().forward(x)?;
        model.module().forward(x)?;
        let second = model.backward(&loss(&model.forward_t(x, true)?)?)?;
        let (first, second) = (by_name(varmap, &first), by_name(varmap, &second));
        assert_eq!(first, second, "the same step twice gave other gradients");
        Ok(second)
    });
    assert_close(&got, &want);
}

#[test]
fn two_wrappers_over_one_varmap_both_average_like_one_process() {
    let want = reference(mlp, |m, x| loss(&m.forward(x)?));
    let got = on_two_ranks(mlp, |first, varmap, x| {
        let pg = first.process_group().clone();
        let second = DistributedDataParallel::new(varmap, &pg, &Device::Cpu, mlp)?;
        let from_second = by_name(
            varmap,
            &second.backward(&loss(&second.forward_t(x, true)?)?)?,
        );
        let from_first = by_name(varmap, &first.backward(&loss(&first.forward_t(x, true)?)?)?);
        assert_eq!(from_first, from_second);
        Ok(from_first)
    });
    assert_close(&got, &want);
}

#[test]
fn a_plain_loss_backward_through_our_layers_is_reported_at_the_next_forward() {
    distributed::spawn_threads(1, |pg| {
        let varmap = VarMap::new();
        let model = DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, mlp)?;
        let x = batch();
        loss(&model.forward_t(&x, true)?)?.backward()?;
        let err = model.forward_t(&x, true).unwrap_err();
        assert!(matches!(err, Error::UnfinishedReduction { .. }), "{err}");
        Ok(())
    })
    .unwrap();
}
