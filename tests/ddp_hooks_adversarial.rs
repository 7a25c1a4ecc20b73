//! Adversarial tests of DistributedDataParallel's watched copies (this crate's layers compute
//! from the variable behind DDP's copy and hand its gradient to the reducer as made) and of the
//! host backend's in-place all-reduce of lone gradients: evaluation before the first step,
//! several optimizer steps over host-backend ranks (threads of this test, so that the in-place
//! ring runs) against one process, activation checkpointing with a weight tied across the
//! block, `no_sync` accumulation, ZeRO-2, mixed precision and f64 parameters.

mod common;

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Conv2dConfig, Linear, Optimizer, VarBuilder, VarMap};
use candle_parallel::activation_checkpointing::{checkpoint, Checkpointed};
use candle_parallel::amp::MixedPrecision;
use candle_parallel::ddp::{DdpConfig, JoinDivisor, Sharding};
use candle_parallel::distributed::{self, Algorithm, Backend, InitConfig, ProcessGroup};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{Sgd, SgdConfig};
use candle_parallel::{nn, DistributedDataParallel};
use std::time::Duration;

const SEED: u64 = 5;

/// A model of every kind of layer that reads through DDP's copies: a convolution, a layer norm
/// (whose two gradients come out of one buffer), `nn::linear_gelu`, an RMS norm with a bias
/// added by candle, `nn::linear`, and a weight that only candle's ops use, transposed.
struct Mixed {
    conv: nn::Conv2d,
    ln: nn::LayerNorm,
    fc1: Linear,
    rms: nn::RmsNorm,
    rms_bias: Tensor,
    fc2: Linear,
    proj: Tensor,
}

fn mixed(vb: VarBuilder) -> candle_core::Result<Mixed> {
    Ok(Mixed {
        conv: nn::conv2d(2, 3, 3, Conv2dConfig::default(), vb.pp("conv"))?,
        ln: nn::layer_norm(27, 1e-5, vb.pp("ln"))?,
        fc1: candle_nn::linear(27, 10, vb.pp("fc1"))?,
        rms: nn::rms_norm(10, 1e-5, vb.pp("rms"))?,
        rms_bias: vb.get_with_hints(10, "rms.bias", candle_nn::Init::Const(0.1))?,
        fc2: candle_nn::linear(10, 5, vb.pp("fc2"))?,
        proj: vb.get((5, 10), "proj")?,
    })
}

impl Module for Mixed {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let n = x.dim(0)?;
        let h = self.conv.forward(x)?.reshape((n, 27))?;
        let h = nn::linear_gelu(&self.ln.forward(&h)?, &self.fc1)?;
        let h = self.rms.forward(&h)?.broadcast_add(&self.rms_bias)?;
        nn::linear(&h, &self.fc2)? + h.matmul(&self.proj.t()?)?
    }
}

/// Rows of images `(rows, 2, 5, 5)`, different for each `salt`.
fn images(rows: usize, salt: usize) -> Tensor {
    let v: Vec<f32> = (0..rows * 50)
        .map(|i| (((i + salt * 13) * 37 % 29) as f32 - 14.0) / 9.0)
        .collect();
    Tensor::from_vec(v, (rows, 2, 5, 5), &Device::Cpu).unwrap()
}

fn loss(out: &Tensor) -> candle_core::Result<Tensor> {
    out.sqr()?.mean_all()
}

/// Each variable's value, by name.
fn weights(varmap: &VarMap) -> Vec<(String, Vec<f64>)> {
    let mut out: Vec<_> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), common::as_f64(v.as_tensor())))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn assert_close(got: &[(String, Vec<f64>)], want: &[(String, Vec<f64>)], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for ((name, g), (wname, w)) in got.iter().zip(want) {
        assert_eq!(name, wname, "{what}");
        assert_eq!(g.len(), w.len(), "{what}: {name}");
        for (i, (p, q)) in g.iter().zip(w).enumerate() {
            assert!(
                (p - q).abs() <= tol * (1.0 + q.abs()),
                "{what}: {name}[{i}]: {p} against {q}"
            );
        }
    }
}

const SGD: SgdConfig = SgdConfig {
    lr: 0.05,
    momentum: 0.9,
    dampening: 0.0,
    weight_decay: 0.01,
    nesterov: false,
    maximize: false,
};

/// One process: `steps` SGD steps of `build`'s model on the whole batch of each step.
fn one_process<M: Module>(
    build: fn(VarBuilder) -> candle_core::Result<M>,
    dtype: DType,
    steps: usize,
    batch: impl Fn(usize) -> Tensor,
) -> Vec<(String, Vec<f64>)> {
    let varmap = VarMap::new();
    let model = build(seeded_var_builder(&varmap, SEED, dtype, &Device::Cpu)).unwrap();
    let mut opt = Sgd::new(varmap.all_vars(), SGD).unwrap();
    for step in 0..steps {
        let x = batch(step).to_dtype(dtype).unwrap();
        let grads = loss(&model.forward(&x).unwrap())
            .unwrap()
            .backward()
            .unwrap();
        opt.step(&grads).unwrap();
    }
    weights(&varmap)
}

/// Runs `f` on `world` host-backend ranks (TCP and shared memory over 127.0.0.1), threads of
/// this process: the backend that averages lone gradients in their own storage.
fn host_ranks<T: Send>(world: usize, f: impl Fn(ProcessGroup) -> T + Sync) -> Vec<T> {
    host_ranks_with(world, Algorithm::Ring, f)
}

/// [`host_ranks`] with the all-reduce `algorithm`.
fn host_ranks_with<T: Send>(
    world: usize,
    algorithm: Algorithm,
    f: impl Fn(ProcessGroup) -> T + Sync,
) -> Vec<T> {
    let port = common::free_port();
    let config = InitConfig {
        rendezvous_timeout: Duration::from_secs(30),
        algorithm,
        ..InitConfig::default()
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (f, config) = (&f, config.clone());
                s.spawn(move || {
                    let rv = common::local_rendezvous(rank, world, port);
                    let pg = ProcessGroup::new(&rv, &Device::Cpu, config).unwrap();
                    assert_eq!(pg.backend(), Backend::Tcp);
                    f(pg)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A bucket per parameter: every gradient travels alone (in place on the host backend).
fn lone_buckets() -> DdpConfig {
    DdpConfig {
        bucket_cap_mb: 1e-5,
        first_bucket_mb: 1e-5,
        ..DdpConfig::default()
    }
}

/// `steps` SGD steps under DDP, each rank on its share of the step's batch of `rows` rows.
fn ddp_steps<M: Module + 'static>(
    pg: &ProcessGroup,
    config: DdpConfig,
    build: fn(VarBuilder) -> candle_core::Result<M>,
    steps: usize,
    batch: impl Fn(usize) -> Tensor,
) -> Vec<(String, Vec<f64>)> {
    let varmap = VarMap::new();
    build(seeded_var_builder(
        &varmap,
        SEED,
        config.dtype,
        &Device::Cpu,
    ))
    .unwrap();
    let model =
        DistributedDataParallel::with_config(&varmap, pg, &Device::Cpu, config, build).unwrap();
    let mut opt = Sgd::new(model.parameters(), SGD).unwrap();
    let (world, rank) = (pg.world_size(), pg.rank());
    for step in 0..steps {
        let x = batch(step);
        let per = x.dim(0).unwrap() / world;
        let mine = x.narrow(0, per * rank, per).unwrap();
        let l = loss(&model.forward_t(&mine, true).unwrap()).unwrap();
        let grads = model.backward(&l).unwrap();
        opt.step(&grads).unwrap();
    }
    weights(&varmap)
}

/// An evaluation forward before training (a first validation, a sanity check) counts uses of
/// the weights that no backward follows: the first backward must still hand each gradient on
/// as it is made, so that the buckets are rebuilt in backward's order, as without it.
#[test]
fn an_evaluation_before_the_first_step_leaves_the_buckets_in_backward_order() {
    let buckets = |evaluate_first: bool| {
        distributed::spawn_threads(1, |pg| {
            let varmap = VarMap::new();
            let model = DistributedDataParallel::with_config(
                &varmap,
                &pg,
                &Device::Cpu,
                lone_buckets(),
                mixed,
            )?;
            let x = images(4, 0);
            if evaluate_first {
                model.module().forward(&x)?;
            }
            model.backward(&loss(&model.forward_t(&x, true)?)?)?;
            Ok(model.buckets())
        })
        .unwrap()
        .remove(0)
    };
    let plain = buckets(false);
    assert_eq!(
        buckets(true),
        plain,
        "an evaluation before the first step changed the rebuilt buckets"
    );
}

/// Host-backend ranks, every gradient alone in its bucket (averaged in its own storage, the
/// layer norm's two out of one buffer), three SGD steps with momentum: the weights of one
/// process, for 2 and 3 ranks.
#[test]
fn host_ranks_train_every_layer_kind_like_one_process_with_lone_gradients() {
    for world in [2, 3] {
        let batch = |step| images(6, step);
        let want = one_process(mixed, DType::F32, 3, batch);
        let got = host_ranks(world, |pg| ddp_steps(&pg, lone_buckets(), mixed, 3, batch));
        for (rank, g) in got.iter().enumerate() {
            assert_close(g, &want, 1e-5, &format!("world {world}, rank {rank}"));
        }
    }
}

/// The hierarchical all-reduce (forced: one machine, so a reduce-scatter and an all-gather
/// within it) leaves the sum and the backend divides; lone gradients take that path too, in
/// buckets of one and of several.
#[test]
fn hierarchical_all_reduce_with_lone_and_shared_buckets_trains_like_one_process() {
    let batch = |step| images(6, step + 5);
    let want = one_process(mixed, DType::F32, 2, batch);
    for config in [lone_buckets(), DdpConfig::default()] {
        let got = host_ranks_with(2, Algorithm::Hierarchical, |pg| {
            ddp_steps(&pg, config.clone(), mixed, 2, batch)
        });
        for (rank, g) in got.iter().enumerate() {
            let what = format!(
                "hierarchical, cap {} MiB, rank {rank}",
                config.bucket_cap_mb
            );
            assert_close(g, &want, 1e-5, &what);
        }
    }
}

/// ZeRO-2 over host-backend ranks with our layers: the weights of one process.
#[test]
fn zero2_over_host_ranks_with_our_layers_trains_like_one_process() {
    let batch = |step| images(6, step + 7);
    let want = one_process(mixed, DType::F32, 2, batch);
    let config = DdpConfig {
        sharding: Sharding::Zero2,
        ..lone_buckets()
    };
    let got = host_ranks(2, |pg| ddp_steps(&pg, config.clone(), mixed, 2, batch));
    for (rank, g) in got.iter().enumerate() {
        assert_close(g, &want, 1e-5, &format!("ZeRO-2, rank {rank}"));
    }
}

/// f64 parameters: the norms read through to f64 variables; `nn::linear` computes in f32, so
/// the comparison is at f32's precision.
#[test]
fn f64_parameters_over_host_ranks_train_like_one_process() {
    let batch = |step| images(6, step + 3);
    let want = one_process(mixed, DType::F64, 2, batch);
    let config = DdpConfig {
        dtype: DType::F64,
        ..lone_buckets()
    };
    let got = host_ranks(2, |pg| {
        ddp_steps(&pg, config.clone(), mixed, 2, |s| {
            batch(s).to_dtype(DType::F64).unwrap()
        })
    });
    for (rank, g) in got.iter().enumerate() {
        assert_close(g, &want, 1e-5, &format!("f64, rank {rank}"));
    }
}

/// Mixed precision (bf16 compute, f32 reduction): the copies are casts, not watched; the
/// gradients are those of f32 within bf16's precision.
#[test]
fn bf16_mixed_precision_with_our_layers_is_f32_within_bf16_precision() {
    let x = images(6, 1);
    let varmap = VarMap::new();
    let model = mixed(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu)).unwrap();
    let grads = loss(&model.forward(&x).unwrap())
        .unwrap()
        .backward()
        .unwrap();
    let want: Vec<_> = weights(&varmap)
        .into_iter()
        .map(|(name, _)| {
            let v = varmap.data().lock().unwrap()[&name].clone();
            (name, common::as_f64(grads.get(v.as_tensor()).unwrap()))
        })
        .collect();
    let config = DdpConfig {
        mixed_precision: MixedPrecision::bf16(),
        ..lone_buckets()
    };
    let got = host_ranks(2, |pg| {
        let varmap = VarMap::new();
        mixed(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu)).unwrap();
        let model =
            DistributedDataParallel::with_config(&varmap, &pg, &Device::Cpu, config.clone(), mixed)
                .unwrap();
        let mine = x.narrow(0, 3 * pg.rank(), 3).unwrap();
        let out = model.forward_t(&mine, true).unwrap();
        let grads = model.backward(&loss(&out).unwrap()).unwrap();
        weights(&varmap)
            .into_iter()
            .map(|(name, _)| {
                let v = varmap.data().lock().unwrap()[&name].clone();
                (name, common::as_f64(grads.get(v.as_tensor()).unwrap()))
            })
            .collect::<Vec<_>>()
    });
    for (rank, g) in got.iter().enumerate() {
        assert_close(g, &want, 3e-2, &format!("bf16, rank {rank}"));
    }
}

/// A block under activation checkpointing whose first weight `nn::linear` also uses outside
/// the block: its gradient has a part from the block (through the copy) and one from the
/// variable; and `no_sync` micro-steps before the synced one.
struct Ckpt {
    block: Checkpointed<Block>,
    tied: Linear,
    head: Linear,
}

struct Block {
    fc: Linear,
    ln: nn::LayerNorm,
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.ln.forward(&nn::linear_relu(x, &self.fc)?)
    }
}

fn ckpt(vb: VarBuilder) -> candle_core::Result<Ckpt> {
    let block = checkpoint(vb.pp("block"), |vb| {
        Ok(Block {
            fc: candle_nn::linear(8, 8, vb.pp("fc"))?,
            ln: nn::layer_norm(8, 1e-5, vb.pp("ln"))?,
        })
    })?;
    Ok(Ckpt {
        block,
        tied: candle_nn::linear(8, 8, vb.pp("block").pp("fc"))?,
        head: candle_nn::linear(8, 3, vb.pp("head"))?,
    })
}

impl Module for Ckpt {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = x.flatten_from(1)?.narrow(D::Minus1, 0, 8)?;
        let h = self.block.forward(&nn::linear(&x, &self.tied)?)?;
        nn::linear(&(h + &x)?, &self.head)
    }
}

#[test]
fn checkpointed_block_with_a_tied_weight_and_no_sync_micro_steps_like_one_process() {
    let batch = |step| images(12, step + 11);
    let want = one_process(ckpt, DType::F32, 2, batch);
    let got = host_ranks(2, |pg| {
        let varmap = VarMap::new();
        ckpt(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu)).unwrap();
        let model =
            DistributedDataParallel::with_config(&varmap, &pg, &Device::Cpu, lone_buckets(), ckpt)
                .unwrap();
        let mut opt = Sgd::new(model.parameters(), SGD).unwrap();
        for step in 0..2 {
            let mine = batch(step).narrow(0, 6 * pg.rank(), 6).unwrap();
            // Three micro-batches of two rows: two summed locally, the third synchronised.
            let micro = |i: usize| -> Tensor {
                let out = model
                    .forward_t(&mine.narrow(0, 2 * i, 2).unwrap(), true)
                    .unwrap();
                (loss(&out).unwrap() / 3.0).unwrap()
            };
            {
                let _local = model.no_sync();
                for i in 0..2 {
                    model.backward(&micro(i)).unwrap();
                }
            }
            let grads = model.backward(&micro(2)).unwrap();
            opt.step(&grads).unwrap();
        }
        weights(&varmap)
    });
    for (rank, g) in got.iter().enumerate() {
        assert_close(g, &want, 1e-5, &format!("checkpoint, rank {rank}"));
    }
}

/// Uneven inputs under `join` over host-backend ranks with our layers: rank 0 runs out after
/// two steps and shadows rank 1's third (its lone gradients are zeros, averaged in place beside
/// rank 1's). With `JoinDivisor::Active` the third step is rank 1's alone: the weights of one
/// process that takes both ranks' rows for two steps, then rank 1's.
#[test]
fn join_with_uneven_inputs_and_our_layers_trains_like_one_process() {
    let rows = |step: usize, rank: usize| images(3, 10 * step + rank);
    let want = one_process(mixed, DType::F32, 3, |step| match step {
        0 | 1 => Tensor::cat(&[rows(step, 0), rows(step, 1)], 0).unwrap(),
        _ => rows(step, 1),
    });
    let got = host_ranks(2, |pg| {
        let varmap = VarMap::new();
        mixed(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu)).unwrap();
        let model =
            DistributedDataParallel::with_config(&varmap, &pg, &Device::Cpu, lone_buckets(), mixed)
                .unwrap();
        let mut opt = Sgd::new(model.parameters(), SGD).unwrap();
        let rank = pg.rank();
        model
            .join(&mut opt, JoinDivisor::Active, |opt| {
                for step in 0..2 + rank {
                    let l = loss(&model.forward_t(&rows(step, rank), true)?)?;
                    opt.step(&model.backward(&l)?)?;
                }
                Ok(())
            })
            .unwrap();
        weights(&varmap)
    });
    for (rank, g) in got.iter().enumerate() {
        assert_close(g, &want, 1e-5, &format!("join, rank {rank}"));
    }
}
