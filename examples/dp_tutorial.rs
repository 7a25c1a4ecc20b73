//! PyTorch's DataParallel tutorial, in candle.
//!
//!     cargo run --example dp_tutorial -- --devices 3
//!
//! A `Linear(5, 2)` model prints the size of the input it sees inside its forward; the loop
//! prints the size of the whole batch outside. With N devices each batch of 30 is split
//! torch.chunk-style: with 8 devices a batch of 30 shows seven `[4, 5]` and one `[2, 5]`, and
//! the last batch of 10 shows five `[2, 5]` (only five replicas run).

use anyhow::Result;
use candle_core::{Module, Tensor};
use candle_nn::{linear, Linear, VarBuilder, VarMap};
use candle_parallel::devices::replica_devices;
use candle_parallel::rng::Rng;
use candle_parallel::DataParallel;
use clap::Parser;

const INPUT_SIZE: usize = 5;
const OUTPUT_SIZE: usize = 2;
const BATCH_SIZE: usize = 30;
const DATA_SIZE: usize = 100;

/// The DataParallel tutorial: watch a batch being split across devices.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Replicas to run (default: every GPU with --features cuda, else 1 CPU replica).
    #[arg(long)]
    devices: Option<usize>,
    /// Use CPU replicas even when GPUs are available.
    #[arg(long)]
    cpu: bool,
}

struct Model {
    fc: Linear,
}

impl Model {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Self {
            fc: linear(INPUT_SIZE, OUTPUT_SIZE, vb.pp("fc"))?,
        })
    }
}

impl Module for Model {
    fn forward(&self, input: &Tensor) -> candle_core::Result<Tensor> {
        let output = self.fc.forward(input)?;
        println!(
            "\tIn Model: input size {:?} output size {:?}",
            input.dims(),
            output.dims()
        );
        Ok(output)
    }
}

fn main() -> Result<()> {
    // The library's messages (rendezvous progress, DDP's reports) go through `log`.
    candle_parallel::logging::init();
    let args = Args::parse();
    let devices = replica_devices(args.devices, args.cpu)?;
    if devices.len() > 1 {
        println!("Let's use {} devices!", devices.len());
    }
    let device = devices[0].clone();
    let varmap = VarMap::new();
    let model = DataParallel::new(&varmap, devices, Model::new)?;

    let mut rng = Rng::new(0);
    let values: Vec<f32> = (0..DATA_SIZE * INPUT_SIZE)
        .map(|_| rng.normal() as f32)
        .collect();
    let data = Tensor::from_vec(values, (DATA_SIZE, INPUT_SIZE), &device)?;
    let mut start = 0;
    while start < DATA_SIZE {
        let len = BATCH_SIZE.min(DATA_SIZE - start);
        let input = data.narrow(0, start, len)?;
        let output = model.forward(&input)?;
        println!(
            "Outside: input size {:?} output_size {:?}",
            input.dims(),
            output.dims()
        );
        start += len;
    }
    Ok(())
}
