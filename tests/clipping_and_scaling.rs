//! Gradient clipping and f16 loss scaling under every sharding, against one process: a clip
//! that bites every step (the 2-norm and the inf-norm) trains to one process's weights under
//! plain DDP, ZeRO-2 and fully sharded data parallel; an overflow that only one rank's pieces
//! can see skips that step on every rank and halves every rank's scale. Two real processes.

mod common;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, loss, Init, Linear, Optimizer, VarBuilder, VarMap};
use candle_parallel::amp::{GradScaler, GradScalerConfig};
use candle_parallel::ddp::{DdpConfig, Sharding};
use candle_parallel::distributed::ProcessGroup;
use candle_parallel::fsdp::{self, FsdpConfig, Unit};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{clip_grad_norm, AdamW, AdamWConfig};
use candle_parallel::{DistributedDataParallel, Error, FullyShardedDataParallel};
use common::models::{share, CLASSES, IN};
use common::{done, is_child, join_child, Ranks};
use std::collections::HashMap;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(120);
const WORLD: usize = 2;
const PER: usize = 6;
const STEPS: usize = 20;
const WIDTH: usize = 10;
const SEED: u64 = 9;
const ADAMW: AdamWConfig = AdamWConfig {
    lr: 0.05,
    betas: (0.9, 0.999),
    eps: 1e-8,
    weight_decay: 0.01,
    amsgrad: false,
    maximize: false,
};

/// A perceptron whose hidden layer is a unit, times a learnable scalar temperature (one
/// element: under sharding, only rank 0 holds it).
struct Net {
    l1: Unit<Linear>,
    head: Linear,
    temp: Tensor,
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.l1.forward(x)?.relu()?;
        self.head.forward(&h)?.broadcast_mul(&self.temp)
    }
}

fn net(vb: VarBuilder) -> candle_core::Result<Net> {
    Ok(Net {
        l1: fsdp::unit(vb.pp("l1"), |vb| linear(IN, WIDTH, vb))?,
        head: linear(WIDTH, CLASSES, vb.pp("head"))?,
        temp: vb.get_with_hints(1, "temp", Init::Const(1.0))?,
    })
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum How {
    One,
    Ddp(Sharding),
    Full,
}

/// What one run does to its gradients each step, and when its loss overflows.
#[derive(Clone, Copy, Debug)]
enum Treat {
    /// Clip to this norm, of this order.
    Clip(f64, f64),
    /// Scale the loss (f16's GradScaler); at this step the temperature's gradient is infinite
    /// on rank 1 only.
    Scale { overflow_at: usize },
}

/// The loss of step `step` on rank `rank`'s rows (`rank` None: one process, all rows), with
/// the poison that makes the temperature's gradient infinite on rank 1 at `overflow_at`.
fn step_loss(
    forward: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>,
    temp: Option<&Tensor>,
    step: usize,
    rank: Option<usize>,
    treat: Treat,
) -> candle_core::Result<Tensor> {
    let (x, y) = match rank {
        Some(r) => share(step, WORLD, PER, r),
        None => share(step, 1, WORLD * PER, 0),
    };
    let ce = loss::cross_entropy(&forward(&x)?, &y)?;
    let (Treat::Scale { overflow_at }, Some(temp)) = (treat, temp) else {
        return Ok(ce);
    };
    // Rank 1's loss (half of one process's) gets temp * inf at that step.
    let poisoned = step == overflow_at && rank != Some(0);
    let factor = if poisoned { f32::INFINITY } else { 0.0 };
    let weight = if rank.is_none() { 0.5 } else { 1.0 };
    let poison = Tensor::new(&[factor * weight], temp.device())?;
    ce + temp.mul(&poison)?.sum_all()?
}

/// What a run saw: every parameter by name at the end, and (scaling) each step's scale and
/// whether it stepped.
type Outcome = (HashMap<String, Tensor>, Vec<(f64, bool)>);

/// The end of one step: clip and step, or step through the scaler.
fn finish(
    treat: Treat,
    scaler: &mut Option<GradScaler>,
    trace: &mut Vec<(f64, bool)>,
    grads: &mut GradStore,
    opt: &mut AdamW,
    clip: impl FnOnce(&mut GradStore, f64, f64),
) {
    match (treat, scaler.as_mut()) {
        (Treat::Clip(max, p), _) => {
            clip(grads, max, p);
            opt.step(grads).unwrap();
        }
        (Treat::Scale { .. }, Some(scaler)) => {
            let stepped = scaler.step(opt, grads).unwrap();
            scaler.update();
            trace.push((scaler.scale_factor(), stepped));
        }
        (Treat::Scale { .. }, None) => unreachable!("a scaling run has a scaler"),
    }
}

fn scaled(l: Tensor, scaler: &Option<GradScaler>) -> Tensor {
    match scaler {
        Some(s) => s.scale(&l).unwrap(),
        None => l,
    }
}

/// Trains `STEPS` steps one way.
fn run(pg: Option<&ProcessGroup>, how: How, treat: Treat) -> Outcome {
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let model = net(seeded_var_builder(&varmap, SEED, DType::F32, &device)).unwrap();
    let rank = pg.map(|g| g.rank());
    let mut trace = Vec::new();
    let mut scaler = match (treat, pg) {
        (Treat::Scale { .. }, Some(pg)) => {
            Some(GradScaler::for_group(GradScalerConfig::default(), pg, &device).unwrap())
        }
        (Treat::Scale { .. }, None) => Some(GradScaler::new(GradScalerConfig::default()).unwrap()),
        _ => None,
    };
    let weights = match how {
        How::One => {
            let vars = varmap.all_vars();
            let mut opt = AdamW::new(vars.clone(), ADAMW).unwrap();
            for step in 0..STEPS {
                let forward = |x: &Tensor| model.forward(x);
                let l = step_loss(&forward, Some(&model.temp), step, None, treat).unwrap();
                let mut grads = scaled(l, &scaler).backward().unwrap();
                finish(
                    treat,
                    &mut scaler,
                    &mut trace,
                    &mut grads,
                    &mut opt,
                    |g, max, p| {
                        clip_grad_norm(g, &vars, max, p, false).unwrap();
                    },
                );
            }
            common_weights(&varmap)
        }
        How::Ddp(sharding) => {
            let config = DdpConfig {
                sharding,
                bucket_cap_mb: 1e-4,
                first_bucket_mb: 1e-4,
                ..DdpConfig::default()
            };
            let pg = pg.expect("a group");
            let m =
                DistributedDataParallel::with_config(&varmap, pg, &device, config, net).unwrap();
            let mut opt = AdamW::new(m.parameters(), ADAMW).unwrap();
            for step in 0..STEPS {
                let forward = |x: &Tensor| m.forward_t(x, true).map_err(Error::into_candle);
                let temp = m.module().temp.clone();
                let l = step_loss(&forward, Some(&temp), step, rank, treat).unwrap();
                let mut grads = m.backward(&scaled(l, &scaler)).unwrap();
                finish(
                    treat,
                    &mut scaler,
                    &mut trace,
                    &mut grads,
                    &mut opt,
                    |g, max, p| {
                        m.clip_grad_norm(g, max, p, false).unwrap();
                    },
                );
            }
            common_weights(&varmap)
        }
        How::Full => {
            let config = FsdpConfig {
                seed: Some(SEED),
                ..FsdpConfig::default()
            };
            let pg = pg.expect("a group");
            let f = FullyShardedDataParallel::with_config(&VarMap::new(), pg, &device, config, net)
                .unwrap();
            let mut opt = AdamW::new(f.parameters(), ADAMW).unwrap();
            for step in 0..STEPS {
                let forward = |x: &Tensor| f.forward_t(x, true).map_err(Error::into_candle);
                // The temperature lives inside FSDP's model: the poison multiplies rank 1's
                // output instead (every piece then sees it; the skip is the same).
                let l = match treat {
                    Treat::Scale { overflow_at } if step == overflow_at && rank == Some(1) => {
                        let (x, y) = share(step, WORLD, PER, 1);
                        let out = forward(&x).unwrap();
                        let ce = loss::cross_entropy(&out, &y).unwrap();
                        (ce + (out.sum_all().unwrap() * f64::INFINITY).unwrap()).unwrap()
                    }
                    _ => step_loss(&forward, None, step, rank, treat).unwrap(),
                };
                let mut grads = f.backward(&scaled(l, &scaler)).unwrap();
                finish(
                    treat,
                    &mut scaler,
                    &mut trace,
                    &mut grads,
                    &mut opt,
                    |g, max, p| {
                        f.clip_grad_norm(g, max, p, false).unwrap();
                    },
                );
            }
            f.full_parameters().unwrap().into_iter().collect()
        }
    };
    (weights, trace)
}

fn common_weights(varmap: &VarMap) -> HashMap<String, Tensor> {
    varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().copy().unwrap()))
        .collect()
}

fn max_diff(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .map(|(n, t)| common::max_abs_diff(t, &b[n]))
        .fold(0.0, f32::max)
}

#[test]
fn a_clip_that_bites_trains_as_one_process_under_every_sharding() {
    let test = "a_clip_that_bites_trains_as_one_process_under_every_sharding";
    if is_child() {
        let pg = join_child();
        for treat in [Treat::Clip(0.05, 2.0), Treat::Clip(0.01, f64::INFINITY)] {
            let (want, _) = run(None, How::One, treat);
            for how in [
                How::Ddp(Sharding::None),
                How::Ddp(Sharding::Zero2),
                How::Full,
            ] {
                let (got, _) = run(Some(&pg), how, treat);
                let d = max_diff(&got, &want);
                assert!(
                    d <= 1e-5,
                    "rank {} {how:?} {treat:?}: differs by {d}",
                    pg.rank()
                );
            }
        }
        done();
        return;
    }
    Ranks::world(test, WORLD).assert_all_pass(LIMIT);
}

#[test]
fn an_overflow_only_one_ranks_pieces_see_skips_the_step_everywhere_and_halves_the_scale() {
    let test =
        "an_overflow_only_one_ranks_pieces_see_skips_the_step_everywhere_and_halves_the_scale";
    if is_child() {
        let pg = join_child();
        let treat = Treat::Scale { overflow_at: 3 };
        let (want, want_trace) = run(None, How::One, treat);
        assert!(!want_trace[3].1 && want_trace.iter().filter(|t| !t.1).count() == 1);
        assert_eq!(want_trace[3].0, 32768.0);
        for how in [
            How::Ddp(Sharding::None),
            How::Ddp(Sharding::Zero2),
            How::Full,
        ] {
            let (got, trace) = run(Some(&pg), how, treat);
            assert_eq!(trace, want_trace, "rank {} {how:?}", pg.rank());
            if how != How::Full {
                let d = max_diff(&got, &want);
                assert!(d <= 1e-5, "rank {} {how:?}: differs by {d}", pg.rank());
            }
        }
        done();
        return;
    }
    Ranks::world(test, WORLD).assert_all_pass(LIMIT);
}

/// Gradients laid out two ways at once (pieces over the group, and whole on every rank): the
/// total norm counts each piece once and the whole ones once, and every rank scales by it.
#[test]
fn a_norm_over_parts_counts_pieces_over_their_group_and_whole_gradients_once() {
    use candle_core::Var;
    use candle_parallel::distributed;
    use candle_parallel::optim::clip_grad_norm_parts;
    let got = distributed::spawn_threads(2, |g| {
        // Rank r's piece has gradient [3 + r] (3 and 4), the whole one [12] on both ranks.
        let piece = Var::new(&[1f32], &Device::Cpu)?;
        let whole = Var::new(&[1f32], &Device::Cpu)?;
        let loss = ((piece.as_tensor() * (3.0 + g.rank() as f64))?.sum_all()?
            + (whole.as_tensor() * 12.0)?.sum_all()?)?;
        let mut grads = loss.backward()?;
        let parts = [
            (&[piece.clone()][..], Some(&g)),
            (&[whole.clone()][..], None),
        ];
        let norm = clip_grad_norm_parts(&mut grads, &parts, 6.5, 2.0, false)?;
        let scaled = grads.get(whole.as_tensor()).unwrap().to_vec1::<f32>()?[0];
        Ok((norm, scaled))
    })
    .unwrap();
    for (norm, scaled) in got {
        // sqrt(3² + 4² + 12²) = 13: every gradient halved.
        assert!((norm - 13.0).abs() < 1e-9, "{norm}");
        assert!((scaled - 6.0).abs() < 1e-5, "{scaled}");
    }
}

/// A NaN in one rank's piece makes the total norm NaN on every rank, and, as torch's
/// `clip_grad_norm_` (whose coefficient `max_norm / (NaN + 1e-6)` clamps to NaN), every
/// gradient on every rank NaN (2-norm and inf-norm): not one rank stepping with NaN pieces
/// while the others step with finite ones.
#[test]
fn a_nan_in_one_ranks_piece_makes_every_gradient_nan_as_torch_does() {
    use candle_core::Var;
    use candle_parallel::distributed;
    use candle_parallel::optim::clip_grad_norm_parts;
    for norm_type in [2.0, f64::INFINITY] {
        let got = distributed::spawn_threads(2, |g| {
            let piece = Var::new(&[1f32, 1.], &Device::Cpu)?;
            let whole = Var::new(&[1f32], &Device::Cpu)?;
            let k = if g.rank() == 1 { f64::NAN } else { 3.0 };
            let loss =
                ((piece.as_tensor() * k)?.sum_all()? + (whole.as_tensor() * 12.0)?.sum_all()?)?;
            let mut grads = loss.backward()?;
            let parts = [
                (&[piece.clone()][..], Some(&g)),
                (&[whole.clone()][..], None),
            ];
            let norm = clip_grad_norm_parts(&mut grads, &parts, 6.5, norm_type, false)?;
            let mut values = grads.get(piece.as_tensor()).unwrap().to_vec1::<f32>()?;
            values.extend(grads.get(whole.as_tensor()).unwrap().to_vec1::<f32>()?);
            Ok((norm, values))
        })
        .unwrap();
        for (rank, (norm, values)) in got.into_iter().enumerate() {
            assert!(norm.is_nan(), "{norm_type}: rank {rank}'s norm {norm}");
            assert!(
                values.iter().all(|v| v.is_nan()),
                "{norm_type}: rank {rank}'s gradients {values:?}"
            );
        }
    }
}
