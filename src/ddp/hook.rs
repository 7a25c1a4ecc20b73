//! Where DistributedDataParallel learns that a gradient is ready, and how the model is built so
//! that it does.
//!
//! candle has no gradient hooks, but its backward pass walks the graph in topological order, so
//! a custom op's `bwd` runs once, after every use of the op's output has contributed, with the
//! output's complete gradient. [`GradReady`] is such an op: an identity around a parameter.
//! The model is built (by the user's constructor, through [`Registry`], a `VarBuilder` backend)
//! over these identities instead of the variables themselves; in backward each parameter's
//! `GradReady` hands the reducer its gradient the moment it is complete.
//!
//! A custom op cannot return storage shared with its input, so the identity's output is a copy
//! of the variable: [`Registry`] keeps the copies so that DDP refreshes them in place from the
//! variables before each forward (after the optimizer changed them). Buffers (BatchNorm's
//! running statistics) are handed out as the `VarMap`'s own variables, so their in-place
//! updates persist and checkpoints hold them. An integer variable (an index table read with
//! `get_with_hints_dtype`) is a buffer whatever its name: nothing trains it, and collectives
//! cannot reduce it (torch's parameters are float too). A variable of a dtype no collective
//! carries (f8, f6, f4) is refused, by name.
//!
//! candle adds the copy's gradient to a fresh tensor of zeros (the copy is no variable), two
//! tensors as large as the weight every step. So a copy in the variable's dtype is also
//! watched ([`GradientHook`]): this crate's layers (`nn::linear`, the norms, the convolutions)
//! compute from the variable behind it and hand the variable's gradient to the reducer as they
//! make it, summed with any part candle's ops on the copy sent through `GradReady`, once every
//! part is in. A mixed-precision copy (a cast) is not watched.

use super::reducer::Reducer;
use crate::error::{device_name, Error};
use crate::nn::{self, GradientHook};
use crate::util::sync::lock;
use candle_core::{CpuStorage, DType, Device, Layout, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarMap};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The identity whose backward tells the reducer that parameter `index`'s gradient is ready.
pub(crate) struct GradReady {
    pub index: usize,
    pub reducer: Arc<Reducer>,
    /// The dtype the copy is made in (mixed precision's compute dtype), when not the
    /// variable's: the cast is part of the identity, so that backward stops at the variable.
    pub dtype: Option<DType>,
}

impl candle_core::CustomOp1 for GradReady {
    fn name(&self) -> &'static str {
        "ddp-grad-ready"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        crate::util::pass_through::cpu_as(s, l, self.dtype)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::util::pass_through::cuda_as(s, l, self.dtype)
    }

    /// Hands the gradient to the reducer, which from now on owns it: the variable itself gets
    /// its gradient from `DistributedDataParallel::backward`, averaged over the world. A
    /// watched copy's gradient goes through its [`GradientHook`], which adds the parts this
    /// crate's layers computed from the variable directly.
    fn bwd(&self, _: &Tensor, copy: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        if !nn::copy_gradient(copy, grad) {
            self.reducer.mark_ready(self.index, grad);
        }
        Ok(None)
    }
}

/// What a variable is to DistributedDataParallel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Trained: its gradient is averaged over the world.
    Parameter,
    /// State kept beside the parameters (running statistics, integer tables): broadcast from
    /// rank 0.
    Buffer,
}

impl Kind {
    /// What variable `name` of `dtype` is, `named_buffer` whether its name says buffer; an
    /// error, naming it, for a dtype no collective carries.
    fn of(name: &str, dtype: DType, named_buffer: bool) -> Result<Self, Error> {
        if !super::integers::carried(dtype) {
            return Err(Error::InvalidArgument {
                what: "DDP variable dtype",
                detail: format!(
                    "variable `{name}` is {dtype:?}, which no collective carries: parameters \
                     must be f32, f64, f16 or bf16 and buffers those or an integer dtype; keep \
                     it in one of those and convert where the model uses it"
                ),
            });
        }
        Ok(if named_buffer || dtype.is_int() {
            Self::Buffer
        } else {
            Self::Parameter
        })
    }
}

/// One variable the model asked for, in the order it asked.
#[derive(Clone)]
pub(crate) struct Entry {
    pub name: String,
    pub var: Var,
    pub kind: Kind,
    /// What the model holds: the `GradReady` copy for a parameter, the variable for a buffer.
    pub held: Tensor,
    /// For a parameter whose copy has its dtype: the hook through which this crate's layers
    /// compute from the variable itself and hand its gradient to the reducer as made.
    pub hook: Option<Arc<GradientHook>>,
}

/// The `VarBuilder` backend DDP builds the model through: it takes (or creates) each variable
/// in the `VarMap` and hands out a `GradReady` copy for a parameter, the variable itself for a
/// buffer, and the same tensor again when a name is asked for twice (tied weights).
pub(crate) struct Registry {
    varmap: VarMap,
    device: Device,
    is_buffer: Box<dyn Fn(&str) -> bool + Send + Sync>,
    reducer: Arc<Reducer>,
    /// The dtype parameters compute in (mixed precision), when not their own.
    compute: Option<DType>,
    /// The entries, and each name's position among them.
    entries: Mutex<(Vec<Entry>, HashMap<String, usize>)>,
}

impl Registry {
    pub fn new(
        varmap: &VarMap,
        device: &Device,
        is_buffer: impl Fn(&str) -> bool + Send + Sync + 'static,
        reducer: Arc<Reducer>,
    ) -> Self {
        Self {
            varmap: varmap.clone(),
            device: device.clone(),
            is_buffer: Box::new(is_buffer),
            reducer,
            compute: None,
            entries: Mutex::new((Vec::new(), HashMap::new())),
        }
    }

    /// Hands parameters out as copies in `dtype` (mixed precision's `param_dtype`).
    pub fn compute_in(mut self, dtype: Option<DType>) -> Self {
        self.compute = dtype;
        self
    }

    /// The variables the model asked for, in the order it first asked.
    pub fn entries(&self) -> Vec<Entry> {
        lock(&self.entries).0.clone()
    }

    fn hand_out(&self, name: &str, var: Var) -> candle_core::Result<Tensor> {
        let mut guard = lock(&self.entries);
        let (entries, by_name) = &mut *guard;
        if let Some(&i) = by_name.get(name) {
            return Ok(entries[i].held.clone());
        }
        if !var.device().same_device(&self.device) {
            return Err(Error::VariableNotOnDevice {
                layer: crate::error::DISTRIBUTED_DATA_PARALLEL,
                name: name.to_string(),
                found: device_name(var.device()),
                expected: device_name(&self.device),
            }
            .into_candle());
        }
        let kind =
            Kind::of(name, var.dtype(), (self.is_buffer)(name)).map_err(Error::into_candle)?;
        let (kind, held, hook) = if kind == Kind::Buffer {
            (Kind::Buffer, var.as_tensor().clone(), None)
        } else {
            // Parameters are numbered in the order the model asks for them.
            let index = entries.iter().filter(|e| e.kind == Kind::Parameter).count();
            let cast = self
                .compute
                .filter(|&d| var.dtype().is_float() && var.dtype() != d);
            let op = GradReady {
                index,
                reducer: self.reducer.clone(),
                dtype: cast,
            };
            let held = var.as_tensor().apply_op1(op)?;
            let hook = match cast {
                Some(_) => None,
                None => {
                    let reducer = self.reducer.clone();
                    GradientHook::new(&held, &var, index, move |grad| {
                        reducer.mark_ready(index, &grad)
                    })
                    .map(Arc::new)
                }
            };
            (Kind::Parameter, held, hook)
        };
        by_name.insert(name.to_string(), entries.len());
        entries.push(Entry {
            name: name.to_string(),
            var,
            kind,
            held: held.clone(),
            hook,
        });
        Ok(held)
    }

    fn var(&self, name: &str) -> Option<Var> {
        lock(self.varmap.data()).get(name).cloned()
    }
}

impl SimpleBackend for &Registry {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        self.varmap.get(s, name, h, dtype, dev)?;
        let var = self.var(name).expect("VarMap::get created it");
        self.hand_out(name, var)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        let var = self.var(name).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "variable `{name}` is not in the VarMap: create it first, or ask for it with a \
                 shape"
            ))
        })?;
        self.hand_out(name, var)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        lock(self.varmap.data()).contains_key(name)
    }
}
