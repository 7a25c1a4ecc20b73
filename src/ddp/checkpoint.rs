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

use super::agreement::check_same_descriptions;
use super::DistributedDataParallel;
use crate::checkpoint::{optimizer_state_from, optimizer_tensors, LoadOptions};
use crate::error::{Error, Result};
use crate::optim::{ElementwiseOptimizer, OptimizerState};
use crate::shard::{chunk_elements, chunk_of};
use crate::util::sync::lock;
use candle_core::{Tensor, Var};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

const STATE: &str = "optimizer.state.";

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
        let written = match self.group.rank() {
            0 => crate::checkpoint::save(&tensors, path),
            _ => Ok(()),
        };
        self.agree_on(written, path)
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
        let tensors = crate::checkpoint::read(path);
        let tensors = self.agree_on(tensors, path)?;
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
        let dir = dir.as_ref();
        let (rank, world) = (self.group.rank(), self.group.world_size());
        let written = std::fs::create_dir_all(dir)
            .map_err(|source| Error::File {
                action: "creating the checkpoint folder",
                path: dir.to_path_buf(),
                source,
            })
            .and_then(|()| self.my_share(opt))
            .and_then(|tensors| {
                crate::checkpoint::save(&tensors, dir.join(file_name(rank, world)))
            });
        self.agree_on(written, dir)
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
        let whole = self.read_sharded(dir);
        let whole = self.agree_on(whole, dir)?;
        self.apply(opt, &whole, dir, options)
    }

    /// Every tensor of the sharded checkpoint in `dir`, whole.
    fn read_sharded(&self, dir: &Path) -> Result<HashMap<String, Tensor>> {
        let files = sharded_files(dir)?;
        let mut whole: HashMap<String, Tensor> = HashMap::new();
        let mut parts: HashMap<String, Vec<(usize, Tensor)>> = HashMap::new();
        for file in &files {
            let tensors = crate::checkpoint::read(file)?;
            for (key, t) in tensors {
                match key.rsplit_once('@').map(|(k, s)| (k, s.parse::<usize>())) {
                    Some((base, Ok(start))) => {
                        parts.entry(base.to_string()).or_default().push((start, t))
                    }
                    _ => {
                        whole.insert(key, t);
                    }
                }
            }
        }
        let shapes = self.shapes_by_key(parts.keys());
        for (key, mut pieces) in parts {
            let shape = shapes.get(&key).ok_or_else(|| Error::Checkpoint {
                key: key.clone(),
                path: dir.to_path_buf(),
                detail: format!("`{key}` is not a parameter of this model or its optimizer state"),
            })?;
            pieces.sort_by_key(|(start, _)| *start);
            let mut next = 0;
            for (start, t) in &pieces {
                if *start != next {
                    return Err(Error::Checkpoint {
                        key: key.clone(),
                        path: dir.to_path_buf(),
                        detail: format!(
                            "`{key}` has no part at elements {next}..{start}: a rank's file of \
                             this checkpoint is missing or from another save"
                        ),
                    });
                }
                next += t.elem_count();
            }
            let numel: usize = shape.iter().product();
            if next != numel {
                return Err(Error::Checkpoint {
                    key: key.clone(),
                    path: dir.to_path_buf(),
                    detail: format!(
                        "`{key}` has parts for {next} of its {numel} elements: a rank's file is \
                         missing or from another save"
                    ),
                });
            }
            let flat: Vec<Tensor> = pieces.into_iter().map(|(_, t)| t).collect();
            whole.insert(key, Tensor::cat(&flat, 0)?.reshape(shape.as_slice())?);
        }
        Ok(whole)
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
        let mut order: Vec<(usize, usize)> = slots.iter().copied().enumerate().collect();
        order.sort_by_key(|&(_, i)| i);
        let described: Vec<String> = order
            .iter()
            .map(|&(j, i)| {
                let states: Vec<&str> = state.per_var[j].keys().map(String::as_str).collect();
                format!("{} optimizer state {states:?}", self.params[i].name)
            })
            .collect();
        check_same_descriptions(&self.group, &described, &self.device)?;
        let mut works = Vec::new();
        for &(j, i) in &order {
            for (name, t) in &state.per_var[j] {
                works.push((i, name.clone(), self.group.all_gather_async(t)?));
            }
        }
        let mut full = OptimizerState {
            scalars: state.scalars.clone(),
            per_var: vec![BTreeMap::new(); order.len()],
        };
        for (i, name, work) in works {
            let var = &self.params[i].var;
            let whole = Tensor::cat(&work.wait()?, 0)?
                .narrow(0, 0, var.elem_count())?
                .reshape(var.shape())?;
            let k = order.iter().position(|&(_, p)| p == i).expect("from order");
            full.per_var[k].insert(name, whole);
        }
        let in_order: Vec<usize> = order.iter().map(|&(_, i)| i).collect();
        optimizer_tensors(&names(&in_order), &full)
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
        out.extend(
            self.variables()
                .into_iter()
                .filter(|(name, _)| !parameters.contains(&name.as_str())),
        );
        // This rank's chunk of `t`, a whole tensor of parameter `i` (or already its chunk
        // under ZeRO-2), without padding, keyed at the first element it holds.
        let mut put = |key: String, i: usize, t: &Tensor| -> Result<()> {
            let numel = self.params[i].var.elem_count();
            let within = chunk_elements(numel, world, rank);
            if within.is_empty() {
                if numel == 0 && rank == 0 {
                    // Every chunk of an empty tensor is empty: rank 0 says it exists.
                    out.insert(format!("{key}@0"), t.flatten_all()?.narrow(0, 0, 0)?);
                }
                return Ok(());
            }
            let chunk = match pieces.is_empty() {
                true => chunk_of(t, world, rank)?,
                false => t.clone(),
            };
            let part = chunk.narrow(0, 0, within.len())?.copy()?;
            out.insert(format!("{key}@{}", within.start), part);
            Ok(())
        };
        for (i, e) in self.params.iter().enumerate() {
            let value = match pieces.get(i) {
                Some(piece) => piece.as_tensor().clone(),
                None => e.var.as_tensor().clone(),
            };
            put(e.name.clone(), i, &value)?;
        }
        for (j, &i) in slots.iter().enumerate() {
            for (name, t) in &state.per_var[j] {
                put(format!("{STATE}{}.{name}", self.params[i].name), i, t)?;
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

    /// The shapes of the keys a sharded file may hold in parts: parameters and their states.
    fn shapes_by_key<'a>(
        &self,
        keys: impl Iterator<Item = &'a String>,
    ) -> HashMap<String, Vec<usize>> {
        let by_name: HashMap<&str, &[usize]> = self
            .params
            .iter()
            .map(|e| (e.name.as_str(), e.var.dims()))
            .collect();
        keys.filter_map(|key| {
            let param = match key.strip_prefix(STATE) {
                Some(k) => k.rsplit_once('.')?.0,
                None => key.as_str(),
            };
            by_name.get(param).map(|s| (key.clone(), s.to_vec()))
        })
        .collect()
    }

    /// Makes every rank return an error when one failed: this rank's own, or the failing
    /// rank's words about `path`.
    fn agree_on<T>(&self, result: Result<T>, path: &Path) -> Result<T> {
        crate::distributed::objects::agree_on(&self.group, &self.device, result, |rank, e| {
            Error::Checkpoint {
                key: String::new(),
                path: path.to_path_buf(),
                detail: format!("rank {rank} failed: {e}"),
            }
        })
    }
}

fn file_name(rank: usize, world: usize) -> String {
    format!("rank-{rank}-of-{world}.safetensors")
}

/// The files of a sharded checkpoint in `dir`, in rank order: all of one world size, none
/// missing.
fn sharded_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|source| Error::File {
        action: "reading the checkpoint folder",
        path: dir.to_path_buf(),
        source,
    })?;
    let mut found: BTreeMap<usize, (usize, PathBuf)> = BTreeMap::new();
    let mut worlds = std::collections::BTreeSet::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let parsed = name
            .strip_prefix("rank-")
            .and_then(|n| n.strip_suffix(".safetensors"))
            .and_then(|n| n.split_once("-of-"))
            .and_then(|(r, w)| Some((r.parse::<usize>().ok()?, w.parse::<usize>().ok()?)));
        if let Some((rank, world)) = parsed {
            worlds.insert(world);
            found.insert(rank, (world, entry.path()));
        }
    }
    let checkpoint_error = |detail: String| Error::Checkpoint {
        key: String::new(),
        path: dir.to_path_buf(),
        detail,
    };
    let world = match worlds.len() {
        0 => {
            return Err(checkpoint_error(
                "no rank-<r>-of-<world>.safetensors files: not a sharded checkpoint".into(),
            ))
        }
        1 => *worlds.iter().next().expect("one world size"),
        _ => {
            return Err(checkpoint_error(format!(
                "files of world sizes {worlds:?}: two sharded checkpoints in one folder"
            )))
        }
    };
    (0..world)
        .map(|r| {
            found
                .remove(&r)
                .map(|(_, p)| p)
                .ok_or_else(|| checkpoint_error(format!("{} is missing", file_name(r, world))))
        })
        .collect()
}
