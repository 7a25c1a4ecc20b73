//! FullyShardedDataParallel: the same numbers as DistributedDataParallel on the same data, over
//! real processes on 127.0.0.1 (world 2 and 3) and thread ranks; shared and unused units; bad
//! input as typed errors.

mod common;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{
    embedding, linear, loss, AdamW, Embedding, Linear, Optimizer, ParamsAdamW, VarBuilder, VarMap,
};
use candle_parallel::distributed::{self, ProcessGroup};
use candle_parallel::fsdp::{self, FsdpConfig, Unit};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::nn::{layer_norm, LayerNorm};
use candle_parallel::optim::{Sgd, SgdConfig};
use candle_parallel::rng::Rng;
use candle_parallel::{DistributedDataParallel, Error, FullyShardedDataParallel};
use common::{done, is_child, join_child, Ranks};
use std::collections::HashMap;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(180);
const VOCAB: usize = 7;
const DIM: usize = 5;
const HIDDEN: usize = 13;
const SEQ: usize = 3;
const PER: usize = 4;
const STEPS: usize = 20;
const SEED: u64 = 11;

/// A pre-norm residual MLP block: `x + fc2(gelu(fc1(ln(x))))`; 158 parameters.
struct Block {
    ln: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

fn block(vb: VarBuilder) -> candle_core::Result<Block> {
    Ok(Block {
        ln: layer_norm(DIM, 1e-5, vb.pp("ln"))?,
        fc1: linear(DIM, HIDDEN, vb.pp("fc1"))?,
        fc2: linear(HIDDEN, DIM, vb.pp("fc2"))?,
    })
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = x.apply(&self.ln)?.apply(&self.fc1)?.gelu_erf()?;
        x + h.apply(&self.fc2)?
    }
}

/// A transformer-like model: an embedding and a head (the root, 77 parameters), and blocks in
/// between, each a unit. `uses` lists which block runs at each position (a block may run twice,
/// or not at all).
struct Model {
    emb: Embedding,
    blocks: Vec<Unit<Block>>,
    head: Linear,
    uses: Vec<usize>,
}

fn model(blocks: usize, uses: Vec<usize>) -> impl Fn(VarBuilder) -> candle_core::Result<Model> {
    move |vb: VarBuilder| {
        Ok(Model {
            emb: embedding(VOCAB, DIM, vb.pp("emb"))?,
            blocks: (0..blocks)
                .map(|i| fsdp::unit(vb.pp(format!("h.{i}")), block))
                .collect::<candle_core::Result<_>>()?,
            head: linear(DIM, VOCAB, vb.pp("head"))?,
            uses: uses.clone(),
        })
    }
}

impl Module for Model {
    fn forward(&self, tokens: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = tokens.apply(&self.emb)?;
        for &i in &self.uses {
            x = self.blocks[i].forward(&x)?;
        }
        x.apply(&self.head)
    }
}

/// Rank `rank`'s batch at `step`: tokens (PER, SEQ) and next tokens.
fn batch(step: usize, rank: usize) -> (Tensor, Tensor) {
    let mut rng = Rng::new(1000 * step as u64 + rank as u64);
    let t: Vec<u32> = (0..PER * (SEQ + 1))
        .map(|_| rng.below(VOCAB as u64) as u32)
        .collect();
    let t = Tensor::from_vec(t, (PER, SEQ + 1), &Device::Cpu).unwrap();
    (t.narrow(1, 0, SEQ).unwrap(), t.narrow(1, 1, SEQ).unwrap())
}

fn lm_loss(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    loss::cross_entropy(
        &logits.reshape((PER * SEQ, VOCAB))?,
        &targets.flatten_all()?,
    )
}

#[derive(Clone, Copy)]
enum Opt {
    Sgd,
    AdamW,
}

fn optimizer(
    opt: Opt,
    vars: Vec<candle_core::Var>,
) -> Box<dyn FnMut(&candle_core::backprop::GradStore)> {
    match opt {
        Opt::Sgd => {
            let config = SgdConfig {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.01,
                ..SgdConfig::default()
            };
            let mut o = Sgd::new(vars, config).unwrap();
            Box::new(move |g| o.step(g).unwrap())
        }
        Opt::AdamW => {
            let params = ParamsAdamW {
                lr: 0.01,
                ..ParamsAdamW::default()
            };
            let mut o = AdamW::new(vars, params).unwrap();
            Box::new(move |g| o.step(g).unwrap())
        }
    }
}

/// DDP training for `STEPS` steps; the final variables by name.
fn train_ddp(
    pg: &ProcessGroup,
    blocks: usize,
    uses: &[usize],
    opt: Opt,
) -> HashMap<String, Tensor> {
    let varmap = VarMap::new();
    let build = model(blocks, uses.to_vec());
    build(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu)).unwrap();
    let ddp = DistributedDataParallel::new(&varmap, pg, &Device::Cpu, build).unwrap();
    let mut step = optimizer(opt, ddp.parameters());
    for s in 0..STEPS {
        let (x, y) = batch(s, pg.rank());
        let l = lm_loss(&ddp.forward_t(&x, true).unwrap(), &y).unwrap();
        step(&ddp.backward(&l).unwrap());
    }
    ddp.parameter_names()
        .into_iter()
        .zip(ddp.parameters())
        .map(|(n, v)| (n, v.as_tensor().copy().unwrap()))
        .collect()
}

fn fsdp_model(
    pg: &ProcessGroup,
    blocks: usize,
    uses: &[usize],
) -> candle_parallel::Result<FullyShardedDataParallel<Model>> {
    fully_sharded(pg, model(blocks, uses.to_vec()))
}

/// `build` under FSDP on the CPU, initialised from `SEED` on rank 0.
fn fully_sharded<M, F>(
    pg: &ProcessGroup,
    build: F,
) -> candle_parallel::Result<FullyShardedDataParallel<M>>
where
    F: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
{
    let config = FsdpConfig {
        // Ranks other than 0 start elsewhere: FSDP must take rank 0's values.
        seed: Some(if pg.rank() == 0 { SEED } else { 99 }),
        ..FsdpConfig::default()
    };
    FullyShardedDataParallel::with_config(&VarMap::new(), pg, &Device::Cpu, config, build)
}

/// FSDP training for `STEPS` steps; the final (gathered) variables by name.
fn train_fsdp(
    pg: &ProcessGroup,
    blocks: usize,
    uses: &[usize],
    opt: Opt,
) -> HashMap<String, Tensor> {
    let f = fsdp_model(pg, blocks, uses).unwrap();
    let mut step = optimizer(opt, f.parameters());
    for s in 0..STEPS {
        let (x, y) = batch(s, pg.rank());
        let l = lm_loss(&f.forward_t(&x, true).unwrap(), &y).unwrap();
        step(&f.backward(&l).unwrap());
    }
    f.full_parameters().unwrap().into_iter().collect()
}

fn max_diff(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> f32 {
    let mut names: Vec<&String> = a.keys().collect();
    names.sort();
    let mut b_names: Vec<&String> = b.keys().collect();
    b_names.sort();
    assert_eq!(names, b_names);
    names
        .iter()
        .map(|n| common::max_abs_diff(&a[*n], &b[*n]))
        .fold(0.0, f32::max)
}

/// FSDP and DDP on the same data per rank, with two blocks and the root, both optimizers.
fn parity(pg: &ProcessGroup, uses: &[usize]) {
    for opt in [Opt::Sgd, Opt::AdamW] {
        let want = train_ddp(pg, 2, uses, opt);
        let got = train_fsdp(pg, 2, uses, opt);
        let d = max_diff(&got, &want);
        assert!(
            d <= 1e-5,
            "rank {}: FSDP differs from DDP by {d}",
            pg.rank()
        );
        // The weights moved: a parity of untrained models proves nothing.
        let init = VarMap::new();
        model(2, uses.to_vec())(seeded_var_builder(&init, SEED, DType::F32, &Device::Cpu)).unwrap();
        let start: HashMap<String, Tensor> = init
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
            .collect();
        assert!(max_diff(&got, &start) > 1e-2);
    }
}

#[test]
fn fsdp_over_2_and_3_processes_equals_ddp_after_20_steps() {
    if is_child() {
        parity(&join_child(), &[0, 1]);
        done();
        return;
    }
    for world in [2, 3] {
        Ranks::world(
            "fsdp_over_2_and_3_processes_equals_ddp_after_20_steps",
            world,
        )
        .assert_all_pass(LIMIT);
    }
}

#[test]
fn a_unit_used_twice_in_one_forward_gets_both_uses_gradients() {
    distributed::spawn_threads(2, |pg| {
        parity(&pg, &[0, 1, 0]);
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_unit_unused_on_every_rank_gets_no_gradient_and_stays_as_it_was() {
    distributed::spawn_threads(2, |pg| {
        // Block 1 is built and sharded, never run.
        let f = fsdp_model(&pg, 2, &[0]).unwrap();
        let params = f.parameters();
        let names = f.parameter_names();
        let unused = |name: &String| name.starts_with("h.1.");
        let before: Vec<Tensor> = params
            .iter()
            .map(|p| p.as_tensor().copy())
            .collect::<candle_core::Result<_>>()?;
        let (x, y) = batch(0, pg.rank());
        let grads = f.backward(&lm_loss(&f.forward_t(&x, true)?, &y)?)?;
        for (p, name) in params.iter().zip(&names) {
            assert_eq!(grads.get(p.as_tensor()).is_none(), unused(name), "{name}");
        }
        let mut opt = Sgd::new(
            params.clone(),
            SgdConfig {
                lr: 0.1,
                weight_decay: 0.1,
                ..Default::default()
            },
        )?;
        opt.step(&grads)?;
        for ((p, b), name) in params.iter().zip(&before).zip(&names) {
            let moved = common::max_abs_diff(b, p.as_tensor());
            assert_eq!(moved == 0.0, unused(name), "{name} moved by {moved}");
        }
        // And the used parts train as under DDP.
        parity(&pg, &[0]);
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_unit_run_on_one_rank_only_is_a_mismatch_on_every_rank() {
    let errors = distributed::spawn_threads(2, |pg| {
        let uses = if pg.rank() == 0 { vec![0, 1] } else { vec![0] };
        let f = fsdp_model(&pg, 2, &uses)?;
        let (x, y) = batch(0, pg.rank());
        let out = f
            .forward_t(&x, true)
            .and_then(|logits| Ok(lm_loss(&logits, &y)?))
            .and_then(|l| f.backward(&l));
        Ok(out.err().map(|e| e.to_string()))
    })
    .unwrap();
    for (rank, e) in errors.iter().enumerate() {
        let e = e.as_deref().unwrap_or_else(|| panic!("rank {rank} passed"));
        assert!(e.contains("collective mismatch"), "rank {rank}: {e}");
        assert!(e.contains("h.1") && e.contains("h.0"), "rank {rank}: {e}");
    }
}

/// A model whose constructor misuses units, one way per `case`.
fn bad(case: usize) -> impl Fn(VarBuilder) -> candle_core::Result<Vec<Unit<Linear>>> {
    move |vb: VarBuilder| match case {
        // A unit inside a unit.
        0 => Ok(vec![fsdp::unit(vb.pp("outer"), |vb| {
            fsdp::unit(vb.pp("inner"), |vb| linear(2, 2, vb))?;
            linear(2, 2, vb)
        })?]),
        // One variable in two units.
        1 => Ok(vec![
            fsdp::unit(vb.pp("a"), |vb| linear(2, 2, vb.root().pp("shared")))?,
            fsdp::unit(vb.pp("b"), |vb| linear(2, 2, vb.root().pp("shared")))?,
        ]),
        // A unit without variables.
        _ => Ok(vec![fsdp::unit(vb.pp("empty"), |_| {
            Ok(Linear::new(
                Tensor::zeros((2, 2), DType::F32, &Device::Cpu)?,
                None,
            ))
        })?]),
    }
}

#[test]
fn misused_units_and_a_backward_without_forward_are_typed_errors() {
    distributed::spawn_threads(2, |pg| {
        let expect = [
            ("outer", "units do not nest"),
            ("b", "belongs to `a` too"),
            ("empty", "asked for no parameters"),
        ];
        for (case, (unit, text)) in expect.iter().enumerate() {
            match FullyShardedDataParallel::new(&VarMap::new(), &pg, &Device::Cpu, bad(case)) {
                Err(Error::FsdpUnit { unit: u, detail }) => {
                    assert!(u.contains(unit) && detail.contains(text), "{u}: {detail}")
                }
                Err(e) => panic!("case {case}: {e}"),
                Ok(_) => panic!("case {case} passed"),
            }
        }
        let f = fsdp_model(&pg, 2, &[0, 1])?;
        let l = Tensor::zeros((), DType::F32, &Device::Cpu)?;
        assert!(matches!(
            f.backward(&l),
            Err(Error::FsdpBackwardWithoutForward)
        ));
        Ok(())
    })
    .unwrap();
}

#[test]
fn ranks_that_build_different_models_get_an_error_naming_the_variable() {
    let errors = distributed::spawn_threads(2, |pg| {
        let blocks = 2 + pg.rank();
        Ok(fsdp_model(&pg, blocks, &[0]).err().map(|e| e.to_string()))
    })
    .unwrap();
    for e in errors {
        let e = e.expect("an error");
        assert!(
            e.contains("models differ") && e.contains("before FullyShardedDataParallel can"),
            "{e}"
        );
    }
}

/// A block whose output is a view of its last product: the second half of `fc(x)` along the
/// last dimension (a GLU's split, one part of a packed projection).
struct Half(Linear);

impl Module for Half {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.0.forward(x)?.narrow(2, DIM, DIM)
    }
}

struct Halves {
    emb: Embedding,
    blocks: Vec<Unit<Half>>,
    head: Linear,
}

impl Module for Halves {
    fn forward(&self, tokens: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = tokens.apply(&self.emb)?;
        for b in &self.blocks {
            x = b.forward(&x)?;
        }
        x.apply(&self.head)
    }
}

fn halves(vb: VarBuilder) -> candle_core::Result<Halves> {
    Ok(Halves {
        emb: embedding(VOCAB, DIM, vb.pp("emb"))?,
        blocks: (0..2)
            .map(|i| {
                fsdp::unit(vb.pp(format!("h.{i}")), |vb| {
                    Ok(Half(linear(DIM, 2 * DIM, vb)?))
                })
            })
            .collect::<candle_core::Result<_>>()?,
        head: linear(DIM, VOCAB, vb.pp("head"))?,
    })
}

#[test]
fn units_whose_output_is_a_view_train_as_ddp_does() {
    // A unit's output enters the graph through an op that hands a compact tensor on: a view
    // (here a narrow along the last dimension) was refused ("pass-through op given a view").
    distributed::spawn_threads(2, |pg| {
        let varmap = VarMap::new();
        halves(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu))?;
        let ddp = DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, halves)?;
        let f = fully_sharded(&pg, halves)?;
        let mut ddp_step = optimizer(Opt::Sgd, ddp.parameters());
        let mut fsdp_step = optimizer(Opt::Sgd, f.parameters());
        for s in 0..5 {
            let (x, y) = batch(s, pg.rank());
            ddp_step(&ddp.backward(&lm_loss(&ddp.forward_t(&x, true)?, &y)?)?);
            fsdp_step(&f.backward(&lm_loss(&f.forward_t(&x, true)?, &y)?)?);
        }
        let want: HashMap<String, Tensor> = ddp
            .parameter_names()
            .into_iter()
            .zip(ddp.parameters())
            .map(|(n, v)| (n, v.as_tensor().copy().unwrap()))
            .collect();
        let got: HashMap<String, Tensor> = f.full_parameters()?.into_iter().collect();
        let d = max_diff(&want, &got);
        assert!(d < 1e-5, "{d}");
        Ok(())
    })
    .unwrap();
}

#[test]
fn evaluation_forwards_equal_the_unsharded_model_and_keep_nothing() {
    distributed::spawn_threads(3, |pg| {
        let f = fsdp_model(&pg, 2, &[0, 1])?;
        let varmap = VarMap::new();
        let plain =
            model(2, vec![0, 1])(seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu))?;
        let (x, _) = batch(3, pg.rank());
        let d = common::max_abs_diff(&f.forward_t(&x, false)?, &plain.forward(&x)?);
        assert!(d < 1e-6, "{d}");
        // Nothing kept for a backward.
        let l = Tensor::zeros((), DType::F32, &Device::Cpu)?;
        assert!(matches!(
            f.backward(&l),
            Err(Error::FsdpBackwardWithoutForward)
        ));
        // Each rank holds a third of each parameter (rounded up): units of 158 over 3 ranks
        // are within one element per parameter of 53 each, the root's 77 of 26.
        let numel = |name: &String| varmap.data().lock().unwrap()[name].elem_count();
        let mut held = vec![0; f.variable_names().len()];
        let mut piece = 0;
        let params = f.parameters();
        for (unit, names) in f.variable_names().iter().enumerate() {
            for name in names {
                let size = params[piece].elem_count();
                assert_eq!(size, numel(name).div_ceil(3), "{name}");
                held[unit] += size;
                piece += 1;
            }
        }
        assert_eq!(piece, params.len());
        let whole = [158, 158, 77];
        for ((&h, &w), names) in held.iter().zip(&whole).zip(f.variable_names()) {
            assert!(h * 3 >= w && h * 3 < w + 3 * names.len(), "{h} of {w}");
        }
        Ok(())
    })
    .unwrap();
}
