//! Tensor parallel training against one process: a replicated layer, then an MLP block (a
//! column-parallel layer, GELU, a row-parallel layer) cut over 2 and 4 ranks in threads and over 2 real processes trains for
//! 20 steps as the uncut block does in one process, within 1e-5, each rank's slices of the
//! weights and the losses; bad splits are errors naming both numbers.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{linear, Linear, Module, Optimizer, VarBuilder, VarMap};
use candle_parallel::distributed::{self, ProcessGroup};
use candle_parallel::init::seeded_var_builder;
use candle_parallel::nn::ops::gelu_erf;
use candle_parallel::optim::{Sgd, SgdConfig};
use candle_parallel::tensor_parallel::{shard_linear, ColumnParallelLinear, RowParallelLinear};
use common::{done, is_child, join_child, Ranks};
use std::time::Duration;

const IN: usize = 8;
const HIDDEN: usize = 32;
const STEPS: usize = 20;
const SEED: u64 = 5;
const SGD: SgdConfig = SgdConfig {
    lr: 0.05,
    momentum: 0.9,
    dampening: 0.0,
    weight_decay: 0.01,
    nesterov: false,
    maximize: false,
};

/// Step `step`'s batch: 6 rows of inputs and targets, the same on every rank.
fn batch(step: usize) -> (Tensor, Tensor) {
    let mut rng = candle_parallel::rng::Rng::new(100 + step as u64);
    let mut values = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.normal() as f32).collect() };
    let x = Tensor::from_vec(values(6 * IN), (6, IN), &Device::Cpu).unwrap();
    let y = Tensor::from_vec(values(6 * IN), (6, IN), &Device::Cpu).unwrap();
    (x, y)
}

/// The uncut model's layers, initialised by the seed: `fc0` (kept whole on every rank: its
/// gradient needs the input gradients of the column layer summed over the group), `fc1`, `fc2`.
fn full_layers(varmap: &VarMap) -> (Linear, Linear, Linear) {
    let vb = seeded_var_builder(varmap, SEED, DType::F32, &Device::Cpu);
    (
        linear(IN, IN, vb.pp("fc0")).unwrap(),
        linear(IN, HIDDEN, vb.pp("fc1")).unwrap(),
        linear(HIDDEN, IN, vb.pp("fc2")).unwrap(),
    )
}

fn mse(out: &Tensor, y: &Tensor) -> Tensor {
    (out - y).unwrap().sqr().unwrap().mean_all().unwrap()
}

/// One process: the final layers and the losses.
fn one_process() -> ((Linear, Linear, Linear), Vec<f32>) {
    let varmap = VarMap::new();
    let (fc0, fc1, fc2) = full_layers(&varmap);
    let mut opt = Sgd::new(varmap.all_vars(), SGD).unwrap();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch(step);
        let x = fc0.forward(&x).unwrap().relu().unwrap();
        let h = gelu_erf(&fc1.forward(&x).unwrap()).unwrap();
        let loss = mse(&fc2.forward(&h).unwrap(), &y);
        losses.push(loss.to_scalar::<f32>().unwrap());
        opt.backward_step(&loss).unwrap();
    }
    ((fc0, fc1, fc2), losses)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// This rank's parts of the MLP model's layers, by name: `fc0` whole, `fc1` cut by rows,
/// `fc2` by columns.
fn mlp_parts(layers: &(Linear, Linear, Linear), tp: &ProcessGroup) -> Vec<(String, Tensor)> {
    let (fc0, fc1, fc2) = layers;
    let (w1, b1) = shard_linear(fc1.weight(), fc1.bias(), tp, true).unwrap();
    let (w2, b2) = shard_linear(fc2.weight(), fc2.bias(), tp, false).unwrap();
    vec![
        ("fc0.weight".into(), fc0.weight().clone()),
        ("fc0.bias".into(), fc0.bias().unwrap().clone()),
        ("fc1.weight".into(), w1),
        ("fc1.bias".into(), b1.unwrap()),
        ("fc2.weight".into(), w2),
        ("fc2.bias".into(), b2.unwrap()),
    ]
}

/// A VarMap holding `parts` as variables, under their names.
fn varmap_of(parts: Vec<(String, Tensor)>) -> VarMap {
    let varmap = VarMap::new();
    for (name, t) in parts {
        let var = Var::from_tensor(&t).unwrap();
        varmap.data().lock().unwrap().insert(name, var);
    }
    varmap
}

/// Asserts this rank trained as one process: its `losses` within 1e-5 of `want`, and its
/// variables within 1e-5 of `parts` (one process's final weights, cut as this rank holds them).
fn assert_as_one_process(
    tp: &ProcessGroup,
    losses: &[f32],
    want: &[f32],
    varmap: &VarMap,
    parts: Vec<(String, Tensor)>,
) {
    for (step, (a, b)) in losses.iter().zip(want).enumerate() {
        assert!((a - b).abs() < 1e-5, "step {step}: loss {a} against {b}");
    }
    let data = varmap.data().lock().unwrap();
    for (name, want) in parts {
        let d = max_diff(data[&name].as_tensor(), &want);
        assert!(
            d < 1e-5,
            "rank {}: {name} is {d} off one process",
            tp.rank()
        );
    }
}

/// This rank's part of the block, cut from the uncut block's initial weights, trained for
/// [`STEPS`] steps and compared with one process.
fn train_and_compare(tp: &ProcessGroup) {
    let full = VarMap::new();
    let varmap = varmap_of(mlp_parts(&full_layers(&full), tp));
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let fc0 = linear(IN, IN, vb.pp("fc0")).unwrap();
    let col = ColumnParallelLinear::new(IN, HIDDEN, vb.pp("fc1"), tp).unwrap();
    let row = RowParallelLinear::new(HIDDEN, IN, vb.pp("fc2"), tp).unwrap();
    assert_eq!(col.weight().dims(), [HIDDEN / tp.world_size(), IN]);
    assert_eq!(row.weight().dims(), [IN, HIDDEN / tp.world_size()]);
    let mut opt = Sgd::new(varmap.all_vars(), SGD).unwrap();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch(step);
        let x = fc0.forward(&x).unwrap().relu().unwrap();
        let h = gelu_erf(&col.forward(&x).unwrap()).unwrap();
        let loss = mse(&row.forward(&h).unwrap(), &y);
        losses.push(loss.to_scalar::<f32>().unwrap());
        opt.backward_step(&loss).unwrap();
    }
    let (layers, want) = one_process();
    assert_as_one_process(tp, &losses, &want, &varmap, mlp_parts(&layers, tp));
}

/// The block's output and the input's gradient for `x` (a view of a batch), by the uncut
/// layers in one process and by the cut ones on each of 2 thread ranks.
#[test]
fn a_column_parallel_layer_given_a_view_of_a_batch_computes_as_one_process() {
    // Observed before the fix: a batch's rows at an offset (a data-parallel replica's share)
    // failed in `copy_to` with "pass-through op given a view": its `contiguous()` keeps a
    // narrow of whole rows as it is, and the op's forward refused any layout but a compact one.
    type View = fn(&Tensor) -> Tensor;
    let views: [(&str, View); 3] = [
        ("rows 3.. (offset 24)", |b| b.narrow(0, 3, 3).unwrap()),
        ("columns 2..", |b| b.narrow(1, 2, IN).unwrap()),
        ("a transpose", |b| {
            b.t().unwrap().contiguous().unwrap().t().unwrap()
        }),
    ];
    for (what, view) in views {
        let base = |wide: bool| {
            let (x, _) = batch(0);
            match wide {
                // Two more columns in front, for the column view.
                true => Tensor::cat(&[&x.narrow(1, 0, 2).unwrap(), &x], 1).unwrap(),
                false => x,
            }
        };
        let wide = what.starts_with("columns");
        let run = |x: &Tensor, fc1: &dyn Fn(&Tensor) -> Tensor, fc2: &dyn Fn(&Tensor) -> Tensor| {
            let x = Var::from_tensor(x).unwrap();
            let out = fc2(&gelu_erf(&fc1(&view(x.as_tensor()))).unwrap());
            let grads = out.sqr().unwrap().sum_all().unwrap().backward().unwrap();
            (out, grads.get(x.as_tensor()).unwrap().clone())
        };
        let (_, fc1, fc2) = full_layers(&VarMap::new());
        let (want_out, want_grad) = run(&base(wide), &|x| fc1.forward(x).unwrap(), &|h| {
            fc2.forward(h).unwrap()
        });
        distributed::spawn_threads(2, move |tp| {
            let layers = full_layers(&VarMap::new());
            let varmap = varmap_of(mlp_parts(&layers, &tp));
            let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
            let col = ColumnParallelLinear::new(IN, HIDDEN, vb.pp("fc1"), &tp)?;
            let row = RowParallelLinear::new(HIDDEN, IN, vb.pp("fc2"), &tp)?;
            let (out, grad) = run(
                &base(wide),
                &|x| col.forward(x).unwrap_or_else(|e| panic!("{what}: {e}")),
                &|h| row.forward(h).unwrap(),
            );
            let (d_out, d_grad) = (max_diff(&out, &want_out), max_diff(&grad, &want_grad));
            assert!(d_out < 1e-5 && d_grad < 1e-5, "{what}: {d_out}, {d_grad}");
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn an_mlp_cut_over_2_and_4_threads_trains_as_one_process() {
    for ranks in [2, 4] {
        distributed::spawn_threads(ranks, |tp| {
            train_and_compare(&tp);
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn an_mlp_cut_over_2_processes_trains_as_one_process() {
    if is_child() {
        let tp = join_child();
        train_and_compare(&tp);
        return done();
    }
    Ranks::world("an_mlp_cut_over_2_processes_trains_as_one_process", 2)
        .assert_all_pass(Duration::from_secs(120));
}

#[test]
fn sizes_the_group_cannot_share_are_errors_naming_both_numbers() {
    let errors = distributed::spawn_threads(3, |tp| {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let column = ColumnParallelLinear::new(IN, 32, vb.pp("a"), &tp).unwrap_err();
        let row = RowParallelLinear::new(32, IN, vb.pp("b"), &tp).unwrap_err();
        let vocab =
            candle_parallel::tensor_parallel::VocabParallelEmbedding::new(10, IN, vb.pp("c"), &tp)
                .unwrap_err();
        Ok((column.to_string(), row.to_string(), vocab.to_string()))
    })
    .unwrap();
    for (column, row, vocab) in errors {
        assert!(
            vocab.contains("10 tokens") && vocab.contains("3 tensor-parallel"),
            "{vocab}"
        );
        assert!(
            column.contains("output size is 32") && column.contains('3'),
            "{column}"
        );
        assert!(
            row.contains("input size is 32") && row.contains('3'),
            "{row}"
        );
    }
}

const DIM: usize = 16;
const HEADS: usize = 4;
const TIME: usize = 5;

/// Step `step`'s sequences: 3 of [`TIME`] positions, [`DIM`] wide, and their targets.
fn sequences(step: usize) -> (Tensor, Tensor) {
    let (x, y) = (batch(1000 + step).0, batch(2000 + step).0);
    let take = |t: Tensor| {
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        let mut v = v.repeat(6);
        v.truncate(3 * TIME * DIM);
        Tensor::from_vec(v, (3, TIME, DIM), &Device::Cpu).unwrap()
    };
    (take(x), take(y))
}

/// The uncut attention block's layers: the packed projection and the output projection.
fn full_attention(varmap: &VarMap) -> (Linear, Linear) {
    let vb = seeded_var_builder(varmap, SEED + 1, DType::F32, &Device::Cpu);
    (
        linear(DIM, 3 * DIM, vb.pp("attn.qkv")).unwrap(),
        linear(DIM, DIM, vb.pp("attn.proj")).unwrap(),
    )
}

/// `x + attention(x)`, uncut, trained for [`STEPS`] steps: the final layers and the losses.
fn attention_one_process() -> ((Linear, Linear), Vec<f32>) {
    use candle_parallel::nn::attention::causal_attention;
    let varmap = VarMap::new();
    let (qkv, proj) = full_attention(&varmap);
    let mut opt = Sgd::new(varmap.all_vars(), SGD).unwrap();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = sequences(step);
        let a = causal_attention(&qkv.forward(&x).unwrap(), HEADS).unwrap();
        let out = (&x + proj.forward(&a).unwrap()).unwrap();
        let loss = mse(&out, &y);
        losses.push(loss.to_scalar::<f32>().unwrap());
        opt.backward_step(&loss).unwrap();
    }
    ((qkv, proj), losses)
}

/// `x + attention(x)` with the heads split over `tp`, from the uncut block's weights, against
/// one process.
fn attention_against_one_process(tp: &ProcessGroup) {
    use candle_parallel::tensor_parallel::{shard_qkv, ParallelAttention};
    let full = VarMap::new();
    let (qkv, proj) = full_attention(&full);
    let cut = |qkv: &Linear, proj: &Linear| -> Vec<(String, Tensor)> {
        let (w, b) = shard_qkv(qkv.weight(), qkv.bias(), HEADS, tp).unwrap();
        let (pw, pb) = shard_linear(proj.weight(), proj.bias(), tp, false).unwrap();
        vec![
            ("attn.qkv.weight".into(), w),
            ("attn.qkv.bias".into(), b.unwrap()),
            ("attn.proj.weight".into(), pw),
            ("attn.proj.bias".into(), pb.unwrap()),
        ]
    };
    let varmap = varmap_of(cut(&qkv, &proj));
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let attn = ParallelAttention::new(DIM, HEADS, vb.pp("attn"), tp).unwrap();
    assert_eq!(attn.local_heads(), HEADS / tp.world_size());
    let mut opt = Sgd::new(varmap.all_vars(), SGD).unwrap();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = sequences(step);
        let out = (&x + attn.forward(&x).unwrap()).unwrap();
        let loss = mse(&out, &y);
        losses.push(loss.to_scalar::<f32>().unwrap());
        opt.backward_step(&loss).unwrap();
    }
    let ((qkv, proj), want) = attention_one_process();
    assert_as_one_process(tp, &losses, &want, &varmap, cut(&qkv, &proj));
}

#[test]
fn attention_with_its_heads_over_2_and_4_threads_trains_as_one_process() {
    for ranks in [2, 4] {
        distributed::spawn_threads(ranks, |tp| {
            attention_against_one_process(&tp);
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn attention_with_its_heads_over_2_processes_trains_as_one_process() {
    if is_child() {
        let tp = join_child();
        attention_against_one_process(&tp);
        return done();
    }
    Ranks::world(
        "attention_with_its_heads_over_2_processes_trains_as_one_process",
        2,
    )
    .assert_all_pass(Duration::from_secs(120));
}

#[test]
fn heads_the_group_cannot_share_are_an_error_naming_both_numbers() {
    use candle_parallel::tensor_parallel::ParallelAttention;
    let errors = distributed::spawn_threads(3, |tp| {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        Ok(ParallelAttention::new(12, 4, vb, &tp)
            .unwrap_err()
            .to_string())
    })
    .unwrap();
    for e in errors {
        assert!(
            e.contains("4 heads") && e.contains("3 tensor-parallel ranks"),
            "{e}"
        );
    }
}

const VOCAB: usize = 12;

/// Step `step`'s 10 token ids and their targets, over the whole vocabulary.
fn tokens(step: usize) -> (Tensor, Tensor) {
    let mut rng = candle_parallel::rng::Rng::new(300 + step as u64);
    let mut ids = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| (rng.normal().abs() * 1e6) as u32 % VOCAB as u32)
            .collect()
    };
    let x = Tensor::from_vec(ids(10), 10, &Device::Cpu).unwrap();
    let y = Tensor::from_vec(ids(10), 10, &Device::Cpu).unwrap();
    (x, y)
}

/// The uncut embedding and output layer.
fn full_vocab_layers(varmap: &VarMap) -> (candle_nn::Embedding, Linear) {
    let vb = seeded_var_builder(varmap, SEED + 2, DType::F32, &Device::Cpu);
    (
        candle_nn::embedding(VOCAB, IN, vb.pp("emb")).unwrap(),
        linear(IN, VOCAB, vb.pp("head")).unwrap(),
    )
}

fn vocab_one_process() -> ((candle_nn::Embedding, Linear), Vec<f32>) {
    let varmap = VarMap::new();
    let (emb, head) = full_vocab_layers(&varmap);
    let mut opt = Sgd::new(varmap.all_vars(), SGD).unwrap();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = tokens(step);
        let logits = head.forward(&emb.forward(&x).unwrap()).unwrap();
        let loss = candle_nn::loss::cross_entropy(&logits, &y).unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap());
        opt.backward_step(&loss).unwrap();
    }
    ((emb, head), losses)
}

/// A vocabulary-parallel embedding, a column-parallel output layer (its logits never
/// gathered) and the vocabulary-parallel cross-entropy, against one process.
fn vocab_against_one_process(tp: &ProcessGroup) {
    use candle_parallel::tensor_parallel::{vocab_parallel_cross_entropy, VocabParallelEmbedding};
    let full = VarMap::new();
    let (emb, head) = full_vocab_layers(&full);
    let per = VOCAB / tp.world_size();
    let cut = |emb: &candle_nn::Embedding, head: &Linear| -> Vec<(String, Tensor)> {
        let rows = emb.embeddings().narrow(0, tp.rank() * per, per).unwrap();
        let (w, b) = shard_linear(head.weight(), head.bias(), tp, true).unwrap();
        vec![
            ("emb.weight".into(), rows.contiguous().unwrap()),
            ("head.weight".into(), w),
            ("head.bias".into(), b.unwrap()),
        ]
    };
    let varmap = varmap_of(cut(&emb, &head));
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let emb_tp = VocabParallelEmbedding::new(VOCAB, IN, vb.pp("emb"), tp).unwrap();
    let head_tp = ColumnParallelLinear::new(IN, VOCAB, vb.pp("head"), tp).unwrap();
    let mut opt = Sgd::new(varmap.all_vars(), SGD).unwrap();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = tokens(step);
        let logits = head_tp.forward(&emb_tp.forward(&x).unwrap()).unwrap();
        assert_eq!(logits.dims(), [10, per]);
        let loss = vocab_parallel_cross_entropy(&logits, &y, tp).unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap());
        opt.backward_step(&loss).unwrap();
    }
    let ((emb, head), want) = vocab_one_process();
    assert_as_one_process(tp, &losses, &want, &varmap, cut(&emb, &head));
}

#[test]
fn a_vocabulary_split_over_2_and_4_threads_trains_as_one_process() {
    for ranks in [2, 4] {
        distributed::spawn_threads(ranks, |tp| {
            vocab_against_one_process(&tp);
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn a_vocabulary_split_over_2_processes_trains_as_one_process() {
    if is_child() {
        let tp = join_child();
        vocab_against_one_process(&tp);
        return done();
    }
    Ranks::world(
        "a_vocabulary_split_over_2_processes_trains_as_one_process",
        2,
    )
    .assert_all_pass(Duration::from_secs(120));
}

/// Step `step`'s sequences for the sequence-parallel block: 3 of 8 positions, [`IN`] wide.
fn long_sequences(step: usize) -> (Tensor, Tensor) {
    let (x, y) = (batch(4000 + step).0, batch(5000 + step).0);
    let take = |t: Tensor| {
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        let mut v = v.repeat(4);
        v.truncate(3 * 8 * IN);
        Tensor::from_vec(v, (3, 8, IN), &Device::Cpu).unwrap()
    };
    (take(x), take(y))
}

/// `x + fc2(gelu(fc1(ln(x))))` uncut: the final weights (the norm's, fc1's, fc2's) and losses.
fn sp_one_process() -> (VarMap, Vec<f32>) {
    let varmap = VarMap::new();
    let vb = seeded_var_builder(&varmap, SEED + 3, DType::F32, &Device::Cpu);
    let ln = candle_parallel::nn::layer_norm(IN, 1e-5, vb.pp("ln")).unwrap();
    let (fc1, fc2) = (
        linear(IN, HIDDEN, vb.pp("fc1")).unwrap(),
        linear(HIDDEN, IN, vb.pp("fc2")).unwrap(),
    );
    let mut opt = Sgd::new(varmap.all_vars(), SGD).unwrap();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = long_sequences(step);
        let h = gelu_erf(&fc1.forward(&ln.forward(&x).unwrap()).unwrap()).unwrap();
        let out = (&x + fc2.forward(&h).unwrap()).unwrap();
        let loss = mse(&out, &y);
        losses.push(loss.to_scalar::<f32>().unwrap());
        opt.backward_step(&loss).unwrap();
    }
    (varmap, losses)
}

/// The same block with tensor and sequence parallelism: each rank holds its positions of the
/// sequence through the norm and the residual, the linears cut as before; the gradients of the
/// norm and of the row layer's bias are summed over the group.
fn sp_against_one_process(tp: &ProcessGroup) {
    use candle_parallel::tensor_parallel::sum_sequence_parallel_gradients;
    let full = VarMap::new();
    {
        let vb = seeded_var_builder(&full, SEED + 3, DType::F32, &Device::Cpu);
        candle_parallel::nn::layer_norm(IN, 1e-5, vb.pp("ln")).unwrap();
        linear(IN, HIDDEN, vb.pp("fc1")).unwrap();
        linear(HIDDEN, IN, vb.pp("fc2")).unwrap();
    }
    let cut = |full: &VarMap| -> Vec<(String, Tensor)> {
        let data = full.data().lock().unwrap();
        let t = |n: &str| data[n].as_tensor().clone();
        let (w1, b1) = shard_linear(&t("fc1.weight"), Some(&t("fc1.bias")), tp, true).unwrap();
        let (w2, b2) = shard_linear(&t("fc2.weight"), Some(&t("fc2.bias")), tp, false).unwrap();
        vec![
            ("ln.weight".into(), t("ln.weight")),
            ("ln.bias".into(), t("ln.bias")),
            ("fc1.weight".into(), w1),
            ("fc1.bias".into(), b1.unwrap()),
            ("fc2.weight".into(), w2),
            ("fc2.bias".into(), b2.unwrap()),
        ]
    };
    let varmap = varmap_of(cut(&full));
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let ln = candle_parallel::nn::layer_norm(IN, 1e-5, vb.pp("ln")).unwrap();
    let col = ColumnParallelLinear::new(IN, HIDDEN, vb.pp("fc1"), tp)
        .unwrap()
        .sequence_parallel(true);
    let row = RowParallelLinear::new(HIDDEN, IN, vb.pp("fc2"), tp)
        .unwrap()
        .sequence_parallel(true);
    let norm_params: Vec<Var> = {
        let data = varmap.data().lock().unwrap();
        // The norm's parameters, and the row layer's bias, added on each rank's positions.
        vec![
            data["ln.weight"].clone(),
            data["ln.bias"].clone(),
            data["fc2.bias"].clone(),
        ]
    };
    let mut opt = Sgd::new(varmap.all_vars(), SGD).unwrap();
    let per = 8 / tp.world_size();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = long_sequences(step);
        let (x, y) = (
            x.narrow(1, tp.rank() * per, per).unwrap(),
            y.narrow(1, tp.rank() * per, per).unwrap(),
        );
        let h = gelu_erf(&col.forward(&ln.forward(&x).unwrap()).unwrap()).unwrap();
        let out = (&x + row.forward(&h).unwrap()).unwrap();
        assert_eq!(out.dims(), [3, per, IN]);
        // This rank's share of the mean over every position.
        let loss =
            ((&out - &y).unwrap().sqr().unwrap().sum_all().unwrap() / (3 * 8 * IN) as f64).unwrap();
        let whole = tp
            .all_reduce(&loss, candle_parallel::distributed::ReduceOp::Sum)
            .unwrap();
        losses.push(whole.to_scalar::<f32>().unwrap());
        let mut grads = loss.backward().unwrap();
        sum_sequence_parallel_gradients(&mut grads, &norm_params, tp).unwrap();
        opt.step(&grads).unwrap();
    }
    let (want_vars, want) = sp_one_process();
    assert_as_one_process(tp, &losses, &want, &varmap, cut(&want_vars));
}

#[test]
fn sequence_parallel_over_2_and_4_threads_trains_as_one_process() {
    for ranks in [2, 4] {
        distributed::spawn_threads(ranks, |tp| {
            sp_against_one_process(&tp);
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn sequence_parallel_over_2_processes_trains_as_one_process() {
    if is_child() {
        let tp = join_child();
        sp_against_one_process(&tp);
        return done();
    }
    Ranks::world(
        "sequence_parallel_over_2_processes_trains_as_one_process",
        2,
    )
    .assert_all_pass(Duration::from_secs(120));
}

/// [`train_and_compare`]'s model on a [dp 2, tp 2] mesh over 4 processes: each tensor-parallel
/// pair trains on half of every batch, and the replicas average their gradients along "dp"
/// (`pipeline::all_reduce_gradients`) before the step; every rank ends as the uncut model
/// trained in one process on the whole batches, within 1e-5.
#[test]
fn dp_2_by_tp_2_over_4_processes_trains_as_one_process() {
    use candle_parallel::distributed::DeviceMesh;
    use candle_parallel::pipeline::all_reduce_gradients;
    if is_child() {
        let world = join_child();
        let mesh = DeviceMesh::new(&world, &[("dp", 2), ("tp", 2)]).unwrap();
        let (dp, tp) = (mesh.get_group("dp").unwrap(), mesh.get_group("tp").unwrap());
        let full = VarMap::new();
        let parts = mlp_parts(&full_layers(&full), tp);
        let names: Vec<String> = parts.iter().map(|(n, _)| n.clone()).collect();
        let varmap = varmap_of(parts);
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let fc0 = linear(IN, IN, vb.pp("fc0")).unwrap();
        let col = ColumnParallelLinear::new(IN, HIDDEN, vb.pp("fc1"), tp).unwrap();
        let row = RowParallelLinear::new(HIDDEN, IN, vb.pp("fc2"), tp).unwrap();
        // Every parameter in one order on every rank, for the average along "dp".
        let params: Vec<Var> = {
            let data = varmap.data().lock().unwrap();
            names.iter().map(|n| data[n].clone()).collect()
        };
        let mut opt = Sgd::new(params.clone(), SGD).unwrap();
        for step in 0..STEPS {
            let (x, y) = batch(step);
            // This replica's half of the rows.
            let (x, y) = (
                x.narrow(0, 3 * dp.rank(), 3).unwrap(),
                y.narrow(0, 3 * dp.rank(), 3).unwrap(),
            );
            let x = fc0.forward(&x).unwrap().relu().unwrap();
            let h = gelu_erf(&col.forward(&x).unwrap()).unwrap();
            let loss = mse(&row.forward(&h).unwrap(), &y);
            let mut grads = loss.backward().unwrap();
            all_reduce_gradients(&mut grads, &params, dp).unwrap();
            opt.step(&grads).unwrap();
        }
        // Each replica's losses are of its half of the rows: only the weights compare.
        let (layers, _) = one_process();
        assert_as_one_process(tp, &[], &[], &varmap, mlp_parts(&layers, tp));
        return done();
    }
    Ranks::world("dp_2_by_tp_2_over_4_processes_trains_as_one_process", 4)
        .assert_all_pass(Duration::from_secs(120));
}

/// The elements one training step of a block `x -> row(gelu(col(ln(x))))` puts into the
/// tensor-parallel collectives, with or without sequence parallel, in this process.
fn one_step_volume(
    tp: &ProcessGroup,
    sequence_parallel: bool,
) -> candle_parallel::tensor_parallel::Volume {
    use candle_parallel::tensor_parallel::{reset_volume, volume};
    let varmap = VarMap::new();
    let vb = seeded_var_builder(&varmap, SEED, DType::F32, &Device::Cpu);
    let ln = candle_parallel::nn::layer_norm(IN, 1e-5, vb.pp("ln")).unwrap();
    let col = ColumnParallelLinear::new(IN, HIDDEN, vb.pp("fc1"), tp)
        .unwrap()
        .sequence_parallel(sequence_parallel);
    let row = RowParallelLinear::new(HIDDEN, IN, vb.pp("fc2"), tp)
        .unwrap()
        .sequence_parallel(sequence_parallel);
    let (x, _) = long_sequences(0);
    let per = 8 / tp.world_size();
    let x = match sequence_parallel {
        true => x.narrow(1, tp.rank() * per, per).unwrap(),
        false => x,
    };
    reset_volume();
    let h = gelu_erf(&col.forward(&ln.forward(&x).unwrap()).unwrap()).unwrap();
    let out = row.forward(&h).unwrap();
    out.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    volume()
}

/// Megatron's count for one block (a column layer feeding a row layer) over activations of
/// `b * s * h` elements: without sequence parallel, an all-reduce of `b s h` forward and one
/// backward; with it, an all-gather of `b s h / tp` per rank and a reduce-scatter of `b s h`
/// forward, and the same backward: on a ring, the same bytes per rank as the two all-reduces.
#[test]
fn the_collectives_move_megatrons_volume_with_and_without_sequence_parallel() {
    if is_child() {
        let tp = join_child();
        let n = (3 * 8 * IN) as u64; // b * s * h
        let t = tp.world_size() as u64;
        let plain = one_step_volume(&tp, false);
        assert_eq!(
            (plain.all_reduce, plain.all_gather, plain.reduce_scatter),
            (2 * n, 0, 0)
        );
        let sp = one_step_volume(&tp, true);
        assert_eq!(
            (sp.all_reduce, sp.all_gather, sp.reduce_scatter),
            (0, 2 * n / t, 2 * n)
        );
        // Bytes on a ring per rank: all-reduce 2 (t-1)/t n, all-gather (t-1) m, reduce-scatter
        // (t-1)/t n (times t to stay in integers).
        let ring = |v: candle_parallel::tensor_parallel::Volume| {
            2 * (t - 1) * v.all_reduce + t * (t - 1) * v.all_gather + (t - 1) * v.reduce_scatter
        };
        assert_eq!(ring(plain), ring(sp));
        return done();
    }
    Ranks::world(
        "the_collectives_move_megatrons_volume_with_and_without_sequence_parallel",
        2,
    )
    .assert_all_pass(Duration::from_secs(120));
}

/// A plan's parts are what the layers' own helpers cut, and put back together they are the
/// whole weights, over 2 and 4 threads; a size the group cannot share names the variable.
#[test]
fn a_plan_cuts_a_model_as_its_layers_do_and_puts_the_parts_back_together() {
    use candle_parallel::tensor_parallel::{shard_qkv, ParallelPlan, ParallelStyle};
    let plan = ParallelPlan::new()
        .layer("h.*.qkv", ParallelStyle::PackedQkv)
        .layer("h.*.fc1", ParallelStyle::Colwise)
        .layer("h.*.fc2", ParallelStyle::Rowwise)
        .layer("emb", ParallelStyle::VocabEmbedding);
    let randn = |shape: &[usize]| Tensor::randn(0f32, 1., shape, &Device::Cpu).unwrap();
    let whole: Vec<(String, Tensor)> = [
        ("h.0.qkv.weight", randn(&[24, 8])),
        ("h.0.qkv.bias", randn(&[24])),
        ("h.0.fc1.weight", randn(&[16, 8])),
        ("h.0.fc1.bias", randn(&[16])),
        ("h.0.fc2.weight", randn(&[8, 16])),
        ("h.0.fc2.bias", randn(&[8])),
        ("emb.weight", randn(&[12, 8])),
        ("ln.weight", randn(&[8])),
    ]
    .into_iter()
    .map(|(n, t)| (n.to_string(), t))
    .collect();
    for ranks in [2, 4] {
        distributed::spawn_threads(ranks, |tp| {
            let parts = plan.shard_all(whole.iter().map(|(n, t)| (n.as_str(), t)), &tp)?;
            let (w, b) = shard_qkv(&whole[0].1, Some(&whole[1].1), 4, &tp)?;
            assert_eq!(max_diff(&parts["h.0.qkv.weight"], &w), 0.0);
            assert_eq!(max_diff(&parts["h.0.qkv.bias"], &b.unwrap()), 0.0);
            let (w, b) = shard_linear(&whole[2].1, Some(&whole[3].1), &tp, true)?;
            assert_eq!(max_diff(&parts["h.0.fc1.weight"], &w), 0.0);
            assert_eq!(max_diff(&parts["h.0.fc1.bias"], &b.unwrap()), 0.0);
            let (w, b) = shard_linear(&whole[4].1, Some(&whole[5].1), &tp, false)?;
            assert_eq!(max_diff(&parts["h.0.fc2.weight"], &w), 0.0);
            assert_eq!(max_diff(&parts["h.0.fc2.bias"], &b.unwrap()), 0.0);
            assert_eq!(parts["emb.weight"].dims(), [12 / ranks, 8]);
            assert_eq!(parts["ln.weight"].dims(), [8]);
            let local: Vec<(String, Tensor)> = parts.into_iter().collect();
            let back = plan.gather(&local, &tp)?;
            for (name, t) in &whole {
                assert_eq!(max_diff(&back[name], t), 0.0, "{name} over {ranks} ranks");
            }
            Ok(())
        })
        .unwrap();
    }
    let err = distributed::spawn_threads(3, |tp| {
        plan.shard("h.0.fc1.weight", &whole[2].1, &tp).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("h.0.fc1.weight of shape [16, 8]") && err.contains("3 tensor-parallel ranks"),
        "{err}"
    );
}

/// Ranks whose parts do not line up cannot be put back together: different names of the same
/// shape (which all-gather would pair silently), a variable only some ranks hold, and a packed
/// `qkv` part whose rows are not three blocks are errors, on every rank, that name the
/// variable; none is a hang or a wrong tensor.
#[test]
fn a_plan_refuses_to_gather_parts_that_do_not_line_up() {
    use candle_parallel::tensor_parallel::{ParallelPlan, ParallelStyle};
    let plan = ParallelPlan::new()
        .layer("h.*.qkv", ParallelStyle::PackedQkv)
        .layer("h.*.fc1", ParallelStyle::Colwise);
    let part = Tensor::ones((2, 3), DType::F32, &Device::Cpu).unwrap();
    type Local = fn(usize, &Tensor) -> Vec<(String, Tensor)>;
    let cases: [(Local, &str); 3] = [
        (
            |rank, t| vec![(format!("h.{rank}.fc1.weight"), t.clone())],
            "h.1.fc1.weight",
        ),
        (
            |rank, t| {
                let mut local = vec![("h.0.fc1.weight".to_string(), t.clone())];
                if rank == 1 {
                    local.push(("h.1.fc1.weight".to_string(), t.clone()));
                }
                local
            },
            "h.1.fc1.weight",
        ),
        (
            |_, t| vec![("h.0.qkv.weight".to_string(), t.clone())],
            "h.0.qkv.weight of shape [2, 3]",
        ),
    ];
    for (local, want) in cases {
        let errors = distributed::spawn_threads(2, |tp| {
            let err = plan.gather(&local(tp.rank(), &part), &tp).unwrap_err();
            Ok(err.to_string())
        })
        .unwrap();
        for err in errors {
            assert!(err.contains(want), "{want}: {err}");
        }
    }
}
