//! DistributedDataParallel: the same numbers as one process on the whole batch, over thread
//! ranks (in-process groups) and over real processes on 127.0.0.1 (TCP groups).

mod common;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{
    batch_norm, linear, loss, BatchNorm, Linear, ModuleT, Optimizer, VarBuilder, VarMap,
};
use candle_parallel::ddp::{Compression, DdpConfig};
use candle_parallel::distributed::{self, ProcessGroup};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{Sgd, SgdConfig};
use candle_parallel::{DistributedDataParallel, Error};
use common::models::{self, batch, max_diff, mlp, share, values, CLASSES, IN};
use common::{done, is_child, join_child, max_abs_diff, Ranks};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(120);
const SGD: SgdConfig = models::SGD;

/// One process training on the whole batch of `world * per` rows for `steps` steps.
fn reference(world: usize, per: usize, steps: usize) -> Vec<(String, Vec<f32>)> {
    let varmap = VarMap::new();
    let model = mlp(seeded_var_builder(&varmap, 7, DType::F32, &Device::Cpu)).unwrap();
    let mut opt = Sgd::new(varmap.all_vars(), SGD).unwrap();
    for step in 0..steps {
        let (x, y) = batch(step, world * per);
        let l = loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
        opt.backward_step(&l).unwrap();
    }
    values(&varmap)
}

/// This rank's part of DDP training on the same data; returns the final variables.
fn train(
    pg: &ProcessGroup,
    per: usize,
    steps: usize,
    config: DdpConfig,
) -> candle_parallel::Result<Vec<(String, Vec<f32>)>> {
    let varmap = VarMap::new();
    // Rank 0 starts from the reference's weights; the others from other weights, which DDP
    // must replace with rank 0's.
    let seed = if pg.rank() == 0 {
        7
    } else {
        100 + pg.rank() as u64
    };
    mlp(seeded_var_builder(&varmap, seed, DType::F32, &Device::Cpu))?;
    let model = DistributedDataParallel::with_config(&varmap, pg, &Device::Cpu, config, mlp)?;
    let mut opt = Sgd::new(model.parameters(), SGD)?;
    for step in 0..steps {
        let (x, y) = share(step, pg.world_size(), per, pg.rank());
        let l = loss::cross_entropy(&model.forward_t(&x, true)?, &y)?;
        let grads = model.backward(&l)?;
        opt.step(&grads)?;
    }
    Ok(values(&varmap))
}

const PER: usize = 6;
const STEPS: usize = 20;

fn parity(pg: &ProcessGroup) {
    let want = reference(pg.world_size(), PER, STEPS);
    // Small buckets, so that several are in flight and the rebuild has something to do.
    let config = DdpConfig {
        bucket_cap_mb: 1e-3,
        first_bucket_mb: 1e-4,
        ..DdpConfig::default()
    };
    let got = train(pg, PER, STEPS, config).unwrap();
    let d = max_diff(&got, &want);
    assert!(
        d <= 1e-5,
        "rank {}: DDP differs from one process by {d}",
        pg.rank()
    );
    let bf16 = DdpConfig {
        compression: Compression::Bf16,
        ..DdpConfig::default()
    };
    let got = train(pg, PER, STEPS, bf16).unwrap();
    let d = max_diff(&got, &want);
    assert!(
        d <= 2e-2,
        "rank {}: bf16-compressed DDP differs by {d}",
        pg.rank()
    );
}

#[test]
fn ddp_over_1_2_and_3_thread_ranks_equals_one_process_on_the_whole_batch() {
    for world in 1..=3 {
        distributed::spawn_threads(world, |pg| {
            parity(&pg);
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn ddp_over_1_2_and_3_processes_equals_one_process_on_the_whole_batch() {
    let test = "ddp_over_1_2_and_3_processes_equals_one_process_on_the_whole_batch";
    if is_child() {
        parity(&join_child());
        done();
        return;
    }
    for world in 1..=3 {
        Ranks::world(test, world).assert_all_pass(LIMIT);
    }
}

/// Layers built in another order than they are used: `a` is built first and used last.
struct Shuffled {
    a: Linear,
    b: Linear,
    c: Linear,
}

fn shuffled(vb: VarBuilder) -> candle_core::Result<Shuffled> {
    Ok(Shuffled {
        a: linear(16, CLASSES, vb.pp("a"))?,
        b: linear(IN, 16, vb.pp("b"))?,
        c: linear(16, 16, vb.pp("c"))?,
    })
}

impl Module for Shuffled {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.apply(&self.b)?
            .relu()?
            .apply(&self.c)?
            .relu()?
            .apply(&self.a)
    }
}

#[test]
fn buckets_are_issued_while_backward_runs_and_rebuilt_from_the_ready_order() {
    distributed::spawn_threads(2, |pg| {
        let varmap = VarMap::new();
        // One parameter per bucket.
        let config = DdpConfig {
            bucket_cap_mb: 1e-6,
            first_bucket_mb: 1e-6,
            ..DdpConfig::default()
        };
        let model =
            DistributedDataParallel::with_config(&varmap, &pg, &Device::Cpu, config, shuffled)?;
        // Before any iteration: the reverse of the order the model asked for its variables
        // (candle-nn's linear asks for its weight, then its bias).
        let first: Vec<String> = model.buckets().into_iter().flatten().collect();
        assert_eq!(
            first,
            ["c.bias", "c.weight", "b.bias", "b.weight", "a.bias", "a.weight"]
        );
        let (x, y) = share(0, 2, PER, pg.rank());
        let l = loss::cross_entropy(&model.forward_t(&x, true)?, &y)?;
        model.backward(&l)?;
        let stats = model.last_backward_stats();
        assert_eq!(stats.buckets, 6);
        assert!(
            stats.issued_during_autograd >= 1,
            "no bucket was all-reduced before autograd ended: {stats:?}"
        );
        // After it: the order the gradients came in, the last layer's first, the same on both
        // ranks.
        let rebuilt: Vec<String> = model.buckets().into_iter().flatten().collect();
        assert_eq!(
            rebuilt,
            ["a.bias", "a.weight", "c.bias", "c.weight", "b.bias", "b.weight"]
        );
        // And training goes on with them.
        let l = loss::cross_entropy(&model.forward_t(&x, true)?, &y)?;
        model.backward(&l)?;
        Ok(())
    })
    .unwrap();
}

/// Two heads, of which a rank uses one: a branch not taken leaves a parameter unused.
struct TwoHeads {
    body: Linear,
    a: Linear,
    b: Linear,
    use_b: bool,
}

fn two_heads(vb: VarBuilder, use_b: bool) -> candle_core::Result<TwoHeads> {
    Ok(TwoHeads {
        body: linear(IN, 8, vb.pp("body"))?,
        a: linear(8, CLASSES, vb.pp("head_a"))?,
        b: linear(8, CLASSES, vb.pp("head_b"))?,
        use_b,
    })
}

impl Module for TwoHeads {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = x.apply(&self.body)?.relu()?;
        h.apply(if self.use_b { &self.b } else { &self.a })
    }
}

#[test]
fn a_parameter_unused_on_one_rank_contributes_zeros_there() {
    let results = distributed::spawn_threads(2, |pg| {
        let use_b = pg.rank() == 1;
        let varmap = VarMap::new();
        let model =
            DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, |vb| two_heads(vb, use_b))?;
        let (x, y) = share(0, 2, PER, pg.rank());
        let l = loss::cross_entropy(&model.forward_t(&x, true)?, &y)?;
        let averaged = model.backward(&l)?;
        // This rank's own gradients, from the same (rank 0's) weights without DDP.
        let plain = two_heads(
            VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
            use_b,
        )?;
        let local = loss::cross_entropy(&plain.forward(&x)?, &y)?.backward()?;
        let mut out = Vec::new();
        for (name, var) in model.parameter_names().into_iter().zip(model.parameters()) {
            let avg = averaged.get(&var).expect("every parameter gets a gradient");
            let own = match local.get(&var) {
                Some(g) => g.clone(),
                None => var.zeros_like()?,
            };
            out.push((
                name,
                avg.flatten_all()?.to_vec1::<f32>()?,
                own.flatten_all()?.to_vec1::<f32>()?,
            ));
        }
        Ok(out)
    })
    .unwrap();
    for ((name, avg0, own0), (_, avg1, own1)) in results[0].iter().zip(&results[1]) {
        assert_eq!(avg0, avg1, "{name}: the ranks' averaged gradients differ");
        for ((a, x), y) in avg0.iter().zip(own0).zip(own1) {
            assert!(
                (a - (x + y) / 2.0).abs() < 1e-6,
                "{name}: {a} is not the mean of {x} and {y}"
            );
        }
        let unused_somewhere = name.starts_with("head_");
        assert!(
            !unused_somewhere || avg0.iter().any(|&v| v != 0.0),
            "{name} got no gradient"
        );
    }
}

#[test]
fn three_micro_batches_under_no_sync_equal_one_triple_batch() {
    distributed::spawn_threads(2, |pg| {
        let varmap = VarMap::new();
        mlp(seeded_var_builder(&varmap, 7, DType::F32, &Device::Cpu))?;
        let model = DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, mlp)?;
        let (x, y) = share(0, 2, 3 * PER, pg.rank());
        let micro = |k: usize| -> candle_parallel::Result<Tensor> {
            let (xs, ys) = (x.narrow(0, k * PER, PER)?, y.narrow(0, k * PER, PER)?);
            Ok((loss::cross_entropy(&model.forward_t(&xs, true)?, &ys)? / 3.0)?)
        };
        {
            let _local = model.no_sync();
            for k in 0..2 {
                model.backward(&micro(k)?)?;
            }
        }
        let accumulated = model.backward(&micro(2)?)?;
        let l = loss::cross_entropy(&model.forward_t(&x, true)?, &y)?;
        let whole = model.backward(&l)?;
        for var in model.parameters() {
            let d = max_abs_diff(accumulated.get(&var).unwrap(), whole.get(&var).unwrap());
            assert!(d < 1e-6, "{d}");
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_model_with_other_shapes_on_one_rank_is_an_error_on_every_rank_naming_it() {
    let errors = distributed::spawn_threads(3, |pg| {
        let varmap = VarMap::new();
        let wide = pg.rank() == 1;
        let build = move |vb: VarBuilder| -> candle_core::Result<Linear> {
            let _first = linear(IN, 4, vb.pp("a"))?;
            linear(4, if wide { 5 } else { 3 }, vb.pp("b"))
        };
        let err = DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, build)
            .err()
            .unwrap();
        Ok(err.to_string())
    })
    .unwrap();
    for e in &errors {
        assert_eq!(e, &errors[0]);
    }
    // candle-nn's linear asks for its weight before its bias.
    assert!(errors[0].contains("`b.weight`"), "{}", errors[0]);
    assert!(
        errors[0].contains("ranks 0, 2 have b.weight parameter f32 [3, 4]"),
        "{}",
        errors[0]
    );
    assert!(
        errors[0].contains("rank 1 has b.weight parameter f32 [5, 4]"),
        "{}",
        errors[0]
    );
}

/// A conv layer with BatchNorm.
struct Bn {
    lin: Linear,
    bn: BatchNorm,
}

fn bn_model(vb: VarBuilder) -> candle_core::Result<Bn> {
    Ok(Bn {
        lin: linear(IN, 6, vb.pp("lin"))?,
        bn: batch_norm(6, 1e-5, vb.pp("bn"))?,
    })
}

impl ModuleT for Bn {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.bn.forward_t(&x.apply(&self.lin)?, train)
    }
}

#[test]
fn batch_norm_buffers_move_and_equal_rank_0s_on_every_rank() {
    let stats = distributed::spawn_threads(3, |pg| {
        let varmap = VarMap::new();
        let model = DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, bn_model)?;
        assert_eq!(
            model.parameter_names(),
            ["bn.bias", "bn.weight", "lin.bias", "lin.weight"]
        );
        let mut opt = Sgd::new(model.parameters(), SGD)?;
        let read = |name: &str| -> candle_parallel::Result<Vec<f32>> {
            Ok(varmap.data().lock().unwrap()[name].to_vec1::<f32>()?)
        };
        let mut seen = Vec::new();
        for step in 0..5 {
            // Every rank sees other data, so its own statistics differ.
            let (x, _) = share(step, 3, PER, pg.rank());
            let l = model.forward_t(&x, true)?.sqr()?.mean_all()?;
            opt.step(&model.backward(&l)?)?;
            seen.push(read("bn.running_mean")?);
        }
        // What a training forward does first: take rank 0's buffers.
        model.sync_buffers()?;
        Ok((seen, read("bn.running_mean")?, read("bn.running_var")?))
    })
    .unwrap();
    let (_, mean0, var0) = &stats[0];
    assert!(mean0.iter().any(|&m| m != 0.0), "running mean never moved");
    assert!(var0.iter().any(|&v| v != 1.0), "running var never moved");
    for (rank, (seen, mean, var)) in stats.iter().enumerate() {
        assert_eq!(
            (mean, var),
            (mean0, var0),
            "rank {rank}'s buffers differ from rank 0's"
        );
        // Between forwards each rank updated rank 0's statistics with its own batch.
        if rank > 0 {
            assert_ne!(
                seen, &stats[0].0,
                "rank {rank} never used its own statistics"
            );
        }
    }
}

#[test]
fn calling_loss_backward_instead_of_the_wrappers_is_reported_at_the_next_forward() {
    distributed::spawn_threads(1, |pg| {
        let varmap = VarMap::new();
        let model = DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, mlp)?;
        let (x, y) = share(0, 1, PER, 0);
        let l = loss::cross_entropy(&model.forward_t(&x, true)?, &y)?;
        l.backward()?;
        let err = model.forward_t(&x, true).unwrap_err();
        assert!(matches!(err, Error::UnfinishedReduction { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("DistributedDataParallel::backward(&loss)"),
            "{err}"
        );
        // The next iteration works.
        let l = loss::cross_entropy(&model.forward_t(&x, true)?, &y)?;
        model.backward(&l)?;
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_loss_that_uses_a_variable_itself_is_an_error_on_every_rank_naming_it() {
    // A penalty on the weights taken from the VarMap (or parameters()) through candle's ops:
    // its gradient would bypass the average, and the averaged gradient used to replace it in
    // silence.
    let errors = distributed::spawn_threads(2, |pg| {
        let varmap = VarMap::new();
        let model = DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, mlp)?;
        let (x, y) = share(0, 2, PER, pg.rank());
        let weight = model.parameters()[0].as_tensor().clone();
        let l = (loss::cross_entropy(&model.forward_t(&x, true)?, &y)?
            + (weight.sqr()?.sum_all()? * 1e-3)?)?;
        let err = model.backward(&l).unwrap_err();
        // The next iteration, from the model's output only, works.
        let l = loss::cross_entropy(&model.forward_t(&x, true)?, &y)?;
        model.backward(&l)?;
        Ok((err, model.parameter_names()[0].clone()))
    })
    .unwrap();
    for (rank, (err, name)) in errors.into_iter().enumerate() {
        assert!(
            matches!(&err, Error::VariableUsedDirectly { rank: r, parameter } if *r == rank && *parameter == name),
            "{err}"
        );
        assert!(err.to_string().contains("directly"), "{err}");
    }
}

#[test]
fn a_rank_killed_during_backward_is_named_by_the_others_backward() {
    if is_child() {
        let pg = join_child();
        let varmap = VarMap::new();
        let model = DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, mlp).unwrap();
        let (x, y) = share(0, 3, PER, pg.rank());
        let l = loss::cross_entropy(&model.forward_t(&x, true).unwrap(), &y).unwrap();
        if pg.rank() == 2 {
            println!("ready");
            std::thread::sleep(Duration::from_secs(60));
            return;
        }
        println!("backward");
        let err = model.backward(&l).unwrap_err();
        assert!(matches!(err, Error::PeerLost { rank: 2, .. }), "{err}");
        done();
        return;
    }
    Ranks::kill_rank_2_during(
        "a_rank_killed_during_backward_is_named_by_the_others_backward",
        "backward",
        LIMIT,
    );
}

#[test]
fn ranks_initialised_differently_hold_rank_0s_values_after_construction() {
    let results = distributed::spawn_threads(3, |pg| {
        let varmap = VarMap::new();
        mlp(seeded_var_builder(
            &varmap,
            50 + pg.rank() as u64,
            DType::F32,
            &Device::Cpu,
        ))?;
        let before = values(&varmap);
        DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, mlp)?;
        Ok((before, values(&varmap)))
    })
    .unwrap();
    let rank_0_before = &results[0].0;
    for (rank, (before, after)) in results.iter().enumerate() {
        assert_eq!(
            after, rank_0_before,
            "rank {rank} does not hold rank 0's values"
        );
        if rank > 0 {
            assert!(
                max_diff(before, rank_0_before) > 0.0,
                "rank {rank} started equal"
            );
        }
    }
}

/// A model holding integer variables: an index table (read with `get_with_hints_dtype`, named
/// like a parameter) choosing the input's columns, and a step count named as a buffer.
struct Indexed {
    table: Tensor,
    lin: Linear,
}

fn indexed(vb: VarBuilder, rank: usize) -> candle_core::Result<Indexed> {
    use candle_nn::Init;
    // Each rank starts with other integers: rank 0's must win.
    let table =
        vb.get_with_hints_dtype(3, "pick.index", Init::Const(1.0 + rank as f64), DType::U32)?;
    vb.get_with_hints_dtype(
        1,
        "pick.num_batches_tracked",
        Init::Const(rank as f64),
        DType::I64,
    )?;
    Ok(Indexed {
        table,
        lin: linear(3, CLASSES, vb.pp("lin"))?,
    })
}

impl ModuleT for Indexed {
    fn forward_t(&self, x: &Tensor, _: bool) -> candle_core::Result<Tensor> {
        x.index_select(&self.table, 1)?.apply(&self.lin)
    }
}

/// Integer variables are never parameters: they stay out of the reducer (every backward
/// failed with "invalid collective dtype: U32", naming no variable), and travel from rank 0 as
/// every buffer does, at construction and before each training forward, exactly (an i64 above
/// 2^53 too). A dtype no collective carries is refused, naming the variable.
#[test]
fn integer_variables_are_buffers_broadcast_from_rank_0_and_never_reduced() {
    let results = distributed::spawn_threads(2, |pg| {
        let varmap = VarMap::new();
        let rank = pg.rank();
        let model =
            DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, move |vb| indexed(vb, rank))?;
        assert_eq!(model.parameter_names(), ["lin.bias", "lin.weight"]);
        let var = |name: &str| varmap.data().lock().unwrap()[name].clone();
        let after_construction = var("pick.index").to_vec1::<u32>()?;
        // Rank 0 counts past 2^53; rank 1 counts its own: the next training forward takes
        // rank 0's.
        let count = if rank == 0 { (1i64 << 60) + 3 } else { 7 };
        var("pick.num_batches_tracked").set(&Tensor::new(&[count], &Device::Cpu)?)?;
        let mut opt = Sgd::new(model.parameters(), SGD)?;
        for step in 0..3 {
            let (x, _) = share(step, 2, 4, rank);
            let loss = model.forward_t(&x, true)?.sqr()?.mean_all()?;
            opt.step(&model.backward(&loss)?)?;
        }
        let count = var("pick.num_batches_tracked").to_vec1::<i64>()?;
        Ok((
            after_construction,
            count,
            var("lin.weight").flatten_all()?.to_vec1::<f32>()?,
        ))
    })
    .unwrap();
    for (rank, (table, count, weight)) in results.iter().enumerate() {
        assert_eq!(table, &[1, 1, 1], "rank {rank}: rank 0's table");
        assert_eq!(count, &[(1i64 << 60) + 3], "rank {rank}: rank 0's count");
        assert_eq!(weight, &results[0].2, "rank {rank}: the trained weight");
    }

    let errors = distributed::spawn_threads(2, |pg| {
        let varmap = VarMap::new();
        let err = DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, |vb| {
            vb.get_with_hints_dtype(2, "scale.fp8", candle_nn::Init::Const(1.0), DType::F8E4M3)
        })
        .err()
        .map(|e| e.to_string());
        Ok(err)
    })
    .unwrap();
    for err in errors {
        let err = err.expect("an f8 variable is refused");
        assert!(
            err.contains("`scale.fp8`") && err.contains("F8E4M3"),
            "{err}"
        );
    }
}
