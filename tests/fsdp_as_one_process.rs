//! Fully sharded training gives one process's answer (or DDP's, where statistics are per
//! rank), or refuses at once: BatchNorm inside a unit, a frozen layer and an unused root
//! parameter under AdamW's weight decay, a branch skipped on some steps, two training forwards
//! summed into one backward (with units and without), hundreds of units in bf16 and thousands
//! in f16, and rank 0 evaluating alone after the others left.

mod common;

use candle_core::{DType, Device, Module, ModuleT, Tensor};
use candle_nn::{batch_norm, linear, loss, BatchNorm, Linear, Optimizer, VarBuilder, VarMap};
use candle_parallel::distributed::ProcessGroup;
use candle_parallel::fsdp::{self, FsdpConfig, Unit};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
use candle_parallel::{DistributedDataParallel, Error, FullyShardedDataParallel};
use common::models::{share, CLASSES, IN};
use common::{done, is_child, join_child, Ranks};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(120);
const WORLD: usize = 2;
const PER: usize = 6;
const STEPS: usize = 8;
const WIDTH: usize = 9;
const SEED: u64 = 5;
const TOLERANCE: f32 = 1e-5;
const ADAMW: AdamWConfig = AdamWConfig {
    lr: 0.02,
    betas: (0.9, 0.999),
    eps: 1e-8,
    weight_decay: 0.05,
    amsgrad: false,
    maximize: false,
};

type Weights = HashMap<String, Tensor>;

/// SGD beside AdamW: AdamW's step barely depends on a gradient's scale, so a gradient off by a
/// constant factor would pass unseen with AdamW alone.
const SGD: SgdConfig = SgdConfig {
    lr: 0.1,
    momentum: 0.9,
    dampening: 0.0,
    weight_decay: 0.05,
    nesterov: false,
    maximize: false,
};

/// One step of an optimizer of this crate, whichever.
enum Opt {
    AdamW(AdamW),
    Sgd(Sgd),
}

impl Opt {
    fn new(sgd: bool, vars: Vec<candle_core::Var>) -> Self {
        match sgd {
            true => Opt::Sgd(Sgd::new(vars, SGD).unwrap()),
            false => Opt::AdamW(AdamW::new(vars, ADAMW).unwrap()),
        }
    }

    fn step(&mut self, grads: &candle_core::backprop::GradStore) {
        match self {
            Opt::AdamW(o) => o.step(grads).unwrap(),
            Opt::Sgd(o) => o.step(grads).unwrap(),
        }
    }
}

fn max_diff(a: &Weights, b: &Weights) -> f32 {
    let mut names: Vec<&String> = a.keys().collect();
    names.sort();
    let mut other: Vec<&String> = b.keys().collect();
    other.sort();
    assert_eq!(names, other);
    names
        .iter()
        .map(|n| common::max_abs_diff(&a[*n], &b[*n]))
        .fold(0.0, f32::max)
}

fn varmap_weights(varmap: &VarMap) -> Weights {
    varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().copy().unwrap()))
        .collect()
}

// --- BatchNorm inside units -----------------------------------------------------------------

/// `relu(bn(linear(x)))`, a unit.
struct NormBlock {
    fc: Linear,
    bn: BatchNorm,
}

impl ModuleT for NormBlock {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.bn.forward_t(&self.fc.forward(x)?, train)?.relu()
    }
}

fn norm_block(vb: VarBuilder) -> candle_core::Result<NormBlock> {
    Ok(NormBlock {
        fc: linear(WIDTH, WIDTH, vb.pp("fc"))?,
        bn: batch_norm(WIDTH, 1e-5, vb.pp("bn"))?,
    })
}

/// A stem and a head at the root, two BatchNorm blocks as units.
struct NormNet {
    stem: Linear,
    blocks: Vec<Unit<NormBlock>>,
    head: Linear,
}

impl ModuleT for NormNet {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let mut h = self.stem.forward(x)?;
        for b in &self.blocks {
            h = b.forward_t(&h, train)?;
        }
        self.head.forward(&h)
    }
}

fn norm_net(vb: VarBuilder) -> candle_core::Result<NormNet> {
    Ok(NormNet {
        stem: linear(IN, WIDTH, vb.pp("stem"))?,
        blocks: (0..2)
            .map(|i| fsdp::unit(vb.pp(format!("b.{i}")), norm_block))
            .collect::<candle_core::Result<_>>()?,
        head: linear(WIDTH, CLASSES, vb.pp("head"))?,
    })
}

/// Trains `STEPS` steps of DDP or FSDP over the ranks' shares; returns every variable (the
/// running statistics too) and the evaluation output of a fixed batch.
fn train_norm_net(pg: &ProcessGroup, fully_sharded: bool) -> (Weights, Tensor) {
    let eval_x = common::models::batch(77, 5).0;
    if fully_sharded {
        let config = FsdpConfig {
            seed: Some(SEED),
            ..FsdpConfig::default()
        };
        let f = FullyShardedDataParallel::with_config(
            &VarMap::new(),
            pg,
            &Device::Cpu,
            config,
            norm_net,
        )
        .unwrap();
        let mut opt = AdamW::new(f.parameters(), ADAMW).unwrap();
        for step in 0..STEPS {
            let (x, y) = share(step, WORLD, PER, pg.rank());
            let l = loss::cross_entropy(&f.forward_t(&x, true).unwrap(), &y).unwrap();
            opt.step(&f.backward(&l).unwrap()).unwrap();
        }
        let eval = f.forward_t(&eval_x, false).unwrap();
        (f.full_parameters().unwrap().into_iter().collect(), eval)
    } else {
        let varmap = VarMap::new();
        norm_net(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu)).unwrap();
        let m = DistributedDataParallel::new(&varmap, pg, &Device::Cpu, norm_net).unwrap();
        let mut opt = AdamW::new(m.parameters(), ADAMW).unwrap();
        for step in 0..STEPS {
            let (x, y) = share(step, WORLD, PER, pg.rank());
            let l = loss::cross_entropy(&m.forward_t(&x, true).unwrap(), &y).unwrap();
            opt.step(&m.backward(&l).unwrap()).unwrap();
        }
        // Each training forward took rank 0's statistics first (FSDP's too), then updated them
        // with this rank's batch: each rank compares its own.
        let eval = m.forward_t(&eval_x, false).unwrap();
        (varmap_weights(&varmap), eval)
    }
}

#[test]
fn batch_norm_inside_fully_sharded_units_keeps_its_statistics_as_ddp_does() {
    let test = "batch_norm_inside_fully_sharded_units_keeps_its_statistics_as_ddp_does";
    if is_child() {
        let pg = join_child();
        let (ddp, ddp_eval) = train_norm_net(&pg, false);
        let (fsdp, fsdp_eval) = train_norm_net(&pg, true);
        let d = max_diff(&fsdp, &ddp);
        assert!(
            d <= TOLERANCE,
            "rank {}: differs from DDP by {d}",
            pg.rank()
        );
        let d = common::max_abs_diff(&fsdp_eval, &ddp_eval);
        assert!(
            d <= TOLERANCE,
            "rank {}: evaluation differs by {d}",
            pg.rank()
        );
        // The statistics moved: updated once per forward, never decayed.
        let mean = &fsdp["b.0.bn.running_mean"];
        assert!(common::max_abs(mean) > 1e-3, "running mean stayed at 0");
        let var = &fsdp["b.1.bn.running_var"];
        assert!(common::max_abs_diff(var, &var.ones_like().unwrap()) > 1e-3);
        done();
        return;
    }
    Ranks::world(test, WORLD).assert_all_pass(LIMIT);
}

// --- frozen, unused and skipped parameters; two forwards --------------------------------------

/// A unit with a branch that some steps skip.
struct Branchy {
    fc: Linear,
    skip: Linear,
    use_skip: Arc<AtomicBool>,
}

impl Module for Branchy {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.fc.forward(x)?.relu()?;
        match self.use_skip.load(Ordering::SeqCst) {
            true => &h + self.skip.forward(&h)?.tanh()?,
            false => Ok(h),
        }
    }
}

/// A frozen stem (`detach`) and a root layer never used, units (or none), a head.
struct Net {
    stem: Linear,
    _unused: Linear,
    units: Vec<Unit<Branchy>>,
    head: Linear,
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = self.stem.forward(x)?.detach().relu()?;
        for u in &self.units {
            h = u.forward(&h)?;
        }
        self.head.forward(&h)
    }
}

fn net(units: usize, use_skip: Arc<AtomicBool>) -> impl Fn(VarBuilder) -> candle_core::Result<Net> {
    move |vb: VarBuilder| {
        let flag = use_skip.clone();
        Ok(Net {
            stem: linear(IN, WIDTH, vb.pp("stem"))?,
            _unused: linear(WIDTH, WIDTH, vb.pp("unused"))?,
            units: (0..units)
                .map(|i| {
                    let flag = flag.clone();
                    fsdp::unit(vb.pp(format!("u.{i}")), move |vb| {
                        Ok(Branchy {
                            fc: linear(WIDTH, WIDTH, vb.pp("fc"))?,
                            skip: linear(WIDTH, WIDTH, vb.pp("skip"))?,
                            use_skip: flag.clone(),
                        })
                    })
                })
                .collect::<candle_core::Result<_>>()?,
            head: linear(WIDTH, CLASSES, vb.pp("head"))?,
        })
    }
}

/// The loss of step `step`: one forward over the batch, or (`two_forwards`) the sum of two
/// forwards over its halves, each scaled to give the same loss as one.
fn step_loss(
    forward: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>,
    x: &Tensor,
    y: &Tensor,
    two_forwards: bool,
) -> candle_core::Result<Tensor> {
    if !two_forwards {
        return loss::cross_entropy(&forward(x)?, y);
    }
    let half = x.dim(0)? / 2;
    let first = loss::cross_entropy(&forward(&x.narrow(0, 0, half)?)?, &y.narrow(0, 0, half)?)?;
    let second = loss::cross_entropy(
        &forward(&x.narrow(0, half, half)?)?,
        &y.narrow(0, half, half)?,
    )?;
    (first + second)? / 2.0
}

fn skipped_at(step: usize) -> bool {
    step % 3 == 1
}

/// One process over the whole batches.
fn one_process(units: usize, two_forwards: bool, sgd: bool) -> Weights {
    let flag = Arc::new(AtomicBool::new(true));
    let varmap = VarMap::new();
    let m = net(units, flag.clone())(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu))
        .unwrap();
    let mut opt = Opt::new(sgd, varmap.all_vars());
    for step in 0..STEPS {
        flag.store(!skipped_at(step), Ordering::SeqCst);
        // Each rank's share is two halves; one process takes the ranks' halves in order.
        let (x, y) = share(step, 1, WORLD * PER, 0);
        let l = if two_forwards {
            let mut parts = Vec::new();
            for r in 0..WORLD {
                let (x, y) = (
                    x.narrow(0, r * PER, PER).unwrap(),
                    y.narrow(0, r * PER, PER).unwrap(),
                );
                parts.push(step_loss(&|x| m.forward(x), &x, &y, true).unwrap());
            }
            (Tensor::stack(&parts, 0).unwrap().sum_all().unwrap() / WORLD as f64).unwrap()
        } else {
            step_loss(&|x| m.forward(x), &x, &y, false).unwrap()
        };
        opt.step(&l.backward().unwrap());
    }
    varmap_weights(&varmap)
}

fn fully_sharded(pg: &ProcessGroup, units: usize, two_forwards: bool, sgd: bool) -> Weights {
    let flag = Arc::new(AtomicBool::new(true));
    let varmap = VarMap::new();
    net(units, flag.clone())(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu)).unwrap();
    let config = FsdpConfig {
        frozen_parameters: vec!["stem".into(), "unused".into()],
        ..FsdpConfig::default()
    };
    let f = FullyShardedDataParallel::with_config(
        &varmap,
        pg,
        &Device::Cpu,
        config,
        net(units, flag.clone()),
    )
    .unwrap();
    // An optimizer over the VarMap's parameters would never train: refused.
    let err = AdamW::new(varmap.all_vars(), ADAMW)
        .unwrap_err()
        .to_string();
    assert!(err.contains("FullyShardedDataParallel"), "{err}");
    let mut opt = Opt::new(sgd, f.parameters());
    for step in 0..STEPS {
        flag.store(!skipped_at(step), Ordering::SeqCst);
        let (x, y) = share(step, WORLD, PER, pg.rank());
        let forward = |x: &Tensor| f.forward_t(x, true).map_err(Error::into_candle);
        let l = step_loss(&forward, &x, &y, two_forwards).unwrap();
        let grads = f.backward(&l).unwrap();
        // The frozen stem and the unused root layer get no gradient on any rank.
        for (p, name) in f.parameters().iter().zip(f.parameter_names()) {
            let frozen = name.starts_with("stem") || name.starts_with("unused");
            let skipped = name.contains(".skip.") && skipped_at(step);
            assert_eq!(
                grads.get(p.as_tensor()).is_none(),
                frozen || skipped,
                "step {step}: {name}"
            );
        }
        opt.step(&grads);
    }
    f.full_parameters().unwrap().into_iter().collect()
}

#[test]
fn frozen_unused_and_skipped_parameters_and_two_forwards_train_as_one_process() {
    let test = "frozen_unused_and_skipped_parameters_and_two_forwards_train_as_one_process";
    if is_child() {
        let pg = join_child();
        for (units, two_forwards, sgd) in [
            (2, false, false),
            (2, true, false),
            (0, false, false),
            (0, true, false),
            (2, false, true),
            (0, true, true),
        ] {
            let want = one_process(units, two_forwards, sgd);
            let got = fully_sharded(&pg, units, two_forwards, sgd);
            let d = max_diff(&got, &want);
            assert!(
                d <= TOLERANCE,
                "rank {} ({units} units, two forwards: {two_forwards}, SGD: {sgd}): \
                 differs by {d}",
                pg.rank()
            );
            // Frozen and unused layers are where they started.
            let start = {
                let varmap = VarMap::new();
                net(units, Arc::new(AtomicBool::new(true)))(seeded_var_builder(
                    &varmap,
                    SEED,
                    DType::F32,
                    &Device::Cpu,
                ))
                .unwrap();
                varmap_weights(&varmap)
            };
            for name in ["stem.weight", "stem.bias", "unused.weight", "unused.bias"] {
                assert_eq!(
                    common::max_abs_diff(&got[name], &start[name]),
                    0.0,
                    "{name}"
                );
            }
        }
        done();
        return;
    }
    Ranks::world(test, WORLD).assert_all_pass(LIMIT);
}

// --- many units in half precision -----------------------------------------------------------

/// `units` tiny units in a chain, each squashed so that the values stay finite.
struct Chain(Vec<Unit<Linear>>);

impl Module for Chain {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.0
            .iter()
            .try_fold(x.clone(), |h, u| u.forward(&h)?.tanh())
    }
}

fn chain(units: usize) -> impl Fn(VarBuilder) -> candle_core::Result<Chain> {
    move |vb: VarBuilder| {
        let units = (0..units)
            .map(|i| fsdp::unit(vb.pp(format!("h.{i}")), |vb| linear(2, 2, vb)))
            .collect::<candle_core::Result<_>>()?;
        Ok(Chain(units))
    }
}

#[test]
fn more_units_than_half_precision_counts_exactly_train_as_ddp() {
    let test = "more_units_than_half_precision_counts_exactly_train_as_ddp";
    if is_child() {
        let pg = join_child();
        // bf16 counts integers exactly to 256, f16 to 2048: the units' numbers must still tell
        // them apart.
        for (dtype, units) in [(DType::BF16, 300), (DType::F16, 2100)] {
            let x = Tensor::ones((3, 2), dtype, &Device::Cpu).unwrap();
            let config = FsdpConfig {
                dtype,
                seed: Some(SEED),
                ..FsdpConfig::default()
            };
            let f = FullyShardedDataParallel::with_config(
                &VarMap::new(),
                &pg,
                &Device::Cpu,
                config,
                chain(units),
            )
            .unwrap();
            let l = f
                .forward_t(&x, true)
                .unwrap()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap();
            let grads = f.backward(&l).unwrap();
            let pieces = f.parameters();
            assert!(pieces.iter().all(|p| grads.get(p.as_tensor()).is_some()));
            let varmap = VarMap::new();
            chain(units)(seeded_var_builder(&varmap, SEED, dtype, &Device::Cpu)).unwrap();
            let ddp =
                DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, chain(units)).unwrap();
            let want = ddp
                .forward_t(&x, true)
                .unwrap()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap();
            let scalar = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_scalar::<f32>().unwrap();
            assert_eq!(scalar(&l), scalar(&want), "{dtype:?} with {units} units");
        }
        done();
        return;
    }
    Ranks::world(test, WORLD).assert_all_pass(LIMIT);
}

// --- evaluation on one rank -----------------------------------------------------------------

#[test]
fn rank_0_evaluating_alone_after_the_others_left_fails_at_once_naming_them() {
    let test = "rank_0_evaluating_alone_after_the_others_left_fails_at_once_naming_them";
    if is_child() {
        let pg = join_child();
        let flag = Arc::new(AtomicBool::new(true));
        let config = FsdpConfig {
            seed: Some(SEED),
            frozen_parameters: vec!["stem".into(), "unused".into()],
            ..FsdpConfig::default()
        };
        let f = FullyShardedDataParallel::with_config(
            &VarMap::new(),
            &pg,
            &Device::Cpu,
            config,
            net(2, flag),
        )
        .unwrap();
        let mut opt = AdamW::new(f.parameters(), ADAMW).unwrap();
        let (x, y) = share(0, WORLD, PER, pg.rank());
        let l = loss::cross_entropy(&f.forward_t(&x, true).unwrap(), &y).unwrap();
        opt.step(&f.backward(&l).unwrap()).unwrap();
        if pg.rank() == 0 {
            std::thread::sleep(Duration::from_millis(300));
            let started = Instant::now();
            let err = f.forward_t(&x, false).unwrap_err();
            let waited = started.elapsed();
            assert!(
                matches!(err, Error::PeerLost { rank: 1, .. })
                    && err.to_string().contains("run it on every rank"),
                "{err}"
            );
            assert!(waited < Duration::from_secs(10), "took {waited:?}");
        }
        done();
        return;
    }
    Ranks::world(test, WORLD).assert_all_pass(LIMIT);
}
