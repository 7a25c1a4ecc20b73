//! Adversarial probes of issues 31 and 36 (mixed precision, GradScaler, clipping, activation
//! checkpointing, fully sharded prefetch and buffers, checkpoint integrity). The comment above
//! each test says what a breaker found there (what was observed against what was expected, and
//! the cause at the time: line numbers are of then); the test holds the fix. Thread ranks
//! (`spawn_threads`) are used throughout: the findings do not depend on processes.

use candle_core::{DType, Device, Module, ModuleT, Tensor, Var};
use candle_nn::{linear, Linear, Optimizer, VarBuilder, VarMap};
use candle_parallel::amp::{GradScaler, GradScalerConfig, MixedPrecision};
use candle_parallel::ddp::{DdpConfig, JoinDivisor};
use candle_parallel::distributed;
use candle_parallel::fsdp::{self, FsdpConfig, Unit};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{clip_grad_norm, Sgd, SgdConfig};
use candle_parallel::{DistributedDataParallel, FullyShardedDataParallel};
use std::collections::HashMap;
use std::sync::mpsc;
use std::time::Duration;

const CPU: Device = Device::Cpu;

/// Runs `f` on a thread of its own and fails when it takes longer than `limit` (a hang).
fn bounded<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("HANG: did not finish within {limit:?}"))
}

fn sgd(vars: Vec<Var>, lr: f64) -> Sgd {
    Sgd::new(
        vars,
        SgdConfig {
            lr,
            ..Default::default()
        },
    )
    .unwrap()
}

fn rows(seed: usize, n: usize, width: usize) -> Tensor {
    let v: Vec<f32> = (0..n * width)
        .map(|i| (((i + 3 * seed) * 37 % 23) as f32 - 11.0) * 0.15)
        .collect();
    Tensor::from_vec(v, (n, width), &CPU).unwrap()
}

// ---------------------------------------------------------------------------------------------
// 1. clip_grad_norm with norm_type = inf misses a NaN that is not the first element.
//
// Found, fixed. Gradients [1, NaN, 2]: torch 2.15 `clip_grad_norm_(p, 1.0, inf, error_if_nonfinite=True)`
// raises ("The total norm of order inf for gradients from `parameters` is non-finite"); here the
// total is 2.0, no error, and the NaN gradient is scaled by 1/2 and handed to the optimizer.
// Cause: src/optim/clip.rs:84 `a.max_all()` - candle's CPU max reduction compares with `>`, so
// a NaN after the first element never wins; the NaN guard at clip.rs:91 only sees the part's
// result.
#[test]
fn clip_inf_norm_sees_a_nan_that_is_not_the_first_element() {
    let w = Var::new(&[0f32, 0., 0.], &CPU).unwrap();
    let c = Tensor::new(&[1f32, f32::NAN, 2.], &CPU).unwrap();
    let mut grads = (w.as_tensor() * c)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let r = clip_grad_norm(
        &mut grads,
        std::slice::from_ref(&w),
        1.0,
        f64::INFINITY,
        true,
    );
    assert!(
        r.is_err(),
        "a NaN gradient passed clip_grad_norm(inf, error_if_nonfinite): total {r:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// 2. DDP join with a loop that does more than `opt.step(&grads)` between backward and step
//    (clipping, a GradScaler). A joined rank shadows the others' iterations; it used to step
//    the averaged gradients as they came (the replicas diverged in silence), and a scaler's or
//    ZeRO-2 clipping's collective had no partner (a hang, or a mismatch that named neither join
//    nor the cause). Now `join_with` takes the loop's step and the shadow runs it, and plain
//    `join` compares the replicas at its end: a loop it cannot mirror is a typed error naming
//    `join_with`, never a silent divergence or a hang.

fn weights(model: &DistributedDataParallel<Linear>) -> candle_parallel::Result<Vec<Vec<f32>>> {
    model.gather_parameters()?;
    Ok(model
        .named_parameters()
        .iter()
        .map(|(_, p)| p.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect())
}

fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Two thread ranks (rank 0 has one batch, rank 1 two) join a loop that clips every step,
/// through `join_with` or plain `join`; the largest difference of the replicas afterwards.
fn join_clipping(zero2: bool, with: bool) -> Result<f32, String> {
    bounded(Duration::from_secs(60), move || {
        distributed::spawn_threads(2, move |pg| {
            let varmap = VarMap::new();
            let config = DdpConfig {
                sharding: match zero2 {
                    true => candle_parallel::ddp::Sharding::Zero2,
                    false => candle_parallel::ddp::Sharding::None,
                },
                ..Default::default()
            };
            let model = DistributedDataParallel::with_config(&varmap, &pg, &CPU, config, |vb| {
                linear(4, 3, vb)
            })?;
            let mut opt = sgd(model.parameters(), 0.5);
            let step = |opt: &mut Sgd, mut grads: candle_core::backprop::GradStore| {
                model.clip_grad_norm(&mut grads, 0.01, 2.0, false)?;
                Ok(opt.step(&grads)?)
            };
            let batches = 1 + pg.rank();
            let train = |opt: &mut Sgd| {
                for b in 0..batches {
                    let x = rows(b + 10 * pg.rank(), 5, 4);
                    let loss = model.forward_t(&x, true)?.sqr()?.sum_all()?;
                    step(opt, model.backward(&loss)?)?;
                }
                Ok(())
            };
            match with {
                true => model.join_with(&mut opt, JoinDivisor::World, step, train)?,
                false => model.join(&mut opt, JoinDivisor::World, train)?,
            }
            weights(&model)
        })
        .map(|w| max_abs_diff(&w[0], &w[1]))
        .map_err(|e| e.to_string())
    })
}

#[test]
fn join_with_clipping_keeps_the_replicas_equal() {
    for zero2 in [false, true] {
        let outcome = join_clipping(zero2, true);
        assert!(
            matches!(outcome, Ok(d) if d < 1e-6),
            "join_with + clip_grad_norm (ZeRO-2: {zero2}): {outcome:?}"
        );
    }
}

#[test]
fn plain_join_with_clipping_is_an_error_naming_join_with() {
    for zero2 in [false, true] {
        let outcome = join_clipping(zero2, false);
        assert!(
            matches!(&outcome, Err(e) if e.contains("join_with")),
            "join + clip_grad_norm (ZeRO-2: {zero2}): {outcome:?}"
        );
    }
}

/// As [`join_clipping`], with a GradScaler (one-process, or agreed over the group).
fn join_scaling(for_group: bool, with: bool) -> Result<f32, String> {
    bounded(Duration::from_secs(60), move || {
        distributed::spawn_threads(2, move |pg| {
            let varmap = VarMap::new();
            let model = DistributedDataParallel::new(&varmap, &pg, &CPU, |vb| linear(4, 3, vb))?;
            let opt = sgd(model.parameters(), 0.01);
            let scaler = match for_group {
                true => GradScaler::for_group(GradScalerConfig::default(), &pg, &CPU)?,
                false => GradScaler::new(GradScalerConfig::default())?,
            };
            let mut state = (opt, scaler);
            type State = (Sgd, GradScaler);
            let step = |(opt, scaler): &mut State, mut grads: candle_core::backprop::GradStore| {
                scaler.step(opt, &mut grads)?;
                scaler.update();
                Ok(())
            };
            let batches = 1 + pg.rank();
            let train = |state: &mut State| {
                for b in 0..batches {
                    let x = rows(b + 10 * pg.rank(), 5, 4);
                    let loss = model.forward_t(&x, true)?.sqr()?.mean_all()?;
                    let grads = model.backward(&state.1.scale(&loss)?)?;
                    step(state, grads)?;
                }
                Ok(())
            };
            match with {
                true => model.join_with(&mut state, JoinDivisor::World, step, train)?,
                false => model.join(&mut state.0, JoinDivisor::World, |opt| {
                    for b in 0..batches {
                        let x = rows(b + 10 * pg.rank(), 5, 4);
                        let loss = model.forward_t(&x, true)?.sqr()?.mean_all()?;
                        let mut grads = model.backward(&state.1.scale(&loss)?)?;
                        state.1.step(opt, &mut grads)?;
                        state.1.update();
                    }
                    Ok(())
                })?,
            }
            weights(&model)
        })
        .map(|w| max_abs_diff(&w[0], &w[1]))
        .map_err(|e| e.to_string())
    })
}

#[test]
fn join_with_a_grad_scaler_keeps_the_replicas_equal() {
    for for_group in [false, true] {
        let outcome = join_scaling(for_group, true);
        assert!(
            matches!(outcome, Ok(d) if d < 1e-6),
            "join_with + GradScaler (for the group: {for_group}): {outcome:?}"
        );
    }
}

#[test]
fn plain_join_with_a_grad_scaler_is_an_error_naming_join_with() {
    for for_group in [false, true] {
        let outcome = join_scaling(for_group, false);
        assert!(
            matches!(&outcome, Err(e) if e.contains("join_with")),
            "join + GradScaler (for the group: {for_group}): {outcome:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 6. GradScaler with two optimizers (torch: `scaler.step(opt1); scaler.step(opt2);
//    scaler.update()`, the documented GAN / multi-optimizer pattern).
//
// Expected: both optimizers step (torch 2.15 keeps one state per optimizer). Observed: the
// second `step` fails with "GradScaler::step: already called since the last update()" (and a
// second `unscale` for the other optimizer's variables fails likewise), so a model with two
// optimizers cannot use the scaler at all.
// Cause: src/amp/grad_scaler.rs:85 keeps one `stage` for the scaler, not per optimizer.
#[test]
fn grad_scaler_steps_two_optimizers_in_one_iteration() {
    let a = Var::new(&[1f32, 2.], &CPU).unwrap();
    let b = Var::new(&[3f32], &CPU).unwrap();
    let mut opt_a = sgd(vec![a.clone()], 0.1);
    let mut opt_b = sgd(vec![b.clone()], 0.1);
    let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
    let loss = (a.as_tensor().sqr().unwrap().sum_all().unwrap()
        + b.as_tensor().sqr().unwrap().sum_all().unwrap())
    .unwrap();
    let mut grads = scaler.scale(&loss).unwrap().backward().unwrap();
    assert!(scaler.step(&mut opt_a, &mut grads).unwrap());
    let second = scaler.step(&mut opt_b, &mut grads);
    assert!(
        matches!(second, Ok(true)),
        "the second optimizer could not step: {second:?}"
    );
    scaler.update();
    // b = 3 - 0.1 * 6 = 2.4
    assert!((b.as_tensor().to_vec1::<f32>().unwrap()[0] - 2.4).abs() < 1e-5);
}

// ---------------------------------------------------------------------------------------------
// Models for the fully sharded probes.

/// A linear layer followed by candle-nn's BatchNorm.
struct NormBlock {
    fc: Linear,
    bn: candle_nn::BatchNorm,
}

impl ModuleT for NormBlock {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.bn.forward_t(&self.fc.forward(x)?, train)?.relu()
    }
}

fn norm_block(vb: VarBuilder) -> candle_core::Result<NormBlock> {
    Ok(NormBlock {
        fc: linear(4, 6, vb.pp("fc"))?,
        bn: candle_nn::batch_norm(6, 1e-5, vb.pp("bn"))?,
    })
}

/// A BatchNorm unit and a root head.
struct NormNet {
    a: Unit<NormBlock>,
    head: Linear,
}

impl ModuleT for NormNet {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.head.forward(&self.a.forward_t(x, train)?)
    }
}

fn norm_net(vb: VarBuilder) -> candle_core::Result<NormNet> {
    Ok(NormNet {
        a: fsdp::unit(vb.pp("a"), norm_block)?,
        head: linear(6, 2, vb.pp("head"))?,
    })
}

// ---------------------------------------------------------------------------------------------
// 7. FullyShardedDataParallel with MixedPrecision::bf16() and candle-nn's BatchNorm.
//
// Found, fixed. Expected (torch FSDP2's MixedPrecisionPolicy leaves buffers alone; DDP here keeps them
// f32 and works): the training forward works and the running mean moves from 0. Observed: the
// first training forward fails with candle's "dtype mismatch in add, lhs: BF16, rhs: F32"
// (printed), naming neither the layer nor the policy.
// Cause: src/fsdp/backend.rs:236-256 `serving` puts the buffers into a `VarBuilder` whose
// dtype is the compute dtype (src/fsdp/flat_param.rs:447, src/fsdp/mod.rs:564), and candle's
// HashMap backend converts every tensor it hands out to that dtype (candle-nn
// var_builder.rs:314): the running statistics arrive as bf16 *copies* (not the `VarMap`'s
// variables), which BatchNorm's f32 batch statistics cannot be added to. A buffer updated in
// place in a dtype that does match would be updated in the copy and lost in silence.
#[test]
fn fsdp_bf16_trains_a_unit_with_batch_norm() {
    let outcome = bounded(Duration::from_secs(60), || {
        distributed::spawn_threads(2, |pg| {
            let config = FsdpConfig {
                seed: Some(3),
                mixed_precision: MixedPrecision::bf16(),
                ..Default::default()
            };
            let model =
                FullyShardedDataParallel::with_config(&VarMap::new(), &pg, &CPU, config, norm_net)?;
            let mut opt = sgd(model.parameters(), 0.1);
            let x = rows(pg.rank(), 8, 4);
            let loss = model.forward_t(&x, true)?.sqr()?.mean_all()?;
            opt.step(&model.backward(&loss)?)?;
            let (_, mean) = model
                .buffers()
                .into_iter()
                .find(|(n, _)| n.ends_with("running_mean"))
                .expect("a running mean");
            Ok(mean.as_tensor().to_vec1::<f32>()?)
        })
        .map_err(|e| e.to_string())
    });
    match outcome {
        Ok(means) => assert!(
            means[0].iter().any(|m| *m != 0.0),
            "the running mean never moved: {means:?}"
        ),
        Err(e) => panic!("FSDP bf16 + BatchNorm failed: {e}"),
    }
}

// Control for 7: the same model under DDP with MixedPrecision::bf16() trains and moves the
// running mean (PASSES).
#[test]
fn ddp_bf16_trains_a_model_with_batch_norm() {
    let means = bounded(Duration::from_secs(60), || {
        distributed::spawn_threads(2, |pg| {
            let config = DdpConfig {
                mixed_precision: MixedPrecision::bf16(),
                ..Default::default()
            };
            let varmap = VarMap::new();
            let model = DistributedDataParallel::with_config(&varmap, &pg, &CPU, config, norm_net)?;
            let mut opt = sgd(model.parameters(), 0.1);
            let x = rows(pg.rank(), 8, 4);
            let loss = model.forward_t(&x, true)?.sqr()?.mean_all()?;
            opt.step(&model.backward(&loss)?)?;
            let mean = varmap.data().lock().unwrap()["a.bn.running_mean"].clone();
            Ok(mean.as_tensor().to_vec1::<f32>()?)
        })
        .unwrap()
    });
    assert!(means[0].iter().any(|m| *m != 0.0), "{means:?}");
}

// ---------------------------------------------------------------------------------------------
// 8. Activation checkpointing around a block with BatchNorm: are the running statistics updated
//    once, as without checkpointing, and when?
//
// Found (low severity, behaviour not documented), fixed: buffers are served live to the
// checkpointed forward and as copies to the recomputation. In one process, running mean after forward
// and after backward: plain [0.0230, 0.0244, ...] then the same; checkpointed [0, 0, ...]
// after forward, then [0.0230, 0.0244, ...] after backward. So the statistics are updated
// once (torch's non-reentrant checkpoint updates them twice), but only when backward runs: a
// training-mode forward with no backward (a BatchNorm recalibration pass over a few batches,
// a forward whose loss is discarded) leaves them untouched, in silence.
// Cause: the checkpointed forward serves detached copies (src/activation_checkpointing/
// mod.rs:150 `p.detach()`, and candle-nn's BatchNorm makes a Var of a non-variable by copying),
// and the recomputation in backward gets the live variable (pin.rs:52-55 `p.is_variable()`).
#[test]
fn checkpointed_batch_norm_updates_its_running_stats_once_at_forward() {
    let run = |checkpointed: bool| -> (Vec<f32>, Vec<f32>) {
        let varmap = VarMap::new();
        let vb = seeded_var_builder(&varmap, 5, DType::F32, &CPU);
        let block = candle_parallel::activation_checkpointing::checkpoint_if(
            checkpointed,
            vb.pp("blk"),
            norm_block,
        )
        .unwrap();
        let x = Var::from_tensor(&rows(1, 8, 4)).unwrap();
        let y = block.forward_t(x.as_tensor(), true).unwrap();
        let mean = || {
            varmap.data().lock().unwrap()["blk.bn.running_mean"]
                .as_tensor()
                .to_vec1::<f32>()
                .unwrap()
        };
        let after_forward = mean();
        y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        (after_forward, mean())
    };
    let plain = run(false);
    let ckpt = run(true);
    assert_eq!(
        ckpt, plain,
        "running mean (after forward, after backward): checkpointed {ckpt:?}, plain {plain:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// 9. FSDP prefetch: an evaluation forward that skips a unit leaves that unit's prefetched
//    all-gather behind; after `opt.step`, `full_parameters()` (and so `save_checkpoint`) takes
//    it and returns the weights from before the step.
//
// Found, fixed. Units a, b, c and a root head; training forwards use a, b, c; evaluation forwards
// skip b (an auxiliary branch). Loop: train forward, backward, eval forward (a validation
// loss), opt.step, full_parameters(). Expected: b's weight after the step (a second
// full_parameters() call returns it). Observed: the first call returns b's weight from
// before the step (difference printed), so a checkpoint saved there holds a stale unit.
// Cause: src/fsdp/unit.rs:212-213 prefetches unit id+1 at every use, evaluation included;
// nothing drops the prefetch at the end of an evaluation forward (only the next forward,
// src/fsdp/mod.rs:541, and a backward's end_iteration do), and FlatParam::gather
// (src/fsdp/flat_param.rs:321-325) takes whatever is in the slot, whatever the step since.
struct Three {
    a: Unit<Linear>,
    b: Unit<Linear>,
    c: Unit<Linear>,
    head: Linear,
}

impl ModuleT for Three {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let h = self.a.forward(x)?.tanh()?;
        let h = match train {
            true => self.b.forward(&h)?.tanh()?,
            false => h,
        };
        self.head.forward(&self.c.forward(&h)?.tanh()?)
    }
}

fn three(vb: VarBuilder) -> candle_core::Result<Three> {
    Ok(Three {
        a: fsdp::unit(vb.pp("a"), |vb| linear(4, 4, vb))?,
        b: fsdp::unit(vb.pp("b"), |vb| linear(4, 4, vb))?,
        c: fsdp::unit(vb.pp("c"), |vb| linear(4, 4, vb))?,
        head: linear(4, 2, vb.pp("head"))?,
    })
}

#[test]
fn full_parameters_after_an_eval_forward_and_a_step_are_current() {
    let diffs = bounded(Duration::from_secs(60), || {
        distributed::spawn_threads(2, |pg| {
            let config = FsdpConfig {
                seed: Some(1),
                ..Default::default()
            };
            let model =
                FullyShardedDataParallel::with_config(&VarMap::new(), &pg, &CPU, config, three)?;
            let mut opt = sgd(model.parameters(), 0.5);
            let x = rows(pg.rank(), 6, 4);
            let loss = model.forward_t(&x, true)?.sqr()?.sum_all()?;
            let grads = model.backward(&loss)?;
            let _validation = model.forward_t(&x, false)?;
            opt.step(&grads)?;
            let first: HashMap<String, Tensor> = model.full_parameters()?.into_iter().collect();
            let second: HashMap<String, Tensor> = model.full_parameters()?.into_iter().collect();
            let d = (&first["b.weight"] - &second["b.weight"])?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            Ok(d)
        })
        .unwrap()
    });
    assert!(
        diffs.iter().all(|d| *d == 0.0),
        "full_parameters() returned b.weight from before the step: max |first - second| per rank {diffs:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// 10. Checkpoint files of every odd shape and dtype, and damaged ones (PASSES: held up).
// Zero-size, 0-d, bf16/f16/u8/i64/u32 and non-contiguous tensors round-trip bit for bit (read
// here and by candle); truncation, a huge header length, a file of another program, appended
// bytes, a renamed tensor, swapped names and a removed metadata map are each either refused
// naming the file, or (metadata removed: a file "of another program") read with a warning.
#[test]
fn checkpoint_files_of_odd_tensors_and_damaged_files() {
    use candle_parallel::checkpoint;
    let dir = std::env::temp_dir().join(format!("breaker31-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("odd.safetensors");
    let tensors: HashMap<String, Tensor> = [
        ("empty", Tensor::zeros((0, 3), DType::F32, &CPU).unwrap()),
        ("scalar", Tensor::new(2.5f64, &CPU).unwrap()),
        (
            "half",
            Tensor::new(&[1.5f32, -2.0, 65504.0], &CPU)
                .unwrap()
                .to_dtype(DType::F16)
                .unwrap(),
        ),
        (
            "brain",
            Tensor::new(&[1.5f32, -2.0, 3.0e38], &CPU)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap(),
        ),
        ("bytes", Tensor::new(&[0u8, 255, 7], &CPU).unwrap()),
        (
            "long",
            Tensor::new(&[i64::MIN, -1, i64::MAX], &CPU).unwrap(),
        ),
        ("word", Tensor::new(&[u32::MAX, 0], &CPU).unwrap()),
        ("a.weight", rows(1, 3, 4).t().unwrap()),
        ("b.weight", rows(2, 3, 4).narrow(0, 1, 2).unwrap()),
    ]
    .into_iter()
    .map(|(n, t)| (n.to_string(), t))
    .collect();
    checkpoint::save(&tensors, &path).unwrap();
    let ours = checkpoint::read(&path).unwrap();
    let theirs = candle_core::safetensors::load(&path, &CPU).unwrap();
    for (name, t) in &tensors {
        for back in [&ours[name], &theirs[name]] {
            assert_eq!((back.dtype(), back.dims()), (t.dtype(), t.dims()), "{name}");
            let flat = |x: &Tensor| {
                x.flatten_all()
                    .unwrap()
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap()
            };
            if t.dtype() != DType::I64 {
                assert_eq!(flat(back), flat(t), "{name}");
            } else {
                assert_eq!(
                    back.to_vec1::<i64>().unwrap(),
                    t.to_vec1::<i64>().unwrap(),
                    "{name}"
                );
            }
        }
    }
    let bytes = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + header_len].to_vec()).unwrap();
    let damaged = |name: &str, b: Vec<u8>| -> Result<usize, String> {
        let p = dir.join(name);
        std::fs::write(&p, b).unwrap();
        checkpoint::read(&p)
            .map(|m| m.len())
            .map_err(|e| e.to_string())
    };
    let with_header = |h: &str| {
        let mut b = (h.len() as u64).to_le_bytes().to_vec();
        b.extend(h.as_bytes());
        b.extend(&bytes[8 + header_len..]);
        b
    };
    let mut results = vec![
        ("truncated", damaged("t", bytes[..bytes.len() - 3].to_vec())),
        ("huge header", {
            let mut b = bytes.clone();
            b[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
            damaged("h", b)
        }),
        (
            "another program",
            damaged("o", b"\x89PNG\r\n\x1a\n0000000000000000".to_vec()),
        ),
        ("appended", {
            let mut b = bytes.clone();
            b.extend([0u8; 16]);
            damaged("a", b)
        }),
        (
            "renamed",
            damaged("r", with_header(&header.replace("\"long\"", "\"lone\""))),
        ),
        (
            "swapped",
            damaged(
                "s",
                with_header(
                    &header
                        .replace("\"a.weight\":", "\"x.weight\":")
                        .replace("\"b.weight\":", "\"a.weight\":")
                        .replace("\"x.weight\":", "\"b.weight\":"),
                ),
            ),
        ),
    ];
    for (what, r) in &results {
        assert!(r.is_err(), "{what}: read {r:?}");
        let e = r.as_ref().unwrap_err();
        assert!(
            e.contains(&dir.display().to_string()),
            "{what}: the error does not name the file: {e}"
        );
    }
    // The metadata map removed: what a file of another program looks like; read with a warning.
    let start = header.find("\"__metadata__\"").unwrap();
    let end = header[start..].find('}').unwrap() + start + 2;
    let mut stripped = header.clone();
    stripped.replace_range(start..end, "");
    results.push(("metadata removed", damaged("m", with_header(&stripped))));
    assert_eq!(results.last().unwrap().1, Ok(tensors.len()));
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// 11. FiniteLoss: NaN at step 1, inf from an f16 overflow, a later NaN after an earlier inf
//     (PASSES: held up).
#[test]
fn finite_loss_names_the_first_bad_step_whatever_the_dtype() {
    use candle_parallel::optim::FiniteLoss;
    let mut f = FiniteLoss::new(&CPU).unwrap();
    f.observe(
        &Tensor::new(f32::NAN, &CPU)
            .unwrap()
            .to_dtype(DType::F16)
            .unwrap(),
        1,
    )
    .unwrap();
    let e = f.check().unwrap_err().to_string();
    assert!(e.contains("step 1"), "{e}");
    let mut f = FiniteLoss::new(&CPU).unwrap();
    f.observe(&Tensor::new(1.0f32, &CPU).unwrap(), 1).unwrap();
    // 70000 overflows f16 to +inf.
    let overflow = Tensor::new(&[70000f32, 1.0], &CPU)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    f.observe(&overflow, 2).unwrap();
    f.observe(&Tensor::new(f64::NAN, &CPU).unwrap(), 3).unwrap();
    let e = f.check().unwrap_err().to_string();
    assert!(e.contains("step 2") && e.contains("inf"), "{e}");
    // A finite loss whose sum overflows f64 is not finite either; a bf16 loss checks too.
    let mut f = FiniteLoss::new(&CPU).unwrap();
    f.observe(&Tensor::new(&[1e308f64, 1e308], &CPU).unwrap(), 4)
        .unwrap();
    assert!(f.check().is_err());
    let mut f = FiniteLoss::new(&CPU).unwrap();
    f.observe(
        &Tensor::new(0.25f32, &CPU)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap(),
        5,
    )
    .unwrap();
    f.check().unwrap();
}

// ---------------------------------------------------------------------------------------------
// 12. FSDP no_sync where a unit is used only in the final micro-batch, and another only in the
//     micro-batches under no_sync; against one process (PASSES: held up).
struct Cond {
    a: Unit<Linear>,
    b: Unit<Linear>,
    c: Unit<Linear>,
    head: Linear,
}

impl Module for Cond {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.a.forward(x)?.tanh()?;
        // b only in 3-row micro-batches (the last), c only in 2-row ones (under no_sync).
        let h = match x.dim(0)? {
            3 => self.b.forward(&h)?.tanh()?,
            _ => self.c.forward(&h)?.tanh()?,
        };
        self.head.forward(&h)
    }
}

fn cond(vb: VarBuilder) -> candle_core::Result<Cond> {
    Ok(Cond {
        a: fsdp::unit(vb.pp("a"), |vb| linear(4, 4, vb))?,
        b: fsdp::unit(vb.pp("b"), |vb| linear(4, 4, vb))?,
        c: fsdp::unit(vb.pp("c"), |vb| linear(4, 4, vb))?,
        head: linear(4, 2, vb.pp("head"))?,
    })
}

fn micro(rank: usize, i: usize) -> Tensor {
    rows(7 * rank + i, if i == 2 { 3 } else { 2 }, 4)
}

#[test]
fn fsdp_no_sync_with_units_used_in_some_micro_batches_only_matches_one_process() {
    let sharded = bounded(Duration::from_secs(60), || {
        distributed::spawn_threads(2, |pg| {
            let config = FsdpConfig {
                seed: Some(11),
                ..Default::default()
            };
            let model =
                FullyShardedDataParallel::with_config(&VarMap::new(), &pg, &CPU, config, cond)?;
            let mut opt = sgd(model.parameters(), 0.3);
            for _step in 0..2 {
                let mut grads = None;
                for i in 0..3 {
                    let _local = (i < 2).then(|| model.no_sync());
                    let loss = model
                        .forward_t(&micro(pg.rank(), i), true)?
                        .sqr()?
                        .sum_all()?;
                    grads = Some(model.backward(&loss)?);
                }
                opt.step(&grads.unwrap())?;
            }
            Ok(model
                .full_parameters()?
                .into_iter()
                .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
                .collect::<HashMap<_, _>>())
        })
        .unwrap()
    });
    let varmap = VarMap::new();
    let model = cond(seeded_var_builder(&varmap, 11, DType::F32, &CPU)).unwrap();
    let mut opt = sgd(varmap.all_vars(), 0.3);
    for _step in 0..2 {
        let mut loss = Tensor::new(0f32, &CPU).unwrap();
        for rank in 0..2 {
            for i in 0..3 {
                let l = model
                    .forward(&micro(rank, i))
                    .unwrap()
                    .sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap();
                loss = (loss + (l * 0.5).unwrap()).unwrap();
            }
        }
        opt.step(&loss.backward().unwrap()).unwrap();
    }
    let data = varmap.data().lock().unwrap();
    let mut worst = 0f32;
    for (name, var) in data.iter() {
        let one = var
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let d = max_abs_diff(&[one], &[sharded[0][name].clone()]);
        worst = worst.max(d);
    }
    assert!(
        worst < 1e-5,
        "FSDP no_sync vs one process: max diff {worst}"
    );
}

// ---------------------------------------------------------------------------------------------
// 13. DDP with MixedPrecision::bf16() and sync_batch_norm: trains, the running statistics stay
//     f32 and equal on both ranks, and track the f32 run's within bf16's precision (PASSES:
//     held up).
struct SyncNet {
    fc: Linear,
    bn: candle_parallel::nn::BatchNorm,
}

impl ModuleT for SyncNet {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.bn.forward_t(&self.fc.forward(x)?, train)?.relu()
    }
}

fn sync_norm_run(precision: MixedPrecision) -> Vec<Vec<f32>> {
    bounded(Duration::from_secs(60), move || {
        distributed::spawn_threads(2, |pg| {
            let config = DdpConfig {
                mixed_precision: precision,
                sync_batch_norm: true,
                ..Default::default()
            };
            let varmap = VarMap::new();
            let vb_seed = seeded_var_builder(&varmap, 2, DType::F32, &CPU);
            linear(4, 6, vb_seed.pp("fc"))?;
            let model = DistributedDataParallel::with_config(&varmap, &pg, &CPU, config, |vb| {
                Ok(SyncNet {
                    fc: linear(4, 6, vb.pp("fc"))?,
                    bn: candle_parallel::nn::batch_norm(6, 1e-5, vb.pp("bn"))?,
                })
            })?;
            let mut opt = sgd(model.parameters(), 0.1);
            for step in 0..3 {
                let x = rows(step + 5 * pg.rank(), 6, 4);
                let loss = model.forward_t(&x, true)?.sqr()?.mean_all()?;
                opt.step(&model.backward(&loss)?)?;
            }
            let mean = varmap.data().lock().unwrap()["bn.running_mean"].clone();
            assert_eq!(mean.dtype(), DType::F32);
            Ok(mean.as_tensor().to_vec1::<f32>()?)
        })
        .unwrap()
    })
}

#[test]
fn ddp_bf16_with_sync_batch_norm_tracks_f32() {
    let half = sync_norm_run(MixedPrecision::bf16());
    let full = sync_norm_run(MixedPrecision::default());
    assert_eq!(half[0], half[1], "ranks disagree on the running mean");
    let d = max_abs_diff(&[half[0].clone()], &[full[0].clone()]);
    assert!(d < 2e-2, "bf16 {half:?} vs f32 {full:?}");
}
