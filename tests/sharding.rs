//! Sharded data parallel and uneven inputs: ZeRO-2 inside DistributedDataParallel trains as
//! plain DDP does, and `join` lets ranks with fewer batches shadow the others, over thread ranks
//! and real processes on 127.0.0.1, with tensor sizes no world divides.

mod common;

use candle_core::{DType, Device};
use candle_nn::{loss, Module, Optimizer, VarMap};
use candle_parallel::checkpoint::load_training_state;
use candle_parallel::ddp::{DdpConfig, JoinDivisor, Sharding};
use candle_parallel::distributed::{self, ProcessGroup};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
use candle_parallel::DistributedDataParallel;
use common::models::{batch, max_diff, mlp_uneven, share, values, Mlp, Values};
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

/// The global batch of the checkpoint tests: the same rows at every world size (1, 2, 3, 4, 6).
const ROWS: usize = 12;
const ADAMW: AdamWConfig = AdamWConfig {
    lr: 0.01,
    betas: (0.9, 0.999),
    eps: 1e-8,
    weight_decay: 0.01,
    amsgrad: false,
    maximize: false,
};

/// A model of `sharding` over `pg`, from weights of `seed`, and its AdamW.
fn fresh(
    pg: &ProcessGroup,
    sharding: Sharding,
    seed: u64,
) -> candle_parallel::Result<(VarMap, DistributedDataParallel<Mlp>, AdamW)> {
    let varmap = VarMap::new();
    mlp_uneven(seeded_var_builder(&varmap, seed, DType::F32, &Device::Cpu))?;
    let model = DistributedDataParallel::with_config(
        &varmap,
        pg,
        &Device::Cpu,
        config(sharding),
        mlp_uneven,
    )?;
    let opt = AdamW::new(model.parameters(), ADAMW)?;
    Ok((varmap, model, opt))
}

/// Steps `steps` of the global batches, this rank taking its rows.
fn steps(
    pg: &ProcessGroup,
    model: &DistributedDataParallel<Mlp>,
    opt: &mut AdamW,
    steps: std::ops::Range<usize>,
) -> candle_parallel::Result<()> {
    let per = ROWS / pg.world_size();
    for step in steps {
        let (x, y) = batch(step, ROWS);
        let (x, y) = (
            x.narrow(0, pg.rank() * per, per)?,
            y.narrow(0, pg.rank() * per, per)?,
        );
        let l = loss::cross_entropy(&model.forward_t(&x, true)?, &y)?;
        opt.step(&model.backward(&l)?)?;
    }
    Ok(())
}

/// 10 uninterrupted steps; 5 steps, a consolidated save, a fresh model and optimizer (other
/// weights) loading it, 5 more: the same weights. Then the same through a sharded save.
fn checkpoints_resume(pg: &ProcessGroup, sharding: Sharding, dir: &std::path::Path) {
    let (varmap, model, mut opt) = fresh(pg, sharding, 7).unwrap();
    steps(pg, &model, &mut opt, 0..10).unwrap();
    model.gather_parameters().unwrap();
    let want = values(&varmap);

    let (_, model, mut opt) = fresh(pg, sharding, 7).unwrap();
    steps(pg, &model, &mut opt, 0..5).unwrap();
    let file = dir.join(format!("{sharding:?}-{}.safetensors", pg.world_size()));
    model.save_checkpoint(&opt, &file).unwrap();
    let shards = dir.join(format!("{sharding:?}-{}", pg.world_size()));
    model.save_sharded_checkpoint(&opt, &shards).unwrap();
    for how in ["consolidated", "sharded"] {
        let (varmap, model, mut opt) = fresh(pg, sharding, 99).unwrap();
        match how {
            "consolidated" => model.load_checkpoint(&mut opt, &file).unwrap(),
            _ => model.load_sharded_checkpoint(&mut opt, &shards).unwrap(),
        }
        steps(pg, &model, &mut opt, 5..10).unwrap();
        model.gather_parameters().unwrap();
        let d = max_diff(&values(&varmap), &want);
        assert!(
            d == 0.0,
            "rank {} ({sharding:?}, {how}): resumed training differs by {d}",
            pg.rank()
        );
    }
}

#[test]
fn a_checkpoint_round_trip_resumes_to_the_weights_of_an_uninterrupted_run() {
    let dir = common::temp_dir("zero2-resume");
    for world in [1, 2, 3] {
        for sharding in [Sharding::None, Sharding::Zero2] {
            distributed::spawn_threads(world, |pg| {
                checkpoints_resume(&pg, sharding, &dir);
                Ok(())
            })
            .unwrap();
        }
    }
    // A rank's file missing is an error naming it, as is a file of another model.
    std::fs::remove_file(dir.join("Zero2-3/rank-1-of-3.safetensors")).unwrap();
    distributed::spawn_threads(1, |pg| {
        let (_, model, mut opt) = fresh(&pg, Sharding::Zero2, 7)?;
        let err = model
            .load_sharded_checkpoint(&mut opt, dir.join("Zero2-3"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("rank-1-of-3.safetensors is missing"), "{err}");
        let other = dir.join("other.safetensors");
        candle_parallel::checkpoint::save(
            &[(
                "l1.weight".to_string(),
                candle_core::Tensor::zeros((2, 2), DType::F32, &Device::Cpu)?,
            )]
            .into_iter()
            .collect(),
            &other,
        )?;
        let err = model
            .load_checkpoint(&mut opt, &other)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("other.safetensors")
                && (err.contains("no variable `") || err.contains("has shape [2, 2] in the file")),
            "{err}"
        );
        Ok(())
    })
    .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn checkpoints_of_processes_resume_at_the_same_world_size_and_another() {
    let test = "checkpoints_of_processes_resume_at_the_same_world_size_and_another";
    if is_child() {
        let pg = join_child();
        let dir = std::path::PathBuf::from(std::env::var("CP_DIR").unwrap());
        match std::env::var("CP_PHASE").unwrap().as_str() {
            "resume" => checkpoints_resume(&pg, Sharding::Zero2, &dir),
            // Saved by 3 ranks after 5 steps: loaded by 2, which go on with the same batches.
            "save" => {
                let (_, model, mut opt) = fresh(&pg, Sharding::Zero2, 7).unwrap();
                steps(&pg, &model, &mut opt, 0..5).unwrap();
                model
                    .save_sharded_checkpoint(&opt, dir.join("three"))
                    .unwrap();
                model
                    .save_checkpoint(&opt, dir.join("three.safetensors"))
                    .unwrap();
            }
            _ => {
                let (varmap, model, mut opt) = fresh(&pg, Sharding::Zero2, 99).unwrap();
                model
                    .load_sharded_checkpoint(&mut opt, dir.join("three"))
                    .unwrap();
                steps(&pg, &model, &mut opt, 5..10).unwrap();
                model.gather_parameters().unwrap();
                let got = values(&varmap);
                // The uninterrupted run, in one process over the whole batches.
                let one = VarMap::new();
                let m = mlp_uneven(seeded_var_builder(&one, 7, DType::F32, &Device::Cpu)).unwrap();
                let mut o = AdamW::new(one.all_vars(), ADAMW).unwrap();
                for step in 0..10 {
                    let (x, y) = batch(step, ROWS);
                    o.backward_step(&loss::cross_entropy(&m.forward(&x).unwrap(), &y).unwrap())
                        .unwrap();
                }
                let d = max_diff(&got, &values(&one));
                assert!(
                    d <= 1e-5,
                    "rank {}: resumed at world 2, differs by {d}",
                    pg.rank()
                );
                // The consolidated file, loaded by one process, holds the same state.
                let plain = VarMap::new();
                let m =
                    mlp_uneven(seeded_var_builder(&plain, 99, DType::F32, &Device::Cpu)).unwrap();
                let mut o = AdamW::new(plain.all_vars(), ADAMW).unwrap();
                load_training_state(&plain, &mut o, dir.join("three.safetensors")).unwrap();
                for step in 5..10 {
                    let (x, y) = batch(step, ROWS);
                    o.backward_step(&loss::cross_entropy(&m.forward(&x).unwrap(), &y).unwrap())
                        .unwrap();
                }
                let d = max_diff(&values(&plain), &values(&one));
                assert!(
                    d <= 1e-5,
                    "one process from the consolidated file differs by {d}"
                );
            }
        }
        done();
        return;
    }
    let dir = common::temp_dir("zero2-processes");
    let env = |phase: &str| {
        vec![
            ("CP_DIR".to_string(), dir.display().to_string()),
            ("CP_PHASE".to_string(), phase.to_string()),
        ]
    };
    for (world, phase) in [(2, "resume"), (3, "resume"), (3, "save"), (2, "load")] {
        let port = common::free_port();
        let envs = (0..world)
            .map(|r| {
                let mut e = common::rank_env(r, world, port);
                e.extend(env(phase));
                e
            })
            .collect();
        Ranks::start(test, envs).assert_all_pass(LIMIT);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
