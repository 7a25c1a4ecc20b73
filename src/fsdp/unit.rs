//! Units: the parts of a model that FullyShardedDataParallel gathers, uses and frees one at a
//! time. The model marks them where it builds them, with [`unit`].
//!
//! A candle module holds its weight tensors from the moment it is built, so a unit is kept as
//! its constructor, not as a module: FullyShardedDataParallel builds it over the gathered
//! tensors at each use and drops it right after. Outside FullyShardedDataParallel (one process,
//! DDP) [`unit`] builds the module at once and a [`Unit`] is a plain wrapper around it, so one
//! model definition serves every way of training.

use super::backend::{Buffers, Recording, Source};
use super::flat_param::{FlatParam, Shared, UNPREFIXED};
use super::op::{Run, UnitOp};
use crate::error::{Error, Result};
use candle_core::{Module, ModuleT, Tensor};
use candle_nn::VarBuilder;
use std::cell::RefCell;
use std::sync::Arc;

/// Builds a unit's module from a `VarBuilder`.
type Build<M> = Arc<dyn Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync>;

/// A part of a model that FullyShardedDataParallel shards as one (see [`unit`]).
pub struct Unit<M> {
    inner: Inner<M>,
}

enum Inner<M> {
    /// Built at once: outside FullyShardedDataParallel.
    Eager(M),
    /// Kept as its shard and its constructor.
    Sharded {
        param: Arc<FlatParam>,
        build: Build<M>,
        /// Whether its uses enter autograd's graph (a training forward).
        graph: bool,
    },
    /// Recorded while FullyShardedDataParallel looked at the model at construction; that
    /// model is never run.
    Recorded,
}

/// Marks the module that `build` constructs from `vb` as a unit: under
/// FullyShardedDataParallel its parameters are sharded together, gathered for each use and
/// freed after it; anywhere else `build(vb)` runs at once and the unit is the module.
///
/// `build` must construct the same module each time it is called (FullyShardedDataParallel
/// calls it at every use, forward and backward), and the module must compute the same output
/// each time for the same input (no dropout: the backward recomputes the forward).
///
/// ```rust
/// use candle_core::{DType, Device, Module, Tensor};
/// use candle_nn::{linear, VarBuilder, VarMap};
/// use candle_parallel::fsdp;
/// # fn main() -> candle_core::Result<()> {
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// // Outside FullyShardedDataParallel the unit is built at once, and works as the layer.
/// let layer = fsdp::unit(vb.pp("fc"), |vb| linear(4, 2, vb))?;
/// assert_eq!(layer.forward(&Tensor::ones((3, 4), DType::F32, &Device::Cpu)?)?.dims(), [3, 2]);
/// assert_eq!(varmap.all_vars().len(), 2);
/// # Ok(()) }
/// ```
pub fn unit<M, F>(vb: VarBuilder, build: F) -> candle_core::Result<Unit<M>>
where
    M: 'static,
    F: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
{
    let context = BUILDING.with(|b| b.borrow().clone());
    match context {
        None => Ok(Unit {
            inner: Inner::Eager(build(vb)?),
        }),
        Some(Context::Record { shared, source }) => {
            let prefix = vb.prefix();
            let recording = Recording::new(source);
            let inside = recording.var_builder(&prefix, vb.dtype(), vb.device());
            let module = in_unit(&shared, &prefix, || build(inside))?;
            drop(module);
            let recorded = recording.take();
            let param = FlatParam::new(
                &shared,
                unit_name(&prefix),
                recorded.params,
                recorded.buffers,
            )
            .map_err(|e| shared.fail(e))?;
            RECORDED.with(|r| r.borrow_mut().push(param));
            Ok(Unit {
                inner: Inner::Recorded,
            })
        }
        Some(Context::Nested { shared, outer }) => Err(shared.fail(Error::FsdpUnit {
            unit: unit_name(&vb.prefix()).to_string(),
            detail: format!(
                "it is built inside unit `{outer}`: units do not nest; mark the inner modules \
                 or the outer one, not both"
            ),
        })),
        Some(Context::Serve { shared, graph, .. }) => {
            let prefix = vb.prefix();
            let next = BUILDING.with(|b| b.borrow_mut().as_mut().and_then(Context::next_unit));
            let param = match next {
                Some(p) if p.name == unit_name(&prefix) => p,
                other => {
                    let detail = match other {
                        Some(p) => format!(
                            "the model asked for unit `{}` at this point when FullyShardedDataParallel \
                             was built, and now for `{}`: the model's constructor must ask for the \
                             same units in the same order each time",
                            p.name,
                            unit_name(&prefix)
                        ),
                        None => "the model asks for more units than when FullyShardedDataParallel \
                                 was built: the model's constructor must ask for the same units \
                                 each time"
                            .to_string(),
                    };
                    return Err(shared.fail(Error::FsdpUnit {
                        unit: unit_name(&prefix).to_string(),
                        detail,
                    }));
                }
            };
            Ok(Unit {
                inner: Inner::Sharded {
                    param,
                    build: Arc::new(build),
                    graph,
                },
            })
        }
    }
}

/// A unit's name in messages: its prefix, or [`UNPREFIXED`].
fn unit_name(prefix: &str) -> &str {
    if prefix.is_empty() {
        UNPREFIXED
    } else {
        prefix
    }
}

/// Runs a unit's constructor at construction, where another unit inside it is an error.
fn in_unit<R>(
    shared: &Arc<Shared>,
    prefix: &str,
    build: impl FnOnce() -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let nested = Context::Nested {
        shared: shared.clone(),
        outer: unit_name(prefix).to_string(),
    };
    with_context(nested, build)
}

impl<M> Unit<M> {
    /// The module, when the unit was built at once (outside FullyShardedDataParallel).
    pub fn module(&self) -> Option<&M> {
        match &self.inner {
            Inner::Eager(m) => Some(m),
            _ => None,
        }
    }
}

impl<M: 'static> Unit<M> {
    /// Runs `f` on the module and `xs`: the way to call a module whose forward takes more than
    /// the input (a mask, positions). Only `xs` is differentiated through: tensors that `f`
    /// captures are constants, and get no gradient.
    pub fn forward_with<F>(&self, xs: &Tensor, f: F) -> candle_core::Result<Tensor>
    where
        F: Fn(&M, &Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        match &self.inner {
            Inner::Eager(m) => f(m, xs),
            Inner::Recorded => candle_core::bail!(
                "a unit of the model FullyShardedDataParallel builds to record its units was \
                 run: that model is only looked at"
            ),
            Inner::Sharded {
                param,
                build,
                graph,
            } => {
                let build = build.clone();
                let run: Run = Arc::new(move |vb: VarBuilder, x: &Tensor| f(&build(vb)?, x));
                apply(param, run, xs, *graph).map_err(|e| param.shared.fail(e))
            }
        }
    }
}

impl<M: Module + 'static> Module for Unit<M> {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_with(xs, |m, x| m.forward(x))
    }
}

impl<M: ModuleT + 'static> Unit<M> {
    /// The module's `forward_t` (a unit whose module is `ModuleT` but not `Module`).
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.forward_with(xs, move |m, x| m.forward_t(x, train))
    }
}

/// One use of a sharded unit: gather, build, compute without a graph, free; in a training
/// forward the output then enters the graph through [`UnitOp`], whose backward recomputes.
fn apply(param: &Arc<FlatParam>, run: Run, xs: &Tensor, graph: bool) -> Result<Tensor> {
    let gathered = param.gather()?;
    // The next unit's all-gather travels while this one computes.
    if let Some(next) = param.shared.unit(param.id + 1) {
        next.prefetch()?;
    }
    let vb = param.var_builder(gathered, Buffers::Live)?;
    let out = run(vb, &xs.detach())?;
    if !graph {
        return Ok(out);
    }
    if out.track_op() {
        // Computed from a detached input and untracked parameters, so the forward captured a
        // tensor that needs a gradient: the unit's backward could not hand it on.
        return Err(Error::FsdpUnit {
            unit: param.name.clone(),
            detail: "its forward used a tensor that needs a gradient besides its input (a \
                     parameter of the root or of another unit, or an activation): its gradient \
                     cannot reach it through the unit's recomputation; pass it as the unit's \
                     input, make it a parameter of the unit, or detach it if it is a constant"
                .into(),
        });
    }
    UnitOp::attach(param.clone(), run, xs, out)
}

/// What a model's construction under FullyShardedDataParallel shares with [`unit`].
#[derive(Clone)]
enum Context {
    /// The first build: each unit is built once to record its variables, and sharded.
    Record {
        shared: Arc<Shared>,
        source: Arc<Source>,
    },
    /// Inside a unit's constructor at the first build.
    Nested { shared: Arc<Shared>, outer: String },
    /// Each use: units are handed their flat parameters, in order.
    Serve {
        shared: Arc<Shared>,
        units: Arc<Vec<Arc<FlatParam>>>,
        next: usize,
        graph: bool,
    },
}

impl Context {
    fn next_unit(&mut self) -> Option<Arc<FlatParam>> {
        match self {
            Context::Serve { units, next, .. } => {
                let p = units.get(*next).cloned();
                *next += 1;
                p
            }
            _ => None,
        }
    }
}

thread_local! {
    static BUILDING: RefCell<Option<Context>> = const { RefCell::new(None) };
    /// The units recorded by the construction under way.
    static RECORDED: RefCell<Vec<Arc<FlatParam>>> = const { RefCell::new(Vec::new()) };
}

/// Puts the outer context back when dropped, also when the build panics.
struct Restore(Option<Option<Context>>);

impl Drop for Restore {
    fn drop(&mut self) {
        if let Some(outer) = self.0.take() {
            BUILDING.with(|b| *b.borrow_mut() = outer);
        }
    }
}

fn with_context<R>(context: Context, build: impl FnOnce() -> R) -> R {
    let outer = BUILDING.with(|b| b.borrow_mut().replace(context));
    let _restore = Restore(Some(outer));
    build()
}

/// Runs the model's first build (`build`, over a recording `VarBuilder` made by the caller):
/// each [`unit`] it asks for is built once, recorded and sharded. Returns the build's result
/// and the units' flat parameters, in order.
pub(crate) fn record<R>(
    shared: &Arc<Shared>,
    source: &Arc<Source>,
    build: impl FnOnce() -> R,
) -> (R, Vec<Arc<FlatParam>>) {
    let outer = RECORDED.with(|r| std::mem::take(&mut *r.borrow_mut()));
    let context = Context::Record {
        shared: shared.clone(),
        source: source.clone(),
    };
    let out = with_context(context, build);
    let units = RECORDED.with(|r| std::mem::replace(&mut *r.borrow_mut(), outer));
    (out, units)
}

/// Runs a later build of the model (`build`): each [`unit`] it asks for gets the next of
/// `units`. Fails when it asks for fewer units than there are.
pub(crate) fn serve<R>(
    shared: &Arc<Shared>,
    units: &Arc<Vec<Arc<FlatParam>>>,
    graph: bool,
    build: impl FnOnce() -> candle_core::Result<R>,
) -> Result<R> {
    let context = Context::Serve {
        shared: shared.clone(),
        units: units.clone(),
        next: 0,
        graph,
    };
    let outer = BUILDING.with(|b| b.borrow_mut().replace(context));
    let restore = Restore(Some(outer));
    let out = build();
    let used = BUILDING.with(|b| match &*b.borrow() {
        Some(Context::Serve { next, .. }) => *next,
        _ => 0,
    });
    drop(restore);
    let out = out.map_err(|e| shared.take_error().unwrap_or(Error::Candle(e)))?;
    if used < units.len() {
        return Err(Error::FsdpUnit {
            unit: units[used].name.clone(),
            detail: format!(
                "the model asked for {used} units, and for {} when FullyShardedDataParallel was \
                 built: the model's constructor must ask for the same units each time",
                units.len()
            ),
        });
    }
    Ok(out)
}
