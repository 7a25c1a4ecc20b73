//! SyncBatchNorm: the numbers of candle-nn's BatchNorm on the whole batch, over thread ranks
//! and over real processes on 127.0.0.1.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{batch_norm, linear, loss, Linear, ModuleT, Optimizer, VarBuilder, VarMap};
use candle_parallel::ddp::DdpConfig;
use candle_parallel::distributed::{self, ProcessGroup, ReduceOp};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{Sgd, SgdConfig};
use candle_parallel::rng::Rng;
use candle_parallel::{checkpoint, nn, DistributedDataParallel};
use common::{done, is_child, join_child, max_abs, Ranks};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(120);
const C: usize = 3;

/// Rows of step `step`'s whole batch: (rows, C) or (rows, C, 4, 5), values with a mean and a
/// spread per channel, the same on every rank.
fn whole(step: usize, rows: usize, spatial: bool) -> Tensor {
    let mut rng = Rng::new(77 + step as u64);
    let per_row = if spatial { C * 20 } else { C };
    let v: Vec<f32> = (0..rows * per_row)
        .map(|i| {
            let ch = (i / if spatial { 20 } else { 1 }) % C;
            (ch as f64 * 1.5 + 0.5 + (1.0 + ch as f64) * rng.normal()) as f32
        })
        .collect();
    let shape: Vec<usize> = if spatial {
        vec![rows, C, 4, 5]
    } else {
        vec![rows, C]
    };
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// A fixed weighting of the output elements, so that gradients are not trivial.
fn weights(like: &Tensor) -> Tensor {
    let mut rng = Rng::new(5);
    let v: Vec<f32> = (0..like.elem_count())
        .map(|_| rng.normal() as f32)
        .collect();
    Tensor::from_vec(v, like.shape(), &Device::Cpu).unwrap()
}

/// This rank's rows of a batch split as `rows`.
fn mine(t: &Tensor, rows: &[usize], rank: usize) -> Tensor {
    let start: usize = rows[..rank].iter().sum();
    t.narrow(0, start, rows[rank]).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    common::max_abs_diff(&f32(a), &f32(b))
}

/// Sets weight and bias to something other than 1 and 0.
fn set_affine(varmap: &VarMap) {
    let vars = varmap.data().lock().unwrap();
    let w = &vars["bn.weight"];
    let b = &vars["bn.bias"];
    let dtype = w.dtype();
    w.set(
        &Tensor::new(&[1.5f32, 0.5, -2.0], &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap(),
    )
    .unwrap();
    b.set(
        &Tensor::new(&[0.1f32, -0.3, 2.0], &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap(),
    )
    .unwrap();
}

/// Five training steps of SyncBatchNorm on this rank's `rows` share against candle-nn's
/// BatchNorm on the whole batch: outputs, input gradients, summed weight and bias gradients,
/// running statistics.
fn parity(pg: &ProcessGroup, rows: &[usize], spatial: bool, dtype: DType, tol: f32) {
    let rank = pg.rank();
    let total: usize = rows.iter().sum();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu);
    let sync = nn::sync_batch_norm(C, 1e-5, vb.pp("bn"), pg).unwrap();
    set_affine(&varmap);
    let reference_map = VarMap::new();
    let rvb = VarBuilder::from_varmap(&reference_map, DType::F32, &Device::Cpu);
    let reference = batch_norm(C, 1e-5, rvb.pp("bn")).unwrap();
    set_affine(&reference_map);
    let what = format!("rank {rank} of {rows:?}, spatial {spatial}, {dtype:?}");
    for step in 0..5 {
        let all = whole(step, total, spatial).to_dtype(dtype).unwrap();
        // The reference computes on the same (rounded) values, in f32.
        let all_ref = Var::from_tensor(&all.to_dtype(DType::F32).unwrap()).unwrap();
        let c = weights(&all);
        let y_ref = reference.forward_t(all_ref.as_tensor(), true).unwrap();
        let g_ref = (&y_ref * &c)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();

        let x = Var::from_tensor(&mine(&all, rows, rank)).unwrap();
        let y = sync.forward_t(x.as_tensor(), true).unwrap();
        let l = (y.to_dtype(DType::F32).unwrap() * mine(&c, rows, rank))
            .unwrap()
            .sum_all()
            .unwrap();
        let g = l.backward().unwrap();
        nn::finish_backward(pg).unwrap();

        assert_eq!(y.dims()[0], rows[rank], "{what}: output rows");
        if rows[rank] > 0 {
            let y_want = mine(&y_ref, rows, rank);
            let d = max_diff(&y, &y_want);
            assert!(d <= tol, "{what} step {step}: output off by {d}");
            let dx = g.get(x.as_tensor()).expect("an input gradient");
            let dx_want = mine(g_ref.get(all_ref.as_tensor()).unwrap(), rows, rank);
            let d = max_diff(dx, &dx_want);
            assert!(d <= tol, "{what} step {step}: input gradient off by {d}");
        }
        // Weight and bias gradients are local: their sum over the ranks is the whole batch's.
        for (name, t) in [
            ("weight", sync.weight_and_bias().unwrap().0),
            ("bias", sync.weight_and_bias().unwrap().1),
        ] {
            let local = match g.get(t) {
                Some(d) => d.to_dtype(DType::F32).unwrap(),
                None => Tensor::zeros(C, DType::F32, &Device::Cpu).unwrap(),
            };
            let summed = pg.all_reduce(&local, ReduceOp::Sum).unwrap();
            let want_t = &reference_map.data().lock().unwrap()[&format!("bn.{name}")].clone();
            let want = g_ref.get(want_t).unwrap();
            // Sums of many products (in bf16, rounded at every step): compare relative to
            // their size, with twice the tolerance.
            let scale = max_abs(want);
            let d = max_diff(&summed, want);
            assert!(
                d <= 2.0 * tol * scale.max(1.0),
                "{what} step {step}: {name} gradient off by {d} (of {scale})"
            );
        }
        for (a, b) in [
            (sync.running_mean(), reference.running_mean()),
            (sync.running_var(), reference.running_var()),
        ] {
            let d = max_diff(a, b);
            assert!(
                d <= tol,
                "{what} step {step}: running statistics off by {d}"
            );
        }
    }
}

/// Every case of the parity test on this group.
fn all_parity(pg: &ProcessGroup) {
    let rows: &[usize] = match pg.world_size() {
        2 => &[5, 3],
        3 => &[4, 0, 6],
        _ => &[7],
    };
    for spatial in [false, true] {
        parity(pg, rows, spatial, DType::F32, 1e-5);
    }
    parity(pg, rows, true, DType::BF16, 5e-2);
}

#[test]
fn sync_batch_norm_over_thread_ranks_equals_batch_norm_on_the_whole_batch() {
    for world in [1, 2, 3] {
        distributed::spawn_threads(world, |pg| {
            all_parity(&pg);
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn sync_batch_norm_over_processes_equals_batch_norm_on_the_whole_batch() {
    let test = "sync_batch_norm_over_processes_equals_batch_norm_on_the_whole_batch";
    if is_child() {
        all_parity(&join_child());
        done();
        return;
    }
    for world in [2, 3] {
        Ranks::world(test, world).assert_all_pass(LIMIT);
    }
}

#[test]
fn evaluation_sends_nothing_and_works_after_the_peers_are_gone() {
    let results = distributed::spawn_threads(2, |pg| {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let bn = nn::sync_batch_norm(C, 1e-5, vb.pp("bn"), &pg)?;
        if pg.rank() == 1 {
            return Ok(None); // gone
        }
        std::thread::sleep(Duration::from_millis(200));
        let x = whole(0, 4, true);
        let y = bn.forward_t(&x, false)?;
        // What candle-nn's BatchNorm gives in evaluation, from the same (initial) statistics.
        let plain = batch_norm(
            C,
            1e-5,
            VarBuilder::from_varmap(&VarMap::new(), DType::F32, &Device::Cpu),
        )?;
        let d = max_diff(&y, &plain.forward_t(&x, false)?);
        let train = bn.forward_t(&x, true).unwrap_err().to_string();
        Ok(Some((d, train)))
    })
    .unwrap();
    let (d, train) = results[0].clone().unwrap();
    assert!(d <= 1e-6, "{d}");
    // Training, which needs the peers, fails and names the one that left.
    assert!(train.contains("rank 1 was lost"), "{train}");
}

#[test]
fn checkpoints_move_between_sync_batch_norm_and_batch_norm() {
    let dir = common::temp_dir("sync-bn-ckpt");
    let path = dir.join("bn.safetensors");
    distributed::spawn_threads(1, |pg| {
        // SyncBatchNorm -> candle-nn.
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let sync = nn::sync_batch_norm(C, 1e-5, vb.pp("bn"), &pg)?;
        set_affine(&varmap);
        for step in 0..3 {
            sync.forward_t(&whole(step, 6, true), true)?;
        }
        checkpoint::save_varmap(&varmap, &path)?;
        let mut loaded = VarMap::new();
        let plain = batch_norm(
            C,
            1e-5,
            VarBuilder::from_varmap(&loaded, DType::F32, &Device::Cpu).pp("bn"),
        )?;
        loaded.load(&path)?;
        let x = whole(9, 5, true);
        assert!(max_diff(&sync.forward_t(&x, false)?, &plain.forward_t(&x, false)?) <= 1e-6);

        // candle-nn -> SyncBatchNorm.
        let varmap = VarMap::new();
        let trained = batch_norm(
            C,
            1e-5,
            VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu).pp("bn"),
        )?;
        set_affine(&varmap);
        for step in 0..3 {
            trained.forward_t(&whole(step, 6, false), true)?;
        }
        checkpoint::save_varmap(&varmap, &path)?;
        let mut loaded = VarMap::new();
        let vb = VarBuilder::from_varmap(&loaded, DType::F32, &Device::Cpu);
        let sync = nn::sync_batch_norm(C, 1e-5, vb.pp("bn"), &pg)?;
        loaded.load(&path)?;
        let x = whole(9, 5, false);
        assert!(max_diff(&sync.forward_t(&x, false)?, &trained.forward_t(&x, false)?) <= 1e-6);
        Ok(())
    })
    .unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

/// One model definition, through `nn::batch_norm`.
struct Model {
    lin: Linear,
    bn: nn::BatchNorm,
    head: Linear,
}

fn model(vb: VarBuilder) -> candle_core::Result<Model> {
    Ok(Model {
        lin: linear(C, 6, vb.pp("lin"))?,
        bn: nn::batch_norm(6, 1e-5, vb.pp("bn"))?,
        head: linear(6, 2, vb.pp("head"))?,
    })
}

impl ModuleT for Model {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let h = self.bn.forward_t(&x.apply(&self.lin)?, train)?.relu()?;
        h.apply(&self.head)
    }
}

const SGD: SgdConfig = common::models::SGD;

fn labels(rows: usize) -> Tensor {
    Tensor::from_vec(
        (0..rows as u32).map(|i| i % 2).collect(),
        rows,
        &Device::Cpu,
    )
    .unwrap()
}

fn sorted_values(varmap: &VarMap) -> Vec<(String, Tensor)> {
    let mut all: Vec<(String, Tensor)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().copy().unwrap()))
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

#[test]
fn one_model_definition_is_batch_norm_in_one_process_and_sync_batch_norm_under_ddp() {
    const PER: usize = 4;
    const STEPS: usize = 5;
    // One process, the whole batch.
    let varmap = VarMap::new();
    let plain = model(seeded_var_builder(&varmap, 3, DType::F32, &Device::Cpu)).unwrap();
    assert!(matches!(plain.bn, nn::BatchNorm::Plain(_)));
    let trainable: Vec<Var> = {
        let vars = varmap.data().lock().unwrap();
        [
            "bn.bias",
            "bn.weight",
            "head.bias",
            "head.weight",
            "lin.bias",
            "lin.weight",
        ]
        .iter()
        .map(|n| vars[*n].clone())
        .collect()
    };
    let mut opt = Sgd::new(trainable, SGD).unwrap();
    for step in 0..STEPS {
        let x = whole(step, 3 * PER, false);
        let l = loss::cross_entropy(&plain.forward_t(&x, true).unwrap(), &labels(3 * PER)).unwrap();
        opt.backward_step(&l).unwrap();
    }
    let want = sorted_values(&varmap);

    let got = distributed::spawn_threads(3, |pg| {
        let varmap = VarMap::new();
        model(seeded_var_builder(&varmap, 3, DType::F32, &Device::Cpu))?;
        let config = DdpConfig {
            sync_batch_norm: true,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::with_config(&varmap, &pg, &Device::Cpu, config, model)?;
        assert!(matches!(ddp.module().bn, nn::BatchNorm::Sync(_)));
        let mut opt = Sgd::new(ddp.parameters(), SGD)?;
        for step in 0..STEPS {
            let x = whole(step, 3 * PER, false).narrow(0, pg.rank() * PER, PER)?;
            let y = labels(3 * PER).narrow(0, pg.rank() * PER, PER)?;
            let l = loss::cross_entropy(&ddp.forward_t(&x, true)?, &y)?;
            opt.step(&ddp.backward(&l)?)?;
        }
        Ok(sorted_values(&varmap))
    })
    .unwrap();
    for rank_values in &got {
        for ((name, a), (wname, b)) in rank_values.iter().zip(&want) {
            assert_eq!(name, wname);
            let d = max_diff(a, b);
            assert!(d <= 1e-5, "{name} differs by {d}");
        }
    }
}

#[test]
fn a_batch_of_one_value_per_channel_is_refused_in_training() {
    let err = distributed::spawn_threads(1, |pg| {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let bn = nn::sync_batch_norm(C, 1e-5, vb.pp("block.bn"), &pg)?;
        let e = bn.forward_t(&whole(0, 1, false), true).unwrap_err();
        Ok(e.to_string())
    })
    .unwrap();
    assert!(
        err[0].contains("`block.bn`") && err[0].contains("at least 2"),
        "{}",
        err[0]
    );
}

/// The batch normalisation of the whole batch `x` in f64 (two passes): the output and the
/// weight's and bias's gradients of `sum(y * g)`.
fn reference(x: &Tensor, w: &Tensor, b: &Tensor, g: &Tensor) -> (Tensor, Tensor, Tensor) {
    let f64 = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
    let (x, g) = (f64(x), f64(g));
    let per_channel = |t: &Tensor| {
        t.transpose(0, 1)
            .unwrap()
            .flatten_from(1)
            .unwrap()
            .mean_keepdim(1)
            .unwrap()
            .reshape((1, C, 1, 1))
            .unwrap()
    };
    let centred = x.broadcast_sub(&per_channel(&x)).unwrap();
    let var = per_channel(&centred.sqr().unwrap());
    let x_hat = centred
        .broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap())
        .unwrap();
    let shape = (1, C, 1, 1);
    let y = x_hat
        .broadcast_mul(&f64(w).reshape(shape).unwrap())
        .unwrap()
        .broadcast_add(&f64(b).reshape(shape).unwrap())
        .unwrap();
    let sum = |t: Tensor| t.sum((0, 2, 3)).unwrap();
    (y, sum((&g * &x_hat).unwrap()), sum(g))
}

/// The numbers hold in every dtype: statistics and the weight's and bias's gradients are
/// summed in f32 (f64 for f64), as torch does, and the mean is stable at 1e3 with a spread of
/// 0.1. Before, a bf16 layer summed the affine gradients in bf16 (512 where 4096 is right, for
/// 2 ranks of 16x3x16x16) and took the mean rounded to f32 (1e-4 off in f32 at mean 1e3).
#[test]
fn sync_batch_norm_sums_in_f32_and_holds_at_large_means() {
    // (dtype, mean, spread, tolerance relative to the largest value)
    let cases = [
        (DType::F32, 0.0, 1.0, 1e-5),
        (DType::F32, 1e3, 0.1, 1e-5),
        (DType::F64, 1e3, 0.1, 1e-9),
        (DType::F16, 0.0, 1.0, 4e-3),
        (DType::BF16, 0.0, 1.0, 3e-2),
    ];
    for (dtype, mean, spread, tol) in cases {
        let round = |t: Tensor| t.to_dtype(dtype).unwrap();
        let mut rng = Rng::new(11);
        let mut normal = |shape: &[usize], mean: f64, spread: f64| {
            let v: Vec<f64> = (0..shape.iter().product::<usize>())
                .map(|_| mean + spread * rng.normal())
                .collect();
            round(Tensor::from_vec(v, shape, &Device::Cpu).unwrap())
        };
        let x = normal(&[16, C, 16, 16], mean, spread);
        let g = normal(&[16, C, 16, 16], 0.0, 1.0);
        let (w, b) = (normal(&[C], 1.0, 0.2), normal(&[C], 0.0, 0.2));
        let per_rank = distributed::spawn_threads(2, |pg| {
            let mut varmap = VarMap::new();
            let vb = VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu);
            let bn = nn::sync_batch_norm(C, 1e-5, vb, &pg)?;
            varmap.set([("weight", w.copy()?), ("bias", b.copy()?)].into_iter())?;
            let rows = [8, 8];
            let y = bn.forward_t(&mine(&x, &rows, pg.rank()), true)?;
            let grads = (&y * mine(&g, &rows, pg.rank()))?.sum_all()?.backward()?;
            let vars = varmap.data().lock().unwrap();
            let grad = |name: &str| grads.get(&vars[name]).unwrap().to_dtype(DType::F64);
            // With ones for the output's gradient: each rank's bias gradient is its 2048 values.
            let ones = bn
                .forward_t(&mine(&x, &rows, pg.rank()), true)?
                .sum_all()?
                .backward()?;
            let count = ones.get(&vars["bias"]).unwrap().to_dtype(DType::F64)?;
            Ok((y, grad("weight")?, grad("bias")?, count))
        })
        .unwrap();
        let case = format!("{dtype:?} around {mean}");
        for (_, _, _, count) in &per_rank {
            assert_eq!(count.to_vec1::<f64>().unwrap(), [2048.0; C], "{case}");
        }
        let y = Tensor::cat(&[&per_rank[0].0, &per_rank[1].0], 0).unwrap();
        let dw = (&per_rank[0].1 + &per_rank[1].1).unwrap();
        let db = (&per_rank[0].2 + &per_rank[1].2).unwrap();
        let (want_y, want_dw, want_db) = reference(&x, &w, &b, &g);
        for (what, got, want) in [("y", y, want_y), ("dw", dw, want_dw), ("db", db, want_db)] {
            let (got, want) = (common::as_f64(&got), common::as_f64(&want));
            let d = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            let size = want.iter().map(|v| v.abs()).fold(0.0, f64::max);
            assert!(
                d <= tol * size.max(1.0),
                "{case}: {what} is off by {d} (largest {size})"
            );
        }
    }
}
