//! [`backward`]: candle's `loss.backward()`, with the variables' gradients from this crate's
//! layers stored as they are made instead of added to zeros.
//!
//! candle's backward adds every gradient an op returns to the store's entry for its input, and
//! an input met for the first time gets a fresh tensor of zeros to add to: for a variable used
//! once, as a layer's weight is, that is a tensor of zeros and a second copy of the gradient,
//! each as large as the weight, every step (64 MB each for a 4096 × 4096 layer, about a tenth
//! of the 25 M-parameter MLP's backward). Inside [`backward`], [`linear`](super::linear) and
//! its siblings, the norms and the convolutions hand the gradients of their variables here instead; after candle's walk they go
//! into the store as they are (summed where a variable got several, or also one from candle).
//! The result is the same gradients, to the bit where a variable gets one gradient.
//!
//! Outside [`backward`] (a plain `loss.backward()`) the layers return their gradients to candle
//! as before. This crate's optimizers' `backward_step`, `DistributedDataParallel::backward` and
//! the other wrappers call [`backward`]. A custom op that runs a backward of its own inside a
//! backward must call [`backward`] too: a plain `backward()` there would leave the gradients of
//! those layers' variables to the outer store.
//!
//! ```rust
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use candle_parallel::nn;
//! # fn main() -> candle_core::Result<()> {
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let fc = candle_nn::linear(8, 4, vb.pp("fc"))?;
//! let x = Tensor::randn(0f32, 1.0, (3, 8), &Device::Cpu)?;
//! let loss = nn::linear(&x, &fc)?.sqr()?.sum_all()?;
//! let ours = nn::backward(&loss)?;
//! let candles = loss.backward()?;
//! let (a, b) = (ours.get(fc.weight()).unwrap(), candles.get(fc.weight()).unwrap());
//! assert_eq!(a.to_vec2::<f32>()?, b.to_vec2::<f32>()?);
//! # Ok(()) }
//! ```

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, TensorId};
use std::cell::RefCell;
use std::collections::HashSet;

/// What one [`backward`] collects: the gradients handed over by layers whose output is a node
/// of its loss's graph (the nodes found on the first hand-over: a graph without such layers
/// is not walked twice).
struct Collected {
    loss: Tensor,
    nodes: Option<HashSet<TensorId>>,
    handed: Vec<(Tensor, Tensor)>,
}

thread_local! {
    /// One per [`backward`] running on this thread, innermost last.
    static FRAMES: RefCell<Vec<Collected>> = const { RefCell::new(Vec::new()) };
}

/// Pops this thread's innermost frame when dropped, whatever happened in between.
struct Frame;

impl Frame {
    fn open(loss: &Tensor) -> Self {
        let collected = Collected {
            loss: loss.clone(),
            nodes: None,
            handed: Vec::new(),
        };
        FRAMES.with(|f| f.borrow_mut().push(collected));
        Frame
    }

    /// The gradients handed over so far.
    fn take(&self) -> Vec<(Tensor, Tensor)> {
        FRAMES
            .with(|f| {
                f.borrow_mut()
                    .last_mut()
                    .map(|c| std::mem::take(&mut c.handed))
            })
            .unwrap_or_default()
    }
}

impl Drop for Frame {
    fn drop(&mut self) {
        FRAMES.with(|f| f.borrow_mut().pop());
    }
}

/// The gradients of `loss` with respect to every variable it depends on: `loss.backward()`,
/// with the gradients of the variables of this crate's layers stored as made rather than added
/// to zeros (see the [module documentation](self)). Use it wherever `loss.backward()` would be.
pub fn backward(loss: &Tensor) -> Result<GradStore> {
    let frame = Frame::open(loss);
    let walked = loss.backward();
    let handed = frame.take();
    drop(frame);
    let mut grads = walked?;
    for (var, grad) in handed {
        let grad = match grads.remove(&var) {
            Some(before) => (before + grad)?,
            None => grad,
        };
        grads.insert(&var, grad);
    }
    Ok(grads)
}

/// What a layer's backward returns to candle for `input`'s gradient `grad`, the layer's output
/// being `output`: nothing, when `input` is a variable and `output` is a node of the graph of
/// the innermost [`backward`] running on this thread (which stores `grad` itself after
/// candle's walk); `grad` otherwise. A plain `backward()` of another graph on this thread
/// meanwhile (inside an op's backward, or a rayon job run while this thread waits) gets its
/// gradients from candle as always.
pub(super) fn hand_over(output: &Tensor, input: &Tensor, grad: Option<Tensor>) -> Option<Tensor> {
    let grad = grad?;
    if !input.is_variable() {
        return Some(grad);
    }
    FRAMES.with(|f| {
        let mut frames = f.borrow_mut();
        let Some(frame) = frames.last_mut() else {
            return Some(grad);
        };
        let loss = &frame.loss;
        let nodes = frame
            .nodes
            .get_or_insert_with(|| loss.sorted_nodes().iter().map(|n| n.id()).collect());
        if !nodes.contains(&output.id()) {
            return Some(grad);
        }
        frame.handed.push((input.clone(), grad));
        None
    })
}
