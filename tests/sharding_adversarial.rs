//! Adversarial cases of ZeRO-2 and fully sharded training, each found by trying to break them
//! as a user would: every world from 1 to 4 and every dtype with parameters smaller than the
//! world, weights loaded into the VarMap after wrapping, optimizers of this crate and of
//! candle-nn mixed, evaluations that another rank's step made stale, zero-element parameters
//! in checkpoints, a root parameter captured by a unit, optimizers over the VarMap under fully
//! sharded training, no_sync, compression, join, SyncBatchNorm. Each compares a sharded run
//! against one process (or plain DDP) with the same model, data and optimizer, or checks that a
//! misuse is refused at once. Ranks are threads (`distributed::spawn_threads`) unless said
//! otherwise.

mod common;

use candle_core::{DType, Device, Module, ModuleT, Tensor, Var};
use candle_nn::{linear, Linear, Optimizer, VarBuilder, VarMap};
use candle_parallel::ddp::{Compression, DdpConfig, JoinDivisor, Sharding};
use candle_parallel::distributed::{self, ProcessGroup};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
use candle_parallel::rng::Rng;
use candle_parallel::{DistributedDataParallel, Error};

const SEED: u64 = 11;
const IN: usize = 5;
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

/// Odd shapes: a 5x3 weight (15 elements), a bias of 3, a 3x1 head with a bias of 1, and a
/// one-element scale, so that worlds 2, 3 and 4 all pad and some ranks hold padding only.
struct Odd {
    a: Linear,
    b: Linear,
    scale: Tensor,
}

fn odd(vb: VarBuilder) -> candle_core::Result<Odd> {
    Ok(Odd {
        a: linear(IN, 3, vb.pp("a"))?,
        b: linear(3, 1, vb.pp("b"))?,
        scale: vb.get_with_hints(1, "scale", candle_nn::Init::Const(1.0))?,
    })
}

impl Module for Odd {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.apply(&self.a)?
            .tanh()?
            .apply(&self.b)?
            .broadcast_mul(&self.scale)
    }
}

/// Step `step`'s whole batch (`rows` rows), the same on every rank, in `dtype`.
fn batch(step: usize, rows: usize, dtype: DType) -> (Tensor, Tensor) {
    let mut rng = Rng::new(500 + step as u64);
    let xs: Vec<f32> = (0..rows * IN).map(|_| rng.normal() as f32).collect();
    let ys: Vec<f32> = (0..rows).map(|_| rng.normal() as f32).collect();
    (
        Tensor::from_vec(xs, (rows, IN), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap(),
        Tensor::from_vec(ys, (rows, 1), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap(),
    )
}

fn share(step: usize, world: usize, per: usize, rank: usize, dtype: DType) -> (Tensor, Tensor) {
    let (x, y) = batch(step, world * per, dtype);
    (
        x.narrow(0, rank * per, per).unwrap(),
        y.narrow(0, rank * per, per).unwrap(),
    )
}

fn mse(out: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    (out - y)?.sqr()?.mean_all()
}

type Values = Vec<(String, Vec<f64>)>;

fn values(varmap: &VarMap) -> Values {
    let mut all: Values = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            let flat = v.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
            (k.clone(), flat.to_vec1::<f64>().unwrap())
        })
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

fn max_diff(a: &Values, b: &Values) -> f64 {
    assert_eq!(a.len(), b.len(), "{:?} vs {:?}", names(a), names(b));
    a.iter()
        .zip(b)
        .flat_map(|((na, va), (nb, vb))| {
            assert_eq!(na, nb);
            assert_eq!(va.len(), vb.len(), "{na}");
            va.iter().zip(vb).map(|(x, y)| nan_aware(*x, *y))
        })
        .fold(0.0, f64::max)
}

/// |x - y|, infinite when either is NaN (a NaN must never read as agreement).
fn nan_aware(x: f64, y: f64) -> f64 {
    match x.is_nan() || y.is_nan() {
        true => f64::INFINITY,
        false => (x - y).abs(),
    }
}

fn names(v: &Values) -> Vec<&str> {
    v.iter().map(|(n, _)| n.as_str()).collect()
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Which {
    Sgd,
    AdamW,
    CandleAdamW,
    CandleSgd,
}

enum Opt {
    Sgd(Sgd),
    AdamW(AdamW),
    CandleAdamW(candle_nn::AdamW),
    CandleSgd(candle_nn::SGD),
}

impl Opt {
    fn new(which: Which, vars: Vec<Var>) -> candle_core::Result<Self> {
        Ok(match which {
            Which::Sgd => Opt::Sgd(Sgd::new(vars, SGD)?),
            Which::AdamW => Opt::AdamW(AdamW::new(vars, ADAMW)?),
            Which::CandleAdamW => Opt::CandleAdamW(candle_nn::AdamW::new(
                vars,
                candle_nn::ParamsAdamW {
                    lr: ADAMW.lr,
                    weight_decay: ADAMW.weight_decay,
                    ..Default::default()
                },
            )?),
            Which::CandleSgd => Opt::CandleSgd(candle_nn::SGD::new(vars, 0.1)?),
        })
    }
    fn step(&mut self, g: &candle_core::backprop::GradStore) -> candle_core::Result<()> {
        match self {
            Opt::Sgd(o) => o.step(g),
            Opt::AdamW(o) => o.step(g),
            Opt::CandleAdamW(o) => o.step(g),
            Opt::CandleSgd(o) => o.step(g),
        }
    }
    fn set_lr(&mut self, lr: f64) {
        match self {
            Opt::Sgd(o) => o.set_learning_rate(lr),
            Opt::AdamW(o) => o.set_learning_rate(lr),
            Opt::CandleAdamW(o) => o.set_learning_rate(lr),
            Opt::CandleSgd(o) => o.set_learning_rate(lr),
        }
    }
}

const PER: usize = 3;
const STEPS: usize = 6;

/// One process over the whole batches of a `world`-rank run.
fn one_process(world: usize, dtype: DType, which: Which) -> Values {
    let varmap = VarMap::new();
    let model = odd(seeded_var_builder(&varmap, SEED, dtype, &Device::Cpu)).unwrap();
    let mut opt = Opt::new(which, varmap.all_vars()).unwrap();
    for step in 0..STEPS {
        let (x, y) = batch(step, world * PER, dtype);
        let l = mse(&model.forward(&x).unwrap(), &y).unwrap();
        opt.step(&l.backward().unwrap()).unwrap();
    }
    values(&varmap)
}

fn wrapped(
    pg: &ProcessGroup,
    dtype: DType,
    config: DdpConfig,
) -> (VarMap, DistributedDataParallel<Odd>) {
    let varmap = VarMap::new();
    odd(seeded_var_builder(&varmap, SEED, dtype, &Device::Cpu)).unwrap();
    let config = DdpConfig { dtype, ..config };
    let model =
        DistributedDataParallel::with_config(&varmap, pg, &Device::Cpu, config, odd).unwrap();
    (varmap, model)
}

/// `world` thread ranks, each over its share; rank 0's variables at the end (after a gather
/// for optimizers that do not gather).
fn ranks(world: usize, dtype: DType, which: Which, config: DdpConfig) -> Values {
    let out = distributed::spawn_threads(world, |pg| {
        let (varmap, model) = wrapped(&pg, dtype, config.clone());
        let mut opt = Opt::new(which, model.parameters()).unwrap();
        for step in 0..STEPS {
            let (x, y) = share(step, world, PER, pg.rank(), dtype);
            let l = mse(&model.forward_t(&x, true)?, &y)?;
            let g = model.backward(&l)?;
            opt.step(&g)?;
        }
        model.gather_parameters()?;
        Ok(values(&varmap))
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

fn zero2() -> DdpConfig {
    DdpConfig {
        sharding: Sharding::Zero2,
        bucket_cap_mb: 1e-4,
        first_bucket_mb: 5e-5,
        ..DdpConfig::default()
    }
}

fn ddp_small_buckets() -> DdpConfig {
    DdpConfig {
        bucket_cap_mb: 1e-4,
        first_bucket_mb: 5e-5,
        ..DdpConfig::default()
    }
}

/// ZeRO-2 over worlds 1 to 4, f32 and f64, this crate's SGD and AdamW and
/// candle-nn's AdamW, equals one process; in bf16/f16, equals plain DDP at the same world
/// (bit for bit).
#[test]
fn zero2_over_every_world_and_dtype_equals_one_process_or_ddp() {
    let mut report = Vec::new();
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        for which in [Which::Sgd, Which::AdamW, Which::CandleAdamW] {
            if (dtype, which) == (DType::F16, Which::CandleAdamW) {
                // candle-nn's AdamW computes in f16, where its eps of 1e-8 is 0: 0/0 = NaN
                // for an element with a zero gradient, under DDP as under ZeRO-2.
                continue;
            }
            for world in 1..=4 {
                let got = ranks(world, dtype, which, zero2());
                let (want, against, tol) = match dtype {
                    DType::F32 | DType::F64 => (one_process(world, dtype, which), "one", 1e-5),
                    _ => (ranks(world, dtype, which, ddp_small_buckets()), "ddp", 1e-2),
                };
                let d = max_diff(&got, &want);
                report.push(format!(
                    "{dtype:?} {which:?} world {world} vs {against}: {d:e}"
                ));
                assert!(d <= tol, "{report:#?}");
            }
        }
    }
    eprintln!("{report:#?}");
}

/// Plain DDP or ZeRO-2 over `world` thread ranks where every rank overwrites `a.weight` in
/// the VarMap after wrapping (as `varmap.load(pretrained)` does), then trains; rank 0's
/// variables at the end.
fn load_after_wrapping(world: usize, config: DdpConfig, which: Which) -> Values {
    let out = distributed::spawn_threads(world, |pg| {
        load_after_wrapping_on(&pg, config.clone(), which)
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

fn load_after_wrapping_on(
    pg: &ProcessGroup,
    config: DdpConfig,
    which: Which,
) -> candle_parallel::Result<Values> {
    let world = pg.world_size();
    let (varmap, model) = wrapped(pg, DType::F32, config);
    let pretrained = Tensor::full(0.5f32, (3, IN), &Device::Cpu)?;
    varmap.data().lock().unwrap()["a.weight"].set(&pretrained)?;
    let mut opt = Opt::new(which, model.parameters())?;
    for step in 0..STEPS {
        let (x, y) = share(step, world, PER, pg.rank(), DType::F32);
        let l = mse(&model.forward_t(&x, true)?, &y)?;
        opt.step(&model.backward(&l)?)?;
    }
    model.gather_parameters()?;
    Ok(values(&varmap))
}

/// Once a silent wrong answer. Loading weights into the VarMap after wrapping (candle's
/// `varmap.load(..)` idiom, or any `var.set`) works under plain DDP; under ZeRO-2 the first
/// step's gather overwrites them with pieces cut at construction, with no error or warning.
#[test]
fn zero2_weights_set_in_the_varmap_after_wrapping_are_kept_as_under_ddp() {
    for which in [Which::Sgd, Which::CandleAdamW] {
        let ddp = load_after_wrapping(2, ddp_small_buckets(), which);
        let z2 = load_after_wrapping(2, zero2(), which);
        let d = max_diff(&ddp, &z2);
        assert!(d <= 1e-5, "{which:?}: ZeRO-2 differs from DDP by {d}");
    }
}

/// Two optimizers over disjoint subsets of `parameters()`: `first` over `a.*`, `second` over
/// the rest, stepped in that order; rank 0's variables and its evaluation after the last step.
fn two_optimizers(
    world: usize,
    config: DdpConfig,
    first: Which,
    second: Which,
) -> (Values, Vec<f32>) {
    let out = distributed::spawn_threads(world, |pg| {
        two_optimizers_on(&pg, config.clone(), first, second)
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

fn two_optimizers_on(
    pg: &ProcessGroup,
    config: DdpConfig,
    first: Which,
    second: Which,
) -> candle_parallel::Result<(Values, Vec<f32>)> {
    let world = pg.world_size();
    let (varmap, model) = wrapped(pg, DType::F32, config);
    let (mut a, mut rest) = (Vec::new(), Vec::new());
    for (name, p) in model.parameter_names().iter().zip(model.parameters()) {
        match name.starts_with("a.") {
            true => a.push(p),
            false => rest.push(p),
        }
    }
    let mut o1 = Opt::new(first, a)?;
    let mut o2 = Opt::new(second, rest)?;
    let probe = batch(99, 4, DType::F32).0;
    let mut eval = Vec::new();
    for step in 0..STEPS {
        let (x, y) = share(step, world, PER, pg.rank(), DType::F32);
        let l = mse(&model.forward_t(&x, true)?, &y)?;
        let g = model.backward(&l)?;
        o1.step(&g)?;
        o2.step(&g)?;
        // Evaluate on every rank after each step (no gather: this crate's optimizer ran it).
        eval = match model.forward_t(&probe, false) {
            Ok(t) => t.flatten_all()?.to_vec1::<f32>()?,
            Err(Error::StaleParameters { .. }) => {
                model.gather_parameters()?;
                model
                    .forward_t(&probe, false)?
                    .flatten_all()?
                    .to_vec1::<f32>()?
            }
            Err(e) => return Err(e),
        };
    }
    model.gather_parameters()?;
    Ok((values(&varmap), eval))
}

/// Once a silent wrong answer. ZeRO-2 with this crate's SGD over some parameters and
/// candle-nn's SGD over the others (stepped after it): the first optimizer's gather clears
/// `gather_due`, so the second's steps are never gathered before the next forward; training
/// runs one step behind on those parameters, and the evaluation is not refused.
#[test]
fn zero2_with_this_crates_optimizer_then_candles_over_other_parameters_equals_ddp() {
    let (want, want_eval) = two_optimizers(2, ddp_small_buckets(), Which::Sgd, Which::CandleSgd);
    let (got, got_eval) = two_optimizers(2, zero2(), Which::Sgd, Which::CandleSgd);
    let d = max_diff(&got, &want);
    let e = want_eval
        .iter()
        .zip(&got_eval)
        .map(|(a, b)| (a - b).abs())
        .fold(
            0f32,
            |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
        );
    assert!(
        d <= 1e-5 && e <= 1e-5,
        "ZeRO-2 differs from DDP: weights by {d}, the last evaluation by {e}"
    );
}

/// two of this crate's optimizers over disjoint subsets each gather.
#[test]
fn zero2_with_two_of_this_crates_optimizers_equals_ddp() {
    let (want, _) = two_optimizers(3, ddp_small_buckets(), Which::Sgd, Which::AdamW);
    let (got, _) = two_optimizers(3, zero2(), Which::Sgd, Which::AdamW);
    let d = max_diff(&got, &want);
    assert!(d <= 1e-5, "ZeRO-2 differs from DDP by {d}");
}

/// A one-output linear layer without bias: rank 0 of 2 holds w[0..2], rank 1 w[2..4].
struct NoBias(Linear);
impl Module for NoBias {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.0.forward(x)
    }
}
fn no_bias(vb: VarBuilder) -> candle_core::Result<NoBias> {
    Ok(NoBias(candle_nn::linear_no_bias(4, 1, vb.pp("l"))?))
}

type Staleness = (Result<Vec<f32>, String>, Vec<f32>);

/// Rank `pg.rank()`'s evaluation right after a candle-nn SGD step (or its error), and the
/// evaluation after a gather.
fn rank_local_staleness_on(pg: &ProcessGroup) -> candle_parallel::Result<Staleness> {
    let varmap = VarMap::new();
    no_bias(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu))?;
    let model = DistributedDataParallel::with_config(&varmap, pg, &Device::Cpu, zero2(), no_bias)?;
    let mut opt = candle_nn::SGD::new(model.parameters(), 0.1)?;
    let x = Tensor::new(&[[0f32, 0., 1., 2.], [0., 0., -1., 3.]], &Device::Cpu)?;
    let x = x.narrow(0, pg.rank(), 1)?;
    let l = model.forward_t(&x, true)?.sum_all()?;
    opt.step(&model.backward(&l)?)?;
    let probe = Tensor::new(&[[1f32, 1., 1., 1.]], &Device::Cpu)?;
    let eval = model
        .forward_t(&probe, false)
        .map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .map_err(|e| e.to_string());
    model.gather_parameters()?;
    let current = model
        .forward_t(&probe, false)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok((eval, current))
}

/// Once a silent wrong answer. The staleness check of an evaluation reads this rank's
/// pieces only: with candle-nn's SGD, when a step leaves rank 0's chunk unchanged (inputs 0
/// and 1 are zero, so w[0..2] gets a zero gradient) but moves rank 1's, rank 0 evaluates the
/// pre-step model without an error while rank 1 is refused with StaleParameters.
#[test]
fn zero2_evaluation_after_a_candle_step_is_refused_on_every_rank_or_current() {
    let results = distributed::spawn_threads(2, |pg| rank_local_staleness_on(&pg)).unwrap();
    for (rank, (eval, current)) in results.iter().enumerate() {
        match eval {
            Ok(v) => assert_eq!(
                v, current,
                "rank {rank} evaluated a stale model without an error (the others: {results:?})"
            ),
            Err(e) => assert!(e.contains("gather_parameters"), "{e}"),
        }
    }
}

/// A frozen layer in front (its output detached) and, when `EMPTY`, a zero-element parameter.
struct Ck {
    frozen: Linear,
    a: Linear,
    b: Linear,
    empty: Option<Tensor>,
}

fn ck(with_empty: bool) -> impl Fn(VarBuilder) -> candle_core::Result<Ck> + Clone {
    move |vb: VarBuilder| {
        Ok(Ck {
            frozen: linear(IN, IN, vb.pp("frozen"))?,
            a: linear(IN, 3, vb.pp("a"))?,
            b: linear(3, 1, vb.pp("b"))?,
            empty: match with_empty {
                true => Some(vb.get_with_hints(0, "empty", candle_nn::Init::Const(0.0))?),
                false => None,
            },
        })
    }
}

impl Module for Ck {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = x.apply(&self.frozen)?.detach();
        let out = h.apply(&self.a)?.tanh()?.apply(&self.b)?;
        match &self.empty {
            Some(e) => out.broadcast_add(&e.sum_all()?),
            None => Ok(out),
        }
    }
}

const TOTAL: usize = 6;

/// The optimizer of the checkpoint probes: AdamW, or SGD with momentum for the model with a
/// zero-element parameter (AdamW cannot step one: see
/// `this_crates_optimizers_step_a_zero_element_parameter_in_one_process`).
trait Make: candle_parallel::optim::ElementwiseOptimizer {
    fn make(vars: Vec<Var>) -> candle_core::Result<Self>
    where
        Self: Sized;
}
impl Make for AdamW {
    fn make(vars: Vec<Var>) -> candle_core::Result<Self> {
        AdamW::new(vars, ADAMW)
    }
}
impl Make for Sgd {
    fn make(vars: Vec<Var>) -> candle_core::Result<Self> {
        Sgd::new(vars, SGD)
    }
}

fn ck_one_process<O: Make>(with_empty: bool, steps: usize) -> Values {
    let varmap = VarMap::new();
    let model =
        ck(with_empty)(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu)).unwrap();
    let mut opt = O::make(varmap.all_vars()).unwrap();
    for step in 0..steps {
        let (x, y) = batch(step, TOTAL, DType::F32);
        let l = mse(&model.forward(&x).unwrap(), &y).unwrap();
        opt.step(&l.backward().unwrap()).unwrap();
    }
    values(&varmap)
}

#[derive(Clone, Copy, Debug)]
enum Ckpt {
    Consolidated,
    Sharded,
}

/// Trains `steps` steps (from `first`) over `world` thread ranks with `sharding`, loading the
/// checkpoint at `path` first when `load`, saving it at the end when `!load`.
#[allow(clippy::too_many_arguments)]
fn ck_ranks<O: Make>(
    with_empty: bool,
    world: usize,
    sharding: Sharding,
    first: usize,
    steps: usize,
    how: Ckpt,
    path: &std::path::Path,
    load: bool,
) -> Result<Values, String> {
    let out = distributed::spawn_threads(world, |pg| {
        let varmap = VarMap::new();
        ck(with_empty)(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu))?;
        let config = DdpConfig {
            sharding,
            frozen_parameters: vec!["frozen".into()],
            ..ddp_small_buckets()
        };
        let model = DistributedDataParallel::with_config(
            &varmap,
            &pg,
            &Device::Cpu,
            config,
            ck(with_empty),
        )?;
        let mut opt = O::make(model.parameters())?;
        if load {
            match how {
                Ckpt::Consolidated => model.load_checkpoint(&mut opt, path)?,
                Ckpt::Sharded => model.load_sharded_checkpoint(&mut opt, path)?,
            }
        }
        let per = TOTAL / world;
        for step in first..first + steps {
            let (x, y) = batch(step, TOTAL, DType::F32);
            let (x, y) = (
                x.narrow(0, pg.rank() * per, per)?,
                y.narrow(0, pg.rank() * per, per)?,
            );
            let l = mse(&model.forward_t(&x, true)?, &y)?;
            opt.step(&model.backward(&l)?)?;
        }
        if !load {
            match how {
                Ckpt::Consolidated => model.save_checkpoint(&opt, path)?,
                Ckpt::Sharded => model.save_sharded_checkpoint(&opt, path)?,
            }
        }
        Ok(values(&varmap))
    });
    out.map(|v| v.into_iter().next().unwrap())
        .map_err(|e| e.to_string())
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("breaker-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn resume<O: Make>(
    with_empty: bool,
    from: (usize, Sharding),
    to: (usize, Sharding),
    how: Ckpt,
) -> Result<f64, String> {
    let dir = scratch(&format!(
        "{with_empty}-{}-{:?}-{}-{:?}-{how:?}",
        from.0, from.1, to.0, to.1
    ));
    let path = match how {
        Ckpt::Consolidated => dir.join("all.safetensors"),
        Ckpt::Sharded => dir.join("shards"),
    };
    let got = ck_ranks::<O>(with_empty, from.0, from.1, 0, 3, how, &path, false)
        .and_then(|_| ck_ranks::<O>(with_empty, to.0, to.1, 3, 3, how, &path, true));
    let _ = std::fs::remove_dir_all(&dir);
    Ok(max_diff(&got?, &ck_one_process::<O>(with_empty, 6)))
}

/// a model with a frozen layer, trained 3 steps at one world size and
/// sharding, saved (consolidated or sharded), loaded at another and trained 3 more, equals 6
/// steps of one process.
#[test]
fn checkpoints_with_frozen_parameters_resume_across_worlds_and_shardings() {
    let mut report = Vec::new();
    for how in [Ckpt::Consolidated, Ckpt::Sharded] {
        for (from, to) in [
            ((3, Sharding::Zero2), (2, Sharding::Zero2)),
            ((1, Sharding::None), (3, Sharding::Zero2)),
            ((2, Sharding::Zero2), (3, Sharding::None)),
            ((3, Sharding::None), (1, Sharding::Zero2)),
        ] {
            let d = resume::<AdamW>(false, from, to, how);
            report.push(format!("{how:?} {from:?} -> {to:?}: {d:?}"));
        }
    }
    eprintln!("{report:#?}");
    assert!(
        report.iter().all(|r| r.contains("Ok(") && {
            let v: f64 = r
                .split("Ok(")
                .nth(1)
                .unwrap()
                .trim_end_matches(')')
                .parse()
                .unwrap();
            v <= 1e-5
        }),
        "{report:#?}"
    );
}

/// Once a valid checkpoint refused. A zero-element parameter: a sharded checkpoint
/// holds no part of it (`my_share` skips chunks without elements, and every chunk of an empty
/// tensor has none), so loading it fails with "no variable `empty`: saved from another model?".
/// The consolidated checkpoint of the same model loads.
#[test]
fn a_model_with_a_zero_element_parameter_resumes_from_either_checkpoint() {
    let mut report = Vec::new();
    for how in [Ckpt::Consolidated, Ckpt::Sharded] {
        for (from, to) in [
            ((2, Sharding::None), (2, Sharding::None)),
            ((2, Sharding::Zero2), (2, Sharding::Zero2)),
        ] {
            let d = resume::<Sgd>(true, from, to, how);
            report.push(format!("{how:?} {from:?} -> {to:?}: {d:?}"));
        }
    }
    eprintln!("{report:#?}");
    assert!(report.iter().all(|r| r.contains("Ok(")), "{report:#?}");
}

/// Issue 37's last row: one process, this crate's optimizers
/// over a zero-element parameter that gets its (empty) gradient: "cannot set a variable to a
/// tensor that is derived from its value".
#[test]
fn this_crates_optimizers_step_a_zero_element_parameter_in_one_process() {
    let mut report = Vec::new();
    for which in [Which::Sgd, Which::AdamW] {
        let empty = Var::zeros(0, DType::F32, &Device::Cpu).unwrap();
        let w = Var::new(&[1f32, 2.], &Device::Cpu).unwrap();
        let mut opt = Opt::new(which, vec![empty.clone(), w.clone()]).unwrap();
        let loss = (w.as_tensor().sqr().unwrap().sum_all().unwrap()
            + empty.as_tensor().sum_all().unwrap())
        .unwrap();
        let r = opt.step(&loss.backward().unwrap());
        report.push(format!("{which:?}: {r:?}"));
    }
    assert!(report.iter().all(|r| r.ends_with("Ok(())")), "{report:#?}");
}

// --- Fully sharded ----------------------------------------------------------------------------

use candle_nn::{batch_norm, BatchNorm};
use candle_parallel::fsdp::{self, FsdpConfig, Unit};
use candle_parallel::FullyShardedDataParallel;

const W: usize = 6;

/// A unit with a parameter it never uses.
struct Block {
    fc: Linear,
    _spare: Linear,
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.fc.forward(x)?.tanh()
    }
}

fn block(vb: VarBuilder) -> candle_core::Result<Block> {
    Ok(Block {
        fc: linear(W, W, vb.pp("fc"))?,
        _spare: linear(W, 2, vb.pp("spare"))?,
    })
}

/// BatchNorm at the root, one unit used twice.
struct Fx {
    stem: Linear,
    bn: BatchNorm,
    u: Unit<Block>,
    head: Linear,
}

impl ModuleT for Fx {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let h = self.bn.forward_t(&self.stem.forward(x)?, train)?;
        let h = self.u.forward(&h)?;
        let h = self.u.forward(&h)?;
        self.head.forward(&h)
    }
}

fn fx(vb: VarBuilder) -> candle_core::Result<Fx> {
    Ok(Fx {
        // No bias before a training BatchNorm: its gradient is zero up to rounding, which
        // AdamW would blow up into steps of lr of a random sign.
        stem: candle_nn::linear_no_bias(IN, W, vb.pp("stem"))?,
        bn: batch_norm(W, 1e-5, vb.pp("bn"))?,
        u: fsdp::unit(vb.pp("u"), block)?,
        head: linear(W, 1, vb.pp("head"))?,
    })
}

fn fsdp_config() -> FsdpConfig {
    FsdpConfig {
        seed: Some(SEED),
        frozen_parameters: vec!["u.spare".into()],
        ..FsdpConfig::default()
    }
}

/// One step's pattern, the same under DDP and FSDP: a training forward whose output is dropped,
/// an evaluation, the real training forward, another evaluation, backward, step.
#[derive(Clone, Copy, Debug)]
struct Pattern {
    dropped_forward: bool,
    evaluations: bool,
}

/// Plain SGD for the FSDP parity probes: AdamW's step barely depends on a gradient's scale, so
/// a gradient off by a constant factor would pass unseen.
const FX_SGD: SgdConfig = SgdConfig {
    lr: 0.02,
    momentum: 0.0,
    dampening: 0.0,
    weight_decay: 0.0,
    nesterov: false,
    maximize: false,
};

const FULL: Pattern = Pattern {
    dropped_forward: true,
    evaluations: true,
};

/// One process (world 1's data) with the pattern.
fn fx_one_process(p: Pattern) -> (Values, Vec<f32>) {
    let probe = batch(99, 4, DType::F32).0;
    let mut evals = Vec::new();
    let varmap = VarMap::new();
    let m = fx(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu)).unwrap();
    let mut opt = Sgd::new(varmap.all_vars(), FX_SGD).unwrap();
    for step in 0..STEPS {
        let (x, y) = share(step, 1, PER, 0, DType::F32);
        if p.dropped_forward {
            m.forward_t(&x, true).unwrap();
        }
        if p.evaluations {
            evals.extend(
                m.forward_t(&probe, false)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            );
        }
        let l = mse(&m.forward_t(&x, true).unwrap(), &y).unwrap();
        if p.evaluations {
            evals.extend(
                m.forward_t(&probe, false)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            );
        }
        opt.step(&l.backward().unwrap()).unwrap();
    }
    evals.extend(
        m.forward_t(&probe, false)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap(),
    );
    (values(&varmap), evals)
}

fn fx_train(pg: &ProcessGroup, fully_sharded: bool) -> candle_parallel::Result<(Values, Vec<f32>)> {
    fx_train_with(pg, fully_sharded, FULL)
}

fn fx_train_with(
    pg: &ProcessGroup,
    fully_sharded: bool,
    p: Pattern,
) -> candle_parallel::Result<(Values, Vec<f32>)> {
    let world = pg.world_size();
    let probe = batch(99, 4, DType::F32).0;
    let mut evals = Vec::new();
    let mut push = |t: Tensor| evals.extend(t.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    if fully_sharded {
        let f = FullyShardedDataParallel::with_config(
            &VarMap::new(),
            pg,
            &Device::Cpu,
            fsdp_config(),
            fx,
        )?;
        let mut opt = Sgd::new(f.parameters(), FX_SGD)?;
        for step in 0..STEPS {
            let (x, y) = share(step, world, PER, pg.rank(), DType::F32);
            if p.dropped_forward {
                f.forward_t(&x, true)?;
            }
            if p.evaluations {
                push(f.forward_t(&probe, false)?);
            }
            let l = mse(&f.forward_t(&x, true)?, &y)?;
            if p.evaluations {
                push(f.forward_t(&probe, false)?);
            }
            opt.step(&f.backward(&l)?)?;
        }
        push(f.forward_t(&probe, false)?);
        let mut v: Values = f
            .full_parameters()?
            .into_iter()
            .map(|(n, t)| {
                (
                    n,
                    t.flatten_all()
                        .unwrap()
                        .to_dtype(DType::F64)
                        .unwrap()
                        .to_vec1()
                        .unwrap(),
                )
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        Ok((v, evals))
    } else {
        let varmap = VarMap::new();
        fx(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu))?;
        let config = DdpConfig {
            frozen_parameters: vec!["u.spare".into()],
            ..DdpConfig::default()
        };
        let m = DistributedDataParallel::with_config(&varmap, pg, &Device::Cpu, config, fx)?;
        let mut opt = Sgd::new(m.parameters(), FX_SGD)?;
        for step in 0..STEPS {
            let (x, y) = share(step, world, PER, pg.rank(), DType::F32);
            if p.dropped_forward {
                m.forward_t(&x, true)?;
            }
            if p.evaluations {
                push(m.forward_t(&probe, false)?);
            }
            let l = mse(&m.forward_t(&x, true)?, &y)?;
            if p.evaluations {
                push(m.forward_t(&probe, false)?);
            }
            opt.step(&m.backward(&l)?)?;
        }
        push(m.forward_t(&probe, false)?);
        Ok((values(&varmap), evals))
    }
}

/// Checks FSDP against DDP on every rank of `world` thread ranks.
fn fx_parity(world: usize) -> Result<Vec<String>, String> {
    let out = distributed::spawn_threads(world, |pg| {
        let ddp = fx_train(&pg, false)?;
        let fsdp = fx_train(&pg, true)?;
        let d = max_diff(&fsdp.0, &ddp.0);
        let e = ddp
            .1
            .iter()
            .zip(&fsdp.1)
            .map(|(a, b)| (a - b).abs())
            .fold(
                0f32,
                |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
            );
        Ok(format!(
            "rank {}: weights and statistics {d:e}, evaluations {e:e}",
            pg.rank()
        ))
    });
    out.map_err(|e| e.to_string())
}

/// BatchNorm at the root, a unit used twice with an unused
/// parameter, a training forward never backwarded and evaluations between forwards, FSDP
/// against DDP over 1, 2 and 3 ranks.
#[test]
fn fsdp_with_root_batch_norm_a_unit_used_twice_and_dropped_forwards_equals_ddp() {
    let mut report = Vec::new();
    for world in 1..=3 {
        report.push(format!("world {world}: {:?}", fx_parity(world)));
    }
    // And DDP itself against one process at world 1.
    let one = fx_one_process(FULL);
    let ddp = distributed::spawn_threads(1, |pg| fx_train(&pg, false)).unwrap();
    report.push(format!(
        "ddp vs one process: {:e}",
        max_diff(&ddp[0].0, &one.0)
    ));
    eprintln!("{report:#?}");
    for r in &report {
        assert!(!r.contains("Err("), "{report:#?}");
        for num in r
            .split([' ', ',', '"', ']'])
            .filter_map(|w| w.parse::<f64>().ok())
        {
            assert!(num <= 1e-5, "{report:#?}");
        }
    }
}

/// Once silent (never trained, no warning). Under FSDP the VarMap holds only the buffers (the
/// parameters live in the pieces), so candle's idiom `AdamW::new(varmap.all_vars())` makes an
/// optimizer over the running statistics (or over nothing): this crate's AdamW accepts it, and
/// training leaves every parameter where it started, with no error or warning.
#[test]
fn fsdp_an_optimizer_over_the_varmaps_variables_is_refused_or_trains() {
    let out = distributed::spawn_threads(2, |pg| {
        let varmap = VarMap::new();
        let f =
            FullyShardedDataParallel::with_config(&varmap, &pg, &Device::Cpu, fsdp_config(), fx)?;
        let before = f.full_parameters()?;
        let opt = AdamW::new(varmap.all_vars(), ADAMW);
        let Ok(mut opt) = opt else {
            return Ok(format!("refused: {}", opt.unwrap_err()));
        };
        for step in 0..STEPS {
            let (x, y) = share(step, 2, PER, pg.rank(), DType::F32);
            let l = mse(&f.forward_t(&x, true)?, &y)?;
            opt.step(&f.backward(&l)?)?;
        }
        let after = f.full_parameters()?;
        let moved = before
            .iter()
            .zip(&after)
            .filter(|((n, _), _)| {
                n.ends_with("weight") && !n.contains("spare") && !n.starts_with("bn")
            })
            .map(|((_, a), (_, b))| common::max_abs_diff(a, b))
            .fold(
                0f32,
                |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
            );
        Ok(format!(
            "accepted an optimizer over {} VarMap variables ({:?}); weights moved by {moved}",
            varmap.all_vars().len(),
            varmap.data().lock().unwrap().keys().collect::<Vec<_>>()
        ))
    })
    .unwrap();
    assert!(
        out[0].starts_with("refused") || !out[0].contains("moved by 0"),
        "{out:?}"
    );
}

// --- More ZeRO-2 -------------------------------------------------------------------------------

/// Gradient accumulation: `k` micro-batches per step, the first `k - 1` under `no_sync`, each
/// loss divided by `k`; rank 0's variables after `STEPS` steps.
fn accumulate(world: usize, config: DdpConfig, which: Which, k: usize) -> Values {
    let out = distributed::spawn_threads(world, |pg| {
        let (varmap, model) = wrapped(&pg, DType::F32, config.clone());
        let mut opt = Opt::new(which, model.parameters())?;
        for step in 0..STEPS {
            for micro in 0..k {
                let (x, y) = share(step * 10 + micro, world, PER, pg.rank(), DType::F32);
                if micro + 1 < k {
                    let _local = model.no_sync();
                    let l = (mse(&model.forward_t(&x, true)?, &y)? / k as f64)?;
                    model.backward(&l)?;
                } else {
                    let l = (mse(&model.forward_t(&x, true)?, &y)? / k as f64)?;
                    opt.step(&model.backward(&l)?)?;
                }
            }
        }
        model.gather_parameters()?;
        Ok(values(&varmap))
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

fn accumulate_one_process(world: usize, which: Which, k: usize) -> Values {
    let varmap = VarMap::new();
    let model = odd(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu)).unwrap();
    let mut opt = Opt::new(which, varmap.all_vars()).unwrap();
    for step in 0..STEPS {
        let mut total: Option<Tensor> = None;
        for micro in 0..k {
            let (x, y) = batch(step * 10 + micro, world * PER, DType::F32);
            let l = (mse(&model.forward(&x).unwrap(), &y).unwrap() / k as f64).unwrap();
            total = Some(match total {
                Some(t) => (t + l).unwrap(),
                None => l,
            });
        }
        opt.step(&total.unwrap().backward().unwrap()).unwrap();
    }
    values(&varmap)
}

/// no_sync accumulation under ZeRO-2 (with and without bucket rebuild)
/// equals one process over the k micro-batches.
#[test]
fn zero2_no_sync_accumulation_equals_one_process() {
    let mut report = Vec::new();
    for which in [Which::AdamW, Which::CandleAdamW] {
        for rebuild_buckets in [true, false] {
            for world in [2, 3] {
                let config = DdpConfig {
                    rebuild_buckets,
                    ..zero2()
                };
                let got = accumulate(world, config, which, 3);
                let want = accumulate_one_process(world, which, 3);
                report.push((
                    format!("{which:?} rebuild {rebuild_buckets} world {world}"),
                    max_diff(&got, &want),
                ));
            }
        }
    }
    eprintln!("{report:#?}");
    assert!(report.iter().all(|(_, d)| *d <= 1e-5), "{report:#?}");
}

/// bf16 and f16 compression under ZeRO-2 equal the same compression under
/// DDP (f32 model), over 2 and 3 ranks, rebuilding buckets or not.
#[test]
fn zero2_with_compression_equals_ddp_with_compression() {
    let mut report = Vec::new();
    for compression in [Compression::Bf16, Compression::F16] {
        for rebuild_buckets in [true, false] {
            for world in [2, 3] {
                let base = DdpConfig {
                    compression,
                    rebuild_buckets,
                    ..ddp_small_buckets()
                };
                let z = DdpConfig {
                    sharding: Sharding::Zero2,
                    ..base.clone()
                };
                let want = ranks(world, DType::F32, Which::AdamW, base);
                let got = ranks(world, DType::F32, Which::AdamW, z);
                report.push((
                    format!("{compression:?} rebuild {rebuild_buckets} world {world}"),
                    max_diff(&got, &want),
                ));
            }
        }
    }
    eprintln!("{report:#?}");
    assert!(report.iter().all(|(_, d)| *d <= 1e-6), "{report:#?}");
}

/// Ranks with `2 + rank` batches inside join; rank 0's variables at the end.
fn joined(world: usize, config: DdpConfig, which: Which) -> Values {
    let out = distributed::spawn_threads(world, |pg| {
        let (varmap, model) = wrapped(&pg, DType::F32, config.clone());
        let batches = 2 + pg.rank();
        let rank = pg.rank();
        let vars = model.parameters();
        macro_rules! run {
            ($opt:expr) => {{
                let mut opt = $opt;
                model.join(&mut opt, JoinDivisor::World, |opt| {
                    for step in 0..batches {
                        let (x, y) = share(step, world, PER, rank, DType::F32);
                        let l = mse(&model.forward_t(&x, true)?, &y)?;
                        opt.step(&model.backward(&l)?)?;
                    }
                    Ok(())
                })?;
            }};
        }
        match which {
            Which::AdamW => run!(AdamW::new(vars, ADAMW)?),
            Which::Sgd => run!(Sgd::new(vars, SGD)?),
            Which::CandleAdamW => run!(candle_nn::AdamW::new(
                vars,
                candle_nn::ParamsAdamW {
                    lr: ADAMW.lr,
                    weight_decay: ADAMW.weight_decay,
                    ..Default::default()
                }
            )?),
            Which::CandleSgd => run!(candle_nn::SGD::new(vars, 0.1)?),
        }
        model.gather_parameters()?;
        Ok(values(&varmap))
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

/// join with ZeRO-2 equals join with DDP, with this crate's optimizers and
/// candle-nn's, over 2 and 3 ranks.
#[test]
fn zero2_inside_join_equals_ddp_inside_join() {
    let mut report = Vec::new();
    for which in [
        Which::AdamW,
        Which::Sgd,
        Which::CandleAdamW,
        Which::CandleSgd,
    ] {
        for world in [2, 3] {
            let want = joined(world, ddp_small_buckets(), which);
            let got = joined(world, zero2(), which);
            report.push((format!("{which:?} world {world}"), max_diff(&got, &want)));
        }
    }
    eprintln!("{report:#?}");
    assert!(report.iter().all(|(_, d)| *d <= 1e-6), "{report:#?}");
}

/// A first step at learning rate 0 (warmup), then the usual rate.
fn warmup(world: usize, config: DdpConfig, which: Which) -> Values {
    let out = distributed::spawn_threads(world, |pg| {
        let (varmap, model) = wrapped(&pg, DType::F32, config.clone());
        let mut opt = Opt::new(which, model.parameters())?;
        for step in 0..STEPS {
            opt.set_lr(if step == 0 { 0.0 } else { 0.02 });
            let (x, y) = share(step, world, PER, pg.rank(), DType::F32);
            let l = mse(&model.forward_t(&x, true)?, &y)?;
            opt.step(&model.backward(&l)?)?;
        }
        model.gather_parameters()?;
        Ok(values(&varmap))
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

/// a learning rate of 0 at the first step under ZeRO-2 equals DDP.
#[test]
fn zero2_with_a_first_step_at_learning_rate_0_equals_ddp() {
    let mut report = Vec::new();
    for which in [Which::AdamW, Which::Sgd, Which::CandleAdamW] {
        let want = warmup(2, ddp_small_buckets(), which);
        let got = warmup(2, zero2(), which);
        report.push((format!("{which:?}"), max_diff(&got, &want)));
    }
    eprintln!("{report:#?}");
    assert!(report.iter().all(|(_, d)| *d <= 1e-6), "{report:#?}");
}

// --- SyncBatchNorm under ZeRO-2 ----------------------------------------------------------------

struct Sbn {
    stem: Linear,
    bn: candle_parallel::nn::BatchNorm,
    head: Linear,
}

impl ModuleT for Sbn {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let h = self.bn.forward_t(&self.stem.forward(x)?, train)?.tanh()?;
        self.head.forward(&h)
    }
}

fn sbn(vb: VarBuilder) -> candle_core::Result<Sbn> {
    Ok(Sbn {
        stem: candle_nn::linear_no_bias(IN, W, vb.pp("stem"))?,
        bn: candle_parallel::nn::batch_norm(W, 1e-5, vb.pp("bn"))?,
        head: linear(W, 1, vb.pp("head"))?,
    })
}

/// SyncBatchNorm with ZeRO-2 equals one process (plain BatchNorm over the
/// whole batch), weights and running statistics, over 2 and 3 ranks.
#[test]
fn zero2_with_sync_batch_norm_equals_one_process() {
    let mut report = Vec::new();
    for world in [2, 3] {
        let varmap = VarMap::new();
        let m = sbn(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu)).unwrap();
        let mut opt = AdamW::new(varmap.all_vars(), ADAMW).unwrap();
        for step in 0..STEPS {
            let (x, y) = batch(step, world * PER, DType::F32);
            let l = mse(&m.forward_t(&x, true).unwrap(), &y).unwrap();
            opt.step(&l.backward().unwrap()).unwrap();
        }
        let want = values(&varmap);
        for sharding in [Sharding::None, Sharding::Zero2] {
            let got = distributed::spawn_threads(world, |pg| {
                let varmap = VarMap::new();
                sbn(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu))?;
                let config = DdpConfig {
                    sharding,
                    sync_batch_norm: true,
                    ..ddp_small_buckets()
                };
                let m =
                    DistributedDataParallel::with_config(&varmap, &pg, &Device::Cpu, config, sbn)?;
                let mut opt = AdamW::new(m.parameters(), ADAMW)?;
                for step in 0..STEPS {
                    let (x, y) = share(step, world, PER, pg.rank(), DType::F32);
                    let l = mse(&m.forward_t(&x, true)?, &y)?;
                    opt.step(&m.backward(&l)?)?;
                }
                Ok(values(&varmap))
            })
            .unwrap();
            report.push((
                format!("{sharding:?} world {world}"),
                max_diff(&got[0], &want),
            ));
        }
    }
    eprintln!("{report:#?}");
    assert!(report.iter().all(|(_, d)| *d <= 1e-5), "{report:#?}");
}

// --- A branch taken on rank 0 only, and two dtypes in one model, under ZeRO-2 ------------------

struct Branchy {
    a: Linear,
    extra: Linear,
    b: Linear,
    on: bool,
}

impl Module for Branchy {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = self.a.forward(x)?.tanh()?;
        if self.on {
            h = (&h + self.extra.forward(&h)?)?;
        }
        // `b` is bf16: a second dtype, so a second set of buckets.
        let out = self.b.forward(&h.to_dtype(DType::BF16)?)?;
        out.to_dtype(DType::F32)
    }
}

fn branchy(on: bool) -> impl Fn(VarBuilder) -> candle_core::Result<Branchy> + Clone {
    move |vb: VarBuilder| {
        Ok(Branchy {
            a: linear(IN, 3, vb.pp("a"))?,
            extra: linear(3, 3, vb.pp("extra"))?,
            b: linear(3, 1, vb.pp("b").set_dtype(DType::BF16))?,
            on,
        })
    }
}

/// ZeRO-2 equals DDP with a branch only rank 0 takes and a bf16
/// layer beside f32 ones, over 2 and 3 ranks, this crate's AdamW and candle-nn's.
#[test]
fn zero2_with_a_rank_0_branch_and_two_dtypes_equals_ddp() {
    let mut report = Vec::new();
    for which in [Which::AdamW, Which::CandleAdamW] {
        for world in [2, 3] {
            let run = |sharding: Sharding| {
                distributed::spawn_threads(world, |pg| {
                    let varmap = VarMap::new();
                    let build = branchy(pg.rank() == 0);
                    build(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu))?;
                    let config = DdpConfig {
                        sharding,
                        ..ddp_small_buckets()
                    };
                    let m = DistributedDataParallel::with_config(
                        &varmap,
                        &pg,
                        &Device::Cpu,
                        config,
                        build,
                    )?;
                    let mut opt = Opt::new(which, m.parameters())?;
                    for step in 0..STEPS {
                        let (x, y) = share(step, world, PER, pg.rank(), DType::F32);
                        let l = mse(&m.forward_t(&x, true)?, &y)?;
                        opt.step(&m.backward(&l)?)?;
                    }
                    m.gather_parameters()?;
                    Ok(values(&varmap))
                })
                .map(|v| v.into_iter().next().unwrap())
            };
            let r = match (run(Sharding::None), run(Sharding::Zero2)) {
                (Ok(want), Ok(got)) => format!("{:e}", max_diff(&got, &want)),
                (a, b) => format!("ddp {:?} zero2 {:?}", a.map(|_| ()), b.map(|_| ())),
            };
            report.push(format!("{which:?} world {world}: {r}"));
        }
    }
    eprintln!("{report:#?}");
    for r in &report {
        let d: f64 = r
            .rsplit(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap_or(f64::INFINITY);
        assert!(d <= 1e-2, "{report:#?}");
    }
}

// --- Fully sharded: weights tied across the root and a unit ------------------------------------

/// A root parameter `scale` that the unit's computation uses too (captured by `forward_with`:
/// the usual way to tie an embedding to a head inside a unit).
struct Tied {
    stem: Linear,
    scale: Tensor,
    u: Unit<Linear>,
}

impl Module for Tied {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.stem.forward(x)?.broadcast_mul(&self.scale)?;
        let scale = self.scale.clone();
        let h = self
            .u
            .forward_with(&h, move |m, x| m.forward(&x.broadcast_mul(&scale)?))?;
        h.sum_keepdim(1)
    }
}

fn tied(vb: VarBuilder) -> candle_core::Result<Tied> {
    Ok(Tied {
        stem: linear(IN, W, vb.pp("stem"))?,
        scale: vb.get_with_hints(W, "scale", candle_nn::Init::Const(1.0))?,
        u: fsdp::unit(vb.pp("u"), |vb| linear(W, W, vb))?,
    })
}

/// Once a silent wrong answer (now refused at once). A root
/// parameter captured by a unit's `forward_with` gets only the root's part of its gradient
/// under FSDP (the unit's recomputation computes the rest and drops it), with no error or
/// warning; DDP (and one process) train it fully.
#[test]
fn fsdp_a_root_parameter_used_inside_a_unit_trains_as_under_ddp_or_is_refused() {
    let out = distributed::spawn_threads(2, |pg| {
        let varmap = VarMap::new();
        tied(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu))?;
        let m = DistributedDataParallel::with_config(
            &varmap,
            &pg,
            &Device::Cpu,
            ddp_small_buckets(),
            tied,
        )?;
        // Plain SGD: AdamW hides the loss, since its step barely depends on the gradient's
        // scale (here the unit's part of `scale`'s gradient is exactly half of it).
        let plain = SgdConfig {
            lr: 0.01,
            ..SgdConfig::default()
        };
        let mut opt = Sgd::new(m.parameters(), plain)?;
        let f = FullyShardedDataParallel::with_config(
            &VarMap::new(),
            &pg,
            &Device::Cpu,
            fsdp_config(),
            tied,
        );
        let f = match f {
            Ok(f) => f,
            Err(e) => return Ok(format!("refused: {e}")),
        };
        let mut fopt = Sgd::new(f.parameters(), plain)?;
        for step in 0..STEPS {
            let (x, y) = share(step, 2, PER, pg.rank(), DType::F32);
            let l = mse(&m.forward_t(&x, true)?, &y)?;
            opt.step(&m.backward(&l)?)?;
            let l = match f.forward_t(&x, true) {
                Ok(out) => mse(&out, &y)?,
                Err(e) => return Ok(format!("refused: {e}")),
            };
            let g = match f.backward(&l) {
                Ok(g) => g,
                Err(e) => return Ok(format!("refused: {e}")),
            };
            fopt.step(&g)?;
        }
        let mut got: Values = f
            .full_parameters()?
            .into_iter()
            .map(|(n, t)| {
                (
                    n,
                    t.flatten_all()
                        .unwrap()
                        .to_dtype(DType::F64)
                        .unwrap()
                        .to_vec1()
                        .unwrap(),
                )
            })
            .collect();
        got.sort_by(|a, b| a.0.cmp(&b.0));
        let start = VarMap::new();
        tied(seeded_var_builder(&start, SEED, DType::F32, &Device::Cpu))?;
        Ok(format!(
            "fsdp vs ddp {:?}; ddp moved {:?}",
            per_name(&got, &values(&varmap)),
            per_name(&values(&start), &values(&varmap))
        ))
    })
    .unwrap();
    eprintln!("{out:#?}");
    assert!(
        out[0].starts_with("refused") || !out[0].contains("scale: ") || {
            let d: f64 = out[0]
                .split("scale: ")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            d <= 1e-5
        },
        "{out:#?}"
    );
}

fn per_name(a: &Values, b: &Values) -> Vec<String> {
    a.iter()
        .zip(b)
        .map(|((n, x), (m, y))| {
            assert_eq!(n, m);
            let d = x
                .iter()
                .zip(y)
                .map(|(p, q)| nan_aware(*p, *q))
                .fold(0.0, f64::max);
            format!("{n}: {d:e}")
        })
        .collect()
}

/// FSDP's full_parameters, loaded into a plain model's VarMap, give the
/// same evaluation as FSDP's own (with BatchNorm's statistics).
#[test]
fn fsdp_full_parameters_load_into_a_plain_model() {
    let out = distributed::spawn_threads(3, |pg| {
        let f = FullyShardedDataParallel::with_config(
            &VarMap::new(),
            &pg,
            &Device::Cpu,
            fsdp_config(),
            fx,
        )?;
        let mut opt = AdamW::new(f.parameters(), ADAMW)?;
        for step in 0..STEPS {
            let (x, y) = share(step, 3, PER, pg.rank(), DType::F32);
            let l = mse(&f.forward_t(&x, true)?, &y)?;
            opt.step(&f.backward(&l)?)?;
        }
        let probe = batch(99, 4, DType::F32).0;
        let theirs = f.forward_t(&probe, false)?;
        let full = f.full_parameters()?;
        let varmap = VarMap::new();
        let plain = fx(candle_nn::VarBuilder::from_varmap(
            &varmap,
            DType::F32,
            &Device::Cpu,
        ))?;
        {
            let data = varmap.data().lock().unwrap();
            assert_eq!(data.len(), full.len());
            for (n, t) in &full {
                data[n].set(t)?;
            }
        }
        let ours = plain.forward_t(&probe, false)?;
        Ok(common::max_abs_diff(&theirs, &ours))
    })
    .unwrap();
    assert!(out.iter().all(|&d| d <= 1e-6), "{out:?}");
}

/// bf16 and f16 FSDP, parameters smaller than the world (biases
/// of 1 and 3, a one-element scale) over 3 and 4 ranks, equals DDP in the same dtype.
#[test]
fn fsdp_in_half_precision_with_parameters_smaller_than_the_world_equals_ddp() {
    struct Half {
        u: Unit<Odd>,
    }
    impl Module for Half {
        fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
            self.u.forward(x)
        }
    }
    fn half(vb: VarBuilder) -> candle_core::Result<Half> {
        Ok(Half {
            u: fsdp::unit(vb.pp("u"), odd)?,
        })
    }
    let mut report = Vec::new();
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for world in [3, 4] {
            let out = distributed::spawn_threads(world, |pg| {
                let varmap = VarMap::new();
                half(seeded_var_builder(&varmap, SEED, dtype, &Device::Cpu))?;
                let config = DdpConfig {
                    dtype,
                    ..ddp_small_buckets()
                };
                let m =
                    DistributedDataParallel::with_config(&varmap, &pg, &Device::Cpu, config, half)?;
                let mut opt = Sgd::new(m.parameters(), FX_SGD)?;
                let fc = FsdpConfig {
                    dtype,
                    ..fsdp_config()
                };
                let f = FullyShardedDataParallel::with_config(
                    &VarMap::new(),
                    &pg,
                    &Device::Cpu,
                    fc,
                    half,
                )?;
                let mut fopt = Sgd::new(f.parameters(), FX_SGD)?;
                for step in 0..STEPS {
                    let (x, y) = share(step, world, PER, pg.rank(), dtype);
                    let l = mse(&m.forward_t(&x, true)?, &y)?;
                    opt.step(&m.backward(&l)?)?;
                    let l = mse(&f.forward_t(&x, true)?, &y)?;
                    fopt.step(&f.backward(&l)?)?;
                }
                let mut got: Values = f
                    .full_parameters()?
                    .into_iter()
                    .map(|(n, t)| {
                        (
                            n,
                            t.flatten_all()
                                .unwrap()
                                .to_dtype(DType::F64)
                                .unwrap()
                                .to_vec1()
                                .unwrap(),
                        )
                    })
                    .collect();
                got.sort_by(|a, b| a.0.cmp(&b.0));
                Ok(max_diff(&got, &values(&varmap)))
            })
            .unwrap();
            report.push((format!("{dtype:?} world {world}"), out[0]));
        }
    }
    eprintln!("{report:#?}");
    assert!(report.iter().all(|(_, d)| *d <= 2e-2), "{report:#?}");
}

// --- Misuse ------------------------------------------------------------------------------------

/// misuses under ZeRO-2 are typed errors or harmless, on thread ranks:
/// a second backward of the same loss, a step before any backward, an optimizer over pieces and
/// whole parameters together, a step after the model was dropped.
#[test]
fn zero2_misuses_are_errors_or_harmless() {
    let out = distributed::spawn_threads(2, |pg| {
        let mut seen = Vec::new();
        let (varmap, model) = wrapped(&pg, DType::F32, zero2());
        let mut opt = AdamW::new(model.parameters(), ADAMW)?;
        // A step before any backward: nothing moves (the gather is a collective: both step).
        let before = values(&varmap);
        opt.step(&candle_core::backprop::GradStore::default())?;
        seen.push(format!(
            "step before backward moved {}",
            max_diff(&before, &values(&varmap))
        ));
        // Backward twice on the same loss.
        let (x, y) = share(0, 2, PER, pg.rank(), DType::F32);
        let l = mse(&model.forward_t(&x, true)?, &y)?;
        let g = model.backward(&l)?;
        seen.push(format!(
            "second backward: {:?}",
            model.backward(&l).map(|_| ()).map_err(|e| e.to_string())
        ));
        opt.step(&g)?;
        // A mix of pieces and whole parameters.
        let mut mixed = model.parameters();
        mixed.push(varmap.all_vars()[0].clone());
        seen.push(format!(
            "mixed: {:?}",
            Sgd::new(mixed, SGD).map(|_| ()).map_err(|e| e.to_string())
        ));
        // Drop the model, then step the optimizer over its pieces.
        drop(model);
        let after_drop = opt.step(&g).map_err(|e| e.to_string());
        seen.push(format!("step after drop: {after_drop:?}"));
        Ok(seen)
    })
    .unwrap();
    eprintln!("{out:#?}");
    let r0 = &out[0];
    assert!(r0[0].ends_with("moved 0"), "{r0:?}");
    assert!(r0[1].contains("Err("), "{r0:?}");
    assert!(
        r0[2].contains("Err(") && r0[2].contains("whole parameter"),
        "{r0:?}"
    );
}

/// inside join, rank 0 has no batch at all (it shadows from the
/// first iteration), under ZeRO-2 and DDP alike.
#[test]
fn zero2_join_with_a_rank_without_batches_equals_ddp() {
    let run = |config: DdpConfig| {
        distributed::spawn_threads(3, |pg| {
            let (varmap, model) = wrapped(&pg, DType::F32, config.clone());
            let mut opt = AdamW::new(model.parameters(), ADAMW)?;
            let rank = pg.rank();
            model.join(&mut opt, JoinDivisor::Active, |opt| {
                for step in 0..rank * 2 {
                    let (x, y) = share(step, 3, PER, rank, DType::F32);
                    let l = mse(&model.forward_t(&x, true)?, &y)?;
                    opt.step(&model.backward(&l)?)?;
                }
                Ok(())
            })?;
            Ok(values(&varmap))
        })
        .map_err(|e| e.to_string())
    };
    let want = run(ddp_small_buckets());
    let got = run(zero2());
    match (want, got) {
        (Ok(w), Ok(g)) => {
            for (r, (a, b)) in w.iter().zip(&g).enumerate() {
                let d = max_diff(a, b);
                assert!(d <= 1e-6, "rank {r}: ZeRO-2 differs from DDP by {d}");
            }
        }
        (w, g) => panic!("ddp {:?} zero2 {:?}", w.map(|_| ()), g.map(|_| ())),
    }
}

/// the three silent ZeRO-2 differences above, over two real processes (127.0.0.1):
/// weights set in the VarMap after wrapping, this crate's optimizer then candle-nn's over other
/// parameters, and a candle-nn step that leaves rank 0's chunk unchanged.
#[test]
fn zero2_silent_differences_hold_over_two_processes() {
    let test = "zero2_silent_differences_hold_over_two_processes";
    if common::is_child() {
        let pg = common::join_child();
        let mut failures = Vec::new();
        let ddp = load_after_wrapping_on(&pg, ddp_small_buckets(), Which::Sgd).unwrap();
        let z2 = load_after_wrapping_on(&pg, zero2(), Which::Sgd).unwrap();
        let d = max_diff(&ddp, &z2);
        if d > 1e-5 {
            failures.push(format!(
                "weights set after wrapping: ZeRO-2 differs from DDP by {d}"
            ));
        }
        pg.barrier().unwrap();
        let (want, _) =
            two_optimizers_on(&pg, ddp_small_buckets(), Which::Sgd, Which::CandleSgd).unwrap();
        let (got, _) = two_optimizers_on(&pg, zero2(), Which::Sgd, Which::CandleSgd).unwrap();
        let d = max_diff(&got, &want);
        if d > 1e-5 {
            failures.push(format!("two optimizers: ZeRO-2 differs from DDP by {d}"));
        }
        pg.barrier().unwrap();
        let (eval, current) = rank_local_staleness_on(&pg).unwrap();
        if let Ok(v) = &eval {
            if *v != current {
                failures.push(format!(
                    "rank {} evaluated {v:?} without an error; the current model gives {current:?}",
                    pg.rank()
                ));
            }
        }
        pg.barrier().unwrap();
        assert!(failures.is_empty(), "rank {}: {failures:#?}", pg.rank());
        common::done();
        return;
    }
    common::Ranks::world(test, 2).assert_all_pass(std::time::Duration::from_secs(120));
}

/// FSDP misuses are typed errors: a second backward of the same loss, and
/// a backward of a loss from an evaluation forward.
#[test]
fn fsdp_misuses_are_errors() {
    let out = distributed::spawn_threads(2, |pg| {
        let f = FullyShardedDataParallel::with_config(
            &VarMap::new(),
            &pg,
            &Device::Cpu,
            fsdp_config(),
            fx,
        )?;
        let (x, y) = share(0, 2, PER, pg.rank(), DType::F32);
        let l = mse(&f.forward_t(&x, true)?, &y)?;
        f.backward(&l)?;
        let twice = f.backward(&l).map(|_| ()).map_err(|e| e.to_string());
        let l = mse(&f.forward_t(&x, false)?, &y)?;
        let eval = f.backward(&l).map(|_| ()).map_err(|e| e.to_string());
        Ok((twice, eval))
    })
    .unwrap();
    eprintln!("{out:#?}");
    assert!(
        out.iter().all(|(a, b)| a.is_err() && b.is_err()),
        "{out:#?}"
    );
}
