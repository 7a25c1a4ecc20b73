//! Saving model variables, and whole training states, as safetensors, atomically.
//!
//! A checkpoint is written to a temporary file beside its destination, flushed to disk, and
//! renamed over the destination, so a crash or a full disk never leaves a half-written
//! checkpoint under the real name: readers see the old file or the new one.
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

pub mod resume;

use crate::error::{Error, Result};
use crate::optim::{ElementwiseOptimizer, OptimizerState};
use crate::util::sync::lock;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;

/// Saves every variable of `varmap` under its name to `path`, atomically.
pub fn save_varmap(varmap: &VarMap, path: impl AsRef<Path>) -> Result<()> {
    let tensors: HashMap<String, Tensor> = lock(varmap.data())
        .iter()
        .map(|(name, var)| (name.clone(), var.as_tensor().clone()))
        .collect();
    save(&tensors, path)
}

/// Saves `tensors` to `path` in the safetensors format, atomically. Tensors on GPUs are copied
/// to the host first.
pub fn save(tensors: &HashMap<String, Tensor>, path: impl AsRef<Path>) -> Result<()> {
    let host: HashMap<&str, Tensor> = tensors
        .iter()
        .map(|(k, t)| Ok((k.as_str(), t.to_device(&Device::Cpu)?)))
        .collect::<Result<_>>()?;
    write_atomically(path.as_ref(), |tmp| {
        Ok(candle_core::safetensors::save(&host, tmp)?)
    })
}

/// Writes the file at `path` atomically: `write` fills a temporary file beside it, which is
/// flushed to disk and renamed over `path`, and the folder is synced so that the rename lasts.
/// On failure the temporary file is removed and `path` is untouched.
pub(crate) fn write_atomically(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let file_name = path.file_name().ok_or_else(|| Error::InvalidArgument {
        what: "checkpoint path",
        detail: format!("{} does not name a file", path.display()),
    })?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(file_name);
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
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
    written?;
    // Make the rename itself durable.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        let _ = std::fs::File::open(dir).and_then(|d| d.sync_all());
    }
    Ok(())
}

/// The prefix of every optimizer key in a training-state checkpoint.
const OPTIMIZER: &str = "optimizer.";
/// The prefix of the per-variable state tensors' keys.
const OPTIMIZER_STATE: &str = "optimizer.state.";

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

/// Reads every tensor of the safetensors file at `path` onto the CPU: an I/O failure is
/// [`Error::File`], contents that are not safetensors [`Error::Checkpoint`].
pub(crate) fn read(path: &Path) -> Result<HashMap<String, Tensor>> {
    let bytes = std::fs::read(path).map_err(|source| Error::File {
        action: "reading",
        path: path.to_path_buf(),
        source,
    })?;
    candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).map_err(|e| Error::Checkpoint {
        key: String::new(),
        path: path.to_path_buf(),
        detail: format!("not a safetensors file: {e}"),
    })
}

/// Loads a training state saved by [`save_training_state`] into `varmap`'s variables and into
/// `opt`, whose variables must be `varmap`'s (in any order: the state follows the names).
/// Every variable of `varmap` and every scalar `opt` keeps must be in the file; nothing is
/// changed unless all of it fits. Weights of another dtype are converted (and said so through
/// the `log` facade); optimizer state is converted to the dtype the optimizer keeps it in.
pub fn load_training_state(
    varmap: &VarMap,
    opt: &mut impl ElementwiseOptimizer,
    path: impl AsRef<Path>,
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
        if t.dtype() != var.dtype() {
            log::warn!(
                "{}: `{name}` is {:?}, the variable {:?}: converting",
                path.display(),
                t.dtype(),
                var.dtype()
            );
        }
        weights.push(t.to_device(var.device())?.to_dtype(var.dtype())?);
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
fn var_names(varmap: &VarMap, vars: &[Var]) -> Result<Vec<String>> {
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
