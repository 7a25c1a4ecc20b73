//! Saving model variables as safetensors, atomically.
//!
//! A checkpoint is written to a temporary file beside its destination, flushed to disk, and
//! renamed over the destination, so a crash or a full disk never leaves a half-written
//! checkpoint under the real name: readers see the old file or the new one.
//!
//! ```rust
//! use candle_core::{DType, Device};
//! use candle_nn::{linear, VarBuilder, VarMap};
//! use candle_parallel::checkpoint;
//! # fn main() -> candle_parallel::Result<()> {
//! let varmap = VarMap::new();
//! linear(3, 2, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
//! let path = std::env::temp_dir().join(format!("doc-{}.safetensors", std::process::id()));
//! checkpoint::save_varmap(&varmap, &path)?;
//! let loaded = candle_core::safetensors::load(&path, &Device::Cpu)?;
//! assert_eq!(loaded["weight"].dims(), [2, 3]);
//! # std::fs::remove_file(&path).unwrap();
//! # Ok(()) }
//! ```

use crate::error::{Error, Result};
use crate::util::sync::lock;
use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use std::collections::HashMap;
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
    let path = path.as_ref();
    let file_name = path.file_name().ok_or_else(|| Error::InvalidArgument {
        what: "checkpoint path",
        detail: format!("{} does not name a file", path.display()),
    })?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(file_name);
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let host: HashMap<&str, Tensor> = tensors
        .iter()
        .map(|(k, t)| Ok((k.as_str(), t.to_device(&Device::Cpu)?)))
        .collect::<Result<_>>()?;
    let written = candle_core::safetensors::save(&host, &tmp)
        .map_err(Error::from)
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
