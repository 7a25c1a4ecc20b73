//! The `VarBuilder`s FullyShardedDataParallel builds the model through: at construction one
//! that records what each unit (and the root) asks for, with its initial value; at each use one
//! that serves the gathered tensors.

use crate::init::seeded_values;
use crate::util::sync::lock;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Where initial values come from: the `VarMap`'s variable of that name when it has one, else
/// the builder's `Init` hint, drawn from `seed` and the name when there is a seed (the values
/// `init::seeded_var_builder` gives).
pub(crate) struct Source {
    pub varmap: VarMap,
    pub seed: Option<u64>,
}

impl Source {
    fn value(
        &self,
        shape: Shape,
        name: &str,
        init: Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        if let Some(var) = lock(self.varmap.data()).get(name) {
            if var.shape() != &shape {
                candle_core::bail!(
                    "shape mismatch on {name}: the model asks for {shape:?}, the VarMap has {:?}",
                    var.shape()
                );
            }
            // A copy: the VarMap's variable is the user's, never written by the wrapper.
            return var.as_tensor().to_dtype(dtype)?.to_device(device)?.copy();
        }
        match self.seed {
            Some(seed) => {
                Tensor::from_vec(seeded_values(init, &shape, name, seed), shape, &Device::Cpu)?
                    .to_dtype(dtype)?
                    .to_device(device)
            }
            None => Ok(init.var(shape, dtype, device)?.as_tensor().clone()),
        }
    }
}

/// The variables recorded, in order, and each name's position among them.
type Seen = (Vec<(String, Tensor)>, HashMap<String, usize>);

/// Records the variables asked for, in order (a name asked for twice, tied weights, is one
/// variable), each with its initial value from the [`Source`].
#[derive(Clone)]
pub(crate) struct Recording {
    source: Arc<Source>,
    seen: Arc<Mutex<Seen>>,
}

impl Recording {
    pub fn new(source: Arc<Source>) -> Self {
        Self {
            source,
            seen: Arc::new(Mutex::new((Vec::new(), HashMap::new()))),
        }
    }

    /// A `VarBuilder` over this recording, at `prefix`.
    pub fn var_builder(&self, prefix: &str, dtype: DType, device: &Device) -> VarBuilder<'static> {
        at_prefix(
            VarBuilder::from_backend(Box::new(self.clone()), dtype, device.clone()),
            prefix,
        )
    }

    /// The variables recorded, in the order they were first asked for.
    pub fn take(&self) -> Vec<(String, Tensor)> {
        let mut seen = lock(&self.seen);
        seen.1.clear();
        std::mem::take(&mut seen.0)
    }
}

impl SimpleBackend for Recording {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut seen = lock(&self.seen);
        if let Some(&i) = seen.1.get(name) {
            let t = seen.0[i].1.clone();
            if t.shape() != &s {
                candle_core::bail!(
                    "shape mismatch on {name}: asked for {s:?}, and before for {:?}",
                    t.shape()
                );
            }
            return Ok(t);
        }
        let t = self.source.value(s, name, h, dtype, dev)?;
        let i = seen.0.len();
        seen.0.push((name.to_string(), t.clone()));
        seen.1.insert(name.to_string(), i);
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        let seen = lock(&self.seen);
        if let Some(&i) = seen.1.get(name) {
            return Ok(seen.0[i].1.clone());
        }
        drop(seen);
        match lock(self.source.varmap.data()).get(name) {
            Some(var) => {
                let t = var.as_tensor().copy()?;
                let mut seen = lock(&self.seen);
                let i = seen.0.len();
                seen.0.push((name.to_string(), t.clone()));
                seen.1.insert(name.to_string(), i);
                Ok(t)
            }
            None => candle_core::bail!(
                "variable `{name}` is asked for without a shape and is not in the VarMap: \
                 create it first, or ask for it with a shape"
            ),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        lock(&self.seen).1.contains_key(name) || lock(self.source.varmap.data()).contains_key(name)
    }
}

/// A `VarBuilder` serving `tensors` (full names) at `prefix`.
pub(crate) fn serving(
    names: &[String],
    tensors: Vec<Tensor>,
    prefix: &str,
    dtype: DType,
    device: &Device,
) -> VarBuilder<'static> {
    let map: HashMap<String, Tensor> = names.iter().cloned().zip(tensors).collect();
    at_prefix(VarBuilder::from_tensors(map, dtype, device), prefix)
}

/// `vb` at `prefix` ("" is the root, where `pp("")` would add an empty path component).
fn at_prefix(vb: VarBuilder<'static>, prefix: &str) -> VarBuilder<'static> {
    if prefix.is_empty() {
        vb
    } else {
        vb.pp(prefix)
    }
}
