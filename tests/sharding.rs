//! Sharded data parallel: ZeRO-2 inside DistributedDataParallel trains as plain DDP does, over
//! thread ranks and real processes on 127.0.0.1, with tensor sizes no world divides.

mod common;

use candle_core::{DType, Device};
use candle_nn::{loss, Optimizer, VarMap};
use candle_parallel::ddp::{DdpConfig, Sharding};
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
