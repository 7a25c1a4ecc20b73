//! ZeRO-2's pieces, and how they are kept in step with the model's parameters.
//!
//! Each rank holds its chunk of every parameter ([`crate::shard`]) as a variable of its own,
//! which the optimizer steps; an all-gather per bucket puts the pieces together into the
//! parameters (the `VarMap`'s variables, which the model computes with). Two things can change
//! behind the wrapper's back, and it keeps a copy of its pieces as they were when pieces and
//! parameters last agreed (`synced`) to tell which:
//! - a piece, stepped by an optimizer (this crate's gather at the end of their step; others do
//!   not): the parameters are then behind, and the next training forward gathers;
//! - a parameter, written by the user (`varmap.load(..)`, `Var::set`) after wrapping: the
//!   piece is cut again from it, so that the user's weights are the ones that train.
//!
//! Both at once for one parameter is refused. Whether to gather is agreed by every rank at each
//! training forward (one small all-reduce), since a step may leave one rank's pieces as they
//! were (a zero gradient) and change another's. An evaluation needs no collective: it is
//! refused ([`crate::Error::StaleParameters`]) when this rank's pieces moved, or when a
//! backward came since the last gather and some piece is not held by one of this crate's
//! optimizers (whose step gathers), since another rank's pieces may then have moved.

use super::param::Param;
use crate::distributed::{ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use crate::optim::managed;
use crate::shard::{chunk_elements, chunk_of, FlatLayout};
use candle_core::{DType, Device, Tensor, Var};

/// This rank's pieces and where they stand with respect to the parameters.
pub(super) struct Zero2 {
    /// Per parameter (in the reducer's order), this rank's chunk of it, padded: what the
    /// optimizer steps.
    pub(super) pieces: Vec<Var>,
    /// The pieces when pieces and parameters last agreed.
    synced: Vec<Tensor>,
    /// A synchronised backward came since the last gather: an optimizer may step next.
    gather_due: bool,
    /// That backward handed out a gradient for some piece.
    handed_out: bool,
    /// Whether an optimizer that stepped no piece was reported.
    warned_unstepped: bool,
}

/// Whether `a` and `b` (of one shape) differ anywhere, NaN counting as equal to NaN (and, as
/// `==` has it, -0 as 0). Contiguous CPU tensors of one dtype (f32, f64, bf16, f16, u8, u32,
/// i64) are compared in one pass over their values ([`differs_on_cpu`]); others by candle's
/// ops.
fn differs(a: &Tensor, b: &Tensor) -> Result<bool> {
    match differs_on_cpu(a, b) {
        Some(d) => Ok(d),
        None => Ok(differs_by_ops(a, b)?),
    }
}

/// [`differs`] by candle's ops, for any tensors: a mask each way, NaN masks, a product, a sum.
fn differs_by_ops(a: &Tensor, b: &Tensor) -> candle_core::Result<bool> {
    let mask = |t: &Tensor| t.to_dtype(DType::F32);
    let ne = mask(&a.ne(b)?)?;
    let both_nan = (mask(&a.ne(a)?)? * mask(&b.ne(b)?)?)?;
    Ok((ne - both_nan)?.sum_all()?.to_scalar::<f32>()? > 0.0)
}

/// [`differs`] for contiguous CPU tensors of one dtype: blocks of values over rayon's threads,
/// each block folded without a branch (so that it vectorizes). A training step compares every
/// piece and every parameter's chunk with `synced` twice (at the optimizer's gather and at the
/// next forward); by candle's ops ([`differs_by_ops`]) that was 46%
/// of the samples of a ZeRO-2 step of `transformer_ddp` at 6.3 M parameters on one rank.
/// `None` for other tensors.
fn differs_on_cpu(a: &Tensor, b: &Tensor) -> Option<bool> {
    use candle_core::{CpuStorage as C, Storage};
    fn any<T: Copy + Sync>(a: &[T], b: &[T], ne: impl Fn(T, T) -> bool + Sync) -> bool {
        use rayon::prelude::*;
        const BLOCK: usize = 1 << 15;
        a.len() != b.len()
            || a.par_chunks(BLOCK)
                .zip(b.par_chunks(BLOCK))
                .any(|(x, y)| x.iter().zip(y).fold(false, |d, (&p, &q)| d | ne(p, q)))
    }
    // Floats: unequal, unless both are NaN.
    macro_rules! float {
        ($x:expr, $y:expr) => {
            any($x, $y, |p, q| !(p == q || (p.is_nan() && q.is_nan())))
        };
    }
    if a.dims() != b.dims() {
        return None;
    }
    let ((sa, la), (sb, lb)) = (a.storage_and_layout(), b.storage_and_layout());
    let ((a0, a1), (b0, b1)) = (la.contiguous_offsets()?, lb.contiguous_offsets()?);
    let (Storage::Cpu(sa), Storage::Cpu(sb)) = (&*sa, &*sb) else {
        return None;
    };
    Some(match (sa, sb) {
        (C::F32(x), C::F32(y)) => float!(&x[a0..a1], &y[b0..b1]),
        (C::F64(x), C::F64(y)) => float!(&x[a0..a1], &y[b0..b1]),
        (C::BF16(x), C::BF16(y)) => float!(&x[a0..a1], &y[b0..b1]),
        (C::F16(x), C::F16(y)) => float!(&x[a0..a1], &y[b0..b1]),
        (C::U8(x), C::U8(y)) => any(&x[a0..a1], &y[b0..b1], |p, q| p != q),
        (C::U32(x), C::U32(y)) => any(&x[a0..a1], &y[b0..b1], |p, q| p != q),
        (C::I64(x), C::I64(y)) => any(&x[a0..a1], &y[b0..b1], |p, q| p != q),
        _ => return None,
    })
}

/// This rank's chunk of `param`, as a tensor of its own: a compact one (the chunk is a narrow
/// of the whole parameter, whose `copy` would clone the whole storage, and `synced` would hold
/// every parameter whole on every rank).
fn cut(param: &Param, group: &ProcessGroup) -> Result<Tensor> {
    Ok(chunk_of(param.var.as_tensor(), group.world_size(), group.rank())?.force_contiguous()?)
}

impl Zero2 {
    /// Cuts this rank's pieces from the parameters' current values.
    pub(super) fn cut(params: &[Param], group: &ProcessGroup) -> Result<Self> {
        let mut pieces = Vec::with_capacity(params.len());
        let mut synced = Vec::with_capacity(params.len());
        for p in params {
            let chunk = cut(p, group)?;
            pieces.push(Var::from_tensor(&chunk.copy()?)?);
            synced.push(chunk);
        }
        Ok(Self {
            pieces,
            synced,
            gather_due: false,
            handed_out: false,
            warned_unstepped: false,
        })
    }

    /// Cuts the pieces again from the parameters (after a checkpoint was loaded into them).
    pub(super) fn recut(&mut self, params: &[Param], group: &ProcessGroup) -> Result<()> {
        for (i, p) in params.iter().enumerate() {
            let chunk = cut(p, group)?;
            self.pieces[i].set(&chunk)?;
            self.synced[i] = chunk;
        }
        self.gather_due = false;
        Ok(())
    }

    /// A synchronised backward handed out its gradients (`any`: for some piece).
    pub(super) fn backward_done(&mut self, any: bool) {
        self.gather_due = true;
        self.handed_out = any;
    }

    /// Compares each piece and each parameter's chunk with `synced`: a parameter written since
    /// (and not stepped) gets its piece cut again; one written and stepped is an error. Returns
    /// the first parameter whose piece was stepped, if one was. No collective.
    fn reconcile(&mut self, params: &[Param], group: &ProcessGroup) -> Result<Option<usize>> {
        let (world, rank) = (group.world_size(), group.rank());
        let mut stepped = None;
        for (i, p) in params.iter().enumerate() {
            let piece_moved = differs(self.pieces[i].as_tensor(), &self.synced[i])?;
            let real = chunk_elements(p.var.elem_count(), world, rank);
            let written = !real.is_empty() && {
                // The chunk where it lies in the parameter (`chunk_of` would copy to pad it).
                let now = p.var.flatten_all()?.narrow(0, real.start, real.len())?;
                differs(&now, &self.synced[i].narrow(0, 0, real.len())?)?
            };
            match (piece_moved, written) {
                (true, true) => {
                    return Err(Error::InvalidArgument {
                        what: "DistributedDataParallel (ZeRO-2)",
                        detail: format!(
                            "rank {rank}: `{}` was written in the VarMap and its piece was \
                             stepped since they last agreed, so there are two models; write \
                             weights before the step (or load them with load_checkpoint)",
                            p.name
                        ),
                    })
                }
                (false, true) => {
                    let chunk = cut(p, group)?;
                    self.pieces[i].set(&chunk)?;
                    self.synced[i] = chunk;
                }
                (true, false) => {
                    stepped.get_or_insert(i);
                }
                (false, false) => {}
            }
        }
        Ok(stepped)
    }

    /// Puts every rank's pieces together into the parameters: one all-gather per bucket, all
    /// issued before the first is waited for (parameters written since pieces and parameters
    /// last agreed first get their pieces cut again). Every rank must call it.
    pub(super) fn gather(
        &mut self,
        params: &[Param],
        buckets: &[Vec<usize>],
        flat: &[FlatLayout],
        group: &ProcessGroup,
    ) -> Result<()> {
        self.reconcile(params, group)?;
        self.gather_reconciled(params, buckets, flat, group)
    }

    /// [`Zero2::gather`] right after a [`Zero2::reconcile`].
    fn gather_reconciled(
        &mut self,
        params: &[Param],
        buckets: &[Vec<usize>],
        flat: &[FlatLayout],
        group: &ProcessGroup,
    ) -> Result<()> {
        let shards = buckets
            .iter()
            .map(|members| {
                let pieces: Vec<Tensor> = members
                    .iter()
                    .map(|&i| self.pieces[i].as_tensor().clone())
                    .collect();
                Ok(Tensor::cat(&pieces, 0)?)
            })
            .collect::<Result<Vec<_>>>()?;
        let works = shards
            .iter()
            .map(|s| match group.world_size() {
                1 => Ok(None),
                _ => group.all_gather_async(s).map(Some),
            })
            .collect::<Result<Vec<_>>>()?;
        for ((b, work), shard) in works.into_iter().enumerate().zip(shards) {
            let parts = match work {
                Some(work) => work.wait()?,
                None => vec![shard],
            };
            let members = &buckets[b];
            let shapes: Vec<Vec<usize>> = members
                .iter()
                .map(|&i| params[i].var.dims().to_vec())
                .collect();
            for (&i, t) in members.iter().zip(flat[b].from_shards(&parts, &shapes)?) {
                params[i].var.set(&t)?;
            }
        }
        for (synced, piece) in self.synced.iter_mut().zip(&self.pieces) {
            *synced = piece.as_tensor().copy()?;
        }
        self.gather_due = false;
        Ok(())
    }

    /// What a training forward does first: every rank says whether its pieces were stepped
    /// (one all-reduce), and the pieces are gathered when any were, or when a backward came
    /// since the last gather. Every rank must call it.
    pub(super) fn before_training_forward(
        &mut self,
        params: &[Param],
        buckets: &[Vec<usize>],
        flat: &[FlatLayout],
        group: &ProcessGroup,
    ) -> Result<()> {
        let stepped_here = self.reconcile(params, group)?.is_some();
        let stepped = match group.world_size() {
            1 => stepped_here,
            _ => {
                let device = params
                    .first()
                    .map_or(Device::Cpu, |p| p.var.device().clone());
                let flag = Tensor::new(&[f32::from(u8::from(stepped_here))], &Device::Cpu)?
                    .to_device(&device)?;
                group
                    .all_reduce(&flag, ReduceOp::Max)?
                    .to_device(&Device::Cpu)?
                    .to_vec1::<f32>()?[0]
                    > 0.0
            }
        };
        if self.gather_due && self.handed_out && !stepped {
            self.report_unstepped(group.rank());
        }
        if stepped || self.gather_due {
            // Reconciled above, and nothing can have changed since.
            self.gather_reconciled(params, buckets, flat, group)?;
        }
        Ok(())
    }

    /// The first parameter whose model value may be behind its pieces, when an evaluation
    /// would compute with weights of before a step; see the [module documentation](self).
    pub(super) fn stale(
        &mut self,
        params: &[Param],
        group: &ProcessGroup,
    ) -> Result<Option<String>> {
        if let Some(i) = self.reconcile(params, group)? {
            return Ok(Some(params[i].name.clone()));
        }
        if self.gather_due && !managed::all_stepped_by_this_crate(&self.pieces) {
            // Another rank's pieces may have moved, by an optimizer that does not gather.
            return Ok(params.first().map(|p| p.name.clone()));
        }
        Ok(None)
    }

    /// Says once (rank 0) that a training forward found no piece stepped since the last
    /// backward: the optimizer steps something else, or nothing.
    fn report_unstepped(&mut self, rank: usize) {
        if std::mem::replace(&mut self.warned_unstepped, true) || rank != 0 {
            return;
        }
        log::warn!(
            "DistributedDataParallel (ZeRO-2): no parameter's piece changed between the last \
             backward and this forward, on any rank: the optimizer is not stepping \
             model.parameters() (this rank's pieces), or its learning rate was 0, or the step \
             was skipped (said once)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{CpuStorage, Storage};

    /// The one-pass comparison says what candle's ops say, in every dtype, on NaN (equal to
    /// NaN), on -0 (equal to 0), on one difference anywhere in a long tensor, and on views.
    #[test]
    fn differs_in_one_pass_as_by_candles_ops() -> candle_core::Result<()> {
        let cpu = &Device::Cpu;
        let n = 100_003;
        let base: Vec<f32> = (0..n).map(|i| (i % 97) as f32 - 40.0).collect();
        let mut cases: Vec<(Vec<f32>, Vec<f32>)> = vec![(base.clone(), base.clone())];
        for at in [0, 40_000, n - 1] {
            let mut other = base.clone();
            other[at] += 1.0;
            cases.push((base.clone(), other));
        }
        let (mut nan_a, mut nan_b) = (base.clone(), base.clone());
        nan_a[7] = f32::NAN;
        nan_b[7] = f32::NAN;
        cases.push((nan_a.clone(), nan_b));
        cases.push((nan_a, base.clone()));
        let mut neg_zero = base.clone();
        neg_zero[40] = -0.0; // base[40] is 0
        cases.push((base.clone(), neg_zero));
        for (a, b) in cases {
            let (a, b) = (Tensor::new(a, cpu)?, Tensor::new(b, cpu)?);
            for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I64] {
                let (a, b) = (a.to_dtype(dtype)?, b.to_dtype(dtype)?);
                let by_ops = differs_by_ops(&a, &b)?;
                assert_eq!(differs_on_cpu(&a, &b), Some(by_ops), "{dtype:?}");
                // A narrowed view (an offset into its storage) compares as its values.
                let (va, vb) = (a.narrow(0, 1, n - 2)?, b.narrow(0, 1, n - 2)?);
                let want = differs_on_cpu(&va.copy()?, &vb.copy()?);
                assert_eq!(differs_on_cpu(&va, &vb), want, "{dtype:?} view");
            }
        }
        // At different offsets into their storages (as a parameter's chunk against its compact
        // snapshot), and in the integer types.
        let whole = Tensor::arange(0u32, 20, cpu)?;
        let chunk = whole.narrow(0, 10, 10)?;
        for dtype in [DType::U32, DType::U8, DType::F32] {
            let (chunk, whole) = (chunk.to_dtype(dtype)?, whole.to_dtype(dtype)?);
            let view = whole.narrow(0, 10, 10)?;
            assert_eq!(differs_on_cpu(&view, &chunk), Some(false), "{dtype:?}");
            let first = whole.narrow(0, 0, 10)?;
            assert_eq!(differs_on_cpu(&first, &chunk), Some(true), "{dtype:?}");
        }
        // Strided views and other devices are left to candle's ops.
        let m = Tensor::arange(0f32, 6.0, cpu)?.reshape((2, 3))?;
        assert_eq!(differs_on_cpu(&m.t()?, &m.t()?), None);
        assert!(!differs(&m.t()?, &m.t()?.contiguous()?).unwrap());
        Ok(())
    }

    #[test]
    fn a_cut_piece_holds_its_chunk_only() {
        let sizes = crate::distributed::spawn_threads(2, |pg| {
            let var = Var::from_tensor(&Tensor::arange(0f32, 12., &Device::Cpu)?.reshape((3, 4))?)?;
            let param = Param {
                name: "w".into(),
                var,
                grad_dtype: DType::F32,
            };
            let piece = cut(&param, &pg)?;
            let (storage, _) = piece.storage_and_layout();
            let Storage::Cpu(CpuStorage::F32(buffer)) = &*storage else {
                panic!("an f32 CPU tensor")
            };
            Ok((buffer.len(), piece.to_vec1::<f32>()?))
        })
        .unwrap();
        assert_eq!(sizes[0], (6, (0..6).map(|i| i as f32).collect::<Vec<_>>()));
        assert_eq!(sizes[1], (6, (6..12).map(|i| i as f32).collect::<Vec<_>>()));
    }
}
