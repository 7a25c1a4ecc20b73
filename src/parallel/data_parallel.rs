//! `DataParallel`: one model, one batch, every device.
//!
//! The master variables live in the user's `VarMap` on `devices[0]`. Each forward scatters the
//! batch along `dim` ([`comm::scatter`]), builds one replica per chunk from the master variables
//! copied to the chunk's device ([`replicate`](crate::parallel::replicate)), runs the replicas on a thread
//! each ([`parallel_apply`]) and gathers their outputs on the output device ([`comm::gather`]).
//! Autograd sums every replica's gradient into the master variables, so any candle optimizer
//! works unchanged: `opt.backward_step(&loss)`.
//!
//! ```rust
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{linear, VarMap};
//! use candle_parallel::DataParallel;
//! # fn main() -> candle_parallel::Result<()> {
//! let varmap = VarMap::new();
//! let devices = vec![Device::Cpu; 3]; // three logical replicas
//! let model = DataParallel::new(&varmap, devices, |vb| linear(5, 2, vb))?;
//! let x = Tensor::ones((10, 5), DType::F32, &Device::Cpu)?; // chunks of 4, 4 and 2 rows
//! let y = model.forward(&x)?;
//! assert_eq!(y.dims(), [10, 2]);
//! // Same numbers as the plain model.
//! let plain = model.module().forward(&x)?;
//! assert_eq!(y.to_vec2::<f32>()?, plain.to_vec2::<f32>()?);
//! # Ok(()) }
//! ```
//!
//! As in PyTorch: when the batch has fewer rows than there are devices, only as many replicas
//! run as there are chunks; with a single chunk the master model runs alone. In training mode
//! only the master replica's in-place state updates (BatchNorm running statistics) persist. A
//! model that returns a scalar (its loss) gives, over several devices, a vector of one value per
//! replica (gathered along dimension 0, with a warning once through the `log` facade), and over
//! one device its scalar, as `torch.nn.DataParallel` does.

use crate::error::Result;
use crate::parallel::comm;
use crate::parallel::parallel_apply::parallel_apply;
use crate::parallel::replicate::{build_master, replica_var_builder, vars_by_name};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{ModuleT, VarBuilder, VarMap};
use std::sync::atomic::{AtomicBool, Ordering};

/// Options of [`DataParallel`]; `Default` gives PyTorch's defaults.
#[derive(Clone, Debug)]
pub struct DataParallelConfig {
    /// Where outputs are gathered; `None` means `devices[0]`.
    pub output_device: Option<Device>,
    /// The dimension along which inputs are split and outputs joined.
    pub dim: usize,
    /// The dtype the model's `VarBuilder` asks for when it creates variables.
    pub dtype: DType,
}

impl Default for DataParallelConfig {
    fn default() -> Self {
        Self {
            output_device: None,
            dim: 0,
            dtype: DType::F32,
        }
    }
}

type Builder<M> = Box<dyn Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync>;

/// Data parallelism over several devices of one process, as `torch.nn.DataParallel`.
pub struct DataParallel<M> {
    module: M,
    varmap: VarMap,
    var_names: Vec<String>,
    devices: Vec<Device>,
    output_device: Device,
    dim: usize,
    dtype: DType,
    build: Builder<M>,
    /// Whether the warning about scalar outputs was given.
    warned_scalars: AtomicBool,
}

impl<M> DataParallel<M> {
    /// Wraps the model that `build` constructs, replicated over `devices` with default options.
    ///
    /// `build` is called once here on `devices[0]` to create the master model (and any variable
    /// the `VarMap` lacks), then once per replica and forward pass.
    pub fn new<F>(varmap: &VarMap, devices: Vec<Device>, build: F) -> Result<Self>
    where
        F: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
    {
        Self::with_config(varmap, devices, DataParallelConfig::default(), build)
    }

    /// As [`DataParallel::new`], with options.
    pub fn with_config<F>(
        varmap: &VarMap,
        devices: Vec<Device>,
        config: DataParallelConfig,
        build: F,
    ) -> Result<Self>
    where
        F: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
    {
        let master_device = devices.first().ok_or(crate::Error::NoDevices)?.clone();
        let (module, var_names) = build_master(varmap, config.dtype, &master_device, &build)?;
        Ok(Self {
            module,
            varmap: varmap.clone(),
            var_names,
            output_device: config.output_device.unwrap_or(master_device),
            devices,
            dim: config.dim,
            dtype: config.dtype,
            build: Box::new(build),
            warned_scalars: AtomicBool::new(false),
        })
    }

    /// The master model on `devices[0]` (PyTorch's `.module`): evaluate or save it directly.
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The devices replicas run on, in order.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// The device outputs are gathered on.
    pub fn output_device(&self) -> &Device {
        &self.output_device
    }

    /// The dimension inputs are split along.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The `VarMap` holding the master variables.
    pub fn varmap(&self) -> &VarMap {
        &self.varmap
    }

    /// The names of the model's variables, sorted: the order every collective uses (as
    /// `DistributedDataParallel::parameter_names`).
    pub fn parameter_names(&self) -> &[String] {
        &self.var_names
    }

    /// The old name of [`DataParallel::parameter_names`].
    #[deprecated(
        since = "0.1.0",
        note = "use `parameter_names`, as DistributedDataParallel has"
    )]
    pub fn var_names(&self) -> &[String] {
        self.parameter_names()
    }

    /// The model's master variables, in [`DataParallel::parameter_names`] order: pass them to
    /// an optimizer (as `DistributedDataParallel::parameters`).
    pub fn parameters(&self) -> Vec<Var> {
        vars_by_name(&self.varmap, &self.var_names)
    }

    /// The old name of [`DataParallel::parameters`].
    #[deprecated(
        since = "0.1.0",
        note = "use `parameters`, as DistributedDataParallel has"
    )]
    pub fn vars(&self) -> Vec<Var> {
        self.parameters()
    }

    /// Scatter, replicate, apply `f` in parallel, gather.
    fn run<F>(&self, xs: &Tensor, f: F) -> Result<Tensor>
    where
        F: Fn(&M, &Tensor) -> candle_core::Result<Tensor> + Sync,
    {
        let inputs = comm::scatter(xs, &self.devices, self.dim)?;
        // Only the master model stays on this thread; replicas are built where they run.
        let (varmap, devices, build, dtype) =
            (&self.varmap, &self.devices, &self.build, self.dtype);
        let outputs = parallel_apply(
            &inputs,
            devices,
            |x| f(&self.module, x),
            |i, x| f(&build(replica_var_builder(varmap, dtype, &devices[i]))?, x),
        )?;
        if outputs.iter().all(|t| t.rank() == 0) && self.dim == 0 {
            return self.gather_scalars(outputs);
        }
        comm::gather(&outputs, &self.output_device, self.dim)
    }

    /// torch's `Gather` of scalar outputs (a model that returns its loss): over one device the
    /// master's scalar as it is; otherwise each scalar as a vector of one value, gathered into
    /// one value per replica, with a warning (once).
    fn gather_scalars(&self, outputs: Vec<Tensor>) -> Result<Tensor> {
        if let ([out], 1) = (outputs.as_slice(), self.devices.len()) {
            return Ok(out.clone());
        }
        if !self.warned_scalars.swap(true, Ordering::Relaxed) {
            log::warn!(
                "DataParallel: the model returned scalars, which cannot be gathered along \
                 dimension 0; each is taken as a vector of one value, so the output holds one \
                 value per replica (torch does the same): reduce it, e.g. with mean_all(), \
                 before backward (said once)"
            );
        }
        let vectors = outputs
            .iter()
            .map(|t| t.unsqueeze(0))
            .collect::<candle_core::Result<Vec<_>>>()?;
        comm::gather(&vectors, &self.output_device, 0)
    }
}

impl<M: ModuleT> DataParallel<M> {
    /// The forward pass in training (`train = true`) or evaluation mode.
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        self.run(xs, |m, x| m.forward_t(x, train))
    }
}

impl<M: candle_core::Module> candle_core::Module for DataParallel<M> {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.run(xs, |m, x| m.forward(x))
            .map_err(crate::Error::into_candle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use candle_core::Module;
    use candle_nn::linear;

    #[test]
    fn configuration_errors_are_typed() -> Result<()> {
        let varmap = VarMap::new();
        let err = DataParallel::new(&varmap, vec![], |vb| linear(2, 2, vb)).err();
        assert!(matches!(err, Some(Error::NoDevices)));
        let dp = DataParallel::new(&varmap, vec![Device::Cpu; 2], |vb| linear(2, 2, vb))?;
        let empty = Tensor::zeros((0, 2), DType::F32, &Device::Cpu)?;
        assert!(matches!(
            dp.forward_t(&empty, false),
            Err(Error::EmptyBatch { .. })
        ));
        let config = DataParallelConfig {
            dim: 3,
            ..Default::default()
        };
        let dp = DataParallel::with_config(&varmap, vec![Device::Cpu; 2], config, |vb| {
            linear(2, 2, vb)
        })?;
        let x = Tensor::zeros((4, 2), DType::F32, &Device::Cpu)?;
        assert!(matches!(
            dp.forward_t(&x, false),
            Err(Error::DimOutOfRange { dim: 3, .. })
        ));
        // Through candle's Module trait the typed error survives as the wrapped source.
        let err = dp.forward(&x).unwrap_err();
        assert!(
            err.to_string().contains("dimension 3 is out of range"),
            "{err}"
        );
        Ok(())
    }

    #[test]
    fn a_failing_replica_names_its_index_and_device() -> Result<()> {
        let varmap = VarMap::new();
        // The model rejects chunks of fewer than 3 rows: 10 rows on 3 devices gives 4, 4, 2.
        struct Picky(candle_nn::Linear);
        impl Module for Picky {
            fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
                if x.dim(0)? < 3 {
                    candle_core::bail!("chunk of {} rows is too small", x.dim(0)?)
                }
                self.0.forward(x)
            }
        }
        let dp = DataParallel::new(&varmap, vec![Device::Cpu; 3], |vb| {
            Ok(Picky(linear(2, 2, vb)?))
        })?;
        let x = Tensor::zeros((10, 2), DType::F32, &Device::Cpu)?;
        let err = dp.forward_t(&x, true).unwrap_err();
        assert!(matches!(err, Error::Replica { index: 2, .. }), "{err}");
        assert!(err.to_string().contains("replica 2 on cpu failed"), "{err}");
        assert!(err.to_string().contains("chunk of 2 rows"), "{err}");
        Ok(())
    }

    /// A model that returns its loss: over several devices, a vector of one loss per replica
    /// (torch unsqueezes the scalars and warns), whose mean trains as the whole batch's loss
    /// would; over one device the scalar itself.
    #[test]
    fn scalar_outputs_gather_into_one_value_per_replica() -> Result<()> {
        struct Loss(candle_nn::Linear);
        impl ModuleT for Loss {
            fn forward_t(&self, x: &Tensor, _: bool) -> candle_core::Result<Tensor> {
                candle_nn::Module::forward(&self.0, x)?.sqr()?.mean_all()
            }
        }
        let varmap = VarMap::new();
        let x = Tensor::arange(0f32, 20.0, &Device::Cpu)?.reshape((10, 2))?;
        for (devices, want) in [(3, vec![3]), (1, vec![])] {
            let dp = DataParallel::new(&varmap, vec![Device::Cpu; devices], |vb| {
                Ok(Loss(linear(2, 2, vb)?))
            })?;
            let y = dp.forward_t(&x, true)?;
            assert_eq!(y.dims(), want, "{devices} devices");
            let grads = y.mean_all()?.backward()?;
            assert!(dp.parameters().iter().all(|v| grads.get(v).is_some()));
        }
        // 10 rows on 3 devices: chunks of 4, 4 and 2, each replica's mean loss.
        let dp = DataParallel::new(&varmap, vec![Device::Cpu; 3], |vb| {
            Ok(Loss(linear(2, 2, vb)?))
        })?;
        let y = dp.forward_t(&x, true)?.to_vec1::<f32>()?;
        let plain = |rows: std::ops::Range<usize>| -> Result<f32> {
            Ok(dp
                .module()
                .forward_t(&x.narrow(0, rows.start, rows.len())?, true)?
                .to_scalar()?)
        };
        assert_eq!(y, [plain(0..4)?, plain(4..8)?, plain(8..10)?]);
        Ok(())
    }

    #[test]
    fn vars_come_in_sorted_name_order() -> Result<()> {
        let varmap = VarMap::new();
        let dp = DataParallel::new(&varmap, vec![Device::Cpu], |vb| {
            let a = linear(2, 3, vb.pp("z"))?;
            let b = linear(3, 1, vb.pp("a"))?;
            Ok((a, b))
        })?;
        assert_eq!(
            dp.parameter_names(),
            ["a.bias", "a.weight", "z.bias", "z.weight"]
        );
        let dims: Vec<Vec<usize>> = dp.parameters().iter().map(|v| v.dims().to_vec()).collect();
        assert_eq!(dims, [vec![1], vec![1, 3], vec![3], vec![3, 2]]);
        Ok(())
    }
}
