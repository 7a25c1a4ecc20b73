//! One unit's parameters as one flat shard per rank (torch FSDP's `FlatParameter`): how it is
//! made from the full tensors at construction, gathered back whole for a forward or backward,
//! and how a unit's full gradient becomes this rank's shard of the world's average.
//!
//! Every gather carries the unit's number beside the shard, so that ranks running different
//! units at the same point (a unit used on some ranks only) fail with a typed error naming
//! both units, rather than combining one unit's shards with another's of the same size.

use crate::ddp::agreement::check_same_descriptions;
use crate::distributed::{ProcessGroup, ReduceOp, Work};
use crate::error::{Error, Result};
use crate::shard::FlatLayout;
use crate::util::sync::lock;
use candle_core::{DType, Device, Tensor, Var};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The name of the parameters outside every unit, in messages.
pub(crate) const ROOT: &str = "(root)";

/// The name of a unit built at the root of the `VarBuilder`, in messages.
pub(crate) const UNPREFIXED: &str = "(unprefixed)";

/// What every flat parameter of one wrapper shares: its group, and the iteration under way.
pub(crate) struct Shared {
    pub group: ProcessGroup,
    pub device: Device,
    /// Training forwards so far: a unit's backward belongs to the iteration of its forward.
    pub iteration: AtomicU64,
    /// Each flat parameter's name, by number (0 is the root).
    names: Mutex<Vec<String>>,
    /// The first typed error raised inside candle's backward (where only candle errors pass).
    error: Mutex<Option<Error>>,
}

impl Shared {
    pub fn new(group: ProcessGroup, device: Device) -> Self {
        Self {
            group,
            device,
            iteration: AtomicU64::new(0),
            names: Mutex::new(vec![ROOT.to_string()]),
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
    pub dtype: DType,
    pub layout: FlatLayout,
    /// This rank's shard: what the optimizer steps.
    pub shard: Var,
    pub shared: Arc<Shared>,
    /// Reduce-scatters of this iteration's gradients, in flight.
    pending: Mutex<Vec<Work<Tensor>>>,
}

impl FlatParam {
    /// Makes the flat parameter of `entries` (full names and values, the same on every rank
    /// after this): checks that every rank has the same names, shapes and dtypes, takes rank
    /// 0's values, and keeps this rank's shard only.
    pub fn new(
        shared: &Arc<Shared>,
        name: &str,
        entries: Vec<(String, Tensor)>,
    ) -> Result<Arc<Self>> {
        let unit_error = |detail: String| Error::FsdpUnit {
            unit: name.to_string(),
            detail,
        };
        let Some((_, first)) = entries.first() else {
            return Err(unit_error(
                "it asked for no variables: mark as units only modules with parameters".into(),
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
            .collect();
        check_same_descriptions(group, &descriptions, &shared.device)?;
        let numels: Vec<usize> = entries.iter().map(|(_, t)| t.elem_count()).collect();
        let layout = FlatLayout::new(&numels, group.world_size());
        let values: Vec<Tensor> = entries.iter().map(|(_, t)| t.clone()).collect();
        let mut flat = layout.flatten(&values)?;
        drop(values);
        if group.world_size() > 1 {
            flat = group.broadcast(&flat, 0)?;
        }
        let range = layout.shard_range(group.rank());
        // A copy of its own, so that the full buffer is freed now.
        let shard = flat.narrow(0, range.start, range.len())?.copy()?;
        drop(flat);
        let id = {
            let mut names = lock(&shared.names);
            if name == ROOT {
                0
            } else {
                names.push(name.to_string());
                names.len() - 1
            }
        };
        Ok(Arc::new(Self {
            id,
            name: name.to_string(),
            names: entries.iter().map(|(n, _)| n.clone()).collect(),
            shapes: entries.iter().map(|(_, t)| t.dims().to_vec()).collect(),
            dtype,
            layout,
            shard: Var::from_tensor(&shard)?,
            shared: shared.clone(),
            pending: Mutex::new(Vec::new()),
        }))
    }

    /// Issues the all-gather of every rank's shard, tagged with this unit's number.
    pub fn gather_async(&self) -> Result<Work<Vec<Tensor>>> {
        let tag = Tensor::new(&[self.id as f64], &self.shared.device)?.to_dtype(self.dtype)?;
        let tagged = Tensor::cat(&[self.shard.as_tensor(), &tag], 0)?;
        self.shared.group.all_gather_async(&tagged)
    }

    /// The full tensors (detached, in flat order) from a finished [`gather_async`]; fails
    /// when a rank gathered another unit.
    pub fn unflatten_gathered(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let n = self.layout.shard_len();
        let tags: Vec<Tensor> = parts
            .iter()
            .map(|p| p.narrow(0, n, 1))
            .collect::<candle_core::Result<_>>()?;
        let tags = Tensor::cat(&tags, 0)?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?;
        if let Some((rank, &tag)) = tags.iter().enumerate().find(|(_, &t)| t != self.id as f64) {
            let other = self.shared.name(tag as usize);
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
        let full = Tensor::cat(&shards, 0)?;
        self.layout.unflatten(&full, &self.shapes)
    }

    /// The full tensors, gathered from every rank's shard.
    pub fn gather(&self) -> Result<Vec<Tensor>> {
        let parts = self.gather_async()?.wait()?;
        self.unflatten_gathered(parts)
    }

    /// Issues the reduce-scatter (average) of this rank's full gradients `grads` (in flat
    /// order; `None` where a parameter got none: zeros); [`take_gradient`] waits for it.
    pub fn reduce_scatter(&self, grads: Vec<Option<Tensor>>) -> Result<()> {
        let grads: Vec<Tensor> = grads
            .into_iter()
            .zip(&self.shapes)
            .map(|(g, shape)| match g {
                Some(g) => Ok(g),
                None => Tensor::zeros(shape.as_slice(), self.dtype, &self.shared.device),
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

    /// Drops the reduce-scatters in flight after a failed backward, waiting for each (a
    /// collective cannot be withdrawn once issued).
    pub fn abandon(&self) {
        for work in std::mem::take(&mut *lock(&self.pending)) {
            let _ = work.wait();
        }
    }

    /// The iteration under way.
    pub fn iteration(&self) -> u64 {
        self.shared.iteration.load(Ordering::SeqCst)
    }

    /// A `VarBuilder` at the unit's prefix serving `tensors` (full, in flat order) under the
    /// variables' names: what the unit's constructor is given at each use.
    pub fn var_builder(&self, tensors: Vec<Tensor>) -> candle_nn::VarBuilder<'static> {
        let prefix = if self.id == 0 || self.name == UNPREFIXED {
            ""
        } else {
            self.name.as_str()
        };
        super::backend::serving(
            &self.names,
            tensors,
            prefix,
            self.dtype,
            &self.shared.device,
        )
    }

    /// The bytes of this rank's shard.
    pub fn shard_bytes(&self) -> usize {
        self.layout.shard_len() * self.dtype.size_in_bytes()
    }
}
