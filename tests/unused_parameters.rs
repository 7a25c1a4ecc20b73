//! Parameters without a gradient: DistributedDataParallel names and reports those that got a
//! gradient on no rank (candle-nn's fused layer_norm has no backward, candle #2168), leaves
//! them without a gradient (so that AdamW does not move them), and keeps today's rule for a
//! branch taken on some ranks only. Over real processes on 127.0.0.1, whose logger prints the
//! report on stderr, and over thread ranks where no log line is checked.

mod common;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{layer_norm, linear, AdamW, LayerNorm, Linear, Optimizer, ParamsAdamW};
use candle_nn::{VarBuilder, VarMap};
use candle_parallel::ddp::{named_vars_without_gradient, DdpConfig, UnusedReport};
use candle_parallel::distributed::{self, ProcessGroup, ReduceOp};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{Sgd, SgdConfig};
use candle_parallel::rng::Rng;
use candle_parallel::{vars_without_gradient, DistributedDataParallel, Error};
use common::{done, free_port, is_child, join_child, max_abs_diff, rank_env, Ranks};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(120);
const IN: usize = 6;
const HIDDEN: usize = 8;
const OUT: usize = 3;
const PER: usize = 4;
/// What the report says, whatever the parameters.
const REPORT: &str = "got no gradient on any rank";
/// candle-nn's layer_norm stops the gradient of its own parameters and of everything below it.
const BELOW_LAYER_NORM: [&str; 4] = ["l1.bias", "l1.weight", "ln.bias", "ln.weight"];

/// `linear -> norm -> linear`, the model of issue 17.
struct Stack<N> {
    l1: Linear,
    norm: N,
    l2: Linear,
}

fn candle_nn_stack(vb: VarBuilder) -> candle_core::Result<Stack<LayerNorm>> {
    Ok(Stack {
        l1: linear(IN, HIDDEN, vb.pp("l1"))?,
        norm: layer_norm(HIDDEN, 1e-5, vb.pp("ln"))?,
        l2: linear(HIDDEN, OUT, vb.pp("l2"))?,
    })
}

impl<N: Module> Module for Stack<N> {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // A linear layer's output is contiguous: candle-nn's LayerNorm takes its fused path.
        x.apply(&self.l1)?.apply(&self.norm)?.apply(&self.l2)
    }
}

/// Rank `rank`'s share of step `step`'s batch of `world * PER` rows (inputs, targets).
fn share(step: usize, world: usize, rank: usize) -> (Tensor, Tensor) {
    let rows = world * PER;
    let mut rng = Rng::new(500 + step as u64);
    let xs: Vec<f32> = (0..rows * IN).map(|_| rng.normal() as f32).collect();
    let ys: Vec<f32> = (0..rows * OUT).map(|_| rng.normal() as f32).collect();
    let x = Tensor::from_vec(xs, (rows, IN), &Device::Cpu).unwrap();
    let y = Tensor::from_vec(ys, (rows, OUT), &Device::Cpu).unwrap();
    (
        x.narrow(0, rank * PER, PER).unwrap(),
        y.narrow(0, rank * PER, PER).unwrap(),
    )
}

fn mse(out: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    (out - y)?.sqr()?.mean_all()
}

fn var(varmap: &VarMap, name: &str) -> Tensor {
    varmap.data().lock().unwrap()[name]
        .as_tensor()
        .copy()
        .unwrap()
}

const SGD: SgdConfig = SgdConfig {
    lr: 0.1,
    momentum: 0.0,
    dampening: 0.0,
    weight_decay: 0.0,
    nesterov: false,
    maximize: false,
};

/// Trains `build`'s model over `varmap` under DDP for 3 steps.
fn train_stack<M: Module>(
    pg: &ProcessGroup,
    varmap: &VarMap,
    config: DdpConfig,
    build: impl Fn(VarBuilder) -> candle_core::Result<M>,
) -> DistributedDataParallel<M> {
    let model =
        DistributedDataParallel::with_config(varmap, pg, &Device::Cpu, config, build).unwrap();
    let mut opt = Sgd::new(model.parameters(), SGD).unwrap();
    for step in 0..3 {
        let (x, y) = share(step, pg.world_size(), pg.rank());
        let l = mse(&model.forward_t(&x, true).unwrap(), &y).unwrap();
        let grads = model.backward(&l).unwrap();
        opt.step(&grads).unwrap();
    }
    model
}

/// Starts `world` child ranks of `test`, each with the logger at `info`.
fn ranks_with_logger(test: &str, world: usize) -> Ranks {
    let port = free_port();
    let envs = (0..world)
        .map(|r| {
            let mut env = rank_env(r, world, port);
            env.push(("RUST_LOG".into(), "info".into()));
            env
        })
        .collect();
    Ranks::start(test, envs)
}

#[test]
fn candle_nns_layer_norm_freezes_the_layer_below_and_rank_0_names_it_once() {
    let test = "candle_nns_layer_norm_freezes_the_layer_below_and_rank_0_names_it_once";
    if is_child() {
        candle_parallel::logging::init();
        let pg = join_child();
        let varmap = VarMap::new();
        let model =
            DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, candle_nn_stack).unwrap();
        let mut opt = Sgd::new(model.parameters(), SGD).unwrap();
        let (w1, w2) = (var(&varmap, "l1.weight"), var(&varmap, "l2.weight"));
        for step in 0..3 {
            let (x, y) = share(step, 2, pg.rank());
            let l = mse(&model.forward_t(&x, true).unwrap(), &y).unwrap();
            let grads = model.backward(&l).unwrap();
            for (name, v) in model.parameter_names().iter().zip(model.parameters()) {
                let below = BELOW_LAYER_NORM.contains(&name.as_str());
                assert_eq!(grads.get(&v).is_none(), below, "{name}");
            }
            opt.step(&grads).unwrap();
            assert_eq!(model.unused_parameters(), BELOW_LAYER_NORM);
        }
        assert_eq!(max_abs_diff(&var(&varmap, "l1.weight"), &w1), 0.0);
        assert!(max_abs_diff(&var(&varmap, "l2.weight"), &w2) > 0.0);
        done();
        return;
    }
    let out = ranks_with_logger(test, 2).assert_all_pass(LIMIT);
    // Once, from rank 0, through the logger, naming the four in order.
    assert_eq!(out[0].matches(REPORT).count(), 1, "{}", out[0]);
    let line = out[0].lines().find(|l| l.contains(REPORT)).unwrap();
    assert!(
        line.starts_with("WARN candle_parallel::ddp"),
        "not a log warning: {line}"
    );
    assert!(
        line.contains("4 parameters got no gradient")
            && line.contains("`l1.bias`, `l1.weight`, `ln.bias`, `ln.weight`.")
            && line.contains("#2168")
            && line.contains("candle_parallel::nn")
            && line.contains("detach()"),
        "{line}"
    );
    assert!(!out[1].contains(REPORT), "rank 1 reported too:\n{}", out[1]);
}

/// The same model with candle_parallel's layer_norm, which has a backward.
fn our_stack(vb: VarBuilder) -> candle_core::Result<Stack<candle_parallel::nn::LayerNorm>> {
    Ok(Stack {
        l1: linear(IN, HIDDEN, vb.pp("l1"))?,
        norm: candle_parallel::nn::layer_norm(HIDDEN, 1e-5, vb.pp("ln"))?,
        l2: linear(HIDDEN, OUT, vb.pp("l2"))?,
    })
}

#[test]
fn with_candle_parallels_layer_norm_every_parameter_trains_and_nothing_is_reported() {
    let test = "with_candle_parallels_layer_norm_every_parameter_trains_and_nothing_is_reported";
    if is_child() {
        candle_parallel::logging::init();
        let pg = join_child();
        let varmap = VarMap::new();
        our_stack(seeded_var_builder(&varmap, 3, DType::F32, &Device::Cpu)).unwrap();
        let before: Vec<Tensor> = BELOW_LAYER_NORM.iter().map(|n| var(&varmap, n)).collect();
        // Every rank starts from these values: DDP's broadcast leaves them as they are.
        let model = train_stack(&pg, &varmap, DdpConfig::default(), our_stack);
        assert!(model.unused_parameters().is_empty());
        for (name, was) in BELOW_LAYER_NORM.iter().zip(&before) {
            assert!(
                max_abs_diff(&var(&varmap, name), was) > 0.0,
                "{name} did not move"
            );
        }
        done();
        return;
    }
    let out = ranks_with_logger(test, 2).assert_all_pass(LIMIT);
    for (rank, o) in out.iter().enumerate() {
        assert!(!o.contains(REPORT), "rank {rank} reported:\n{o}");
    }
}

/// Two heads, of which a rank uses one (`head_b` on rank 1 only); `spare` is used nowhere.
struct Heads {
    body: Linear,
    a: Linear,
    b: Linear,
    _spare: Linear,
    use_b: AtomicBool,
}

fn heads(vb: VarBuilder, use_b: bool) -> candle_core::Result<Heads> {
    Ok(Heads {
        body: linear(IN, HIDDEN, vb.pp("body"))?,
        a: linear(HIDDEN, OUT, vb.pp("head_a"))?,
        b: linear(HIDDEN, OUT, vb.pp("head_b"))?,
        _spare: linear(HIDDEN, OUT, vb.pp("spare"))?,
        use_b: AtomicBool::new(use_b),
    })
}

impl Module for Heads {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = x.apply(&self.body)?.relu()?;
        let head = if self.use_b.load(Ordering::SeqCst) {
            &self.b
        } else {
            &self.a
        };
        h.apply(head)
    }
}

#[test]
fn a_branch_taken_on_one_rank_only_is_not_reported_and_gets_the_average() {
    let test = "a_branch_taken_on_one_rank_only_is_not_reported_and_gets_the_average";
    if is_child() {
        candle_parallel::logging::init();
        let pg = join_child();
        let use_b = pg.rank() == 1;
        let varmap = VarMap::new();
        let model = DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, |vb| heads(vb, use_b))
            .unwrap();
        let (x, y) = share(0, 2, pg.rank());
        let l = mse(&model.forward_t(&x, true).unwrap(), &y).unwrap();
        let averaged = model.backward(&l).unwrap();
        assert_eq!(model.unused_parameters(), ["spare.bias", "spare.weight"]);
        // This rank's own gradients from the same weights without DDP (zeros where none),
        // averaged over the user's group.
        let plain = heads(
            VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
            use_b,
        )
        .unwrap();
        let local = mse(&plain.forward(&x).unwrap(), &y)
            .unwrap()
            .backward()
            .unwrap();
        for (name, v) in model.parameter_names().iter().zip(model.parameters()) {
            if name.starts_with("spare") {
                assert!(averaged.get(&v).is_none(), "{name}");
                continue;
            }
            let own = local
                .get(&v)
                .cloned()
                .unwrap_or_else(|| v.zeros_like().unwrap());
            let want = pg.all_reduce(&own, ReduceOp::Avg).unwrap();
            let got = averaged
                .get(&v)
                .unwrap_or_else(|| panic!("{name}: no gradient"));
            assert!(max_abs_diff(got, &want) < 1e-6, "{name}");
            if name.starts_with("head_") {
                assert!(common::max_abs(got) > 0.0, "{name} got zeros");
            }
        }
        done();
        return;
    }
    let out = ranks_with_logger(test, 2).assert_all_pass(LIMIT);
    // Only the parameter used nowhere is reported; the heads are not.
    let line = out[0]
        .lines()
        .find(|l| l.contains(REPORT))
        .unwrap_or_else(|| {
            panic!("spare was not reported:\n{}", out[0]);
        });
    assert!(line.contains("2 parameters") && line.contains("`spare.bias`, `spare.weight`."));
    assert!(!line.contains("head_"), "{line}");
}

/// `body -> head_a`, and a `spare` layer the model never uses, from seed 7's weights.
fn spare_model(vb: VarBuilder) -> candle_core::Result<Heads> {
    heads(vb, false)
}

const ADAMW: ParamsAdamW = ParamsAdamW {
    lr: 0.01,
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    weight_decay: 0.1,
};
const ADAMW_STEPS: usize = 6;

/// The whole batch's loss at each step, and the final variables, of one process with AdamW.
fn adamw_reference() -> (Vec<f32>, VarMap) {
    let varmap = VarMap::new();
    let model = spare_model(seeded_var_builder(&varmap, 7, DType::F32, &Device::Cpu)).unwrap();
    let mut opt = AdamW::new(varmap.all_vars(), ADAMW).unwrap();
    let mut losses = Vec::new();
    for step in 0..ADAMW_STEPS {
        // The rows of both ranks' shares.
        let (x0, y0) = share(step, 2, 0);
        let (x1, y1) = share(step, 2, 1);
        let x = Tensor::cat(&[x0, x1], 0).unwrap();
        let y = Tensor::cat(&[y0, y1], 0).unwrap();
        let l = mse(&model.forward(&x).unwrap(), &y).unwrap();
        losses.push(l.to_scalar::<f32>().unwrap());
        opt.backward_step(&l).unwrap();
    }
    (losses, varmap)
}

#[test]
fn with_adamw_and_weight_decay_ddp_over_a_never_used_parameter_equals_one_process() {
    let test = "with_adamw_and_weight_decay_ddp_over_a_never_used_parameter_equals_one_process";
    if is_child() {
        let pg = join_child();
        let (want_losses, want) = adamw_reference();
        let varmap = VarMap::new();
        spare_model(seeded_var_builder(&varmap, 7, DType::F32, &Device::Cpu)).unwrap();
        let spare = var(&varmap, "spare.weight");
        let model = DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, spare_model).unwrap();
        let mut opt = AdamW::new(model.parameters(), ADAMW).unwrap();
        for (step, want_loss) in want_losses.iter().enumerate() {
            let (x, y) = share(step, 2, pg.rank());
            let l = mse(&model.forward_t(&x, true).unwrap(), &y).unwrap();
            // Equal shares: the mean of the ranks' losses is the whole batch's.
            let whole = pg.all_reduce(&l, ReduceOp::Avg).unwrap();
            let whole = whole.to_scalar::<f32>().unwrap();
            assert!(
                (whole - want_loss).abs() <= 1e-5,
                "step {step}: DDP loss {whole}, one process {want_loss}"
            );
            opt.step(&model.backward(&l).unwrap()).unwrap();
        }
        assert_eq!(
            max_abs_diff(&var(&varmap, "spare.weight"), &spare),
            0.0,
            "the unused parameter moved"
        );
        for (name, v) in want.data().lock().unwrap().iter() {
            let d = max_abs_diff(&var(&varmap, name), v.as_tensor());
            assert!(d <= 1e-5, "{name} differs from one process by {d}");
        }
        done();
        return;
    }
    Ranks::world(test, 2).assert_all_pass(LIMIT);
}

#[test]
fn in_error_mode_every_rank_gets_the_typed_error_naming_the_parameters() {
    let errors = distributed::spawn_threads(2, |pg| {
        let config = DdpConfig {
            unused_report: UnusedReport::Error,
            ..DdpConfig::default()
        };
        let varmap = VarMap::new();
        let model = DistributedDataParallel::with_config(
            &varmap,
            &pg,
            &Device::Cpu,
            config,
            candle_nn_stack,
        )?;
        let mut seen = Vec::new();
        // The error ends the iteration cleanly: the next one fails the same way, not with an
        // unfinished reduction.
        for step in 0..2 {
            let (x, y) = share(step, 2, pg.rank());
            let l = mse(&model.forward_t(&x, true)?, &y)?;
            let err = model.backward(&l).unwrap_err();
            seen.push(err);
        }
        Ok(seen)
    })
    .unwrap();
    for (rank, seen) in errors.iter().enumerate() {
        for err in seen {
            match err {
                Error::ParametersWithoutGradient { names, .. } => {
                    assert_eq!(names, &BELOW_LAYER_NORM, "rank {rank}")
                }
                other => panic!("rank {rank}: {other}"),
            }
            let text = err.to_string();
            assert!(
                text.contains("UnusedReport::Error") && text.contains("#2168"),
                "{text}"
            );
        }
    }
}

#[test]
fn parameters_declared_frozen_are_not_reported_but_still_listed() {
    let test = "parameters_declared_frozen_are_not_reported_but_still_listed";
    if is_child() {
        candle_parallel::logging::init();
        let pg = join_child();
        let frozen = |names: &[&str]| DdpConfig {
            frozen_parameters: names.iter().map(|n| n.to_string()).collect(),
            ..DdpConfig::default()
        };
        // Everything below the norm declared frozen (a layer, and a layer by its prefix).
        let model = train_stack(&pg, &VarMap::new(), frozen(&["l1", "ln."]), candle_nn_stack);
        assert_eq!(model.unused_parameters(), BELOW_LAYER_NORM);
        println!("silent part over");
        // Only the first layer declared: the norm's parameters are reported.
        let model = train_stack(
            &pg,
            &VarMap::new(),
            frozen(&["l1.weight", "l1.bias"]),
            candle_nn_stack,
        );
        assert_eq!(model.unused_parameters(), BELOW_LAYER_NORM);
        done();
        return;
    }
    let out = ranks_with_logger(test, 2).assert_all_pass(LIMIT);
    let (silent, rest) = out[0].split_once("silent part over").unwrap();
    assert!(!silent.contains(REPORT), "{silent}");
    let line = rest
        .lines()
        .find(|l| l.contains(REPORT))
        .unwrap_or_else(|| {
            panic!("the norm's parameters were not reported:\n{rest}");
        });
    assert!(line.contains("2 parameters") && line.contains("`ln.bias`, `ln.weight`."));
    assert!(!line.contains("`l1."), "{line}");
}

#[test]
fn module_right_after_a_step_computes_with_the_new_weights() {
    distributed::spawn_threads(2, |pg| {
        let varmap = VarMap::new();
        let model =
            DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, |vb| heads(vb, false))?;
        let mut opt = Sgd::new(model.parameters(), SGD)?;
        let (x, y) = share(0, 2, pg.rank());
        let before = model.module().forward(&x)?;
        let l = mse(&model.forward_t(&x, true)?, &y)?;
        opt.step(&model.backward(&l)?)?;
        let through_module = model.module().forward(&x)?;
        let current = heads(
            VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
            false,
        )?;
        let want = current.forward(&x)?;
        assert_eq!(max_abs_diff(&through_module, &want), 0.0);
        assert!(
            max_abs_diff(&through_module, &before) > 0.0,
            "the step changed nothing"
        );
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_parameter_with_gradients_only_in_no_sync_micro_steps_counts_as_used() {
    let results = distributed::spawn_threads(2, |pg| {
        let varmap = VarMap::new();
        let model = DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, |vb| heads(vb, true))?;
        let (x, y) = share(0, 2, pg.rank());
        {
            let _local = model.no_sync();
            let l = mse(&model.forward_t(&x, true)?, &y)?;
            model.backward(&l)?;
        }
        // The synchronised step uses head_a; head_b had its gradient in the micro-step.
        model.module().use_b.store(false, Ordering::SeqCst);
        let l = mse(&model.forward_t(&x, true)?, &y)?;
        let grads = model.backward(&l)?;
        let named: Vec<(String, candle_core::Var)> = model
            .parameter_names()
            .into_iter()
            .zip(model.parameters())
            .collect();
        Ok((
            model.unused_parameters(),
            named_vars_without_gradient(&named, &grads),
        ))
    })
    .unwrap();
    for (unused, without) in results {
        assert_eq!(unused, ["spare.bias", "spare.weight"]);
        assert_eq!(without, ["spare.bias", "spare.weight"]);
    }
}

#[test]
fn the_free_function_names_exactly_the_variables_upstream_of_candle_nns_layer_norm() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = candle_nn_stack(vb.clone()).unwrap();
    // A BatchNorm's running statistics live in the VarMap too, but are no parameters.
    let bn = candle_nn::batch_norm(OUT, 1e-5, vb.pp("bn")).unwrap();
    let (x, y) = share(0, 1, 0);
    let out = candle_nn::ModuleT::forward_t(&bn, &model.forward(&x).unwrap(), true).unwrap();
    let grads = mse(&out, &y).unwrap().backward().unwrap();
    assert_eq!(vars_without_gradient(&varmap, &grads), BELOW_LAYER_NORM);
    // The same model with the differentiable reference in place of the fused layer_norm:
    // every variable gets a gradient.
    let own = |name: &str| varmap.data().lock().unwrap()[name].as_tensor().clone();
    let h = x.apply(&model.l1).unwrap();
    let h = candle_nn::ops::layer_norm_slow(&h, &own("ln.weight"), &own("ln.bias"), 1e-5).unwrap();
    let out = candle_nn::ModuleT::forward_t(&bn, &h.apply(&model.l2).unwrap(), true).unwrap();
    let grads = mse(&out, &y).unwrap().backward().unwrap();
    assert!(vars_without_gradient(&varmap, &grads).is_empty());
}
