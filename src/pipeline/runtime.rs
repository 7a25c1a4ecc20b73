//! Running a schedule: one training step of a pipeline (torch's `schedule.step`).
//!
//! Each rank runs its [`Schedule::actions`] in order. A forward of stage `s > 0` receives its
//! input from stage `s - 1` as it was sent (shapes are found at run time, on every
//! micro-batch), makes it a fresh `Var`, and runs the stage; the last stage computes the loss
//! of the micro-batch, divided by the number of micro-batches (torch's `scale_grads`), so that
//! the summed gradients are those of the whole batch. A backward starts from that loss on the
//! last stage and elsewhere from `(output * grad_output).sum_all()`, the gradient of the
//! output received from stage `s + 1` with the shape and dtype of the output (anything else is
//! an error naming both ranks); it adds the stage's parameter gradients to the step's sums and
//! sends the input's gradient to stage `s - 1`.
//!
//! A message to send waits to be issued with the rank's next receive, in one
//! `batch_isend_irecv`, as torch fuses 1F1B's forward send and backward receive: on NCCL, where
//! a send completes with its receive, two neighbours that send to each other at once then never
//! wait for each other. When the next computation receives nothing, the messages leave before
//! it. The step waits for its sends before it returns. A step that failed on some rank leaves
//! messages in flight: the pipeline cannot go on after it (as torch's), only report.

use super::microbatch::split_microbatches;
use super::schedule::{Action, Computation, Schedule};
use super::stage::PipelineStage;
use crate::distributed::{P2pOp, ReduceOp, Work};
use crate::error::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, TensorId, Var};
use candle_nn::ModuleT;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A schedule with its micro-batch count and loss, ready to run steps (torch's
/// `ScheduleGPipe(stage, n_microbatches, loss_fn)` and its siblings).
pub struct PipelineSchedule<L> {
    schedule: Schedule,
    n_microbatches: usize,
    loss_fn: L,
}

/// What a step computed on this rank.
pub struct StepOutput {
    /// Each of this rank's stage parameters' gradient, summed over the micro-batches (whose
    /// losses were divided by their number): the whole batch's gradient. A parameter that got
    /// none has none. Pass it to the optimizer's `step`.
    pub grads: GradStore,
    /// On the rank holding the last stage, each micro-batch's loss (not divided); empty
    /// elsewhere.
    pub losses: Vec<f32>,
    /// When each computation ran, from the step's start (after its inputs arrived, until its
    /// result was handed on).
    pub events: Vec<Event>,
    /// How long the whole step took on this rank.
    pub elapsed: Duration,
}

impl StepOutput {
    /// The mean of the micro-batches' losses (the batch's loss for equal micro-batches and a
    /// mean loss); `None` off the last stage.
    pub fn loss(&self) -> Option<f32> {
        (!self.losses.is_empty())
            .then(|| self.losses.iter().sum::<f32>() / self.losses.len() as f32)
    }

    /// The fraction of the step this rank spent not computing (waiting for its neighbours).
    pub fn idle_fraction(&self) -> f64 {
        let busy: Duration = self.events.iter().map(|e| e.end - e.start).sum();
        let total = self.elapsed.as_secs_f64();
        if total == 0.0 {
            0.0
        } else {
            (1.0 - busy.as_secs_f64() / total).max(0.0)
        }
    }
}

/// What an evaluation ([`PipelineSchedule::eval`]) computed on this rank.
#[derive(Debug)]
pub struct EvalOutput {
    /// On the rank holding the last stage, its outputs of the micro-batches concatenated along
    /// dimension 0 (torch's merged output); `None` elsewhere.
    pub output: Option<Tensor>,
    /// On the rank holding the last stage, each micro-batch's loss where a target was given;
    /// empty elsewhere.
    pub losses: Vec<f32>,
}

/// One computation of a step, timed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Event {
    /// What ran.
    pub action: Action,
    /// When it started, from the step's start.
    pub start: Duration,
    /// When it ended, from the step's start.
    pub end: Duration,
}

/// What a stage keeps of a micro-batch between its forward and its backward.
struct Saved {
    /// The received input, as a variable (none on the first stage).
    input: Option<Var>,
    /// The output (last stage: the loss divided by the micro-batch count).
    output: Tensor,
}

impl<L> PipelineSchedule<L>
where
    L: Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
{
    /// `schedule` over `n_microbatches` micro-batches; the last stage computes each
    /// micro-batch's loss with `loss_fn(output, target)`.
    pub fn new(schedule: Schedule, n_microbatches: usize, loss_fn: L) -> Result<Self> {
        // Checks the count (and interleaving's rounds) before any step.
        schedule.actions(1, 0, n_microbatches)?;
        Ok(Self {
            schedule,
            n_microbatches,
            loss_fn,
        })
    }

    /// The schedule.
    pub fn schedule(&self) -> Schedule {
        self.schedule
    }

    /// How many micro-batches a step cuts the batch into.
    pub fn n_microbatches(&self) -> usize {
        self.n_microbatches
    }

    /// Runs one training step of this rank's `stages` (one for GPipe and 1F1B, the rank's
    /// stages in order for interleaved 1F1B): the batch `input` goes to the rank holding
    /// stage 0, the `target` to the rank holding the last stage (others pass `None`); both are
    /// cut into micro-batches along dimension 0. Every rank of the pipeline calls it.
    ///
    /// Each call checks that every rank runs the same schedule over the same number of
    /// micro-batches and stages, and a step (not an evaluation) too (one small all-reduce); a
    /// difference is an [`Error::Mismatch`] on every rank.
    pub fn step<M: ModuleT>(
        &self,
        stages: &[&PipelineStage<M>],
        input: Option<&Tensor>,
        target: Option<&Tensor>,
    ) -> Result<StepOutput> {
        let (mut run, actions) = self.start(stages, input, target, true)?;
        for action in actions {
            run.action(action, &self.loss_fn)?;
        }
        run.finish()
    }

    /// Runs the forwards only, in evaluation mode (`forward_t(x, false)`), without gradients
    /// (torch's `schedule.eval`): for a validation pass between training steps. Every rank of
    /// the pipeline calls it, with the input on the rank holding stage 0, as for
    /// [`PipelineSchedule::step`]; the target is optional (without it, no loss is computed).
    /// The rank holding the last stage gets its outputs of the micro-batches, concatenated
    /// along dimension 0, and their losses where a target was given.
    pub fn eval<M: ModuleT>(
        &self,
        stages: &[&PipelineStage<M>],
        input: Option<&Tensor>,
        target: Option<&Tensor>,
    ) -> Result<EvalOutput> {
        let (mut run, actions) = self.start(stages, input, target, false)?;
        for action in actions {
            if action.computation == Computation::Forward {
                run.action(action, &self.loss_fn)?;
            }
        }
        let outputs = std::mem::take(&mut run.outputs);
        let step = run.finish()?;
        Ok(EvalOutput {
            output: match outputs.is_empty() {
                true => None,
                false => Some(Tensor::cat(&outputs, 0)?),
            },
            losses: step.losses,
        })
    }

    /// Checks `stages`, agrees on the schedule with the other ranks (first call only), splits
    /// the batch: the step's state and this rank's actions.
    fn start<'a, M: ModuleT>(
        &self,
        stages: &[&'a PipelineStage<M>],
        input: Option<&Tensor>,
        target: Option<&Tensor>,
        train: bool,
    ) -> Result<(Run<'a, M>, Vec<Action>)> {
        let started = Instant::now();
        let first = stages.first().ok_or_else(|| Error::InvalidArgument {
            what: "pipeline step",
            detail: "no stage given; pass this rank's stages".into(),
        })?;
        let group = first.group();
        let (pp, rank) = (group.world_size(), group.rank());
        let n_stages = first.num_stages();
        let expected = self.schedule.stages_of(pp, rank);
        let given: Vec<usize> = stages.iter().map(|s| s.stage_index()).collect();
        if n_stages != pp * self.schedule.stages_per_rank() || given != expected {
            return Err(Error::InvalidArgument {
                what: "pipeline step",
                detail: format!(
                    "rank {rank} of {pp} under {:?} holds stages {expected:?} of {}, but was \
                     given stages {given:?} of {n_stages}",
                    self.schedule,
                    pp * self.schedule.stages_per_rank()
                ),
            });
        }
        self.agree(first, train)?;
        let by_index: HashMap<usize, &PipelineStage<M>> =
            stages.iter().map(|s| (s.stage_index(), *s)).collect();
        let holds_first = by_index.contains_key(&0);
        let holds_last = by_index.contains_key(&(n_stages - 1));
        let inputs = match (holds_first, input) {
            (true, Some(x)) => split_microbatches(x, self.n_microbatches)?,
            (true, None) => return Err(missing(rank, "input", "stage 0")),
            (false, _) => Vec::new(),
        };
        let targets = match (holds_last, target) {
            (true, Some(y)) => split_microbatches(y, self.n_microbatches)?,
            (true, None) if train => return Err(missing(rank, "target", "the last stage")),
            (true, None) => Vec::new(),
            (false, _) => Vec::new(),
        };
        let run = Run {
            stages: by_index,
            n_stages,
            scale: self.n_microbatches as f64,
            inputs,
            targets,
            saved: HashMap::new(),
            local: HashMap::new(),
            pending: Vec::new(),
            sends: Vec::new(),
            sums: HashMap::new(),
            losses: Vec::new(),
            events: Vec::new(),
            started,
            train,
            outputs: Vec::new(),
        };
        let actions = self.schedule.actions(pp, rank, self.n_microbatches)?;
        Ok((run, actions))
    }

    /// Checks once that every rank of the pipeline runs the same schedule, micro-batch count
    /// and number of stages.
    /// Checks that every rank of the pipeline runs the same schedule, over the same
    /// micro-batches and stages, and the same kind of call (a training step or an evaluation:
    /// a rank evaluating while the others train would leave their gradients unread, to be taken
    /// by its next step). One small all-reduce of the values and their negations (`Max` gives
    /// both ends).
    fn agree<M>(&self, stage: &PipelineStage<M>, train: bool) -> Result<()> {
        let group = stage.group();
        let (code, per_rank) = match self.schedule {
            Schedule::GPipe => (0.0, 1),
            Schedule::OneFOneB => (1.0, 1),
            Schedule::Interleaved1F1B { stages_per_rank } => (2.0, stages_per_rank),
        };
        let mine = [
            code,
            per_rank as f64,
            self.n_microbatches as f64,
            stage.num_stages() as f64,
            f64::from(u8::from(train)),
        ];
        let both: Vec<f64> = mine
            .iter()
            .copied()
            .chain(mine.iter().map(|v| -v))
            .collect();
        let t = Tensor::new(both.as_slice(), &Device::Cpu)?.to_device(stage.device())?;
        let ends = group.all_reduce(&t, ReduceOp::Max)?.to_vec1::<f64>()?;
        let (hi, lo): (Vec<f64>, Vec<f64>) = (
            ends[..mine.len()].to_vec(),
            ends[mine.len()..].iter().map(|v| -v).collect(),
        );
        if lo[4] != hi[4] {
            return Err(Error::Mismatch {
                detail: format!(
                    "the pipeline's ranks run different calls: rank {} runs {} while another \
                     runs {}; every rank must call step together, or eval together",
                    group.rank(),
                    if train {
                        "a training step"
                    } else {
                        "an evaluation"
                    },
                    if train {
                        "an evaluation"
                    } else {
                        "a training step"
                    },
                ),
            });
        }
        if lo != hi {
            return Err(Error::Mismatch {
                detail: format!(
                    "the pipeline's ranks run different schedules: rank {} runs {:?} over {} \
                     micro-batches and {} stages, and the ranks' (schedule, stages per rank, \
                     micro-batches, stages) range from {:?} to {:?}; every rank must build \
                     the same PipelineSchedule",
                    group.rank(),
                    self.schedule,
                    self.n_microbatches,
                    stage.num_stages(),
                    &lo[..4],
                    &hi[..4]
                ),
            });
        }
        Ok(())
    }
}

fn missing(rank: usize, what: &str, holder: &str) -> Error {
    Error::InvalidArgument {
        what: "pipeline step",
        detail: format!("rank {rank} holds {holder} but was given no {what}; pass it to step"),
    }
}

/// One step's state on this rank.
struct Run<'a, M> {
    stages: HashMap<usize, &'a PipelineStage<M>>,
    n_stages: usize,
    scale: f64,
    inputs: Vec<Tensor>,
    targets: Vec<Tensor>,
    saved: HashMap<(usize, usize), Saved>,
    /// Messages between two stages of this rank (a pipeline of one rank).
    local: HashMap<Action, Tensor>,
    /// Sends waiting to go out with the next receive.
    pending: Vec<P2pOp>,
    sends: Vec<Work<Vec<Option<Tensor>>>>,
    /// Each parameter's gradient summed over the micro-batches so far.
    sums: HashMap<TensorId, (Var, Tensor)>,
    losses: Vec<f32>,
    events: Vec<Event>,
    started: Instant,
    /// Whether the step trains (false: an evaluation, forwards only).
    train: bool,
    /// The last stage's outputs, in an evaluation.
    outputs: Vec<Tensor>,
}

impl<M: ModuleT> Run<'_, M> {
    fn action<L>(&mut self, a: Action, loss_fn: &L) -> Result<()>
    where
        L: Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
    {
        let stage = self.stages[&a.stage];
        let key = (a.stage, a.microbatch);
        if !self.receives_remotely(a) {
            // Nothing to go out with: the sends leave before this computation.
            self.flush(stage)?;
        }
        match a.computation {
            Computation::Forward => {
                let received = match stage.is_first() {
                    true => None,
                    false => Some(self.receive(stage, a, None)?),
                };
                let input = match (&received, self.train) {
                    (Some(t), true) => Some(Var::from_tensor(t)?),
                    _ => None,
                };
                let start = self.started.elapsed();
                let x = match (&input, received) {
                    (Some(v), _) => v.as_tensor().clone(),
                    (None, Some(t)) => t,
                    (None, None) => self.inputs[a.microbatch].clone(),
                };
                let out = stage.module.forward_t(&x, self.train)?;
                if !self.train {
                    let out = out.detach();
                    if !stage.is_last() {
                        self.send(stage, a, out);
                    } else {
                        if let Some(y) = self.targets.get(a.microbatch) {
                            let loss = loss_fn(&out, y)?;
                            self.losses
                                .push(loss.to_dtype(candle_core::DType::F32)?.to_scalar()?);
                        }
                        self.outputs.push(out);
                    }
                    self.timed(a, start);
                    return Ok(());
                }
                let output = if stage.is_last() {
                    let loss = loss_fn(&out, &self.targets[a.microbatch])?;
                    self.losses
                        .push(loss.to_dtype(candle_core::DType::F32)?.to_scalar()?);
                    (loss / self.scale)?
                } else {
                    self.send(stage, a, out.clone());
                    out
                };
                self.timed(a, start);
                self.saved.insert(key, Saved { input, output });
            }
            Computation::Backward => {
                let saved = self
                    .saved
                    .remove(&key)
                    .expect("the schedule runs F before B");
                let root = match stage.is_last() {
                    true => saved.output,
                    false => {
                        let grad = self.receive(stage, a, Some(&saved.output))?;
                        (saved.output * grad)?.sum_all()?
                    }
                };
                let start = self.started.elapsed();
                let grads = crate::nn::backward(&root)?;
                for (_, var) in stage.named_parameters() {
                    if let Some(g) = grads.get(var.as_tensor()) {
                        let sum = match self.sums.remove(&var.id()) {
                            Some((_, s)) => (s + g)?,
                            None => g.clone(),
                        };
                        self.sums.insert(var.id(), (var.clone(), sum));
                    }
                }
                if let Some(input) = saved.input {
                    let g = match grads.get(input.as_tensor()) {
                        Some(g) => g.clone(),
                        None => {
                            log::warn!(
                                "pipeline stage {}: micro-batch {}'s output does not depend on \
                                 the stage's input, so stage {} gets a zero gradient",
                                a.stage,
                                a.microbatch,
                                a.stage - 1
                            );
                            input.as_tensor().zeros_like()?
                        }
                    };
                    self.send(stage, a, g);
                }
                self.timed(a, start);
            }
        }
        Ok(())
    }

    fn timed(&mut self, action: Action, start: Duration) {
        self.events.push(Event {
            action,
            start,
            end: self.started.elapsed(),
        });
    }

    /// The neighbour stage `a`'s result goes to: the next for a forward, the previous for a
    /// backward.
    fn peer_stage(&self, a: Action) -> usize {
        match a.computation {
            Computation::Forward => a.stage + 1,
            Computation::Backward => a.stage - 1,
        }
    }

    /// Hands `t`, `a`'s result, to the neighbour stage: queued to go out with the next
    /// receive (or at the step's end), or kept here when the neighbour is on this rank.
    fn send(&mut self, stage: &PipelineStage<M>, a: Action, t: Tensor) {
        let to = self.peer_stage(a);
        if self.stages.contains_key(&to) {
            let consumer = Action { stage: to, ..a };
            self.local.insert(consumer, t);
        } else {
            self.pending.push(P2pOp::send(&t, stage.rank_of(to)));
        }
    }

    /// What `a` receives from its neighbour: for a forward, the activation as sent; for a
    /// backward, the gradient of `output`, which must have its shape and dtype.
    fn receive(
        &mut self,
        stage: &PipelineStage<M>,
        a: Action,
        output: Option<&Tensor>,
    ) -> Result<Tensor> {
        if let Some(t) = self.local.remove(&a) {
            return Ok(t);
        }
        let from = match a.computation {
            Computation::Forward => a.stage - 1,
            Computation::Backward => a.stage + 1,
        };
        let peer = stage.rank_of(from);
        let recv = match output {
            Some(o) => P2pOp::recv(peer, o.shape().clone(), o.dtype()),
            None => P2pOp::recv_as_sent(peer),
        };
        let mut ops = std::mem::take(&mut self.pending);
        ops.push(recv);
        let mut got = stage.group().batch_isend_irecv(ops)?.wait()?;
        let t = got.pop().flatten().ok_or_else(|| Error::Aborted {
            reason: format!(
                "stage {}'s receive from rank {peer} came back empty",
                a.stage
            ),
        })?;
        Ok(match output {
            Some(o) if !t.device().same_device(o.device()) => {
                crate::util::ordered_copy::to_device(&t, o.device(), false)?
            }
            _ => t,
        })
    }

    /// Whether `a` waits for a message from another rank.
    fn receives_remotely(&self, a: Action) -> bool {
        let from = match a.computation {
            Computation::Forward if a.stage > 0 => a.stage - 1,
            Computation::Backward if a.stage + 1 < self.n_stages => a.stage + 1,
            _ => return false,
        };
        !self.stages.contains_key(&from)
    }

    /// Issues the sends waiting for a receive.
    fn flush(&mut self, stage: &PipelineStage<M>) -> Result<()> {
        let ops = std::mem::take(&mut self.pending);
        if !ops.is_empty() {
            self.sends.push(stage.group().batch_isend_irecv(ops)?);
        }
        Ok(())
    }

    fn finish(mut self) -> Result<StepOutput> {
        if let Some(stage) = self.stages.values().next().copied() {
            self.flush(stage)?;
        }
        for w in self.sends {
            w.wait()?;
        }
        let mut grads = GradStore::default();
        for (_, (var, sum)) in self.sums {
            grads.insert(var.as_tensor(), sum);
        }
        Ok(StepOutput {
            grads,
            losses: self.losses,
            events: self.events,
            elapsed: self.started.elapsed(),
        })
    }
}
