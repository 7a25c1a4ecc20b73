//! The MLP of `mlp.rs`, trained with DistributedDataParallel: one process per rank.
//!
//!     cargo run --release --example mlp_ddp -- [SAVE_PATH]        # spawns 2 CPU ranks
//!     candle-run --nproc-per-node 4 target/release/examples/mlp_ddp # or torchrun, srun

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{linear, loss, Linear, Optimizer, VarBuilder, VarMap};
use candle_parallel::distributed::{ProcessGroup, ReduceOp};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::optim::{AdamW, AdamWConfig};
use candle_parallel::rng::Rng;
use candle_parallel::{launch, sampler::DistributedSampler, DistributedDataParallel};

const BATCH: usize = 64; // images per optimizer step, over all ranks
const EPOCHS: u64 = 6;

struct Mlp(Linear, Linear, Linear);

impl Mlp {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        let (fc1, fc2) = (linear(2, 64, vb.pp("fc1"))?, linear(64, 64, vb.pp("fc2"))?);
        Ok(Self(fc1, fc2, linear(64, 3, vb.pp("fc3"))?))
    }
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        xs.apply(&self.0)?
            .relu()?
            .apply(&self.1)?
            .relu()?
            .apply(&self.2)
    }
}

/// `n` noisy points on three spiral arms, labelled with their arm.
fn spiral(n: usize, seed: u64, device: &Device) -> Result<(Tensor, Tensor)> {
    let mut rng = Rng::new(seed);
    let (mut points, mut labels) = (Vec::with_capacity(2 * n), Vec::with_capacity(n));
    for _ in 0..n {
        let (arm, r) = (rng.below(3) as u32, rng.uniform());
        let angle = 4.0 * r + arm as f64 * 2.0 * std::f64::consts::PI / 3.0 + 0.3 * rng.normal();
        points.extend([(r * angle.cos()) as f32, (r * angle.sin()) as f32]);
        labels.push(arm);
    }
    let points = Tensor::from_vec(points, (n, 2), device)?;
    Ok((points, Tensor::from_vec(labels, n, device)?))
}

fn main() -> Result<()> {
    // 2 ranks, or this process is one rank of a job that candle-run, torchrun or srun started.
    Ok(launch::spawn(2, |_rank| train())?)
}

fn train() -> Result<()> {
    let save_path = std::env::args().nth(1).unwrap_or("mlp.safetensors".into());
    let device = Device::Cpu;
    let pg = ProcessGroup::from_env(&device)?;
    let (train_x, train_y) = spiral(3072, 0, &device)?;
    let (test_x, test_y) = spiral(1024, 1, &device)?;
    let varmap = VarMap::new();
    Mlp::new(seeded_var_builder(&varmap, 0, DType::F32, &device))?; // the one-process weights
    let model = DistributedDataParallel::new(&varmap, &pg, &device, Mlp::new)?;
    let config = AdamWConfig {
        lr: 0.005,
        ..Default::default()
    };
    let mut opt = AdamW::new(model.parameters(), config)?;
    let mut sampler = DistributedSampler::for_group(train_x.dim(0)?, &pg, Default::default())?;
    for epoch in 0..EPOCHS {
        sampler.set_epoch(epoch);
        let batches = sampler.batches(BATCH / pg.world_size(), false)?;
        let (steps, mut total) = (batches.len(), 0f32);
        for batch in batches {
            let batch = Tensor::from_iter(batch.iter().map(|&i| i as u32), &device)?;
            let logits = model.forward(&train_x.index_select(&batch, 0)?)?;
            let loss = loss::cross_entropy(&logits, &train_y.index_select(&batch, 0)?)?;
            opt.step(&model.backward(&loss)?)?;
            total += loss.to_scalar::<f32>()?;
        }
        let mean_loss = Tensor::new(total / steps as f32, &device)?; // over every rank's batches
        let mean_loss: f32 = pg.all_reduce(&mean_loss, ReduceOp::Avg)?.to_scalar()?;
        if pg.rank() == 0 {
            println!("epoch {epoch}: training loss {mean_loss:.6}");
        }
    }
    if pg.rank() != 0 {
        return Ok(());
    }
    let predicted = model.module().forward(&test_x)?.argmax(D::Minus1)?;
    let correct: u32 = predicted
        .eq(&test_y)?
        .to_dtype(DType::U32)?
        .sum_all()?
        .to_scalar()?;
    println!("test accuracy: {correct}/{}", test_y.dim(0)?);
    varmap.save(save_path)?;
    Ok(())
}
