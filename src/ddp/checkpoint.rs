//! Training-state checkpoints of DistributedDataParallel, with or without ZeRO-2: the full state
//! gathered into one file by rank 0 (torch's `consolidate_state_dict`), or one file per rank
//! that loads back at any world size.
//!
//! Both hold the training state in one format (that of
//! [`crate::checkpoint::save_training_state`]): each variable under its name, each optimizer
//! state of a parameter under `optimizer.state.<parameter>.<state>`, each optimizer scalar under
//! `optimizer.<scalar>`. A sharded file holds this rank's chunk of each parameter and of each
//! of its optimizer states ([`crate::shard`]): the part of a tensor that starts at element `s`
//! of it (flattened) under `<key>@<s>`, and the buffers and scalars whole. A parameter without
//! optimizer state (frozen, or never stepped) has none in either file.

use super::DistributedDataParallel;
use crate::checkpoint::distributed::{
    chunk_piece, chunk_region, insert_scalars, optimizer_state, optimizer_wanted, padded_chunk,
    whole_wanted, Checkpointer, Region, ShardedTensor, StateDict, Wanted,
};
use crate::checkpoint::sharded::{
    agree_on, put_part, read_sharded, read_whole, whole_states, write_share, write_whole, STATE,
};
use crate::checkpoint::{optimizer_state_from, optimizer_tensors, LoadOptions};
use crate::error::{Error, Result};
use crate::optim::{ElementwiseOptimizer, OptimizerState};
use crate::shard::chunk_of;
use crate::util::sync::lock;
use candle_core::{Tensor, Var};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

impl<M> DistributedDataParallel<M> {
    /// Saves the whole training state (every variable, and the optimizer's state of every
    /// parameter, gathered from the shards under ZeRO-2) into one safetensors file at `path`,
    /// written atomically by rank 0. A one-process run loads it with
    /// [`crate::checkpoint::load_training_state`] (its weights with `VarMap::load`), and a job of
    /// any world size with [`load_checkpoint`](Self::load_checkpoint). Every rank must call it;
    /// every rank gets rank 0's error if the write fails. `opt` is the optimizer made over
    /// [`parameters`](Self::parameters).
    pub fn save_checkpoint(
        &self,
        opt: &impl ElementwiseOptimizer,
        path: impl AsRef<Path>,
    ) -> Result<()> {
        self.refuse_inside_join("save_checkpoint")?;
        let path = path.as_ref();
        let mut tensors = self.full_state(opt)?;
        tensors.extend(self.variables());
        write_whole(&self.group, &self.device, &tensors, path)
    }

    /// Loads a file written by [`save_checkpoint`](Self::save_checkpoint) (at any world size,
    /// or by a one-process run's [`crate::checkpoint::save_training_state`]) into the variables,
    /// this rank's pieces and `opt`. Every rank reads `path`, which must be readable on every
    /// rank; every rank must call it. Every tensor must match its checksum and have its
    /// variable's dtype; nothing is changed on any rank unless every rank could load it.
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
        self.refuse_inside_join("load_checkpoint")?;
        let path = path.as_ref();
        let tensors = read_whole(&self.group, &self.device, path)?;
        self.apply(opt, &tensors, path, options)
    }

    /// Saves this rank's share of the training state into `dir` (created if missing) as
    /// `rank-<r>-of-<world>.safetensors`: its part of each flat bucket of parameters and
    /// optimizer state, which under ZeRO-2 is the shard it holds, and the buffers and scalars.
    /// Every rank must call it; [`load_sharded_checkpoint`](Self::load_sharded_checkpoint)
    /// loads the files back at any world size.
    pub fn save_sharded_checkpoint(
        &self,
        opt: &impl ElementwiseOptimizer,
        dir: impl AsRef<Path>,
    ) -> Result<()> {
        self.refuse_inside_join("save_sharded_checkpoint")?;
        write_share(&self.group, &self.device, dir.as_ref(), || {
            self.my_share(opt)
        })
    }

    /// Loads the files [`save_sharded_checkpoint`](Self::save_sharded_checkpoint) wrote into
    /// `dir`, at the world size they were written at or any other: every rank reads every file
    /// (so `dir` must be readable on every rank) and takes what it holds. Fails, naming the
    /// tensor, when a file is missing, a part of a tensor is not in any file, a tensor does not
    /// match its checksum or has another dtype than its variable.
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
        self.refuse_inside_join("load_sharded_checkpoint")?;
        let dir = dir.as_ref();
        let shapes: HashMap<String, Vec<usize>> = self
            .params
            .iter()
            .map(|e| (e.name.clone(), e.var.dims().to_vec()))
            .collect();
        let whole = read_sharded(dir, &shapes);
        let whole = self.agree_on(whole, dir)?;
        self.apply(opt, &whole, dir, options)
    }

    /// This rank's training state for [`Checkpointer`] (the distributed checkpoint: one format
    /// for every layout, loaded at any world size): every parameter and its optimizer states
    /// whole (plain DDP: replicated, each written once), or under ZeRO-2 this rank's flat chunk
    /// of each; the buffers whole; the optimizer's scalars. `opt` is the optimizer made over
    /// [`parameters`](Self::parameters). Every rank calls it, then
    /// [`Checkpointer::save`] or [`Checkpointer::save_async`].
    pub fn state_dict(&self, opt: &impl ElementwiseOptimizer) -> Result<StateDict> {
        self.refuse_inside_join("state_dict")?;
        let (rank, world) = (self.group.rank(), self.group.world_size());
        let pieces = self.reducer.pieces();
        let state = opt.state();
        let slots = self.optimizer_slots(opt)?;
        let parameters: Vec<&str> = self.params.iter().map(|e| e.name.as_str()).collect();
        let mut out = StateDict::new();
        for (name, t) in self.variables() {
            if !parameters.contains(&name.as_str()) {
                out.insert(name, ShardedTensor::whole(t));
            }
        }
        // A parameter (or its state) as this rank holds it: whole, or its chunk under ZeRO-2.
        let held = |shape: &[usize], t: &Tensor| -> Result<ShardedTensor> {
            match pieces.is_empty() {
                true => Ok(ShardedTensor::whole(t.clone())),
                false => {
                    let numel = shape.iter().product();
                    let piece = chunk_piece(t, numel, world, rank)?;
                    ShardedTensor::new(shape, t.dtype(), vec![piece])
                }
            }
        };
        for (i, e) in self.params.iter().enumerate() {
            let value = pieces.get(i).map_or(e.var.as_tensor(), |p| p.as_tensor());
            out.insert(e.name.clone(), held(e.var.dims(), value)?);
        }
        for (j, &i) in slots.iter().enumerate() {
            let p = &self.params[i];
            for (name, t) in &state.per_var[j] {
                out.insert(format!("{STATE}{}.{name}", p.name), held(p.var.dims(), t)?);
            }
        }
        insert_scalars(&mut out, state.scalars)?;
        Ok(out)
    }

    /// Loads the distributed checkpoint of `checkpoints` (saved under any layout at any world
    /// size: plain DDP, ZeRO-2, fully sharded, tensor parallel, one process) into the
    /// variables, this rank's pieces and `opt`: every variable must be in it, with its shape
    /// (and dtype, unless `options` converts); each rank reads the whole parameters (which DDP
    /// holds on every rank) and, under ZeRO-2, only its chunk of each optimizer state. Every
    /// rank calls it; nothing changes on any rank unless every rank could load.
    pub fn load_state_dict(
        &self,
        opt: &mut impl ElementwiseOptimizer,
        checkpoints: &Checkpointer,
        options: LoadOptions,
    ) -> Result<()> {
        self.refuse_inside_join("load_state_dict")?;
        let (rank, world) = (self.group.rank(), self.group.world_size());
        // Checked on every rank together: a rank that gave up here would leave the others
        // waiting in the load.
        let slots = checkpoints.agree(self.optimizer_slots(opt))?;
        let index = checkpoints.index()?;
        let vars: Vec<(String, Var)> = lock(self.varmap.data())
            .iter()
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        let mut wanted: BTreeMap<String, Wanted> = vars
            .iter()
            .map(|(name, var)| {
                (
                    name.clone(),
                    whole_wanted(var.as_tensor(), Some(var.dtype())),
                )
            })
            .collect();
        let names: Vec<String> = slots.iter().map(|&i| self.params[i].name.clone()).collect();
        let sharded = !self.reducer.pieces().is_empty();
        wanted.extend(optimizer_wanted(
            &index,
            &names,
            &self.device,
            |_, shape| match sharded {
                true => vec![chunk_region(shape.iter().product(), world, rank)],
                false => vec![Region::whole(shape)],
            },
        ));
        let loaded = checkpoints.load_indexed(&index, &wanted, options)?;
        let state = optimizer_state(&loaded, &names, |j, t| {
            let shape = self.params[slots[j]].var.dims();
            match sharded {
                true => padded_chunk(t, shape.iter().product(), world),
                false => Ok(t.clone()),
            }
        })?;
        // The optimizer checks its state before taking it; the variables cannot fail.
        opt.load_state(&state)?;
        for (name, var) in &vars {
            if let Some(t) = loaded.get(name).and_then(ShardedTensor::piece) {
                var.set(t)?;
            }
        }
        self.reducer.recut_pieces()
    }

    /// Every variable of the model's `VarMap` (under ZeRO-2, as of the last gather), by name.
    fn variables(&self) -> HashMap<String, Tensor> {
        lock(self.varmap.data())
            .iter()
            .map(|(name, var)| (name.clone(), var.as_tensor().clone()))
            .collect()
    }

    /// The optimizer's whole state, keyed as in the file: under ZeRO-2 each piece's state is
    /// all-gathered (on every rank), in the parameters' order, after the ranks agreed on which
    /// parameters have which states.
    fn full_state(&self, opt: &impl ElementwiseOptimizer) -> Result<HashMap<String, Tensor>> {
        // The model must be current: the optimizer may not have gathered after its step.
        self.reducer.gather_parameters()?;
        let state = opt.state();
        let slots = self.optimizer_slots(opt)?;
        let names = |slots: &[usize]| -> Vec<String> {
            slots.iter().map(|&i| self.params[i].name.clone()).collect()
        };
        if self.reducer.pieces().is_empty() {
            return optimizer_tensors(&names(&slots), &state);
        }
        // In the parameters' order, the same on every rank.
        let mut order: Vec<(usize, usize)> = slots.iter().copied().enumerate().collect();
        order.sort_by_key(|&(_, i)| i);
        let params: Vec<(&str, &[usize], &BTreeMap<String, Tensor>)> = order
            .iter()
            .map(|&(j, i)| {
                let p = &self.params[i];
                (p.name.as_str(), p.var.dims(), &state.per_var[j])
            })
            .collect();
        whole_states(&self.group, &self.device, &params, &state.scalars)
    }

    /// This rank's chunk of each parameter and of each optimizer state (see
    /// [`crate::shard`]), keyed `<key>@<start>`; the buffers and the optimizer's scalars whole.
    /// A parameter the optimizer has no state for has no state parts.
    fn my_share(&self, opt: &impl ElementwiseOptimizer) -> Result<HashMap<String, Tensor>> {
        let (rank, world) = (self.group.rank(), self.group.world_size());
        let state = opt.state();
        let slots = self.optimizer_slots(opt)?;
        let pieces = self.reducer.pieces();
        let scalars_only = OptimizerState {
            scalars: state.scalars.clone(),
            per_var: Vec::new(),
        };
        let mut out = optimizer_tensors(&[], &scalars_only)?;
        let parameters: Vec<&str> = self.params.iter().map(|e| e.name.as_str()).collect();
        // Buffers are the same on every rank after a training forward's broadcast; rank 0's
        // are saved, as in the consolidated file.
        out.extend(
            self.variables()
                .into_iter()
                .filter(|_| rank == 0)
                .filter(|(name, _)| !parameters.contains(&name.as_str())),
        );
        let whole = pieces.is_empty();
        for (i, e) in self.params.iter().enumerate() {
            let value = match pieces.get(i) {
                Some(piece) => piece.as_tensor().clone(),
                None => e.var.as_tensor().clone(),
            };
            put_part(
                &mut out,
                &e.name,
                &value,
                e.var.elem_count(),
                whole,
                (world, rank),
            )?;
        }
        for (j, &i) in slots.iter().enumerate() {
            let p = &self.params[i];
            for (name, t) in &state.per_var[j] {
                let key = format!("{STATE}{}.{name}", p.name);
                put_part(&mut out, &key, t, p.var.elem_count(), whole, (world, rank))?;
            }
        }
        Ok(out)
    }

    /// Puts a whole training state (keyed as in the file) into the variables, this rank's
    /// pieces and `opt`.
    fn apply(
        &self,
        opt: &mut impl ElementwiseOptimizer,
        tensors: &HashMap<String, Tensor>,
        path: &Path,
        options: LoadOptions,
    ) -> Result<()> {
        let missing = |key: &str, detail: String| Error::Checkpoint {
            key: key.to_string(),
            path: path.to_path_buf(),
            detail,
        };
        // Everything is checked before anything is written: a bad file leaves the model as it
        // was.
        let vars: Vec<(String, Var)> = lock(self.varmap.data())
            .iter()
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        let mut values = Vec::with_capacity(vars.len());
        for (name, var) in &vars {
            let t = tensors.get(name).ok_or_else(|| {
                missing(
                    name,
                    format!("no variable `{name}`: saved from another model?"),
                )
            })?;
            if t.dims() != var.dims() {
                return Err(missing(
                    name,
                    format!(
                        "`{name}` has shape {:?} in the file and {:?} in the model",
                        t.dims(),
                        var.dims()
                    ),
                ));
            }
            values.push(options.fit(name, t, var, path)?);
        }
        // The optimizer's state: per parameter, by state name; a parameter without state in
        // the file (never stepped, or frozen) gets none.
        let full = optimizer_state_from(&self.parameter_names_in_order(), tensors, path)?;
        let mut state = OptimizerState {
            scalars: full.scalars,
            per_var: Vec::new(),
        };
        let (rank, world) = (self.group.rank(), self.group.world_size());
        let sharded = !self.reducer.pieces().is_empty();
        for &i in &self.optimizer_slots(opt)? {
            let mut map = BTreeMap::new();
            for (name, t) in &full.per_var[i] {
                let param = &self.params[i];
                if t.dims() != param.var.dims() {
                    let key = format!("{STATE}{}.{name}", param.name);
                    return Err(missing(
                        &key,
                        format!(
                            "`{key}` has shape {:?}; its parameter has shape {:?}",
                            t.dims(),
                            param.var.dims()
                        ),
                    ));
                }
                let t = match sharded {
                    true => chunk_of(t, world, rank)?,
                    false => t.clone(),
                };
                map.insert(name.clone(), t);
            }
            state.per_var.push(map);
        }
        // The optimizer checks its state before taking it; the variables cannot fail.
        opt.load_state(&state)?;
        for ((_, var), t) in vars.iter().zip(&values) {
            var.set(t)?;
        }
        self.reducer.recut_pieces()
    }

    /// For each of the optimizer's variables: the parameter it is, or under ZeRO-2 the
    /// parameter it is a piece of (its index in `params`).
    fn optimizer_slots(&self, opt: &impl ElementwiseOptimizer) -> Result<Vec<usize>> {
        let pieces = self.reducer.pieces();
        let ours: Vec<&Var> = if pieces.is_empty() {
            self.params.iter().map(|e| &e.var).collect()
        } else {
            pieces.iter().collect()
        };
        opt.vars()
            .iter()
            .enumerate()
            .map(|(index, v)| {
                ours.iter()
                    .position(|o| o.as_tensor().id() == v.as_tensor().id())
                    .ok_or_else(|| Error::VariableNotInVarMap {
                        index,
                        shape: v.dims().to_vec(),
                    })
            })
            .collect()
    }

    /// The parameters' names, in the reducer's (the model's) order.
    fn parameter_names_in_order(&self) -> Vec<String> {
        self.params.iter().map(|e| e.name.clone()).collect()
    }

    /// Makes every rank return an error when one failed: this rank's own, or the failing
    /// rank's words about `path`.
    fn agree_on<T>(&self, result: Result<T>, path: &Path) -> Result<T> {
        agree_on(&self.group, &self.device, result, path)
    }
}
