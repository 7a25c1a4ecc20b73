//! Sharded training gives one process's answer, or refuses at once: ZeRO-2 (and plain DDP
//! beside it) against one process over the same batches, with what users do every day: a
//! layer frozen by `detach`, a branch skipped on some steps, evaluations between backward and
//! step and after it, rank 0 reading the model alone at the end, an optimizer over the whole
//! parameters, checkpoints of models with frozen parameters and in bf16, checkpoints inside
//! `join`. Two real processes on 127.0.0.1 each time.

mod common;

use candle_core::{DType, Device, Module, ModuleT, Tensor, Var};
use candle_nn::{linear, loss, Linear, Optimizer, VarBuilder, VarMap};
use candle_parallel::ddp::{DdpConfig, JoinDivisor, Sharding};
use candle_parallel::distributed::ProcessGroup;
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{AdamW, AdamWConfig, ElementwiseOptimizer, Sgd, SgdConfig};
use candle_parallel::{DistributedDataParallel, Error};
use common::models::{max_diff, share, values, CLASSES, IN};
use common::{done, is_child, join_child, Ranks};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(120);
const WORLD: usize = 2;
const PER: usize = 6;
const STEPS: usize = 10;
const HIDDEN: usize = 11;
const TOLERANCE: f32 = 1e-5;
const ADAMW: AdamWConfig = AdamWConfig {
    lr: 0.02,
    betas: (0.9, 0.999),
    eps: 1e-8,
    weight_decay: 0.05,
    amsgrad: false,
    maximize: false,
};
const SGD: SgdConfig = SgdConfig {
    lr: 0.05,
    momentum: 0.9,
    dampening: 0.0,
    weight_decay: 0.05,
    nesterov: true,
    maximize: false,
};

/// A perceptron with a layer frozen by `detach` in front and a branch that steps skip.
struct Probe {
    frozen: Linear,
    l1: Linear,
    branch: Linear,
    head: Linear,
    use_branch: Arc<AtomicBool>,
}

impl ModuleT for Probe {
    fn forward_t(&self, x: &Tensor, _train: bool) -> candle_core::Result<Tensor> {
        let h = self.frozen.forward(x)?.detach().relu()?;
        let mut h = self.l1.forward(&h)?.relu()?;
        if self.use_branch.load(Ordering::SeqCst) {
            h = (&h + self.branch.forward(&h)?.tanh()?)?;
        }
        self.head.forward(&h)
    }
}

fn probe(use_branch: Arc<AtomicBool>) -> impl Fn(VarBuilder) -> candle_core::Result<Probe> {
    move |vb: VarBuilder| {
        Ok(Probe {
            frozen: linear(IN, HIDDEN, vb.pp("frozen"))?,
            l1: linear(HIDDEN, HIDDEN, vb.pp("l1"))?,
            branch: linear(HIDDEN, HIDDEN, vb.pp("branch"))?,
            head: linear(HIDDEN, CLASSES, vb.pp("head"))?,
            use_branch: use_branch.clone(),
        })
    }
}

/// Whether step `step` runs the branch (on every rank alike).
fn branch_at(step: usize) -> bool {
    step % 3 != 1
}

/// The rows every evaluation runs on.
fn probe_batch() -> Tensor {
    common::models::batch(999, 5).0
}

/// Which optimizer a run trains with.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Which {
    /// This crate's AdamW (gathers at the end of each step under ZeRO-2).
    AdamW,
    /// This crate's SGD with momentum and Nesterov.
    Sgd,
    /// candle-nn's AdamW: does not gather; the model is behind until a gather.
    CandleAdamW,
}

enum Opt {
    AdamW(AdamW),
    Sgd(Sgd),
    Candle(candle_nn::AdamW),
}

impl Opt {
    fn new(which: Which, vars: Vec<Var>) -> candle_core::Result<Self> {
        Ok(match which {
            Which::AdamW => Opt::AdamW(AdamW::new(vars, ADAMW)?),
            Which::Sgd => Opt::Sgd(Sgd::new(vars, SGD)?),
            Which::CandleAdamW => {
                let params = candle_nn::ParamsAdamW {
                    lr: ADAMW.lr,
                    weight_decay: ADAMW.weight_decay,
                    ..Default::default()
                };
                Opt::Candle(candle_nn::AdamW::new(vars, params)?)
            }
        })
    }

    fn step(&mut self, grads: &candle_core::backprop::GradStore) -> candle_core::Result<()> {
        match self {
            Opt::AdamW(o) => o.step(grads),
            Opt::Sgd(o) => o.step(grads),
            Opt::Candle(o) => o.step(grads),
        }
    }
}

/// What a run saw: the evaluation outputs before and after each step, and the final weights.
struct Seen {
    before_step: Vec<Tensor>,
    after_step: Vec<Tensor>,
    weights: common::models::Values,
}

/// One process over the whole batches.
fn one_process(which: Which) -> Seen {
    let flag = Arc::new(AtomicBool::new(true));
    let varmap = VarMap::new();
    let model =
        probe(flag.clone())(seeded_var_builder(&varmap, 3, DType::F32, &Device::Cpu)).unwrap();
    let mut opt = Opt::new(which, varmap.all_vars()).unwrap();
    let (mut before_step, mut after_step) = (Vec::new(), Vec::new());
    for step in 0..STEPS {
        flag.store(branch_at(step), Ordering::SeqCst);
        let (x, y) = share(step, 1, WORLD * PER, 0);
        let l = loss::cross_entropy(&model.forward_t(&x, true).unwrap(), &y).unwrap();
        let grads = l.backward().unwrap();
        before_step.push(model.forward_t(&probe_batch(), false).unwrap());
        opt.step(&grads).unwrap();
        after_step.push(model.forward_t(&probe_batch(), false).unwrap());
    }
    Seen {
        before_step,
        after_step,
        weights: values(&varmap),
    }
}

fn ddp_config(sharding: Sharding) -> DdpConfig {
    DdpConfig {
        bucket_cap_mb: 2e-4,
        first_bucket_mb: 1e-4,
        sharding,
        frozen_parameters: vec!["frozen".into()],
        ..DdpConfig::default()
    }
}

/// `WORLD` ranks over their shares of the same batches, evaluating between backward and step
/// and after the step; rank 1 leaves at the end while rank 0 reads the model alone.
fn ranks(pg: &ProcessGroup, sharding: Sharding, which: Which) -> Option<Seen> {
    let flag = Arc::new(AtomicBool::new(true));
    let varmap = VarMap::new();
    probe(flag.clone())(seeded_var_builder(&varmap, 3, DType::F32, &Device::Cpu)).unwrap();
    let model = DistributedDataParallel::with_config(
        &varmap,
        pg,
        &Device::Cpu,
        ddp_config(sharding),
        probe(flag.clone()),
    )
    .unwrap();
    let mut opt = Opt::new(which, model.parameters()).unwrap();
    let (mut before_step, mut after_step) = (Vec::new(), Vec::new());
    let behind = sharding == Sharding::Zero2 && which == Which::CandleAdamW;
    for step in 0..STEPS {
        flag.store(branch_at(step), Ordering::SeqCst);
        let (x, y) = share(step, WORLD, PER, pg.rank());
        let l = loss::cross_entropy(&model.forward_t(&x, true).unwrap(), &y).unwrap();
        let grads = model.backward(&l).unwrap();
        // An optimizer that does not gather (candle-nn's): an evaluation after a backward is
        // refused at once (another rank's pieces may have moved), before the step as after,
        // and works after a gather on every rank.
        let evaluate = |model: &DistributedDataParallel<Probe>| {
            let out = model.forward_t(&probe_batch(), false);
            if !behind {
                return out.unwrap();
            }
            match out {
                Err(Error::StaleParameters { rank, .. }) => assert_eq!(rank, pg.rank()),
                other => panic!("expected StaleParameters, got {:?}", other.map(|_| ())),
            }
            model.gather_parameters().unwrap();
            model.forward_t(&probe_batch(), false).unwrap()
        };
        before_step.push(evaluate(&model));
        opt.step(&grads).unwrap();
        after_step.push(evaluate(&model));
    }
    if pg.rank() != 0 {
        // Rank 1 is done; rank 0 evaluates and reads the model on its own.
        return None;
    }
    std::thread::sleep(Duration::from_millis(100));
    let alone = model.module().forward_t(&probe_batch(), false).unwrap();
    let through = model.forward_t(&probe_batch(), false).unwrap();
    assert_eq!(common::max_abs_diff(&alone, &through), 0.0);
    assert_eq!(
        common::max_abs_diff(&alone, after_step.last().unwrap()),
        0.0
    );
    Some(Seen {
        before_step,
        after_step,
        weights: values(&varmap),
    })
}

fn compare(got: &Seen, want: &Seen, what: &str) {
    for (step, (g, w)) in got.before_step.iter().zip(&want.before_step).enumerate() {
        let d = common::max_abs_diff(g, w);
        assert!(
            d <= TOLERANCE,
            "{what}: evaluation before step {step} differs by {d}"
        );
    }
    for (step, (g, w)) in got.after_step.iter().zip(&want.after_step).enumerate() {
        let d = common::max_abs_diff(g, w);
        assert!(
            d <= TOLERANCE,
            "{what}: evaluation after step {step} differs by {d}"
        );
    }
    let d = max_diff(&got.weights, &want.weights);
    assert!(d <= TOLERANCE, "{what}: the final weights differ by {d}");
}

#[test]
fn zero2_with_a_frozen_layer_a_skipped_branch_and_evaluations_trains_as_one_process() {
    let test = "zero2_with_a_frozen_layer_a_skipped_branch_and_evaluations_trains_as_one_process";
    if is_child() {
        let pg = join_child();
        for which in [Which::AdamW, Which::Sgd, Which::CandleAdamW] {
            let want = one_process(which);
            for sharding in [Sharding::None, Sharding::Zero2] {
                if let Some(got) = ranks(&pg, sharding, which) {
                    compare(&got, &want, &format!("{sharding:?} with {which:?}"));
                    // The frozen layer is exactly where it started.
                    let start = VarMap::new();
                    probe(Arc::new(AtomicBool::new(true)))(seeded_var_builder(
                        &start,
                        3,
                        DType::F32,
                        &Device::Cpu,
                    ))
                    .unwrap();
                    let frozen = |v: &common::models::Values| {
                        v.iter()
                            .filter(|(n, _)| n.starts_with("frozen"))
                            .cloned()
                            .collect::<Vec<_>>()
                    };
                    let moved = max_diff(&frozen(&got.weights), &frozen(&values(&start)));
                    assert_eq!(moved, 0.0, "{sharding:?} with {which:?}: frozen moved");
                }
                // Both ranks start the next run together.
                pg.barrier().unwrap();
            }
        }
        done();
        return;
    }
    Ranks::world(test, WORLD).assert_all_pass(LIMIT);
}

#[test]
fn an_optimizer_of_this_crate_over_the_whole_parameters_is_refused_under_zero2() {
    let test = "an_optimizer_of_this_crate_over_the_whole_parameters_is_refused_under_zero2";
    if is_child() {
        candle_parallel::logging::init();
        let pg = join_child();
        let flag = Arc::new(AtomicBool::new(true));
        let varmap = VarMap::new();
        let model = DistributedDataParallel::with_config(
            &varmap,
            &pg,
            &Device::Cpu,
            ddp_config(Sharding::Zero2),
            probe(flag),
        )
        .unwrap();
        for which in [Which::AdamW, Which::Sgd] {
            let err = Opt::new(which, varmap.all_vars())
                .err()
                .unwrap()
                .to_string();
            assert!(
                err.contains("a whole parameter of DistributedDataParallel with Sharding::Zero2")
                    && err.contains("model.parameters()"),
                "{err}"
            );
        }
        // An optimizer made before the wrapper is refused at its first step.
        let early_map = VarMap::new();
        probe(Arc::new(AtomicBool::new(true)))(seeded_var_builder(
            &early_map,
            1,
            DType::F32,
            &Device::Cpu,
        ))
        .unwrap();
        let mut early = AdamW::new(early_map.all_vars(), ADAMW).unwrap();
        let wrapped = DistributedDataParallel::with_config(
            &early_map,
            &pg,
            &Device::Cpu,
            ddp_config(Sharding::Zero2),
            probe(Arc::new(AtomicBool::new(true))),
        )
        .unwrap();
        let (x, y) = share(0, WORLD, PER, pg.rank());
        let l = loss::cross_entropy(&wrapped.forward_t(&x, true).unwrap(), &y).unwrap();
        let grads = wrapped.backward(&l).unwrap();
        let err = early.step(&grads).unwrap_err().to_string();
        assert!(err.contains("model.parameters()"), "{err}");
        // candle-nn's optimizers cannot be checked: the next training forward says that no
        // piece moved (see the parent's check of the log).
        let mut candle = Opt::new(Which::CandleAdamW, varmap.all_vars()).unwrap();
        for step in 0..2 {
            let (x, y) = share(step, WORLD, PER, pg.rank());
            let l = loss::cross_entropy(&model.forward_t(&x, true).unwrap(), &y).unwrap();
            candle.step(&model.backward(&l).unwrap()).unwrap();
        }
        done();
        return;
    }
    let out = Ranks::world(test, WORLD).assert_all_pass(LIMIT);
    assert!(
        out[0].contains("no parameter's piece changed between the last backward and this forward"),
        "{}",
        out[0]
    );
}

/// A bf16 model (plain DDP) whose frozen layer has no optimizer state: a sharded save and a
/// consolidated one, each loaded by one process and by ZeRO-2, which go on as if never stopped.
fn frozen_state_round_trip(pg: &ProcessGroup, dir: &std::path::Path, dtype: DType) {
    let flag = Arc::new(AtomicBool::new(true));
    let fresh = |sharding: Sharding, seed: u64| {
        let varmap = VarMap::new();
        probe(flag.clone())(seeded_var_builder(&varmap, seed, dtype, &Device::Cpu)).unwrap();
        let config = DdpConfig {
            dtype,
            ..ddp_config(sharding)
        };
        let model = DistributedDataParallel::with_config(
            &varmap,
            pg,
            &Device::Cpu,
            config,
            probe(flag.clone()),
        )
        .unwrap();
        let opt = AdamW::new(model.parameters(), ADAMW).unwrap();
        (varmap, model, opt)
    };
    let train = |model: &DistributedDataParallel<Probe>, opt: &mut AdamW, steps| {
        for step in steps {
            flag.store(branch_at(step), Ordering::SeqCst);
            let (x, y) = share(step, WORLD, PER, pg.rank());
            let x = x.to_dtype(dtype).unwrap();
            let l = loss::cross_entropy(&model.forward_t(&x, true).unwrap(), &y).unwrap();
            opt.step(&model.backward(&l).unwrap()).unwrap();
        }
    };
    let (varmap, model, mut opt) = fresh(Sharding::None, 3);
    train(&model, &mut opt, 0..STEPS);
    let want = values(&varmap);
    for (save, load) in [
        (Sharding::None, Sharding::None),
        (Sharding::None, Sharding::Zero2),
        (Sharding::Zero2, Sharding::None),
        (Sharding::Zero2, Sharding::Zero2),
    ] {
        let (_, model, mut opt) = fresh(save, 3);
        train(&model, &mut opt, 0..STEPS / 2);
        // The frozen layer and a branch skipped so far have no state.
        assert!(opt.state().per_var.iter().any(|m| m.is_empty()));
        let file = dir.join(format!("{dtype:?}-{save:?}.safetensors"));
        let folder = dir.join(format!("{dtype:?}-{save:?}"));
        model.save_checkpoint(&opt, &file).unwrap();
        model.save_sharded_checkpoint(&opt, &folder).unwrap();
        for sharded in [false, true] {
            let (varmap, model, mut opt) = fresh(load, 11);
            match sharded {
                false => model.load_checkpoint(&mut opt, &file).unwrap(),
                true => model.load_sharded_checkpoint(&mut opt, &folder).unwrap(),
            }
            train(&model, &mut opt, STEPS / 2..STEPS);
            let d = max_diff(&values(&varmap), &want);
            assert!(
                d == 0.0,
                "{dtype:?}: saved under {save:?}, loaded under {load:?} (sharded file: \
                 {sharded}): differs by {d}"
            );
        }
    }
}

#[test]
fn checkpoints_of_models_with_frozen_parameters_resume_in_f32_and_bf16_under_any_sharding() {
    let test =
        "checkpoints_of_models_with_frozen_parameters_resume_in_f32_and_bf16_under_any_sharding";
    if is_child() {
        let pg = join_child();
        let dir = std::path::PathBuf::from(std::env::var("CP_DIR").unwrap());
        for dtype in [DType::F32, DType::BF16] {
            frozen_state_round_trip(&pg, &dir, dtype);
        }
        done();
        return;
    }
    let dir = common::temp_dir("frozen-state");
    let port = common::free_port();
    let envs = (0..WORLD)
        .map(|r| {
            let mut e = common::rank_env(r, WORLD, port);
            e.push(("CP_DIR".to_string(), dir.display().to_string()));
            e
        })
        .collect();
    Ranks::start(test, envs).assert_all_pass(LIMIT);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn collectives_other_than_training_inside_join_are_refused_at_once_on_the_calling_rank() {
    let test =
        "collectives_other_than_training_inside_join_are_refused_at_once_on_the_calling_rank";
    if is_child() {
        let pg = join_child();
        let dir = common::temp_dir(&format!("join-refusal-{}", pg.rank()));
        for sharding in [Sharding::None, Sharding::Zero2] {
            let flag = Arc::new(AtomicBool::new(true));
            let varmap = VarMap::new();
            let model = DistributedDataParallel::with_config(
                &varmap,
                &pg,
                &Device::Cpu,
                ddp_config(sharding),
                probe(flag),
            )
            .unwrap();
            let mut opt = AdamW::new(model.parameters(), ADAMW).unwrap();
            // Rank 1 runs out of batches at once and shadows; rank 0 tries to save mid-way.
            let batches = if pg.rank() == 0 { 2 } else { 0 };
            let file = dir.join("inside.safetensors");
            let outcome = model.join(&mut opt, JoinDivisor::World, |opt| {
                for step in 0..batches {
                    let (x, y) = share(step, WORLD, PER, pg.rank());
                    let l = loss::cross_entropy(&model.forward_t(&x, true)?, &y)?;
                    opt.step(&model.backward(&l)?)?;
                    let refusals = [
                        model.save_checkpoint(opt, &file).err(),
                        model.save_sharded_checkpoint(opt, &dir).err(),
                        model.gather_parameters().err(),
                        model.sync_buffers().err(),
                    ];
                    for err in refusals {
                        let err = err.expect("refused inside join").to_string();
                        assert!(
                            err.contains("rank 0: ") && err.contains("after join returns"),
                            "{err}"
                        );
                    }
                }
                Ok(())
            });
            outcome.unwrap();
            // After join, the same calls work on every rank.
            model.save_checkpoint(&opt, &file).unwrap();
            model.gather_parameters().unwrap();
        }
        let _ = std::fs::remove_dir_all(&dir);
        done();
        return;
    }
    Ranks::world(test, WORLD).assert_all_pass(LIMIT);
}
