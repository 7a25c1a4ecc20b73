//! The ops that put a checkpointed block's output into autograd's graph.
//!
//! [`Core`], over the block's input and a one-element marker, hands on the output computed
//! beforehand without a graph; its backward recomputes the block with a graph and keeps the
//! parameters' gradients. The marker has passed through one [`Pin`] per parameter on its way to
//! `Core`, so that each parameter is an argument of an op of the graph without being copied;
//! backward reaches the pins after `Core`, and each hands its parameter the gradient `Core`
//! kept.

use crate::util::is_default_buffer;
use crate::util::sync::lock;
use candle_core::{CpuStorage, DType, Layout, Shape, Storage, Tensor, Var};
use std::sync::{Arc, Mutex};

/// Builds the block over the given tensors (the parameters, in order) and runs it on an input.
pub(super) type Run =
    Arc<dyn Fn(Vec<Tensor>, &Tensor) -> candle_core::Result<Tensor> + Send + Sync>;

/// One use of a checkpointed block: how to run it, its parameters, and the gradients its
/// backward found for them.
pub(super) struct Recompute {
    run: Run,
    params: Arc<Vec<(String, Tensor)>>,
    /// Copies of the buffers among `params` as they were before the forward (`None` for the
    /// parameters).
    buffers_before: Vec<Option<Tensor>>,
    grads: Mutex<Vec<Option<Tensor>>>,
}

impl Recompute {
    pub(super) fn new(
        run: Run,
        params: Arc<Vec<(String, Tensor)>>,
        buffers_before: Vec<Option<Tensor>>,
    ) -> Self {
        let n = params.len();
        Self {
            run,
            params,
            buffers_before,
            grads: Mutex::new(vec![None; n]),
        }
    }

    /// The block's output over `params` (detached) for `x` (detached): no graph.
    pub(super) fn run_detached(
        &self,
        params: Vec<Tensor>,
        x: &Tensor,
    ) -> candle_core::Result<Tensor> {
        (self.run)(params, x)
    }

    /// The backward: reruns the block with a graph over leaves holding the parameters' values
    /// (the parameters themselves when they are leaves already) and a fresh copy of the input,
    /// back-propagates `grad`, keeps the parameters' gradients and returns the input's.
    fn backward(&self, xs: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let leaves = self
            .params
            .iter()
            .zip(&self.buffers_before)
            .map(|((_, p), before)| {
                if let Some(before) = before {
                    // A fresh copy of the buffer as the forward found it: the forward updated
                    // the live one already, and what the recomputation writes is lost.
                    return before.copy();
                }
                match p.is_variable() {
                    true => Ok(p.clone()),
                    // A copy: a tensor made by an op (DDP's copies) must stop the inner
                    // backward.
                    false => Ok(Var::from_tensor(&p.detach())?.as_tensor().clone()),
                }
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let input = Var::from_tensor(&xs.detach())?;
        let out = (self.run)(leaves.clone(), input.as_tensor())?;
        let grads = crate::nn::backward(&(out * grad)?.sum_all()?)?;
        *lock(&self.grads) = leaves.iter().map(|l| grads.get(l).cloned()).collect();
        Ok(grads.get(input.as_tensor()).cloned())
    }
}

/// The op whose output is the block's (see the [module documentation](self)).
struct Core {
    recompute: Arc<Recompute>,
    /// The output computed beforehand; the op's forward takes it.
    out: Mutex<Option<Tensor>>,
}

/// The op that makes parameter `index` an argument of the graph (see the
/// [module documentation](self)).
struct Pin {
    recompute: Arc<Recompute>,
    index: usize,
}

/// `out` (computed from `xs` without a graph) as the output of the block's ops over `xs` and
/// its tracked parameters.
pub(super) fn attach(
    recompute: Arc<Recompute>,
    xs: &Tensor,
    out: Tensor,
) -> candle_core::Result<Tensor> {
    // `out` may be a view (a narrow, a transpose, a broadcast): `Core` hands on a compact copy
    // of its values.
    let mut marker = Tensor::zeros(1, DType::F32, out.device())?;
    for (index, (name, p)) in recompute.params.iter().enumerate() {
        if p.track_op() && !is_default_buffer(name, p.dtype()) {
            let pin = Pin {
                recompute: recompute.clone(),
                index,
            };
            marker = marker.apply_op2(p, pin)?;
        }
    }
    let core = Core {
        recompute,
        out: Mutex::new(Some(out)),
    };
    xs.apply_op2(&marker, core)
}

/// A compact copy of `t`'s values: the forward of an op that hands `t` on.
fn hand_on_cpu(t: &Tensor) -> candle_core::Result<(CpuStorage, Shape)> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => crate::util::pass_through::cpu(s, layout),
        _ => candle_core::bail!("activation checkpointing: a tensor is not on the CPU"),
    }
}

#[cfg(feature = "cuda")]
fn hand_on_cuda(t: &Tensor) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cuda(s) => crate::util::pass_through::cuda(s, layout),
        _ => candle_core::bail!("activation checkpointing: a tensor is not on the GPU"),
    }
}

impl Core {
    fn take_out(&self) -> candle_core::Result<Tensor> {
        lock(&self.out)
            .take()
            .ok_or_else(|| candle_core::Error::Msg("activation checkpoint op applied twice".into()))
    }
}

impl candle_core::CustomOp2 for Core {
    fn name(&self) -> &'static str {
        "activation-checkpoint"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        hand_on_cpu(&self.take_out()?)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        hand_on_cuda(&self.take_out()?)
    }

    fn bwd(
        &self,
        xs: &Tensor,
        marker: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad_in = self.recompute.backward(xs, grad)?;
        // The pins upstream run only if the marker gets a gradient.
        Ok((grad_in, Some(marker.zeros_like()?)))
    }
}

impl candle_core::CustomOp2 for Pin {
    fn name(&self) -> &'static str {
        "activation-checkpoint-pin"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        crate::util::pass_through::cpu(s, l)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::util::pass_through::cuda(s, l)
    }

    fn bwd(
        &self,
        marker: &Tensor,
        param: &Tensor,
        _res: &Tensor,
        _grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let g = match lock(&self.recompute.grads)[self.index].take() {
            Some(g) => Some(g),
            // A parameter the block did not use: candle's backward expects a gradient for a
            // tensor made by an op (DDP's copies), none for a variable.
            None if !param.is_variable() => Some(param.zeros_like()?),
            None => None,
        };
        Ok((Some(marker.zeros_like()?), g))
    }
}
