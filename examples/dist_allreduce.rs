//! Collectives across processes, started either way:
//!
//!     cargo run --example dist_allreduce -- --nproc 3          # spawns its own 3 ranks
//!     cargo build --example dist_allreduce
//!     candle-run --nproc-per-node 3 target/debug/examples/dist_allreduce
//!
//! Every rank contributes `rank + 1` and prints the all-reduced sum and the gathered values.

use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_parallel::distributed::{ProcessGroup, ReduceOp};
use candle_parallel::launch;
use clap::Parser;

/// All-reduce and all-gather across processes.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Ranks to spawn when not started by candle-run or torchrun.
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// Make this rank fail (to see the others stopped and the failure reported).
    #[arg(long)]
    fail_rank: Option<usize>,
}

fn rank_main(args: &Args) -> Result<()> {
    let pg = ProcessGroup::from_env(&Device::Cpu)?;
    let (rank, world) = (pg.rank(), pg.world_size());
    if args.fail_rank == Some(rank) {
        anyhow::bail!("rank {rank} was asked to fail");
    }
    let x = Tensor::new(&[rank as f32 + 1.0, 10.0], &Device::Cpu)?;
    let sum = pg.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?;
    let gathered: Vec<f32> = pg
        .all_gather(&x)?
        .iter()
        .map(|t| t.to_vec1::<f32>().map(|v| v[0]))
        .collect::<candle_core::Result<_>>()?;
    println!("rank {rank} of {world}: all_reduce(sum) = {sum:?}, all_gather = {gathered:?}");
    pg.barrier()?;
    Ok(())
}

fn main() -> Result<()> {
    // The library's messages (rendezvous progress, DDP's reports) go through `log`.
    candle_parallel::logging::init();
    let args = Args::parse();
    // Spawns --nproc ranks; under candle-run or torchrun this process already is one.
    launch::spawn(args.nproc, |_rank| rank_main(&args))?;
    Ok(())
}
