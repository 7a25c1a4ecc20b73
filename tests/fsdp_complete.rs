//! Fully sharded training made complete: checkpoints (one consolidated file, or one file per
//! rank) that resume at any world size and load into DDP and into one process, buffers
//! included; `no_sync` gradient accumulation equal to one batch k times larger; and a
//! backward run outside the wrapper (candle's `opt.backward_step`) refused at the next
//! forward instead of a model that never trains.

mod common;

use candle_core::{DType, Device, Module, ModuleT, Tensor};
use candle_nn::{batch_norm, linear, loss, BatchNorm, Linear, Optimizer, VarBuilder, VarMap};
use candle_parallel::checkpoint::load_training_state;
use candle_parallel::ddp::{DdpConfig, Sharding};
use candle_parallel::distributed::{self, ProcessGroup};
use candle_parallel::fsdp::{self, FsdpConfig, Unit};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{AdamW, AdamWConfig};
use candle_parallel::{DistributedDataParallel, Error, FullyShardedDataParallel};
use common::models::{batch, CLASSES, IN};
use common::{done, is_child, join_child, Ranks};
use std::collections::HashMap;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(120);
const ROWS: usize = 12;
const WIDTH: usize = 7;
const SEED: u64 = 21;
const ADAMW: AdamWConfig = AdamWConfig {
    lr: 0.02,
    betas: (0.9, 0.999),
    eps: 1e-8,
    weight_decay: 0.05,
    amsgrad: false,
    maximize: false,
};

/// A unit with BatchNorm (buffers), a unit without, a root head.
struct Net {
    a: Unit<NormBlock>,
    b: Unit<Linear>,
    head: Linear,
}

/// A linear layer and, in the BatchNorm model, a BatchNorm (whose batch statistics make the
/// training depend on how rows are split, so the arithmetic comparisons use the model
/// without).
struct NormBlock {
    fc: Linear,
    bn: Option<BatchNorm>,
}

impl ModuleT for NormBlock {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let h = self.fc.forward(x)?;
        match &self.bn {
            Some(bn) => bn.forward_t(&h, train)?.relu(),
            None => h.relu(),
        }
    }
}

impl ModuleT for Net {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let h = self.a.forward_t(x, train)?;
        let h = self.b.forward(&h)?.tanh()?;
        self.head.forward(&h)
    }
}

fn net(vb: VarBuilder) -> candle_core::Result<Net> {
    net_of(false, vb)
}

fn net_with(norm: bool) -> impl Fn(VarBuilder) -> candle_core::Result<Net> + Send + Sync + 'static {
    move |vb: VarBuilder| net_of(norm, vb)
}

fn net_of(norm: bool, vb: VarBuilder) -> candle_core::Result<Net> {
    Ok(Net {
        a: fsdp::unit(vb.pp("a"), move |vb| {
            let bn = match norm {
                true => Some(batch_norm(WIDTH, 1e-5, vb.pp("bn"))?),
                false => None,
            };
            Ok(NormBlock {
                fc: linear(IN, WIDTH, vb.pp("fc"))?,
                bn,
            })
        })?,
        b: fsdp::unit(vb.pp("b"), |vb| linear(WIDTH, WIDTH, vb))?,
        head: linear(WIDTH, CLASSES, vb.pp("head"))?,
    })
}

fn fsdp_model(pg: &ProcessGroup, seed: u64) -> FullyShardedDataParallel<Net> {
    fsdp_model_with(pg, seed, false)
}

fn fsdp_model_with(pg: &ProcessGroup, seed: u64, norm: bool) -> FullyShardedDataParallel<Net> {
    let config = FsdpConfig {
        seed: Some(seed),
        ..FsdpConfig::default()
    };
    let build = net_with(norm);
    FullyShardedDataParallel::with_config(&VarMap::new(), pg, &Device::Cpu, config, build).unwrap()
}

/// This rank's rows of step `step`'s batch of `ROWS`.
fn rows(step: usize, pg: &ProcessGroup) -> (Tensor, Tensor) {
    let (x, y) = batch(step, ROWS);
    let per = ROWS / pg.world_size();
    (
        x.narrow(0, pg.rank() * per, per).unwrap(),
        y.narrow(0, pg.rank() * per, per).unwrap(),
    )
}

fn train_fsdp(
    f: &FullyShardedDataParallel<Net>,
    opt: &mut AdamW,
    steps: std::ops::Range<usize>,
    pg: &ProcessGroup,
) {
    for step in steps {
        let (x, y) = rows(step, pg);
        let l = loss::cross_entropy(&f.forward_t(&x, true).unwrap(), &y).unwrap();
        opt.step(&f.backward(&l).unwrap()).unwrap();
    }
}

/// Parameters and buffers by name, with the running statistics of rank 0 (broadcast before
/// each training forward, then updated by rank 0's rows: what every wrapper holds on rank 0).
fn weights(f: &FullyShardedDataParallel<Net>) -> HashMap<String, Tensor> {
    f.full_parameters().unwrap().into_iter().collect()
}

fn max_diff(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>, skip_stats: bool) -> f32 {
    a.iter()
        .filter(|(n, _)| !(skip_stats && n.contains("running")))
        .map(|(n, t)| common::max_abs_diff(t, &b[n]))
        .fold(0.0, f32::max)
}

/// Saves after 5 steps at this world size (both formats), or loads them at another and trains
/// 5 more: the weights of an uninterrupted run at the loading world size.
fn checkpoints(pg: &ProcessGroup, dir: &std::path::Path, phase: &str) {
    match phase {
        "save" => {
            let f = fsdp_model(pg, SEED);
            let mut opt = AdamW::new(f.parameters(), ADAMW).unwrap();
            train_fsdp(&f, &mut opt, 0..5, pg);
            f.save_checkpoint(&opt, dir.join("whole.safetensors"))
                .unwrap();
            f.save_sharded_checkpoint(&opt, dir.join("sharded"))
                .unwrap();
            // With BatchNorm: its statistics travel too.
            let f = fsdp_model_with(pg, SEED, true);
            let mut opt = AdamW::new(f.parameters(), ADAMW).unwrap();
            train_fsdp(&f, &mut opt, 0..5, pg);
            f.save_checkpoint(&opt, dir.join("norm.safetensors"))
                .unwrap();
            f.save_sharded_checkpoint(&opt, dir.join("norm")).unwrap();
            let saved: HashMap<String, Tensor> = f.full_parameters().unwrap().into_iter().collect();
            if pg.rank() == 0 {
                let file = dir.join("norm-rank0.safetensors");
                candle_parallel::checkpoint::save(&saved, file).unwrap();
            }
        }
        _ => {
            // Uninterrupted, at this world size.
            let f = fsdp_model(pg, SEED);
            let mut opt = AdamW::new(f.parameters(), ADAMW).unwrap();
            train_fsdp(&f, &mut opt, 0..10, pg);
            let want = weights(&f);
            for how in ["whole", "sharded"] {
                let f = fsdp_model(pg, 99);
                let mut opt = AdamW::new(f.parameters(), ADAMW).unwrap();
                match how {
                    "whole" => f.load_checkpoint(&mut opt, dir.join("whole.safetensors")),
                    _ => f.load_sharded_checkpoint(&mut opt, dir.join("sharded")),
                }
                .unwrap();
                train_fsdp(&f, &mut opt, 5..10, pg);
                let d = max_diff(&weights(&f), &want, false);
                assert!(
                    d <= 1e-5,
                    "rank {} ({how}): resumed differs by {d}",
                    pg.rank()
                );
            }
            // DDP at this world size loads FSDP's sharded files.
            let varmap = VarMap::new();
            net(seeded_var_builder(&varmap, 99, DType::F32, &Device::Cpu)).unwrap();
            let config = DdpConfig {
                sharding: Sharding::Zero2,
                ..DdpConfig::default()
            };
            let m = DistributedDataParallel::with_config(&varmap, pg, &Device::Cpu, config, net)
                .unwrap();
            let mut opt = AdamW::new(m.parameters(), ADAMW).unwrap();
            m.load_sharded_checkpoint(&mut opt, dir.join("sharded"))
                .unwrap();
            for step in 5..10 {
                let (x, y) = rows(step, pg);
                let l = loss::cross_entropy(&m.forward_t(&x, true).unwrap(), &y).unwrap();
                opt.step(&m.backward(&l).unwrap()).unwrap();
            }
            let ddp: HashMap<String, Tensor> = varmap
                .data()
                .lock()
                .unwrap()
                .iter()
                .map(|(n, v)| (n.clone(), v.as_tensor().copy().unwrap()))
                .collect();
            let d = max_diff(&ddp, &want, false);
            assert!(
                d <= 1e-5,
                "rank {}: DDP from FSDP's files differs by {d}",
                pg.rank()
            );
            // The BatchNorm model's parameters and rank 0's statistics, as saved, both ways.
            let saved =
                candle_parallel::checkpoint::read(dir.join("norm-rank0.safetensors")).unwrap();
            for how in ["whole", "sharded"] {
                let f = fsdp_model_with(pg, 99, true);
                let mut opt = AdamW::new(f.parameters(), ADAMW).unwrap();
                match how {
                    "whole" => f.load_checkpoint(&mut opt, dir.join("norm.safetensors")),
                    _ => f.load_sharded_checkpoint(&mut opt, dir.join("norm")),
                }
                .unwrap();
                let got = weights(&f);
                assert!(got.contains_key("a.bn.running_mean"));
                let d = max_diff(&got, &saved, false);
                assert!(
                    d == 0.0,
                    "rank {} ({how}): the BatchNorm model loads with {d}",
                    pg.rank()
                );
            }
            // One process reads the consolidated file as a training state.
            let one = VarMap::new();
            let model = net(seeded_var_builder(&one, 99, DType::F32, &Device::Cpu)).unwrap();
            let mut o = AdamW::new(one.all_vars(), ADAMW).unwrap();
            load_training_state(&one, &mut o, dir.join("whole.safetensors")).unwrap();
            let (x, _) = batch(50, 4);
            let plain = model.forward_t(&x, false).unwrap();
            assert_eq!(plain.dims(), [4, CLASSES]);
        }
    }
}

#[test]
fn fsdp_checkpoints_resume_at_another_world_size_and_load_into_ddp_and_one_process() {
    let test = "fsdp_checkpoints_resume_at_another_world_size_and_load_into_ddp_and_one_process";
    if is_child() {
        let pg = join_child();
        let dir = std::path::PathBuf::from(std::env::var("CP_DIR").unwrap());
        checkpoints(&pg, &dir, &std::env::var("CP_PHASE").unwrap());
        done();
        return;
    }
    let dir = common::temp_dir("fsdp-checkpoints");
    for (world, phase) in [(3, "save"), (2, "load")] {
        let port = common::free_port();
        let envs = (0..world)
            .map(|r| {
                let mut e = common::rank_env(r, world, port);
                e.push(("CP_DIR".into(), dir.display().to_string()));
                e.push(("CP_PHASE".into(), phase.into()));
                e
            })
            .collect();
        Ranks::start(test, envs).assert_all_pass(LIMIT);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn no_sync_accumulation_equals_one_batch_k_times_larger() {
    distributed::spawn_threads(2, |pg| {
        // 3 micro-batches of 2 rows per rank, losses divided by 3; against 6 rows at once.
        let accumulated = fsdp_model(&pg, SEED);
        let mut opt = AdamW::new(accumulated.parameters(), ADAMW)?;
        let whole = fsdp_model(&pg, SEED);
        let mut whole_opt = AdamW::new(whole.parameters(), ADAMW)?;
        for step in 0..4 {
            let (x, y) = rows(step, &pg);
            let mut grads = None;
            for k in 0..3 {
                let _local = (k < 2).then(|| accumulated.no_sync());
                let (xk, yk) = (x.narrow(0, 2 * k, 2)?, y.narrow(0, 2 * k, 2)?);
                let l = (loss::cross_entropy(&accumulated.forward_t(&xk, true)?, &yk)? / 3.0)?;
                let g = accumulated.backward(&l)?;
                if k < 2 {
                    // Nothing for the optimizer yet.
                    assert!(accumulated.parameters().iter().all(|p| g.get(p).is_none()));
                }
                grads = Some(g);
            }
            opt.step(&grads.unwrap())?;
            let l = loss::cross_entropy(&whole.forward_t(&x, true)?, &y)?;
            whole_opt.step(&whole.backward(&l)?)?;
        }
        // BatchNorm sees the rows in threes: compare the parameters, not the statistics.
        let d = max_diff(&weights(&accumulated), &weights(&whole), true);
        assert!(d <= 1e-5, "accumulated differs by {d}");
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_backward_outside_the_wrapper_is_refused_at_the_next_forward() {
    distributed::spawn_threads(2, |pg| {
        let f = fsdp_model(&pg, SEED);
        let mut opt = AdamW::new(f.parameters(), ADAMW)?;
        let (x, y) = rows(0, &pg);
        let l = loss::cross_entropy(&f.forward_t(&x, true)?, &y)?;
        // candle's habit: the optimizer gets no gradient of its pieces.
        opt.backward_step(&l)?;
        let err = f.forward_t(&x, true).unwrap_err();
        assert!(matches!(err, Error::FsdpUnreducedBackward), "{err}");
        assert!(err.to_string().contains("model.backward(&loss)"), "{err}");
        // The wrapper is usable again, the right way.
        let l = loss::cross_entropy(&f.forward_t(&x, true)?, &y)?;
        opt.step(&f.backward(&l)?)?;
        Ok(())
    })
    .unwrap();
}
