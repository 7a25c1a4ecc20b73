//! Sharded checkpoints: each rank writes its chunk of every parameter and of every optimizer
//! state ([`crate::shard`]) to `rank-<r>-of-<world>.safetensors` in one folder, the part of a
//! tensor that starts at element `s` of it (flattened) under `<key>@<s>`, and the buffers and
//! scalars whole; any world size reads the folder back. DistributedDataParallel (plain and
//! ZeRO-2) and FullyShardedDataParallel write the same format, so either loads the other's.

use super::optimizer_tensors;
use crate::distributed::objects::all_gather_bytes;
use crate::distributed::ProcessGroup;
use crate::error::{Error, Result};
use crate::optim::OptimizerState;
use crate::shard::{chunk_elements, chunk_of};
use candle_core::{Device, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The prefix of the per-variable optimizer states' keys.
pub(crate) const STATE: &str = "optimizer.state.";

/// Puts this rank's part of `t` into `out` under `<key>@<start>`: `t` is a whole tensor of
/// `numel` elements (`whole`), or already this rank's padded chunk of one; padding is left
/// out. Every chunk of an empty tensor is empty: rank 0 then writes an empty part, so that the
/// key exists.
pub(crate) fn put_part(
    out: &mut HashMap<String, Tensor>,
    key: &str,
    t: &Tensor,
    numel: usize,
    whole: bool,
    (world, rank): (usize, usize),
) -> Result<()> {
    let within = chunk_elements(numel, world, rank);
    if within.is_empty() {
        if numel == 0 && rank == 0 {
            out.insert(format!("{key}@0"), t.flatten_all()?.narrow(0, 0, 0)?);
        }
        return Ok(());
    }
    let chunk = match whole {
        true => chunk_of(t, world, rank)?,
        false => t.clone(),
    };
    let part = chunk.narrow(0, 0, within.len())?.force_contiguous()?;
    out.insert(format!("{key}@{}", within.start), part);
    Ok(())
}

/// The whole optimizer state of parameters held as pieces, keyed as in a training-state file
/// (`optimizer.state.<name>.<state>`, and `optimizer.<scalar>`). Every rank of `group` calls it
/// with the same parameters in the same order (`params`: each one's name, shape and its
/// piece's states); the ranks first agree that they hold the same states, then each state is
/// all-gathered. `device` is where the group's collectives run.
pub(crate) fn whole_states(
    group: &ProcessGroup,
    device: &Device,
    params: &[(&str, &[usize], &BTreeMap<String, Tensor>)],
    scalars: &BTreeMap<String, f64>,
) -> Result<HashMap<String, Tensor>> {
    let described: String = params
        .iter()
        .map(|(name, _, states)| {
            let names: Vec<&str> = states.keys().map(String::as_str).collect();
            format!("{name} {names:?}\n")
        })
        .collect();
    let all = all_gather_bytes(group, described.as_bytes(), device)?;
    if let Some(rank) = all
        .iter()
        .position(|b| b.as_slice() != described.as_bytes())
    {
        let theirs = String::from_utf8_lossy(&all[rank]);
        let first = described
            .lines()
            .zip(theirs.lines())
            .find(|(a, b)| a != b)
            .map_or("a parameter".to_string(), |(a, b)| {
                format!("`{a}` here, `{b}` there")
            });
        return Err(Error::Mismatch {
            detail: format!(
                "rank {} and rank {rank} hold different optimizer states ({first}): every rank \
                 must step the same parameters with the same optimizer",
                group.rank()
            ),
        });
    }
    let mut works = Vec::new();
    for (name, shape, states) in params {
        for (state, t) in states.iter() {
            works.push((*name, *shape, state, group.all_gather_async(t)?));
        }
    }
    let mut out = HashMap::new();
    for (name, shape, state, work) in works {
        let numel: usize = shape.iter().product();
        let whole = Tensor::cat(&work.wait()?, 0)?
            .narrow(0, 0, numel)?
            .reshape(shape)?;
        out.insert(format!("{STATE}{name}.{state}"), whole);
    }
    let scalars_only = OptimizerState {
        scalars: scalars.clone(),
        per_var: Vec::new(),
    };
    out.extend(optimizer_tensors(&[], &scalars_only)?);
    Ok(out)
}

/// The shapes of the keys a sharded file may hold in parts: parameters and their states.
fn shapes_by_key<'a>(
    shapes: &HashMap<String, Vec<usize>>,
    keys: impl Iterator<Item = &'a String>,
) -> HashMap<String, Vec<usize>> {
    keys.filter_map(|key| {
        let param = match key.strip_prefix(STATE) {
            Some(k) => k.rsplit_once('.')?.0,
            None => key.as_str(),
        };
        shapes.get(param).map(|s| (key.clone(), s.clone()))
    })
    .collect()
}

/// Every tensor of the sharded checkpoint in `dir` (every rank's file), whole: the parts of
/// each key laid end to end, checked to cover it exactly. `shapes` gives each parameter's
/// shape by name (its optimizer states have it too).
pub(crate) fn read_sharded(
    dir: &Path,
    shapes: &HashMap<String, Vec<usize>>,
) -> Result<HashMap<String, Tensor>> {
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
    let shapes = shapes_by_key(shapes, parts.keys());
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

/// `result` of this rank, agreed by every rank of `group`: a failure anywhere is an error
/// everywhere, naming the rank that failed and `path`.
pub(crate) fn agree_on<T>(
    group: &ProcessGroup,
    device: &Device,
    result: Result<T>,
    path: &Path,
) -> Result<T> {
    crate::distributed::objects::agree_on(group, device, result, |rank, e| Error::Checkpoint {
        key: String::new(),
        path: path.to_path_buf(),
        detail: format!("rank {rank} failed: {e}"),
    })
}

/// Writes `tensors` (the whole training state, the same on every rank of `group`) into one file
/// at `path` from rank 0; every rank learns whether the write succeeded.
pub(crate) fn write_whole(
    group: &ProcessGroup,
    device: &Device,
    tensors: &HashMap<String, Tensor>,
    path: &Path,
) -> Result<()> {
    let written = match group.rank() {
        0 => super::save(tensors, path),
        _ => Ok(()),
    };
    agree_on(group, device, written, path)
}

/// The tensors of the file at `path`, read on every rank of `group`: unless every rank could
/// read it, every rank fails.
pub(crate) fn read_whole(
    group: &ProcessGroup,
    device: &Device,
    path: &Path,
) -> Result<HashMap<String, Tensor>> {
    agree_on(group, device, super::read(path), path)
}

/// Writes this rank's share (what `share` makes) into `dir`, created if missing, as its file of
/// the sharded format; every rank of `group` learns whether every rank wrote its own.
pub(crate) fn write_share(
    group: &ProcessGroup,
    device: &Device,
    dir: &Path,
    share: impl FnOnce() -> Result<HashMap<String, Tensor>>,
) -> Result<()> {
    let written = std::fs::create_dir_all(dir)
        .map_err(|source| Error::File {
            action: "creating the checkpoint folder",
            path: dir.to_path_buf(),
            source,
        })
        .and_then(|()| share())
        .and_then(|tensors| {
            super::save(
                &tensors,
                dir.join(file_name(group.rank(), group.world_size())),
            )
        });
    agree_on(group, device, written, dir)
}

/// The file of rank `rank` of `world`.
pub(crate) fn file_name(rank: usize, world: usize) -> String {
    format!("rank-{rank}-of-{world}.safetensors")
}

/// The files of a sharded checkpoint in `dir`, in rank order: all of one world size, none
/// missing.
pub(crate) fn sharded_files(dir: &Path) -> Result<Vec<PathBuf>> {
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
