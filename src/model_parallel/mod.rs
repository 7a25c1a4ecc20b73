//! Model parallel inside one process: a model cut into stages, each on a device of its own
//! (PyTorch's "Single-Machine Model Parallel Best Practices": `ModelParallelResNet50` and
//! `PipelineParallelResNet50`).
//!
//! When a model does not fit one GPU, its parts go on different GPUs of one process: the
//! forward moves the activations from each part's device to the next's (between CUDA devices,
//! copies ordered on both streams as torch orders them), and a backward from the output flows
//! back through every part, each variable's gradient landing on its own device. The numbers are
//! the one-device model's. Alone this keeps one device busy at a time;
//! [`ModelParallel::with_split_size`] cuts each batch into micro-batches and runs every stage on
//! a thread of its own, so that the stages work at once (a pipeline).
//!
//! The tutorial's `ToyModel` (net1 on `cuda:0`, net2 on `cuda:1`), converted; here both
//! "devices" are the CPU, as in the tests:
//!
//! ```rust
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{linear, loss, Optimizer, VarBuilder, VarMap};
//! use candle_parallel::model_parallel::{ModelParallel, Stage};
//! use candle_parallel::optim::{Sgd, SgdConfig};
//! # fn main() -> candle_parallel::Result<()> {
//! let (dev0, dev1) = (Device::Cpu, Device::Cpu); // Device::new_cuda(0)?, Device::new_cuda(1)?
//! let varmap = VarMap::new();
//! let vb = |device: &Device| VarBuilder::from_varmap(&varmap, DType::F32, device);
//! let net1 = linear(10, 10, vb(&dev0).pp("net1"))?;
//! let net2 = linear(10, 5, vb(&dev1).pp("net2"))?;
//! let model = ModelParallel::new(vec![
//!     Stage::new(&dev0, move |x: &Tensor| net1.forward(x)?.relu()),
//!     Stage::new(&dev1, net2),
//! ])?;
//! let mut opt = Sgd::new(varmap.all_vars(), SgdConfig { lr: 0.001, ..Default::default() })?;
//! let x = Tensor::randn(0f32, 1., (20, 10), &dev0)?;
//! let labels = Tensor::randn(0f32, 1., (20, 5), &dev1)?;
//! let out = model.forward(&x)?; // on dev1
//! opt.backward_step(&loss::mse(&out, &labels)?)?;
//!
//! // Pipelined: micro-batches of 5 rows, both stages at work at once.
//! let model = model.with_split_size(5)?;
//! let out = model.forward(&x)?;
//! assert_eq!(out.dims(), [20, 5]);
//! opt.backward_step(&loss::mse(&out, &labels)?)?;
//! # Ok(()) }
//! ```
//!
//! Pieces: [`model`] (the model), [`stage`] (a part and its device), `pipeline` (the threads of
//! the pipelined forward), [`micro_batch`] (how a batch is cut).

pub mod micro_batch;
pub mod model;
mod pipeline;
pub mod stage;

pub use model::ModelParallel;
pub use stage::Stage;
