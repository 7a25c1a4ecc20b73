//! Resumable training: a folder of checkpoints that a restarted job (`candle-run
//! --max-restarts`) picks up where the last one left off.
//!
//! A checkpoint holds the training state (the model and the optimizer's state, written by the
//! caller: [`crate::checkpoint::save_training_state`] in one process,
//! `DistributedDataParallel::save_checkpoint` in a job) and each rank's [`Progress`]: the epoch,
//! the optimizer steps taken, the position in the epoch's sampler share, and a random
//! generator's state. In the folder, each checkpoint is a subfolder `step-<step>` holding
//! `state.safetensors` and `rank-<r>-of-<world>.progress.safetensors`, and the file `latest`
//! names the last complete one. `latest` is replaced (atomically, like every file) only once
//! every rank has written its part, so a job killed while saving resumes from the checkpoint
//! before; older subfolders are removed after. What a killed save left (temporary files, a
//! subfolder never completed) is removed at the next load or save. A full disk names the
//! folder, the size that was needed and what was free, and says that the folder needs room for
//! the last checkpoint and the next one; every rank reports the failing rank's words.
//!
//! [`ResumeDir::load`] resumes at the world size the checkpoint was written at;
//! [`ResumeDir::load_at_any_world`] also takes one of another world size (an elastic job,
//! `candle-run --nnodes MIN:MAX`, that lost or gained machines), with a state that loads at
//! any world size (DDP's and the fully sharded wrapper's checkpoints do), and translates the
//! position in the epoch: with `DistributedSampler`'s interleaved shares, position `p` on
//! each of `W` ranks means that the first `p·W` samples of the epoch were used, so each of
//! `W'` ranks skips `p·W/W'`.
//!
//! ```rust
//! use candle_core::{DType, Device};
//! use candle_nn::{linear, Optimizer, VarBuilder, VarMap};
//! use candle_parallel::checkpoint::{self, resume::{Progress, ResumeDir}};
//! use candle_parallel::optim::{Sgd, SgdConfig};
//! # fn main() -> candle_parallel::Result<()> {
//! let dir = std::env::temp_dir().join(format!("resume-doc-{}", std::process::id()));
//! # let _ = std::fs::remove_dir_all(&dir);
//! let varmap = VarMap::new();
//! linear(3, 2, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
//! let mut opt = Sgd::new(varmap.all_vars(), SgdConfig::default())?;
//! let resume = ResumeDir::new(&dir);
//!
//! // Nothing to resume from yet: start at the beginning.
//! let load = |opt: &mut Sgd| {
//!     resume.load(|path| checkpoint::load_training_state(&varmap, opt, path))
//! };
//! assert!(load(&mut opt)?.is_none());
//!
//! // ... train, and now and then:
//! let progress = Progress { epoch: 2, step: 120, position: 256, rng: None };
//! resume.save(&progress, |path| checkpoint::save_training_state(&varmap, &opt, path))?;
//!
//! // A restarted run carries on from there.
//! let resumed = load(&mut opt)?.expect("a checkpoint");
//! assert_eq!((resumed.epoch, resumed.step, resumed.position), (2, 120, 256));
//! # std::fs::remove_dir_all(&dir).unwrap();
//! # Ok(()) }
//! ```

use crate::distributed::objects::agree_on;
use crate::distributed::{ProcessGroup, ReduceOp};
use crate::error::{human_bytes, Error, Result};
use crate::rng::Rng;
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Where training stands: with the weights and the optimizer's state, what a resumed run needs
/// to take the same steps on the same batches as a run that never stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Progress {
    /// The epoch in progress: the one to `set_epoch` on the sampler when resuming.
    pub epoch: u64,
    /// Optimizer steps taken since training began (what a learning-rate schedule follows).
    pub step: u64,
    /// How many indices of this epoch's sampler share (`DistributedSampler::indices`) were
    /// trained on: a resumed run starts at this one. Equal to the share's length when the
    /// epoch's training is done.
    pub position: usize,
    /// This rank's random generator, when training draws random numbers (dropout, augmentation):
    /// it carries on with the numbers the run would have drawn.
    pub rng: Option<Rng>,
}

/// What [`ResumeDir::load_at_any_world`] resumed from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resumed {
    /// This rank's progress, translated to this job's world size.
    pub progress: Progress,
    /// The world size of the job that wrote the checkpoint.
    pub saved_world: usize,
}

/// `saved`, the progress of a rank of a job of `saved_world` ranks, for rank `rank` of a job
/// of `world`: the same samples of the epoch used (see the module docs).
fn translate(saved: Progress, saved_world: usize, world: usize, rank: usize) -> Progress {
    let used = saved.position * saved_world;
    if !used.is_multiple_of(world) && rank == 0 {
        log::warn!(
            "the checkpoint's position ({} samples of each of {saved_world} ranks' shares, {used} \
             in all) does not divide among {world} ranks: resuming at {} each, so {} samples \
             are trained twice (a global batch that both world sizes divide avoids this)",
            saved.position,
            used / world,
            used % world
        );
    }
    if saved.rng.is_some() && rank == 0 {
        log::warn!(
            "the checkpoint holds the random generators of {saved_world} ranks, which do not \
             carry over to {world}: every rank starts its generator anew"
        );
    }
    Progress {
        epoch: saved.epoch,
        step: saved.step,
        position: used / world,
        rng: None,
    }
}

/// The world size of the job that wrote the checkpoint in `folder` (from its rank 0's
/// progress file's name).
fn saved_world(folder: &Path) -> Option<usize> {
    std::fs::read_dir(folder)
        .into_iter()
        .flatten()
        .flatten()
        .find_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let rest = name.strip_prefix("rank-0-of-")?;
            rest.strip_suffix(".progress.safetensors")?
                .parse::<usize>()
                .ok()
        })
}

/// The file naming the last complete checkpoint.
const LATEST: &str = "latest";
/// The training state's file in a checkpoint's folder.
pub const STATE_FILE: &str = "state.safetensors";
const STEP_PREFIX: &str = "step-";

/// A folder of resumable checkpoints, saved and loaded by every rank of a job (or by one
/// process); see the [module docs](self).
#[derive(Clone, Debug)]
pub struct ResumeDir {
    dir: PathBuf,
    group: Option<(ProcessGroup, Device)>,
}

impl ResumeDir {
    /// The checkpoints in `dir` of a single process.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            group: None,
        }
    }

    /// The checkpoints in `dir` of a job: every rank of `group` must call [`save`](Self::save)
    /// and [`load`](Self::load) together, and `dir` must be the same folder for all of them (a
    /// shared file system when the job spans machines). `device` is where the group's
    /// collectives run (the rank's GPU under NCCL).
    pub fn for_group(dir: impl Into<PathBuf>, group: &ProcessGroup, device: &Device) -> Self {
        Self {
            dir: dir.into(),
            group: Some((group.clone(), device.clone())),
        }
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn rank_and_world(&self) -> (usize, usize) {
        self.group
            .as_ref()
            .map_or((0, 1), |(g, _)| (g.rank(), g.world_size()))
    }

    /// Saves a checkpoint: `save_state` writes the training state to the path it is given (on
    /// every rank; for a job, typically `DistributedDataParallel::save_checkpoint`, which has
    /// rank 0 write it), each rank writes its `progress`, and once all succeeded `latest` names
    /// the new checkpoint. Every rank gets an error if any rank failed, and the previous
    /// checkpoint stays the one to resume from. Returns the checkpoint's folder.
    pub fn save(
        &self,
        progress: &Progress,
        save_state: impl FnOnce(&Path) -> Result<()>,
    ) -> Result<PathBuf> {
        let (rank, world) = self.rank_and_world();
        let name = format!("{STEP_PREFIX}{:012}", progress.step);
        let folder = self.dir.join(&name);
        let mine = std::fs::create_dir_all(&folder)
            .map_err(|source| Error::File {
                action: "creating the checkpoint folder",
                path: folder.clone(),
                source,
            })
            .and_then(|()| {
                super::save(
                    &progress_tensors(progress, rank, world)?,
                    folder.join(progress_file(rank, world)),
                )
            });
        self.agree(mine, &folder)
            .map_err(|e| self.room_for_two(e))?;
        let state = save_state(&folder.join(STATE_FILE));
        self.agree(state, &folder)
            .map_err(|e| self.room_for_two(e))?;
        let committed = match rank {
            0 => super::write_atomically(&self.dir.join(LATEST), |tmp| {
                std::fs::write(tmp, format!("{name}\n")).map_err(|source| Error::File {
                    action: "writing",
                    path: tmp.to_path_buf(),
                    source,
                })
            }),
            _ => Ok(()),
        };
        self.agree(committed, &self.dir.join(LATEST))?;
        if rank == 0 {
            // Every rank is done writing: whatever else is in the folder is left over.
            self.remove_all_but(&name);
            super::remove_temporaries(&self.dir);
            super::remove_temporaries(&folder);
        }
        log::debug!("checkpoint saved: {}", folder.display());
        Ok(folder)
    }

    /// Loads the last complete checkpoint, if the folder has one: `load_state` reads the
    /// training state from the path it is given (for a job, typically
    /// `DistributedDataParallel::load_checkpoint`), and this rank's [`Progress`] comes back.
    /// `None` when the folder does not exist or holds no checkpoint yet (a first run), on
    /// every rank. An error names the file when the checkpoint is incomplete or corrupt, or
    /// was written by a job of another world size, and when the ranks do not see the same
    /// checkpoint (the folder is not shared).
    pub fn load(&self, load_state: impl FnOnce(&Path) -> Result<()>) -> Result<Option<Progress>> {
        Ok(self.load_from(load_state, false)?.map(|r| r.progress))
    }

    /// As [`load`](Self::load), but a checkpoint written by a job of another world size is
    /// loaded too (`load_state` must load the state at this world size, as
    /// `DistributedDataParallel::load_checkpoint` and `FullyShardedDataParallel`'s do): every
    /// rank resumes at the same epoch and step, at the position that skips the samples the
    /// saving job used (see the [module docs](self)). The ranks' random generators do not carry
    /// over to another world size (each rank's `rng` is then `None`, with a warning when the
    /// checkpoint held some). A position whose samples do not divide among this job's ranks is
    /// rounded down (a few samples are trained twice) with a warning; with a global batch that
    /// both world sizes divide, it always divides at a step.
    pub fn load_at_any_world(
        &self,
        load_state: impl FnOnce(&Path) -> Result<()>,
    ) -> Result<Option<Resumed>> {
        self.load_from(load_state, true)
    }

    fn load_from(
        &self,
        load_state: impl FnOnce(&Path) -> Result<()>,
        any_world: bool,
    ) -> Result<Option<Resumed>> {
        let (rank, world) = self.rank_and_world();
        let latest_path = self.dir.join(LATEST);
        let latest = self.latest();
        // Every rank must take the same way: all resume from one checkpoint, or all start anew.
        let seen = match &latest {
            Ok(Some((_, step))) => Some(*step),
            _ => None,
        };
        self.agree_on_step(seen, &latest_path)?;
        let Some((folder, _)) = latest? else {
            log::info!(
                "no checkpoint in {}: training starts from the beginning",
                self.dir.display()
            );
            if rank == 0 {
                super::remove_temporaries(&self.dir);
            }
            return Ok(None);
        };
        if rank == 0 {
            // Nobody writes while a job loads: what a killed save left goes now.
            let keep = folder.file_name().and_then(|n| n.to_str()).unwrap_or("");
            self.remove_all_but(keep);
            super::remove_temporaries(&self.dir);
            super::remove_temporaries(&folder);
        }
        let saved_world = match saved_world(&folder) {
            Some(w) if any_world => w,
            _ => world,
        };
        let progress = if saved_world == world {
            let file = folder.join(progress_file(rank, world));
            self.agree(read_progress(&file, &folder, rank, world), &file)?
        } else {
            let file = folder.join(progress_file(0, saved_world));
            let saved = self.agree(read_progress(&file, &folder, 0, saved_world), &file)?;
            translate(saved, saved_world, world, rank)
        };
        let state = folder.join(STATE_FILE);
        self.agree(load_state(&state), &state)?;
        log::info!(
            "resumed from {} (written by {saved_world} ranks): epoch {}, step {}, position {} in \
             the epoch",
            folder.display(),
            progress.epoch,
            progress.step,
            progress.position
        );
        Ok(Some(Resumed {
            progress,
            saved_world,
        }))
    }

    /// The last complete checkpoint's folder and step, from `latest`; `None` when there is
    /// none.
    pub fn latest(&self) -> Result<Option<(PathBuf, u64)>> {
        let path = self.dir.join(LATEST);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(Error::File {
                    action: "reading",
                    path,
                    source,
                })
            }
        };
        let name = text.trim();
        let step = name
            .strip_prefix(STEP_PREFIX)
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or_else(|| Error::Checkpoint {
                key: String::new(),
                path: path.clone(),
                detail: format!(
                    "holds {name:?}, not the name of a checkpoint folder ({STEP_PREFIX}<step>); \
                     the file is corrupt: remove the folder to start anew"
                ),
            })?;
        let folder = self.dir.join(name);
        if !folder.is_dir() {
            return Err(Error::Checkpoint {
                key: String::new(),
                path,
                detail: format!(
                    "names {}, which is not a folder: the checkpoint was removed; remove \
                     `latest` to start anew",
                    folder.display()
                ),
            });
        }
        Ok(Some((folder, step)))
    }

    /// Removes every checkpoint folder but `keep` (older ones, and newer ones a killed job left
    /// incomplete); a failure is only reported.
    fn remove_all_but(&self, keep: &str) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if name != keep && name.starts_with(STEP_PREFIX) {
                if let Err(e) = std::fs::remove_dir_all(entry.path()) {
                    log::warn!(
                        "could not remove the old checkpoint {}: {e}",
                        entry.path().display()
                    );
                }
            }
        }
    }

    /// `result` on this rank, or, when another rank failed, an error naming it and giving its
    /// own words (about `path`): every rank fails together (one process: `result` itself).
    fn agree<T>(&self, result: Result<T>, path: &Path) -> Result<T> {
        let Some((group, device)) = &self.group else {
            return result;
        };
        agree_on(group, device, result, |rank, e| Error::Checkpoint {
            key: String::new(),
            path: path.to_path_buf(),
            detail: format!("rank {rank} failed: {e}"),
        })
    }

    /// A failed save, said with what to do about it when the folder lacks the room: the last
    /// complete checkpoint stays until the next one is written, so the folder needs room for
    /// both. Every rank measures the same folder after the same failure, so all say the same.
    fn room_for_two(&self, e: Error) -> Error {
        let Ok(Some((last, _))) = self.latest() else {
            return e;
        };
        let kept: u64 = std::fs::read_dir(&last)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|f| f.metadata().ok())
            .map(|m| m.len())
            .sum();
        let Some(free) = super::free_bytes(&self.dir).filter(|&free| free < kept) else {
            return e;
        };
        let why = format!(
            "the last checkpoint ({}, {}) is kept until this one is complete, so {} needs room \
             for both ({} free)",
            last.display(),
            human_bytes(kept),
            self.dir.display(),
            human_bytes(free)
        );
        match e {
            Error::DiskFull {
                path,
                folder,
                needed,
                available,
                ..
            } => Error::DiskFull {
                path,
                folder,
                needed,
                available,
                hint: format!("{why}: free space there, or give the job another checkpoint folder"),
            },
            Error::Checkpoint { key, path, detail } => Error::Checkpoint {
                key,
                path,
                detail: format!("{detail}; {why}"),
            },
            other => Error::Checkpoint {
                key: String::new(),
                path: self.dir.clone(),
                detail: format!("{other}; {why}"),
            },
        }
    }

    /// Fails on every rank unless every rank saw the same checkpoint (`step`, or none).
    fn agree_on_step(&self, step: Option<u64>, latest: &Path) -> Result<()> {
        let Some((group, device)) = &self.group else {
            return Ok(());
        };
        // -1 for none; f64 holds every step below 2^53 exactly.
        let mine = step.map_or(-1.0, |s| s as f64);
        let t = Tensor::new(&[mine, -mine], device)?;
        let most = group.all_reduce(&t, ReduceOp::Max)?;
        let most = most.to_device(&Device::Cpu)?.to_vec1::<f64>()?;
        if most[0] != mine || most[1] != -mine {
            let shown = |s: f64| match s {
                s if s < 0.0 => "none".to_string(),
                s => format!("step {s}"),
            };
            return Err(Error::Checkpoint {
                key: String::new(),
                path: latest.to_path_buf(),
                detail: format!(
                    "rank {} sees {}, but the ranks' checkpoints range from {} to {}: the \
                     folder must be one folder shared by every rank",
                    group.rank(),
                    shown(mine),
                    shown(-most[1]),
                    shown(most[0])
                ),
            });
        }
        Ok(())
    }
}

/// `rank-<r>-of-<world>.progress.safetensors`.
fn progress_file(rank: usize, world: usize) -> String {
    format!("rank-{rank}-of-{world}.progress.safetensors")
}

/// The keys of a progress file: `progress` = [epoch, step, position, rank, world] and, with a
/// generator, `rng` = its state; u64s as i64 bit patterns (safetensors has no u64 in candle).
fn progress_tensors(p: &Progress, rank: usize, world: usize) -> Result<HashMap<String, Tensor>> {
    let numbers = [
        p.epoch,
        p.step,
        p.position as u64,
        rank as u64,
        world as u64,
    ];
    let mut out = HashMap::new();
    out.insert("progress".to_string(), i64_tensor(&numbers)?);
    if let Some(rng) = &p.rng {
        out.insert("rng".to_string(), i64_tensor(&rng.state())?);
    }
    Ok(out)
}

fn i64_tensor(values: &[u64]) -> Result<Tensor> {
    let bits: Vec<i64> = values.iter().map(|&v| v as i64).collect();
    Ok(Tensor::new(bits, &Device::Cpu)?)
}

/// This rank's progress from `file`, checked against the rank and world it must be of.
fn read_progress(file: &Path, folder: &Path, rank: usize, world: usize) -> Result<Progress> {
    if !file.exists() {
        let other_world = saved_world(folder).filter(|&w| w != world);
        let detail = match other_world {
            Some(w) => format!(
                "missing: the checkpoint was written by a job of {w} ranks, this job has \
                 {world}; resume with {w} ranks, load it with `load_at_any_world` (a state \
                 that loads at any world size), or start anew in another folder"
            ),
            None => "missing: the checkpoint is incomplete; remove its folder and `latest` \
                     to start anew"
                .to_string(),
        };
        return Err(Error::Checkpoint {
            key: String::new(),
            path: file.to_path_buf(),
            detail,
        });
    }
    let tensors = super::read(file)?;
    let numbers = |key: &str, len: usize| -> Result<Vec<u64>> {
        let wrong = |detail: String| Error::Checkpoint {
            key: key.to_string(),
            path: file.to_path_buf(),
            detail,
        };
        let t = tensors
            .get(key)
            .ok_or_else(|| wrong(format!("no tensor `{key}`: the file is corrupt")))?;
        if t.dtype() != DType::I64 || t.dims() != [len] {
            return Err(wrong(format!(
                "`{key}` is {:?} {:?}, not i64 [{len}]: the file is corrupt",
                t.dtype(),
                t.dims()
            )));
        }
        Ok(t.to_vec1::<i64>()?.into_iter().map(|v| v as u64).collect())
    };
    let n = numbers("progress", 5)?;
    if (n[3], n[4]) != (rank as u64, world as u64) {
        return Err(Error::Checkpoint {
            key: "progress".into(),
            path: file.to_path_buf(),
            detail: format!(
                "holds the progress of rank {} of {}, not of rank {rank} of {world}: the file \
                 was renamed or copied; remove the checkpoint to start anew",
                n[3], n[4]
            ),
        });
    }
    let rng = match tensors.contains_key("rng") {
        false => None,
        true => {
            let s = numbers("rng", 4)?;
            let state = [s[0], s[1], s[2], s[3]];
            Some(Rng::from_state(state).ok_or_else(|| {
                Error::Checkpoint {
                    key: "rng".into(),
                    path: file.to_path_buf(),
                    detail: "the generator's state is all zeros, which no generator reaches: the \
                         file is corrupt"
                        .into(),
                }
            })?)
        }
    };
    Ok(Progress {
        epoch: n[0],
        step: n[1],
        position: n[2] as usize,
        rng,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::spawn_threads;

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("resume-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// A training state of one tensor, `w`, holding `value`.
    fn save_value(value: f32) -> impl FnOnce(&Path) -> Result<()> {
        move |path| {
            let t = Tensor::new(&[value], &Device::Cpu)?;
            super::super::save(&HashMap::from([("w".to_string(), t)]), path)
        }
    }

    fn read_value(path: &Path) -> Result<f32> {
        Ok(super::super::read(path)?["w"].to_vec1::<f32>()?[0])
    }

    fn progress(step: u64, rng: Option<Rng>) -> Progress {
        Progress {
            epoch: 3,
            step,
            position: 64 * step as usize,
            rng,
        }
    }

    #[test]
    fn a_saved_checkpoint_comes_back_with_its_progress_and_generator() -> Result<()> {
        let dir = temp("roundtrip");
        let resume = ResumeDir::new(&dir);
        assert_eq!(resume.load(|_| panic!("nothing to load"))?, None);
        let mut rng = Rng::new(9);
        rng.next_u64();
        resume.save(&progress(10, Some(rng.clone())), save_value(1.0))?;
        resume.save(&progress(20, None), save_value(2.0))?;
        let mut loaded = None;
        let p = resume.load(|path| {
            loaded = Some(read_value(path)?);
            Ok(())
        })?;
        assert_eq!(p, Some(progress(20, None)));
        assert_eq!(loaded, Some(2.0));
        // The older checkpoint is gone, the newer one holds the generator when it had one.
        let folders: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with(STEP_PREFIX))
            .collect();
        assert_eq!(folders, ["step-000000000020"]);
        resume.save(&progress(30, Some(rng.clone())), save_value(3.0))?;
        let back = resume.load(|_| Ok(()))?.unwrap();
        assert_eq!(back.rng, Some(rng));
        std::fs::remove_dir_all(dir).unwrap();
        Ok(())
    }

    #[test]
    fn a_failed_save_leaves_the_previous_checkpoint_to_resume_from() -> Result<()> {
        let dir = temp("failed");
        let resume = ResumeDir::new(&dir);
        resume.save(&progress(10, None), save_value(1.0))?;
        let failed = resume.save(&progress(20, None), |_| {
            Err(Error::InvalidArgument {
                what: "test",
                detail: "the disk is full".into(),
            })
        });
        assert!(failed.unwrap_err().to_string().contains("the disk is full"));
        let mut loaded = None;
        let p = resume.load(|path| {
            loaded = Some(read_value(path)?);
            Ok(())
        })?;
        assert_eq!((p.map(|p| p.step), loaded), (Some(10), Some(1.0)));
        std::fs::remove_dir_all(dir).unwrap();
        Ok(())
    }

    #[test]
    fn corrupt_files_are_named_with_what_is_wrong() -> Result<()> {
        let dir = temp("corrupt");
        let resume = ResumeDir::new(&dir);
        let folder = resume.save(&progress(5, None), save_value(1.0))?;
        let file = folder.join(progress_file(0, 1));
        std::fs::write(&file, b"not a safetensors file").unwrap();
        match resume.load(|_| Ok(())) {
            Err(Error::Checkpoint { path, detail, .. }) => {
                assert_eq!(path, file);
                assert!(detail.contains("not a safetensors file"), "{detail}");
            }
            other => panic!("{other:?}"),
        }
        // A progress file of another rank, renamed.
        let other = progress_tensors(&progress(5, None), 1, 2)?;
        super::super::save(&other, &file)?;
        let err = resume.load(|_| Ok(())).unwrap_err().to_string();
        assert!(err.contains("rank 1 of 2, not of rank 0 of 1"), "{err}");
        std::fs::write(dir.join(LATEST), "garbage\n").unwrap();
        match resume.load(|_| Ok(())) {
            Err(Error::Checkpoint { path, detail, .. }) => {
                assert_eq!(path, dir.join(LATEST));
                assert!(detail.contains("\"garbage\""), "{detail}");
            }
            other => panic!("{other:?}"),
        }
        std::fs::remove_dir_all(dir).unwrap();
        Ok(())
    }

    #[test]
    fn every_rank_saves_its_own_generator_and_another_world_is_refused() -> Result<()> {
        let dir = temp("ranks");
        let seeds = spawn_threads(2, |pg| {
            let resume = ResumeDir::for_group(&dir, &pg, &Device::Cpu);
            assert_eq!(resume.load(|_| Ok(()))?, None);
            let rng = Rng::new(100 + pg.rank() as u64);
            // Rank 0 writes the state, as DDP's save_checkpoint does.
            let rank = pg.rank();
            resume.save(&progress(7, Some(rng)), |path| match rank {
                0 => save_value(7.0)(path),
                _ => Ok(()),
            })?;
            let back = resume.load(|path| {
                assert_eq!(read_value(path)?, 7.0);
                Ok(())
            })?;
            Ok(back.and_then(|p| p.rng))
        })?;
        assert_eq!(seeds, [Some(Rng::new(100)), Some(Rng::new(101))]);
        let err = ResumeDir::new(&dir)
            .load(|_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("written by a job of 2 ranks, this job has 1"),
            "{err}"
        );
        std::fs::remove_dir_all(dir).unwrap();
        Ok(())
    }

    #[test]
    fn a_checkpoint_of_4_ranks_resumes_on_2_and_on_3_at_the_samples_it_used() -> Result<()> {
        let dir = temp("any-world");
        // 4 ranks, each 24 samples into its share: 96 samples of the epoch used.
        spawn_threads(4, |pg| {
            let resume = ResumeDir::for_group(&dir, &pg, &Device::Cpu);
            let rng = Some(Rng::new(pg.rank() as u64 + 1));
            let at = Progress {
                epoch: 2,
                step: 6,
                position: 24,
                rng,
            };
            let rank = pg.rank();
            resume.save(&at, |path| match rank {
                0 => save_value(6.0)(path),
                _ => Ok(()),
            })?;
            Ok(())
        })?;
        for (world, position) in [(2, 48), (3, 32), (4, 24)] {
            let resumed = spawn_threads(world, |pg| {
                let resume = ResumeDir::for_group(&dir, &pg, &Device::Cpu);
                let r = resume.load_at_any_world(|path| {
                    assert_eq!(read_value(path)?, 6.0);
                    Ok(())
                })?;
                Ok(r.expect("a checkpoint"))
            })?;
            for (rank, r) in resumed.into_iter().enumerate() {
                assert_eq!(r.saved_world, 4);
                let p = r.progress;
                assert_eq!((p.epoch, p.step, p.position), (2, 6, position), "{world}");
                // A generator carries over at the same world size only.
                let rng = (world == 4).then(|| Rng::new(rank as u64 + 1));
                assert_eq!(p.rng, rng, "world {world}");
            }
        }
        // `load` keeps refusing another world size, and says what loads it.
        let err = ResumeDir::new(&dir)
            .load(|_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("load_at_any_world"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
        Ok(())
    }

    #[test]
    fn ranks_that_see_different_checkpoints_all_fail() -> Result<()> {
        let dirs = [temp("unshared-0"), temp("unshared-1")];
        ResumeDir::new(&dirs[0]).save(&progress(4, None), save_value(1.0))?;
        let results = spawn_threads(2, |pg| {
            let resume = ResumeDir::for_group(&dirs[pg.rank()], &pg, &Device::Cpu);
            Ok(resume
                .load(|_| Ok(()))
                .map(|_| ())
                .map_err(|e| e.to_string()))
        })?;
        for r in results {
            let err = r.unwrap_err();
            assert!(err.contains("one folder shared by every rank"), "{err}");
        }
        std::fs::remove_dir_all(&dirs[0]).unwrap();
        Ok(())
    }
}
