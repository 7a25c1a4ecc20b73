//! Making the ranks' models one: the check that every rank built the same variables, and the
//! broadcasts of rank 0's values (every variable at construction, the buffers before each
//! training forward).

use super::bucket::{assign_buckets, BucketParam};
use super::hook::{Entry, Kind};
use super::integers;
use crate::distributed::objects::all_gather_bytes;
use crate::distributed::ProcessGroup;
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor, Var};

/// "conv1.weight parameter f32 [6, 3, 5, 5]": what every rank must agree on, variable by variable.
fn describe(e: &Entry) -> String {
    let kind = match e.kind {
        Kind::Parameter => "parameter",
        Kind::Buffer => "buffer",
    };
    format!(
        "{} {kind} {} {:?}",
        e.name,
        e.var.dtype().as_str(),
        e.var.dims()
    )
}

/// Fails, on every rank and with the same message, unless every rank built the same variables
/// (names, kinds, dtypes, shapes) in the same order; the message names the first variable that
/// differs and which ranks have what.
pub(crate) fn check_same_model(
    group: &ProcessGroup,
    entries: &[Entry],
    device: &Device,
) -> Result<()> {
    let mine: Vec<String> = entries.iter().map(describe).collect();
    check_same_descriptions(
        group,
        &mine,
        device,
        crate::error::DISTRIBUTED_DATA_PARALLEL,
    )
}

/// Fails, on every rank and with the same message, unless every rank passed the same
/// descriptions ("name kind dtype [shape]", one per variable, the name first) in the same
/// order; the message names the first variable that differs and which ranks have what.
pub(crate) fn check_same_descriptions(
    group: &ProcessGroup,
    mine: &[String],
    device: &Device,
    wrapper: &'static str,
) -> Result<()> {
    let all = all_gather_bytes(group, mine.join("\n").as_bytes(), device)?;
    let lists: Vec<Vec<String>> = all
        .iter()
        .map(|b| {
            let text = String::from_utf8_lossy(b);
            if text.is_empty() {
                Vec::new()
            } else {
                text.lines().map(str::to_string).collect()
            }
        })
        .collect();
    let longest = lists.iter().map(Vec::len).max().unwrap_or(0);
    for pos in 0..longest {
        let at: Vec<Option<&String>> = lists.iter().map(|l| l.get(pos)).collect();
        if at.windows(2).all(|w| w[0] == w[1]) {
            continue;
        }
        // Group the ranks by what they have at this position.
        let mut groups: Vec<(Option<&String>, Vec<usize>)> = Vec::new();
        for (rank, d) in at.iter().enumerate() {
            match groups.iter_mut().find(|(g, _)| g == d) {
                Some((_, ranks)) => ranks.push(rank),
                None => groups.push((*d, vec![rank])),
            }
        }
        let variable = at
            .iter()
            .flatten()
            .next()
            .and_then(|d| d.split(' ').next())
            .unwrap_or("?")
            .to_string();
        let parts: Vec<String> = groups
            .iter()
            .map(|(d, ranks)| {
                let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
                let (who, has) = if ranks.len() == 1 {
                    ("rank", "has")
                } else {
                    ("ranks", "have")
                };
                match d {
                    Some(d) => format!("{who} {} {has} {d}", list.join(", ")),
                    None => format!("{who} {} {has} no variable there", list.join(", ")),
                }
            })
            .collect();
        return Err(Error::ModelMismatch {
            wrapper,
            variable,
            detail: format!("variable #{pos}: {}", parts.join("; ")),
        });
    }
    Ok(())
}

/// Overwrites `vars` on every rank with rank 0's values: one broadcast per bucket of at most
/// `bucket_bytes` (per dtype), all issued before the first is waited for. Integer variables
/// (index tables, counts: buffers, never parameters) travel together in one more broadcast, as
/// f64 ([`integers::encode`]), as torch broadcasts every buffer.
pub(crate) fn broadcast_from_rank_0(
    group: &ProcessGroup,
    vars: &[Var],
    bucket_bytes: usize,
) -> Result<()> {
    if group.world_size() == 1 || vars.is_empty() {
        return Ok(());
    }
    let (ints, floats): (Vec<&Var>, Vec<&Var>) = vars.iter().partition(|v| v.dtype().is_int());
    let params: Vec<BucketParam> = floats
        .iter()
        .enumerate()
        .map(|(index, v)| BucketParam {
            index,
            bytes: v.elem_count() * v.dtype().size_in_bytes(),
            dtype: v.dtype(),
        })
        .collect();
    let buckets = assign_buckets(&params, bucket_bytes, bucket_bytes);
    let works = buckets
        .iter()
        .map(|members| {
            let parts = members
                .iter()
                .map(|&i| floats[i].as_tensor().flatten_all())
                .collect::<candle_core::Result<Vec<_>>>()?;
            let flat = Tensor::cat(&parts, 0)?;
            group.broadcast_async(&flat, 0)
        })
        .collect::<Result<Vec<_>>>()?;
    let int_work = if ints.is_empty() {
        None
    } else {
        let parts = ints
            .iter()
            .map(|v| integers::encode(v.as_tensor()))
            .collect::<Result<Vec<_>>>()?;
        Some(group.broadcast_async(&Tensor::cat(&parts, 0)?, 0)?)
    };
    for (members, work) in buckets.iter().zip(works) {
        let flat = work.wait()?;
        let mut offset = 0;
        for &i in members {
            let v = floats[i];
            let n = v.elem_count();
            v.set(&flat.narrow(0, offset, n)?.reshape(v.shape())?)?;
            offset += n;
        }
    }
    if let Some(work) = int_work {
        let flat = work.wait()?;
        let mut offset = 0;
        for v in ints {
            let n = integers::encoded_len(v.dtype(), v.elem_count());
            let values = integers::decode(&flat.narrow(0, offset, n)?, v.dtype(), v.as_tensor())?;
            v.set(&values)?;
            offset += n;
        }
    }
    Ok(())
}

/// Whether variables of `dtype` travel in [`broadcast_from_rank_0`] ([`integers::carried`]:
/// every dtype the hook lets through).
pub(crate) fn travels(dtype: DType) -> bool {
    integers::carried(dtype)
}
