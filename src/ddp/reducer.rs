//! The cross-device gradient reducer (torch's `Reducer`): gradients averaged over the world in
//! buckets, each all-reduced as soon as its gradients are ready, while backward goes on.
//!
//! The names follow c10d's `reducer.cpp`, so that the two read side by side. Each forward
//! starts an iteration ([`Reducer::prepare_for_backward`]). Each parameter's
//! [`GradReady`](super::hook::GradReady) reports its gradient as backward completes it
//! ([`Reducer::mark_ready`]). When every gradient of the next bucket is in, the bucket's
//! asynchronous all-reduce is issued on DDP's own group; buckets go strictly in bucket order,
//! so every rank issues the same collectives in the same order. When autograd is done,
//! [`Reducer::finalize_backward`] fills the gradients of parameters that got none (zeros: a
//! branch not taken on this rank), issues what is left, waits for every bucket in order and
//! hands out the averaged gradients. After the first iteration the buckets are rebuilt once
//! from the order in which gradients actually became ready (rank 0's, broadcast), as torch
//! does.
//!
//! A parameter that got no gradient on *any* rank (torch's `local_used_map` with
//! `find_unused_parameters`) gets none from `finalize_backward` either, so that an optimizer
//! leaves it as it is, as it would in one process: the ranks agree on who got a gradient with
//! one small all-reduce (a max over a 0/1 map, one entry per parameter). The buckets issued
//! during autograd differ in number between ranks, so that collective goes at a fixed place:
//! after every bucket was issued in `finalize_backward`, never among them. The parameter still
//! travels in its bucket (as zeros); it is only left out of the `GradStore`. Such parameters
//! are reported (see [`UnusedReport`]) unless declared frozen.
//!
//! Under [`no_sync`](super::DistributedDataParallel::no_sync) gradients are summed locally
//! instead, and the next synchronised backward all-reduces the sums.

use super::bucket::{assign_buckets, BucketParam};
use super::compression::Compression;
use super::integers;
use super::iteration::{Iteration, Phase};
use super::param::Param;
use super::unused::{describe, UnusedReport};
use super::zero2::Zero2;
use super::Sharding;
use crate::distributed::{ProcessGroup, ReduceOp, Work};
use crate::error::{Error, Result};
use crate::shard::FlatLayout;
use crate::util::sync::lock;
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What the reducer is told at construction.
pub(crate) struct Setup {
    pub group: ProcessGroup,
    pub params: Vec<Param>,
    /// Parameter indices in the order their gradients are expected to be ready.
    pub expected_order: Vec<usize>,
    pub first_bucket_bytes: usize,
    pub bucket_bytes: usize,
    pub compression: Compression,
    pub rebuild_buckets: bool,
    /// What to do about parameters with a gradient on no rank.
    pub unused_report: UnusedReport,
    /// Per parameter: declared frozen, so never reported.
    pub frozen: Vec<bool>,
    /// Whether gradients are all-reduced (every rank keeps them all) or reduce-scattered
    /// (each rank keeps its shard of each bucket).
    pub sharding: Sharding,
}

/// Timings of the last synchronised backward (for benchmarks).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BackwardStats {
    /// From the start of `backward` to the end of autograd (with the all-reduces issued
    /// meanwhile).
    pub autograd: Duration,
    /// From the end of autograd until every bucket was reduced: the communication that was
    /// not hidden behind backward.
    pub tail: Duration,
    /// The number of buckets.
    pub buckets: usize,
    /// The buckets issued before autograd ended.
    pub issued_during_autograd: usize,
}

/// Which parameters travel in which bucket: what `assign_buckets` gives, and each parameter's
/// bucket. Made from the expected order at construction, rebuilt once from the observed one.
struct Layout {
    /// Per bucket, its parameters, in the order they travel.
    buckets: Vec<Vec<usize>>,
    /// Per parameter, its bucket.
    bucket_of: Vec<usize>,
    /// Per bucket, its parameters cut into one chunk per rank, each rank's chunks laid end to
    /// end: what a reduce-scatter cuts and an all-gather puts together.
    flat: Vec<FlatLayout>,
}

impl Layout {
    /// The buckets of `setup`'s parameters, taken in `order`.
    fn new(setup: &Setup, order: &[usize]) -> Self {
        let params: Vec<BucketParam> = order
            .iter()
            .map(|&i| BucketParam {
                index: i,
                bytes: setup.params[i].bytes(),
                dtype: setup.params[i].grad_dtype,
            })
            .collect();
        let buckets = assign_buckets(&params, setup.first_bucket_bytes, setup.bucket_bytes);
        let mut bucket_of = vec![0; setup.params.len()];
        for (b, members) in buckets.iter().enumerate() {
            for &i in members {
                bucket_of[i] = b;
            }
        }
        let world = setup.group.world_size();
        let flat = buckets
            .iter()
            .map(|members| {
                let numels: Vec<usize> = members
                    .iter()
                    .map(|&i| setup.params[i].var.elem_count())
                    .collect();
                FlatLayout::new(&numels, world)
            })
            .collect();
        Self {
            buckets,
            bucket_of,
            flat,
        }
    }
}

/// What the reducer knows: its setup, the buckets, the current iteration, and what outlives an
/// iteration (no_sync sums, the last backward's timings and unused parameters).
struct State {
    setup: Setup,
    layout: Layout,
    iteration: Iteration,
    /// Sums of gradients from no_sync backwards, waiting for the next synchronised one.
    accumulated: Vec<Option<Tensor>>,
    /// Whether the buckets were rebuilt from an observed order yet.
    rebuilt: bool,
    stats: BackwardStats,
    /// The parameters with a gradient on no rank in the last synchronised backward.
    unused: Vec<usize>,
    /// The sets of such parameters reported so far (each once).
    reported: HashSet<Vec<usize>>,
    /// Under ZeRO-2, this rank's pieces, which the optimizer steps.
    zero2: Option<Zero2>,
    /// What the world's average is multiplied by in the next synchronised backward (under
    /// `join`, world / active ranks, to average over the ranks still training).
    scale: f64,
}

/// The reducer. Made empty, so that the model's `GradReady` ops can point at it while the
/// model is built; [`Reducer::configure`] gives it the parameters.
#[derive(Default)]
pub(crate) struct Reducer {
    state: Mutex<Option<State>>,
}

impl Reducer {
    /// Gives the reducer its parameters and their initial buckets; under ZeRO-2 cuts this
    /// rank's shards from the parameters' current values.
    pub fn configure(&self, setup: Setup) -> Result<()> {
        let layout = Layout::new(&setup, &setup.expected_order);
        let n = setup.params.len();
        let zero2 = match setup.sharding {
            Sharding::None => None,
            Sharding::Zero2 => Some(Zero2::cut(&setup.params, &setup.group)?),
        };
        *lock(&self.state) = Some(State {
            setup,
            layout,
            iteration: Iteration::default(),
            accumulated: vec![None; n],
            rebuilt: false,
            stats: BackwardStats::default(),
            unused: Vec::new(),
            reported: HashSet::new(),
            zero2,
            scale: 1.0,
        });
        Ok(())
    }

    /// Multiplies the averages of the next synchronised backward by `scale` (1 after it).
    pub fn scale_next_average(&self, scale: f64) {
        if let Some(st) = lock(&self.state).as_mut() {
            st.scale = scale;
        }
    }

    /// Under ZeRO-2, this rank's piece of each parameter, in the reducer's order; empty
    /// otherwise.
    pub fn pieces(&self) -> Vec<Var> {
        lock(&self.state)
            .as_ref()
            .and_then(|st| st.zero2.as_ref())
            .map(|z| z.pieces.clone())
            .unwrap_or_default()
    }

    /// Under ZeRO-2, cuts this rank's pieces again from the parameters' current values (after
    /// they were loaded); does nothing without sharding.
    pub fn recut_pieces(&self) -> Result<()> {
        let mut guard = lock(&self.state);
        match guard.as_mut() {
            Some(st) => match st.zero2.as_mut() {
                Some(z) => z.recut(&st.setup.params, &st.setup.group),
                None => Ok(()),
            },
            None => Ok(()),
        }
    }

    /// Under ZeRO-2, puts every rank's pieces together into the parameters: one all-gather per
    /// bucket, all issued before the first is waited for, so that they follow each other on
    /// the backend's thread (parameters written in the `VarMap` since first get their pieces
    /// cut again). Every rank must call it. Does nothing without sharding. This crate's
    /// optimizers call it at the end of their steps.
    pub fn gather_parameters(&self) -> Result<()> {
        let mut guard = lock(&self.state);
        let Some(st) = guard.as_mut() else {
            return Ok(());
        };
        let State {
            setup,
            layout,
            zero2,
            ..
        } = st;
        match zero2 {
            Some(z) => z.gather(&setup.params, &layout.buckets, &layout.flat, &setup.group),
            None => Ok(()),
        }
    }

    /// What a training forward does first under ZeRO-2: the gather, when any rank's pieces
    /// were stepped since the last one (not by this crate's optimizers, which gather), or a
    /// backward came since. Every rank must call it.
    pub fn before_training_forward(&self) -> Result<()> {
        let mut guard = lock(&self.state);
        let Some(st) = guard.as_mut() else {
            return Ok(());
        };
        let State {
            setup,
            layout,
            zero2,
            ..
        } = st;
        match zero2 {
            Some(z) => z.before_training_forward(
                &setup.params,
                &layout.buckets,
                &layout.flat,
                &setup.group,
            ),
            None => Ok(()),
        }
    }

    /// Under ZeRO-2, a parameter whose value in the model may be behind its pieces (the model
    /// would evaluate with weights of before a step), with no collective; see
    /// [`super::zero2`].
    pub fn stale_parameter(&self) -> Result<Option<String>> {
        let mut guard = lock(&self.state);
        match guard.as_mut() {
            Some(st) => match st.zero2.as_mut() {
                Some(z) => z.stale(&st.setup.params, &st.setup.group),
                None => Ok(None),
            },
            None => Ok(None),
        }
    }

    /// The buckets' parameter names, in bucket order.
    pub fn bucket_names(&self) -> Vec<Vec<String>> {
        let guard = lock(&self.state);
        let Some(st) = guard.as_ref() else {
            return Vec::new();
        };
        st.layout
            .buckets
            .iter()
            .map(|b| b.iter().map(|&i| st.setup.params[i].name.clone()).collect())
            .collect()
    }

    /// The names of the parameters with a gradient on no rank in the last synchronised
    /// backward, sorted.
    pub fn unused_names(&self) -> Vec<String> {
        let guard = lock(&self.state);
        let Some(st) = guard.as_ref() else {
            return Vec::new();
        };
        let mut names: Vec<String> = st
            .unused
            .iter()
            .map(|&i| st.setup.params[i].name.clone())
            .collect();
        names.sort();
        names
    }

    /// Timings of the last synchronised backward.
    pub fn stats(&self) -> BackwardStats {
        lock(&self.state)
            .as_ref()
            .map(|s| s.stats)
            .unwrap_or_default()
    }

    /// Starts an iteration (at each forward): gradients may come in, all-reduced when `sync`.
    /// Fails when the previous iteration's gradients came in but were never reduced (torch's
    /// check that the prior reduction finished).
    pub fn prepare_for_backward(&self, sync: bool) -> Result<()> {
        let mut guard = lock(&self.state);
        let st = guard.as_mut().expect("configured at construction");
        let unfinished = st.iteration.phase != Phase::Idle;
        if let Some(&first) = st.iteration.ready_order.first().filter(|_| unfinished) {
            let parameter = st.setup.params[first].name.clone();
            st.iteration = Iteration::default();
            return Err(Error::UnfinishedReduction { parameter });
        }
        let phase = if sync {
            Phase::Reducing
        } else {
            Phase::Accumulating
        };
        st.iteration = Iteration::start(phase, &st.layout.buckets, st.setup.params.len());
        Ok(())
    }

    /// Parameter `index`'s gradient is complete (called from backward). Errors are kept for
    /// [`Reducer::finalize_backward`], which is where the caller can act on them.
    pub fn mark_ready(&self, index: usize, grad: &Tensor) {
        let mut guard = lock(&self.state);
        let Some(st) = guard.as_mut() else { return };
        if let Err(e) = st.mark_ready(index, grad) {
            st.iteration.error.get_or_insert(e);
        }
    }

    /// Ends the iteration after autograd: hands out, in `grads`, each parameter's gradient
    /// averaged over the world (or, under no_sync, this rank's sum so far).
    pub fn finalize_backward(&self, grads: &mut GradStore, started: Instant) -> Result<()> {
        let mut guard = lock(&self.state);
        let st = guard.as_mut().expect("configured at construction");
        let result = st.finalize_backward(grads, started);
        // Issued collectives still run to the end, in their place.
        st.iteration = Iteration::default();
        result
    }
}

impl State {
    /// Takes parameter `index`'s gradient: into its bucket, issuing the buckets it completes,
    /// or under no_sync into this rank's sum (torch's `mark_variable_ready`).
    fn mark_ready(&mut self, index: usize, grad: &Tensor) -> Result<()> {
        let it = &mut self.iteration;
        let parameter = || self.setup.params[index].name.clone();
        if it.phase == Phase::Idle {
            return Err(Error::GradientOutsideIteration {
                parameter: parameter(),
            });
        }
        if it.grads[index].is_some() {
            return Err(Error::GradientTwice {
                parameter: parameter(),
            });
        }
        // Under mixed precision, averaged in the reduce dtype. A large gradient's cast splits
        // over rayon's threads while this lock is held; its blocks take no lock (ranks that
        // share one pool: see `threads::in_pool`).
        let grad = &crate::nn::cast(grad, self.setup.params[index].grad_dtype)?;
        let grad = match self.accumulated[index].take() {
            Some(sum) => (sum + grad)?,
            None => grad.clone(),
        };
        if it.phase == Phase::Accumulating {
            self.accumulated[index] = Some(grad);
            return Ok(());
        }
        it.grads[index] = Some(grad);
        it.ready_order.push(index);
        it.buckets[self.layout.bucket_of[index]].pending -= 1;
        self.issue_ready_buckets()
    }

    /// Issues every bucket whose gradients are all in, strictly in bucket order (torch's
    /// `mark_bucket_ready`): one all-reduce of the bucket's gradients, so that backward is not
    /// held up copying them. With one rank the average is the gradient itself: nothing is sent.
    fn issue_ready_buckets(&mut self) -> Result<()> {
        let (group, compression) = (&self.setup.group, self.setup.compression);
        let it = &mut self.iteration;
        while let Some(bucket) = it.buckets.get_mut(it.next).filter(|b| b.pending == 0) {
            let b = it.next;
            it.next += 1;
            if group.world_size() == 1 {
                continue;
            }
            let grads: Vec<Tensor> = bucket
                .params
                .iter()
                .map(|&i| it.grads[i].clone().expect("the bucket is complete"))
                .collect();
            bucket.work = Some(match self.setup.sharding {
                Sharding::None => compression.all_reduce_async(group, &grads)?,
                Sharding::Zero2 => {
                    let flat = self.layout.flat[b].flatten(&grads)?;
                    // The flat copy travels: the gradients themselves are no longer needed.
                    for &i in &bucket.params {
                        it.grads[i] = None;
                    }
                    compression
                        .reduce_scatter_async(group, &flat)?
                        .map(|shard| Ok(vec![shard]))
                }
            });
        }
        Ok(())
    }

    /// Completes every bucket: a parameter that got no gradient on this rank (a branch not
    /// taken here) contributes its no_sync sums, or zeros.
    fn fill_missing_gradients(&mut self) -> Result<()> {
        let it = &mut self.iteration;
        // The buckets already issued had every gradient.
        for bucket in it.buckets.iter_mut().skip(it.next) {
            for &i in &bucket.params {
                if it.grads[i].is_none() {
                    let g = match self.accumulated[i].take() {
                        Some(sum) => sum,
                        None => {
                            let p = &self.setup.params[i];
                            Tensor::zeros(p.var.shape(), p.grad_dtype, p.var.device())?
                        }
                    };
                    it.grads[i] = Some(g);
                    bucket.pending -= 1;
                }
            }
        }
        Ok(())
    }

    /// Completes and issues every bucket, agrees with the other ranks on which parameters got
    /// a gradient anywhere, waits for the buckets in order and puts the averages in `grads`.
    fn finalize_backward(&mut self, grads: &mut GradStore, started: Instant) -> Result<()> {
        if self.iteration.phase == Phase::Idle {
            return Err(Error::BackwardWithoutForward);
        }
        if let Some(e) = self.iteration.error.take() {
            return Err(e);
        }
        if self.iteration.phase == Phase::Accumulating {
            self.refuse_direct_uses(grads)?;
            for (p, sum) in self.setup.params.iter().zip(&self.accumulated) {
                if let Some(sum) = sum {
                    grads.insert(p.var.as_tensor(), sum.clone());
                }
            }
            return Ok(());
        }
        let autograd_done = Instant::now();
        let issued_during_autograd = self.iteration.next;
        let n = self.setup.params.len();
        // A gradient now, or sums from no_sync micro-steps: either counts as one.
        let mut used_here: Vec<bool> = (0..n).map(|i| self.accumulated[i].is_some()).collect();
        for &i in &self.iteration.ready_order {
            used_here[i] = true;
        }
        self.fill_missing_gradients()?;
        self.issue_ready_buckets()?;
        // After the last bucket, on every rank: which parameters got a gradient anywhere.
        let used_anywhere = self.all_reduce_local_used_map(&used_here)?;
        // Per parameter: its averaged gradient, or under ZeRO-2 this rank's chunk of it.
        let mut averaged: Vec<Option<Tensor>> = vec![None; n];
        let it = &mut self.iteration;
        for (b, bucket) in it.buckets.iter_mut().enumerate() {
            let reduced = bucket.wait(&mut it.grads)?;
            let reduced = match self.setup.sharding {
                Sharding::None => reduced,
                Sharding::Zero2 => {
                    // With one rank nothing travelled: the shard is the whole bucket.
                    let shard = match self.setup.group.world_size() {
                        1 => self.layout.flat[b].shard(&reduced, 0)?,
                        _ => reduced.into_iter().next().expect("one shard per bucket"),
                    };
                    self.layout.flat[b].split_shard(&shard)?
                }
            };
            for (&i, g) in bucket.params.iter().zip(reduced) {
                averaged[i] = Some(g);
            }
        }
        let used_anywhere: Vec<bool> = match used_anywhere {
            Some(work) => integers::from_tensor(&work.wait()?)?
                .into_iter()
                .map(|u| u > 0)
                .collect(),
            None => used_here,
        };
        self.unused = (0..n).filter(|&i| !used_anywhere[i]).collect();
        // After this iteration's collectives, so that a rank that fails here leaves none half
        // done on the others.
        self.refuse_direct_uses(grads)?;
        let scale = std::mem::replace(&mut self.scale, 1.0);
        let scaled =
            |g: Tensor| -> Result<Tensor> { Ok(if scale == 1.0 { g } else { (g * scale)? }) };
        // A parameter used on no rank gets no gradient, nor (under ZeRO-2) do its pieces: the
        // optimizer leaves it and its state as they are, as in one process.
        let mut handed_out = false;
        for (i, g) in averaged.into_iter().enumerate() {
            let var = match &self.zero2 {
                Some(z) => &z.pieces[i],
                None => &self.setup.params[i].var,
            };
            if let Some(g) = g.filter(|_| used_anywhere[i]) {
                grads.insert(var.as_tensor(), scaled(crate::nn::cast(&g, var.dtype())?)?);
                handed_out = true;
            }
        }
        if let Some(z) = self.zero2.as_mut() {
            z.backward_done(handed_out);
        }
        self.stats = BackwardStats {
            autograd: autograd_done - started,
            tail: autograd_done.elapsed(),
            buckets: self.layout.buckets.len(),
            issued_during_autograd,
        };
        // The pieces do not depend on the buckets: they can be rebuilt under ZeRO-2 too.
        if self.setup.rebuild_buckets && !self.rebuilt {
            self.rebuild_buckets()?;
        }
        self.report_unused()
    }

    /// Fails when `grads` (candle's backward of the loss) holds a gradient of a variable
    /// itself: the model computes with copies, so that gradient comes from a direct use of the
    /// variable, which the averaged gradient handed out would overwrite in silence.
    fn refuse_direct_uses(&self, grads: &GradStore) -> Result<()> {
        let direct = self
            .setup
            .params
            .iter()
            .find(|p| grads.get(p.var.as_tensor()).is_some());
        match direct {
            Some(p) => Err(Error::VariableUsedDirectly {
                rank: self.setup.group.rank(),
                parameter: p.name.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Issues the all-reduce (max) of this rank's 0/1 map of parameters that got a gradient
    /// (torch's `local_used_map`); `None` with one rank, whose map is the world's.
    fn all_reduce_local_used_map(&self, used_here: &[bool]) -> Result<Option<Work<Tensor>>> {
        let group = &self.setup.group;
        let Some(first) = self.setup.params.first() else {
            return Ok(None);
        };
        if group.world_size() == 1 {
            return Ok(None);
        }
        let map = integers::to_tensor(
            used_here.iter().map(|&u| usize::from(u)),
            first.var.device(),
        )?;
        Ok(Some(group.all_reduce_async(&map, ReduceOp::Max)?))
    }

    /// Tells the user about the parameters with a gradient on no rank that are not declared
    /// frozen: a warning from rank 0, once per distinct set, or an error on every rank.
    fn report_unused(&mut self) -> Result<()> {
        // In index order, as `unused` is.
        let set: Vec<usize> = self
            .unused
            .iter()
            .copied()
            .filter(|&i| !self.setup.frozen[i])
            .collect();
        if set.is_empty() {
            return Ok(());
        }
        let mut names: Vec<String> = set
            .iter()
            .map(|&i| self.setup.params[i].name.clone())
            .collect();
        names.sort();
        match self.setup.unused_report {
            UnusedReport::Error => Err(Error::ParametersWithoutGradient {
                summary: describe(&names),
                names,
            }),
            UnusedReport::Warn => {
                if self.setup.group.rank() == 0 && self.reported.insert(set) {
                    log::warn!(
                        "DistributedDataParallel: {}; or set DdpConfig::unused_report to \
                         UnusedReport::Error to make this an error.",
                        describe(&names)
                    );
                }
                Ok(())
            }
        }
    }

    /// Rebuilds the buckets from the order gradients came in on rank 0 (the parameters that
    /// got none there last), broadcast so that every rank builds the same buckets.
    fn rebuild_buckets(&mut self) -> Result<()> {
        let n = self.setup.params.len();
        let mut order = self.iteration.ready_order.clone();
        let mut seen = vec![false; n];
        for &i in &order {
            seen[i] = true;
        }
        order.extend(
            self.setup
                .expected_order
                .iter()
                .copied()
                .filter(|&i| !seen[i]),
        );
        let device = self
            .setup
            .params
            .first()
            .map_or(Device::Cpu, |p| p.var.device().clone());
        let mine = integers::to_tensor(order, &device)?;
        let agreed = integers::from_tensor(&self.setup.group.broadcast(&mine, 0)?)?;
        self.layout = Layout::new(&self.setup, &agreed);
        self.rebuilt = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::spawn_threads;
    use candle_core::DType;

    /// A reducer of one parameter `w`, as DistributedDataParallel configures it.
    fn reducer(group: ProcessGroup, w: &Var) -> Reducer {
        let reducer = Reducer::default();
        reducer
            .configure(Setup {
                group,
                params: vec![Param {
                    name: "w".into(),
                    var: w.clone(),
                    grad_dtype: w.dtype(),
                }],
                expected_order: vec![0],
                first_bucket_bytes: 1 << 20,
                bucket_bytes: 25 << 20,
                compression: Compression::None,
                rebuild_buckets: true,
                unused_report: UnusedReport::Warn,
                frozen: vec![false],
                sharding: Sharding::None,
            })
            .unwrap();
        reducer
    }

    #[test]
    fn each_misuse_is_an_error_that_names_it_and_the_next_iteration_works() {
        spawn_threads(1, |pg| {
            let w = Var::ones(2, DType::F32, &Device::Cpu)?;
            let r = reducer(pg, &w);
            // Candle's backward of a loss of the model's copies: no gradient of `w` itself.
            let other = Var::ones(1, DType::F32, &Device::Cpu)?;
            let mut grads = other.as_tensor().sum_all()?.backward()?;
            let g = Tensor::new(&[2f32, 3.], &Device::Cpu)?;
            let named_w = |e: &Error| e.to_string().contains("`w`");

            let err = r.finalize_backward(&mut grads, Instant::now()).unwrap_err();
            assert!(matches!(err, Error::BackwardWithoutForward), "{err}");

            let outside = lock(&r.state).as_mut().unwrap().mark_ready(0, &g);
            let err = outside.unwrap_err();
            assert!(matches!(err, Error::GradientOutsideIteration { .. }) && named_w(&err));

            r.prepare_for_backward(true)?;
            r.mark_ready(0, &g);
            r.mark_ready(0, &g);
            let err = r.finalize_backward(&mut grads, Instant::now()).unwrap_err();
            assert!(matches!(err, Error::GradientTwice { .. }) && named_w(&err));

            r.prepare_for_backward(true)?;
            r.mark_ready(0, &g);
            let err = r.prepare_for_backward(true).unwrap_err();
            assert!(matches!(err, Error::UnfinishedReduction { .. }) && named_w(&err));

            // A loss that used `w` itself: its gradient would be replaced in silence.
            r.prepare_for_backward(true)?;
            r.mark_ready(0, &g);
            let mut direct = w.as_tensor().sum_all()?.backward()?;
            let err = r
                .finalize_backward(&mut direct, Instant::now())
                .unwrap_err();
            assert!(matches!(err, Error::VariableUsedDirectly { .. }) && named_w(&err));

            r.prepare_for_backward(true)?;
            r.mark_ready(0, &g);
            r.finalize_backward(&mut grads, Instant::now())?;
            assert_eq!(grads.get(&w).unwrap().to_vec1::<f32>()?, [2., 3.]);
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn under_no_sync_gradients_are_summed_until_the_next_synchronised_backward() {
        spawn_threads(1, |pg| {
            let w = Var::ones(2, DType::F32, &Device::Cpu)?;
            let r = reducer(pg, &w);
            // Each backward's own store, of a loss of the model's copies (not of `w` itself).
            let other = Var::ones(1, DType::F32, &Device::Cpu)?;
            let store = || other.as_tensor().sum_all()?.backward();
            let g = Tensor::new(&[2f32, 3.], &Device::Cpu)?;
            r.prepare_for_backward(false)?;
            r.mark_ready(0, &g);
            let mut grads = store()?;
            r.finalize_backward(&mut grads, Instant::now())?;
            assert_eq!(grads.get(&w).unwrap().to_vec1::<f32>()?, [2., 3.]);
            r.prepare_for_backward(true)?;
            r.mark_ready(0, &g);
            let mut grads = store()?;
            r.finalize_backward(&mut grads, Instant::now())?;
            assert_eq!(grads.get(&w).unwrap().to_vec1::<f32>()?, [4., 6.]);
            Ok(())
        })
        .unwrap();
    }
}
