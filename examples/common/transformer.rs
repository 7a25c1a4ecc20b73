//! A small decoder-only transformer (GPT-style, pre-norm) and the task it learns: sorting a
//! sequence of digits. Shared by `examples/transformer_ddp.rs`, `examples/transformer_pp.rs`
//! (which cuts it into [`TransformerStage`]s) and `benches/ddp_throughput.rs`;
//! `scripts/torch_transformer_bench.py` is the same model in PyTorch, with the same variable
//! names, so weights and gradients compare name by name.
//!
//! The model is made of candle-nn's `Embedding` and `Linear` and of candle-parallel's layers
//! with a backward (`nn::LayerNorm`, `nn::attention::causal_attention`, one op from the packed
//! projection to the heads' outputs, and `nn::ops::gelu_erf`, one op with a one-pass backward
//! where candle's is nine): candle-nn's own fused
//! layer norm and softmax have no backward in candle 0.11, and every parameter upstream of them
//! would train as if frozen.

#![allow(dead_code)]

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{embedding, linear, Embedding, Linear, VarBuilder};
use candle_parallel::activation_checkpointing::{checkpoint_if, Checkpointed};
use candle_parallel::distributed::ProcessGroup;
use candle_parallel::fsdp::{self, Unit};
use candle_parallel::nn::attention::causal_attention;
use candle_parallel::nn::{self, layer_norm, LayerNorm};
use candle_parallel::rng::Rng;
use candle_parallel::tensor_parallel::{
    ParallelAttention, ParallelMlp, ParallelPlan, ParallelStyle,
};

/// torch's `nn.LayerNorm` default.
const LN_EPS: f64 = 1e-5;

/// The shape of a [`Transformer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Tokens in the vocabulary.
    pub vocab: usize,
    /// The longest sequence (rows of the position embedding).
    pub max_len: usize,
    /// Width of the residual stream.
    pub dim: usize,
    /// Attention heads per block; `dim` must be a multiple.
    pub heads: usize,
    /// Blocks.
    pub layers: usize,
    /// Activation checkpointing of every k-th block (block 0, k, 2k, ...; 0: none).
    pub checkpoint_every: usize,
}

impl Config {
    /// Checks the shape, with a message naming the flag at fault.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.dim == 0 || self.heads == 0 || self.layers == 0 {
            return Err(format!(
                "--dim {}, --heads {} and --layers {} must all be at least 1",
                self.dim, self.heads, self.layers
            ));
        }
        if !self.dim.is_multiple_of(self.heads) {
            return Err(format!(
                "--dim {} is not a multiple of --heads {}: each head takes dim / heads channels",
                self.dim, self.heads
            ));
        }
        Ok(())
    }

    /// The number of trainable parameters.
    pub fn parameters(&self) -> usize {
        let (d, v) = (self.dim, self.vocab);
        let block =
            2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
        v * d + self.max_len * d + self.layers * block + 2 * d + d * v + v
    }
}

/// Causal multi-head self-attention: one projection to queries, keys and values, one out.
struct Attention {
    qkv: Linear,
    proj: Linear,
    heads: usize,
}

impl Attention {
    fn new(dim: usize, heads: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            qkv: linear(dim, 3 * dim, vb.pp("qkv"))?,
            proj: linear(dim, dim, vb.pp("proj"))?,
            heads,
        })
    }

    /// `x` is (batch, time, dim); position `i` attends to positions `0..=i`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = causal_attention(&nn::linear(x, &self.qkv)?, self.heads)?;
        nn::linear(&y, &self.proj)
    }
}

/// The model cut over a tensor-parallel group (Megatron's layout): each block's attention heads
/// and MLP hidden features split over the ranks, the norms, the embeddings and the head
/// replicated ([`parallel_plan`] says which variable is cut how).
#[derive(Clone, Debug)]
pub struct TensorParallel {
    /// The ranks that share each layer.
    pub group: ProcessGroup,
    /// Training forwards keep the residual stream split along the sequence between the
    /// blocks' parallel layers (Megatron's sequence parallel); evaluation runs whole.
    pub sequence_parallel: bool,
}

/// How [`Transformer`]'s variables lie over a tensor-parallel group: the packed attention
/// projection and the first MLP layer column-parallel, the two projections back row-parallel.
pub fn parallel_plan() -> ParallelPlan {
    ParallelPlan::new()
        .layer("h.*.attn.qkv", ParallelStyle::PackedQkv)
        .layer("h.*.attn.proj", ParallelStyle::Rowwise)
        .layer("h.*.mlp.fc1", ParallelStyle::Colwise)
        .layer("h.*.mlp.fc2", ParallelStyle::Rowwise)
}

/// A block's attention and MLP: whole, or cut over a tensor-parallel group (built twice, as
/// sequence parallel trains them and as evaluation runs them, over the same variables).
enum Mixing {
    Whole {
        attn: Attention,
        fc1: Linear,
        fc2: Linear,
    },
    Parallel {
        attn: Box<[ParallelAttention; 2]>,
        mlp: Box<[ParallelMlp; 2]>,
    },
}

/// A pre-norm block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`, the MLP 4 times wider with
/// an exact (erf) GELU, as torch's `F.gelu`.
struct Block {
    ln1: LayerNorm,
    ln2: LayerNorm,
    mixing: Mixing,
}

impl Block {
    fn new(dim: usize, heads: usize, vb: VarBuilder, tp: Option<&TensorParallel>) -> Result<Self> {
        let ln1 = layer_norm(dim, LN_EPS, vb.pp("ln1"))?;
        let ln2 = layer_norm(dim, LN_EPS, vb.pp("ln2"))?;
        let mixing = match tp {
            None => Mixing::Whole {
                attn: Attention::new(dim, heads, vb.pp("attn"))?,
                fc1: linear(dim, 4 * dim, vb.pp("mlp.fc1"))?,
                fc2: linear(4 * dim, dim, vb.pp("mlp.fc2"))?,
            },
            Some(tp) => {
                let g = &tp.group;
                let attn =
                    ParallelAttention::new(dim, heads, vb.pp("attn"), g).map_err(to_candle)?;
                let mlp = ParallelMlp::new(dim, 4 * dim, vb.pp("mlp"), g).map_err(to_candle)?;
                let sp = tp.sequence_parallel;
                Mixing::Parallel {
                    attn: Box::new([attn.clone(), attn.sequence_parallel(sp)]),
                    mlp: Box::new([mlp.clone(), mlp.sequence_parallel(sp)]),
                }
            }
        };
        Ok(Self { ln1, ln2, mixing })
    }

    /// The block on `x`: the whole sequence, or (`split`, under sequence parallelism) this
    /// rank's positions.
    fn forward(&self, x: &Tensor, split: bool) -> Result<Tensor> {
        match &self.mixing {
            Mixing::Whole { attn, fc1, fc2 } => {
                let x = (x + attn.forward(&x.apply(&self.ln1)?)?)?;
                let h = nn::linear_gelu(&x.apply(&self.ln2)?, fc1)?;
                x + nn::linear(&h, fc2)?
            }
            Mixing::Parallel { attn, mlp } => {
                let i = usize::from(split);
                let a = attn[i].forward(&x.apply(&self.ln1)?).map_err(to_candle)?;
                let x = (x + a)?;
                let m = mlp[i].forward(&x.apply(&self.ln2)?).map_err(to_candle)?;
                x + m
            }
        }
    }
}

fn to_candle(e: candle_parallel::Error) -> candle_core::Error {
    e.into_candle()
}

/// A decoder-only transformer: token and learned position embeddings, pre-norm blocks, a final
/// layer norm and a linear head. Its forward takes token ids (batch, time) as u32 and gives
/// logits (batch, time, vocab); position `i` sees tokens `0..=i` only.
pub struct Transformer {
    tok_emb: Embedding,
    pos_emb: Embedding,
    /// Each block is a unit of fully sharded training (gathered, used and freed on its own);
    /// anywhere else a unit is just the block. Inside, a block may drop its activations in
    /// forward and recompute them in backward (`Config::checkpoint_every`).
    blocks: Vec<Unit<Checkpointed<Block>>>,
    ln_f: LayerNorm,
    head: Linear,
    max_len: usize,
    tp: Option<TensorParallel>,
}

impl Transformer {
    /// Builds the model from `vb`: variables `tok_emb.weight`, `pos_emb.weight`,
    /// `h.{i}.{ln1,attn.qkv,attn.proj,ln2,mlp.fc1,mlp.fc2}.{weight,bias}`, `ln_f.*`, `head.*`.
    pub fn new(config: Config, vb: VarBuilder) -> Result<Self> {
        Self::new_parallel(config, vb, None)
    }

    /// The model with its blocks cut over `tp` (whole with `None`): `vb` holds this rank's
    /// parts under the whole model's names ([`parallel_plan`]`().shard` of a one-process
    /// model's weights starts where that model starts).
    pub fn new_parallel(
        config: Config,
        vb: VarBuilder,
        tp: Option<TensorParallel>,
    ) -> Result<Self> {
        config.check().map_err(candle_core::Error::msg)?;
        let (dim, heads, every) = (config.dim, config.heads, config.checkpoint_every);
        let blocks = (0..config.layers)
            .map(|i| {
                let recompute = every > 0 && i % every == 0;
                let tp = tp.clone();
                fsdp::unit(vb.pp(format!("h.{i}")), move |vb| {
                    let tp = tp.clone();
                    checkpoint_if(recompute, vb, move |vb| {
                        Block::new(dim, heads, vb, tp.as_ref())
                    })
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            tok_emb: embedding(config.vocab, config.dim, vb.pp("tok_emb"))?,
            pos_emb: embedding(config.max_len, config.dim, vb.pp("pos_emb"))?,
            blocks,
            ln_f: layer_norm(config.dim, LN_EPS, vb.pp("ln_f"))?,
            head: linear(config.dim, config.vocab, vb.pp("head"))?,
            max_len: config.max_len,
            tp,
        })
    }

    /// The positions `start..start + len` of a `t`-token sequence this rank computes: all of
    /// them, or under sequence parallelism its `t / tp` (an error when `tp` does not divide
    /// `t`).
    pub fn positions(&self, t: usize) -> Result<(usize, usize)> {
        match &self.tp {
            Some(tp) if tp.sequence_parallel => {
                let ranks = tp.group.world_size();
                if !t.is_multiple_of(ranks) {
                    candle_core::bail!(
                        "sequence parallel over {ranks} ranks needs sequences whose length is a \
                         multiple of {ranks}, not {t}: change --digits"
                    );
                }
                Ok((tp.group.rank() * t / ranks, t / ranks))
            }
            _ => Ok((0, t)),
        }
    }

    /// The logits of `tokens` (batch, time) at every position, on every rank (evaluation).
    pub fn forward_whole(&self, tokens: &Tensor) -> Result<Tensor> {
        self.forward_positions(tokens, false)
    }

    /// The logits at [`Transformer::positions`] (`split`) or at every position.
    fn forward_positions(&self, tokens: &Tensor, split: bool) -> Result<Tensor> {
        let (_, t) = tokens.dims2()?;
        if t > self.max_len {
            candle_core::bail!(
                "a sequence of {t} tokens is longer than the model's {} positions",
                self.max_len
            );
        }
        let (start, len) = if split { self.positions(t)? } else { (0, t) };
        let tokens = tokens.narrow(1, start, len)?;
        let positions = Tensor::arange(start as u32, (start + len) as u32, tokens.device())?;
        let mut x = tokens
            .apply(&self.tok_emb)?
            .broadcast_add(&positions.apply(&self.pos_emb)?)?;
        for block in &self.blocks {
            x = block.forward_with(&x, move |b, x| {
                b.forward_with(x, move |b, x| b.forward(x, split))
            })?;
        }
        nn::linear(&x.apply(&self.ln_f)?, &self.head)
    }
}

/// Training's forward: under sequence parallelism, the logits of this rank's positions only
/// ([`Transformer::positions`]; [`sort_loss_at`] takes them), else of every position.
impl Module for Transformer {
    fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        let split = self.tp.as_ref().is_some_and(|tp| tp.sequence_parallel);
        self.forward_positions(tokens, split)
    }
}

/// A [`Transformer`] whose `forward` is [`Transformer::forward_whole`], for evaluation.
pub struct Whole<'a>(pub &'a Transformer);

impl Module for Whole<'_> {
    fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        self.0.forward_whole(tokens)
    }
}

/// The blocks stage `stage` of `num_stages` holds: an even share, in order.
pub fn stage_blocks(layers: usize, stage: usize, num_stages: usize) -> std::ops::Range<usize> {
    stage * layers / num_stages..(stage + 1) * layers / num_stages
}

/// A consecutive part of a [`Transformer`], for a pipeline: the first stage holds the
/// embeddings, the last the final norm and the head, each its share of the blocks
/// ([`stage_blocks`]), with the whole model's variable names. The first stage takes token ids
/// (batch, time); the others the residual stream (batch, time, dim); the last gives logits.
pub struct TransformerStage {
    embeddings: Option<(Embedding, Embedding)>,
    blocks: Vec<Block>,
    head: Option<(LayerNorm, Linear)>,
}

impl TransformerStage {
    /// Stage `stage` of `num_stages` of the transformer `config` describes, from `vb` (the
    /// whole model's names: `h.3.attn.qkv.weight` for block 3, wherever it sits).
    pub fn new(config: Config, stage: usize, num_stages: usize, vb: VarBuilder) -> Result<Self> {
        Self::new_parallel(config, stage, num_stages, vb, None)
    }

    /// The stage with its blocks cut over `tp` (whole with `None`; no sequence parallel:
    /// stages pass whole activations), from this rank's parts in `vb`.
    pub fn new_parallel(
        config: Config,
        stage: usize,
        num_stages: usize,
        vb: VarBuilder,
        tp: Option<&ProcessGroup>,
    ) -> Result<Self> {
        config.check().map_err(candle_core::Error::msg)?;
        let tp = tp.map(|group| TensorParallel {
            group: group.clone(),
            sequence_parallel: false,
        });
        let first = stage == 0;
        let last = stage + 1 == num_stages;
        let embeddings = match first {
            true => Some((
                embedding(config.vocab, config.dim, vb.pp("tok_emb"))?,
                embedding(config.max_len, config.dim, vb.pp("pos_emb"))?,
            )),
            false => None,
        };
        let blocks = stage_blocks(config.layers, stage, num_stages)
            .map(|i| {
                Block::new(
                    config.dim,
                    config.heads,
                    vb.pp(format!("h.{i}")),
                    tp.as_ref(),
                )
            })
            .collect::<Result<_>>()?;
        let head = match last {
            true => Some((
                layer_norm(config.dim, LN_EPS, vb.pp("ln_f"))?,
                linear(config.dim, config.vocab, vb.pp("head"))?,
            )),
            false => None,
        };
        Ok(Self {
            embeddings,
            blocks,
            head,
        })
    }
}

impl Module for TransformerStage {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let mut x = match &self.embeddings {
            Some((tok, pos)) => {
                let t = xs.dim(1)?;
                let positions = Tensor::arange(0u32, t as u32, xs.device())?;
                xs.apply(tok)?.broadcast_add(&positions.apply(pos)?)?
            }
            None => xs.clone(),
        };
        for block in &self.blocks {
            x = block.forward(&x, false)?;
        }
        match &self.head {
            Some((ln_f, head)) => nn::linear(&x.apply(ln_f)?, head),
            None => Ok(x),
        }
    }
}

/// The task: given `len` digits and a separator, write the digits in ascending order.
///
/// A sample is `x_1 .. x_len SEP y_1 .. y_len` (2 len + 1 tokens). The model reads its first
/// 2 len tokens and is trained on the next-token predictions at positions `len .. 2 len`: the
/// separator predicts `y_1`, `y_1` predicts `y_2`, and so on. The answer is exact: accuracy is
/// the share of held-out samples whose whole sorted sequence is right.
#[derive(Clone, Debug)]
pub struct SortTask {
    /// Digits per sample.
    pub len: usize,
    /// `n` samples of `2 len + 1` tokens, row after row.
    pub tokens: Vec<u32>,
}

/// The digits 0..=9 and the separator.
pub const VOCAB: usize = 11;
const SEP: u32 = 10;

impl SortTask {
    /// `train` training and `test` held-out samples of `len` digits, from `seed`. No held-out
    /// sample occurs in the training set. Panics where [`SortTask::try_generate`] fails.
    pub fn generate(len: usize, train: usize, test: usize, seed: u64) -> (Self, Self) {
        Self::try_generate(len, train, test, seed).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`SortTask::generate`], or an error naming the flags when the held-out samples take
    /// every sample `len` digits can make (none would be left to train on).
    pub fn try_generate(
        len: usize,
        train: usize,
        test: usize,
        seed: u64,
    ) -> std::result::Result<(Self, Self), String> {
        let mut rng = Rng::new(seed);
        let sample = |rng: &mut Rng| -> Vec<u32> {
            let x: Vec<u32> = (0..len).map(|_| rng.below(10) as u32).collect();
            let mut y = x.clone();
            y.sort_unstable();
            x.into_iter().chain([SEP]).chain(y).collect()
        };
        let mut seen = std::collections::HashSet::new();
        let mut test_tokens = Vec::with_capacity(test * (2 * len + 1));
        for _ in 0..test {
            let s = sample(&mut rng);
            seen.insert(s.clone());
            test_tokens.extend(s);
        }
        let possible = 10f64.powi(len.min(300) as i32);
        if train > 0 && seen.len() as f64 >= possible {
            return Err(format!(
                "the {test} held-out samples (--test-size) take all {possible} samples of {len} \
                 digits (--digits), leaving none to train on: hold out fewer or sort more digits"
            ));
        }
        let mut train_tokens = Vec::with_capacity(train * (2 * len + 1));
        let mut n = 0;
        while n < train {
            let s = sample(&mut rng);
            if !seen.contains(&s) {
                train_tokens.extend(s);
                n += 1;
            }
        }
        Ok((
            Self {
                len,
                tokens: train_tokens,
            },
            Self {
                len,
                tokens: test_tokens,
            },
        ))
    }

    /// The number of samples.
    pub fn size(&self) -> usize {
        self.tokens.len() / (2 * self.len + 1)
    }

    /// The positions the model reads: `2 len`.
    pub fn context(&self) -> usize {
        2 * self.len
    }

    /// The samples at `indices`: the model's inputs (n, 2 len) and the answers (n, len).
    pub fn batch(&self, indices: &[usize], device: &Device) -> Result<(Tensor, Tensor)> {
        let row = 2 * self.len + 1;
        let (mut inputs, mut answers) = (Vec::new(), Vec::new());
        for &i in indices {
            let s = &self.tokens[i * row..(i + 1) * row];
            inputs.extend_from_slice(&s[..row - 1]);
            answers.extend_from_slice(&s[self.len + 1..]);
        }
        let n = indices.len();
        Ok((
            Tensor::from_vec(inputs, (n, row - 1), device)?,
            Tensor::from_vec(answers, (n, self.len), device)?,
        ))
    }

    /// Greedy decoding of the answers of `inputs` (n, 2 len), whose answer positions are
    /// ignored: the model writes each digit after the separator from the ones it wrote before.
    /// Returns how many samples it got entirely right against `answers`.
    pub fn exact_matches(
        &self,
        model: &impl Module,
        inputs: &Tensor,
        answers: &Tensor,
    ) -> Result<usize> {
        let len = self.len;
        let n = inputs.dim(0)?;
        // The prompt, then the model's own digits as they come.
        let mut tokens = inputs.narrow(1, 0, len + 1)?;
        let mut written = Vec::with_capacity(len);
        for _ in 0..len {
            let logits = model.forward(&tokens)?;
            let next = logits
                .get_on_dim(1, tokens.dim(1)? - 1)?
                .argmax(D::Minus1)?;
            let next = next.to_dtype(DType::U32)?.reshape((n, 1))?;
            written.push(next.clone());
            tokens = Tensor::cat(&[&tokens, &next], 1)?;
        }
        let written = Tensor::cat(&written, 1)?;
        let wrong = written.ne(answers)?.to_dtype(DType::U32)?.sum(1)?;
        let right = wrong.eq(0u32)?.to_dtype(DType::U32)?.sum_all()?;
        Ok(right.to_scalar::<u32>()? as usize)
    }
}

/// The task's loss: the mean cross-entropy of the answer positions `len .. 2 len` of `logits`
/// (n, 2 len, vocab) against `answers` (n, len).
pub fn sort_loss(logits: &Tensor, answers: &Tensor) -> Result<Tensor> {
    let (n, len) = answers.dims2()?;
    let vocab = logits.dim(2)?;
    let logits = logits.narrow(1, len, len)?.reshape((n * len, vocab))?;
    candle_nn::loss::cross_entropy(&logits, &answers.flatten_all()?)
}

/// [`sort_loss`] of the positions `start..start + p` of a sequence, given their logits (n, p,
/// vocab): the sum of the cross-entropies of the answer positions among them over `n * len`,
/// so that the ranks' losses over their positions (sequence parallel) add up to the whole
/// sequence's. The other positions take part with weight zero, so that every rank's backward
/// runs through its blocks (and their collectives) even when it holds no answer position.
pub fn sort_loss_at(logits: &Tensor, answers: &Tensor, start: usize) -> Result<Tensor> {
    let (n, len) = answers.dims2()?;
    let (_, p, vocab) = logits.dims3()?;
    let dev = logits.device();
    // Position `len + k` predicts answer `k`.
    let (mut targets, mut weights) = (vec![0u32; n * p], vec![0f32; n * p]);
    let answers = answers.to_vec2::<u32>()?;
    for (i, row) in answers.iter().enumerate() {
        for j in 0..p {
            if let Some(k) = (start + j).checked_sub(len).filter(|&k| k < len) {
                targets[i * p + j] = row[k];
                weights[i * p + j] = 1.0;
            }
        }
    }
    let log_p = candle_nn::ops::log_softmax(&logits.reshape((n * p, vocab))?, D::Minus1)?;
    let picked = log_p
        .gather(&Tensor::from_vec(targets, (n * p, 1), dev)?, D::Minus1)?
        .squeeze(1)?;
    let weights = Tensor::from_vec(weights, n * p, dev)?.to_dtype(picked.dtype())?;
    (picked * weights)?.sum_all()?.neg()? / (n * len) as f64
}
