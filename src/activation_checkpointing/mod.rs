//! Activation checkpointing (`torch.utils.checkpoint`): a block whose activations are dropped in
//! forward and recomputed in backward, trading compute for memory.
//!
//! The model marks its blocks where it builds them, with [`checkpoint`] (or [`checkpoint_if`],
//! to select every k-th block): the block is built as usual, and its forward runs without
//! keeping a graph; only its input is kept. Its output enters autograd's graph through a custom
//! op whose backward rebuilds the block over fresh leaves holding its parameters' values, reruns
//! its forward with a graph from a fresh copy of the input, back-propagates the output's
//! gradient through it, and hands the input's and every parameter's gradient on to the outer
//! backward. The gradients are those of the plain block, bit for bit.
//!
//! It works in one process, under DistributedDataParallel (plain and ZeRO-2: the parameters are
//! DDP's copies, whose gradients reach its reducer as usual), and inside or outside fully
//! sharded units. The rules are those of a fully sharded unit: the block computes the same output
//! each time for the same input (no dropout inside: backward recomputes it), and tensors that
//! [`Checkpointed::forward_with`] captures besides the input are constants.
//!
//! Buffers (variables named `running_mean`, `running_var`, `num_batches_tracked`, and integer
//! variables) are handed to the forward as they are, so BatchNorm's running statistics move
//! once, at forward, as without checkpointing; the recomputation gets copies of them as the
//! forward found them. Under `DdpConfig::sync_batch_norm` the block's `nn::batch_norm` layers
//! are rebuilt as SyncBatchNorm each time.
//!
//! ```rust
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{linear, Linear, VarBuilder, VarMap};
//! use candle_parallel::activation_checkpointing::checkpoint;
//! # fn main() -> candle_parallel::Result<()> {
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let block = checkpoint(vb.pp("block"), |vb| linear(4, 4, vb))?;
//! let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu)?;
//! let loss = block.forward(&x)?.sqr()?.sum_all()?;
//! let grads = loss.backward()?; // the block's forward runs again here
//! let w = varmap.data().lock().unwrap()["block.weight"].clone();
//! assert!(grads.get(w.as_tensor()).is_some());
//! # Ok(()) }
//! ```

mod pin;

use crate::distributed::ProcessGroup;
use crate::util::is_default_buffer;
use crate::util::sync::lock;
use candle_core::{DType, Device, Module, ModuleT, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use pin::{attach, Recompute};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Builds a block's module from a `VarBuilder`.
type Build<M> = Arc<dyn Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync>;

/// A block built with [`checkpoint`]: it computes as the module `build` makes, without keeping
/// its activations.
pub struct Checkpointed<M> {
    /// The module over the variables themselves: what a plain forward (no checkpointing) uses.
    module: M,
    /// Whether forward drops the activations.
    enabled: bool,
    build: Build<M>,
    /// The tensors the block asked for, by full name, and the prefix they were asked at.
    params: Arc<Vec<(String, Tensor)>>,
    prefix: String,
    dtype: DType,
    device: Device,
    /// The group the block's `nn::batch_norm` layers synchronise over when it was built (under
    /// `DdpConfig::sync_batch_norm`): each rebuild makes them SyncBatchNorm layers again.
    sync_group: Option<ProcessGroup>,
}

/// Builds the module `build` makes from `vb` as a checkpointed block: see the
/// [module documentation](self). `build` must make the same module each time it is called (it
/// runs again at each forward and backward, over other tensors).
pub fn checkpoint<M, F>(vb: VarBuilder, build: F) -> candle_core::Result<Checkpointed<M>>
where
    M: 'static,
    F: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
{
    checkpoint_if(true, vb, build)
}

/// [`checkpoint`] when `enabled`, else the plain module in the same wrapper: for checkpointing
/// every k-th block (`checkpoint_if(i % k == 0, ..)`) or none, from one model definition.
pub fn checkpoint_if<M, F>(
    enabled: bool,
    vb: VarBuilder,
    build: F,
) -> candle_core::Result<Checkpointed<M>>
where
    M: 'static,
    F: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
{
    let recorder = Recorder {
        root: vb.root(),
        seen: Mutex::new((Vec::new(), HashMap::new())),
    };
    let prefix = vb.prefix();
    let (dtype, device) = (vb.dtype(), vb.device().clone());
    let recording = at_prefix(
        VarBuilder::from_backend(Box::new(&recorder), dtype, device.clone()),
        &prefix,
    );
    let module = build(recording)?;
    let params = std::mem::take(&mut lock(&recorder.seen).0);
    Ok(Checkpointed {
        module,
        enabled,
        build: Arc::new(build),
        params: Arc::new(params),
        prefix,
        dtype,
        device,
        sync_group: crate::nn::building_sync_group(),
    })
}

impl<M> Checkpointed<M> {
    /// The module over the variables themselves (its forward keeps its activations).
    pub fn module(&self) -> &M {
        &self.module
    }

    /// Whether the block drops its activations (false for a block that
    /// [`checkpoint_if`] left plain).
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// The names of the tensors the block asked for.
    pub fn parameter_names(&self) -> Vec<String> {
        self.params.iter().map(|(n, _)| n.clone()).collect()
    }
}

impl<M: 'static> Checkpointed<M> {
    /// Runs `f` on the module and `xs`: the way to call a block whose forward takes more than
    /// its input (a mask, positions). Only `xs` is differentiated through: tensors that `f`
    /// captures are constants.
    pub fn forward_with<F>(&self, xs: &Tensor, f: F) -> candle_core::Result<Tensor>
    where
        F: Fn(&M, &Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        let tracked = xs.track_op()
            || self
                .params
                .iter()
                .any(|(name, p)| p.track_op() && !is_default_buffer(name, p.dtype()));
        if !self.enabled || !tracked {
            // Nothing to keep: no graph would be built.
            return f(&self.module, xs);
        }
        let build = self.build.clone();
        let (prefix, dtype, device) = (self.prefix.clone(), self.dtype, self.device.clone());
        let sync_group = self.sync_group.clone();
        let names: Vec<String> = self.params.iter().map(|(n, _)| n.clone()).collect();
        let run = move |tensors: Vec<Tensor>, x: &Tensor| -> candle_core::Result<Tensor> {
            let given = Given(names.iter().cloned().zip(tensors).collect());
            let vb = VarBuilder::from_backend(Box::new(given), dtype, device.clone());
            let module =
                crate::nn::rebuilding(sync_group.clone(), || build(at_prefix(vb, &prefix)))?;
            f(&module, x)
        };
        // The recomputation gets copies of the buffers as they are before this forward, which
        // updates the live ones: its own updates are lost, and it computes with the values the
        // forward used.
        let before = self
            .params
            .iter()
            .map(|(name, p)| match is_default_buffer(name, p.dtype()) {
                true => p.copy().map(Some),
                false => Ok(None),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let recompute = Arc::new(Recompute::new(Arc::new(run), self.params.clone(), before));
        // The parameters without their graph; the buffers themselves, so that a training
        // forward updates BatchNorm's running statistics in place, once, as without
        // checkpointing.
        let detached: Vec<Tensor> = self
            .params
            .iter()
            .map(|(name, p)| match is_default_buffer(name, p.dtype()) {
                true => p.clone(),
                false => p.detach(),
            })
            .collect();
        let out = recompute.run_detached(detached, &xs.detach())?;
        attach(recompute, xs, out)
    }
}

impl<M: Module + 'static> Module for Checkpointed<M> {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_with(xs, |m, x| m.forward(x))
    }
}

impl<M: ModuleT + 'static> Checkpointed<M> {
    /// The module's `forward_t` (a block whose module is `ModuleT` but not `Module`).
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.forward_with(xs, move |m, x| m.forward_t(x, train))
    }
}

/// The tensors asked for, in order, and each name's position among them.
type Seen = (Vec<(String, Tensor)>, HashMap<String, usize>);

/// A `VarBuilder` backend that asks the block's real `VarBuilder` (at the root: names arrive
/// whole) for each tensor and records what it hands out.
struct Recorder<'a> {
    root: VarBuilder<'a>,
    seen: Mutex<Seen>,
}

impl Recorder<'_> {
    fn record(&self, name: &str, t: Tensor) -> Tensor {
        let mut seen = lock(&self.seen);
        if let Some(&i) = seen.1.get(name) {
            return seen.0[i].1.clone();
        }
        let i = seen.0.len();
        seen.0.push((name.to_string(), t.clone()));
        seen.1.insert(name.to_string(), i);
        t
    }
}

impl SimpleBackend for &Recorder<'_> {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        _: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.root.get_with_hints_dtype(s, name, h, dtype)?;
        Ok(self.record(name, t))
    }

    fn get_unchecked(&self, name: &str, dtype: DType, _: &Device) -> candle_core::Result<Tensor> {
        let t = self.root.get_unchecked_dtype(name, dtype)?;
        Ok(self.record(name, t))
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.root.contains_tensor(name)
    }
}

/// A `VarBuilder` backend over the tensors a block asked for, handed out as they are: in the
/// dtype the block's real `VarBuilder` gave them (under mixed precision, compute copies in
/// bf16 beside an f32 builder), never cast again.
struct Given(HashMap<String, Tensor>);

impl Given {
    fn find(&self, name: &str) -> candle_core::Result<Tensor> {
        self.0.get(name).cloned().ok_or_else(|| {
            candle_core::Error::CannotFindTensor {
                path: name.to_string(),
            }
            .bt()
        })
    }
}

impl SimpleBackend for Given {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: Init,
        _: DType,
        _: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.find(name)?;
        if t.shape() != &s {
            return Err(candle_core::Error::UnexpectedShape {
                msg: format!("activation checkpointing: {name} changed shape between uses"),
                expected: s,
                got: t.shape().clone(),
            }
            .bt());
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        self.find(name)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
}

/// `vb` at `prefix` ("" is the root, where `pp("")` would add an empty path component).
fn at_prefix<'a>(vb: VarBuilder<'a>, prefix: &str) -> VarBuilder<'a> {
    if prefix.is_empty() {
        vb
    } else {
        vb.pp(prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::{layer_norm, LayerNorm};
    use candle_core::backprop::GradStore;
    use candle_core::Var;
    use candle_nn::{linear, Linear, VarMap};

    /// A pre-norm residual MLP block.
    struct Block {
        ln: LayerNorm,
        fc1: Linear,
        fc2: Linear,
    }

    fn block(vb: VarBuilder) -> candle_core::Result<Block> {
        Ok(Block {
            ln: layer_norm(6, 1e-5, vb.pp("ln"))?,
            fc1: linear(6, 24, vb.pp("fc1"))?,
            fc2: linear(24, 6, vb.pp("fc2"))?,
        })
    }

    impl Module for Block {
        fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
            let h = x.apply(&self.ln)?.apply(&self.fc1)?.gelu_erf()?;
            x + h.apply(&self.fc2)?.affine(1.0, 0.0)?
        }
    }

    /// Three blocks, the ones in `checkpointed` with activation checkpointing; the gradients of
    /// a loss over them, by variable name, and the input's.
    fn grads(checkpointed: &[usize], scale: f64) -> (Vec<(String, Vec<f32>)>, Vec<f32>) {
        let varmap = VarMap::new();
        let vb = crate::init::seeded_var_builder(&varmap, 4, DType::F32, &Device::Cpu);
        let blocks: Vec<Checkpointed<Block>> = (0..3)
            .map(|i| checkpoint_if(checkpointed.contains(&i), vb.pp(format!("h.{i}")), block))
            .collect::<candle_core::Result<_>>()
            .unwrap();
        let x0: Vec<f32> = (0..30).map(|i| ((i * 7) % 11) as f32 * 0.3 - 1.0).collect();
        let x = Var::from_tensor(&Tensor::from_vec(x0, (5, 6), &Device::Cpu).unwrap()).unwrap();
        let mut h = x.as_tensor().clone();
        for b in &blocks {
            // A block used twice: both uses' gradients.
            h = b.forward(&h).unwrap();
        }
        h = blocks[1].forward(&h).unwrap();
        let loss = (h.sqr().unwrap().sum_all().unwrap() * scale).unwrap();
        let g: GradStore = loss.backward().unwrap();
        let mut out: Vec<(String, Vec<f32>)> = varmap
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(n, v)| {
                let grad = g
                    .get(v.as_tensor())
                    .expect("every variable gets a gradient");
                (n.clone(), grad.flatten_all().unwrap().to_vec1().unwrap())
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        let gx = g
            .get(x.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        (out, gx)
    }

    #[test]
    fn gradients_equal_the_plain_blocks_bit_for_bit_whichever_blocks_are_checkpointed() {
        let plain = grads(&[], 0.5);
        for chosen in [vec![0], vec![1], vec![0, 2], vec![0, 1, 2]] {
            assert_eq!(grads(&chosen, 0.5), plain, "checkpointed {chosen:?}");
        }
    }

    #[test]
    fn without_a_tracked_input_or_parameter_the_block_runs_plain() {
        let c = checkpoint(
            VarBuilder::from_tensors(
                [(
                    "w.weight".to_string(),
                    Tensor::ones((2, 2), DType::F32, &Device::Cpu).unwrap(),
                )]
                .into(),
                DType::F32,
                &Device::Cpu,
            )
            .pp("w"),
            |vb| Ok(Linear::new(vb.get((2, 2), "weight")?, None)),
        )
        .unwrap();
        assert_eq!(c.parameter_names(), ["w.weight"]);
        let out = c
            .forward(&Tensor::ones((1, 2), DType::F32, &Device::Cpu).unwrap())
            .unwrap();
        assert!(!out.track_op());
        assert_eq!(out.to_vec2::<f32>().unwrap(), [[2., 2.]]);
    }
}
