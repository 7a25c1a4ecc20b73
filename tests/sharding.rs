//! Sharded data parallel and uneven inputs: ZeRO-2 inside DistributedDataParallel trains as
//! plain DDP does, and `join` lets ranks with fewer batches shadow the others, over thread ranks
//! and real processes on 127.0.0.1, with tensor sizes no world divides.

mod common;

use candle_core::{DType, Device};
use candle_nn::{loss, Module, Optimizer, VarMap};
use candle_parallel::ddp::{DdpConfig, JoinDivisor, Sharding};
use candle_parallel::distributed::{self, ProcessGroup};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{Sgd, SgdConfig};
use candle_parallel::DistributedDataParallel;
use common::models::{max_diff, mlp_uneven, share, values, Values};
use common::{done, is_child, join_child, Ranks};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(120);
const PER: usize = 5;
const STEPS: usize = 20;
const SGD: SgdConfig = SgdConfig {
    lr: 0.05,
    momentum: 0.9,
    dampening: 0.1,
    weight_decay: 0.01,
    nesterov: false,
    maximize: false,
};

/// Small buckets, so that the model spans several, each cut unevenly.
fn config(sharding: Sharding) -> DdpConfig {
    DdpConfig {
        bucket_cap_mb: 4e-4,
        first_bucket_mb: 1e-4,
        sharding,
        ..DdpConfig::default()
    }
}

/// Trains `STEPS` steps on this rank's share of the data, with an optimizer made by `opt`
/// over what the wrapper gives it; returns the final variables and the optimizer's variables'
/// total size.
fn train<O: Optimizer>(
    pg: &ProcessGroup,
    config: DdpConfig,
    opt: impl Fn(Vec<candle_core::Var>) -> candle_core::Result<O>,
) -> candle_parallel::Result<(Values, usize)> {
    let varmap = VarMap::new();
    mlp_uneven(seeded_var_builder(&varmap, 7, DType::F32, &Device::Cpu))?;
    let model =
        DistributedDataParallel::with_config(&varmap, pg, &Device::Cpu, config, mlp_uneven)?;
    let mut opt = opt(model.parameters())?;
    for step in 0..STEPS {
        let (x, y) = share(step, pg.world_size(), PER, pg.rank());
        let l = loss::cross_entropy(&model.forward_t(&x, true)?, &y)?;
        opt.step(&model.backward(&l)?)?;
    }
    model.gather_parameters()?;
    let held = model.parameters().iter().map(|v| v.elem_count()).sum();
    Ok((values(&varmap), held))
}

fn zero2_equals_ddp(pg: &ProcessGroup) {
    let sgd = |vars| Sgd::new(vars, SGD);
    let (want, full) = train(pg, config(Sharding::None), sgd).unwrap();
    let (got, shard) = train(pg, config(Sharding::Zero2), sgd).unwrap();
    let d = max_diff(&got, &want);
    assert!(
        d <= 1e-5,
        "rank {}: ZeRO-2 differs from DDP by {d}",
        pg.rank()
    );
    // Each rank steps its own share: within one element per bucket of full / world.
    let world = pg.world_size();
    assert!(
        shard * world >= full && shard * world < full + world * 8,
        "rank {}: holds {shard} of {full} elements over {world} ranks",
        pg.rank()
    );
}

#[test]
fn zero2_over_1_2_and_3_thread_ranks_equals_ddp() {
    for world in 1..=3 {
        distributed::spawn_threads(world, |pg| {
            zero2_equals_ddp(&pg);
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn zero2_over_2_and_3_processes_equals_ddp() {
    let test = "zero2_over_2_and_3_processes_equals_ddp";
    if is_child() {
        zero2_equals_ddp(&join_child());
        done();
        return;
    }
    for world in 2..=3 {
        Ranks::world(test, world).assert_all_pass(LIMIT);
    }
}

/// Batches per rank in the join tests: 12 in all, the ranks running out at different steps.
const BATCHES: [usize; 3] = [3, 5, 4];

/// One process over the same 12 batches: at step t, the batches of the ranks that still have
/// one, their losses summed and divided as `divisor` says.
fn join_reference(divisor: JoinDivisor) -> Values {
    let varmap = VarMap::new();
    let model = mlp_uneven(seeded_var_builder(&varmap, 7, DType::F32, &Device::Cpu)).unwrap();
    let mut opt = Sgd::new(varmap.all_vars(), SGD).unwrap();
    for step in 0..*BATCHES.iter().max().unwrap() {
        let active: Vec<usize> = (0..3).filter(|&r| BATCHES[r] > step).collect();
        let mut total: Option<candle_core::Tensor> = None;
        for &r in &active {
            let (x, y) = share(step, 3, PER, r);
            let l = loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
            total = Some(match total {
                None => l,
                Some(t) => (t + l).unwrap(),
            });
        }
        let by = match divisor {
            JoinDivisor::World => 3.0,
            JoinDivisor::Active => active.len() as f64,
        };
        opt.backward_step(&(total.unwrap() / by).unwrap()).unwrap();
    }
    values(&varmap)
}

/// This rank's `BATCHES[rank]` steps inside `join`.
fn join_train(
    pg: &ProcessGroup,
    sharding: Sharding,
    divisor: JoinDivisor,
) -> candle_parallel::Result<Values> {
    let varmap = VarMap::new();
    mlp_uneven(seeded_var_builder(&varmap, 7, DType::F32, &Device::Cpu))?;
    let model = DistributedDataParallel::with_config(
        &varmap,
        pg,
        &Device::Cpu,
        config(sharding),
        mlp_uneven,
    )?;
    let mut opt = Sgd::new(model.parameters(), SGD)?;
    model.join(&mut opt, divisor, |opt| {
        for step in 0..BATCHES[pg.rank()] {
            let (x, y) = share(step, 3, PER, pg.rank());
            let l = loss::cross_entropy(&model.forward_t(&x, true)?, &y)?;
            opt.step(&model.backward(&l)?)?;
        }
        Ok(())
    })?;
    model.gather_parameters()?;
    Ok(values(&varmap))
}

fn join_equals_one_process(pg: &ProcessGroup) {
    for divisor in [JoinDivisor::World, JoinDivisor::Active] {
        let want = join_reference(divisor);
        for sharding in [Sharding::None, Sharding::Zero2] {
            let got = join_train(pg, sharding, divisor).unwrap();
            let d = max_diff(&got, &want);
            assert!(
                d <= 1e-5,
                "rank {} ({sharding:?}, {divisor:?}): joined training differs from one process \
                 by {d}",
                pg.rank()
            );
        }
    }
}

#[test]
fn ranks_with_3_5_and_4_batches_inside_join_equal_one_process_over_the_12() {
    distributed::spawn_threads(3, |pg| {
        join_equals_one_process(&pg);
        Ok(())
    })
    .unwrap();
}

#[test]
fn processes_with_3_5_and_4_batches_inside_join_equal_one_process_over_the_12() {
    let test = "processes_with_3_5_and_4_batches_inside_join_equal_one_process_over_the_12";
    if is_child() {
        join_equals_one_process(&join_child());
        done();
        return;
    }
    Ranks::world(test, 3).assert_all_pass(LIMIT);
}

#[test]
fn an_evaluation_or_no_sync_forward_inside_join_is_an_error_naming_the_rank() {
    distributed::spawn_threads(1, |pg| {
        let varmap = VarMap::new();
        let model = DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, mlp_uneven)?;
        let mut opt = Sgd::new(model.parameters(), SGD)?;
        let (x, _) = share(0, 1, PER, 0);
        let err = model
            .join(&mut opt, JoinDivisor::World, |_| model.forward_t(&x, false))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rank 0: an evaluation forward inside join"),
            "{err}"
        );
        let err = model
            .join(&mut opt, JoinDivisor::World, |_| {
                let _local = model.no_sync();
                model.forward_t(&x, true)
            })
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rank 0: a no_sync forward inside join"),
            "{err}"
        );
        // The model is usable again once join returned.
        let l = loss::cross_entropy(&model.forward_t(&x, true)?, &share(0, 1, PER, 0).1)?;
        opt.step(&model.backward(&l)?)?;
        Ok(())
    })
    .unwrap();
}
