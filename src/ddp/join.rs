//! Uneven inputs: ranks whose data runs out first shadow the collectives of those still
//! training (torch's `Join` context with DDP's join hook), so that nobody hangs and the last
//! batches still count.

use super::{integers, DistributedDataParallel};
use crate::distributed::ReduceOp;
use crate::error::{Error, Result};
use crate::util::sync::lock;
use candle_core::backprop::GradStore;
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
    /// [`backward`](Self::backward) and one `opt.step` (the shadow mirrors exactly that), with
    /// the optimizer's learning rate changed the same way on every rank (a joined rank keeps the
    /// last one it set). `no_sync` and SyncBatchNorm cannot be mixed with joining: they are an
    /// error. If `train` fails, the error is returned at once and the other ranks see this rank
    /// as lost at their next collective.
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
        let trained = train(opt);
        let result = trained.and_then(|t| {
            self.shadow(opt, divisor)?;
            Ok(t)
        });
        *lock(&self.joining) = None;
        result
    }

    /// Shadows the iterations of the ranks still training, until none is.
    fn shadow<O: Optimizer>(&self, opt: &mut O, divisor: JoinDivisor) -> Result<()> {
        loop {
            let active = self.count_active(false, divisor)?;
            if active == 0 {
                return Ok(());
            }
            self.reducer.prepare_for_backward(true)?;
            self.before_forward(true)?;
            let mut grads = GradStore::default();
            self.reducer.finalize_backward(&mut grads, Instant::now())?;
            opt.step(&grads)?;
        }
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
