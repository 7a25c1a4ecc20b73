//! Saving model variables, and whole training states, as safetensors, atomically and with a
//! checksum of every tensor.
//!
//! A checkpoint is written to a temporary file beside its destination, flushed to disk, and
//! renamed over the destination, so a crash or a full disk never leaves a half-written
//! checkpoint under the real name: readers see the old file or the new one. Temporary files
//! that a killed process left are removed at the next save of the same file. A full disk is
//! [`Error::DiskFull`], naming the file, what it needed and what was free.
//!
//! Every tensor's CRC-32C (of its dtype, shape and bytes) is in the file's metadata and is
//! checked when the file is read: a flipped bit or a changed header is an error naming the file
//! and the tensor, and nothing is loaded. Files without checksums (another program's) load with
//! a warning. A tensor whose dtype differs from its variable's is an error unless
//! [`LoadOptions::convert_dtypes`] asks for the conversion (which is logged).
//!
//! A training state ([`save_training_state`], [`load_training_state`]) holds the variables and
//! the optimizer's state in one file:
//! - each variable under its own name, so `VarMap::load` reads the weights of such a file;
//! - each per-variable state tensor under `optimizer.state.<variable name>.<state name>`
//!   (`optimizer.state.fc1.weight.exp_avg`);
//! - each scalar of the optimizer as a 0-dim f64 tensor under `optimizer.<scalar name>`
//!   (`optimizer.step`).
//!
//! [`optimizer_tensors`] and [`optimizer_state_from`] write and read the optimizer's part under
//! names of the caller's choosing (a sharded wrapper names its flat shards).
//!
//! [`resume`] keeps a folder of checkpoints that a restarted job resumes from: the training
//! state, and each rank's epoch, step, sampler position and random generator.
//!
//! ```rust
//! use candle_core::{DType, Device};
//! use candle_nn::{linear, Optimizer, VarBuilder, VarMap};
//! use candle_parallel::checkpoint;
//! use candle_parallel::optim::{AdamW, AdamWConfig, ElementwiseOptimizer};
//! # fn main() -> candle_parallel::Result<()> {
//! let varmap = VarMap::new();
//! linear(3, 2, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
//! let path = std::env::temp_dir().join(format!("doc-{}.safetensors", std::process::id()));
//! checkpoint::save_varmap(&varmap, &path)?;
//! let loaded = candle_core::safetensors::load(&path, &Device::Cpu)?;
//! assert_eq!(loaded["weight"].dims(), [2, 3]);
//!
//! // The variables and the optimizer's state, to resume training from.
//! let mut opt = AdamW::new(varmap.all_vars(), AdamWConfig::default())?;
//! opt.backward_step(&varmap.all_vars()[0].as_tensor().sum_all()?)?;
//! checkpoint::save_training_state(&varmap, &opt, &path)?;
//! let mut resumed = AdamW::new(varmap.all_vars(), AdamWConfig::default())?;
//! checkpoint::load_training_state(&varmap, &mut resumed, &path)?;
//! assert_eq!(resumed.state().scalars["step"], 1.0);
//! # std::fs::remove_file(&path).unwrap();
//! # Ok(()) }
//! ```

mod crc32c;
pub mod distributed;
mod format;
pub mod resume;
pub(crate) mod sharded;

use crate::error::{Error, Result};
use crate::optim::{ElementwiseOptimizer, OptimizerState};
use crate::util::sync::lock;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

/// Saves every variable of `varmap` under its name to `path`, atomically.
pub fn save_varmap(varmap: &VarMap, path: impl AsRef<Path>) -> Result<()> {
    let tensors: HashMap<String, Tensor> = lock(varmap.data())
        .iter()
        .map(|(name, var)| (name.clone(), var.as_tensor().clone()))
        .collect();
    save(&tensors, path)
}

/// Saves `tensors` to `path` in the safetensors format, with a checksum of every tensor,
/// atomically. Tensors on GPUs are copied to the host first.
pub fn save(tensors: &HashMap<String, Tensor>, path: impl AsRef<Path>) -> Result<()> {
    save_with_metadata(tensors, path, &BTreeMap::new())
}

/// As [`save`], with `metadata` in the file's header besides the checksums.
pub(crate) fn save_with_metadata(
    tensors: &HashMap<String, Tensor>,
    path: impl AsRef<Path>,
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let host: HashMap<&str, Tensor> = tensors
        .iter()
        .map(|(k, t)| Ok((k.as_str(), t.to_device(&Device::Cpu)?)))
        .collect::<Result<_>>()?;
    let prepared = format::prepare_with(&host, metadata)?;
    let path = path.as_ref();
    write_atomically(path, |tmp| {
        // Flushed and synced here, so that a full disk found only then is named as one.
        let written = std::fs::File::create(tmp).and_then(|f| {
            let mut out = std::io::BufWriter::with_capacity(1 << 20, &f);
            prepared.write(&mut out)?;
            drop(out);
            f.sync_all()
        });
        written.map_err(|source| write_error(path, tmp, prepared.len, source))
    })
}

/// The error of a failed write of `len` bytes to `tmp` (for `path`): [`Error::DiskFull`] when
/// the disk (or a quota) is full, else [`Error::File`].
pub(crate) fn write_error(path: &Path, tmp: &Path, len: u64, source: std::io::Error) -> Error {
    let full = source.kind() == std::io::ErrorKind::StorageFull
        || source.kind() == std::io::ErrorKind::QuotaExceeded;
    if !full {
        return Error::File {
            action: "writing",
            path: tmp.to_path_buf(),
            source,
        };
    }
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    Error::DiskFull {
        available: free_bytes(&folder).unwrap_or(0),
        path: path.to_path_buf(),
        folder,
        needed: len,
        hint: "free space there, or write elsewhere".into(),
    }
}

/// The bytes free to an unprivileged writer on the file system of `dir`.
pub(crate) fn free_bytes(dir: &Path) -> Option<u64> {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
        // SAFETY: statvfs writes into the zeroed struct we own; `c` is a valid C string.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
            return None;
        }
        #[allow(clippy::unnecessary_cast)]
        Some(st.f_bavail as u64 * st.f_frsize as u64)
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        None
    }
}

/// The temporary name `write_atomically` writes `path` under, for process `pid`.
fn temporary(path: &Path, pid: u32) -> Option<std::path::PathBuf> {
    let file_name = path.file_name()?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(file_name);
    tmp_name.push(format!(".tmp-{pid}"));
    Some(path.with_file_name(tmp_name))
}

/// Whether process `pid` is alive on this machine (unknown elsewhere than unix: assumed alive).
fn alive(pid: u32) -> bool {
    #[cfg(unix)]
    {
        let Ok(pid) = libc::pid_t::try_from(pid) else {
            return false;
        };
        // SAFETY: signal 0 only checks that the process exists.
        let r = unsafe { libc::kill(pid, 0) };
        r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// Removes the temporary files of `path` (`.name.tmp-<pid>`) that dead processes left: a save
/// killed before its rename.
fn remove_leftovers_of(path: &Path) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let prefix = format!(".{}.tmp-", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file = entry.file_name();
        let Some(pid) = file
            .to_str()
            .and_then(|f| f.strip_prefix(&prefix))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !alive(pid) {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => log::info!(
                    "removed {}, left by a save that was killed",
                    entry.path().display()
                ),
                Err(e) => log::warn!("could not remove {}: {e}", entry.path().display()),
            }
        }
    }
}

/// Removes every temporary file of a save (`.<name>.tmp-<pid>`) in `dir`, whoever left it: for
/// a folder where nobody else is saving at the moment (a job's checkpoint folder between two
/// saves).
pub(crate) fn remove_temporaries(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let temporary = name.starts_with('.')
            && name
                .rsplit_once(".tmp-")
                .is_some_and(|(_, pid)| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()));
        if temporary && entry.path().is_file() {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => log::info!(
                    "removed {}, left by a save that was interrupted",
                    entry.path().display()
                ),
                Err(e) => log::warn!("could not remove {}: {e}", entry.path().display()),
            }
        }
    }
}

/// Writes the file at `path` atomically: `write` fills a temporary file beside it, which is
/// flushed to disk and renamed over `path`, and the folder is synced so that the rename lasts.
/// On failure the temporary file is removed and `path` is untouched. Temporary files of `path`
/// that dead processes left are removed first.
pub(crate) fn write_atomically(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = temporary(path, std::process::id()).ok_or_else(|| Error::InvalidArgument {
        what: "checkpoint path",
        detail: format!("{} does not name a file", path.display()),
    })?;
    remove_leftovers_of(path);
    let written = write(&tmp)
        .and_then(|()| sync(&tmp, "writing"))
        .and_then(|()| {
            std::fs::rename(&tmp, path).map_err(|source| Error::File {
                action: "renaming a temporary checkpoint to",
                path: path.to_path_buf(),
                source,
            })
        });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    // What is free once the partial file is gone, which is what the user will find.
    let written = written.map_err(|e| match e {
        Error::DiskFull {
            path,
            folder,
            needed,
            hint,
            available,
        } => Error::DiskFull {
            available: free_bytes(&folder).unwrap_or(available),
            path,
            folder,
            needed,
            hint,
        },
        other => other,
    });
    written?;
    // Make the rename itself durable.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        let _ = std::fs::File::open(dir).and_then(|d| d.sync_all());
    }
    Ok(())
}

/// The prefix of every optimizer key in a training-state checkpoint.
pub(crate) const OPTIMIZER: &str = "optimizer.";
/// The prefix of the per-variable state tensors' keys.
pub(crate) const OPTIMIZER_STATE: &str = "optimizer.state.";

/// Saves the variables of `varmap` and the state of `opt` to `path`, atomically, in the format
/// of the [module docs](self). Every variable of `opt` must be one of `varmap`'s (its name is
/// the `VarMap`'s); `varmap` may hold more (buffers).
pub fn save_training_state(
    varmap: &VarMap,
    opt: &impl ElementwiseOptimizer,
    path: impl AsRef<Path>,
) -> Result<()> {
    let names = var_names(varmap, opt.vars())?;
    let mut tensors = HashMap::new();
    for (name, var) in lock(varmap.data()).iter() {
        if name.starts_with(OPTIMIZER) {
            return Err(Error::InvalidArgument {
                what: "variable name in a training state",
                detail: format!(
                    "`{name}` starts with `{OPTIMIZER}`, which training-state checkpoints keep \
                     for the optimizer's state; rename the variable"
                ),
            });
        }
        tensors.insert(name.clone(), var.as_tensor().clone());
    }
    tensors.extend(optimizer_tensors(&names, &opt.state())?);
    save(&tensors, path)
}

/// Reads every tensor of the safetensors file at `path` onto the CPU, checking each one's
/// checksum: an I/O failure is [`Error::File`]; contents that are not safetensors, or a tensor
/// that does not match its checksum, [`Error::Checkpoint`] naming it (nothing is returned).
pub fn read(path: impl AsRef<Path>) -> Result<HashMap<String, Tensor>> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|source| Error::File {
        action: "reading",
        path: path.to_path_buf(),
        source,
    })?;
    format::parse(&bytes, path)
}

/// How a checkpoint is loaded into variables.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Convert a tensor whose dtype differs from its variable's (said through the `log`
    /// facade), instead of failing (default: fail, naming the tensor and both dtypes: a
    /// checkpoint of another model, or a corrupt one).
    pub convert_dtypes: bool,
}

impl LoadOptions {
    /// `t` (tensor `name` of the file at `path`) in `var`'s dtype and on its device, or the
    /// error that its dtype differs.
    pub(crate) fn fit(&self, name: &str, t: &Tensor, var: &Var, path: &Path) -> Result<Tensor> {
        if t.dtype() != var.dtype() {
            if !self.convert_dtypes {
                return Err(Error::Checkpoint {
                    key: name.to_string(),
                    path: path.to_path_buf(),
                    detail: format!(
                        "`{name}` is {:?} in the file and {:?} in the model: a checkpoint of \
                         another model, or a corrupt one; to convert on purpose, load with \
                         LoadOptions {{ convert_dtypes: true, .. }}",
                        t.dtype(),
                        var.dtype()
                    ),
                });
            }
            log::warn!(
                "{}: `{name}` is {:?}, the variable {:?}: converting, as LoadOptions asks",
                path.display(),
                t.dtype(),
                var.dtype()
            );
        }
        Ok(t.to_device(var.device())?.to_dtype(var.dtype())?)
    }
}

/// Loads a training state saved by [`save_training_state`] into `varmap`'s variables and into
/// `opt`, whose variables must be `varmap`'s (in any order: the state follows the names).
/// Every variable of `varmap` and every scalar `opt` keeps must be in the file, each tensor
/// must match its checksum and have its variable's dtype; nothing is changed unless all of it
/// fits. Optimizer state is converted to the dtype the optimizer keeps it in.
pub fn load_training_state(
    varmap: &VarMap,
    opt: &mut impl ElementwiseOptimizer,
    path: impl AsRef<Path>,
) -> Result<()> {
    load_training_state_with(varmap, opt, path, LoadOptions::default())
}

/// As [`load_training_state`], with options (converting dtypes on purpose).
pub fn load_training_state_with(
    varmap: &VarMap,
    opt: &mut impl ElementwiseOptimizer,
    path: impl AsRef<Path>,
    options: LoadOptions,
) -> Result<()> {
    let path = path.as_ref();
    let tensors = read(path)?;
    let names = var_names(varmap, opt.vars())?;
    let vars: Vec<(String, Var)> = lock(varmap.data())
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    let mut weights = Vec::with_capacity(vars.len());
    for (name, var) in &vars {
        let t = tensors.get(name).ok_or_else(|| Error::Checkpoint {
            key: name.clone(),
            path: path.to_path_buf(),
            detail: format!(
                "no tensor `{name}`, a variable of the VarMap; load a checkpoint saved from the \
                 same model"
            ),
        })?;
        if t.dims() != var.dims() {
            return Err(Error::Checkpoint {
                key: name.clone(),
                path: path.to_path_buf(),
                detail: format!(
                    "`{name}` has shape {:?}, but the VarMap's variable has shape {:?}; load a \
                     checkpoint saved from the same model",
                    t.dims(),
                    var.dims()
                ),
            });
        }
        weights.push(options.fit(name, t, var, path)?);
    }
    let state = optimizer_state_from(&names, &tensors, path)?;
    // Our optimizers keep the same states for every variable that has any: one that has fewer
    // than another means a tensor is missing from the file.
    let kept: BTreeSet<&String> = state.per_var.iter().flat_map(|m| m.keys()).collect();
    for (name, map) in names.iter().zip(&state.per_var) {
        if let Some(missing) = kept
            .iter()
            .find(|k| !map.is_empty() && !map.contains_key(**k))
        {
            let key = format!("{OPTIMIZER_STATE}{name}.{missing}");
            return Err(Error::Checkpoint {
                detail: format!(
                    "no tensor `{key}`, though `{name}` has other optimizer state and other \
                     variables have `{missing}`; the file is incomplete"
                ),
                key,
                path: path.to_path_buf(),
            });
        }
    }
    if let Some(scalar) = opt
        .state()
        .scalars
        .keys()
        .find(|k| !state.scalars.contains_key(*k))
    {
        return Err(Error::Checkpoint {
            key: format!("{OPTIMIZER}{scalar}"),
            path: path.to_path_buf(),
            detail: format!(
                "no tensor `{OPTIMIZER}{scalar}`, which the optimizer needs; load a checkpoint \
                 saved by save_training_state with the same kind of optimizer"
            ),
        });
    }
    let known: BTreeSet<&str> = vars.iter().map(|(n, _)| n.as_str()).collect();
    let unused: Vec<&String> = tensors
        .keys()
        .filter(|k| !known.contains(k.as_str()) && !k.starts_with(OPTIMIZER))
        .collect();
    if !unused.is_empty() {
        log::warn!(
            "{}: {} tensors match no variable of the VarMap and are ignored (e.g. `{}`)",
            path.display(),
            unused.len(),
            unused[0]
        );
    }
    opt.load_state(&state)?;
    for ((_, var), t) in vars.iter().zip(&weights) {
        var.set(t)?;
    }
    Ok(())
}

/// The checkpoint tensors of an optimizer state whose variables are named `names` (in the
/// order of [`OptimizerState::per_var`]): `optimizer.state.<name>.<state>` for each state
/// tensor and `optimizer.<scalar>`, a 0-dim f64 tensor on the CPU, for each scalar.
pub fn optimizer_tensors(
    names: &[String],
    state: &OptimizerState,
) -> Result<HashMap<String, Tensor>> {
    if names.len() != state.per_var.len() {
        return Err(Error::InvalidArgument {
            what: "optimizer variable names",
            detail: format!(
                "{} names for the {} variables of the optimizer state",
                names.len(),
                state.per_var.len()
            ),
        });
    }
    let mut out = HashMap::new();
    for (name, map) in names.iter().zip(&state.per_var) {
        for (state_name, t) in map {
            out.insert(format!("{OPTIMIZER_STATE}{name}.{state_name}"), t.clone());
        }
    }
    for (scalar, &x) in &state.scalars {
        out.insert(
            format!("{OPTIMIZER}{scalar}"),
            Tensor::new(x, &Device::Cpu)?,
        );
    }
    Ok(out)
}

/// Reads the optimizer state of the variables named `names` from checkpoint `tensors` (read
/// from `source`, named in errors): the inverse of [`optimizer_tensors`]. A variable without
/// state tensors gets an empty map; every `optimizer.<scalar>` key becomes a scalar. Whether
/// the state fits an optimizer is checked by its `load_state`.
pub fn optimizer_state_from(
    names: &[String],
    tensors: &HashMap<String, Tensor>,
    source: &Path,
) -> Result<OptimizerState> {
    let mut state = OptimizerState {
        per_var: vec![Default::default(); names.len()],
        ..Default::default()
    };
    let index: HashMap<&str, usize> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i))
        .collect();
    for (key, t) in tensors {
        if let Some(rest) = key.strip_prefix(OPTIMIZER_STATE) {
            // State names have no dot, variable names may: split at the last one.
            let owner = rest
                .rsplit_once('.')
                .and_then(|(var, state_name)| Some((*index.get(var)?, state_name)));
            match owner {
                Some((i, state_name)) => {
                    state.per_var[i].insert(state_name.to_string(), t.clone());
                }
                None => log::warn!(
                    "{}: `{key}` is the state of no variable of the optimizer; ignored",
                    source.display()
                ),
            }
        } else if let Some(scalar) = key.strip_prefix(OPTIMIZER) {
            let value = match t.rank() {
                0 => t.to_dtype(DType::F64)?.to_scalar::<f64>()?,
                _ => {
                    return Err(Error::Checkpoint {
                        key: key.clone(),
                        path: source.to_path_buf(),
                        detail: format!(
                            "the optimizer scalar `{key}` has shape {:?}, not a 0-dim tensor",
                            t.dims()
                        ),
                    })
                }
            };
            state.scalars.insert(scalar.to_string(), value);
        }
    }
    Ok(state)
}

/// The name of each of `vars` in `varmap`.
pub(crate) fn var_names(varmap: &VarMap, vars: &[Var]) -> Result<Vec<String>> {
    let by_id: HashMap<_, String> = lock(varmap.data())
        .iter()
        .map(|(name, var)| (var.as_tensor().id(), name.clone()))
        .collect();
    vars.iter()
        .enumerate()
        .map(|(index, var)| {
            by_id
                .get(&var.as_tensor().id())
                .cloned()
                .ok_or_else(|| Error::VariableNotInVarMap {
                    index,
                    shape: var.dims().to_vec(),
                })
        })
        .collect()
}

fn sync(path: &Path, action: &'static str) -> Result<()> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|source| Error::File {
            action,
            path: path.to_path_buf(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
    use candle_nn::{linear, Linear, Module, Optimizer, VarBuilder};

    fn temp(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("cp-train-{}-{name}", std::process::id()))
    }

    /// Two linear layers (`fc1.weight`, ..., `fc2.bias`), freshly and randomly initialised.
    fn model(varmap: &VarMap) -> Result<(Linear, Linear)> {
        let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
        Ok((linear(3, 4, vb.pp("fc1"))?, linear(4, 2, vb.pp("fc2"))?))
    }

    fn train(m: &(Linear, Linear), opt: &mut impl Optimizer, steps: std::ops::Range<usize>) {
        for s in steps {
            let x = ((Tensor::arange(0f32, 15., &Device::Cpu).unwrap() * 0.37).unwrap() + s as f64)
                .unwrap()
                .sin()
                .unwrap()
                .reshape((5, 3))
                .unwrap();
            let y =
                m.1.forward(&m.0.forward(&x).unwrap().tanh().unwrap())
                    .unwrap();
            opt.backward_step(&y.sqr().unwrap().mean_all().unwrap())
                .unwrap();
        }
    }

    fn values(varmap: &VarMap) -> std::collections::BTreeMap<String, Vec<f32>> {
        lock(varmap.data())
            .iter()
            .map(|(n, v)| (n.clone(), v.flatten_all().unwrap().to_vec1().unwrap()))
            .collect()
    }

    /// Trains 3 steps, saves, trains 4 more; loads the file into a fresh model and optimizer
    /// (its variables in another order) and trains the same 4 steps there.
    fn resumes_bit_for_bit<O: ElementwiseOptimizer>(config: O::Config, file: &str) -> Result<()>
    where
        O::Config: Clone,
    {
        let path = temp(file);
        let varmap = VarMap::new();
        let m = model(&varmap)?;
        let mut opt = O::new(varmap.all_vars(), config.clone())?;
        train(&m, &mut opt, 0..3);
        save_training_state(&varmap, &opt, &path)?;
        train(&m, &mut opt, 3..7);

        let fresh = VarMap::new();
        let m2 = model(&fresh)?;
        let mut vars = fresh.all_vars();
        vars.reverse();
        let mut opt2 = O::new(vars, config)?;
        load_training_state(&fresh, &mut opt2, &path)?;
        train(&m2, &mut opt2, 3..7);
        assert_eq!(values(&varmap), values(&fresh));

        // The weights alone, as VarMap::load reads them.
        let mut weights = VarMap::new();
        model(&weights)?;
        weights.load(&path)?;
        assert_eq!(weights.data().lock().unwrap().len(), 4);
        std::fs::remove_file(path).unwrap();
        Ok(())
    }

    #[test]
    fn an_adamw_training_state_resumes_bit_for_bit() -> Result<()> {
        let config = AdamWConfig {
            lr: 0.01,
            amsgrad: true,
            ..Default::default()
        };
        resumes_bit_for_bit::<AdamW>(config, "adamw.safetensors")
    }

    #[test]
    fn an_sgd_training_state_resumes_bit_for_bit() -> Result<()> {
        let config = SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            ..Default::default()
        };
        resumes_bit_for_bit::<Sgd>(config, "sgd.safetensors")
    }

    #[test]
    fn the_file_holds_the_documented_keys() -> Result<()> {
        let path = temp("keys.safetensors");
        let varmap = VarMap::new();
        let m = model(&varmap)?;
        let mut opt = AdamW::new(varmap.all_vars(), Default::default())?;
        train(&m, &mut opt, 0..2);
        save_training_state(&varmap, &opt, &path)?;
        let t = candle_core::safetensors::load(&path, &Device::Cpu)?;
        assert_eq!(t["optimizer.step"].dtype(), DType::F64);
        assert_eq!(t["optimizer.step"].to_scalar::<f64>()?, 2.0);
        assert_eq!(t["optimizer.state.fc1.weight.exp_avg_sq"].dims(), [4, 3]);
        assert_eq!(t["optimizer.state.fc2.bias.exp_avg"].dims(), [2]);
        assert_eq!(t.len(), 4 + 4 * 2 + 1);
        std::fs::remove_file(path).unwrap();
        Ok(())
    }

    #[test]
    fn missing_keys_are_named_with_the_file() -> Result<()> {
        let varmap = VarMap::new();
        let m = model(&varmap)?;
        let mut opt = AdamW::new(varmap.all_vars(), Default::default())?;
        train(&m, &mut opt, 0..1);
        let weights_only = temp("weights.safetensors");
        save_varmap(&varmap, &weights_only)?;
        match load_training_state(&varmap, &mut opt, &weights_only) {
            Err(Error::Checkpoint { key, path, .. }) => {
                assert_eq!(
                    (key.as_str(), path),
                    ("optimizer.step", weights_only.clone())
                )
            }
            other => panic!("{other:?}"),
        }

        let names = var_names(&varmap, opt.vars())?;
        let mut tensors = optimizer_tensors(&names, &opt.state())?;
        tensors.remove("optimizer.state.fc2.weight.exp_avg");
        let incomplete = temp("incomplete.safetensors");
        for (n, v) in lock(varmap.data()).iter() {
            tensors.insert(n.clone(), v.as_tensor().clone());
        }
        save(&tensors, &incomplete)?;
        let err = load_training_state(&varmap, &mut opt, &incomplete).unwrap_err();
        assert!(
            matches!(&err, Error::Checkpoint { key, .. }
                if key == "optimizer.state.fc2.weight.exp_avg"),
            "{err}"
        );
        assert!(err.to_string().contains("incomplete.safetensors"), "{err}");

        tensors.remove("fc1.bias");
        save(&tensors, &incomplete)?;
        let err = load_training_state(&varmap, &mut opt, &incomplete).unwrap_err();
        assert!(
            matches!(&err, Error::Checkpoint { key, .. } if key == "fc1.bias"),
            "{err}"
        );
        std::fs::remove_file(weights_only).unwrap();
        std::fs::remove_file(incomplete).unwrap();
        Ok(())
    }

    #[test]
    fn an_optimizer_variable_outside_the_varmap_is_refused() -> Result<()> {
        let varmap = VarMap::new();
        model(&varmap)?;
        let mut vars = varmap.all_vars();
        vars.push(Var::zeros((2, 5), DType::F32, &Device::Cpu)?);
        let opt = Sgd::new(vars, Default::default())?;
        let err = save_training_state(&varmap, &opt, temp("never.safetensors")).unwrap_err();
        assert!(
            matches!(&err, Error::VariableNotInVarMap { index: 4, shape } if shape == &[2, 5]),
            "{err}"
        );
        Ok(())
    }

    #[test]
    fn a_save_removes_what_dead_processes_left_and_keeps_what_live_ones_write() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("cp-leftover-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.safetensors");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        // Killed and waited for when dropped, whatever the test does.
        struct Live(std::process::Child);
        impl Drop for Live {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let live = Live(
            std::process::Command::new("sleep")
                .arg("5")
                .spawn()
                .unwrap(),
        );
        let left = temporary(&path, dead).unwrap();
        let busy = temporary(&path, live.0.id()).unwrap();
        let other = temporary(&dir.join("other.safetensors"), dead).unwrap();
        for f in [&left, &busy, &other] {
            std::fs::write(f, b"partial").unwrap();
        }
        let mut tensors = HashMap::new();
        tensors.insert("a".to_string(), Tensor::new(&[1f32, 2.], &Device::Cpu)?);
        save(&tensors, &path)?;
        assert!(!left.exists(), "a dead process's temporary file stayed");
        assert!(
            busy.exists() && other.exists(),
            "another save's file was removed"
        );
        drop(live);
        std::fs::remove_dir_all(dir).unwrap();
        Ok(())
    }

    #[test]
    fn a_weight_of_another_dtype_is_refused_unless_the_conversion_is_asked_for() -> Result<()> {
        let varmap = VarMap::new();
        let m = model(&varmap)?;
        let mut opt = AdamW::new(varmap.all_vars(), Default::default())?;
        train(&m, &mut opt, 0..1);
        let path = temp("dtype.safetensors");
        let names = var_names(&varmap, opt.vars())?;
        let mut tensors = optimizer_tensors(&names, &opt.state())?;
        for (n, v) in lock(varmap.data()).iter() {
            tensors.insert(n.clone(), v.as_tensor().clone());
        }
        let bias = tensors["fc1.bias"].to_dtype(DType::F64)?;
        tensors.insert("fc1.bias".into(), bias);
        save(&tensors, &path)?;
        let err = load_training_state(&varmap, &mut opt, &path).unwrap_err();
        assert!(
            err.to_string()
                .contains("`fc1.bias` is F64 in the file and F32 in the model"),
            "{err}"
        );
        let options = LoadOptions {
            convert_dtypes: true,
        };
        load_training_state_with(&varmap, &mut opt, &path, options)?;
        std::fs::remove_file(path).unwrap();
        Ok(())
    }

    #[test]
    fn a_failed_save_keeps_the_old_file_and_leaves_no_temporary() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("cp-ckpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.safetensors");
        let mut tensors = HashMap::new();
        tensors.insert("a".to_string(), Tensor::new(&[1f32, 2.], &Device::Cpu)?);
        save(&tensors, &path)?;
        // A directory where the file should be makes the rename fail.
        let blocked = dir.join("blocked.safetensors");
        std::fs::create_dir_all(blocked.join("inside")).unwrap();
        assert!(matches!(save(&tensors, &blocked), Err(Error::File { .. })));
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.contains(".tmp-"))
            .collect();
        assert!(left.is_empty(), "temporary files left: {left:?}");
        let loaded = candle_core::safetensors::load(&path, &Device::Cpu)?;
        assert_eq!(loaded["a"].to_vec1::<f32>()?, [1., 2.]);
        std::fs::remove_dir_all(dir).unwrap();
        Ok(())
    }
}
