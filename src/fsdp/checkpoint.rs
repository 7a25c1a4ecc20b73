//! Training-state checkpoints of FullyShardedDataParallel, in the formats DistributedDataParallel
//! writes: the whole state gathered into one safetensors file by rank 0 (each parameter and
//! buffer under its name, each optimizer state under `optimizer.state.<parameter>.<state>`:
//! what [`crate::checkpoint::load_training_state`] and `VarMap::load` read in one process), or
//! one file per rank of its chunks ([`crate::checkpoint::sharded`]), which any world size, and
//! DDP, load back.

use super::FullyShardedDataParallel;
use crate::checkpoint::distributed::{
    chunk_piece, chunk_region, insert_scalars, optimizer_state, optimizer_wanted, padded_chunk,
    whole_wanted, Checkpointer, ShardedTensor, StateDict, Wanted,
};
use crate::checkpoint::sharded::{
    agree_on, put_part, read_sharded, read_whole, whole_states, write_share, write_whole, STATE,
};
use crate::checkpoint::{optimizer_state_from, optimizer_tensors, LoadOptions};
use crate::error::{Error, Result};
use crate::optim::{ElementwiseOptimizer, OptimizerState};
use crate::shard::chunk_of;
use candle_core::{Tensor, Var};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// One parameter as a checkpoint sees it: its name, shape and this rank's piece.
struct Slot {
    name: String,
    shape: Vec<usize>,
    piece: Var,
}

impl<M> FullyShardedDataParallel<M> {
    /// Saves the whole training state (every parameter, gathered from the pieces; every buffer;
    /// the optimizer's state of every parameter, gathered) into one safetensors file at `path`,
    /// written atomically by rank 0, in the format of
    /// [`crate::checkpoint::save_training_state`]: a one-process program loads it with
    /// `load_training_state` (its weights with `VarMap::load`), a job of any world size with
    /// [`load_checkpoint`](Self::load_checkpoint). Every rank must call it (rank 0 holds the
    /// whole model for the write); every rank gets rank 0's error if the write fails.
    pub fn save_checkpoint(
        &self,
        opt: &impl ElementwiseOptimizer,
        path: impl AsRef<Path>,
    ) -> Result<()> {
        let path = path.as_ref();
        let state = opt.state();
        let slots = self.optimizer_slots(opt)?;
        let params = self.slots();
        let mut order: Vec<(usize, usize)> = slots.iter().copied().enumerate().collect();
        order.sort_by_key(|&(_, i)| i);
        let described: Vec<(&str, &[usize], &BTreeMap<String, Tensor>)> = order
            .iter()
            .map(|&(j, i)| {
                let p = &params[i];
                (p.name.as_str(), p.shape.as_slice(), &state.per_var[j])
            })
            .collect();
        let device = self.shared.device.clone();
        let mut tensors = whole_states(&self.shared.group, &device, &described, &state.scalars)?;
        tensors.extend(self.full_parameters()?);
        write_whole(&self.shared.group, &device, &tensors, path)
    }

    /// Loads a file written by [`save_checkpoint`](Self::save_checkpoint) (at any world size, by
    /// DistributedDataParallel, or by a one-process `save_training_state`) into this rank's
    /// pieces, the buffers and `opt`. Every rank reads `path` and must call it. Every tensor
    /// must match its checksum and have its variable's dtype; nothing is changed on any rank
    /// unless every rank could read it.
    pub fn load_checkpoint(
        &self,
        opt: &mut impl ElementwiseOptimizer,
        path: impl AsRef<Path>,
    ) -> Result<()> {
        self.load_checkpoint_with(opt, path, LoadOptions::default())
    }

    /// As [`load_checkpoint`](Self::load_checkpoint), with options (converting dtypes on
    /// purpose).
    pub fn load_checkpoint_with(
        &self,
        opt: &mut impl ElementwiseOptimizer,
        path: impl AsRef<Path>,
        options: LoadOptions,
    ) -> Result<()> {
        let path = path.as_ref();
        let tensors = read_whole(&self.shared.group, &self.shared.device, path)?;
        self.apply(opt, &tensors, path, options)
    }

    /// Saves this rank's share of the training state into `dir` (created if missing) as
    /// `rank-<r>-of-<world>.safetensors`: its chunk of every parameter and optimizer state (the
    /// pieces it holds), and the buffers and scalars. Every rank must call it;
    /// [`load_sharded_checkpoint`](Self::load_sharded_checkpoint) loads the files back at any
    /// world size (so does DistributedDataParallel's).
    pub fn save_sharded_checkpoint(
        &self,
        opt: &impl ElementwiseOptimizer,
        dir: impl AsRef<Path>,
    ) -> Result<()> {
        let (group, device) = (&self.shared.group, &self.shared.device);
        write_share(group, device, dir.as_ref(), || self.my_share(opt))
    }

    /// Loads the files [`save_sharded_checkpoint`](Self::save_sharded_checkpoint) (or DDP's)
    /// wrote into `dir`, at the world size they were written at or any other: every rank reads
    /// every file and takes what it holds.
    pub fn load_sharded_checkpoint(
        &self,
        opt: &mut impl ElementwiseOptimizer,
        dir: impl AsRef<Path>,
    ) -> Result<()> {
        self.load_sharded_checkpoint_with(opt, dir, LoadOptions::default())
    }

    /// As [`load_sharded_checkpoint`](Self::load_sharded_checkpoint), with options.
    pub fn load_sharded_checkpoint_with(
        &self,
        opt: &mut impl ElementwiseOptimizer,
        dir: impl AsRef<Path>,
        options: LoadOptions,
    ) -> Result<()> {
        let dir = dir.as_ref();
        let shapes: HashMap<String, Vec<usize>> = self
            .slots()
            .into_iter()
            .map(|s| (s.name, s.shape))
            .collect();
        let whole = read_sharded(dir, &shapes);
        let whole = self.agree_on(whole, dir)?;
        self.apply(opt, &whole, dir, options)
    }

    /// This rank's training state for [`Checkpointer`] (the distributed checkpoint: one format
    /// for every layout, loaded at any world size): its flat chunk of every parameter and of
    /// each of its optimizer states (without padding), the buffers whole, the optimizer's
    /// scalars. Every rank calls it, then [`Checkpointer::save`] or
    /// [`Checkpointer::save_async`]; nothing is gathered.
    pub fn state_dict(&self, opt: &impl ElementwiseOptimizer) -> Result<StateDict> {
        let group = &self.shared.group;
        let (rank, world) = (group.rank(), group.world_size());
        let state = opt.state();
        let slots = self.slots();
        let chunk = |shape: &[usize], t: &Tensor| -> Result<ShardedTensor> {
            let piece = chunk_piece(t, shape.iter().product(), world, rank)?;
            ShardedTensor::new(shape, t.dtype(), vec![piece])
        };
        let mut out = StateDict::new();
        for s in &slots {
            out.insert(s.name.clone(), chunk(&s.shape, s.piece.as_tensor())?);
        }
        for (j, &i) in self.optimizer_slots(opt)?.iter().enumerate() {
            let s = &slots[i];
            for (name, t) in &state.per_var[j] {
                out.insert(format!("{STATE}{}.{name}", s.name), chunk(&s.shape, t)?);
            }
        }
        for (name, var) in self.buffers() {
            out.insert(name, ShardedTensor::whole(var.as_tensor().clone()));
        }
        insert_scalars(&mut out, state.scalars)?;
        Ok(out)
    }

    /// Loads the distributed checkpoint of `checkpoints` (saved under any layout at any world
    /// size) into this rank's pieces, the buffers and `opt`: each rank reads only the elements
    /// of its chunks. Every rank calls it; nothing changes on any rank unless every rank could
    /// load.
    pub fn load_state_dict(
        &self,
        opt: &mut impl ElementwiseOptimizer,
        checkpoints: &Checkpointer,
        options: LoadOptions,
    ) -> Result<()> {
        let group = &self.shared.group;
        let (rank, world) = (group.rank(), group.world_size());
        let device = &self.shared.device;
        // Checked on every rank together: a rank that gave up here would leave the others
        // waiting in the load.
        let order = checkpoints.agree(self.optimizer_slots(opt))?;
        let index = checkpoints.index()?;
        let slots = self.slots();
        let mut wanted = BTreeMap::new();
        for s in &slots {
            let numel = s.shape.iter().product();
            let want = Wanted {
                shape: s.shape.clone(),
                dtype: Some(s.piece.dtype()),
                device: device.clone(),
                regions: vec![chunk_region(numel, world, rank)],
            };
            wanted.insert(s.name.clone(), want);
        }
        let buffers = self.buffers();
        for (name, var) in &buffers {
            wanted.insert(
                name.clone(),
                whole_wanted(var.as_tensor(), Some(var.dtype())),
            );
        }
        let names: Vec<String> = order.iter().map(|&i| slots[i].name.clone()).collect();
        wanted.extend(optimizer_wanted(&index, &names, device, |_, shape| {
            vec![chunk_region(shape.iter().product(), world, rank)]
        }));
        let loaded = checkpoints.load_indexed(&index, &wanted, options)?;
        let numel = |i: usize| slots[i].shape.iter().product::<usize>();
        let state = optimizer_state(&loaded, &names, |j, t| {
            padded_chunk(t, numel(order[j]), world)
        })?;
        let mut pieces = Vec::with_capacity(slots.len());
        for (i, s) in slots.iter().enumerate() {
            let real = loaded.get(&s.name).and_then(ShardedTensor::piece);
            let real = real.ok_or_else(|| Error::Checkpoint {
                key: s.name.clone(),
                path: checkpoints.dir().to_path_buf(),
                detail: format!("`{}` did not load as one piece", s.name),
            })?;
            pieces.push(padded_chunk(real, numel(i), world)?);
        }
        // The optimizer checks its state before taking it; the variables cannot fail.
        opt.load_state(&state)?;
        for (s, t) in slots.iter().zip(pieces) {
            s.piece.set(&t)?;
        }
        for (name, var) in buffers {
            if let Some(t) = loaded.get(&name).and_then(ShardedTensor::piece) {
                var.set(t)?;
            }
        }
        Ok(())
    }

    /// Every parameter, in the order of [`parameters`](Self::parameters).
    fn slots(&self) -> Vec<Slot> {
        self.flat_params()
            .flat_map(|p| {
                p.names
                    .iter()
                    .zip(&p.shapes)
                    .zip(&p.pieces)
                    .map(|((name, shape), piece)| Slot {
                        name: name.clone(),
                        shape: shape.clone(),
                        piece: piece.clone(),
                    })
            })
            .collect()
    }

    /// For each of the optimizer's variables, the parameter it is a piece of (its index in
    /// [`slots`](Self::slots)).
    fn optimizer_slots(&self, opt: &impl ElementwiseOptimizer) -> Result<Vec<usize>> {
        let pieces = self.parameters();
        opt.vars()
            .iter()
            .enumerate()
            .map(|(index, v)| {
                pieces
                    .iter()
                    .position(|p| p.as_tensor().id() == v.as_tensor().id())
                    .ok_or_else(|| Error::VariableNotInVarMap {
                        index,
                        shape: v.dims().to_vec(),
                    })
            })
            .collect()
    }

    /// This rank's chunk of each parameter and optimizer state, keyed `<key>@<start>`; the
    /// buffers and scalars whole.
    fn my_share(&self, opt: &impl ElementwiseOptimizer) -> Result<HashMap<String, Tensor>> {
        let group = &self.shared.group;
        let at = (group.world_size(), group.rank());
        let state = opt.state();
        let scalars_only = OptimizerState {
            scalars: state.scalars.clone(),
            per_var: Vec::new(),
        };
        let mut out = optimizer_tensors(&[], &scalars_only)?;
        let slots = self.slots();
        for s in &slots {
            let numel = s.shape.iter().product();
            put_part(&mut out, &s.name, s.piece.as_tensor(), numel, false, at)?;
        }
        for (j, &i) in self.optimizer_slots(opt)?.iter().enumerate() {
            let s = &slots[i];
            let numel = s.shape.iter().product();
            for (name, t) in &state.per_var[j] {
                let key = format!("{STATE}{}.{name}", s.name);
                put_part(&mut out, &key, t, numel, false, at)?;
            }
        }
        // Rank 0's buffers, as in the consolidated file.
        if group.rank() == 0 {
            for (name, var) in self.buffers() {
                out.insert(name, var.as_tensor().copy()?);
            }
        }
        Ok(out)
    }

    /// Puts a whole training state (keyed as in the file) into this rank's pieces, the buffers
    /// and `opt`, after checking all of it.
    fn apply(
        &self,
        opt: &mut impl ElementwiseOptimizer,
        tensors: &HashMap<String, Tensor>,
        path: &Path,
        options: LoadOptions,
    ) -> Result<()> {
        let group = &self.shared.group;
        let (world, rank) = (group.world_size(), group.rank());
        let wrong = |key: &str, detail: String| Error::Checkpoint {
            key: key.to_string(),
            path: path.to_path_buf(),
            detail,
        };
        let whole = |name: &str, shape: &[usize]| -> Result<&Tensor> {
            let t = tensors.get(name).ok_or_else(|| {
                wrong(
                    name,
                    format!("no tensor `{name}`: saved from another model?"),
                )
            })?;
            if t.dims() != shape {
                return Err(wrong(
                    name,
                    format!(
                        "`{name}` has shape {:?} in the file and {shape:?} in the model",
                        t.dims()
                    ),
                ));
            }
            Ok(t)
        };
        let slots = self.slots();
        let mut pieces = Vec::with_capacity(slots.len());
        for s in &slots {
            let t = options.fit(&s.name, whole(&s.name, &s.shape)?, &s.piece, path)?;
            pieces.push(chunk_of(&t, world, rank)?);
        }
        let mut buffers = Vec::new();
        for (name, var) in self.buffers() {
            let t = options.fit(&name, whole(&name, var.dims())?, &var, path)?;
            buffers.push((var, t));
        }
        let names: Vec<String> = slots.iter().map(|s| s.name.clone()).collect();
        let full = optimizer_state_from(&names, tensors, path)?;
        let mut state = OptimizerState {
            scalars: full.scalars,
            per_var: Vec::new(),
        };
        for &i in &self.optimizer_slots(opt)? {
            let mut map = BTreeMap::new();
            for (name, t) in &full.per_var[i] {
                let key = format!("{STATE}{}.{name}", slots[i].name);
                if t.dims() != slots[i].shape.as_slice() {
                    return Err(wrong(
                        &key,
                        format!(
                            "`{key}` has shape {:?}; its parameter has shape {:?}",
                            t.dims(),
                            slots[i].shape
                        ),
                    ));
                }
                map.insert(name.clone(), chunk_of(t, world, rank)?);
            }
            state.per_var.push(map);
        }
        // The optimizer checks its state before taking it; the variables cannot fail.
        opt.load_state(&state)?;
        for (s, t) in slots.iter().zip(pieces) {
            s.piece.set(&t)?;
        }
        for (var, t) in buffers {
            var.set(&t)?;
        }
        Ok(())
    }

    /// Makes every rank return an error when one failed: this rank's own, or the failing
    /// rank's words about `path`.
    fn agree_on<T>(&self, result: Result<T>, path: &Path) -> Result<T> {
        agree_on(&self.shared.group, &self.shared.device, result, path)
    }
}
