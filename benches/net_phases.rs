//! Where a training step of the CIFAR-10 Net spends its time: phase by phase, then layer by layer.
//!
//!     cargo bench --bench net_phases
//!     cargo bench --bench net_phases --features cuda -- --batches 128,512 --steps 50
//!
//! On a GPU every interval is GPU time, measured with CUDA events on the device's stream, and
//! beside it the host's time to issue the same calls: where the host takes longer than the
//! GPU, the step waits on the host, not on kernels. On the CPU both are the wall clock.
//!
//! The phases of a step are forward with the loss, backward, and the SGD update (medians over
//! `--steps` steps). Each layer is then timed alone on an input of the shape it sees in the Net:
//! its forward, and the backward of `sum(layer(x) * g)` for a fixed random `g` (which adds one
//! multiply and one sum to the layer's own backward; torch's twin does the same). The first
//! convolution's input needs no gradient, as in training. The Net runs each convolution with
//! its ReLU and max-pooling as one op (`conv1 block`, `conv2 block`; the three apart are timed
//! too, for comparison) and each hidden linear layer with its ReLU. `scripts/torch_net_bench.py --phases`
//! prints the same tables for PyTorch. `--candle-kernels` runs candle's ops where ours would
//! (`nn::use_own_cpu_kernels(false)`, `nn::use_own_cuda_kernels(false)`), to compare the two.
//! Reports; asserts nothing.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{loss, Conv2dConfig, Linear, Optimizer, VarMap};
use candle_parallel::cifar::Net;
use candle_parallel::init::seeded_var_builder;
use candle_parallel::nn::{self, max_pool2d, Conv2d};
use candle_parallel::optim::{Sgd, SgdConfig};
use std::time::Instant;

struct Options {
    batches: Vec<usize>,
    steps: usize,
    cpu: bool,
    candle_kernels: bool,
}

fn parse() -> Result<Options> {
    let mut o = Options {
        batches: vec![128, 512],
        steps: 30,
        cpu: false,
        candle_kernels: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |flag: &str| args.next().with_context(|| format!("{flag} needs a value"));
        match arg.as_str() {
            "--batches" => {
                o.batches = value("--batches")?
                    .split(',')
                    .map(|v| {
                        v.trim()
                            .parse()
                            .with_context(|| format!("--batches: {v:?}"))
                    })
                    .collect::<Result<_>>()?
            }
            "--steps" => o.steps = value("--steps")?.parse().context("--steps")?,
            "--cpu" => o.cpu = true,
            "--candle-kernels" => o.candle_kernels = true,
            "--bench" => {} // passed by `cargo bench`
            other => bail!("unknown argument {other:?}"),
        }
    }
    if o.batches.contains(&0) || o.steps == 0 {
        bail!("batch sizes and --steps must be positive");
    }
    Ok(o)
}

/// A point in time on the host and, on a GPU, on the device's stream.
struct Mark {
    host: Instant,
    #[cfg(feature = "cuda")]
    event: Option<candle_core::cuda_backend::cudarc::driver::CudaEvent>,
}

/// Takes [`Mark`]s on one device.
struct Clock {
    #[cfg(feature = "cuda")]
    stream: Option<std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>>,
}

impl Clock {
    fn new(device: &Device) -> Self {
        #[cfg(not(feature = "cuda"))]
        let _ = device;
        Self {
            #[cfg(feature = "cuda")]
            stream: match device {
                Device::Cuda(d) => Some(d.cuda_stream()),
                _ => None,
            },
        }
    }

    fn mark(&self) -> Result<Mark> {
        #[cfg(feature = "cuda")]
        if let Some(stream) = &self.stream {
            use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
            let event = stream
                .context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            event.record(stream)?;
            return Ok(Mark {
                host: Instant::now(),
                event: Some(event),
            });
        }
        Ok(Mark {
            host: Instant::now(),
            #[cfg(feature = "cuda")]
            event: None,
        })
    }

    /// Milliseconds from `a` to `b`: (device time, host time). Waits for `b` on a GPU.
    fn between(&self, a: &Mark, b: &Mark) -> Result<(f64, f64)> {
        let host = (b.host - a.host).as_secs_f64() * 1e3;
        #[cfg(feature = "cuda")]
        if let (Some(x), Some(y)) = (&a.event, &b.event) {
            return Ok((f64::from(x.elapsed_ms(y)?), host));
        }
        Ok((host, host))
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Medians of forward + loss, backward, update and the whole step: (device ms, host ms) each.
fn phases(device: &Device, batch: usize, steps: usize) -> Result<Vec<(f64, f64)>> {
    let varmap = VarMap::new();
    let net = Net::new(seeded_var_builder(&varmap, 0, DType::F32, device))?;
    let config = SgdConfig {
        lr: 0.01,
        momentum: 0.9,
        ..Default::default()
    };
    let mut opt = Sgd::new(varmap.all_vars(), config)?;
    let x = Tensor::randn(0f32, 1.0, (batch, 3, 32, 32), device)?;
    let labels: Vec<u32> = (0..batch as u32).map(|i| i % 10).collect();
    let y = Tensor::from_vec(labels, batch, device)?;
    let clock = Clock::new(device);
    let warmup = 3;
    let mut marks = Vec::with_capacity(steps);
    for step in 0..warmup + steps {
        let m0 = clock.mark()?;
        let l = loss::cross_entropy(&net.forward(&x)?, &y)?;
        let m1 = clock.mark()?;
        let grads = l.backward()?;
        let m2 = clock.mark()?;
        opt.step(&grads)?;
        let m3 = clock.mark()?;
        if step >= warmup {
            marks.push([m0, m1, m2, m3]);
        }
    }
    let mut columns = vec![(Vec::new(), Vec::new()); 4];
    for [m0, m1, m2, m3] in &marks {
        for (i, (a, b)) in [(m0, m1), (m1, m2), (m2, m3), (m0, m3)].iter().enumerate() {
            let (gpu, host) = clock.between(a, b)?;
            columns[i].0.push(gpu);
            columns[i].1.push(host);
        }
    }
    Ok(columns
        .into_iter()
        .map(|(g, h)| (median(g), median(h)))
        .collect())
}

type Layer = Box<dyn Fn(&Tensor) -> candle_core::Result<Tensor>>;

/// One layer of the Net: its name, the shape of its input, whether that input needs a
/// gradient, and the layer.
type Case = (&'static str, Vec<usize>, bool, Layer);

/// The Net's layers in order, at `batch`.
fn layers(device: &Device, batch: usize) -> Result<Vec<Case>> {
    let vars = VarMap::new();
    let vb = seeded_var_builder(&vars, 0, DType::F32, device);
    let conv = |name: &str, cin, cout| -> Result<Conv2d> {
        let w = vb.get((cout, cin, 5, 5), &format!("{name}.weight"))?;
        let b = vb.get(cout, &format!("{name}.bias"))?;
        Ok(Conv2d::new(w, Some(b), Conv2dConfig::default()))
    };
    let fc = |name: &str, fin, fout| -> Result<Linear> {
        let w = vb.get((fout, fin), &format!("{name}.weight"))?;
        let b = vb.get(fout, &format!("{name}.bias"))?;
        Ok(Linear::new(w, Some(b)))
    };
    let (conv1, conv2) = (conv("conv1", 3, 6)?, conv("conv2", 6, 16)?);
    let (block1, block2) = (conv1.clone(), conv2.clone());
    let (fc1, fc2, fc3) = (
        fc("fc1", 400, 120)?,
        fc("fc2", 120, 84)?,
        fc("fc3", 84, 10)?,
    );
    let labels: Vec<u32> = (0..batch as u32).map(|i| i % 10).collect();
    let y = Tensor::from_vec(labels, batch, device)?;
    let b = batch;
    Ok(vec![
        (
            "conv1 block",
            vec![b, 3, 32, 32],
            false,
            Box::new(move |x| block1.forward_relu_max_pool2d(x, 2)),
        ),
        (
            "conv2 block",
            vec![b, 6, 14, 14],
            true,
            Box::new(move |x| block2.forward_relu_max_pool2d(x, 2)),
        ),
        (
            "fc1 + relu",
            vec![b, 400],
            true,
            Box::new(move |x| nn::linear_relu(x, &fc1)),
        ),
        (
            "fc2 + relu",
            vec![b, 120],
            true,
            Box::new(move |x| nn::linear_relu(x, &fc2)),
        ),
        (
            "fc3",
            vec![b, 84],
            true,
            Box::new(move |x| nn::linear(x, &fc3)),
        ),
        (
            "cross_entropy",
            vec![b, 10],
            true,
            Box::new(move |x| loss::cross_entropy(x, &y)),
        ),
        // The blocks' three ops apart, as the Net ran them before (not in the sum).
        (
            "(conv1)",
            vec![b, 3, 32, 32],
            false,
            Box::new(move |x| conv1.forward(x)),
        ),
        ("(relu)", vec![b, 6, 28, 28], true, Box::new(|x| x.relu())),
        (
            "(max_pool)",
            vec![b, 6, 28, 28],
            true,
            Box::new(|x| max_pool2d(x, 2)),
        ),
        (
            "(conv2)",
            vec![b, 6, 14, 14],
            true,
            Box::new(move |x| conv2.forward(x)),
        ),
        ("(relu)", vec![b, 16, 10, 10], true, Box::new(|x| x.relu())),
        (
            "(max_pool)",
            vec![b, 16, 10, 10],
            true,
            Box::new(|x| max_pool2d(x, 2)),
        ),
    ])
}

/// Median device ms of `layer`'s forward, and of the backward of `sum(layer(x) * g)`.
fn layer_times(
    device: &Device,
    shape: &[usize],
    needs_grad: bool,
    layer: &Layer,
    reps: usize,
) -> Result<(f64, f64)> {
    let input = Tensor::randn(0f32, 1.0, shape, device)?;
    let var = Var::from_tensor(&input)?;
    let x = if needs_grad { var.as_tensor() } else { &input };
    let g = layer(x)?.randn_like(0.0, 1.0)?;
    let clock = Clock::new(device);
    let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
    for rep in 0..reps + 2 {
        let m0 = clock.mark()?;
        let out = layer(x)?;
        let m1 = clock.mark()?;
        let objective = (out * &g)?.sum_all()?;
        let m2 = clock.mark()?;
        objective.backward()?;
        let m3 = clock.mark()?;
        if rep >= 2 {
            fwd.push(clock.between(&m0, &m1)?.0);
            bwd.push(clock.between(&m2, &m3)?.0);
        }
    }
    Ok((median(fwd), median(bwd)))
}

fn main() -> Result<()> {
    candle_parallel::memory::keep_freed_memory();
    let o = parse()?;
    nn::use_own_cpu_kernels(!o.candle_kernels);
    nn::use_own_cuda_kernels(!o.candle_kernels);
    let kernels = match o.candle_kernels {
        true => "candle's ops",
        false => "our kernels",
    };
    let device = if o.cpu || candle_parallel::devices::gpu_count() == 0 {
        Device::Cpu
    } else {
        candle_parallel::devices::cuda_device(0)?
    };
    let (what, host) = if device.is_cuda() {
        ("GPU ms (CUDA events)", "host ms")
    } else {
        ("ms (wall clock)", "")
    };
    for &batch in &o.batches {
        println!(
            "\nNet training step at batch {batch} on {} with {kernels}: median of {} steps",
            if device.is_cuda() { "GPU 0" } else { "the CPU" },
            o.steps
        );
        println!("{:<20} {what:>22} {host:>10}", "phase");
        let names = ["forward + loss", "backward", "SGD update", "step"];
        for (name, (gpu, host)) in names.iter().zip(phases(&device, batch, o.steps)?) {
            let host = if device.is_cuda() {
                format!("{host:.3}")
            } else {
                String::new()
            };
            println!("{name:<20} {gpu:>22.3} {host:>10}");
        }
        println!(
            "{:<14} {:<18} {:>12} {:>12}",
            "layer", "input", "forward ms", "backward ms"
        );
        let (mut total_f, mut total_b) = (0.0, 0.0);
        let mut summed = false;
        for (name, shape, needs_grad, layer) in layers(&device, batch)? {
            let apart = name.starts_with('(');
            if apart && !summed {
                println!("{:<14} {:<18} {total_f:>12.3} {total_b:>12.3}", "sum", "");
                println!("the blocks' ops apart, as the Net ran them before fusing:");
                summed = true;
            }
            let (f, b) = layer_times(&device, &shape, needs_grad, &layer, o.steps)?;
            if !apart {
                total_f += f;
                total_b += b;
            }
            println!(
                "{name:<14} {:<18} {f:>12.3} {b:>12.3}",
                format!("{shape:?}")
            );
        }
    }
    Ok(())
}
