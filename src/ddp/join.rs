//! Uneven inputs: ranks whose data runs out first shadow the collectives of those still
//! training (torch's `Join` context with DDP's join hook), so that nobody hangs and the last
//! batches still count.

use super::{integers, DistributedDataParallel};
use crate::distributed::ReduceOp;
use crate::error::{Error, Result};
use crate::util::sync::lock;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use candle_nn::{ModuleT, Optimizer};
use std::sync::atomic::Ordering;
use std::time::Instant;

/// What the gradients of an iteration in which some ranks have joined are averaged over.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum JoinDivisor {
    /// The whole world, the joined ranks counting as zeros (torch's default,
    /// `divide_by_initial_world_size=True`): each batch weighs the same whenever it comes.
    #[default]
    World,
    /// The ranks still training: the average over the batches of the iteration, as one process
    /// would take it over those batches.
    Active,
}

impl<M: ModuleT> DistributedDataParallel<M> {
    /// Runs `train`, this rank's training loop, so that ranks with fewer batches than others
    /// neither hang nor make the others hang (torch's `with Join([model]):`). Every rank calls it.
    ///
    /// Inside, every synchronised [`forward_t`](Self::forward_t) first counts the ranks still
    /// training (one small all-reduce). Once `train` returns here, this rank shadows the others'
    /// iterations until every rank is done: for each, it joins the buffer broadcast, (under
    /// ZeRO-2) the parameter gather, and every gradient bucket with zeros, and steps `opt` with
    /// the averaged gradients it gets, so that its parameters and optimizer state stay those
    /// of the ranks still training. `divisor` says what an iteration's gradients are averaged
    /// over when some ranks have joined.
    ///
    /// Inside `train`, each forward must be a training forward followed by
    /// [`backward`](Self::backward) and one `opt.step` of the gradients as they are (the shadow
    /// mirrors exactly that), with the optimizer's learning rate changed the same way on every
    /// rank (a joined rank keeps the last one it set). A loop that does more between backward
    /// and step (clipping, a [`GradScaler`](crate::amp::GradScaler)) uses
    /// [`join_with`](Self::join_with) instead: inside `join`, both refuse at once, naming it.
    /// `no_sync` and SyncBatchNorm cannot be mixed with
    /// joining: they are an error. If `train` fails, the error is returned at once and the
    /// other ranks see this rank as lost at their next collective.
    ///
    /// When every rank is done, the ranks compare a fingerprint of their parameters (one small
    /// all-reduce): replicas that differ, because the loop did something the shadow could not
    /// mirror, are an [`Error::Mismatch`], never a silent divergence.
    ///
    /// ```rust
    /// use candle_core::{Device, Tensor};
    /// use candle_nn::{linear, Optimizer, VarMap};
    /// use candle_parallel::ddp::JoinDivisor;
    /// use candle_parallel::optim::{Sgd, SgdConfig};
    /// use candle_parallel::{distributed, DistributedDataParallel};
    /// # fn main() -> candle_parallel::Result<()> {
    /// let weights = distributed::spawn_threads(2, |pg| {
    ///     let varmap = VarMap::new();
    ///     let model = DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, |vb| linear(3, 1, vb))?;
    ///     let mut opt = Sgd::new(model.parameters(), SgdConfig { lr: 0.1, ..Default::default() })?;
    ///     let batches = 2 + pg.rank(); // rank 0 has 2 batches, rank 1 has 3
    ///     model.join(&mut opt, JoinDivisor::Active, |opt| {
    ///         for _ in 0..batches {
    ///             let x = Tensor::ones((4, 3), candle_core::DType::F32, &Device::Cpu)?;
    ///             let loss = model.forward_t(&x, true)?.sqr()?.mean_all()?;
    ///             opt.step(&model.backward(&loss)?)?;
    ///         }
    ///         Ok(())
    ///     })?;
    ///     Ok(model.parameters()[1].to_vec2::<f32>()?) // the weight (sorted by name)
    /// })?;
    /// assert_eq!(weights[0], weights[1]); // rank 0 took rank 1's third step too
    /// # Ok(()) }
    /// ```
    pub fn join<O: Optimizer, T>(
        &self,
        opt: &mut O,
        divisor: JoinDivisor,
        train: impl FnOnce(&mut O) -> Result<T>,
    ) -> Result<T> {
        let step = |opt: &mut O, grads: GradStore| -> Result<()> { Ok(opt.step(&grads)?) };
        self.join_inner(opt, divisor, step, train, true)
    }

    /// [`join`](Self::join) for a loop whose step is more than `opt.step(&grads)`: `step` takes
    /// the training state (an optimizer, a scaler: whatever `train` steps with) and the
    /// averaged gradients of one iteration, and does what the loop does with them (clipping,
    /// unscaling, stepping, updating a scale). `train` calls the same `step` after each
    /// [`backward`](Self::backward); a joined rank calls it with the gradients it shadows, so
    /// that every rank clips by the same norm, skips the same steps and keeps the same scale,
    /// and the collectives inside `step` (clipping under ZeRO-2,
    /// [`GradScaler::for_group`](crate::amp::GradScaler::for_group)) have a partner.
    ///
    /// ```rust
    /// use candle_core::backprop::GradStore;
    /// use candle_core::{Device, Tensor};
    /// use candle_nn::{linear, Optimizer, VarMap};
    /// use candle_parallel::amp::{GradScaler, GradScalerConfig};
    /// use candle_parallel::ddp::JoinDivisor;
    /// use candle_parallel::optim::{Sgd, SgdConfig};
    /// use candle_parallel::{distributed, DistributedDataParallel};
    /// # fn main() -> candle_parallel::Result<()> {
    /// let weights = distributed::spawn_threads(2, |pg| {
    ///     let varmap = VarMap::new();
    ///     let model = DistributedDataParallel::new(&varmap, &pg, &Device::Cpu, |vb| linear(3, 1, vb))?;
    ///     let opt = Sgd::new(model.parameters(), SgdConfig { lr: 0.1, ..Default::default() })?;
    ///     let scaler = GradScaler::for_group(GradScalerConfig::default(), &pg, &Device::Cpu)?;
    ///     let step = |(opt, scaler): &mut (Sgd, GradScaler), mut grads: GradStore| {
    ///         scaler.unscale(&mut grads, opt.vars())?;
    ///         model.clip_grad_norm(&mut grads, 1.0, 2.0, false)?;
    ///         scaler.step(opt, &mut grads)?;
    ///         scaler.update();
    ///         Ok(())
    ///     };
    ///     let batches = 2 + pg.rank(); // rank 0 has 2 batches, rank 1 has 3
    ///     model.join_with(&mut (opt, scaler), JoinDivisor::World, &step, |state| {
    ///         for _ in 0..batches {
    ///             let x = Tensor::ones((4, 3), candle_core::DType::F32, &Device::Cpu)?;
    ///             let loss = model.forward_t(&x, true)?.sqr()?.mean_all()?;
    ///             step(state, model.backward(&state.1.scale(&loss)?)?)?;
    ///         }
    ///         Ok(())
    ///     })?;
    ///     Ok(model.parameters()[1].to_vec2::<f32>()?)
    /// })?;
    /// assert_eq!(weights[0], weights[1]);
    /// # Ok(()) }
    /// ```
    pub fn join_with<S, T>(
        &self,
        state: &mut S,
        divisor: JoinDivisor,
        step: impl Fn(&mut S, GradStore) -> Result<()>,
        train: impl FnOnce(&mut S) -> Result<T>,
    ) -> Result<T> {
        self.join_inner(state, divisor, step, train, false)
    }

    /// [`join_with`](Self::join_with); `plain` for [`join`](Self::join), whose loop the lower
    /// layers check for collectives of their own (see [`crate::util::plain_join`]).
    fn join_inner<S, T>(
        &self,
        state: &mut S,
        divisor: JoinDivisor,
        step: impl Fn(&mut S, GradStore) -> Result<()>,
        train: impl FnOnce(&mut S) -> Result<T>,
        plain: bool,
    ) -> Result<T> {
        if !self.sync_groups.is_empty() {
            return Err(Error::InvalidArgument {
                what: "DistributedDataParallel::join",
                detail: "the model has SyncBatchNorm layers, whose collectives a joined rank \
                         cannot shadow; train without join (or without sync_batch_norm)"
                    .into(),
            });
        }
        {
            let mut joining = lock(&self.joining);
            if joining.is_some() {
                return Err(Error::InvalidArgument {
                    what: "DistributedDataParallel::join",
                    detail: "called inside another join of the same model".into(),
                });
            }
            *joining = Some(divisor);
        }
        let trained = {
            let _plain = plain.then(crate::util::plain_join::enter);
            train(state)
        };
        let result = trained.and_then(|t| {
            self.shadow(state, divisor, &step)?;
            self.check_replicas_agree()?;
            Ok(t)
        });
        *lock(&self.joining) = None;
        result.map_err(|e| match mismatch_detail(e) {
            Ok(detail) => Error::Mismatch {
                detail: format!(
                    "{detail} (inside join, rank {}: a rank that ran out of batches shadows \
                     the others' iterations, each a forward's count of the ranks training, \
                     the buffer broadcast, the gradient buckets and the step given to join; a \
                     loop that runs other collectives, or changes the gradients before its \
                     step (clip_grad_norm, a GradScaler), must give that step to join_with)",
                    self.group.rank()
                ),
            },
            Err(e) => e,
        })
    }

    /// Shadows the iterations of the ranks still training, until none is.
    fn shadow<S>(
        &self,
        state: &mut S,
        divisor: JoinDivisor,
        step: impl Fn(&mut S, GradStore) -> Result<()>,
    ) -> Result<()> {
        loop {
            let active = self.count_active(false, divisor)?;
            if active == 0 {
                return Ok(());
            }
            self.reducer.prepare_for_backward(true)?;
            self.before_forward(true)?;
            let mut grads = GradStore::default();
            self.reducer.finalize_backward(&mut grads, Instant::now())?;
            step(state, grads)?;
        }
    }

    /// Once every rank is done: a fingerprint of the parameters (their sum and sum of
    /// squares, in f64), compared over the ranks with one all-reduce. Not under ZeRO-2, where
    /// each rank keeps pieces of its own and the parameters are gathered at the next forward:
    /// there a step the joined ranks cannot mirror leaves no two replicas to compare, and
    /// such a loop must use `join_with` (clipping's collective, without it, is a mismatch).
    fn check_replicas_agree(&self) -> Result<()> {
        if !self.reducer.pieces().is_empty() {
            return Ok(());
        }
        let mut sums = [0f64; 2];
        for p in self.parameters() {
            let p = p.to_dtype(DType::F64)?;
            sums[0] += p.sum_all()?.to_device(&Device::Cpu)?.to_scalar::<f64>()?;
            sums[1] += p
                .sqr()?
                .sum_all()?
                .to_device(&Device::Cpu)?
                .to_scalar::<f64>()?;
        }
        // A rank whose parameters are not finite sends a flag instead of its sums, so that a
        // run that diverged the same way everywhere (a learning rate too large) is not taken
        // for replicas that differ.
        let finite = sums.iter().all(|s| s.is_finite());
        let (a, b, f) = match finite {
            true => (sums[0], sums[1], 0.0),
            false => (0.0, 0.0, 1.0),
        };
        let t = Tensor::new(&[a, b, f, -a, -b, -f], &Device::Cpu)?.to_device(&self.device)?;
        let max = self
            .group
            .all_reduce(&t, ReduceOp::Max)?
            .to_device(&Device::Cpu)?
            .to_vec1::<f64>()?;
        if (0..3).all(|i| max[i] == -max[i + 3]) {
            if !finite {
                log::warn!(
                    "rank {}: after join every rank's parameters hold inf or NaN: the training \
                     diverged (a learning rate too large?)",
                    self.group.rank()
                );
            }
            return Ok(());
        }
        let mine = match finite {
            true => format!("sum {}, sum of squares {}", sums[0], sums[1]),
            false => "parameters with inf or NaN".into(),
        };
        let others = match max[2] == -max[5] {
            true => format!("sums over the ranks from {} to {}", -max[3], max[0]),
            false => "some ranks' parameters are finite, some not".into(),
        };
        Err(Error::Mismatch {
            detail: format!(
                "after join the replicas' parameters differ (rank {}: {mine}; {others}): the \
                 training loop changed the gradients or the parameters between backward and \
                 step in a way the joined ranks did not mirror",
                self.group.rank(),
            ),
        })
    }

    /// Inside `join`: how many ranks are still training (this one when `training`), agreed by
    /// one all-reduce; sets the scale of the next average for `divisor`.
    pub(super) fn count_active(&self, training: bool, divisor: JoinDivisor) -> Result<usize> {
        let flag = integers::to_tensor([usize::from(training)], &self.device)?;
        let active = integers::from_tensor(&self.group.all_reduce(&flag, ReduceOp::Sum)?)?[0];
        let world = self.group.world_size();
        if divisor == JoinDivisor::Active && active > 0 {
            self.reducer
                .scale_next_average(world as f64 / active as f64);
        }
        Ok(active)
    }

    /// Inside `join`, what a forward on a rank still training must check and do first.
    pub(super) fn join_iteration(&self, divisor: JoinDivisor, train: bool) -> Result<()> {
        if self.no_sync.load(Ordering::SeqCst) > 0 || !train {
            return Err(Error::InvalidArgument {
                what: "DistributedDataParallel::join",
                detail: format!(
                    "rank {}: {} forward inside join; a joined rank shadows training \
                     iterations only (a training forward, backward, one step): evaluate \
                     and accumulate outside join",
                    self.group.rank(),
                    if train { "a no_sync" } else { "an evaluation" }
                ),
            });
        }
        self.count_active(true, divisor).map(|_| ())
    }
}

/// The detail of a collective mismatch, also when it came through a candle trait method (an
/// optimizer's step), which keeps our error as text only; any other error as it is.
fn mismatch_detail(e: Error) -> std::result::Result<String, Error> {
    const PREFIX: &str = "collective mismatch between ranks: ";
    match e {
        Error::Mismatch { detail } => Ok(detail),
        Error::Candle(c) => {
            let text = c.to_string();
            match text.strip_prefix(PREFIX) {
                Some(detail) => Ok(detail.lines().next().unwrap_or(detail).to_string()),
                None => Err(Error::Candle(c)),
            }
        }
        e => Err(e),
    }
}
