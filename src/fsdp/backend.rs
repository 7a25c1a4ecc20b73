//! The `VarBuilder`s FullyShardedDataParallel builds the model through: at construction one
//! that records what each unit (and the root) asks for, with its initial value; at each use one
//! that serves the gathered tensors.
//!
//! Buffers (running statistics, and every variable that is not a float) are not sharded: they
//! are the `VarMap`'s own variables, served as themselves so that a layer's in-place updates
//! (candle-nn's BatchNorm) land in them, once per forward: a backward's recomputation is
//! served copies.

use crate::init::seeded_values;
use crate::util::sync::lock;
use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Where initial values come from: the `VarMap`'s variable of that name when it has one, else
/// the builder's `Init` hint, drawn from `seed` and the name when there is a seed (the values
/// `init::seeded_var_builder` gives); and which variables are buffers.
pub(crate) struct Source {
    pub varmap: VarMap,
    pub seed: Option<u64>,
    /// Names (last path component) of buffers of a float dtype.
    pub buffer_names: Vec<String>,
}

impl Source {
    /// Whether the variable `name` of `dtype` is a buffer: named as one, or not a float.
    pub fn is_buffer(&self, name: &str, dtype: DType) -> bool {
        let last = name.rsplit('.').next().unwrap_or(name);
        !dtype.is_float() || self.buffer_names.iter().any(|b| b == last)
    }

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
        self.fresh(shape, name, init, dtype, device)
    }

    /// A new initial value for `name`.
    fn fresh(
        &self,
        shape: Shape,
        name: &str,
        init: Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        match self.seed {
            Some(seed) => {
                Tensor::from_vec(seeded_values(init, &shape, name, seed), shape, &Device::Cpu)?
                    .to_dtype(dtype)?
                    .to_device(device)
            }
            None => Ok(init.var(shape, dtype, device)?.as_tensor().clone()),
        }
    }

    /// The buffer `name`: the `VarMap`'s variable, created (with its initial value) when the
    /// `VarMap` lacks it.
    fn buffer(
        &self,
        shape: Shape,
        name: &str,
        init: Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Var> {
        let mut vars = lock(self.varmap.data());
        if let Some(var) = vars.get(name) {
            if var.shape() != &shape || var.dtype() != dtype {
                candle_core::bail!(
                    "buffer {name}: the model asks for {shape:?} {dtype:?}, the VarMap has {:?} \
                     {:?}",
                    var.shape(),
                    var.dtype()
                );
            }
            return Ok(var.clone());
        }
        let var = Var::from_tensor(&self.fresh(shape, name, init, dtype, device)?)?;
        vars.insert(name.to_string(), var.clone());
        Ok(var)
    }
}

/// What a recording saw, in the order first asked for: the parameters with their initial
/// values, and the buffers.
#[derive(Default)]
pub(crate) struct Recorded {
    pub params: Vec<(String, Tensor)>,
    pub buffers: Vec<(String, Var)>,
}

/// The variables recorded, and each name's place (`Ok`: a parameter, `Err`: a buffer).
type Seen = (Recorded, HashMap<String, std::result::Result<usize, usize>>);

/// Records the variables asked for, in order (a name asked for twice, tied weights, is one
/// variable): parameters with their initial value from the [`Source`], buffers as the
/// `VarMap`'s variables.
#[derive(Clone)]
pub(crate) struct Recording {
    source: Arc<Source>,
    seen: Arc<Mutex<Seen>>,
}

impl Recording {
    pub fn new(source: Arc<Source>) -> Self {
        Self {
            source,
            seen: Arc::new(Mutex::new(Default::default())),
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
    pub fn take(&self) -> Recorded {
        let mut seen = lock(&self.seen);
        seen.1.clear();
        std::mem::take(&mut seen.0)
    }

    /// What was recorded under `name` before, checked against `shape` when given.
    fn known(&self, name: &str, shape: Option<&Shape>) -> candle_core::Result<Option<Tensor>> {
        let seen = lock(&self.seen);
        let t = match seen.1.get(name) {
            Some(Ok(i)) => seen.0.params[*i].1.clone(),
            Some(Err(i)) => seen.0.buffers[*i].1.as_tensor().clone(),
            None => return Ok(None),
        };
        if let Some(s) = shape.filter(|s| t.shape() != *s) {
            candle_core::bail!(
                "shape mismatch on {name}: asked for {s:?}, and before for {:?}",
                t.shape()
            );
        }
        Ok(Some(t))
    }

    fn record_param(&self, name: &str, t: Tensor) -> Tensor {
        let mut seen = lock(&self.seen);
        let i = seen.0.params.len();
        seen.0.params.push((name.to_string(), t.clone()));
        seen.1.insert(name.to_string(), Ok(i));
        t
    }

    fn record_buffer(&self, name: &str, var: Var) -> Tensor {
        let mut seen = lock(&self.seen);
        let i = seen.0.buffers.len();
        let t = var.as_tensor().clone();
        seen.0.buffers.push((name.to_string(), var));
        seen.1.insert(name.to_string(), Err(i));
        t
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
        if let Some(t) = self.known(name, Some(&s))? {
            return Ok(t);
        }
        if self.source.is_buffer(name, dtype) {
            let var = self.source.buffer(s, name, h, dtype, dev)?;
            return Ok(self.record_buffer(name, var));
        }
        let t = self.source.value(s, name, h, dtype, dev)?;
        Ok(self.record_param(name, t))
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        if let Some(t) = self.known(name, None)? {
            return Ok(t);
        }
        let var = lock(self.source.varmap.data()).get(name).cloned();
        match var {
            Some(var) if self.source.is_buffer(name, var.dtype()) => {
                Ok(self.record_buffer(name, var))
            }
            Some(var) => {
                let t = var.as_tensor().copy()?;
                Ok(self.record_param(name, t))
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

/// How a use of a unit gets the buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Buffers {
    /// The variables themselves: a training forward's updates land in them.
    Live,
    /// Copies: a backward's recomputation updates nothing.
    Copied,
}

/// A `VarBuilder` serving `tensors` (full names) and `buffers` at `prefix`.
///
/// Parameters come in `dtype` (the compute dtype); buffers come as they are, whatever the
/// builder is asked for: a BatchNorm under bf16 mixed precision keeps its running statistics
/// in f32 and updates the variables themselves (torch's mixed precision leaves buffers alone).
pub(crate) fn serving(
    names: &[String],
    tensors: Vec<Tensor>,
    buffers: &[(String, Var)],
    how: Buffers,
    prefix: &str,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<VarBuilder<'static>> {
    let params = names.iter().cloned().zip(tensors).collect();
    let mut served = HashMap::new();
    for (name, var) in buffers {
        let t = match how {
            Buffers::Live => var.as_tensor().clone(),
            Buffers::Copied => var.as_tensor().copy()?,
        };
        served.insert(name.clone(), t);
    }
    let backend = Serving {
        params,
        buffers: served,
    };
    Ok(at_prefix(
        VarBuilder::from_backend(Box::new(backend), dtype, device.clone()),
        prefix,
    ))
}

/// The backend of [`serving`].
struct Serving {
    params: HashMap<String, Tensor>,
    buffers: HashMap<String, Tensor>,
}

impl Serving {
    fn find(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        if let Some(t) = self.buffers.get(name) {
            return Ok(t.clone());
        }
        match self.params.get(name) {
            Some(t) => t.to_device(dev)?.to_dtype(dtype),
            None => Err(candle_core::Error::CannotFindTensor {
                path: name.to_string(),
            }
            .bt()),
        }
    }
}

impl SimpleBackend for Serving {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.find(name, dtype, dev)?;
        if t.shape() != &s {
            return Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name}"),
                expected: s,
                got: t.shape().clone(),
            }
            .bt());
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.find(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.params.contains_key(name) || self.buffers.contains_key(name)
    }
}

/// `vb` at `prefix` ("" is the root, where `pp("")` would add an empty path component).
fn at_prefix(vb: VarBuilder<'static>, prefix: &str) -> VarBuilder<'static> {
    if prefix.is_empty() {
        vb
    } else {
        vb.pp(prefix)
    }
}
