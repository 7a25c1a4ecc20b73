//! `SyncBatchNorm` (`torch.nn.SyncBatchNorm`): the layer, its statistics' collective and its
//! backward. The user-facing documentation is on [`SyncBatchNorm`].

use super::accumulate::{sum_rows, wide};
use crate::distributed::{ProcessGroup, ReduceOp};
use crate::error::Error;
use crate::util::sync::lock;
use candle_core::{CpuStorage, DType, Device, Layout, Result, Shape, Tensor, Var};
use candle_nn::{BatchNormConfig, Init, ModuleT, VarBuilder};
use std::sync::{Arc, Mutex};

/// The backward all-reduces that training forwards of a group's SyncBatchNorm layers owe,
/// oldest first.
#[derive(Default)]
pub(crate) struct BackwardTickets {
    pending: Mutex<Vec<Ticket>>,
    issued: Mutex<u64>,
}

struct Ticket {
    id: u64,
    channels: usize,
    dtype: DType,
    device: Device,
}

impl BackwardTickets {
    fn issue(&self, channels: usize, dtype: DType, device: &Device) -> u64 {
        let id = {
            let mut issued = lock(&self.issued);
            *issued += 1;
            *issued
        };
        lock(&self.pending).push(Ticket {
            id,
            channels,
            dtype,
            device: device.clone(),
        });
        id
    }

    /// Takes ticket `id`: whether it was still owed.
    fn take(&self, id: u64) -> bool {
        let mut pending = lock(&self.pending);
        match pending.iter().position(|t| t.id == id) {
            Some(i) => {
                pending.remove(i);
                true
            }
            None => false,
        }
    }

    /// Sends zeros for every ticket still owed, newest first (the order backward would have).
    fn finish(&self, group: &ProcessGroup) -> crate::Result<()> {
        let owed: Vec<Ticket> = std::mem::take(&mut *lock(&self.pending));
        for t in owed.iter().rev() {
            let zeros = Tensor::zeros(2 * t.channels, t.dtype, &t.device)?;
            group.all_reduce(&zeros, ReduceOp::Sum)?;
        }
        Ok(())
    }
}

/// Completes the backward of every SyncBatchNorm layer on `group` whose training forward ran
/// but whose backward autograd did not reach (a rank with no rows): it sends zeros in their
/// place, so that no rank waits. `DistributedDataParallel::backward` calls it for the layers of
/// its model; call it yourself after each backward otherwise, on every rank.
pub fn finish_backward(group: &ProcessGroup) -> crate::Result<()> {
    group.extension::<BackwardTickets>().finish(group)
}

/// `SyncBatchNorm`: batch normalisation with the batch statistics of every rank's samples
/// (`torch.nn.SyncBatchNorm`).
///
/// With data parallelism each rank sees a slice of the batch; plain BatchNorm normalises with
/// the slice's statistics. SyncBatchNorm normalises with those of the whole batch, exactly as
/// one process holding it would, with candle-nn's `BatchNorm` semantics and variable names:
///
/// - training forward: each rank sends its per-channel count, mean (as a shift and its
///   correction, from two passes) and centred sum of squares (in f32, f64 for f64 inputs) in
///   one all-gather; every rank combines them in rank order in f64 (Chan's parallel formula,
///   stable where the sum of squares is not), normalises with the
///   global mean and (biased) variance, and updates the running statistics with them, the
///   variance unbiased with the global count: identical on every rank. Ranks may hold different
///   numbers of rows, none included (they still take part);
/// - backward: the input gradient needs the global `sum(dy)` and `sum(dy * x_hat)` per channel,
///   one all-reduce; the weight and bias gradients stay local (DistributedDataParallel averages
///   them), as in torch;
/// - evaluation: the running statistics, no communication at all.
///
/// A rank with no rows may never reach the layer's backward (candle's autograd does not carry
/// every gradient through empty tensors). Each training forward therefore leaves a ticket for
/// its backward all-reduce; [`finish_backward`] sends zeros for the tickets autograd did not
/// reach, in backward order, so that no rank waits. `DistributedDataParallel::backward` calls
/// it; without DDP, call it after each backward.
///
/// ```rust
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{ModuleT, VarBuilder, VarMap};
/// use candle_parallel::{distributed, nn};
/// # fn main() -> candle_parallel::Result<()> {
/// // Two ranks with 3 and 1 rows normalise with the statistics of all 4.
/// let out = distributed::spawn_threads(2, |pg| {
///     let varmap = VarMap::new();
///     let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
///     let bn = nn::sync_batch_norm(1, 1e-5, vb, &pg)?;
///     let rows: &[f32] = if pg.rank() == 0 { &[1.0, 2.0, 3.0] } else { &[6.0] };
///     let x = Tensor::new(rows, &Device::Cpu)?.reshape(((), 1))?;
///     let y = bn.forward_t(&x, true)?;
///     nn::finish_backward(&pg)?; // no backward here: nothing pending is left behind
///     Ok(y.flatten_all()?.to_vec1::<f32>()?)
/// })?;
/// // Mean 3, variance 3.5: rank 1's 6 is (6 - 3) / sqrt(3.5).
/// assert!((out[1][0] - 3.0 / 3.5f32.sqrt()).abs() < 1e-4);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SyncBatchNorm {
    running_mean: Var,
    running_var: Var,
    weight_and_bias: Option<(Tensor, Tensor)>,
    remove_mean: bool,
    eps: f64,
    momentum: f64,
    group: ProcessGroup,
    tickets: Arc<BackwardTickets>,
    /// The layer's variable prefix, for messages.
    name: String,
}

impl std::fmt::Debug for SyncBatchNorm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyncBatchNorm")
            .field("name", &self.name)
            .field("num_features", &self.running_mean.elem_count())
            .field("eps", &self.eps)
            .field("momentum", &self.momentum)
            .finish()
    }
}

/// A SyncBatchNorm layer of `num_features` channels over `group`, with the variables (and
/// their initial values) of `candle_nn::batch_norm`: `running_mean`, `running_var`, and, when
/// `config.affine`, `weight` and `bias`. Checkpoints move freely between the two.
pub fn sync_batch_norm<C: Into<BatchNormConfig>>(
    num_features: usize,
    config: C,
    vb: VarBuilder,
    group: &ProcessGroup,
) -> Result<SyncBatchNorm> {
    let config = config.into();
    let name = vb.prefix();
    let invalid = |detail: String| {
        Error::InvalidArgument {
            what: "SyncBatchNorm configuration",
            detail: format!("layer `{name}`: {detail}"),
        }
        .into_candle()
    };
    if config.eps.is_nan() || config.eps < 0.0 {
        return Err(invalid(format!("eps {} is negative", config.eps)));
    }
    if !(0.0..=1.0).contains(&config.momentum) {
        return Err(invalid(format!(
            "momentum {} is not between 0 and 1",
            config.momentum
        )));
    }
    let running_mean = vb.get_with_hints(num_features, "running_mean", Init::Const(0.))?;
    let running_var = vb.get_with_hints(num_features, "running_var", Init::Const(1.))?;
    let weight_and_bias = if config.affine {
        let weight = vb.get_with_hints(num_features, "weight", Init::Const(1.))?;
        let bias = vb.get_with_hints(num_features, "bias", Init::Const(0.))?;
        Some((weight, bias))
    } else {
        None
    };
    let tickets = group.extension::<BackwardTickets>();
    super::note_sync_group(group);
    Ok(SyncBatchNorm {
        // The VarMap's own variables, so that updates persist (a copy otherwise).
        running_mean: Var::from_tensor(&running_mean)?,
        running_var: Var::from_tensor(&running_var)?,
        weight_and_bias,
        remove_mean: config.remove_mean,
        eps: config.eps,
        momentum: config.momentum,
        group: group.clone(),
        tickets,
        name,
    })
}

/// `[1, C, 1, ..]` for an input of `rank` dimensions with `c` channels.
fn channel_shape(rank: usize, c: usize) -> Vec<usize> {
    (0..rank).map(|d| if d == 1 { c } else { 1 }).collect()
}

/// Per-row sums of a `(C, M)` tensor, as a `[C]` tensor (zeros when `M` is 0).
fn row_sums(t: &Tensor) -> Result<Tensor> {
    if t.elem_count() == 0 {
        return Tensor::zeros(t.dim(0)?, t.dtype(), t.device());
    }
    sum_rows(t)
}

/// The global statistics, combined from every rank's count, mean and centred sum of squares.
struct Stats {
    count: f64,
    mean: Vec<f64>,
    /// The biased variance (the second moment about zero when the mean is not removed).
    var: Vec<f64>,
}

impl Stats {
    /// Combines every rank's message: per channel its mean's shift and correction, its sum of
    /// squares about that mean, then its count (`3 c + 1` values).
    fn combine(parts: &[Vec<f64>], c: usize) -> Self {
        let count: f64 = parts.iter().map(|p| p[3 * c]).sum();
        let rank_mean = |p: &[f64], k: usize| p[k] + p[c + k];
        let mean: Vec<f64> = (0..c)
            .map(|k| {
                let s: f64 = parts.iter().map(|p| p[3 * c] * rank_mean(p, k)).sum();
                if count > 0.0 {
                    s / count
                } else {
                    0.0
                }
            })
            .collect();
        let var = (0..c)
            .map(|k| {
                let m2: f64 = parts
                    .iter()
                    .map(|p| p[2 * c + k] + p[3 * c] * (rank_mean(p, k) - mean[k]).powi(2))
                    .sum();
                if count > 0.0 {
                    m2 / count
                } else {
                    0.0
                }
            })
            .collect();
        Self { count, mean, var }
    }
}

impl SyncBatchNorm {
    /// The running mean (the `VarMap`'s variable).
    pub fn running_mean(&self) -> &Tensor {
        self.running_mean.as_tensor()
    }

    /// The running variance (the `VarMap`'s variable).
    pub fn running_var(&self) -> &Tensor {
        self.running_var.as_tensor()
    }

    /// The weight and bias, when the layer is affine.
    pub fn weight_and_bias(&self) -> Option<(&Tensor, &Tensor)> {
        self.weight_and_bias.as_ref().map(|(w, b)| (w, b))
    }

    /// The group whose samples the statistics cover.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    fn check_input(&self, x: &Tensor) -> Result<usize> {
        let c = self.running_mean.elem_count();
        if x.rank() < 2 || x.dim(1)? != c {
            return Err(Error::InvalidArgument {
                what: "SyncBatchNorm input",
                detail: format!(
                    "layer `{}` has {c} channels but got shape {:?}; inputs are (N, {c}, ...)",
                    self.name,
                    x.dims()
                ),
            }
            .into_candle());
        }
        Ok(c)
    }

    /// Scales and shifts the normalised `x` (evaluation) with the weight and bias, taken to
    /// `x`'s dtype, the internal one, so that their gradients are summed there.
    fn affine(&self, x: Tensor, shape: &[usize]) -> Result<Tensor> {
        match &self.weight_and_bias {
            None => Ok(x),
            Some((w, b)) => {
                let param = |t: &Tensor| t.to_dtype(x.dtype())?.reshape(shape);
                x.broadcast_mul(&param(w)?)?.broadcast_add(&param(b)?)
            }
        }
    }

    /// The training forward. Everything runs in the channels-first layout `(C, M)`, `M` the
    /// samples times the spatial positions (as candle-nn's `BatchNorm` does), in f32 (f64 for
    /// f64): there every per-channel reduction, the weight's and bias's gradients included, is
    /// over the last, contiguous dimension, summed in lanes on the CPU ([`sum_rows`]); over the
    /// other dimensions of `(N, C, H, W)` candle takes a slow strided path.
    fn forward_train(&self, x: &Tensor) -> Result<Tensor> {
        let c = self.check_input(x)?;
        let internal = wide(x.dtype());
        let xi = x.to_dtype(internal)?.transpose(0, 1)?;
        let channels_first = xi.dims().to_vec();
        let flat = xi.flatten_from(1)?.contiguous()?;
        let n = flat.dim(1)?;
        // The statistics need no gradient: the backward uses the global ones (below).
        let values = flat.detach();
        // This rank's mean as a shift and its correction (their sum in f64 is the mean: rounded
        // to f32 it would be off by half an ulp, large against a small spread), and the sum of
        // squares about it.
        let zeros = || Tensor::zeros(c, internal, x.device());
        let (shift, correction, m2) = if n == 0 {
            (zeros()?, zeros()?, zeros()?)
        } else if self.remove_mean {
            // Two passes, the second correcting the first mean by c = mean(d), d = x - mean:
            // then sum((d - c)^2) = sum(d^2) - n c^2 (stable at any mean).
            let shift = (sum_rows(&values)? / n as f64)?;
            let d = values.broadcast_sub(&shift.reshape((c, 1))?)?;
            let correction = (sum_rows(&d)? / n as f64)?;
            let m2 = (sum_rows(&d.sqr()?)? - (correction.sqr()? * n as f64)?)?.relu()?;
            (shift, correction, m2)
        } else {
            (zeros()?, zeros()?, sum_rows(&values.sqr()?)?)
        };
        let count = Tensor::new(&[n as f64], x.device())?.to_dtype(internal)?;
        let message = Tensor::cat(&[&shift, &correction, &m2, &count], 0)?;
        let parts = self
            .group
            .all_gather(&message)
            .map_err(Error::into_candle)?
            .iter()
            .map(|t| {
                t.to_dtype(DType::F64)?
                    .to_device(&Device::Cpu)?
                    .to_vec1::<f64>()
            })
            .collect::<Result<Vec<_>>>()?;
        let stats = Stats::combine(&parts, c);
        if stats.count < 2.0 {
            return Err(Error::InvalidArgument {
                what: "SyncBatchNorm batch",
                detail: format!(
                    "layer `{}` got {} value(s) per channel over all ranks in training mode; \
                     batch statistics need at least 2",
                    self.name, stats.count
                ),
            }
            .into_candle());
        }
        self.update_running_stats(&stats)?;
        let column = |v: &[f64]| -> Result<Tensor> {
            Tensor::from_vec(v.to_vec(), (c, 1), &Device::Cpu)?
                .to_dtype(internal)?
                .to_device(x.device())
        };
        let std: Vec<f64> = stats.var.iter().map(|v| (v + self.eps).sqrt()).collect();
        let centred = if self.remove_mean {
            // Centred on this rank's shift first (exact for values near it), then by the small
            // difference to the global mean, taken in f64.
            let own = &parts[self.group.rank()][..c];
            let rest: Vec<f64> = stats.mean.iter().zip(own).map(|(g, o)| g - o).collect();
            flat.broadcast_sub(&shift.reshape((c, 1))?)?
                .broadcast_sub(&column(&rest)?)?
        } else {
            flat
        };
        let z = centred.broadcast_div(&column(&std)?)?;
        let ticket = self.tickets.issue(c, internal, x.device());
        let normed = z.apply_op1(GlobalStatsGrad {
            group: self.group.clone(),
            tickets: self.tickets.clone(),
            ticket,
            count: stats.count,
            remove_mean: self.remove_mean,
            name: self.name.clone(),
        })?;
        let y = match &self.weight_and_bias {
            None => normed,
            Some((w, b)) => {
                // The product and sum by candle ops, with constants; the weight's and bias's
                // gradients (sums over the samples) by `row_sums`, through `ParamGrads`.
                let constant = |t: &Tensor| t.to_dtype(internal)?.detach().reshape((c, 1));
                normed
                    .broadcast_mul(&constant(w)?)?
                    .broadcast_add(&constant(b)?)?
                    .apply_op3(
                        w,
                        b,
                        ParamGrads {
                            x_hat: normed.detach(),
                        },
                    )?
            }
        };
        y.to_dtype(x.dtype())?
            .reshape(channels_first)?
            .transpose(0, 1)
    }

    fn update_running_stats(&self, stats: &Stats) -> Result<()> {
        let m = self.momentum;
        let dev = self.running_mean.device();
        let dtype = self.running_mean.dtype();
        // In the internal dtype, rounded to the statistics' own once.
        let internal = wide(dtype);
        let tensor = |v: Vec<f64>| -> Result<Tensor> {
            Tensor::from_vec(v, stats.mean.len(), &Device::Cpu)?
                .to_dtype(internal)?
                .to_device(dev)
        };
        let update = |running: &Var, batch: Tensor| -> Result<()> {
            let old = running.as_tensor().to_dtype(internal)?;
            running.set(&((old * (1.0 - m))? + (batch * m)?)?.to_dtype(dtype)?)
        };
        if self.remove_mean {
            update(&self.running_mean, tensor(stats.mean.clone())?)?;
        }
        let unbias = stats.count / (stats.count - 1.0);
        update(
            &self.running_var,
            tensor(stats.var.iter().map(|v| v * unbias).collect())?,
        )
    }

    fn forward_eval(&self, x: &Tensor) -> Result<Tensor> {
        let c = self.check_input(x)?;
        let shape = channel_shape(x.rank(), c);
        let internal = wide(x.dtype());
        let stat = |v: &Var| {
            v.as_detached_tensor()
                .to_dtype(internal)?
                .reshape(shape.as_slice())
        };
        let (mean, var) = (stat(&self.running_mean)?, stat(&self.running_var)?);
        let normed = x
            .to_dtype(internal)?
            .broadcast_sub(&mean)?
            .broadcast_div(&(var + self.eps)?.sqrt()?)?;
        self.affine(normed, &shape)?.to_dtype(x.dtype())
    }
}

impl ModuleT for SyncBatchNorm {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        if train {
            self.forward_train(x)
        } else {
            self.forward_eval(x)
        }
    }
}

/// The identity on the normalised input `x_hat`, whose backward turns `g = dL/dx_hat` into
/// the gradient through the global statistics: `g - mean(g) - x_hat * mean(g * x_hat)`, the
/// means over every rank's samples (one all-reduce of `sum(g)` and `sum(g * x_hat)` per
/// channel). `x_hat` is channels first, `(C, M)`, as `forward_train` lays it out. Autograd then
/// divides by the standard deviation on the way to the input.
struct GlobalStatsGrad {
    group: ProcessGroup,
    tickets: Arc<BackwardTickets>,
    ticket: u64,
    count: f64,
    remove_mean: bool,
    name: String,
}

impl candle_core::CustomOp1 for GlobalStatsGrad {
    fn name(&self) -> &'static str {
        "sync-batch-norm"
    }

    /// The input is a fresh tensor (a division's result): its storage is exactly its values.
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        crate::util::pass_through::cpu(s, l)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::util::pass_through::cuda(s, l)
    }

    fn bwd(&self, _: &Tensor, x_hat: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        if !self.tickets.take(self.ticket) {
            return Err(Error::InvalidArgument {
                what: "SyncBatchNorm backward",
                detail: format!(
                    "layer `{}`: backward ran twice for one forward, or after finish_backward",
                    self.name
                ),
            }
            .into_candle());
        }
        // `x_hat` and `g` are `(C, M)`, channels first (see `forward_train`).
        let sums = Tensor::cat(&[row_sums(g)?, row_sums(&(g * x_hat)?)?], 0)?;
        let sums = self
            .group
            .all_reduce(&sums, ReduceOp::Sum)
            .map_err(Error::into_candle)?;
        let c = x_hat.dim(0)?;
        let mean_g = (sums.narrow(0, 0, c)? / self.count)?.reshape((c, 1))?;
        let mean_gx = (sums.narrow(0, c, c)? / self.count)?.reshape((c, 1))?;
        let dz = g.broadcast_sub(&x_hat.broadcast_mul(&mean_gx)?)?;
        let dz = if self.remove_mean {
            dz.broadcast_sub(&mean_g)?
        } else {
            dz
        };
        Ok(Some(dz))
    }
}

/// The identity on the channels-first `(C, M)` output of the affine step, over the weight and
/// bias it used as constants: its backward hands the output's gradient `g` on, and gives the
/// weight `sum(g * x_hat)` and the bias `sum(g)` per channel, in their dtype.
struct ParamGrads {
    x_hat: Tensor,
}

impl candle_core::CustomOp3 for ParamGrads {
    fn name(&self) -> &'static str {
        "sync-batch-norm-affine"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        crate::util::pass_through::cpu(s, l)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::util::pass_through::cuda(s, l)
    }

    fn bwd(
        &self,
        _: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dw = row_sums(&(g * &self.x_hat)?)?.to_dtype(w.dtype())?;
        let db = row_sums(g)?.to_dtype(b.dtype())?;
        Ok((Some(g.clone()), Some(dw), Some(db)))
    }
}
