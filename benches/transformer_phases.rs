//! Where a training step of `transformer_ddp`'s transformer spends its time, ours beside
//! PyTorch's: the whole step by phase (forward with the loss, backward, AdamW), then each layer
//! alone, forward and backward, on the input it sees in the model.
//!
//!     cargo bench --bench transformer_phases
//!     cargo bench --bench transformer_phases -- --threads 1 --dim 128 --batch 64
//!
//! The model and batch are the example's (`--layers 2 --dim 64 --heads 4 --digits 8 --batch
//! 32`: sequences of 16 tokens). Each layer is timed alone as `net_phases` times the Net's:
//! its forward, and the backward of `sum(layer(x) * g)` for a fixed random `g` by
//! `nn::backward`, as the training step's (the layer's parameters get their gradients as made,
//! not added to zeros as candle's `backward()` would: before 2026-11-27 the rows of layers
//! with parameters included those adds). The attention core is the part between the qkv and
//! output projections (`nn::attention::causal_attention`, and beside it the candle ops it
//! replaced); the other layers are the model's (`nn::linear`,
//! `nn::linear_gelu`, `nn::LayerNorm`, as `examples/common/transformer.rs` uses them; the
//! GELU alone is `nn::ops::gelu_erf`). Medians over `--steps` repetitions after 3 warm-up ones.
//! `scripts/torch_transformer_phases.py` times the same in PyTorch with the same threads; this
//! bench runs it when `python3 -c "import torch"` works and prints the ratios. Reports; asserts
//! nothing.

#[path = "../examples/common/transformer.rs"]
mod transformer;

#[path = "common/timing.rs"]
mod timing;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{embedding, linear, Optimizer, VarBuilder, VarMap};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::nn::attention::{self, causal_attention};
use candle_parallel::nn::ops::gelu_erf;
use candle_parallel::nn::{self, layer_norm};
use candle_parallel::optim::{AdamW, AdamWConfig};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use timing::time;
use transformer::{sort_loss, Config, SortTask, Transformer};

struct Options {
    layers: usize,
    dim: usize,
    heads: usize,
    digits: usize,
    batch: usize,
    steps: usize,
    threads: Option<usize>,
}

fn parse() -> Result<Options> {
    let mut o = Options {
        layers: 2,
        dim: 64,
        heads: 4,
        digits: 8,
        batch: 32,
        steps: 30,
        threads: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |flag: &str| -> Result<usize> {
            Ok(args
                .next()
                .with_context(|| format!("{flag} needs a value"))?
                .parse()?)
        };
        match a.as_str() {
            "--layers" => o.layers = value("--layers")?,
            "--dim" => o.dim = value("--dim")?,
            "--heads" => o.heads = value("--heads")?,
            "--digits" => o.digits = value("--digits")?,
            "--batch" => o.batch = value("--batch")?,
            "--steps" => o.steps = value("--steps")?,
            "--threads" => o.threads = Some(value("--threads")?),
            "--bench" => {}
            other => anyhow::bail!("unknown argument {other}"),
        }
    }
    Ok(o)
}

/// Forward and backward times of `layer` on `x` (made a variable when `grad_x`).
fn layer(
    steps: usize,
    x: &Tensor,
    grad_x: bool,
    layer: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
) -> Result<(f64, f64)> {
    let x = if grad_x {
        Var::from_tensor(x)?.as_tensor().clone()
    } else {
        x.clone()
    };
    let g = layer(&x)?.rand_like(-1.0, 1.0)?;
    let fwd = time(steps, || {
        layer(&x)?;
        Ok(())
    })?;
    let bwd_and_fwd = time(steps, || {
        nn::backward(&(layer(&x)? * &g)?.sum_all()?)?;
        Ok(())
    })?;
    Ok((fwd, (bwd_and_fwd - fwd).max(0.0)))
}

fn main() -> Result<()> {
    // As transformer_ddp does: freed tensor memory stays for the next step, rather than being
    // returned to the kernel and faulted in again (which costs most with several threads).
    candle_parallel::memory::keep_freed_memory();
    candle_parallel::threads::one_pool();
    let o = parse()?;
    if let Some(n) = o.threads {
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    let threads = candle_core::utils::get_num_threads();
    let (task, _) = SortTask::generate(o.digits, o.batch, 0, 7);
    let config = Config {
        vocab: 11,
        max_len: task.context(),
        dim: o.dim,
        heads: o.heads,
        layers: o.layers,
        checkpoint_every: 0,
    };
    let (tokens, answers) = task.batch(&(0..o.batch).collect::<Vec<_>>(), &Device::Cpu)?;
    let (b, t, d) = (o.batch, tokens.dim(1)?, o.dim);
    println!(
        "transformer_ddp's model: {} layers, dim {d}, {} heads, batch {b} x {t} tokens, {threads} \
         threads",
        o.layers, o.heads
    );
    let mut ours: BTreeMap<&str, (f64, f64)> = BTreeMap::new();

    // The whole step.
    let varmap = VarMap::new();
    let model = Transformer::new(
        config,
        seeded_var_builder(&varmap, 1, DType::F32, &Device::Cpu),
    )?;
    let mut opt = AdamW::new(varmap.all_vars(), AdamWConfig::default())?;
    let forward = time(o.steps, || {
        sort_loss(&model.forward(&tokens)?, &answers)?;
        Ok(())
    })?;
    let backward = time(o.steps, || {
        nn::backward(&sort_loss(&model.forward(&tokens)?, &answers)?)?;
        Ok(())
    })? - forward;
    let grads = nn::backward(&sort_loss(&model.forward(&tokens)?, &answers)?)?;
    let step = time(o.steps, || Ok(opt.step(&grads)?))?;
    ours.insert("step: forward + loss", (forward, 0.0));
    ours.insert("step: backward", (backward.max(0.0), 0.0));
    ours.insert("step: AdamW", (step, 0.0));

    // Each layer alone.
    let vm = VarMap::new();
    let vb: VarBuilder = seeded_var_builder(&vm, 2, DType::F32, &Device::Cpu);
    let x = Tensor::randn(0f32, 1.0, (b, t, d), &Device::Cpu)?;
    let tok = embedding(11, d, vb.pp("tok"))?;
    let pos = embedding(t, d, vb.pp("pos"))?;
    let positions = Tensor::arange(0u32, t as u32, &Device::Cpu)?;
    let inputs = tokens.clone();
    ours.insert(
        "embeddings",
        layer(o.steps, &inputs, false, |ids| {
            ids.apply(&tok)?.broadcast_add(&positions.apply(&pos)?)
        })?,
    );
    let ln = layer_norm(d, 1e-5, vb.pp("ln"))?;
    ours.insert("layer_norm", layer(o.steps, &x, true, |x| x.apply(&ln))?);
    let qkv = linear(d, 3 * d, vb.pp("qkv"))?;
    ours.insert(
        "qkv linear",
        layer(o.steps, &x, true, |x| nn::linear(x, &qkv))?,
    );
    let q = Tensor::randn(0f32, 1.0, (b, t, 3 * d), &Device::Cpu)?;
    ours.insert(
        "attention core",
        layer(o.steps, &q, true, |q| causal_attention(q, o.heads))?,
    );
    // The candle ops it replaced (reshape, permute, three copies, scores, mask, our softmax,
    // weighted sum, transpose): PyTorch's twin has no such row.
    ours.insert(
        "attention, composed",
        layer(o.steps, &q, true, |q| attention::composed(q, o.heads))?,
    );
    let proj = linear(d, d, vb.pp("proj"))?;
    ours.insert(
        "proj linear",
        layer(o.steps, &x, true, |x| nn::linear(x, &proj))?,
    );
    let fc1 = linear(d, 4 * d, vb.pp("fc1"))?;
    ours.insert(
        "fc1 linear + gelu",
        layer(o.steps, &x, true, |x| nn::linear_gelu(x, &fc1))?,
    );
    let h = Tensor::randn(0f32, 1.0, (b, t, 4 * d), &Device::Cpu)?;
    ours.insert(
        "gelu (of fc1's output)",
        layer(o.steps, &h, true, gelu_erf)?,
    );
    let fc2 = linear(4 * d, d, vb.pp("fc2"))?;
    ours.insert(
        "fc2 linear",
        layer(o.steps, &h, true, |h| nn::linear(h, &fc2))?,
    );
    let head = linear(d, 11, vb.pp("head"))?;
    ours.insert(
        "head + loss",
        layer(o.steps, &x, true, |x| {
            sort_loss(&nn::linear(x, &head)?, &answers)?.unsqueeze(0)
        })?,
    );

    // PyTorch's, through the twin.
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/torch_transformer_phases.py");
    let mut torch: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    let args = [
        ("--layers", o.layers),
        ("--dim", d),
        ("--heads", o.heads),
        ("--digits", o.digits),
        ("--batch", b),
        ("--steps", o.steps),
        ("--threads", threads),
    ];
    let mut cmd = Command::new("python3");
    cmd.arg(&script);
    for (flag, v) in args {
        cmd.args([flag, &v.to_string()]);
    }
    match cmd.output() {
        Ok(out) if out.status.success() => {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                let Some(rest) = line.strip_prefix("torch ") else {
                    continue;
                };
                let f: Vec<&str> = rest.rsplitn(3, ' ').collect();
                if let [bwd, fwd, name] = f[..] {
                    torch.insert(name.to_string(), (fwd.parse()?, bwd.parse()?));
                }
            }
        }
        Ok(out) => println!(
            "torch: skipped, {} failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => println!("torch: skipped, python3 does not run ({e})"),
    }

    println!(
        "\n{:<22} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9}",
        "ms", "ours fwd", "ours bwd", "torch fwd", "torch bwd", "fwd ×", "bwd ×"
    );
    let ms = |v: f64| format!("{:.3}", v * 1e3);
    let ratio = |a: f64, b: f64| {
        if b > 0.0 {
            format!("{:.2}", a / b)
        } else {
            "-".into()
        }
    };
    for (name, (f, bw)) in &ours {
        let (tf, tb) = torch.get(*name).copied().unwrap_or((f64::NAN, f64::NAN));
        println!(
            "{name:<22} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9}",
            ms(*f),
            if *bw > 0.0 { ms(*bw) } else { "-".into() },
            ms(tf),
            if tb > 0.0 { ms(tb) } else { "-".into() },
            ratio(*f, tf),
            ratio(*bw, tb),
        );
    }
    println!("(× is ours over torch's time: above 1, we are slower)");
    Ok(())
}
