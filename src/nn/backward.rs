//! [`backward`]: candle's `loss.backward()`, with the variables' gradients from this crate's
//! layers stored as they are made instead of added to zeros.
//!
//! candle's backward adds every gradient an op returns to the store's entry for its input, and
//! an input met for the first time gets a fresh tensor of zeros to add to: for a variable used
//! once, as a layer's weight is, that is a tensor of zeros and a second copy of the gradient,
//! each as large as the weight, every step (64 MB each for a 4096 × 4096 layer, about a tenth
//! of the 25 M-parameter MLP's backward). Inside [`backward`], [`linear`](super::linear) and
//! its siblings, the norms and the convolutions hand the gradients of their variables here
//! instead; after candle's walk they go into the store as they are (summed where a variable got
//! several, or also one from candle). The result is the same gradients, to the bit where a
//! variable gets one gradient.
//!
//! A wrapper that builds the model over identity copies of its variables, to learn when each
//! gradient is complete (DistributedDataParallel), watches them with a [`GradientHook`]: the
//! layers then compute from the variable behind the copy, and its gradient goes to the hook,
//! whole, as soon as its last part is made (the parts: one per use by these layers since the
//! hook's last reset whose graph still lives, and the copy's own when the copy is in the
//! graph; a part expected but not made, from a graph kept beside the loss's, holds the
//! gradient to the end of the walk).
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
use candle_core::{Result, Tensor, TensorId, Var};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// What one [`backward`] collects: the gradients handed over by layers whose output is a node
/// of its loss's graph (the nodes found on the first hand-over: a graph without such layers
/// is not walked twice), and the parts of watched variables' gradients still incomplete.
struct Collected {
    loss: Tensor,
    nodes: Option<HashSet<TensorId>>,
    handed: Vec<(Tensor, Tensor)>,
    parts: HashMap<TensorId, Part>,
    /// The first failure to sum two parts, reported when the walk ends.
    error: Option<candle_core::Error>,
}

impl Collected {
    fn nodes(&mut self) -> &HashSet<TensorId> {
        let loss = &self.loss;
        self.nodes
            .get_or_insert_with(|| loss.sorted_nodes().iter().map(|n| n.id()).collect())
    }
}

/// The gradient of a watched variable so far, and how many parts made it.
struct Part {
    watched: Arc<Watched>,
    sum: Tensor,
    count: usize,
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
            parts: HashMap::new(),
            error: None,
        };
        FRAMES.with(|f| f.borrow_mut().push(collected));
        Frame
    }

    /// The gradients handed over so far, the watched variables' incomplete sums, and the
    /// first failure.
    fn take(&self) -> (Vec<(Tensor, Tensor)>, Vec<Part>, Option<candle_core::Error>) {
        FRAMES
            .with(|f| {
                f.borrow_mut().last_mut().map(|c| {
                    let parts = std::mem::take(&mut c.parts).into_values().collect();
                    (std::mem::take(&mut c.handed), parts, c.error.take())
                })
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
    let (handed, mut parts, error) = frame.take();
    drop(frame);
    let mut grads = walked?;
    if let Some(e) = error {
        return Err(e);
    }
    // Parts of watched gradients the walk left incomplete (a use counted that was not in this
    // graph) are complete now: the hooks get them, in the order of the variables.
    parts.sort_by_key(|p| p.watched.order);
    for p in parts {
        (p.watched.hook)(p.sum);
    }
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
/// candle's walk, or hands it to the variable's hook when it is [watched](GradientHook));
/// `grad` otherwise. A plain `backward()` of another graph on this thread meanwhile (inside an
/// op's backward, or a rayon job run while this thread waits) gets its gradients from candle as
/// always. A watched variable's gradient goes to its hook in a plain `backward()` too.
pub(super) fn hand_over(output: &Tensor, input: &Tensor, grad: Option<Tensor>) -> Option<Tensor> {
    let grad = grad?;
    if !input.is_variable() {
        return Some(grad);
    }
    let watched = watched(input.id());
    let complete = FRAMES.with(|f| {
        let mut frames = f.borrow_mut();
        let Some(frame) = frames.last_mut() else {
            return match &watched {
                Some(_) => Ok(grad),
                None => Err(Some(grad)),
            };
        };
        if !frame.nodes().contains(&output.id()) {
            return Err(Some(grad));
        }
        match &watched {
            Some(w) => add_part(frame, w, grad).ok_or(None),
            None => {
                frame.handed.push((input.clone(), grad));
                Err(None)
            }
        }
    });
    match (complete, watched) {
        (Ok(sum), Some(w)) => {
            (w.hook)(sum);
            None
        }
        (Ok(_), None) => unreachable!("only a watched variable's gradient completes"),
        (Err(back), _) => back,
    }
}

/// Adds `grad` to `w`'s gradient in `frame`; the sum, once every part expected is in (one per
/// live use by this crate's layers since the last reset, and one from the copy when the copy
/// is in the graph).
fn add_part(frame: &mut Collected, w: &Arc<Watched>, grad: Tensor) -> Option<Tensor> {
    let expected = w.live_uses() + usize::from(frame.nodes().contains(&w.copy));
    let key = w.var.id();
    let count = match frame.parts.get_mut(&key) {
        Some(part) => {
            match &part.sum + &grad {
                Ok(sum) => part.sum = sum,
                Err(e) => {
                    frame.error.get_or_insert(e);
                }
            }
            part.count += 1;
            part.count
        }
        None => {
            frame.parts.insert(
                key,
                Part {
                    watched: w.clone(),
                    sum: grad,
                    count: 1,
                },
            );
            1
        }
    };
    if count < expected {
        return None;
    }
    frame.parts.remove(&key).map(|p| p.sum)
}

/// A variable whose gradient a wrapper takes from [`backward`] as soon as it is complete
/// (DistributedDataParallel's parameters), through an identity copy of it that the model
/// holds.
struct Watched {
    var: Var,
    /// The copy the model holds (made by the wrapper's identity op).
    copy: TensorId,
    /// Where it came in among the watched variables (the order incomplete sums are handed on).
    order: usize,
    /// One reference per use of the variable by this crate's layers in place of the copy since
    /// the last [`GradientHook::reset_uses`] whose op still lives (its graph was not dropped:
    /// an evaluation's forward releases its uses with its output): how many parts its gradient
    /// may come in.
    uses: Mutex<Arc<()>>,
    hook: Box<dyn Fn(Tensor) + Send + Sync>,
}

/// The watched variables, by the ids of the variable and of its copy.
fn registry() -> &'static Mutex<HashMap<TensorId, Arc<Watched>>> {
    static WATCHED: OnceLock<Mutex<HashMap<TensorId, Arc<Watched>>>> = OnceLock::new();
    WATCHED.get_or_init(Mutex::default)
}

/// How many variables are watched: none, and a layer does not look.
static WATCHING: AtomicUsize = AtomicUsize::new(0);

fn watched(id: TensorId) -> Option<Arc<Watched>> {
    if WATCHING.load(Ordering::Relaxed) == 0 {
        return None;
    }
    crate::util::sync::lock(registry()).get(&id).cloned()
}

/// What watches `t` when `t` is a watched copy (not a watched variable).
fn watched_copy(t: &Tensor) -> Option<Arc<Watched>> {
    watched(t.id()).filter(|w| w.copy == t.id())
}

/// While it lives, `var`'s gradient goes to `hook` in one piece, as soon as it is complete,
/// instead of into the [`backward`]'s store: a wrapper's gradient hook (DistributedDataParallel
/// averages each parameter's gradient over the world as backward completes it).
///
/// The model holds `copy`, the output of the wrapper's identity op over `var` (whose backward
/// calls [`copy_gradient`]). Where the copy is in `var`'s own dtype (not a mixed-precision
/// cast) it holds `var`'s values, and this crate's layers compute from `var` itself instead
/// ([`through`]): `var`'s gradient from them is then stored as they make it, where candle
/// would add the copy's to a fresh tensor of zeros. The wrapper must refresh the copy from `var`
/// before each forward and call [`reset_uses`](Self::reset_uses) after each backward.
pub(crate) struct GradientHook {
    watched: Arc<Watched>,
}

impl GradientHook {
    /// Watches `var` through `copy` (of its dtype and shape); `order` ranks it among the
    /// variables its wrapper watches. `None` when another hook watches `var` already (two
    /// wrappers over one variable): the copy is then not watched.
    pub(crate) fn new(
        copy: &Tensor,
        var: &Var,
        order: usize,
        hook: impl Fn(Tensor) + Send + Sync + 'static,
    ) -> Option<Self> {
        let mut map = crate::util::sync::lock(registry());
        if map.contains_key(&var.id()) {
            return None;
        }
        let watched = Arc::new(Watched {
            var: var.clone(),
            copy: copy.id(),
            order,
            uses: Mutex::default(),
            hook: Box::new(hook),
        });
        map.insert(var.id(), watched.clone());
        map.insert(copy.id(), watched.clone());
        WATCHING.fetch_add(1, Ordering::Relaxed);
        Some(Self { watched })
    }

    /// Forgets the uses counted so far (graphs still held count no more): call it when a
    /// backward ended.
    pub(crate) fn reset_uses(&self) {
        *crate::util::sync::lock(&self.watched.uses) = Arc::new(());
    }
}

impl Drop for GradientHook {
    fn drop(&mut self) {
        let mut map = crate::util::sync::lock(registry());
        for id in [self.watched.var.id(), self.watched.copy] {
            if map.get(&id).is_some_and(|w| Arc::ptr_eq(w, &self.watched)) {
                map.remove(&id);
            }
        }
        WATCHING.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Watched {
    /// The uses by this crate's layers whose ops still live.
    fn live_uses(&self) -> usize {
        Arc::strong_count(&crate::util::sync::lock(&self.uses)) - 1
    }
}

/// One use of a watched variable by a layer's op, counted while it lives: the op keeps it
/// ([`Held`]), so the use ends with the op's graph.
pub(super) struct Use(#[allow(dead_code)] Arc<()>);

/// `t` as this crate's layers record it as an input: the variable behind a watched copy (its
/// use added to `uses`, for the op to hold), `t` itself otherwise.
pub(super) fn through(t: &Tensor, uses: &mut Vec<Use>) -> Tensor {
    match watched_copy(t) {
        Some(w) => {
            uses.push(Use(crate::util::sync::lock(&w.uses).clone()));
            w.var.as_tensor().clone()
        }
        None => t.clone(),
    }
}

/// A layer's op with the [`Use`]s of the watched variables it reads: candle's graph owns it,
/// so the uses end with the graph. Everything else is the op's.
pub(super) struct Held<O> {
    op: O,
    _uses: Vec<Use>,
}

impl<O> Held<O> {
    pub(super) fn new(op: O, uses: Vec<Use>) -> Self {
        Self { op, _uses: uses }
    }
}

impl<O: candle_core::CustomOp2> candle_core::CustomOp2 for Held<O> {
    fn name(&self) -> &'static str {
        self.op.name()
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        self.op.cpu_fwd(s1, l1, s2, l2)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CudaStorage,
        l2: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        self.op.cuda_fwd(s1, l1, s2, l2)
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        self.op.bwd(a, b, res, grad)
    }
}

impl<O: candle_core::CustomOp3> candle_core::CustomOp3 for Held<O> {
    fn name(&self) -> &'static str {
        self.op.name()
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
        s3: &candle_core::CpuStorage,
        l3: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        self.op.cpu_fwd(s1, l1, s2, l2, s3, l3)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CudaStorage,
        l2: &candle_core::Layout,
        s3: &candle_core::CudaStorage,
        l3: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        self.op.cuda_fwd(s1, l1, s2, l2, s3, l3)
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.op.bwd(a, b, c, res, grad)
    }
}

/// What a wrapper's identity op does in backward with the gradient of its output `copy`:
/// `false` when `copy` is not watched (the op hands `grad` on itself); otherwise it goes to the
/// hook, at once, or once the parts from this crate's layers are in too.
pub(crate) fn copy_gradient(copy: &Tensor, grad: &Tensor) -> bool {
    let Some(w) = watched_copy(copy) else {
        return false;
    };
    let complete = FRAMES.with(|f| match f.borrow_mut().last_mut() {
        Some(frame) if w.live_uses() > 0 => add_part(frame, &w, grad.clone()),
        _ => Some(grad.clone()),
    });
    if let Some(sum) = complete {
        (w.hook)(sum);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{CpuStorage, CustomOp1, Device, Layout, Module, Shape};
    use candle_nn::Linear;

    type Events = Arc<Mutex<Vec<&'static str>>>;

    /// An identity whose backward notes that it ran.
    struct Probe(Events);

    impl CustomOp1 for Probe {
        fn name(&self) -> &'static str {
            "probe"
        }

        fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
            crate::util::pass_through::cpu(s, l)
        }

        fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
            self.0.lock().unwrap().push("probe");
            Ok(Some(grad.clone()))
        }
    }

    /// The overlap DDP relies on: the hook gets a layer's weight gradient when the layer's
    /// backward made it, before the ops under the layer run theirs.
    #[test]
    fn a_watched_weight_reaches_its_hook_as_its_layer_finishes() -> Result<()> {
        let dev = Device::Cpu;
        let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 3), &dev)?)?;
        let copy = w.as_tensor().copy()?;
        let events: Events = Arc::default();
        let got = Arc::new(Mutex::new(None));
        let (e, g) = (events.clone(), got.clone());
        let hook = GradientHook::new(&copy, &w, 0, move |grad| {
            e.lock().unwrap().push("hook");
            *g.lock().unwrap() = Some(grad);
        })
        .expect("nothing else watches w");
        assert!(
            GradientHook::new(&copy, &w, 0, |_| {}).is_none(),
            "a second hook on one variable"
        );
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (5, 3), &dev)?)?;
        let probed = x.as_tensor().apply_op1(Probe(events.clone()))?;
        let layer = Linear::new(copy.clone(), None);
        let grads = backward(&super::super::linear(&probed, &layer)?.sqr()?.sum_all()?)?;
        assert_eq!(*events.lock().unwrap(), ["hook", "probe"]);
        assert!(grads.get(w.as_tensor()).is_none(), "the hook took it");
        assert!(grads.get(x.as_tensor()).is_some());
        let plain = Linear::new(w.as_tensor().clone(), None)
            .forward(x.as_tensor())?
            .sqr()?
            .sum_all()?
            .backward()?;
        let hooked = got.lock().unwrap().take().expect("the hook ran");
        let want = plain.get(w.as_tensor()).expect("w has a gradient");
        let diff = hooked.sub(want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        drop(hook);
        let mut uses = Vec::new();
        assert_eq!(
            through(&copy, &mut uses).id(),
            copy.id(),
            "unwatched once dropped"
        );
        assert!(uses.is_empty());
        Ok(())
    }
}
