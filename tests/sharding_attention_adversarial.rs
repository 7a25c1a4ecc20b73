//! Probes written to break two features, as a user would: `pipeline::FullyShardedStage` (fs_*)
//! and `nn::attention::causal_attention` (attn_*). Each asserts the correct behaviour; the seven
//! that failed when written were fixed (a parameter without a gradient anywhere was stepped with
//! zeros, a builder asking for fewer variables or a stale stage passed in silence, an integer
//! variable broke every gather, a zero-width qkv panicked, the backward lost accuracy at scores
//! near 1e4).

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{linear, Init, Linear, Optimizer, VarBuilder, VarMap};
use candle_parallel::distributed::{self, DeviceMesh};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::nn::attention::{causal_attention, composed};
use candle_parallel::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
use candle_parallel::pipeline::{FullyShardedStage, PipelineSchedule, Schedule};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, Once};

// ---------------------------------------------------------------- a logger that records

static LOGS: Mutex<Vec<String>> = Mutex::new(Vec::new());
static LOGGER_ONCE: Once = Once::new();

struct Recorder;

impl log::Log for Recorder {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }
    fn log(&self, record: &log::Record) {
        if record.level() <= log::Level::Warn {
            LOGS.lock()
                .unwrap()
                .push(format!("{}", record.args()).to_lowercase());
        }
    }
    fn flush(&self) {}
}

fn install_logger() {
    LOGGER_ONCE.call_once(|| {
        let _ = log::set_logger(&Recorder);
        log::set_max_level(log::LevelFilter::Warn);
    });
}

fn logged_any(words: &[&str]) -> Option<String> {
    LOGS.lock()
        .unwrap()
        .iter()
        .find(|m| words.iter().any(|w| m.contains(w)))
        .cloned()
}

// ---------------------------------------------------------------- feature A: fully sharded

const SEED: u64 = 11;
const ROWS: usize = 12;
const STEPS: usize = 4;

#[derive(Clone, Copy, Default)]
struct Flags {
    /// A variable the builder creates but the forward never uses.
    unused: bool,
    /// A zero-size variable used in the forward (through its sum).
    empty: bool,
}

struct Net {
    l1: Linear,
    scale: Tensor,
    l2: Linear,
    empty: Option<Tensor>,
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.l1.forward(x)?.relu()?.broadcast_mul(&self.scale)?;
        let y = self.l2.forward(&h)?;
        match &self.empty {
            Some(e) => y.broadcast_add(&e.sum_all()?),
            None => Ok(y),
        }
    }
}

/// l1: 4 -> 5 (20 + 5 elements, 5 not a multiple of 3), scale: 1 element (< dp), l2: 5 -> 2 (10
/// + 2, 2 < 3), optionally a zero-size `empty` and an `unused` (3, 2).
fn build(vb: VarBuilder, flags: Flags) -> candle_core::Result<Net> {
    let l1 = linear(4, 5, vb.pp("l1"))?;
    let scale = vb.get_with_hints(
        1,
        "scale",
        Init::Randn {
            mean: 1.0,
            stdev: 0.1,
        },
    )?;
    let l2 = linear(5, 2, vb.pp("l2"))?;
    let empty = match flags.empty {
        true => Some(vb.get_with_hints(
            0,
            "empty",
            Init::Randn {
                mean: 0.0,
                stdev: 1.0,
            },
        )?),
        false => None,
    };
    if flags.unused {
        vb.get_with_hints(
            (3, 2),
            "unused",
            Init::Randn {
                mean: 0.0,
                stdev: 1.0,
            },
        )?;
    }
    Ok(Net {
        l1,
        scale,
        l2,
        empty,
    })
}

fn det(n: usize, seed: f64) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let v = ((i as f64 * 12.9898 + seed * 78.233).sin() * 43758.5453).fract();
            (2.0 * v) as f32
        })
        .collect()
}

fn data(step: usize) -> (Tensor, Tensor) {
    let x = Tensor::from_vec(det(ROWS * 4, step as f64 + 0.5), (ROWS, 4), &Device::Cpu).unwrap();
    let y = Tensor::from_vec(det(ROWS * 2, step as f64 + 7.25), (ROWS, 2), &Device::Cpu).unwrap();
    (x, y)
}

#[derive(Clone, Copy)]
enum Opt {
    Sgd,
    AdamW,
}

enum AnyOpt {
    Sgd(Sgd),
    AdamW(AdamW),
}

impl AnyOpt {
    fn new(kind: Opt, vars: Vec<Var>) -> AnyOpt {
        match kind {
            Opt::Sgd => AnyOpt::Sgd(
                Sgd::new(
                    vars,
                    SgdConfig {
                        lr: 0.1,
                        momentum: 0.9,
                        weight_decay: 0.05,
                        ..Default::default()
                    },
                )
                .unwrap(),
            ),
            Opt::AdamW => AnyOpt::AdamW(
                AdamW::new(
                    vars,
                    AdamWConfig {
                        lr: 0.05,
                        weight_decay: 0.1,
                        ..Default::default()
                    },
                )
                .unwrap(),
            ),
        }
    }
    fn step(&mut self, g: &candle_core::backprop::GradStore) -> candle_core::Result<()> {
        match self {
            AnyOpt::Sgd(o) => o.step(g),
            AnyOpt::AdamW(o) => o.step(g),
        }
    }
}

type Values = Vec<(String, Vec<f32>)>;

fn values_of(pairs: impl IntoIterator<Item = (String, Var)>) -> Values {
    let mut v: Values = pairs
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                v.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            )
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn one_process(kind: Opt, flags: Flags) -> Values {
    let varmap = VarMap::new();
    let net = build(
        seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu),
        flags,
    )
    .unwrap();
    let mut opt = AnyOpt::new(kind, varmap.all_vars());
    for step in 0..STEPS {
        let (x, y) = data(step);
        let loss = candle_nn::loss::mse(&net.forward(&x).unwrap(), &y).unwrap();
        opt.step(&loss.backward().unwrap()).unwrap();
    }
    let data = varmap.data().lock().unwrap();
    values_of(data.iter().map(|(n, v)| (n.clone(), v.clone())))
}

/// Trains on `dp` thread replicas, each initialised with a different seed except rank 0 (the
/// replicas must take rank 0's values). Returns each replica's (held elements, final values).
fn sharded(dp: usize, kind: Opt, flags: Flags) -> Vec<(usize, Values)> {
    distributed::spawn_threads(dp, |world| {
        let mesh = DeviceMesh::new(&world, &[("dp", dp), ("pp", 1)])?;
        let (dpg, ppg) = (mesh.get_group("dp")?, mesh.get_group("pp")?);
        let varmap = VarMap::new();
        let seed = match dpg.rank() {
            0 => SEED,
            r => SEED + 100 + r as u64,
        };
        build(
            seeded_var_builder(&varmap, seed, DType::F32, &Device::Cpu),
            flags,
        )?;
        let stage = FullyShardedStage::new(&varmap, move |vb| build(vb, flags), 0, 1, ppg, dpg)?;
        drop(varmap);
        let held: usize = stage.pieces().iter().map(|p| p.elem_count()).sum();
        let mut opt = AnyOpt::new(kind, stage.pieces().to_vec());
        let schedule = PipelineSchedule::new(Schedule::GPipe, 2, candle_nn::loss::mse)?;
        let per = ROWS / dp;
        for step in 0..STEPS {
            let (x, y) = data(step);
            let (x, y) = (
                x.narrow(0, per * dpg.rank(), per)?,
                y.narrow(0, per * dpg.rank(), per)?,
            );
            let whole = stage.gather()?;
            let out = schedule.step(&[&whole], Some(&x), Some(&y))?;
            let g = stage.reduce_scatter(&whole, &out.grads)?;
            opt.step(&g)?;
            drop(whole);
            if step == 1 {
                let whole = stage.gather()?;
                let eval = schedule.eval(&[&whole], Some(&x), Some(&y))?;
                assert_eq!(eval.losses.len(), 2);
                assert!(eval.losses.iter().all(|l| l.is_finite()));
            }
        }
        let whole = stage.gather()?;
        Ok((held, values_of(whole.named_parameters().to_vec())))
    })
    .unwrap()
}

fn compare(dp: usize, kind: Opt, flags: Flags) {
    let want = one_process(kind, flags);
    let got = sharded(dp, kind, flags);
    let total: usize = want.iter().map(|(_, v)| v.len()).sum();
    for (rank, (held, vals)) in got.iter().enumerate() {
        assert!(
            *held <= total.div_ceil(dp) + want.len(),
            "dp {dp}: replica {rank} holds {held} of {total} elements"
        );
        let names: Vec<&String> = vals.iter().map(|(n, _)| n).collect();
        let want_names: Vec<&String> = want.iter().map(|(n, _)| n).collect();
        assert_eq!(names, want_names, "dp {dp}: replica {rank}'s variables");
        for ((name, g), (_, w)) in vals.iter().zip(&want) {
            let d = g
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                d <= 1e-5,
                "dp {dp}: replica {rank}: `{name}` is {d} from one process (got {:?}, want {:?})",
                &g[..g.len().min(6)],
                &w[..w.len().min(6)]
            );
            assert_eq!(g, &got[0].1.iter().find(|(n, _)| n == name).unwrap().1);
        }
    }
}

#[test]
fn fs_dp1_sgd_trains_as_one_process() {
    compare(1, Opt::Sgd, Flags::default());
}

#[test]
fn fs_dp3_uneven_sgd_trains_as_one_process() {
    compare(3, Opt::Sgd, Flags::default());
}

#[test]
fn fs_dp3_uneven_adamw_trains_as_one_process() {
    compare(3, Opt::AdamW, Flags::default());
}

#[test]
fn fs_dp3_zero_size_parameter_trains_as_one_process() {
    compare(
        3,
        Opt::Sgd,
        Flags {
            empty: true,
            ..Default::default()
        },
    );
}

/// A parameter the forward never uses gets no gradient in one process, so neither SGD's weight
/// decay nor AdamW's touch it there (crate::shard's docs: "a parameter without a gradient is
/// left out of a step on every rank, as in one process").
#[test]
fn fs_dp3_unused_parameter_adamw_trains_as_one_process() {
    compare(
        3,
        Opt::AdamW,
        Flags {
            unused: true,
            ..Default::default()
        },
    );
}

#[test]
fn fs_dp2_unused_parameter_sgd_weight_decay_trains_as_one_process() {
    compare(
        2,
        Opt::Sgd,
        Flags {
            unused: true,
            ..Default::default()
        },
    );
}

/// Runs `f` on a world of one thread with `dp` and `pp` groups of one, returning its result as
/// text (an error, a panic, or "ok").
fn on_one_rank<F>(f: F) -> String
where
    F: Fn(
            &candle_parallel::distributed::ProcessGroup,
            &candle_parallel::distributed::ProcessGroup,
        ) -> Result<(), String>
        + Sync,
{
    let r = distributed::spawn_threads(1, |world| {
        let mesh = DeviceMesh::new(&world, &[("dp", 1), ("pp", 1)])?;
        let (dp, pp) = (mesh.get_group("dp")?, mesh.get_group("pp")?);
        Ok(match catch_unwind(AssertUnwindSafe(|| f(pp, dp))) {
            Ok(Ok(())) => "ok".to_string(),
            Ok(Err(e)) => format!("error: {e}"),
            Err(_) => "PANIC".to_string(),
        })
    });
    match r {
        Ok(v) => v[0].clone(),
        Err(e) => format!("spawn error: {e}"),
    }
}

fn plain(vb: VarBuilder) -> candle_core::Result<Net> {
    build(vb, Flags::default())
}

fn plain_varmap(flags: Flags) -> VarMap {
    let varmap = VarMap::new();
    build(
        seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu),
        flags,
    )
    .unwrap();
    varmap
}

#[test]
fn fs_builder_asking_for_an_extra_variable_is_an_error_naming_it() {
    let r = on_one_rank(|pp, dp| {
        let varmap = plain_varmap(Flags::default());
        let builder = |vb: VarBuilder| -> candle_core::Result<Net> {
            let net = plain(vb.clone())?;
            vb.get_with_hints(3, "surprise", Init::Const(0.0))?;
            Ok(net)
        };
        let s =
            FullyShardedStage::new(&varmap, builder, 0, 1, pp, dp).map_err(|e| e.to_string())?;
        s.gather().map(|_| ()).map_err(|e| e.to_string())
    });
    assert!(r.starts_with("error") && r.contains("surprise"), "got: {r}");
}

#[test]
fn fs_builder_asking_for_fewer_variables_is_an_error_naming_the_missing_one() {
    let r = on_one_rank(|pp, dp| {
        let varmap = plain_varmap(Flags {
            unused: true,
            ..Default::default()
        });
        let s = FullyShardedStage::new(&varmap, plain, 0, 1, pp, dp).map_err(|e| e.to_string())?;
        s.gather().map(|_| ()).map_err(|e| e.to_string())
    });
    assert!(r.starts_with("error") && r.contains("unused"), "got: {r}");
}

#[test]
fn fs_builder_asking_for_another_shape_is_an_error() {
    let r = on_one_rank(|pp, dp| {
        let varmap = plain_varmap(Flags::default());
        let builder = |vb: VarBuilder| linear(4, 6, vb.pp("l1"));
        let s =
            FullyShardedStage::new(&varmap, builder, 0, 1, pp, dp).map_err(|e| e.to_string())?;
        s.gather().map(|_| ()).map_err(|e| e.to_string())
    });
    assert!(r.starts_with("error") && r.contains("l1"), "got: {r}");
}

#[test]
fn fs_mixed_dtypes_is_an_error_naming_the_variable() {
    let r = on_one_rank(|pp, dp| {
        let varmap = VarMap::new();
        {
            let mut data = varmap.data().lock().unwrap();
            data.insert(
                "a".into(),
                Var::zeros((2, 2), DType::F32, &Device::Cpu).unwrap(),
            );
            data.insert("b".into(), Var::zeros(3, DType::F64, &Device::Cpu).unwrap());
        }
        let builder = |vb: VarBuilder| vb.get((2, 2), "a");
        FullyShardedStage::new(&varmap, builder, 0, 1, pp, dp)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    assert!(r.starts_with("error") && r.contains("`b`"), "got: {r}");
}

#[test]
fn fs_empty_varmap_is_an_error() {
    let r = on_one_rank(|pp, dp| {
        let varmap = VarMap::new();
        let builder = |_vb: VarBuilder| Ok(());
        FullyShardedStage::new(&varmap, builder, 0, 1, pp, dp)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    assert!(r.starts_with("error"), "got: {r}");
}

/// A VarMap with an integer variable (a step counter, say) beside the float parameters: either
/// `new` refuses it by name, or a builder that asks for it again still gathers.
#[test]
fn fs_integer_variable_in_the_varmap_is_refused_or_gathered() {
    let r = on_one_rank(|pp, dp| {
        let varmap = plain_varmap(Flags::default());
        let builder = |vb: VarBuilder| -> candle_core::Result<Net> {
            let net = plain(vb.clone())?;
            vb.get_with_hints_dtype(1, "count", Init::Const(0.0), DType::U32)?;
            Ok(net)
        };
        builder(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))
            .map_err(|e| format!("setup: {e}"))?;
        let s = FullyShardedStage::new(&varmap, builder, 0, 1, pp, dp)
            .map_err(|e| format!("new: {e}"))?;
        s.gather().map(|_| ()).map_err(|e| format!("gather: {e}"))
    });
    assert!(
        r == "ok" || (r.starts_with("error: new") && r.contains("count")),
        "got: {r}"
    );
}

#[test]
fn fs_stage_not_on_this_rank_is_an_error_on_that_rank() {
    let r = distributed::spawn_threads(2, |world| {
        let mesh = DeviceMesh::new(&world, &[("dp", 1), ("pp", 2)])?;
        let (dp, pp) = (mesh.get_group("dp")?, mesh.get_group("pp")?);
        let varmap = plain_varmap(Flags::default());
        let r = catch_unwind(AssertUnwindSafe(|| {
            FullyShardedStage::new(&varmap, plain, 0, 2, pp, dp).map(|_| ())
        }));
        let bad = catch_unwind(AssertUnwindSafe(|| {
            FullyShardedStage::new(&varmap, plain, 0, 3, pp, dp).map(|_| ())
        }));
        Ok((
            match r {
                Ok(Ok(())) => "ok".to_string(),
                Ok(Err(e)) => format!("error: {e}"),
                Err(_) => "PANIC".into(),
            },
            matches!(bad, Ok(Err(_))),
        ))
    })
    .unwrap();
    assert_eq!(r[0].0, "ok");
    assert!(
        r[1].0.starts_with("error") && r[1].0.contains("stage 0"),
        "rank 1: {}",
        r[1].0
    );
    assert!(r[0].1 && r[1].1, "3 stages over 2 ranks must be refused");
}

#[test]
fn fs_reduce_scatter_with_a_stage_of_another_sharded_stage_is_an_error() {
    let r = on_one_rank(|pp, dp| {
        let a = FullyShardedStage::new(&plain_varmap(Flags::default()), plain, 0, 1, pp, dp)
            .map_err(|e| e.to_string())?;
        let other = VarMap::new();
        let other_build = |vb: VarBuilder| build(vb.pp("other"), Flags::default());
        other_build(seeded_var_builder(&other, 1, DType::F32, &Device::Cpu)).unwrap();
        let b =
            FullyShardedStage::new(&other, other_build, 0, 1, pp, dp).map_err(|e| e.to_string())?;
        let stage_b = b.gather().map_err(|e| e.to_string())?;
        a.reduce_scatter(&stage_b, &candle_core::backprop::GradStore::default())
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    assert!(r.starts_with("error"), "got: {r}");
}

/// The step's gradients handed to reduce_scatter with a stale stage (gathered earlier, for an
/// evaluation say): none of its variables has a gradient in the store while the store holds
/// gradients, a certain mistake. Correct: an error, or at least a warning through `log`; wrong:
/// all-zero gradients in silence.
#[test]
fn fs_reduce_scatter_with_a_stale_stage_is_not_silent() {
    install_logger();
    let r = on_one_rank(|pp, dp| {
        let s = FullyShardedStage::new(&plain_varmap(Flags::default()), plain, 0, 1, pp, dp)
            .map_err(|e| e.to_string())?;
        let schedule = PipelineSchedule::new(Schedule::GPipe, 2, candle_nn::loss::mse)
            .map_err(|e| e.to_string())?;
        let stale = s.gather().map_err(|e| e.to_string())?;
        let fresh = s.gather().map_err(|e| e.to_string())?;
        let (x, y) = data(0);
        let out = schedule
            .step(&[&fresh], Some(&x), Some(&y))
            .map_err(|e| e.to_string())?;
        let g = s
            .reduce_scatter(&stale, &out.grads)
            .map_err(|e| e.to_string())?;
        let norm: f32 = s
            .pieces()
            .iter()
            .map(|p| {
                g.get(p.as_tensor())
                    .map(|t| {
                        t.abs()
                            .unwrap()
                            .sum_all()
                            .unwrap()
                            .to_scalar::<f32>()
                            .unwrap()
                    })
                    .unwrap_or(0.0)
            })
            .sum();
        Err(format!("accepted; gradient pieces' L1 norm {norm}"))
    });
    let warned = logged_any(&["no gradient", "without a gradient", "stale", "not the one"]);
    assert!(
        r.starts_with("error: reduce_scatter") || r.contains("not the one") || warned.is_some(),
        "got: {r}; no warning logged"
    );
}

// ---------------------------------------------------------------- feature B: attention

fn detq(shape: &[usize], seed: f64, scale: f32) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f32> = det(n, seed).into_iter().map(|x| x * scale).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

fn max_abs(t: &Tensor) -> f64 {
    f64s(t).iter().fold(0f64, |m, x| m.max(x.abs()))
}

/// The largest difference, infinite where one is NaN and the other is not.
fn diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    f64s(a)
        .iter()
        .zip(f64s(b))
        .map(|(x, y)| match (x.is_nan(), y.is_nan()) {
            (true, true) => 0.0,
            (false, false) => (x - y).abs(),
            _ => f64::INFINITY,
        })
        .fold(0f64, f64::max)
}

type Attn = dyn Fn(&Tensor, usize) -> candle_core::Result<Tensor>;

/// `f`'s output and the gradient of `sum(f(qkv) * g)` with respect to `qkv`.
fn value_and_grad(f: &Attn, qkv: &Tensor, heads: usize, g: &Tensor) -> (Tensor, Tensor) {
    let v = Var::from_tensor(qkv).unwrap();
    let y = f(v.as_tensor(), heads).unwrap();
    let grads = (&y * g).unwrap().sum_all().unwrap().backward().unwrap();
    (y, grads.get(&v).expect("a gradient").clone())
}

fn check_against_composed(b: usize, t: usize, heads: usize, hd: usize, scale: f32) {
    let dim = heads * hd;
    let qkv = detq(&[b, t, 3 * dim], (b * 1000 + t) as f64, scale);
    let g = detq(&[b, t, dim], t as f64 + 0.3, 1.0);
    let (y, dq) = value_and_grad(&causal_attention, &qkv, heads, &g);
    let (yr, dqr) = value_and_grad(&composed, &qkv, heads, &g);
    let dy = diff(&y, &yr);
    let dd = diff(&dq, &dqr);
    assert!(
        dy <= 1e-5 * max_abs(&yr).max(1.0),
        "({b}, {t}, {heads}x{hd}): values {dy} apart"
    );
    assert!(
        dd <= 1e-5 * max_abs(&dqr).max(1.0),
        "({b}, {t}, {heads}x{hd}): gradients {dd} apart (scale {})",
        max_abs(&dqr)
    );
}

fn no_panic<T>(f: impl FnOnce() -> candle_core::Result<T>) -> Result<T, String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("error: {e}")),
        Err(_) => Err("PANIC".into()),
    }
}

#[test]
fn attn_bad_arguments_are_errors_not_panics() {
    let cases: [(Vec<usize>, usize); 5] = [
        (vec![2, 5, 12], 0), // no heads
        (vec![2, 5, 10], 1), // width not a multiple of 3
        (vec![2, 5, 12], 3), // dim 4 not a multiple of 3 heads
        (vec![2, 5, 6], 4),  // more heads than width
        (vec![5, 12], 2),    // not 3-D
    ];
    for (shape, heads) in cases {
        let qkv = detq(&shape, 1.0, 1.0);
        let r = no_panic(|| causal_attention(&qkv, heads));
        assert!(
            matches!(&r, Err(e) if e.starts_with("error")),
            "{shape:?}, {heads} heads: {:?}",
            r.map(|t| t.dims().to_vec())
        );
    }
}

#[test]
fn attn_batch_0_and_time_0_give_empty_outputs_and_gradients() {
    for shape in [[0usize, 5, 12], [2, 0, 12], [0, 0, 12]] {
        let r = no_panic(|| {
            let v = Var::from_tensor(&Tensor::zeros(&shape, DType::F32, &Device::Cpu)?)?;
            let y = causal_attention(v.as_tensor(), 2)?;
            let grads = y.sum_all()?.backward()?;
            let g = grads.get(&v).map(|g| g.dims().to_vec());
            Ok((y.dims().to_vec(), g))
        });
        let (dims, g) = r.unwrap_or_else(|e| panic!("{shape:?}: {e}"));
        assert_eq!(dims, [shape[0], shape[1], 4], "{shape:?}");
        if let Some(g) = g {
            assert_eq!(g, shape, "{shape:?}: gradient shape");
        }
    }
}

/// Heads of size 0 (`qkv` of width 0): an empty `(b, t, 0)` output, no panic.
#[test]
fn attn_zero_width_is_no_panic() {
    let r = no_panic(|| {
        let v = Var::from_tensor(&Tensor::zeros((2, 3, 0), DType::F32, &Device::Cpu)?)?;
        let y = causal_attention(v.as_tensor(), 1)?;
        y.sum_all()?.backward()?;
        Ok(y.dims().to_vec())
    });
    assert!(
        matches!(&r, Ok(d) if d == &[2, 3, 0]) || matches!(&r, Err(e) if e.starts_with("error")),
        "got {r:?}"
    );
}

#[test]
fn attn_time_1_is_the_value() {
    let qkv = detq(&[3, 1, 18], 2.0, 1.0);
    let y = causal_attention(&qkv, 3).unwrap();
    assert_eq!(y.dims(), [3, 1, 6]);
    assert!(diff(&y, &qkv.narrow(2, 12, 6).unwrap()) < 1e-6);
    check_against_composed(3, 1, 3, 2, 1.0);
}

#[test]
fn attn_block_boundaries_and_long_time_equal_composed() {
    for t in [63, 64, 65, 128, 129, 300] {
        check_against_composed(2, t, 2, 8, 1.0);
    }
    check_against_composed(1, 300, 4, 1, 1.0);
}

/// Scores around 1e3..1e4: no NaN or infinity, and the kernel as close to an f64 computation
/// as the composed ops are (within 10x, or 1e-5 of the scale).
#[test]
fn attn_large_magnitude_is_stable() {
    let (b, t, heads, hd) = (2, 80, 2, 16);
    let dim = heads * hd;
    for scale in [30f32, 100.0] {
        let qkv = detq(&[b, t, 3 * dim], 5.0, scale);
        let g = detq(&[b, t, dim], 6.0, 1.0);
        let (y, dq) = value_and_grad(&causal_attention, &qkv, heads, &g);
        let (yc, dqc) = value_and_grad(&composed, &qkv, heads, &g);
        let q64 = qkv.to_dtype(DType::F64).unwrap();
        let g64 = g.to_dtype(DType::F64).unwrap();
        let (yr, dqr) = value_and_grad(&composed, &q64, heads, &g64);
        for t in [&y, &dq] {
            assert!(
                f64s(t).iter().all(|x| x.is_finite()),
                "scale {scale}: not finite"
            );
        }
        let (ey, ec) = (
            diff(&y.to_dtype(DType::F64).unwrap(), &yr),
            diff(&yc.to_dtype(DType::F64).unwrap(), &yr),
        );
        let (eg, egc) = (
            diff(&dq.to_dtype(DType::F64).unwrap(), &dqr),
            diff(&dqc.to_dtype(DType::F64).unwrap(), &dqr),
        );
        assert!(
            ey <= (10.0 * ec).max(1e-5 * max_abs(&yr)),
            "scale {scale}: values {ey} from f64 (composed f32: {ec})"
        );
        assert!(
            eg <= (10.0 * egc).max(1e-5 * max_abs(&dqr)),
            "scale {scale}: gradients {eg} from f64 (composed f32: {egc}, scale {})",
            max_abs(&dqr)
        );
    }
}

/// A NaN in one query (row 3, head 0 of sequence 0) makes that row's head-0 outputs NaN and
/// nothing else.
#[test]
fn attn_nan_in_one_query_stays_in_its_row() {
    let (b, t, heads, hd) = (2, 6, 2, 2);
    let dim = heads * hd;
    let mut v = det(b * t * 3 * dim, 9.0);
    v[3 * 3 * dim] = f32::NAN; // sequence 0, row 3, q column 0 (head 0)
    let qkv = Tensor::from_vec(v, (b, t, 3 * dim), &Device::Cpu).unwrap();
    let y = causal_attention(&qkv, heads).unwrap();
    let y = y.to_vec3::<f32>().unwrap();
    for (s, seq) in y.iter().enumerate() {
        for (r, row) in seq.iter().enumerate() {
            for (c, x) in row.iter().enumerate() {
                let should_be_nan = s == 0 && r == 3 && c < hd;
                assert_eq!(x.is_nan(), should_be_nan, "output ({s}, {r}, {c}) = {x}");
            }
        }
    }
}

#[test]
fn attn_other_dtypes_keep_their_dtype_and_values() {
    let qkv = detq(&[2, 9, 24], 3.0, 1.0);
    let want = causal_attention(&qkv, 2).unwrap();
    for (dtype, tol) in [(DType::F64, 1e-6), (DType::F16, 1e-2), (DType::BF16, 5e-2)] {
        let r = no_panic(|| {
            let v = Var::from_tensor(&qkv.to_dtype(dtype)?)?;
            let y = causal_attention(v.as_tensor(), 2)?;
            let grads = y.sum_all()?.backward()?;
            let g = grads.get(&v).expect("a gradient").dtype();
            Ok((y, g))
        });
        let (y, gdt) = r.unwrap_or_else(|e| panic!("{dtype:?}: {e}"));
        assert_eq!((y.dtype(), gdt), (dtype, dtype));
        let d = diff(&y.to_dtype(DType::F32).unwrap(), &want);
        assert!(d <= tol, "{dtype:?}: {d} from f32");
    }
}

#[test]
fn attn_non_contiguous_views_equal_composed() {
    let (b, t, heads, hd) = (2, 70, 2, 4);
    let dim = heads * hd;
    let g = detq(&[b, t, dim], 1.5, 1.0);
    type View = dyn Fn(&Tensor) -> Tensor;
    let narrow: &View = &move |w| w.narrow(2, 3, 3 * dim).unwrap();
    let transposed: &View = &|w| w.transpose(1, 2).unwrap();
    for (name, base, view) in [
        ("narrow", detq(&[b, t, 3 * dim + 5], 4.0, 1.0), narrow),
        ("transposed", detq(&[b, 3 * dim, t], 4.5, 1.0), transposed),
    ] {
        let run = |f: &Attn| {
            let v = Var::from_tensor(&base).unwrap();
            let x = view(v.as_tensor());
            assert!(!x.is_contiguous());
            let y = f(&x, heads).unwrap();
            let grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
            (y, grads.get(&v).expect("a gradient").clone())
        };
        let (y, dq) = run(&causal_attention);
        let (yr, dqr) = run(&composed);
        assert!(
            diff(&y, &yr) <= 1e-5 * max_abs(&yr).max(1.0),
            "{name}: values"
        );
        assert!(
            diff(&dq, &dqr) <= 1e-5 * max_abs(&dqr).max(1.0),
            "{name}: gradients"
        );
    }
}

#[test]
fn attn_qkv_from_a_product_passes_gradients_to_its_factors() {
    let (b, t, heads, hd, inp) = (2, 33, 2, 4, 8);
    let dim = heads * hd;
    let x = detq(&[b * t, inp], 2.5, 1.0);
    let w0 = detq(&[inp, 3 * dim], 3.5, 0.5);
    let g = detq(&[b, t, dim], 4.5, 1.0);
    let run = |f: &Attn| {
        let w = Var::from_tensor(&w0).unwrap();
        let qkv = x
            .matmul(w.as_tensor())
            .unwrap()
            .reshape((b, t, 3 * dim))
            .unwrap();
        let y = f(&qkv, heads).unwrap();
        let grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
        grads.get(&w).expect("a gradient for w").clone()
    };
    let (dw, dwr) = (run(&causal_attention), run(&composed));
    assert!(diff(&dw, &dwr) <= 1e-5 * max_abs(&dwr).max(1.0));
}

#[test]
fn attn_two_forwards_one_backward_give_the_summed_gradients() {
    let (b, t, heads, hd) = (2, 70, 2, 4);
    let dim = heads * hd;
    let base = detq(&[b, t, 3 * dim], 8.0, 1.0);
    let g = detq(&[b, t, dim], 8.5, 1.0);
    let run = |f: &Attn| {
        let v = Var::from_tensor(&base).unwrap();
        let y1 = f(v.as_tensor(), heads).unwrap();
        let y2 = f(
            &(v.as_tensor() * 0.5).unwrap().affine(1.0, 0.25).unwrap(),
            heads,
        )
        .unwrap();
        let y3 = f(v.as_tensor(), heads).unwrap();
        let loss = (y1.sum_all().unwrap() + (&y2 * &g).unwrap().sum_all().unwrap())
            .unwrap()
            .add(&y3.sqr().unwrap().sum_all().unwrap())
            .unwrap();
        let grads = loss.backward().unwrap();
        grads.get(&v).expect("a gradient").clone()
    };
    let (d, dr) = (run(&causal_attention), run(&composed));
    assert!(
        diff(&d, &dr) <= 1e-5 * max_abs(&dr).max(1.0),
        "{} apart",
        diff(&d, &dr)
    );
}
