//! Adversarial probes of training loops: `join_with` and plain `join`'s replica check, the
//! per-optimizer GradScaler (against torch 2.15: scripts/torch_grad_scaler_two_optimizers.py),
//! and activation checkpointing with buffers and SyncBatchNorm. Where a test's comment says
//! "Observed", that is what a breaker found before the fix (causes at the lines of then); the
//! test holds the fix. Thread ranks throughout.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, ModuleT, Tensor, Var};
use candle_nn::{linear, Linear, Optimizer, VarBuilder, VarMap};
use candle_parallel::activation_checkpointing::{checkpoint_if, Checkpointed};
use candle_parallel::amp::{GradScaler, GradScalerConfig, MixedPrecision};
use candle_parallel::ddp::{DdpConfig, JoinDivisor, Sharding};
use candle_parallel::distributed;
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
use candle_parallel::DistributedDataParallel;
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

fn rows(seed: usize, n: usize, width: usize) -> Tensor {
    let v: Vec<f32> = (0..n * width)
        .map(|i| (((i + 3 * seed) * 37 % 23) as f32 - 11.0) * 0.15)
        .collect();
    Tensor::from_vec(v, (n, width), &CPU).unwrap()
}

fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn named(varmap: &VarMap) -> Vec<(String, Vec<f32>)> {
    let mut out: Vec<(String, Vec<f32>)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, v)| v.dtype().is_float())
        .map(|(n, v)| {
            (
                n.clone(),
                v.as_tensor()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap(),
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Variables by name, as f32 values.
type Named = Vec<(String, Vec<f32>)>;

fn values(n: &[(String, Vec<f32>)]) -> Vec<Vec<f32>> {
    n.iter().map(|(_, v)| v.clone()).collect()
}

// =============================================================================================
// Models

/// A linear layer, this crate's `nn::batch_norm` (SyncBatchNorm under DDP's
/// `sync_batch_norm`), relu.
struct NormBlock {
    fc: Linear,
    bn: candle_parallel::nn::BatchNorm,
}

impl ModuleT for NormBlock {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.bn.forward_t(&self.fc.forward(x)?, train)?.relu()
    }
}

fn norm_block(vb: VarBuilder) -> candle_core::Result<NormBlock> {
    Ok(NormBlock {
        fc: linear(4, 4, vb.pp("fc"))?,
        bn: candle_parallel::nn::batch_norm(4, 1e-5, vb.pp("bn"))?,
    })
}

/// A (possibly checkpointed) norm block used `uses` times, then a head.
struct Net {
    block: Checkpointed<NormBlock>,
    head: Linear,
    uses: usize,
}

impl ModuleT for Net {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        for _ in 0..self.uses {
            h = self.block.forward_t(&h, train)?;
        }
        self.head.forward(&h)
    }
}

fn net(
    checkpointed: bool,
    uses: usize,
) -> impl Fn(VarBuilder) -> candle_core::Result<Net> + Send + Sync {
    move |vb| {
        Ok(Net {
            block: checkpoint_if(checkpointed, vb.pp("blk"), norm_block)?,
            head: linear(4, 2, vb.pp("head"))?,
            uses,
        })
    }
}

// =============================================================================================
// A. SyncBatchNorm inside a checkpointed block under DDP.
//
// Expected: `DdpConfig { sync_batch_norm: true }` with a checkpointed block holding
// `nn::batch_norm` trains as the same model without checkpointing (SyncBatchNorm: statistics
// over both ranks' rows), the running statistics and weights equal after 3 steps.
// Observed: after 3 steps rank 0's weights and running stats differ from the plain model by up to
// 0.058 (running_mean [0.0376, 0.1202, ..] vs plain [0.0493, 0.1117, ..]); no error, no warning.
// Cause: the checkpointed block's forward rebuilds the block with
// `build` at every forward and backward (src/activation_checkpointing/mod.rs:146-149), outside
// DDP's `nn::building` (src/ddp/mod.rs:259), where `nn::batch_norm` (src/nn/mod.rs:136) makes a
// plain BatchNorm: the checkpointed block normalises over this rank's rows only, and the
// SyncBatchNorm layer DDP registered (whose group `backward` finishes) is never run.
/// Rank 0's variables after three DDP steps, checkpointed and plain, from the same start.
fn compare_ddp_norm(uses: usize, config: fn() -> DdpConfig) {
    // Same starting weights: candle's VarMap init is random, so both runs load the weights of
    // one seeded VarMap first.
    let plain = ddp_norm_run_seeded(false, uses, config);
    let ckpt = ddp_norm_run_seeded(true, uses, config);
    let (plain, ckpt) = match (plain, ckpt) {
        (Ok(p), Ok(c)) => (p, c),
        (p, c) => panic!("plain: {:?}\ncheckpointed: {:?}", p.err(), c.err()),
    };
    let names: Vec<&String> = plain[0].iter().map(|(n, _)| n).collect();
    let d = max_abs_diff(&values(&plain[0]), &values(&ckpt[0]));
    assert!(
        d < 1e-5,
        "checkpointed vs plain, largest difference {d} over {names:?}\nplain {:?}\nckpt  {:?}",
        plain[0],
        ckpt[0]
    );
}

fn ddp_norm_run_seeded(
    checkpointed: bool,
    uses: usize,
    config: fn() -> DdpConfig,
) -> Result<Vec<Named>, String> {
    bounded(Duration::from_secs(90), move || {
        distributed::spawn_threads(2, |pg| {
            let varmap = VarMap::new();
            // Seed the variables by name (both runs ask for the same names and shapes).
            {
                let vb = seeded_var_builder(&varmap, 11, DType::F32, &CPU);
                net(false, 1)(vb)?;
            }
            let model = DistributedDataParallel::with_config(&varmap, &pg, &CPU, config(), |vb| {
                net(checkpointed, uses)(vb)
            })?;
            let mut opt = Sgd::new(
                model.parameters(),
                SgdConfig {
                    lr: 0.1,
                    ..Default::default()
                },
            )?;
            for step in 0..3 {
                let x = rows(step * 7 + pg.rank() * 3, 6, 4);
                let loss = model.forward_t(&x, true)?.sqr()?.mean_all()?;
                opt.step(&model.backward(&loss)?)?;
            }
            Ok(named(&varmap))
        })
        .map_err(|e| e.to_string())
    })
}

#[test]
fn a_sync_batch_norm_inside_a_checkpointed_block_trains_as_without_checkpointing() {
    compare_ddp_norm(1, || DdpConfig {
        sync_batch_norm: true,
        ..Default::default()
    });
}

// B. Control-style probes: plain BatchNorm (no sync) inside a checkpointed block under DDP, in
// f32 and bf16, the block used once or twice per forward: running statistics and weights after
// 3 steps must equal the same model without checkpointing.
#[test]
fn b_ddp_checkpointed_batch_norm_equals_plain_f32_used_twice() {
    compare_ddp_norm(2, DdpConfig::default);
}

#[test]
fn b_ddp_checkpointed_batch_norm_equals_plain_bf16() {
    compare_ddp_norm(1, || DdpConfig {
        mixed_precision: MixedPrecision::bf16(),
        ..Default::default()
    });
}

#[test]
fn b_ddp_checkpointed_batch_norm_equals_plain_zero2_used_twice() {
    compare_ddp_norm(2, || DdpConfig {
        sharding: Sharding::Zero2,
        ..Default::default()
    });
}

// =============================================================================================
// C. join_with: three ranks with 0, 1 and 3 batches (rank 0 has none at all), a step that
// clips then uses a group GradScaler, Sgd or AdamW, plain or ZeRO-2, JoinDivisor::Active or
// World. Contract (src/ddp/join.rs:17-25): with Active, an iteration's gradient is the average
// over the batches of the ranks still training, as one process would take it over those
// batches; with World, the joined ranks count as zeros (the sum over the active ranks' batch
// means divided by the world size). So every rank's final weights must equal one process that,
// for each iteration, takes the batches of the ranks still training and does the same step.

const BATCHES: [usize; 3] = [0, 1, 3];
const CLIP: f64 = 0.05;

fn batch(rank: usize, b: usize) -> Tensor {
    rows(100 * rank + 7 * b, 5, 4)
}

fn seeded_linear(varmap: &VarMap) -> Linear {
    linear(4, 3, seeded_var_builder(varmap, 5, DType::F32, &CPU)).unwrap()
}

#[derive(Clone, Copy, Debug)]
enum Opt {
    Sgd,
    AdamW,
}

fn make_opt(kind: Opt, vars: Vec<Var>) -> candle_parallel::Result<Box<dyn Stepper>> {
    Ok(match kind {
        Opt::Sgd => Box::new(Sgd::new(
            vars,
            SgdConfig {
                lr: 0.3,
                momentum: 0.9,
                ..Default::default()
            },
        )?),
        Opt::AdamW => Box::new(AdamW::new(
            vars,
            AdamWConfig {
                lr: 0.05,
                ..Default::default()
            },
        )?),
    })
}

/// An optimizer behind a box, for the scaler.
trait Stepper: Send {
    fn vars_(&self) -> Vec<Var>;
    fn step_(
        &mut self,
        scaler: &mut GradScaler,
        grads: &mut GradStore,
    ) -> candle_parallel::Result<bool>;
}

impl<O: candle_parallel::optim::ElementwiseOptimizer + Send> Stepper for O {
    fn vars_(&self) -> Vec<Var> {
        self.vars().to_vec()
    }
    fn step_(
        &mut self,
        scaler: &mut GradScaler,
        grads: &mut GradStore,
    ) -> candle_parallel::Result<bool> {
        scaler.step(self, grads)
    }
}

/// One process over the same data: per iteration, the active ranks' batches concatenated.
fn one_process(kind: Opt, divisor: JoinDivisor) -> Vec<Vec<f32>> {
    let varmap = VarMap::new();
    let model = seeded_linear(&varmap);
    let vars: Vec<Var> = {
        let mut v: Vec<(String, Var)> = varmap
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v.into_iter().map(|(_, v)| v).collect()
    };
    let mut opt = make_opt(kind, vars.clone()).unwrap();
    let mut scaler = GradScaler::new(GradScalerConfig {
        init_scale: 1024.0,
        ..Default::default()
    })
    .unwrap();
    let world = BATCHES.len();
    for i in 0..*BATCHES.iter().max().unwrap() {
        let active: Vec<usize> = (0..world).filter(|&r| BATCHES[r] > i).collect();
        let x = Tensor::cat(&active.iter().map(|&r| batch(r, i)).collect::<Vec<_>>(), 0).unwrap();
        let mut loss = model
            .forward(&x)
            .unwrap()
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap();
        if let JoinDivisor::World = divisor {
            loss = (loss * (active.len() as f64 / world as f64)).unwrap();
        }
        let mut grads = scaler.scale(&loss).unwrap().backward().unwrap();
        scaler.unscale(&mut grads, &opt.vars_()).unwrap();
        candle_parallel::optim::clip_grad_norm(&mut grads, &opt.vars_(), CLIP, 2.0, false).unwrap();
        opt.step_(&mut scaler, &mut grads).unwrap();
        scaler.update();
    }
    values(&named(&varmap))
}

fn joined(
    kind: Opt,
    sharding: Sharding,
    divisor: JoinDivisor,
) -> Result<Vec<Vec<Vec<f32>>>, String> {
    bounded(Duration::from_secs(90), move || {
        distributed::spawn_threads(3, move |pg| {
            let varmap = VarMap::new();
            seeded_linear(&varmap);
            let config = DdpConfig {
                sharding,
                ..Default::default()
            };
            let model = DistributedDataParallel::with_config(&varmap, &pg, &CPU, config, |vb| {
                linear(4, 3, vb)
            })?;
            let opt = make_opt(kind, model.parameters())?;
            let scaler = GradScaler::for_group(
                GradScalerConfig {
                    init_scale: 1024.0,
                    ..Default::default()
                },
                &pg,
                &CPU,
            )?;
            type State = (Box<dyn Stepper>, GradScaler);
            let step = |(opt, scaler): &mut State, mut grads: GradStore| {
                scaler.unscale(&mut grads, &opt.vars_())?;
                model.clip_grad_norm(&mut grads, CLIP, 2.0, false)?;
                opt.step_(scaler, &mut grads)?;
                scaler.update();
                Ok(())
            };
            let rank = pg.rank();
            let mut state: State = (opt, scaler);
            model.join_with(&mut state, divisor, step, |state| {
                for b in 0..BATCHES[rank] {
                    let loss = model.forward_t(&batch(rank, b), true)?.sqr()?.mean_all()?;
                    let grads = model.backward(&state.1.scale(&loss)?)?;
                    step(state, grads)?;
                }
                Ok(())
            })?;
            model.gather_parameters()?;
            Ok(values(&named(&varmap)))
        })
        .map_err(|e| e.to_string())
    })
}

fn check_join(kind: Opt, sharding: Sharding, divisor: JoinDivisor) {
    let want = one_process(kind, divisor);
    let got = joined(kind, sharding, divisor)
        .unwrap_or_else(|e| panic!("{kind:?} {sharding:?} {divisor:?}: {e}"));
    for (rank, w) in got.iter().enumerate() {
        let d = max_abs_diff(w, &want);
        assert!(
            d < 1e-5,
            "{kind:?} {sharding:?} {divisor:?}: rank {rank} differs from one process by {d}\n\
             rank {rank}: {w:?}\none process: {want:?}"
        );
    }
}

#[test]
fn c_join_with_0_1_3_batches_active_equals_one_process() {
    for kind in [Opt::Sgd, Opt::AdamW] {
        for sharding in [Sharding::None, Sharding::Zero2] {
            check_join(kind, sharding, JoinDivisor::Active);
        }
    }
}

#[test]
fn c_join_with_0_1_3_batches_world_equals_one_process() {
    for kind in [Opt::Sgd, Opt::AdamW] {
        for sharding in [Sharding::None, Sharding::Zero2] {
            check_join(kind, sharding, JoinDivisor::World);
        }
    }
}

// =============================================================================================
// D. join_with whose step fails on one rank (rank 1's second step): the error must come back
// on every rank, promptly (bounded here), never a hang.

/// Three ranks with 0, 1 and 3 batches inside `join_with`, whose step fails on `failing`'s
/// `call`-th call: the error must come back on every rank, bounded, never a hang.
fn step_error_returns_everywhere(failing: usize, call: usize) {
    let message = format!("rank {failing}'s step {call} fails");
    let expected = message.clone();
    let outcome = bounded(Duration::from_secs(60), move || {
        distributed::spawn_threads(3, move |pg| {
            let varmap = VarMap::new();
            let model = DistributedDataParallel::new(&varmap, &pg, &CPU, |vb| linear(4, 3, vb))?;
            let mut opt = Sgd::new(
                model.parameters(),
                SgdConfig {
                    lr: 0.1,
                    ..Default::default()
                },
            )?;
            let rank = pg.rank();
            let calls = std::cell::Cell::new(0);
            let step = |opt: &mut Sgd, grads: GradStore| {
                calls.set(calls.get() + 1);
                if rank == failing && calls.get() == call {
                    return Err(candle_parallel::Error::InvalidArgument {
                        what: "probe",
                        detail: message.clone(),
                    });
                }
                Ok(opt.step(&grads)?)
            };
            model.join_with(&mut opt, JoinDivisor::World, step, |opt| {
                for b in 0..BATCHES[rank] {
                    let loss = model.forward_t(&batch(rank, b), true)?.sqr()?.mean_all()?;
                    step(opt, model.backward(&loss)?)?;
                }
                Ok(())
            })
        })
        .map_err(|e| e.to_string())
    });
    assert!(
        matches!(&outcome, Err(e) if e.contains(&expected)),
        "{outcome:?}"
    );
}

#[test]
fn d_join_with_step_error_on_one_rank_returns_everywhere() {
    // Rank 1's second step, while rank 2 still trains and rank 0 shadows.
    step_error_returns_everywhere(1, 2);
}

#[test]
fn d_join_with_step_error_on_the_joined_rank_returns_everywhere() {
    // The rank with no batches at all fails in its first shadow step.
    step_error_returns_everywhere(0, 1);
}

// =============================================================================================
// E. GradScaler: `unscale` with the optimizer's variables in another order than the
// optimizer's own (a user who unscales `model.parameters()` sorted by name and steps an
// optimizer made from `varmap.all_vars()`, or any two listings of the same set).
//
// Expected (torch 2.15 keys the state by the optimizer, never by a listing of its
// parameters): the step uses the unscaled gradients and steps.
// Observed: `step` fails "variable 0 of 2 [...] was already unscaled since the last update(),
// with another set of variables".
// Cause: src/amp/grad_scaler.rs:200 and :285 compare `ids` as ordered Vecs (`o.ids == ids`), so
// the same set in another order is a new optimizer overlapping the first.
#[test]
fn e_grad_scaler_unscale_then_step_with_the_same_vars_in_another_order() {
    let a = Var::new(&[1f32, 2.], &CPU).unwrap();
    let b = Var::new(&[3f32], &CPU).unwrap();
    let mut opt = Sgd::new(
        vec![a.clone(), b.clone()],
        SgdConfig {
            lr: 0.1,
            ..Default::default()
        },
    )
    .unwrap();
    let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
    let loss = (a.as_tensor().sqr().unwrap().sum_all().unwrap()
        + b.as_tensor().sqr().unwrap().sum_all().unwrap())
    .unwrap();
    let mut grads = scaler.scale(&loss).unwrap().backward().unwrap();
    scaler.unscale(&mut grads, &[b.clone(), a.clone()]).unwrap();
    let stepped = scaler.step(&mut opt, &mut grads);
    assert!(matches!(stepped, Ok(true)), "{stepped:?}");
    scaler.update();
    // b = 3 - 0.1 * 6 = 2.4 (unscaled once, not twice)
    assert!((b.as_tensor().to_vec1::<f32>().unwrap()[0] - 2.4).abs() < 1e-5);
}

// =============================================================================================
// F. Plain join: the replica check and the group-scaler refusal.

/// A linear model with an integer buffer and a frozen (unused) parameter.
struct Odd {
    fc: Linear,
    _count: Tensor,
    _frozen: Tensor,
}

impl ModuleT for Odd {
    fn forward_t(&self, x: &Tensor, _: bool) -> candle_core::Result<Tensor> {
        self.fc.forward(x)
    }
}

fn odd(vb: VarBuilder) -> candle_core::Result<Odd> {
    Ok(Odd {
        fc: linear(4, 3, vb.pp("fc"))?,
        _count: vb.get_with_hints_dtype(1, "count", candle_nn::Init::Const(0.), DType::I64)?,
        _frozen: vb.get((2, 2), "frozen.weight")?,
    })
}

// False positives: a legitimate plain-join loop (forward, backward, one opt.step) over a model
// with an integer buffer and a frozen parameter, in f32 and under bf16 MixedPrecision, Sgd and
// AdamW, 3 ranks with 0/1/3 batches: must end Ok with equal replicas.
#[test]
fn f_plain_join_legitimate_loops_are_not_mismatches() {
    for precision in [MixedPrecision::default(), MixedPrecision::bf16()] {
        for kind in [Opt::Sgd, Opt::AdamW] {
            let outcome = bounded(Duration::from_secs(90), move || {
                distributed::spawn_threads(3, move |pg| {
                    let varmap = VarMap::new();
                    let config = DdpConfig {
                        mixed_precision: precision,
                        frozen_parameters: vec!["frozen".into()],
                        ..Default::default()
                    };
                    let model =
                        DistributedDataParallel::with_config(&varmap, &pg, &CPU, config, odd)?;
                    let mut opt = match kind {
                        Opt::Sgd => Plain::S(Sgd::new(
                            model.parameters(),
                            SgdConfig {
                                lr: 0.3,
                                momentum: 0.9,
                                ..Default::default()
                            },
                        )?),
                        Opt::AdamW => Plain::A(AdamW::new(
                            model.parameters(),
                            AdamWConfig {
                                lr: 0.05,
                                ..Default::default()
                            },
                        )?),
                    };
                    let rank = pg.rank();
                    model.join(&mut opt, JoinDivisor::Active, |opt| {
                        for b in 0..BATCHES[rank] {
                            let loss = model.forward_t(&batch(rank, b), true)?.sqr()?.mean_all()?;
                            opt.step(&model.backward(&loss)?)?;
                        }
                        Ok(())
                    })?;
                    Ok(values(&named(&varmap)))
                })
                .map_err(|e| e.to_string())
            });
            match outcome {
                Ok(w) => {
                    for r in 1..3 {
                        assert_eq!(w[r], w[0], "{precision:?} {kind:?}: rank {r}");
                    }
                }
                Err(e) => panic!("{precision:?} {kind:?}: {e}"),
            }
        }
    }
}

/// Sgd or AdamW behind one type.
enum Plain {
    S(Sgd),
    A(AdamW),
}

impl Optimizer for Plain {
    type Config = ();
    fn new(_: Vec<Var>, _: ()) -> candle_core::Result<Self> {
        candle_core::bail!("not used")
    }
    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        match self {
            Plain::S(o) => o.step(grads),
            Plain::A(o) => o.step(grads),
        }
    }
    fn learning_rate(&self) -> f64 {
        match self {
            Plain::S(o) => o.learning_rate(),
            Plain::A(o) => o.learning_rate(),
        }
    }
    fn set_learning_rate(&mut self, lr: f64) {
        match self {
            Plain::S(o) => o.set_learning_rate(lr),
            Plain::A(o) => o.set_learning_rate(lr),
        }
    }
}

// False negative: plain join under ZeRO-2 with a one-process GradScaler (`GradScaler::new`,
// which the plain-join refusal does not cover: it refuses group scalers only). The rank that
// ran out of batches shadows with `opt.step` of the *scaled* gradients (x1024) on its piece,
// the active rank steps its piece with unscaled ones; the replica check is skipped under ZeRO-2
// (src/ddp/join.rs check_replicas_agree returns Ok when pieces exist).
// Expected: an error naming join_with (as for clipping under ZeRO-2 and for the scaler without
// sharding), or weights equal to the same run through join_with.
// Observed: Ok on both ranks, equal replicas, and weights up to 36 away from join_with's
// (fc weight piece [-2.16, -11.25, 35.15, -33.44, ..] vs [-0.098, -0.160, -0.875, 0.577, ..]):
// the joined rank's piece took a step of the x1024 gradients. Silent.
// Cause: src/amp/grad_scaler.rs:186-187 refuses only scalers with a group of world size > 1
// inside a plain join; src/ddp/join.rs:220 skips the replica check under ZeRO-2.
#[test]
fn f_plain_join_zero2_with_a_one_process_scaler_is_not_silent() {
    let run = |with: bool| {
        bounded(Duration::from_secs(60), move || {
            distributed::spawn_threads(2, move |pg| {
                let varmap = VarMap::new();
                seeded_linear(&varmap);
                let config = DdpConfig {
                    sharding: Sharding::Zero2,
                    ..Default::default()
                };
                let model =
                    DistributedDataParallel::with_config(&varmap, &pg, &CPU, config, |vb| {
                        linear(4, 3, vb)
                    })?;
                let opt = Sgd::new(
                    model.parameters(),
                    SgdConfig {
                        lr: 0.1,
                        ..Default::default()
                    },
                )?;
                let scaler = GradScaler::new(GradScalerConfig {
                    init_scale: 1024.0,
                    ..Default::default()
                })?;
                type State = (Sgd, GradScaler);
                let step = |(opt, scaler): &mut State, mut grads: GradStore| {
                    scaler.step(opt, &mut grads)?;
                    scaler.update();
                    Ok(())
                };
                let mut state = (opt, scaler);
                let rank = pg.rank();
                let train = |state: &mut State| {
                    for b in 0..1 + rank {
                        let loss = model.forward_t(&batch(rank, b), true)?.sqr()?.mean_all()?;
                        let grads = model.backward(&state.1.scale(&loss)?)?;
                        step(state, grads)?;
                    }
                    Ok(())
                };
                if with {
                    model.join_with(&mut state, JoinDivisor::World, step, train)?;
                } else {
                    let (opt, scaler) = &mut state;
                    model.join(opt, JoinDivisor::World, |opt| {
                        for b in 0..1 + rank {
                            let loss = model.forward_t(&batch(rank, b), true)?.sqr()?.mean_all()?;
                            let mut grads = model.backward(&scaler.scale(&loss)?)?;
                            scaler.step(opt, &mut grads)?;
                            scaler.update();
                        }
                        Ok(())
                    })?;
                }
                model.gather_parameters()?;
                Ok(values(&named(&varmap)))
            })
            .map_err(|e| e.to_string())
        })
    };
    let want = run(true).expect("join_with");
    match run(false) {
        Err(e) => assert!(e.contains("join_with"), "{e}"),
        Ok(got) => {
            let d = max_abs_diff(&got[0], &want[0]);
            assert!(
                d < 1e-5,
                "plain join + ZeRO-2 + GradScaler::new ended Ok, {d} away from join_with's \
                 weights:\nplain join {:?}\njoin_with  {:?}",
                got[0],
                want[0]
            );
        }
    }
}

// =============================================================================================
// G. Activation checkpointing with candle-nn's BatchNorm in one process: a block used twice
// per forward, training and evaluation forwards, over several SGD steps. Gradients (bit for
// bit, as the module docs promise) and running statistics must equal the plain block's.

/// candle-nn's BatchNorm after a linear layer.
struct NnNorm {
    fc: Linear,
    bn: candle_nn::BatchNorm,
}

impl ModuleT for NnNorm {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.bn.forward_t(&self.fc.forward(x)?, train)?.relu()
    }
}

fn nn_norm(vb: VarBuilder) -> candle_core::Result<NnNorm> {
    Ok(NnNorm {
        fc: linear(4, 4, vb.pp("fc"))?,
        bn: candle_nn::batch_norm(4, 1e-5, vb.pp("bn"))?,
    })
}

/// Three steps: a training forward using the block twice, then (step 2) an evaluation forward
/// followed by backward too; every gradient and the variables at the end.
fn one_process_norm(checkpointed: bool) -> (Vec<Vec<Vec<f32>>>, Named) {
    let varmap = VarMap::new();
    let vb = seeded_var_builder(&varmap, 9, DType::F32, &CPU);
    let block = checkpoint_if(checkpointed, vb.pp("blk"), nn_norm).unwrap();
    let mut vars: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .filter(|(n, _)| !n.contains("running"))
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let vars: Vec<Var> = vars.into_iter().map(|(_, v)| v).collect();
    let mut opt = Sgd::new(
        vars.clone(),
        SgdConfig {
            lr: 0.1,
            ..Default::default()
        },
    )
    .unwrap();
    let mut all_grads = Vec::new();
    for step in 0..3 {
        let train = step != 2;
        let x = Var::from_tensor(&rows(step * 5 + 1, 6, 4)).unwrap();
        let h = block.forward_t(x.as_tensor(), train).unwrap();
        let h = block.forward_t(&h, train).unwrap();
        let grads = h.sqr().unwrap().mean_all().unwrap().backward().unwrap();
        let mut g: Vec<Vec<f32>> = vars
            .iter()
            .map(|v| {
                grads
                    .get(v.as_tensor())
                    .map(|g| g.flatten_all().unwrap().to_vec1().unwrap())
                    .unwrap_or_default()
            })
            .collect();
        g.push(
            grads
                .get(x.as_tensor())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap(),
        );
        all_grads.push(g);
        opt.step(&grads).unwrap();
    }
    (all_grads, named(&varmap))
}

#[test]
fn g_checkpointed_candle_nn_batch_norm_used_twice_train_and_eval_equals_plain() {
    let plain = one_process_norm(false);
    let ckpt = one_process_norm(true);
    assert_eq!(ckpt.0, plain.0, "gradients (step, variable) differ");
    assert_eq!(ckpt.1, plain.1, "variables after 3 steps differ");
}

// =============================================================================================
// H. FSDP with MixedPrecision::bf16 and a checkpointed block (candle-nn BatchNorm) inside a
// unit: must train (no dtype error), move the running mean, and equal the same FSDP model
// without checkpointing.

struct CkNorm(Checkpointed<NnNorm>);

impl ModuleT for CkNorm {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.0.forward_t(x, train)
    }
}

struct FsdpNet {
    a: candle_parallel::fsdp::Unit<CkNorm>,
    head: Linear,
}

impl ModuleT for FsdpNet {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.head.forward(&self.a.forward_t(x, train)?)
    }
}

fn fsdp_run(checkpointed: bool) -> Result<Vec<Named>, String> {
    bounded(Duration::from_secs(90), move || {
        distributed::spawn_threads(2, move |pg| {
            let config = candle_parallel::FsdpConfig {
                seed: Some(3),
                mixed_precision: MixedPrecision::bf16(),
                ..Default::default()
            };
            let model = candle_parallel::FullyShardedDataParallel::with_config(
                &VarMap::new(),
                &pg,
                &CPU,
                config,
                move |vb| {
                    Ok(FsdpNet {
                        a: candle_parallel::fsdp::unit(vb.pp("a"), move |vb| {
                            Ok(CkNorm(checkpoint_if(checkpointed, vb, nn_norm)?))
                        })?,
                        head: linear(4, 2, vb.pp("head"))?,
                    })
                },
            )?;
            let mut opt = Sgd::new(
                model.parameters(),
                SgdConfig {
                    lr: 0.1,
                    ..Default::default()
                },
            )?;
            for step in 0..3 {
                let x = rows(step * 3 + pg.rank(), 8, 4);
                let loss = model.forward_t(&x, true)?.sqr()?.mean_all()?;
                opt.step(&model.backward(&loss)?)?;
            }
            let mut out: Vec<(String, Vec<f32>)> = model
                .buffers()
                .into_iter()
                .filter(|(_, v)| v.dtype().is_float())
                .map(|(n, v)| {
                    (
                        n,
                        v.as_tensor()
                            .to_dtype(DType::F32)
                            .unwrap()
                            .flatten_all()
                            .unwrap()
                            .to_vec1()
                            .unwrap(),
                    )
                })
                .collect();
            for (n, t) in model.full_parameters()? {
                out.push((n, t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?));
            }
            out.sort_by(|a, b| a.0.cmp(&b.0));
            Ok(out)
        })
        .map_err(|e| e.to_string())
    })
}

#[test]
fn h_fsdp_bf16_checkpointed_batch_norm_unit_equals_plain() {
    let plain = fsdp_run(false).expect("plain FSDP bf16");
    let ckpt = fsdp_run(true).expect("checkpointed FSDP bf16");
    let mean = plain[0]
        .iter()
        .find(|(n, _)| n.ends_with("running_mean"))
        .expect("a running mean");
    assert!(mean.1.iter().any(|m| *m != 0.0), "{mean:?}");
    let d = max_abs_diff(&values(&plain[0]), &values(&ckpt[0]));
    assert!(d < 1e-6, "{d}\nplain {:?}\nckpt  {:?}", plain[0], ckpt[0]);
}

// =============================================================================================
// I. Plain join's replica check on a run that diverged to NaN the same way on every rank (a
// learning rate far too large: nothing the shadow failed to mirror).
//
// Expected: Ok (torch's Join has no such check; the replicas are equal, all NaN), or an error
// that says the parameters are not finite.
// Observed: Error::Mismatch "after join the replicas' parameters differ (rank 0: sum NaN, ...):
// the training loop changed the gradients or the parameters between backward and step in a way
// the joined ranks did not mirror", wrapped in the join_with advice: it blames a correct loop
// and sends the user to join_with, which fails the same way.
// Cause: src/ddp/join.rs:240-243 treats NaN as differing ("NaN never equals") and reports it
// with the message of a divergence (join.rs:247-254); join_with runs the same check.
#[test]
fn i_plain_join_on_a_nan_run_does_not_blame_the_loop() {
    for with in [false, true] {
        let outcome = bounded(Duration::from_secs(60), move || {
            distributed::spawn_threads(2, move |pg| {
                let varmap = VarMap::new();
                let model =
                    DistributedDataParallel::new(&varmap, &pg, &CPU, |vb| linear(4, 3, vb))?;
                let mut opt = Sgd::new(
                    model.parameters(),
                    SgdConfig {
                        lr: 1e30,
                        ..Default::default()
                    },
                )?;
                let rank = pg.rank();
                let train = |opt: &mut Sgd| {
                    for b in 0..3 + rank {
                        let loss = model.forward_t(&batch(rank, b), true)?.sqr()?.mean_all()?;
                        opt.step(&model.backward(&loss)?)?;
                    }
                    Ok(())
                };
                match with {
                    false => model.join(&mut opt, JoinDivisor::World, train)?,
                    true => model.join_with(
                        &mut opt,
                        JoinDivisor::World,
                        |opt: &mut Sgd, g: GradStore| Ok(opt.step(&g)?),
                        train,
                    )?,
                }
                Ok(values(&named(&varmap)))
            })
            .map_err(|e| e.to_string())
        });
        match &outcome {
            Ok(w) => assert!(w[0].iter().flatten().any(|x| !x.is_finite()), "{w:?}"),
            Err(e) => assert!(
                !e.contains("did not mirror") && !e.contains("must give that step to join_with"),
                "join_with: {with}: a correct loop whose run went to NaN is blamed: {e}"
            ),
        }
    }
}

// =============================================================================================
// J. Accumulation with no_sync outside join, then join_with: each rank sums one micro-batch
// locally (no_sync, before join), then trains inside join_with; rank 0 has no batch inside
// join, rank 1 one. Rank 0's pending micro-batch gradient must either count (the first synced
// iteration averages both ranks' sums, as without join when rank 0 has a batch of zeros'
// weight) or be refused with an error; never lost in silence, never a hang.
//
// What counts as right: one process over [r0 micro, r1 micro, r1 batch] with World divisor:
// grad = (g(r0 micro) + g(r1 micro) + g(r1 batch)) / 2 (each rank's sum, averaged over 2).
#[test]
fn j_no_sync_accumulation_before_join_is_not_lost_in_silence() {
    let mean_loss =
        |m: &Linear, x: &Tensor| m.forward(x).unwrap().sqr().unwrap().mean_all().unwrap();
    let want = {
        let varmap = VarMap::new();
        let m = seeded_linear(&varmap);
        let vars: Vec<Var> = {
            let mut v: Vec<(String, Var)> =
                varmap.data().lock().unwrap().clone().into_iter().collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v.into_iter().map(|(_, v)| v).collect()
        };
        let loss = ((mean_loss(&m, &batch(0, 50)) + mean_loss(&m, &batch(1, 50))).unwrap()
            + mean_loss(&m, &batch(1, 0)))
        .unwrap();
        let loss = (loss / 2.0).unwrap();
        let mut opt = Sgd::new(
            vars,
            SgdConfig {
                lr: 0.1,
                ..Default::default()
            },
        )
        .unwrap();
        opt.step(&loss.backward().unwrap()).unwrap();
        values(&named(&varmap))
    };
    let outcome = bounded(Duration::from_secs(60), || {
        distributed::spawn_threads(2, |pg| {
            let varmap = VarMap::new();
            seeded_linear(&varmap);
            let model = DistributedDataParallel::new(&varmap, &pg, &CPU, |vb| linear(4, 3, vb))?;
            let mut opt = Sgd::new(
                model.parameters(),
                SgdConfig {
                    lr: 0.1,
                    ..Default::default()
                },
            )?;
            let rank = pg.rank();
            {
                let _local = model.no_sync();
                let loss = model.forward_t(&batch(rank, 50), true)?.sqr()?.mean_all()?;
                model.backward(&loss)?;
            }
            model.join_with(
                &mut opt,
                JoinDivisor::World,
                |opt: &mut Sgd, g: GradStore| Ok(opt.step(&g)?),
                |opt| {
                    for b in 0..rank {
                        let loss = model.forward_t(&batch(rank, b), true)?.sqr()?.mean_all()?;
                        opt.step(&model.backward(&loss)?)?;
                    }
                    Ok(())
                },
            )?;
            Ok(values(&named(&varmap)))
        })
        .map_err(|e| e.to_string())
    });
    match outcome {
        Err(e) => assert!(e.contains("no_sync"), "an error that does not say why: {e}"),
        Ok(got) => {
            for (r, w) in got.iter().enumerate() {
                let d = max_abs_diff(w, &want);
                assert!(
                    d < 1e-5,
                    "rank {r} is {d} away from one process over all the micro-batches\n\
                     rank {r}: {w:?}\nwant: {want:?}"
                );
            }
        }
    }
}

// =============================================================================================
// K. GradScaler with two optimizers against torch 2.15 (`torch.amp.GradScaler("cpu",
// init_scale=8, growth_interval=2)`, SGD lr 0.1 on w_a = [1, 2] and w_b = [3]; loss
// sum(w_a * x_a) + sum(w_b^2 * x_b); iteration 2 puts an inf in x_a (only optimizer A's
// gradients), iteration 4 a NaN in x_b (only B's); A is unscaled explicitly, B by its step).
// torch's (scale, growth tracker, w_a, w_b) after each iteration, printed by
// scripts/torch_grad_scaler_two_optimizers.py:
//   0 8.0 1 [0.9, 1.95] [2.4]      1 16.0 0 [0.8, 1.9] [1.92]   2 8.0 0 [0.8, 1.9] [1.536]
//   3 8.0 1 [0.7, 1.85] [1.2288]   4 4.0 0 [0.6, 1.8] [1.2288]  5 4.0 1 [0.5, 1.75] [0.98304]
#[test]
fn k_grad_scaler_two_optimizers_inf_in_one_matches_torch() {
    let want: [(f64, u64, [f32; 2], f32); 6] = [
        (8.0, 1, [0.9, 1.95], 2.4),
        (16.0, 0, [0.8, 1.9], 1.92),
        (8.0, 0, [0.8, 1.9], 1.536),
        (8.0, 1, [0.7, 1.85], 1.2288),
        (4.0, 0, [0.6, 1.8], 1.2288),
        (4.0, 1, [0.5, 1.75], 0.98304),
    ];
    let wa = Var::new(&[1f32, 2.], &CPU).unwrap();
    let wb = Var::new(&[3f32], &CPU).unwrap();
    let cfg = SgdConfig {
        lr: 0.1,
        ..Default::default()
    };
    let mut oa = Sgd::new(vec![wa.clone()], cfg).unwrap();
    let mut ob = Sgd::new(vec![wb.clone()], cfg).unwrap();
    let mut s = GradScaler::new(GradScalerConfig {
        init_scale: 8.0,
        growth_interval: 2,
        ..Default::default()
    })
    .unwrap();
    for (i, (scale, tracker, a, b)) in want.iter().enumerate() {
        let xa = Tensor::new(&[1f32, if i == 2 { f32::INFINITY } else { 0.5 }], &CPU).unwrap();
        let xb = Tensor::new(&[if i == 4 { f32::NAN } else { 1.0 }], &CPU).unwrap();
        let loss = ((wa.as_tensor() * &xa).unwrap().sum_all().unwrap()
            + (wb.as_tensor().sqr().unwrap() * &xb)
                .unwrap()
                .sum_all()
                .unwrap())
        .unwrap();
        let mut grads = s.scale(&loss).unwrap().backward().unwrap();
        s.unscale(&mut grads, std::slice::from_ref(&wa)).unwrap();
        s.step(&mut oa, &mut grads).unwrap();
        s.step(&mut ob, &mut grads).unwrap();
        s.update();
        let got_a = wa.as_tensor().to_vec1::<f32>().unwrap();
        let got_b = wb.as_tensor().to_vec1::<f32>().unwrap()[0];
        assert_eq!(s.state(), (*scale, *tracker), "iteration {i}");
        assert!(
            (got_a[0] - a[0]).abs() < 1e-5 && (got_a[1] - a[1]).abs() < 1e-5,
            "iteration {i}: w_a {got_a:?}, torch {a:?}"
        );
        assert!(
            (got_b - b).abs() < 1e-5,
            "iteration {i}: w_b {got_b}, torch {b}"
        );
    }
}

// =============================================================================================
// L. A block that updates its buffers in place with `slice_set` (the way to write a tensor in
// place in candle without `Var::set`): an integer `num_batches_tracked` counter and a float
// `running_mean` EMA, inside a checkpointed block, one training forward and backward.
//
// Expected (the module docs: "buffers are served live to the forward and as copies to the
// recomputation", so that they move once, as without checkpointing): counter 1 and the EMA of
// one step, as the plain block.
// Observed: checkpointed counter 2 and running mean [0.0143, 0.0230, -0.0969] (two EMA
// steps); plain counter 1 and [0.0075, 0.0121, -0.0510]. Silent.
// Cause: the recomputation's "copies" are `p.detach()`
// (src/activation_checkpointing/pin.rs:53), and candle 0.11's `Tensor::detach` shares the
// storage (candle-core tensor.rs:2382-2391: `storage: self.storage.clone()`): an in-place write
// in the recomputation lands in the live buffer.
struct Counting {
    fc: Linear,
    count: Tensor,
    mean: Tensor,
}

impl ModuleT for Counting {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let y = self.fc.forward(x)?;
        if train {
            let one = Tensor::ones(1, DType::I64, x.device())?;
            self.count
                .slice_set(&(self.count.broadcast_add(&one))?, 0, 0)?;
            let batch = y.detach().mean(0)?;
            let ema = ((&self.mean * 0.9)? + (batch * 0.1)?)?;
            self.mean.slice_set(&ema, 0, 0)?;
        }
        Ok(y)
    }
}

fn counting(vb: VarBuilder) -> candle_core::Result<Counting> {
    Ok(Counting {
        fc: linear(4, 3, vb.pp("fc"))?,
        count: vb.get_with_hints_dtype(
            1,
            "num_batches_tracked",
            candle_nn::Init::Const(0.),
            DType::I64,
        )?,
        mean: vb.get_with_hints(3, "running_mean", candle_nn::Init::Const(0.))?,
    })
}

#[test]
fn l_in_place_buffer_updates_happen_once_under_checkpointing() {
    let run = |checkpointed: bool| {
        let varmap = VarMap::new();
        let vb = seeded_var_builder(&varmap, 4, DType::F32, &CPU);
        let block = checkpoint_if(checkpointed, vb.pp("c"), counting).unwrap();
        let x = Var::from_tensor(&rows(2, 5, 4)).unwrap();
        let y = block.forward_t(x.as_tensor(), true).unwrap();
        y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        let data = varmap.data().lock().unwrap();
        (
            data["c.num_batches_tracked"]
                .as_tensor()
                .to_vec1::<i64>()
                .unwrap(),
            data["c.running_mean"].as_tensor().to_vec1::<f32>().unwrap(),
        )
    };
    let plain = run(false);
    let ckpt = run(true);
    assert_eq!(
        ckpt, plain,
        "(counter, running mean): checkpointed vs plain"
    );
}

#[test]
fn b_ddp_checkpointed_batch_norm_equals_plain_bf16_zero2_used_twice() {
    compare_ddp_norm(2, || DdpConfig {
        mixed_precision: MixedPrecision::bf16(),
        sharding: Sharding::Zero2,
        ..Default::default()
    });
}

// =============================================================================================
// M. A block whose training forward updates a buffer (candle's way: `Var::from_tensor` of the
// served tensor, then `set`) and then computes with the updated value (a running normaliser
// of inputs, as in RL observation normalisation; BatchNorm's eval path reading stats that the
// same forward moved).
//
// Expected (module docs: "The gradients are those of the plain block, bit for bit"): the
// gradients equal the plain block's, the buffer moved once.
// Observed: running mean equal (moved once), but the weight gradient differs from the plain
// block's by up to 0.17 ([0.4572, -0.7234, ..] vs [0.4517, -0.6906, ..]). Silent.
// Cause: the recomputation gets the buffer's value *after* the forward's update
// (src/activation_checkpointing/pin.rs:50-54 copies the buffer as it is at backward), updates
// that copy again and computes with a value the forward never used. Severity low: the module
// docs' rule "the block computes the same output each time for the same input" arguably
// excludes such a block, but a snapshot of the buffers taken before the forward and served to
// the recomputation would make it exact (torch's non-reentrant checkpoint has the same flaw).
struct RunningCentre {
    fc: Linear,
    mean: Tensor,
}

impl ModuleT for RunningCentre {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let y = self.fc.forward(x)?;
        let mean = Var::from_tensor(&self.mean)?;
        if train {
            let batch = y.detach().mean(0)?;
            mean.set(&((mean.as_tensor() * 0.5)? + (batch * 0.5)?)?)?;
        }
        y.broadcast_sub(&mean.as_tensor().detach())?.tanh()
    }
}

fn running_centre(vb: VarBuilder) -> candle_core::Result<RunningCentre> {
    Ok(RunningCentre {
        fc: linear(4, 3, vb.pp("fc"))?,
        mean: vb.get_with_hints(3, "running_mean", candle_nn::Init::Const(0.))?,
    })
}

#[test]
fn m_a_forward_that_reads_its_updated_buffer_has_the_plain_gradients() {
    let run = |checkpointed: bool| {
        let varmap = VarMap::new();
        let vb = seeded_var_builder(&varmap, 4, DType::F32, &CPU);
        let block = checkpoint_if(checkpointed, vb.pp("c"), running_centre).unwrap();
        let x = Var::from_tensor(&rows(2, 5, 4)).unwrap();
        let y = block.forward_t(x.as_tensor(), true).unwrap();
        let g = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        let data = varmap.data().lock().unwrap();
        let w = &data["c.fc.weight"];
        (
            g.get(w.as_tensor())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            data["c.running_mean"].as_tensor().to_vec1::<f32>().unwrap(),
        )
    };
    let plain = run(false);
    let ckpt = run(true);
    assert_eq!(
        ckpt, plain,
        "(weight gradient, running mean): checkpointed vs plain"
    );
}

// =============================================================================================
// N. GradScaler::unscale with a variable listed twice (a parameter list built by
// concatenating two overlapping groups).
//
// Expected: the gradient divided by the scale once (torch unscales each `.grad` once per
// optimizer, whatever its param groups say), or an error naming the duplicate.
// Observed: Ok, and the gradient [0.5, 1.0] (divided by the scale 4 twice) instead of [2, 4];
// a later step would move the parameter by a quarter of the step. Silent. Low severity.
// Cause: src/amp/grad_scaler.rs unscale (the loop after the `inv` line) loops over `vars` and re-inserts
// `g * inv` each time, with no check for duplicates within one call.
#[test]
fn n_grad_scaler_unscale_with_a_duplicated_variable() {
    let a = Var::new(&[1f32, 2.], &CPU).unwrap();
    let mut scaler = GradScaler::new(GradScalerConfig {
        init_scale: 4.0,
        ..Default::default()
    })
    .unwrap();
    let loss = a.as_tensor().sqr().unwrap().sum_all().unwrap();
    let mut grads = scaler.scale(&loss).unwrap().backward().unwrap();
    match scaler.unscale(&mut grads, &[a.clone(), a.clone()]) {
        Err(_) => {}
        Ok(()) => {
            let g = grads.get(a.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(
                g,
                [2., 4.],
                "the gradient of a^2 is 2a; unscaled twice it is 2a/4"
            );
        }
    }
}

// =============================================================================================
// O. A checkpointed block whose output is a view of its last product: a GLU's half (a narrow
// at an offset), a transpose, a broadcast, the first part of a `chunk`, the first rows.
//
// Expected: the gradients of the plain block, bit for bit, in one process (to rounding for the
// transpose and the broadcast, which the next layer reads in another order); under DDP the steps of one process on the whole batch.
// Observed: every forward failed with "pass-through op given a view (Layout { .. }): make it
// contiguous first" except the first rows, whose output kept the product's whole buffer alive
// (twice the activation the block was checkpointed to drop).
// Cause: src/activation_checkpointing/pin.rs `attach` made a view compact with `Tensor::copy`,
// which keeps the view's layout, and the op's forward (src/util/pass_through.rs) refused any
// layout but a compact one, and cloned a compact one's storage whole.

/// How [`ViewOut`] returns (a function of each row of) its product `(n, 2 * 4)`, as an
/// `(n, 4)` view.
#[derive(Clone, Copy, Debug)]
enum View {
    /// The second half of each row: a narrow at an offset.
    SecondHalf,
    /// The first half, through `chunk` (offset 0, rows strided).
    FirstChunk,
    /// The first half, laid out column-major (a transpose of a compact `(4, n)`).
    Transpose,
    /// Each row's mean, broadcast over 4 columns.
    Broadcast,
    /// The first half made compact, as the first `n` rows of a `(2n, 4)` buffer.
    FirstRows,
}

struct ViewOut(Linear, View);

impl Module for ViewOut {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let n = x.dim(0)?;
        let y = self.0.forward(x)?;
        match self.1 {
            View::SecondHalf => y.narrow(1, 4, 4),
            View::FirstChunk => Ok(y.chunk(2, 1)?[0].clone()),
            View::Transpose => y.narrow(1, 0, 4)?.t()?.contiguous()?.t(),
            View::Broadcast => y.mean_keepdim(1)?.broadcast_as((n, 4)),
            View::FirstRows => {
                let h = y.narrow(1, 0, 4)?.contiguous()?;
                Tensor::cat(&[&h, &h], 0)?.narrow(0, 0, n)
            }
        }
    }
}

/// Two blocks returning `view` (checkpointed or not) and a head.
struct ViewNet(Vec<Checkpointed<ViewOut>>, Linear);

impl Module for ViewNet {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        for b in &self.0 {
            h = b.forward(&h)?;
        }
        h.apply(&self.1)
    }
}

fn view_net(
    checkpointed: bool,
    view: View,
) -> impl Fn(VarBuilder) -> candle_core::Result<ViewNet> + Send + Sync + Copy {
    move |vb| {
        let blocks = (0..2)
            .map(|i| {
                checkpoint_if(checkpointed, vb.pp(format!("b{i}")), move |vb| {
                    Ok(ViewOut(linear(4, 8, vb)?, view))
                })
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(ViewNet(blocks, linear(4, 3, vb.pp("head"))?))
    }
}

const VIEWS: [View; 5] = [
    View::SecondHalf,
    View::FirstChunk,
    View::Transpose,
    View::Broadcast,
    View::FirstRows,
];

#[test]
fn o_a_checkpointed_block_whose_output_is_a_view_has_the_plain_blocks_gradients() {
    for view in VIEWS {
        // Rows 3.. of a larger batch: the input is a view too.
        let x = rows(1, 9, 4).narrow(0, 3, 6).unwrap();
        let grads = |checkpointed: bool| -> candle_core::Result<Named> {
            let varmap = VarMap::new();
            let vb = seeded_var_builder(&varmap, 5, DType::F32, &CPU);
            let model = view_net(checkpointed, view)(vb)?;
            if checkpointed {
                // The block's output holds its own values only, not the product's buffer.
                let out = model.0[0].forward(&x)?;
                let (storage, _) = out.storage_and_layout();
                let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(buffer)) = &*storage
                else {
                    panic!("an f32 CPU tensor")
                };
                assert_eq!(
                    buffer.len(),
                    out.elem_count(),
                    "{view:?}: the output's buffer"
                );
            }
            let g = model.forward(&x)?.sqr()?.sum_all()?.backward()?;
            let mut out: Named = varmap
                .data()
                .lock()
                .unwrap()
                .iter()
                .map(|(n, v)| {
                    let g = g.get(v.as_tensor()).expect("every variable has a gradient");
                    (n.clone(), g.flatten_all().unwrap().to_vec1().unwrap())
                })
                .collect();
            out.sort_by(|a, b| a.0.cmp(&b.0));
            Ok(out)
        };
        let plain = grads(false).unwrap();
        let ckpt = grads(true).unwrap_or_else(|e| panic!("{view:?}: {e}"));
        match view {
            // The head reads the checkpointed output compact, the plain one column-major or
            // broadcast: candle's matmul sums in another order.
            View::Transpose | View::Broadcast => {
                let d = max_abs_diff(&values(&ckpt), &values(&plain));
                assert!(d < 1e-4, "{view:?}: checkpointed vs plain gradients, {d}");
            }
            _ => assert_eq!(ckpt, plain, "{view:?}: checkpointed vs plain gradients"),
        }
    }
}

#[test]
fn o_under_ddp_a_checkpointed_block_whose_output_is_a_view_trains_as_one_process() {
    let sgd = SgdConfig {
        lr: 0.1,
        ..Default::default()
    };
    for view in VIEWS {
        let varmap = VarMap::new();
        let model =
            view_net(false, view)(seeded_var_builder(&varmap, 5, DType::F32, &CPU)).unwrap();
        let mut opt = Sgd::new(varmap.all_vars(), sgd).unwrap();
        for step in 0..3 {
            let loss = model.forward(&rows(step, 8, 4)).unwrap().sqr().unwrap();
            opt.backward_step(&loss.mean_all().unwrap()).unwrap();
        }
        let want = named(&varmap);
        let got = bounded(Duration::from_secs(60), move || {
            distributed::spawn_threads(2, move |pg| {
                let varmap = VarMap::new();
                view_net(false, view)(seeded_var_builder(&varmap, 5, DType::F32, &CPU))?;
                let ddp = DistributedDataParallel::new(&varmap, &pg, &CPU, view_net(true, view))?;
                let mut opt = Sgd::new(ddp.parameters(), sgd)?;
                for step in 0..3 {
                    // This rank's half of the batch: a narrow at an offset on rank 1.
                    let x = rows(step, 8, 4).narrow(0, 4 * pg.rank(), 4)?;
                    let loss = ddp.forward_t(&x, true)?.sqr()?.mean_all()?;
                    opt.step(&ddp.backward(&loss)?)?;
                }
                Ok(named(&varmap))
            })
        })
        .unwrap_or_else(|e| panic!("{view:?}: {e}"));
        for g in &got {
            let d = max_abs_diff(&values(&want), &values(g));
            assert!(d < 1e-5, "{view:?}: DDP vs one process, {d}");
        }
    }
}

/// A linear layer, then this crate's `nn::batch_norm` last: the block's training output is the
/// norm's, a transpose (candle-nn's BatchNorm and SyncBatchNorm alike return one).
struct NormLast {
    fc: Linear,
    bn: candle_parallel::nn::BatchNorm,
}

impl ModuleT for NormLast {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.bn.forward_t(&self.fc.forward(x)?, train)
    }
}

/// A (possibly checkpointed) [`NormLast`] block, then a head.
struct NormLastNet(Checkpointed<NormLast>, Linear);

impl ModuleT for NormLastNet {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.1.forward(&self.0.forward_t(x, train)?)
    }
}

fn norm_last_net(checkpointed: bool) -> impl Fn(VarBuilder) -> candle_core::Result<NormLastNet> {
    move |vb| {
        let block = checkpoint_if(checkpointed, vb.pp("blk"), |vb| {
            Ok(NormLast {
                fc: linear(4, 4, vb.pp("fc"))?,
                bn: candle_parallel::nn::batch_norm(4, 1e-5, vb.pp("bn"))?,
            })
        })?;
        Ok(NormLastNet(block, linear(4, 2, vb.pp("head"))?))
    }
}

#[test]
fn o_a_checkpointed_block_ending_with_batch_norm_trains_as_without_checkpointing() {
    // Observed before the fix: "pass-through op given a view (Layout { shape: [12, 4], stride:
    // [1, 12], .. })" at the first training forward: the norm's output is a transpose.
    let sgd = SgdConfig {
        lr: 0.1,
        ..Default::default()
    };
    let one_process = |checkpointed: bool| -> Named {
        let varmap = VarMap::new();
        let vb = seeded_var_builder(&varmap, 11, DType::F32, &CPU);
        let model = norm_last_net(checkpointed)(vb).unwrap();
        let mut opt = Sgd::new(varmap.all_vars(), sgd).unwrap();
        for step in 0..3 {
            let out = model.forward_t(&rows(step, 12, 4), true).unwrap();
            opt.backward_step(&out.sqr().unwrap().mean_all().unwrap())
                .unwrap_or_else(|e| panic!("checkpointed {checkpointed}: {e}"));
        }
        named(&varmap)
    };
    let plain = one_process(false);
    let d = max_abs_diff(&values(&plain), &values(&one_process(true)));
    assert!(d < 1e-6, "one process, checkpointed vs plain: {d}");
    // Under DDP with SyncBatchNorm: statistics over both ranks' rows, as one process's.
    let ranks = bounded(Duration::from_secs(60), move || {
        distributed::spawn_threads(2, move |pg| {
            let varmap = VarMap::new();
            norm_last_net(false)(seeded_var_builder(&varmap, 11, DType::F32, &CPU))?;
            let config = DdpConfig {
                sync_batch_norm: true,
                ..Default::default()
            };
            let model = DistributedDataParallel::with_config(
                &varmap,
                &pg,
                &CPU,
                config,
                norm_last_net(true),
            )?;
            let mut opt = Sgd::new(model.parameters(), sgd)?;
            for step in 0..3 {
                let x = rows(step, 12, 4).narrow(0, 6 * pg.rank(), 6)?;
                let loss = model.forward_t(&x, true)?.sqr()?.mean_all()?;
                opt.step(&model.backward(&loss)?)?;
            }
            Ok(named(&varmap))
        })
    })
    .unwrap();
    for got in &ranks {
        let d = max_abs_diff(&values(&plain), &values(got));
        assert!(
            d < 1e-5,
            "DDP with SyncBatchNorm, checkpointed, vs one process: {d}"
        );
    }
}
