//! PyTorch's model-parallel tutorial (`ToyModel`: `net1` on one device, `net2` on another),
//! as a pipeline of two processes in candle.
//!
//!     cargo run --example pp_tutorial
//!
//! The tutorial's model is `Linear(10, 10)`, ReLU, `Linear(10, 5)`, trained with MSE and SGD
//! (lr 0.001) on batches of 20 random rows. Here stage 0 (`net1` and the ReLU) runs in rank
//! 0's process and stage 1 (`net2`) in rank 1's; each batch goes through in 4 micro-batches
//! under 1F1B. Rank 1 prints the loss of each step; both ranks end by checking their stage's
//! weights against the whole model trained in one process on the same batches.

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, loss, Linear, Optimizer, VarMap};
use candle_parallel::distributed::ProcessGroup;
use candle_parallel::init::seeded_var_builder;
use candle_parallel::launch;
use candle_parallel::optim::{Sgd, SgdConfig};
use candle_parallel::pipeline::{PipelineSchedule, PipelineStage, Schedule};
use candle_parallel::rng::Rng;

const STEPS: usize = 10;
const SGD: SgdConfig = SgdConfig {
    lr: 0.001,
    momentum: 0.0,
    dampening: 0.0,
    weight_decay: 0.0,
    nesterov: false,
    maximize: false,
};

/// A stage of the tutorial's model: `net1` and the ReLU, or `net2`.
struct Part {
    layer: Linear,
    relu: bool,
}

impl Module for Part {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = x.apply(&self.layer)?;
        if self.relu {
            y.relu()
        } else {
            Ok(y)
        }
    }
}

/// Step `step`'s batch: 20 rows of inputs and labels, the same in every process.
fn batch(step: usize) -> Result<(Tensor, Tensor)> {
    let mut rng = Rng::new(step as u64);
    let mut randn = |n: usize| (0..n).map(|_| rng.normal() as f32).collect::<Vec<_>>();
    let x = Tensor::from_vec(randn(20 * 10), (20, 10), &Device::Cpu)?;
    let y = Tensor::from_vec(randn(20 * 5), (20, 5), &Device::Cpu)?;
    Ok((x, y))
}

fn main() -> Result<()> {
    candle_parallel::logging::init();
    Ok(launch::spawn(2, |_rank| train())?)
}

fn train() -> Result<()> {
    let pg = ProcessGroup::from_env(&Device::Cpu)?;
    let rank = pg.rank();
    let varmap = VarMap::new();
    // Seeded: the same initial weights as the one-process model below, name by name.
    let vb = seeded_var_builder(&varmap, 0, DType::F32, &Device::Cpu);
    let part = match rank {
        0 => Part {
            layer: linear(10, 10, vb.pp("net1"))?,
            relu: true,
        },
        _ => Part {
            layer: linear(10, 5, vb.pp("net2"))?,
            relu: false,
        },
    };
    let stage = PipelineStage::new(part, &varmap, rank, 2, &pg)?;
    let schedule = PipelineSchedule::new(Schedule::OneFOneB, 4, loss::mse)?;
    let mut opt = Sgd::new(stage.parameters(), SGD)?;
    for step in 0..STEPS {
        let (x, y) = batch(step)?;
        // Stage 0 uses the inputs, stage 1 the labels: each rank may pass both.
        let out = schedule.step(&[&stage], Some(&x), Some(&y))?;
        opt.step(&out.grads)?;
        if let Some(loss) = out.loss() {
            println!("step {step}: loss {loss:.6}");
        }
    }
    // The tutorial's model in one process, on the same batches.
    let whole = VarMap::new();
    let vb = seeded_var_builder(&whole, 0, DType::F32, &Device::Cpu);
    let (net1, net2) = (
        linear(10, 10, vb.pp("net1"))?,
        linear(10, 5, vb.pp("net2"))?,
    );
    let mut opt = Sgd::new(whole.all_vars(), SGD)?;
    for step in 0..STEPS {
        let (x, y) = batch(step)?;
        let out = x.apply(&net1)?.relu()?.apply(&net2)?;
        opt.backward_step(&loss::mse(&out, &y)?)?;
    }
    let whole = whole.data().lock().unwrap();
    let mut worst = 0f32;
    for (name, var) in stage.named_parameters() {
        let diff = (var.as_tensor() - whole[name].as_tensor())?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        worst = worst.max(diff);
    }
    println!("rank {rank}: stage {rank}'s weights against one process: max |diff| {worst:.1e}");
    anyhow::ensure!(
        worst < 1e-5,
        "rank {rank}: the pipeline drifted from one process"
    );
    Ok(())
}
