//! Gradient clipping with torch's semantics: [`clip_grad_norm`] (`torch.nn.utils.
//! clip_grad_norm_`: the gradients of all the parameters scaled together so that their total
//! p-norm is at most `max_norm`) and [`clip_grad_value`] (`clip_grad_value_`: each element
//! clamped).
//!
//! When the parameters are sharded over ranks (ZeRO-2, fully sharded), the norm must be the
//! whole model's, not this rank's pieces': [`clip_grad_norm_over`] adds every rank's `Σ|g|^p`
//! (the maximum for the inf-norm) with one all-reduce, so that every rank scales by the same
//! coefficient. The wrappers' own `clip_grad_norm` methods pick the right form.
//!
//! ```rust
//! use candle_core::{Device, Var};
//! use candle_parallel::optim::clip_grad_norm;
//! # fn main() -> candle_parallel::Result<()> {
//! let (a, b) = (Var::new(&[1f32, 2.], &Device::Cpu)?, Var::new(&[2f32], &Device::Cpu)?);
//! // The gradients of a² + b² are 2a = [2, 4] and 2b = [4]: norm 6.
//! let loss = (a.as_tensor().sqr()?.sum_all()? + b.as_tensor().sqr()?.sum_all()?)?;
//! let mut grads = loss.backward()?;
//! let norm = clip_grad_norm(&mut grads, &[a.clone(), b.clone()], 3.0, 2.0, false)?;
//! assert_eq!(norm, 6.0);
//! // Scaled by 3 / 6 (torch adds 1e-6 to the norm).
//! let g = grads.get(a.as_tensor()).unwrap().to_vec1::<f32>()?;
//! assert!((g[1] - 2.0).abs() < 1e-5);
//! # Ok(()) }
//! ```

use crate::distributed::{ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

/// torch's `clip_grad_norm_` over the gradients in `grads` of `vars` (those without a gradient
/// are skipped): the total `norm_type`-norm of all of them (`f64::INFINITY` for the largest
/// magnitude), and, when it exceeds `max_norm`, every gradient multiplied by
/// `max_norm / (total + 1e-6)` (a NaN total makes every gradient NaN, as in torch). Returns the
/// total norm (before clipping). With `error_if_nonfinite`, a NaN or infinite total is an
/// error and nothing is changed.
pub fn clip_grad_norm(
    grads: &mut GradStore,
    vars: &[Var],
    max_norm: f64,
    norm_type: f64,
    error_if_nonfinite: bool,
) -> Result<f64> {
    clip_grad_norm_over(grads, vars, max_norm, norm_type, error_if_nonfinite, None)
}

/// [`clip_grad_norm`] for gradients sharded over the ranks of `group`: each rank holds the
/// gradients of its `vars` (its pieces, every element on one rank only), the total norm is the
/// whole model's (one all-reduce), and every rank scales by the same coefficient. Every rank of
/// `group` must call it. Without a group it is [`clip_grad_norm`].
pub fn clip_grad_norm_over(
    grads: &mut GradStore,
    vars: &[Var],
    max_norm: f64,
    norm_type: f64,
    error_if_nonfinite: bool,
    group: Option<&ProcessGroup>,
) -> Result<f64> {
    clip_grad_norm_parts(
        grads,
        &[(vars, group)],
        max_norm,
        norm_type,
        error_if_nonfinite,
    )
}

/// [`clip_grad_norm`] over gradients laid out in several ways at once: each part's `vars`
/// hold pieces spread over the ranks of its group (every element on one rank of it; `None`:
/// this rank holds them whole), the total norm adds every part's (one all-reduce per part
/// with a group, in the order given), and every rank scales by the same coefficient. Under
/// tensor parallel with data parallel, for example, the cut weights' gradients are pieces over
/// the tensor-parallel group and the replicated ones' are whole (or, under ZeRO-2, pieces over
/// the whole mesh and over the data-parallel group). Every rank of every group must call it
/// with the same parts.
pub fn clip_grad_norm_parts(
    grads: &mut GradStore,
    parts: &[(&[Var], Option<&ProcessGroup>)],
    max_norm: f64,
    norm_type: f64,
    error_if_nonfinite: bool,
) -> Result<f64> {
    if norm_type.is_nan() || norm_type <= 0.0 {
        return Err(Error::InvalidArgument {
            what: "clip_grad_norm norm_type",
            detail: format!("{norm_type} (must be positive, or f64::INFINITY)"),
        });
    }
    if crate::util::plain_join::inside() {
        return Err(Error::InvalidArgument {
            what: "clip_grad_norm",
            detail: "inside DistributedDataParallel::join: a rank that has run out of batches \
                     steps the averaged gradients as they come, unclipped; give the step \
                     (clip, then step) to join_with, which runs it on the joined ranks too"
                .into(),
        });
    }
    // A variable in two parts (or twice in one) would count twice in the norm.
    let mut seen = std::collections::HashSet::new();
    for (k, &(vars, _)) in parts.iter().enumerate() {
        if let Some(v) = vars.iter().find(|v| !seen.insert(v.as_tensor().id())) {
            return Err(Error::InvalidArgument {
                what: "clip_grad_norm parts",
                detail: format!(
                    "a variable of shape {:?} appears twice (the second time in part {k}): its \
                     gradient would count twice in the total norm; list each variable once",
                    v.dims()
                ),
            });
        }
    }
    if max_norm.is_nan() {
        return Err(Error::InvalidArgument {
            what: "clip_grad_norm max_norm",
            detail: "NaN".into(),
        });
    }
    let infinity = norm_type.is_infinite();
    // NaN must win over max(), which would drop it.
    let combine = |a: f64, b: f64| match (infinity, a.is_nan() || b.is_nan()) {
        (_, true) => f64::NAN,
        (true, false) => a.max(b),
        (false, false) => a + b,
    };
    let mut present: Vec<(&Var, Tensor)> = Vec::new();
    let mut reduced = 0f64;
    for &(vars, group) in parts {
        let mine: Vec<(&Var, Tensor)> = vars
            .iter()
            .filter_map(|v| grads.get(v.as_tensor()).map(|g| (v, g.clone())))
            .collect();
        // This rank's part: Σ|g|^p, or max|g|, in f64.
        let mut local = 0f64;
        for (_, g) in &mine {
            if g.elem_count() == 0 {
                continue;
            }
            let a = g.to_dtype(DType::F64)?.abs()?;
            let part = match (infinity, norm_type) {
                // candle's max drops a NaN that is not first; a sum of |g| is NaN exactly when
                // some element is.
                (true, _) => {
                    let sum = a.sum_all()?;
                    if sum.to_scalar::<f64>()?.is_nan() {
                        sum
                    } else {
                        a.max_all()?
                    }
                }
                (false, 2.0) => a.sqr()?.sum_all()?,
                (false, 1.0) => a.sum_all()?,
                (false, p) => a.powf(p)?.sum_all()?,
            }
            .to_device(&Device::Cpu)?
            .to_scalar::<f64>()?;
            local = combine(local, part);
        }
        let over_group = match group.filter(|g| g.world_size() > 1) {
            Some(group) => {
                let device = mine
                    .first()
                    .or(present.first())
                    .map_or(group.device().clone(), |(_, g)| g.device().clone());
                let op = if infinity {
                    ReduceOp::Max
                } else {
                    ReduceOp::Sum
                };
                let t = Tensor::new(&[local], &Device::Cpu)?.to_device(&device)?;
                group
                    .all_reduce(&t, op)?
                    .to_device(&Device::Cpu)?
                    .to_vec1::<f64>()?[0]
            }
            None => local,
        };
        reduced = combine(reduced, over_group);
        present.extend(mine);
    }
    let total = if infinity {
        reduced
    } else {
        reduced.powf(1.0 / norm_type)
    };
    if error_if_nonfinite && !total.is_finite() {
        return Err(Error::NonFiniteGradientNorm { norm_type, total });
    }
    // torch clamps a NaN coefficient to NaN (f64::min would give 1 and leave the gradients).
    let coef = match total.is_nan() {
        true => f64::NAN,
        false => (max_norm / (total + 1e-6)).min(1.0),
    };
    // torch multiplies even by 1; the product would be each gradient itself.
    if coef != 1.0 {
        for (v, g) in present {
            let scaled = match g.dtype() {
                DType::F64 => (g * coef)?,
                // torch multiplies by the coefficient as an f32 tensor.
                _ => g.affine(coef as f32 as f64, 0.0)?,
            };
            grads.insert(v.as_tensor(), scaled);
        }
    }
    Ok(total)
}

/// torch's `clip_grad_value_`: every element of the gradients in `grads` of `vars` clamped to
/// `[-clip_value, clip_value]` (elementwise: the same sharded or not).
pub fn clip_grad_value(grads: &mut GradStore, vars: &[Var], clip_value: f64) -> Result<()> {
    if clip_value.is_nan() || clip_value < 0.0 {
        return Err(Error::InvalidArgument {
            what: "clip_grad_value clip_value",
            detail: format!("{clip_value} (must be at least 0)"),
        });
    }
    for v in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            let clamped = g.clamp(-clip_value, clip_value)?;
            grads.insert(v.as_tensor(), clamped);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grads_of(values: &[&[f32]]) -> (Vec<Var>, GradStore) {
        let vars: Vec<Var> = values
            .iter()
            .map(|v| Var::new(*v, &Device::Cpu).unwrap())
            .collect();
        // loss = Σ v·c with c the values: each gradient is its values.
        let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
        for (var, v) in vars.iter().zip(values) {
            let c = Tensor::new(*v, &Device::Cpu).unwrap();
            loss = (loss + (var.as_tensor() * c).unwrap().sum_all().unwrap()).unwrap();
        }
        let grads = loss.backward().unwrap();
        (vars, grads)
    }

    #[test]
    fn norms_of_every_order_and_the_coefficient_follow_torch() {
        let values: [&[f32]; 2] = [&[3., -4.], &[12.]];
        // The totals are torch 2.15's for the same gradients.
        for (p, want) in [
            (2.0, 13.0),
            (1.0, 19.0),
            (f64::INFINITY, 12.0),
            (3.0, 12.207_056),
        ] {
            let (vars, mut grads) = grads_of(&values);
            let total = clip_grad_norm(&mut grads, &vars, 1.0, p, false).unwrap();
            assert!((total - want).abs() < 1e-3, "p = {p}: {total}");
            let g = grads
                .get(vars[1].as_tensor())
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let coef = (1.0 / (want + 1e-6)) as f32;
            assert!((g[0] - 12.0 * coef).abs() < 1e-5, "p = {p}: {g:?}");
        }
        // A norm under the limit changes nothing.
        let (vars, mut grads) = grads_of(&values);
        clip_grad_norm(&mut grads, &vars, 100.0, 2.0, false).unwrap();
        assert_eq!(
            grads
                .get(vars[0].as_tensor())
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            [3., -4.]
        );
    }

    #[test]
    fn a_nonfinite_norm_is_an_error_when_asked_and_bad_arguments_are_refused() {
        let (vars, mut grads) = grads_of(&[&[f32::NAN, 1.], &[2.]]);
        let err = clip_grad_norm(&mut grads, &vars, 1.0, 2.0, true).unwrap_err();
        assert!(err.to_string().contains("not finite"), "{err}");
        let total = clip_grad_norm(&mut grads, &vars, 1.0, f64::INFINITY, false).unwrap();
        assert!(total.is_nan());
        for p in [0.0, -1.0, f64::NAN] {
            assert!(clip_grad_norm(&mut grads, &vars, 1.0, p, false).is_err());
        }
        // A variable listed twice, in one part or in two, would count twice in the norm.
        let twice = [vars[0].clone(), vars[1].clone(), vars[0].clone()];
        let err = clip_grad_norm(&mut grads, &twice, 1.0, 2.0, false).unwrap_err();
        assert!(err.to_string().contains("appears twice"), "{err}");
        let (first, second) = (&vars[..1], &vars[..]);
        let parts = [(first, None), (second, None)];
        let err = clip_grad_norm_parts(&mut grads, &parts, 1.0, 2.0, false).unwrap_err();
        assert!(err.to_string().contains("in part 1"), "{err}");
        let (vars, mut grads) = grads_of(&[&[3., -4.]]);
        clip_grad_value(&mut grads, &vars, 3.5).unwrap();
        let g = grads
            .get(vars[0].as_tensor())
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(g, [3., -3.5]);
        assert!(clip_grad_value(&mut grads, &vars, -1.0).is_err());
    }

    #[test]
    fn sharded_gradients_clip_by_the_whole_models_norm() {
        // Two ranks holding halves of [3, -4, 12] (the second padded with a zero).
        let totals = crate::distributed::spawn_threads(2, |pg| {
            let mine: &[f32] = if pg.rank() == 0 {
                &[3., -4.]
            } else {
                &[12., 0.]
            };
            let (vars, mut grads) = grads_of(&[mine]);
            let total = clip_grad_norm_over(&mut grads, &vars, 6.5, 2.0, false, Some(&pg))?;
            let g = grads.get(vars[0].as_tensor()).unwrap().to_vec1::<f32>()?;
            Ok((total, g))
        })
        .unwrap();
        for (total, g) in &totals {
            assert!((total - 13.0).abs() < 1e-9, "{total}");
            assert!(g.iter().all(|x| x.abs() <= 6.0 + 1e-4), "{g:?}");
        }
        assert!((totals[1].1[0] - 6.0).abs() < 1e-4);
    }
}
