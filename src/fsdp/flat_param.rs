//! One unit's parameters as one flat shard per rank (torch FSDP's `FlatParameter`, cut per
//! parameter as FSDP2 cuts them): how it is made from the full tensors at construction,
//! gathered back whole for a forward or backward, and how a unit's full gradient becomes this
//! rank's pieces of the world's average.
//!
//! Each rank holds its chunk of every parameter of the unit ([`crate::shard`]) as a variable
//! of its own, a piece, which the optimizer steps: a parameter that got no gradient on any rank
//! gets none, so that the optimizer leaves it alone. The unit's buffers (running statistics)
//! are not sharded: every rank holds them whole.
//!
//! Every gather carries the unit's number beside the shard, so that ranks running different
//! units at the same point (a unit used on some ranks only) fail with a typed error naming
//! both units, rather than combining one unit's shards with another's of the same size. The
//! number travels as base-64 digits, exact in every float dtype (bf16 counts exactly to 256
//! only).

use super::backend::Buffers;
use crate::amp::MixedPrecision;
use crate::ddp::agreement::{broadcast_from_rank_0, check_same_descriptions, travels};
use crate::distributed::{ProcessGroup, ReduceOp, Work};
use crate::error::{Error, Result};
use crate::shard::FlatLayout;
use crate::util::sync::lock;
use candle_core::{DType, Device, Tensor, Var};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// The wrapper, in messages.
const FSDP: &str = "FullyShardedDataParallel";

/// The name of the parameters outside every unit, in messages.
pub(crate) const ROOT: &str = "(root)";

/// The name of a unit built at the root of the `VarBuilder`, in messages.
pub(crate) const UNPREFIXED: &str = "(unprefixed)";

/// How many base-64 digits a unit's number travels as: units up to 64^4.
const TAG_DIGITS: usize = 4;

/// What every flat parameter of one wrapper shares: its group, and the iteration under way.
pub(crate) struct Shared {
    pub group: ProcessGroup,
    pub device: Device,
    /// The dtypes units compute and average gradients in.
    pub precision: MixedPrecision,
    /// Backwards so far: a unit's backward belongs to the iteration of its forward (every
    /// training forward since the last backward belongs to the next one).
    pub iteration: AtomicU64,
    /// Open `no_sync` guards: backwards sum gradients on this rank only.
    pub no_sync: AtomicUsize,
    /// A backward went through a training forward's output since the last
    /// `FullyShardedDataParallel::backward` ended (set by the output's op).
    pub backward_ran: AtomicBool,
    /// Each flat parameter's name, by number (0 is the root).
    names: Mutex<Vec<String>>,
    /// The units, by number less one, for prefetching the next one's gather.
    units: Mutex<Vec<Weak<FlatParam>>>,
    /// The units used by the training forwards of this iteration, in order (by number).
    uses: Mutex<Vec<usize>>,
    /// The first typed error raised inside candle's backward (where only candle errors pass).
    error: Mutex<Option<Error>>,
}

impl Shared {
    pub fn new(group: ProcessGroup, device: Device, precision: MixedPrecision) -> Self {
        Self {
            group,
            device,
            precision,
            iteration: AtomicU64::new(0),
            no_sync: AtomicUsize::new(0),
            backward_ran: AtomicBool::new(false),
            names: Mutex::new(vec![ROOT.to_string()]),
            units: Mutex::new(Vec::new()),
            uses: Mutex::new(Vec::new()),
            error: Mutex::new(None),
        }
    }

    /// Keeps `e` (the first only) for `take_error`, and gives candle an error that says so.
    pub fn fail(&self, e: Error) -> candle_core::Error {
        let text = e.to_string();
        lock(&self.error).get_or_insert(e);
        candle_core::Error::Msg(text)
    }

    /// The typed error kept by [`Shared::fail`], if any.
    pub fn take_error(&self) -> Option<Error> {
        lock(&self.error).take()
    }

    /// Notes a training forward's use of unit `id`; returns its place among this iteration's
    /// uses.
    pub fn note_use(&self, id: usize) -> usize {
        let mut uses = lock(&self.uses);
        uses.push(id);
        uses.len() - 1
    }

    /// The unit used at place `k` of this iteration's training forwards.
    pub fn used_at(&self, k: usize) -> Option<Arc<FlatParam>> {
        let id = *lock(&self.uses).get(k)?;
        self.unit(id)
    }

    /// Unit number `id` (units count from 1), while it lives.
    pub fn unit(&self, id: usize) -> Option<Arc<FlatParam>> {
        lock(&self.units).get(id.checked_sub(1)?)?.upgrade()
    }

    /// Ends an iteration: forgets its uses, and the gathers prefetched for it.
    pub fn end_iteration(&self) {
        lock(&self.uses).clear();
        self.drop_prefetched();
    }

    /// Drops every gather prefetched and never used: each forward, backward and gathering of
    /// the whole model starts without, since a step may change the parameters between them
    /// (such a gather still runs, in its place in the collectives' order, on every rank
    /// alike).
    pub fn drop_prefetched(&self) {
        let units: Vec<Arc<FlatParam>> =
            lock(&self.units).iter().filter_map(Weak::upgrade).collect();
        for u in units {
            lock(&u.prefetched).take();
        }
    }

    fn name(&self, id: usize) -> String {
        lock(&self.names)
            .get(id)
            .cloned()
            .unwrap_or_else(|| format!("#{id}"))
    }
}

/// One unit's (or the root's) parameters, flattened, padded and cut into one shard per rank.
pub(crate) struct FlatParam {
    /// 0 for the root, then the units in the order the model asks for them.
    pub id: usize,
    /// The unit's prefix ("h.0"), or [`ROOT`].
    pub name: String,
    /// The full names of the parameters, in flat order.
    pub names: Vec<String>,
    pub shapes: Vec<Vec<usize>>,
    /// The dtype of the pieces (the master weights).
    pub dtype: DType,
    /// The dtype the unit is gathered and computes in.
    pub compute: DType,
    pub layout: FlatLayout,
    /// This rank's piece of each parameter, in flat order: what the optimizer steps.
    pub pieces: Vec<Var>,
    /// The unit's buffers (whole on every rank), by full name.
    pub buffers: Vec<(String, Var)>,
    pub shared: Arc<Shared>,
    /// Reduce-scatters of this iteration's gradients, in flight.
    pending: Mutex<Vec<Work<Tensor>>>,
    /// The all-gather issued ahead of this unit's use, while the unit before it computed.
    prefetched: Mutex<Option<Work<Vec<Tensor>>>>,
    /// Per parameter: whether it got a gradient on this rank in this iteration.
    used: Mutex<Vec<bool>>,
    /// Per parameter: this rank's gradients summed under `no_sync`, until the next
    /// synchronised backward reduce-scatters them.
    local: Mutex<Vec<Option<Tensor>>>,
}

impl FlatParam {
    /// Makes the flat parameter of `entries` (full names and values, the same on every rank
    /// after this) and `buffers`: checks that every rank has the same names, shapes and
    /// dtypes, takes rank 0's values, and keeps this rank's pieces only (and the buffers).
    pub fn new(
        shared: &Arc<Shared>,
        name: &str,
        entries: Vec<(String, Tensor)>,
        buffers: Vec<(String, Var)>,
    ) -> Result<Arc<Self>> {
        let unit_error = |detail: String| Error::FsdpUnit {
            unit: name.to_string(),
            detail,
        };
        let Some((_, first)) = entries.first() else {
            return Err(unit_error(
                "it asked for no parameters: mark as units only modules with parameters".into(),
            ));
        };
        let dtype = first.dtype();
        if !dtype.is_float() {
            return Err(unit_error(format!(
                "`{}` is {}: only float parameters are sharded",
                entries[0].0,
                dtype.as_str()
            )));
        }
        if let Some((other, t)) = entries.iter().find(|(_, t)| t.dtype() != dtype) {
            return Err(unit_error(format!(
                "`{}` is {} and `{other}` is {}: the parameters of one unit share one flat \
                 buffer, so one dtype; make them one dtype or put them in different units",
                entries[0].0,
                dtype.as_str(),
                t.dtype().as_str()
            )));
        }
        let group = &shared.group;
        let descriptions: Vec<String> = entries
            .iter()
            .map(|(n, t)| {
                format!(
                    "{n} parameter of unit {name} {} {:?}",
                    dtype.as_str(),
                    t.dims()
                )
            })
            .chain(describe_buffers(name, &buffers))
            .collect();
        check_same_descriptions(group, &descriptions, &shared.device, FSDP)?;
        let numels: Vec<usize> = entries.iter().map(|(_, t)| t.elem_count()).collect();
        let (world, rank) = (group.world_size(), group.rank());
        let layout = FlatLayout::new(&numels, world);
        let values: Vec<Tensor> = entries.iter().map(|(_, t)| t.clone()).collect();
        let mut flat = layout.flatten(&values)?;
        drop(values);
        if world > 1 {
            flat = group.broadcast(&flat, 0)?;
        }
        let range = layout.shard_range(rank);
        // Copies of their own elements only (a view's `copy` would copy the whole buffer for
        // each), so that the full buffer is freed now.
        let pieces = layout
            .split_shard(&flat.narrow(0, range.start, range.len())?)?
            .iter()
            .map(|chunk| Ok(Var::from_tensor(&chunk.force_contiguous()?)?))
            .collect::<Result<Vec<_>>>()?;
        drop(flat);
        broadcast_buffers(group, &buffers)?;
        let id = {
            let mut names = lock(&shared.names);
            if name == ROOT {
                0
            } else {
                names.push(name.to_string());
                names.len() - 1
            }
        };
        let param = Arc::new(Self {
            id,
            name: name.to_string(),
            names: entries.iter().map(|(n, _)| n.clone()).collect(),
            shapes: entries.iter().map(|(_, t)| t.dims().to_vec()).collect(),
            compute: shared.precision.compute_dtype(dtype),
            dtype,
            layout,
            used: Mutex::new(vec![false; pieces.len()]),
            local: Mutex::new(vec![None; pieces.len()]),
            pieces,
            buffers,
            shared: shared.clone(),
            pending: Mutex::new(Vec::new()),
            prefetched: Mutex::new(None),
        });
        if id > 0 {
            lock(&shared.units).push(Arc::downgrade(&param));
        }
        Ok(param)
    }

    /// This rank's shard: its pieces laid end to end, in the dtype the unit computes in.
    fn shard(&self) -> Result<Tensor> {
        let pieces: Vec<Tensor> = self.pieces.iter().map(|p| p.as_tensor().clone()).collect();
        Ok(crate::nn::cast(&Tensor::cat(&pieces, 0)?, self.compute)?)
    }

    /// Issues the all-gather of every rank's shard, tagged with this unit's number.
    pub fn gather_async(&self) -> Result<Work<Vec<Tensor>>> {
        let digits: Vec<f64> = (0..TAG_DIGITS)
            .map(|k| ((self.id >> (6 * k)) & 63) as f64)
            .collect();
        let tag = Tensor::new(digits.as_slice(), &self.shared.device)?.to_dtype(self.compute)?;
        let tagged = Tensor::cat(&[&self.shard()?, &tag], 0)?;
        self.shared.group.all_gather_async(&tagged)
    }

    /// The full tensors (detached, in flat order) from a finished [`gather_async`]; fails
    /// when a rank gathered another unit.
    pub fn unflatten_gathered(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let n = self.layout.shard_len();
        let tags: Vec<Tensor> = parts
            .iter()
            .map(|p| p.narrow(0, n, TAG_DIGITS))
            .collect::<candle_core::Result<_>>()?;
        let digits = Tensor::cat(&tags, 0)?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?;
        let tags: Vec<usize> = digits
            .chunks(TAG_DIGITS)
            .map(|d| {
                d.iter()
                    .enumerate()
                    .map(|(k, &v)| (v as usize) << (6 * k))
                    .sum()
            })
            .collect();
        if let Some((rank, &tag)) = tags.iter().enumerate().find(|(_, &t)| t != self.id) {
            let other = self.shared.name(tag);
            return Err(Error::Mismatch {
                detail: format!(
                    "FullyShardedDataParallel: rank {} gathered the parameters of unit `{}` \
                     while rank {rank} gathered those of unit `{other}`: every rank must run \
                     the same units in the same order, in forward and in backward (a unit \
                     whose output reaches the loss on some ranks only gets here)",
                    self.shared.group.rank(),
                    self.name
                ),
            });
        }
        let shards: Vec<Tensor> = parts
            .iter()
            .map(|p| p.narrow(0, 0, n))
            .collect::<candle_core::Result<_>>()?;
        self.layout.from_shards(&shards, &self.shapes)
    }

    /// The full tensors, gathered from every rank's shard.
    pub fn gather(&self) -> Result<Vec<Tensor>> {
        let work = match lock(&self.prefetched).take() {
            Some(work) => work,
            None => self.gather_async()?,
        };
        self.unflatten_gathered(work.wait()?)
    }

    /// Issues this unit's all-gather now, for a use to come (every rank prefetches the same
    /// units in the same order); does nothing when one is already in flight.
    pub fn prefetch(&self) -> Result<()> {
        let mut slot = lock(&self.prefetched);
        if slot.is_none() {
            *slot = Some(self.gather_async()?);
        }
        Ok(())
    }

    /// Issues the reduce-scatter (average) of this rank's full gradients `grads` (in flat
    /// order; `None` where a parameter got none: zeros, and it counts as unused here), in the
    /// policy's reduce dtype; [`take_gradient`] waits for it.
    pub fn reduce_scatter(&self, grads: Vec<Option<Tensor>>) -> Result<()> {
        for (used, g) in lock(&self.used).iter_mut().zip(&grads) {
            *used |= g.is_some();
        }
        let dtype = self.shared.precision.reduce_dtype(self.compute);
        let mut grads = grads;
        {
            // Under no_sync the sums stay here; the next synchronised backward sends them.
            let mut local = lock(&self.local);
            let accumulate = self.shared.no_sync.load(Ordering::SeqCst) > 0;
            for (g, sum) in grads.iter_mut().zip(local.iter_mut()) {
                let both = match (g.take(), sum.take()) {
                    (Some(a), Some(b)) => Some((a.to_dtype(dtype)? + b)?),
                    (Some(a), None) => Some(a.to_dtype(dtype)?),
                    (None, b) => b,
                };
                match accumulate {
                    true => *sum = both,
                    false => *g = both,
                }
            }
            if accumulate {
                return Ok(());
            }
        }
        let grads: Vec<Tensor> = grads
            .into_iter()
            .zip(&self.shapes)
            .map(|(g, shape)| match g {
                Some(g) => crate::nn::cast(&g, dtype),
                None => Tensor::zeros(shape.as_slice(), dtype, &self.shared.device),
            })
            .collect::<candle_core::Result<_>>()?;
        let flat = self.layout.flatten(&grads)?;
        drop(grads);
        let work = self
            .shared
            .group
            .reduce_scatter_async(&flat, ReduceOp::Avg)?;
        lock(&self.pending).push(work);
        Ok(())
    }

    /// This rank's shard of the averaged gradient of the iteration: the sum of every
    /// reduce-scatter issued for it (a unit used twice in one forward has two), or `None` when
    /// none was (the unit's output did not reach the loss).
    pub fn take_gradient(&self) -> Result<Option<Tensor>> {
        let works: Vec<Work<Tensor>> = std::mem::take(&mut *lock(&self.pending));
        let mut sum: Option<Tensor> = None;
        for work in works {
            let g = work.wait()?;
            sum = Some(match sum {
                Some(s) => (s + g)?,
                None => g,
            });
        }
        Ok(sum)
    }

    /// Whether gradients summed under `no_sync` wait to be reduce-scattered, with no
    /// reduce-scatter issued for this backward yet (the unit did not run in it).
    pub fn holds_local_sums(&self) -> bool {
        lock(&self.pending).is_empty() && lock(&self.local).iter().any(Option::is_some)
    }

    /// Per parameter, whether it got a gradient on this rank in the iteration; resets it.
    pub fn take_used(&self) -> Vec<bool> {
        let mut used = lock(&self.used);
        std::mem::replace(&mut *used, vec![false; self.pieces.len()])
    }

    /// Drops the reduce-scatters in flight after a failed backward, waiting for each (a
    /// collective cannot be withdrawn once issued).
    pub fn abandon(&self) {
        for work in std::mem::take(&mut *lock(&self.pending)) {
            let _ = work.wait();
        }
        self.take_used();
        lock(&self.local).fill(None);
    }

    /// The iteration under way.
    pub fn iteration(&self) -> u64 {
        self.shared.iteration.load(Ordering::SeqCst)
    }

    /// A `VarBuilder` at the unit's prefix serving `tensors` (full, in flat order) under the
    /// variables' names, and the buffers as `how` says: what the unit's constructor is given
    /// at each use.
    pub fn var_builder(
        &self,
        tensors: Vec<Tensor>,
        how: Buffers,
    ) -> Result<candle_nn::VarBuilder<'static>> {
        let prefix = if self.id == 0 || self.name == UNPREFIXED {
            ""
        } else {
            self.name.as_str()
        };
        Ok(super::backend::serving(
            &self.names,
            tensors,
            &self.buffers,
            how,
            prefix,
            self.compute,
            &self.shared.device,
        )?)
    }

    /// The bytes of this rank's shard.
    pub fn shard_bytes(&self) -> usize {
        self.layout.shard_len() * self.dtype.size_in_bytes()
    }
}

/// "name buffer of unit U dtype [shape]" for each of `buffers`: what every rank must agree on.
fn describe_buffers<'a>(
    unit: &'a str,
    buffers: &'a [(String, Var)],
) -> impl Iterator<Item = String> + 'a {
    buffers.iter().map(move |(n, v)| {
        format!(
            "{n} buffer of unit {unit} {} {:?}",
            v.dtype().as_str(),
            v.dims()
        )
    })
}

/// Overwrites `buffers` with rank 0's values, on every rank (every rank must call it).
pub(crate) fn broadcast_buffers(group: &ProcessGroup, buffers: &[(String, Var)]) -> Result<()> {
    let travelling: Vec<Var> = buffers
        .iter()
        .filter(|(_, v)| travels(v.dtype()))
        .map(|(_, v)| v.clone())
        .collect();
    broadcast_from_rank_0(group, &travelling, 25 << 20)
}

/// Checks that every rank has the same `buffers` (outside any unit: `unit` is the root) and
/// takes rank 0's values.
pub(crate) fn agree_on_buffers(
    shared: &Shared,
    unit: &str,
    buffers: &[(String, Var)],
) -> Result<()> {
    let descriptions: Vec<String> = describe_buffers(unit, buffers).collect();
    check_same_descriptions(&shared.group, &descriptions, &shared.device, FSDP)?;
    broadcast_buffers(&shared.group, buffers)
}
