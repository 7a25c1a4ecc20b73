//! Saving: the ranks' descriptions made into one plan (who writes which piece), each rank's
//! file, and the commit (the index, written by rank 0 once every file is in place).

use super::index::{FileEntry, IndexFile, PieceEntry, TensorEntry, FORMAT, INDEX_FILE, SAVE_ID};
use super::region::{tiling_fault, Region};
use super::StateDict;
use crate::checkpoint::{remove_temporaries, save_with_metadata, write_atomically};
use crate::distributed::objects::all_gather_bytes;
use crate::distributed::ProcessGroup;
use crate::error::{Error, Result};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

/// One tensor as a rank describes it to the others.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Described {
    key: String,
    shape: Vec<usize>,
    dtype: String,
    regions: Vec<Region>,
}

/// What a rank tells the others before a save.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Description {
    /// A fresh save name (rank 0's is taken).
    id: String,
    tensors: Vec<Described>,
}

/// A save, planned: the same index on every rank (file lengths still unknown) and the pieces
/// this rank writes.
#[derive(Clone, Debug)]
pub(crate) struct Planned {
    rank: usize,
    index: IndexFile,
    /// `(tensor, region, key in the file)` of each piece this rank writes.
    mine: Vec<(String, Region, String)>,
    /// This rank's file, when it writes any piece.
    file: Option<String>,
}

/// The file of `rank` of `world` in save `id`.
fn file_name(rank: usize, world: usize, id: &str) -> String {
    format!("shard-{rank}-of-{world}-{id}.safetensors")
}

/// Plans a save of `state`: every rank of `group` (or this process alone) describes what it
/// holds, and all agree on who writes what.
pub(crate) fn plan(
    dir: &Path,
    group: Option<&(ProcessGroup, Device)>,
    state: &StateDict,
) -> Result<Planned> {
    let id = format!(
        "{:016x}",
        crate::rng::fresh_seed() ^ u64::from(std::process::id())
    );
    let mine = Description {
        id,
        tensors: state
            .iter()
            .map(|(key, t)| Described {
                key: key.to_string(),
                shape: t.shape().to_vec(),
                dtype: t.dtype().as_str().to_string(),
                regions: t.pieces().iter().map(|(r, _)| r.clone()).collect(),
            })
            .collect(),
    };
    let (rank, all) = match group {
        None => (0, vec![mine]),
        Some((g, d)) => {
            let bytes = serde_json::to_vec(&mine).map_err(|e| Error::Checkpoint {
                key: String::new(),
                path: dir.to_path_buf(),
                detail: format!("describing the state: {e}"),
            })?;
            let all = all_gather_bytes(g, &bytes, d)?
                .iter()
                .map(|b| serde_json::from_slice(b))
                .collect::<std::result::Result<Vec<Description>, _>>()
                .map_err(|e| Error::Checkpoint {
                    key: String::new(),
                    path: dir.to_path_buf(),
                    detail: format!("a rank's description of its state is unreadable: {e}"),
                })?;
            (g.rank(), all)
        }
    };
    let (index, mut writes) = global_plan(&all)?;
    let file = index
        .files
        .iter()
        .find(|f| f.rank == rank)
        .map(|f| f.name.clone());
    Ok(Planned {
        rank,
        index,
        mine: writes.remove(&rank).unwrap_or_default(),
        file,
    })
}

/// The index (file lengths 0) and each rank's writes, from every rank's description: pieces
/// held by several ranks are written by the one that has the fewest bytes to write so far;
/// every tensor's pieces must agree on its shape and dtype, and tile it.
#[allow(clippy::type_complexity)]
fn global_plan(
    all: &[Description],
) -> Result<(IndexFile, BTreeMap<usize, Vec<(String, Region, String)>>)> {
    let world = all.len();
    let id = all[0].id.clone();
    // Every tensor: its shape and dtype by the first rank that has it, and its distinct
    // regions with the ranks holding each.
    let mut tensors: BTreeMap<&str, (usize, &Described, BTreeMap<&Region, Vec<usize>>)> =
        BTreeMap::new();
    for (rank, d) in all.iter().enumerate() {
        for t in &d.tensors {
            let entry = tensors
                .entry(t.key.as_str())
                .or_insert_with(|| (rank, t, BTreeMap::new()));
            let (first, seen, regions) = entry;
            if seen.shape != t.shape || seen.dtype != t.dtype {
                return Err(Error::Mismatch {
                    detail: format!(
                        "`{}` is {} {:?} on rank {first} and {} {:?} on rank {rank}: every rank \
                         must save the same model",
                        t.key, seen.dtype, seen.shape, t.dtype, t.shape
                    ),
                });
            }
            for r in &t.regions {
                regions.entry(r).or_default().push(rank);
            }
        }
    }
    let mut load = vec![0usize; world];
    let mut writes: BTreeMap<usize, Vec<(String, Region, String)>> = BTreeMap::new();
    let mut entries = BTreeMap::new();
    let mut names = std::collections::HashSet::new();
    for (key, (_, described, regions)) in tensors {
        let numel: usize = described.shape.iter().product();
        // A piece of no elements is kept only for a tensor of none, so that its key exists.
        let kept: Vec<(&Region, &Vec<usize>)> = regions
            .iter()
            .map(|(r, ranks)| (*r, ranks))
            .filter(|(r, _)| r.elem_count() > 0 || numel == 0)
            .take(if numel == 0 { 1 } else { usize::MAX })
            .collect();
        if numel == 0 && kept.is_empty() {
            return Err(Error::Mismatch {
                detail: format!("`{key}` (no elements) is held by no rank as a piece"),
            });
        }
        let refs: Vec<&Region> = kept.iter().map(|(r, _)| *r).collect();
        if let Some(fault) = tiling_fault(&described.shape, &refs) {
            return Err(Error::Mismatch {
                detail: format!(
                    "`{key}` (shape {:?}) is not saved whole by the ranks' pieces: {fault}; every \
                     element must be held by some rank, and pieces that overlap must be the same",
                    described.shape
                ),
            });
        }
        let size = described
            .dtype
            .parse::<candle_core::DType>()
            .map_or(4, |d| d.size_in_bytes());
        let whole = Region::whole(&described.shape);
        let mut pieces = Vec::with_capacity(kept.len());
        for (n, (region, ranks)) in kept.into_iter().enumerate() {
            let writer = *ranks
                .iter()
                .min_by_key(|&&r| (load[r], r))
                .expect("a region has a holder");
            load[writer] += region.elem_count() * size;
            let mut stored = match *region == whole {
                true => key.to_string(),
                false => format!("{key}#{n}"),
            };
            // A tensor may itself be named `w#0`: every stored name must be one piece's only,
            // or a file would hold one of the two and the other load its elements.
            while !names.insert(stored.clone()) {
                stored.push('#');
            }
            writes.entry(writer).or_default().push((
                key.to_string(),
                region.clone(),
                stored.clone(),
            ));
            pieces.push((writer, stored, region.clone()));
        }
        entries.insert(key.to_string(), (described, pieces));
    }
    let files: Vec<FileEntry> = writes
        .keys()
        .map(|&rank| FileEntry {
            name: file_name(rank, world, &id),
            rank,
            bytes: 0,
        })
        .collect();
    let file_of = |rank: usize| files.iter().position(|f| f.rank == rank).expect("a file");
    let tensors = entries
        .into_iter()
        .map(|(key, (described, pieces))| {
            let pieces = pieces
                .into_iter()
                .map(|(writer, stored, region)| PieceEntry {
                    file: file_of(writer),
                    key: stored,
                    region,
                })
                .collect();
            let entry = TensorEntry {
                dtype: described.dtype.clone(),
                shape: described.shape.clone(),
                pieces,
            };
            (key, entry)
        })
        .collect();
    let index = IndexFile {
        format: FORMAT.to_string(),
        version: super::index::VERSION,
        save_id: id,
        world_size: world,
        files,
        tensors,
    };
    Ok((index, writes))
}

impl Planned {
    /// This rank's pieces, as they are now (a synchronous save writes them at once).
    fn pieces(&self, state: &StateDict) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::with_capacity(self.mine.len());
        for (key, region, stored) in &self.mine {
            let t = state
                .get(key)
                .and_then(|t| t.pieces().iter().find(|(r, _)| r == region))
                .map(|(_, t)| t.clone())
                .ok_or_else(|| Error::Checkpoint {
                    key: key.clone(),
                    path: PathBuf::new(),
                    detail: format!("`{key}` lost its piece {region:?} between plan and write"),
                })?;
            let t = match region {
                Region::Flat { len, .. } => t.reshape(*len)?,
                Region::Box { .. } => t,
            };
            out.insert(stored.clone(), t);
        }
        Ok(out)
    }

    /// This rank's pieces copied to host memory, so that training may change them while they
    /// are written.
    fn staged(&self, state: &StateDict) -> Result<HashMap<String, Tensor>> {
        self.pieces(state)?
            .into_iter()
            .map(|(k, t)| {
                let host = match t.device() {
                    Device::Cpu => t.force_contiguous()?,
                    _ => t.to_device(&Device::Cpu)?,
                };
                Ok((k, host))
            })
            .collect()
    }

    /// Writes this rank's file of `state`'s pieces into `dir`: its length (0 without a file).
    pub(crate) fn write(&self, dir: &Path, state: &StateDict) -> Result<u64> {
        let pieces = self.pieces(state)?;
        write_file(dir, self.file.as_deref(), &self.index.save_id, &pieces)
    }
}

/// Writes `pieces` into file `name` of `dir` (created if missing), with the save's name in
/// its metadata: the file's length.
fn write_file(
    dir: &Path,
    name: Option<&str>,
    id: &str,
    pieces: &HashMap<String, Tensor>,
) -> Result<u64> {
    let Some(name) = name else { return Ok(0) };
    std::fs::create_dir_all(dir).map_err(|source| Error::File {
        action: "creating the checkpoint folder",
        path: dir.to_path_buf(),
        source,
    })?;
    let path = dir.join(name);
    let metadata = BTreeMap::from([(SAVE_ID.to_string(), id.to_string())]);
    save_with_metadata(pieces, &path, &metadata)?;
    std::fs::metadata(&path)
        .map(|m| m.len())
        .map_err(|source| Error::File {
            action: "reading the length of",
            path,
            source,
        })
}

/// Commits a planned save once every rank wrote its file (`written`: this rank's outcome, its
/// file's length): rank 0 writes the index, then removes the files of earlier saves. Every rank
/// learns whether every rank succeeded.
pub(crate) fn commit(
    group: Option<&(ProcessGroup, Device)>,
    dir: &Path,
    planned: &Planned,
    written: Result<u64>,
) -> Result<()> {
    let failed = |rank: usize, message: String| Error::Checkpoint {
        key: String::new(),
        path: dir.to_path_buf(),
        detail: format!(
            "rank {rank} could not write its file: {message}; the checkpoint saved before, if \
             any, is still the folder's"
        ),
    };
    // Every rank's outcome: the lengths of the files, or who failed.
    let lengths: Vec<u64> = match group {
        None => vec![written?],
        Some((g, d)) => {
            let mine: std::result::Result<u64, String> = match &written {
                Ok(n) => Ok(*n),
                Err(e) => Err(e.to_string()),
            };
            let bytes = serde_json::to_vec(&mine).unwrap_or_default();
            let all = all_gather_bytes(g, &bytes, d)?;
            let lengths = all
                .iter()
                .enumerate()
                .map(|(rank, b)| {
                    let theirs: std::result::Result<u64, String> = serde_json::from_slice(b)
                        .unwrap_or_else(|e| Err(format!("its report is unreadable: {e}")));
                    theirs.map_err(|m| failed(rank, m))
                })
                .collect::<Result<Vec<u64>>>();
            if let Err(e) = lengths {
                // Every rank knows the save will not be committed: its file is no
                // checkpoint's, and would stay until a later save succeeds.
                if let (Ok(_), Some(name)) = (&written, &planned.file) {
                    if let Err(e) = std::fs::remove_file(dir.join(name)) {
                        log::warn!("could not remove {name}, of a failed save: {e}");
                    }
                }
                written?;
                return Err(e);
            }
            lengths?
        }
    };
    let committed = match planned.rank {
        0 => write_index(dir, planned, &lengths),
        _ => Ok(()),
    };
    // Whether rank 0 is known not to have written the index (its write fails before the
    // rename): then this save's files are no checkpoint's, and each rank removes its own.
    let uncommitted = std::cell::Cell::new(committed.is_err());
    let committed = match group {
        None => committed,
        Some((g, d)) => crate::distributed::objects::agree_on(g, d, committed, |rank, m| {
            uncommitted.set(true);
            Error::Checkpoint {
                key: String::new(),
                path: dir.join(INDEX_FILE),
                detail: format!("rank {rank} could not write the index: {m}"),
            }
        }),
    };
    if committed.is_ok() && planned.rank == 0 {
        remove_stale(dir, &planned.index);
    }
    if let (true, Some(name)) = (uncommitted.get(), &planned.file) {
        if let Err(e) = std::fs::remove_file(dir.join(name)) {
            log::warn!("could not remove {name}, of a save that was not committed: {e}");
        }
    }
    committed
}

/// Writes the index of `planned` with the files' `lengths` (by rank), atomically.
fn write_index(dir: &Path, planned: &Planned, lengths: &[u64]) -> Result<()> {
    let mut index = planned.index.clone();
    for f in &mut index.files {
        f.bytes = lengths[f.rank];
        // Each rank wrote into its own `dir`: unless the folder is shared, rank 0 would commit
        // an index of files that are not beside it, a checkpoint that cannot load.
        let path = dir.join(&f.name);
        let found = std::fs::metadata(&path).map(|m| m.len());
        if found.as_ref().ok() != Some(&f.bytes) {
            let found = match found {
                Ok(n) => format!("is {n} bytes, not the {} rank {} wrote", f.bytes, f.rank),
                Err(e) => format!("is not there ({e})"),
            };
            return Err(Error::Checkpoint {
                key: String::new(),
                path,
                detail: format!(
                    "rank {}'s file of this save, as rank 0 sees the folder, {found}: every \
                     rank must save into the same folder (a shared file system when the job \
                     spans machines); nothing was committed",
                    f.rank
                ),
            });
        }
    }
    let text = serde_json::to_vec_pretty(&index).map_err(|e| Error::Checkpoint {
        key: String::new(),
        path: dir.join(INDEX_FILE),
        detail: format!("writing the index: {e}"),
    })?;
    std::fs::create_dir_all(dir).map_err(|source| Error::File {
        action: "creating the checkpoint folder",
        path: dir.to_path_buf(),
        source,
    })?;
    let path = dir.join(INDEX_FILE);
    write_atomically(&path, |tmp| {
        std::fs::write(tmp, &text)
            .map_err(|source| crate::checkpoint::write_error(&path, tmp, text.len() as u64, source))
    })
}

/// Removes the files of earlier saves (and temporaries of killed ones) from `dir`, now that
/// `index` is the folder's: what cannot be removed is logged.
fn remove_stale(dir: &Path, index: &IndexFile) {
    remove_temporaries(dir);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = name.starts_with("shard-") && name.ends_with(".safetensors");
        if ours && !index.files.iter().any(|f| f.name == name) {
            if let Err(e) = std::fs::remove_file(entry.path()) {
                log::warn!(
                    "could not remove {}, a file of an earlier save: {e}",
                    entry.path().display()
                );
            }
        }
    }
}

/// What an asynchronous save's thread ends with.
enum Outcome {
    /// It wrote and committed the save (or failed doing so).
    Committed(Result<()>),
    /// It wrote this rank's file (its length), which the caller commits.
    Written(Result<u64>),
}

/// An asynchronous save in flight.
pub(crate) struct Pending {
    planned: Planned,
    thread: JoinHandle<Outcome>,
}

impl Pending {
    /// Stages this rank's pieces of `state` and starts a thread writing them into `dir`; with
    /// `commit` (`Some(group)`, or `Some(None)` for one process) the thread commits too.
    pub(crate) fn start(
        planned: Planned,
        state: &StateDict,
        dir: &Path,
        committer: Option<Option<(ProcessGroup, Device)>>,
    ) -> Result<Self> {
        // A rank that cannot stage still takes part in the commit, which then fails everywhere.
        let staged = planned.staged(state);
        let (dir, p) = (dir.to_path_buf(), planned.clone());
        let thread = std::thread::Builder::new()
            .name("checkpoint-save".into())
            .spawn(move || {
                let written =
                    staged.and_then(|s| write_file(&dir, p.file.as_deref(), &p.index.save_id, &s));
                match committer {
                    Some(group) => Outcome::Committed(commit(group.as_ref(), &dir, &p, written)),
                    None => Outcome::Written(written),
                }
            })
            .map_err(|source| Error::Io {
                context: "starting the thread of an asynchronous save".into(),
                source,
            })?;
        Ok(Self { planned, thread })
    }

    /// Whether its thread is done.
    pub(crate) fn done(&self) -> bool {
        self.thread.is_finished()
    }

    fn join(self) -> (Planned, Outcome) {
        let outcome = self.thread.join().unwrap_or_else(|_| {
            Outcome::Committed(Err(Error::Checkpoint {
                key: String::new(),
                path: PathBuf::new(),
                detail: "the thread of an asynchronous save panicked".into(),
            }))
        });
        (self.planned, outcome)
    }

    /// Waits for the thread and commits what it wrote, if it did not (every rank calls it).
    pub(crate) fn finish(self, group: Option<&(ProcessGroup, Device)>, dir: &Path) -> Result<()> {
        match self.join() {
            (_, Outcome::Committed(r)) => r,
            (planned, Outcome::Written(w)) => commit(group, dir, &planned, w),
        }
    }

    /// Waits for the thread, without the other ranks: a save its thread did not commit is
    /// left uncommitted (the previous checkpoint stays the folder's).
    pub(crate) fn finish_alone(self) -> Result<()> {
        match self.join() {
            (_, Outcome::Committed(r)) => r,
            (_, Outcome::Written(w)) => w.and_then(|_| {
                Err(Error::Checkpoint {
                    key: String::new(),
                    path: PathBuf::new(),
                    detail: "its files were written but never committed (call `wait` on every \
                             rank before dropping the Checkpointer)"
                        .into(),
                })
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn described(key: &str, shape: &[usize], regions: Vec<Region>) -> Described {
        Described {
            key: key.into(),
            shape: shape.to_vec(),
            dtype: "f32".into(),
            regions,
        }
    }

    #[test]
    fn replicated_pieces_are_written_once_by_the_least_loaded_rank() {
        // Three ranks of plain DDP: every tensor whole on every rank.
        let all: Vec<Description> = (0..3)
            .map(|_| Description {
                id: "x".into(),
                tensors: vec![
                    described("a", &[100], vec![Region::whole(&[100])]),
                    described("b", &[60], vec![Region::whole(&[60])]),
                    described("c", &[50], vec![Region::whole(&[50])]),
                    described("d", &[40], vec![Region::whole(&[40])]),
                ],
            })
            .collect();
        let (index, writes) = global_plan(&all).unwrap();
        let writers: Vec<usize> = ["a", "b", "c", "d"]
            .iter()
            .map(|k| index.files[index.tensors[*k].pieces[0].file].rank)
            .collect();
        assert_eq!(writers, [0, 1, 2, 2]);
        assert_eq!(writes.values().map(Vec::len).sum::<usize>(), 4);
        assert_eq!(index.tensors["a"].pieces[0].key, "a");
    }

    #[test]
    fn pieces_that_leave_a_gap_or_disagree_are_refused_naming_the_tensor() {
        let half = |start| Region::Flat { start, len: 5 };
        let gap = vec![
            Description {
                id: "x".into(),
                tensors: vec![described("w", &[2, 5], vec![half(0)])],
            },
            Description {
                id: "y".into(),
                tensors: vec![described("w", &[2, 5], vec![half(4)])],
            },
        ];
        let err = global_plan(&gap).unwrap_err().to_string();
        assert!(
            err.contains("`w`") && err.contains("two different pieces"),
            "{err}"
        );
        let mut shapes = gap.clone();
        shapes[1].tensors[0] = described("w", &[5, 2], vec![half(5)]);
        let err = global_plan(&shapes).unwrap_err().to_string();
        assert!(
            err.contains("rank 0") && err.contains("[5, 2] on rank 1"),
            "{err}"
        );
        let mut missing = gap;
        missing[1].tensors.clear();
        let err = global_plan(&missing).unwrap_err().to_string();
        assert!(err.contains("elements 5..10 are in no piece"), "{err}");
    }
}
