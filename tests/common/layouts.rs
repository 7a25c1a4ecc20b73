//! One small model under every data-parallel layout (one process, DDP, ZeRO-2, fully
//! sharded), behind one face, for the distributed checkpoint's tests.

use super::models::{batch, mlp_uneven, values, Mlp, Values};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{loss, VarMap};
use candle_parallel::checkpoint::distributed::{self as dcp, Checkpointer, StateDict};
use candle_parallel::checkpoint::{self, LoadOptions};
use candle_parallel::ddp::{DdpConfig, Sharding};
use candle_parallel::distributed::ProcessGroup;
use candle_parallel::fsdp::{FsdpConfig, FullyShardedDataParallel};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{AdamWConfig, ElementwiseOptimizer};
use candle_parallel::tensor_parallel::{ParallelPlan, ParallelStyle};
use candle_parallel::DistributedDataParallel;
use std::collections::BTreeSet;
use std::path::Path;

/// Rows of every step's global batch: worlds 1 to 5 share it evenly.
pub const ROWS: usize = 60;

/// The AdamW both checkpoint test files train with.
pub const ADAMW: AdamWConfig = AdamWConfig {
    lr: 0.01,
    betas: (0.9, 0.999),
    eps: 1e-8,
    weight_decay: 0.01,
    amsgrad: false,
    maximize: false,
};

/// The tensor-parallel tests' plan: a column-cut `fc1`, a row-cut `fc2`, a packed `qkv`.
pub fn tp_plan() -> ParallelPlan {
    ParallelPlan::new()
        .layer("fc1", ParallelStyle::Colwise)
        .layer("fc2", ParallelStyle::Rowwise)
        .layer("qkv", ParallelStyle::PackedQkv)
}

/// A `VarMap` of variables made from `parts`, by name.
pub fn varmap_of(parts: impl IntoIterator<Item = (String, Tensor)>) -> VarMap {
    let varmap = VarMap::new();
    for (n, t) in parts {
        let v = Var::from_tensor(&t).unwrap();
        varmap.data().lock().unwrap().insert(n, v);
    }
    varmap
}

/// The name in `varmap` of each of `opt`'s variables, in the optimizer's order.
pub fn names_of(varmap: &VarMap, opt: &impl ElementwiseOptimizer) -> Vec<String> {
    let data = varmap.data().lock().unwrap();
    opt.vars()
        .iter()
        .map(|v| {
            let named = data
                .iter()
                .find(|(_, w)| w.as_tensor().id() == v.as_tensor().id());
            named
                .expect("an optimizer variable of the VarMap")
                .0
                .clone()
        })
        .collect()
}

/// A tensor's elements as the bits of their f64 values: equal means equal bit for bit.
pub fn bits(t: &Tensor) -> Vec<u64> {
    super::as_f64(t).iter().map(|x| x.to_bits()).collect()
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Layout {
    One,
    Ddp,
    Zero2,
    Fsdp,
}

pub enum Model {
    One(VarMap, Mlp),
    Ddp(VarMap, DistributedDataParallel<Mlp>),
    Fsdp(FullyShardedDataParallel<Mlp>),
}

impl Model {
    pub fn new<O: ElementwiseOptimizer>(
        pg: &ProcessGroup,
        layout: Layout,
        seed: u64,
        dtype: DType,
        config: O::Config,
    ) -> (Model, O) {
        let model = match layout {
            Layout::One => {
                let varmap = VarMap::new();
                let m = mlp_uneven(seeded_var_builder(&varmap, seed, dtype, &Device::Cpu)).unwrap();
                Model::One(varmap, m)
            }
            Layout::Ddp | Layout::Zero2 => {
                let varmap = VarMap::new();
                mlp_uneven(seeded_var_builder(&varmap, seed, dtype, &Device::Cpu)).unwrap();
                let config = DdpConfig {
                    bucket_cap_mb: 4e-4,
                    first_bucket_mb: 1e-4,
                    sharding: match layout {
                        Layout::Zero2 => Sharding::Zero2,
                        _ => Sharding::None,
                    },
                    ..DdpConfig::default()
                };
                let ddp = DistributedDataParallel::with_config(
                    &varmap,
                    pg,
                    &Device::Cpu,
                    config,
                    mlp_uneven,
                )
                .unwrap();
                Model::Ddp(varmap, ddp)
            }
            Layout::Fsdp => {
                assert_eq!(dtype, DType::F32);
                let config = FsdpConfig {
                    seed: Some(seed),
                    ..FsdpConfig::default()
                };
                let f = FullyShardedDataParallel::with_config(
                    &VarMap::new(),
                    pg,
                    &Device::Cpu,
                    config,
                    mlp_uneven,
                )
                .unwrap();
                Model::Fsdp(f)
            }
        };
        let params = match &model {
            Model::One(v, _) => v.all_vars(),
            Model::Ddp(_, m) => m.parameters(),
            Model::Fsdp(f) => f.parameters(),
        };
        (model, O::new(params, config).unwrap())
    }

    pub fn train(
        &self,
        pg: &ProcessGroup,
        opt: &mut impl ElementwiseOptimizer,
        steps: std::ops::Range<usize>,
    ) {
        let per = ROWS / pg.world_size();
        let dtype = self.dtype();
        for step in steps {
            let (x, y) = batch(step, ROWS);
            let (x, y) = (
                x.narrow(0, pg.rank() * per, per)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap(),
                y.narrow(0, pg.rank() * per, per).unwrap(),
            );
            let grads = match self {
                Model::One(_, m) => {
                    let l = loss::cross_entropy(&m.forward(&x).unwrap(), &y).unwrap();
                    l.backward().unwrap()
                }
                Model::Ddp(_, m) => {
                    let l = loss::cross_entropy(&m.forward_t(&x, true).unwrap(), &y).unwrap();
                    m.backward(&l).unwrap()
                }
                Model::Fsdp(f) => {
                    let l = loss::cross_entropy(&f.forward_t(&x, true).unwrap(), &y).unwrap();
                    f.backward(&l).unwrap()
                }
            };
            opt.step(&grads).unwrap();
        }
    }

    /// The dtype of the parameters.
    pub fn dtype(&self) -> DType {
        match self {
            Model::One(v, _) => v.all_vars()[0].dtype(),
            Model::Ddp(_, m) => m.parameters()[0].dtype(),
            Model::Fsdp(f) => f.parameters()[0].dtype(),
        }
    }

    /// The evaluation loss of a batch no step sees.
    pub fn evaluate(&self, pg: &ProcessGroup) -> f32 {
        let per = ROWS / pg.world_size();
        let (x, y) = batch(999, ROWS);
        let (x, y) = (
            x.narrow(0, pg.rank() * per, per).unwrap(),
            y.narrow(0, pg.rank() * per, per).unwrap(),
        );
        let logits = match self {
            Model::One(_, m) => m.forward(&x).unwrap(),
            Model::Ddp(_, m) => m.forward_t(&x, false).unwrap(),
            Model::Fsdp(f) => f.forward_t(&x, false).unwrap(),
        };
        loss::cross_entropy(&logits, &y)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    pub fn state_dict(&self, opt: &impl ElementwiseOptimizer) -> StateDict {
        match self {
            Model::One(v, _) => dcp::training_state(v, opt).unwrap(),
            Model::Ddp(_, m) => m.state_dict(opt).unwrap(),
            Model::Fsdp(f) => f.state_dict(opt).unwrap(),
        }
    }

    pub fn load(
        &self,
        opt: &mut impl ElementwiseOptimizer,
        c: &Checkpointer,
        options: LoadOptions,
    ) -> candle_parallel::Result<()> {
        match self {
            Model::One(v, _) => dcp::load_training_state(c, v, opt, options),
            Model::Ddp(_, m) => m.load_state_dict(opt, c, options),
            Model::Fsdp(f) => f.load_state_dict(opt, c, options),
        }
    }

    /// The whole training state in one file (every layout's consolidated save).
    pub fn save_whole(&self, opt: &impl ElementwiseOptimizer, path: &Path) {
        match self {
            Model::One(v, _) => checkpoint::save_training_state(v, opt, path).unwrap(),
            Model::Ddp(_, m) => m.save_checkpoint(opt, path).unwrap(),
            Model::Fsdp(f) => f.save_checkpoint(opt, path).unwrap(),
        }
    }

    pub fn values(&self) -> Values {
        match self {
            Model::One(varmap, _) => values(varmap),
            Model::Ddp(varmap, m) => {
                m.gather_parameters().unwrap();
                values(varmap)
            }
            Model::Fsdp(f) => {
                let mut all: Values = f
                    .full_parameters()
                    .unwrap()
                    .into_iter()
                    .map(|(n, t)| {
                        let t = t.to_dtype(DType::F32).unwrap();
                        (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
                    })
                    .collect();
                all.sort_by(|a, b| a.0.cmp(&b.0));
                all
            }
        }
    }
}

/// Every tensor of two training-state files is the same, bit for bit.
pub fn assert_same_files(a: &Path, b: &Path) {
    let (a_t, b_t) = (checkpoint::read(a).unwrap(), checkpoint::read(b).unwrap());
    let keys: BTreeSet<&String> = a_t.keys().collect();
    let b_keys: BTreeSet<&String> = b_t.keys().collect();
    assert_eq!(keys, b_keys, "{} and {}", a.display(), b.display());
    for k in keys {
        assert_eq!(
            bits(&a_t[k]),
            bits(&b_t[k]),
            "`{k}` differs between {} and {}",
            a.display(),
            b.display()
        );
    }
}

/// One process over the whole batches of `steps` from weights of seed 7.
pub fn one_process<O: ElementwiseOptimizer>(config: O::Config, steps: usize) -> Values {
    let varmap = VarMap::new();
    let m = mlp_uneven(seeded_var_builder(&varmap, 7, DType::F32, &Device::Cpu)).unwrap();
    let mut o = O::new(varmap.all_vars(), config).unwrap();
    for step in 0..steps {
        let (x, y) = batch(step, ROWS);
        let l = loss::cross_entropy(&m.forward(&x).unwrap(), &y).unwrap();
        o.step(&l.backward().unwrap()).unwrap();
    }
    values(&varmap)
}
