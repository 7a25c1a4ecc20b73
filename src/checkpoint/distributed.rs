//! One checkpoint for every layout (PyTorch's Distributed Checkpoint): each rank saves the
//! pieces it holds, one index says where every piece of every tensor is, and any layout at any
//! world size loads it back, each rank reading only the pieces that overlap its own.
//!
//! A rank describes what it holds as a [`StateDict`]: each tensor's whole shape and this rank's
//! pieces of it, each piece a [`Region`] of the whole tensor (a box, as tensor-parallel cuts
//! and row blocks are; or a flat range, as ZeRO-2's and fully sharded's shards are). The
//! wrappers make theirs (`DistributedDataParallel::state_dict`, the fully sharded wrapper's,
//! `ParallelPlan::state_dict`, `pipeline`'s stages'); a one-process program's is
//! [`training_state`].
//!
//! [`Checkpointer::save`]: the ranks exchange their descriptions; every piece held by several
//! ranks (replicated weights) is written once, by the rank that has written least so far; the
//! pieces of every tensor must tile it exactly. Each rank writes its file
//! (`shard-<rank>-of-<world>-<save>.safetensors`, with a CRC-32C of every piece), and once all
//! have, rank 0 writes `index.json` (atomically, as every file): the save exists from that
//! moment, and files of earlier saves are removed after. A process killed during a save leaves
//! the previous index, whose files are still there: the previous checkpoint loads.
//!
//! [`Checkpointer::load`]: every rank says what it wants ([`Wanted`], from its own
//! [`StateDict::wanted`] or built by hand), reads the index, and copies from each stored piece
//! the elements its regions share with it. A missing, torn or foreign file, a piece that does
//! not match its checksum, a tensor the checkpoint lacks or of another shape, is an error
//! naming the file and the tensor, on every rank, and nothing is returned.
//!
//! [`Checkpointer::save_async`] copies the pieces to host memory and returns; a thread writes
//! and commits the save while training goes on (on the host backend; with the job's
//! collectives on a GPU, the commit waits for [`Checkpointer::wait`], the next save or load).
//!
//! ```rust
//! use candle_core::{DType, Device, Tensor};
//! use candle_parallel::checkpoint::distributed::{Checkpointer, Region, ShardedTensor, StateDict};
//! # fn main() -> candle_parallel::Result<()> {
//! let dir = std::env::temp_dir().join(format!("dcp-doc-{}", std::process::id()));
//! # let _ = std::fs::remove_dir_all(&dir);
//! let w = Tensor::arange(0f32, 12., &Device::Cpu)?.reshape((4, 3))?;
//! // Saved as two row blocks (as two tensor-parallel ranks would hold it) ...
//! let mut state = StateDict::new();
//! state.insert(
//!     "w",
//!     ShardedTensor::new(
//!         &[4, 3],
//!         DType::F32,
//!         vec![
//!             (Region::Box { offsets: vec![0, 0], sizes: vec![2, 3] }, w.narrow(0, 0, 2)?),
//!             (Region::Box { offsets: vec![2, 0], sizes: vec![2, 3] }, w.narrow(0, 2, 2)?),
//!         ],
//!     )?,
//! );
//! let mut checkpoints = Checkpointer::new(&dir);
//! checkpoints.save(&state)?;
//! // ... and loaded as a flat shard (as a ZeRO-2 rank holds it).
//! let mut wanted = StateDict::new();
//! wanted.insert("w", ShardedTensor::new(&[4, 3], DType::F32, vec![
//!     (Region::Flat { start: 5, len: 4 }, Tensor::zeros(4, DType::F32, &Device::Cpu)?),
//! ])?);
//! let loaded = checkpoints.load(&wanted.wanted(), Default::default())?;
//! assert_eq!(loaded.get("w").unwrap().pieces()[0].1.to_vec1::<f32>()?, [5., 6., 7., 8.]);
//! # std::fs::remove_dir_all(&dir).unwrap();
//! # Ok(()) }
//! ```

mod index;
mod region;
mod save;

pub use index::{Index, INDEX_FILE};
pub use region::Region;

use crate::checkpoint::{optimizer_tensors, var_names, LoadOptions, OPTIMIZER, OPTIMIZER_STATE};
use crate::distributed::objects::agree_on;
use crate::distributed::ProcessGroup;
use crate::error::{Error, Result};
use crate::optim::{ElementwiseOptimizer, OptimizerState};
use crate::util::sync::lock;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use index::Reader;
use region::overlaps;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// A tensor as one rank holds it: its whole shape and dtype, and the pieces of it this rank
/// has (none, some, or the whole).
#[derive(Clone, Debug)]
pub struct ShardedTensor {
    shape: Vec<usize>,
    dtype: DType,
    pieces: Vec<(Region, Tensor)>,
}

impl ShardedTensor {
    /// A tensor held whole.
    pub fn whole(t: Tensor) -> Self {
        Self {
            shape: t.dims().to_vec(),
            dtype: t.dtype(),
            pieces: vec![(Region::whole(t.dims()), t)],
        }
    }

    /// A tensor of whole shape `shape` and `dtype`, of which this rank holds `pieces`: each
    /// region must fit in `shape`, and its tensor have the region's shape (a flat region's
    /// piece: its length, in any shape) and `dtype`.
    pub fn new(shape: &[usize], dtype: DType, pieces: Vec<(Region, Tensor)>) -> Result<Self> {
        for (region, t) in &pieces {
            let wrong = |detail: String| Error::InvalidArgument {
                what: "a piece of a sharded tensor",
                detail,
            };
            if let Some(why) = region.misfit(shape) {
                return Err(wrong(why));
            }
            let fits = match region {
                Region::Box { sizes, .. } => t.dims() == sizes.as_slice(),
                Region::Flat { len, .. } => t.elem_count() == *len,
            };
            if !fits {
                return Err(wrong(format!(
                    "{region:?} holds {:?} elements, its tensor has shape {:?}",
                    region.dims(),
                    t.dims()
                )));
            }
            if t.dtype() != dtype {
                return Err(wrong(format!(
                    "the piece at {region:?} is {:?}, the tensor {dtype:?}",
                    t.dtype()
                )));
            }
        }
        Ok(Self {
            shape: shape.to_vec(),
            dtype,
            pieces,
        })
    }

    /// The whole tensor's shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Its dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// This rank's pieces.
    pub fn pieces(&self) -> &[(Region, Tensor)] {
        &self.pieces
    }

    /// This rank's pieces, taken.
    pub fn into_pieces(self) -> Vec<(Region, Tensor)> {
        self.pieces
    }

    /// The one piece this rank holds, if it holds exactly one.
    pub fn piece(&self) -> Option<&Tensor> {
        match self.pieces.as_slice() {
            [(_, t)] => Some(t),
            _ => None,
        }
    }

    /// This rank's pieces laid end to end along dimension 0, as one tensor: the piece itself
    /// when there is one, a packed tensor-parallel part (its queries', keys' and values' rows)
    /// when there are several.
    pub(crate) fn joined(&self) -> Result<Tensor> {
        match self.pieces.as_slice() {
            [] => Err(Error::InvalidArgument {
                what: "a sharded tensor",
                detail: "this rank holds no piece of it to join".into(),
            }),
            [(_, t)] => Ok(t.clone()),
            pieces => {
                let all: Vec<Tensor> = pieces.iter().map(|(_, p)| p.clone()).collect();
                Ok(Tensor::cat(&all, 0)?)
            }
        }
    }
}

/// What one rank holds of a model's training state: tensors by name.
#[derive(Clone, Debug, Default)]
pub struct StateDict {
    tensors: BTreeMap<String, ShardedTensor>,
}

impl StateDict {
    /// An empty one.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) tensor `name`.
    pub fn insert(&mut self, name: impl Into<String>, t: ShardedTensor) {
        self.tensors.insert(name.into(), t);
    }

    /// Tensor `name`.
    pub fn get(&self, name: &str) -> Option<&ShardedTensor> {
        self.tensors.get(name)
    }

    /// Takes tensor `name` out.
    pub fn remove(&mut self, name: &str) -> Option<ShardedTensor> {
        self.tensors.remove(name)
    }

    /// The tensors, by name in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &ShardedTensor)> {
        self.tensors.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// How many tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether it has none.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// What loading into these very pieces asks for: each tensor's shape, dtype, device and
    /// regions.
    pub fn wanted(&self) -> BTreeMap<String, Wanted> {
        self.tensors
            .iter()
            .map(|(name, t)| {
                let device = t
                    .pieces
                    .first()
                    .map_or(Device::Cpu, |(_, p)| p.device().clone());
                let wanted = Wanted {
                    shape: t.shape.clone(),
                    dtype: Some(t.dtype),
                    device,
                    regions: t.pieces.iter().map(|(r, _)| r.clone()).collect(),
                };
                (name.clone(), wanted)
            })
            .collect()
    }
}

impl IntoIterator for StateDict {
    type Item = (String, ShardedTensor);
    type IntoIter = std::collections::btree_map::IntoIter<String, ShardedTensor>;
    fn into_iter(self) -> Self::IntoIter {
        self.tensors.into_iter()
    }
}

/// What a rank wants loaded of one tensor.
#[derive(Clone, Debug)]
pub struct Wanted {
    /// The whole tensor's shape, which must be the saved one.
    pub shape: Vec<usize>,
    /// The dtype it is wanted in: `None` takes the saved one; another than the saved one is an
    /// error unless [`LoadOptions::convert_dtypes`].
    pub dtype: Option<DType>,
    /// Where the pieces go.
    pub device: Device,
    /// The regions wanted, each becoming one piece.
    pub regions: Vec<Region>,
}

/// A folder that holds a distributed checkpoint, saved and loaded by every rank of a job
/// together (or by one process); see the [module docs](self).
pub struct Checkpointer {
    dir: PathBuf,
    group: Option<(ProcessGroup, Device)>,
    /// A group of its own, for the commits of asynchronous saves.
    commit_group: Option<ProcessGroup>,
    /// The asynchronous save in flight; behind a lock so that loads (`&self`) can finish it.
    pending: Mutex<Option<save::Pending>>,
    /// The failure of an asynchronous save that a load finished, for the next `wait`.
    failed: Mutex<Option<Error>>,
}

impl std::fmt::Debug for Checkpointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpointer")
            .field("dir", &self.dir)
            .field("rank", &self.group.as_ref().map(|(g, _)| g.rank()))
            .field("pending", &lock(&self.pending).is_some())
            .finish()
    }
}

impl Checkpointer {
    /// The checkpoint in `dir` of a single process.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            group: None,
            commit_group: None,
            pending: Mutex::new(None),
            failed: Mutex::new(None),
        }
    }

    /// The checkpoint in `dir` of a job: every rank of `group` saves and loads together, and
    /// `dir` is the same folder for all of them (a shared file system when the job spans
    /// machines). `device` is where the group's collectives run.
    pub fn for_group(dir: impl Into<PathBuf>, group: &ProcessGroup, device: &Device) -> Self {
        Self {
            dir: dir.into(),
            group: Some((group.clone(), device.clone())),
            commit_group: None,
            pending: Mutex::new(None),
            failed: Mutex::new(None),
        }
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Saves `state` (this rank's pieces; every rank calls it) and returns once the save is
    /// committed. An asynchronous save still in flight is finished first.
    pub fn save(&mut self, state: &StateDict) -> Result<()> {
        self.wait()?;
        let planned = save::plan(&self.dir, self.group.as_ref(), state)?;
        let written = planned.write(&self.dir, state);
        save::commit(self.group.as_ref(), &self.dir, &planned, written)
    }

    /// Starts saving `state`: the pieces this rank writes are copied to host memory, then a
    /// thread writes them while the caller goes on. On the host backend the thread also commits
    /// the save (over a process group of its own); with the job's collectives on a GPU, the
    /// save is committed by [`wait`](Self::wait), the next save or load. A save still in
    /// flight is finished first. Every rank calls it.
    pub fn save_async(&mut self, state: &StateDict) -> Result<()> {
        self.wait()?;
        let planned = save::plan(&self.dir, self.group.as_ref(), state)?;
        // One process, or the host backend: the thread commits (over a group of its own, so
        // that its collectives never meet the training's); else `wait` does.
        let commit = match &self.group {
            None => Some(None),
            Some((g, d)) if d.is_cpu() => {
                if self.commit_group.is_none() {
                    let all: Vec<usize> = (0..g.world_size()).collect();
                    self.commit_group = g.new_group(&all)?;
                }
                self.commit_group.clone().map(|g| Some((g, Device::Cpu)))
            }
            Some(_) => None,
        };
        *lock(&self.pending) = Some(save::Pending::start(planned, state, &self.dir, commit)?);
        Ok(())
    }

    /// Finishes the asynchronous save in flight, if any: waits for its file, commits it if its
    /// thread does not, and returns its outcome (every rank calls it).
    pub fn wait(&mut self) -> Result<()> {
        self.finish_pending();
        match lock(&self.failed).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Finishes the asynchronous save in flight, if any, keeping its failure for `wait`: a load
    /// during the save would read the index of the previous save while rank 0 removes that
    /// save's files once the new one commits.
    fn finish_pending(&self) {
        let pending = lock(&self.pending).take();
        if let Some(Err(e)) = pending.map(|p| p.finish(self.group.as_ref(), &self.dir)) {
            log::warn!(
                "an asynchronous save to {} failed (the next `wait` returns it): {e}",
                self.dir.display()
            );
            *lock(&self.failed) = Some(e);
        }
    }

    /// Whether an asynchronous save is still being written (its thread not done).
    pub fn in_flight(&self) -> bool {
        lock(&self.pending).as_ref().is_some_and(|p| !p.done())
    }

    /// The committed checkpoint's index (every rank reads it; an error on every rank unless
    /// every rank could). An asynchronous save in flight is finished first.
    pub fn index(&self) -> Result<Index> {
        self.finish_pending();
        let index = Index::read(&self.dir);
        self.agree(index)
    }

    /// Whether the folder holds a committed checkpoint (read by this rank alone).
    pub fn exists(&self) -> bool {
        self.dir.join(INDEX_FILE).is_file()
    }

    /// Loads what `wanted` asks for from the committed checkpoint: each tensor's regions, as
    /// pieces in the same order. Every rank calls it; unless every rank could load all it asked
    /// for, every rank gets an error (naming the file and tensor) and nothing. An asynchronous
    /// save in flight is finished first (its failure is [`wait`](Self::wait)'s to return).
    pub fn load(
        &self,
        wanted: &BTreeMap<String, Wanted>,
        options: LoadOptions,
    ) -> Result<StateDict> {
        self.finish_pending();
        let loaded = Index::read(&self.dir).and_then(|index| load_from(&index, wanted, options));
        self.agree(loaded)
    }

    /// As [`load`](Self::load), from `index`, which [`index`](Self::index) just read (the
    /// layouts read it first, to learn the optimizer's keys): the index is not read again.
    pub(crate) fn load_indexed(
        &self,
        index: &Index,
        wanted: &BTreeMap<String, Wanted>,
        options: LoadOptions,
    ) -> Result<StateDict> {
        self.agree(load_from(index, wanted, options))
    }

    /// `result` of this rank, agreed by every rank: a failure anywhere is an error everywhere
    /// (a layout's checks before a load, so that no rank waits for one that gave up).
    pub(crate) fn agree<T>(&self, result: Result<T>) -> Result<T> {
        match &self.group {
            Some((g, d)) => agree_on(g, d, result, |rank, message| Error::Checkpoint {
                key: String::new(),
                path: self.dir.clone(),
                detail: format!("rank {rank} failed: {message}"),
            }),
            None => result,
        }
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        if let Some(p) = lock(&self.pending).take() {
            if let Err(e) = p.finish_alone() {
                log::error!(
                    "an asynchronous save to {} did not finish: {e}",
                    self.dir.display()
                );
            }
        }
    }
}

/// Loads `wanted` from `index`'s checkpoint, on this rank alone.
fn load_from(
    index: &Index,
    wanted: &BTreeMap<String, Wanted>,
    options: LoadOptions,
) -> Result<StateDict> {
    let path = index.dir.join(INDEX_FILE);
    let mut reader = Reader::new(index);
    let mut out = StateDict::new();
    for (key, want) in wanted {
        let bad = |detail: String| Error::Checkpoint {
            key: key.clone(),
            path: path.clone(),
            detail,
        };
        let entry = index.file.tensors.get(key).ok_or_else(|| {
            bad(format!(
                "the checkpoint has no tensor `{key}`: saved from another model?"
            ))
        })?;
        if entry.shape != want.shape {
            return Err(bad(format!(
                "`{key}` has shape {:?} in the checkpoint and {:?} here",
                entry.shape, want.shape
            )));
        }
        let saved: DType = entry
            .dtype
            .parse()
            .map_err(|_| bad("unknown dtype".into()))?;
        let dtype = match want.dtype {
            Some(d) if d != saved && !options.convert_dtypes => {
                return Err(bad(format!(
                    "`{key}` is {saved:?} in the checkpoint and {d:?} here: a checkpoint of \
                     another model, or a corrupt one; to convert on purpose, load with \
                     LoadOptions {{ convert_dtypes: true, .. }}"
                )))
            }
            Some(d) => {
                if d != saved {
                    log::warn!("`{key}` is {saved:?} in the checkpoint: converting to {d:?}");
                }
                d
            }
            None => saved,
        };
        let stored_runs: Vec<_> = entry
            .pieces
            .iter()
            .map(|p| p.region.runs(&entry.shape))
            .collect();
        let numel = entry.shape.iter().product();
        if let Some(fault) = region::runs_tiling_fault(numel, &stored_runs) {
            return Err(bad(format!(
                "`{key}`'s pieces in the index do not tile it: {fault}"
            )));
        }
        let size = saved.size_in_bytes();
        let mut pieces = Vec::with_capacity(want.regions.len());
        for region in &want.regions {
            if let Some(why) = region.misfit(&entry.shape) {
                return Err(bad(format!("`{key}`: {why}")));
            }
            let runs = region.runs(&entry.shape);
            let mut buf = vec![0u8; region.elem_count() * size];
            let mut filled = 0;
            for (stored, s_runs) in entry.pieces.iter().zip(&stored_runs) {
                let copies = overlaps(s_runs, &runs);
                if copies.is_empty() {
                    continue;
                }
                let piece = reader.piece(stored.file, &stored.key)?;
                let (piece_dtype, data) = (&piece.0, &piece.1);
                if *piece_dtype != saved || data.len() != stored.region.elem_count() * size {
                    return Err(Error::Checkpoint {
                        key: stored.key.clone(),
                        path: index.dir.join(&index.file.files[stored.file].name),
                        detail: format!(
                            "`{}` is {piece_dtype:?} of {} bytes; the index says {saved:?} of \
                             {} elements",
                            stored.key,
                            data.len(),
                            stored.region.elem_count()
                        ),
                    });
                }
                for c in copies {
                    buf[c.to * size..(c.to + c.len) * size]
                        .copy_from_slice(&data[c.from * size..(c.from + c.len) * size]);
                    filled += c.len;
                }
            }
            debug_assert_eq!(
                filled,
                region.elem_count(),
                "the stored pieces tile `{key}`"
            );
            let t = Tensor::from_raw_buffer(&buf, saved, &region.dims(), &Device::Cpu)?;
            pieces.push((region.clone(), t.to_dtype(dtype)?.to_device(&want.device)?));
        }
        out.insert(
            key.clone(),
            ShardedTensor {
                shape: want.shape.clone(),
                dtype,
                pieces,
            },
        );
    }
    Ok(out)
}

/// The training state of a one-process model: every variable of `varmap` whole, under its
/// name, and `opt`'s state as [`crate::checkpoint::save_training_state`] names it
/// (`optimizer.state.<variable>.<state>`, and each scalar as a 0-dim f64 tensor under
/// `optimizer.<scalar>`). Every variable of `opt` must be one of `varmap`'s.
pub fn training_state(varmap: &VarMap, opt: &impl ElementwiseOptimizer) -> Result<StateDict> {
    let names = var_names(varmap, opt.vars())?;
    let mut state = StateDict::new();
    for (name, var) in lock(varmap.data()).iter() {
        state.insert(name.clone(), ShardedTensor::whole(var.as_tensor().clone()));
    }
    for (name, t) in optimizer_tensors(&names, &opt.state())? {
        state.insert(name, ShardedTensor::whole(t));
    }
    Ok(state)
}

/// Loads a training state from `checkpoints` into `varmap`'s variables and `opt` (a
/// one-process program; the checkpoint saved under any layout at any world size): every
/// variable must be in it; the optimizer's state is taken for the variables it has state for.
/// Nothing is changed unless all of it loads.
pub fn load_training_state(
    checkpoints: &Checkpointer,
    varmap: &VarMap,
    opt: &mut impl ElementwiseOptimizer,
    options: LoadOptions,
) -> Result<()> {
    let index = checkpoints.index()?;
    let vars: Vec<(String, candle_core::Var)> = lock(varmap.data())
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    let names = var_names(varmap, opt.vars())?;
    let mut wanted = BTreeMap::new();
    for (name, var) in &vars {
        wanted.insert(
            name.clone(),
            whole_wanted(var.as_tensor(), Some(var.dtype())),
        );
    }
    wanted.extend(optimizer_wanted(
        &index,
        &names,
        &Device::Cpu,
        |_, shape| vec![Region::whole(shape)],
    ));
    let loaded = checkpoints.load_indexed(&index, &wanted, options)?;
    let state = optimizer_state(&loaded, &names, |_, t| Ok(t.clone()))?;
    opt.load_state(&state)?;
    for (name, var) in &vars {
        if let Some(t) = loaded.get(name).and_then(ShardedTensor::piece) {
            var.set(t)?;
        }
    }
    Ok(())
}

/// Puts the optimizer's `scalars` into `out`, each whole (every rank holds them) as a 0-dim
/// f64 tensor under `optimizer.<scalar>`, as a training-state file has them.
pub(crate) fn insert_scalars(out: &mut StateDict, scalars: BTreeMap<String, f64>) -> Result<()> {
    let scalars_only = OptimizerState {
        scalars,
        per_var: Vec::new(),
    };
    for (name, t) in optimizer_tensors(&[], &scalars_only)? {
        out.insert(name, ShardedTensor::whole(t));
    }
    Ok(())
}

/// Wanting the whole of `t`.
pub(crate) fn whole_wanted(t: &Tensor, dtype: Option<DType>) -> Wanted {
    Wanted {
        shape: t.dims().to_vec(),
        dtype,
        device: t.device().clone(),
        regions: vec![Region::whole(t.dims())],
    }
}

/// The optimizer's keys of `index` for the parameters `names` (in the optimizer's order):
/// each per-parameter state (`optimizer.state.<name>.<state>`) as `regions(i, shape)` of it
/// (`i`: the parameter's place in `names`; `shape`: the saved one), in the saved dtype on
/// `device`; every scalar whole, on the host.
pub(crate) fn optimizer_wanted(
    index: &Index,
    names: &[String],
    device: &Device,
    regions: impl Fn(usize, &[usize]) -> Vec<Region>,
) -> BTreeMap<String, Wanted> {
    let mut out = BTreeMap::new();
    for key in index.keys() {
        let shape = index.shape(key).unwrap_or_default().to_vec();
        if let Some(rest) = key.strip_prefix(OPTIMIZER_STATE) {
            if let Some((i, _)) = state_of(rest, names) {
                let wanted = Wanted {
                    regions: regions(i, &shape),
                    shape,
                    dtype: None,
                    device: device.clone(),
                };
                out.insert(key.to_string(), wanted);
            }
        } else if let Some(scalar) = key.strip_prefix(OPTIMIZER) {
            if !scalar.contains('.') {
                let wanted = Wanted {
                    regions: vec![Region::whole(&shape)],
                    shape,
                    dtype: None,
                    device: Device::Cpu,
                };
                out.insert(key.to_string(), wanted);
            }
        }
    }
    out
}

/// `(parameter index, state name)` of `rest` (a key without `optimizer.state.`), if it is a
/// state of one of `names`.
fn state_of<'a>(rest: &'a str, names: &[String]) -> Option<(usize, &'a str)> {
    names.iter().enumerate().find_map(|(i, n)| {
        let state = rest.strip_prefix(n.as_str())?.strip_prefix('.')?;
        (!state.contains('.')).then_some((i, state))
    })
}

/// The optimizer state of the parameters `names` (in the optimizer's order) in `loaded`: each
/// state's pieces ([`ShardedTensor::joined`]) passed through `finish(i, state)` (to the form the
/// optimizer keeps, e.g. a padded chunk), and every scalar.
pub(crate) fn optimizer_state(
    loaded: &StateDict,
    names: &[String],
    finish: impl Fn(usize, &Tensor) -> Result<Tensor>,
) -> Result<OptimizerState> {
    let mut state = OptimizerState {
        scalars: BTreeMap::new(),
        per_var: vec![BTreeMap::new(); names.len()],
    };
    for (key, t) in loaded.iter() {
        if let Some(rest) = key.strip_prefix(OPTIMIZER_STATE) {
            if let Some((i, s)) = state_of(rest, names) {
                state.per_var[i].insert(s.to_string(), finish(i, &t.joined()?)?);
            }
        } else if let Some(scalar) = key.strip_prefix(OPTIMIZER) {
            if !scalar.contains('.') {
                let v = t.joined()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                state.scalars.insert(scalar.to_string(), v);
            }
        }
    }
    Ok(state)
}

/// The flat region of rank `rank`'s chunk of a tensor of `numel` elements cut over `world`
/// ranks ([`crate::shard`]), without its padding.
pub(crate) fn chunk_region(numel: usize, world: usize, rank: usize) -> Region {
    let within = crate::shard::chunk_elements(numel, world, rank);
    Region::Flat {
        start: within.start,
        len: within.len(),
    }
}

/// A rank's padded chunk ([`crate::shard::chunk_of`]) as the piece of a [`chunk_region`]: the
/// real elements, flat.
pub(crate) fn chunk_piece(
    chunk: &Tensor,
    numel: usize,
    world: usize,
    rank: usize,
) -> Result<(Region, Tensor)> {
    let region = chunk_region(numel, world, rank);
    let real = chunk.flatten_all()?.narrow(0, 0, region.elem_count())?;
    Ok((region, real))
}

/// The padded chunk of a rank from its real elements `real` (a loaded [`chunk_region`]).
pub(crate) fn padded_chunk(real: &Tensor, numel: usize, world: usize) -> Result<Tensor> {
    let c = crate::shard::chunk_len(numel, world);
    let real = real.flatten_all()?;
    match c - real.elem_count() {
        0 => Ok(real),
        pad => Ok(Tensor::cat(
            &[
                real.clone(),
                Tensor::zeros(pad, real.dtype(), real.device())?,
            ],
            0,
        )?),
    }
}
