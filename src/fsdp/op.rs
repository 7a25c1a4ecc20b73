//! How a unit's output, computed without a graph, enters autograd's graph: [`UnitOp`], a custom
//! op over the unit's input and its first piece. Its forward hands on the output computed
//! beforehand; its backward gathers the unit's parameters again, rebuilds the unit over fresh
//! variables (and copies of its buffers, so that the recomputation updates no running
//! statistics a second time), recomputes the forward with a graph from the input,
//! back-propagates the output's gradient through it, and reduce-scatters the parameters'
//! gradient into this rank's pieces.
//!
//! The piece is an argument so that the op is in the graph even when the input needs no
//! gradient (a unit fed by the data). Its gradient is not returned to candle: it comes from a
//! reduce-scatter still in flight, which `FullyShardedDataParallel::backward` waits for.

use super::backend::Buffers;
use super::flat_param::FlatParam;
use crate::error::{Error, Result};
use crate::util::sync::lock;
use candle_core::{CpuStorage, Layout, Shape, Storage, Tensor, Var};
use std::sync::{Arc, Mutex};

/// Builds a unit's module over a `VarBuilder` and runs it on an input.
pub(crate) type Run =
    Arc<dyn Fn(candle_nn::VarBuilder, &Tensor) -> candle_core::Result<Tensor> + Send + Sync>;

/// The op that puts a unit's output into the graph (see the [module documentation](self)).
pub(crate) struct UnitOp {
    param: Arc<FlatParam>,
    run: Run,
    /// The output, computed before the op is applied; its forward takes it.
    out: Mutex<Option<Tensor>>,
    /// The training forward this use belongs to.
    iteration: u64,
    /// This use's place among the iteration's unit uses.
    use_index: usize,
}

impl UnitOp {
    /// `out` (computed from `xs` without a graph) as the output of a `UnitOp` over `xs` and the
    /// unit's first piece.
    pub fn attach(param: Arc<FlatParam>, run: Run, xs: &Tensor, out: Tensor) -> Result<Tensor> {
        // `out` may be a view (a narrow, a packed projection's part): the op's forward hands
        // on a compact copy of its values.
        let piece = param.pieces[0].as_tensor().clone();
        let op = UnitOp {
            iteration: param.iteration(),
            use_index: param.shared.note_use(param.id),
            param,
            run,
            out: Mutex::new(Some(out)),
        };
        Ok(xs.apply_op2(&piece, op)?)
    }

    fn take_out(&self) -> candle_core::Result<Tensor> {
        lock(&self.out)
            .take()
            .ok_or_else(|| candle_core::Error::Msg("fsdp-unit op applied twice".into()))
    }

    /// The backward (see the [module documentation](self)): the input's gradient.
    fn backward(&self, xs: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let now = self.param.iteration();
        if now != self.iteration {
            return Err(Error::FsdpUnit {
                unit: self.param.name.clone(),
                detail: format!(
                    "a backward went through the graph of a training forward of iteration {} \
                     while iteration {now} is the current one: the graph was already \
                     back-propagated by FullyShardedDataParallel::backward; run it once on the \
                     loss of the training forwards since the last one",
                    self.iteration
                ),
            });
        }
        let tensors = self.param.gather()?;
        // Backward meets the uses in reverse: the use before this one's gather travels while
        // this one recomputes.
        if let Some(before) = self.use_index.checked_sub(1) {
            if let Some(unit) = self.param.shared.used_at(before) {
                unit.prefetch()?;
            }
        }
        let vars = tensors
            .iter()
            .map(Var::from_tensor)
            .collect::<candle_core::Result<Vec<_>>>()?;
        drop(tensors);
        let vb = self.param.var_builder(
            vars.iter().map(|v| v.as_tensor().clone()).collect(),
            Buffers::Copied,
        )?;
        let input = Var::from_tensor(&xs.detach())?;
        let out = (self.run)(vb, input.as_tensor())?;
        let grads = crate::nn::backward(&(out * grad)?.sum_all()?)?;
        let grad_in = grads.get(input.as_tensor()).cloned();
        let param_grads = vars
            .iter()
            .map(|v| grads.get(v.as_tensor()).cloned())
            .collect();
        drop(grads);
        drop(vars);
        self.param.reduce_scatter(param_grads)?;
        Ok(grad_in)
    }
}

impl candle_core::CustomOp2 for UnitOp {
    fn name(&self) -> &'static str {
        "fsdp-unit"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = self.take_out()?;
        let (storage, layout) = out.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => crate::util::pass_through::cpu(s, layout),
            _ => candle_core::bail!("fsdp-unit: the unit's output is not on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let out = self.take_out()?;
        let (storage, layout) = out.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => crate::util::pass_through::cuda(s, layout),
            _ => candle_core::bail!("fsdp-unit: the unit's output is not on the GPU"),
        }
    }

    fn bwd(
        &self,
        xs: &Tensor,
        _piece: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad_in = self
            .backward(xs, grad)
            .map_err(|e| self.param.shared.fail(e))?;
        Ok((grad_in, None))
    }
}

/// The identity over a training forward's output that notes a backward through it, so that a
/// backward run outside `FullyShardedDataParallel::backward` (`loss.backward()`, candle's
/// `opt.backward_step(&loss)`), whose gradients nobody averages or hands to the optimizer, is
/// an error at the next forward rather than a model that silently never trains.
pub(crate) struct Seen {
    pub shared: Arc<super::flat_param::Shared>,
}

impl candle_core::CustomOp1 for Seen {
    fn name(&self) -> &'static str {
        "fsdp-output"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        crate::util::pass_through::cpu(s, l)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::util::pass_through::cuda(s, l)
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        self.shared
            .backward_ran
            .store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(Some(grad.clone()))
    }
}
