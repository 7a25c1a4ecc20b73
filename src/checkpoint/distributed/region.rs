//! Where a piece of a tensor sits in the whole tensor, as runs of the whole tensor's elements in
//! row-major order: the arithmetic that lets any layout read any other layout's pieces.

use serde::{Deserialize, Serialize};

/// The part of a tensor (of a known whole shape) that one piece holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Region {
    /// A box: along each dimension, `sizes[d]` indices from `offsets[d]` (a tensor-parallel
    /// piece, a row block, or the whole tensor). The piece's own shape is `sizes`.
    Box {
        /// Where the box starts, per dimension.
        offsets: Vec<usize>,
        /// Its extent, per dimension.
        sizes: Vec<usize>,
    },
    /// `len` elements of the row-major flattened tensor from element `start` (a flat shard of
    /// ZeRO-2 or fully sharded data parallel). The piece is one-dimensional.
    Flat {
        /// The first element.
        start: usize,
        /// How many.
        len: usize,
    },
}

/// A run of elements: `len` of them from element `start` of the whole (flattened) tensor,
/// found from element `local` of the piece on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub start: usize,
    pub len: usize,
    pub local: usize,
}

impl Region {
    /// The whole of a tensor of `shape`.
    pub fn whole(shape: &[usize]) -> Self {
        Region::Box {
            offsets: vec![0; shape.len()],
            sizes: shape.to_vec(),
        }
    }

    /// The shape of the piece that holds this region.
    pub fn dims(&self) -> Vec<usize> {
        match self {
            Region::Box { sizes, .. } => sizes.clone(),
            Region::Flat { len, .. } => vec![*len],
        }
    }

    /// How many elements it holds.
    pub fn elem_count(&self) -> usize {
        match self {
            Region::Box { sizes, .. } => sizes.iter().product(),
            Region::Flat { len, .. } => *len,
        }
    }

    /// Why this region does not fit in a tensor of `shape`, if it does not.
    pub(crate) fn misfit(&self, shape: &[usize]) -> Option<String> {
        match self {
            Region::Box { offsets, sizes } => {
                if offsets.len() != shape.len() || sizes.len() != shape.len() {
                    return Some(format!(
                        "a box at {offsets:?} of size {sizes:?} has another rank than the \
                         tensor's shape {shape:?}"
                    ));
                }
                let out = (0..shape.len()).find(|&d| {
                    offsets[d]
                        .checked_add(sizes[d])
                        .is_none_or(|end| end > shape[d])
                });
                out.map(|d| {
                    format!(
                        "a box at {offsets:?} of size {sizes:?} reaches past the tensor's shape \
                         {shape:?} along dimension {d}"
                    )
                })
            }
            Region::Flat { start, len } => {
                let numel: usize = shape.iter().product();
                let end = start.checked_add(*len);
                end.is_none_or(|end| end > numel).then(|| {
                    format!(
                        "elements {start}..{} reach past the tensor's {numel} elements \
                         (shape {shape:?})",
                        start.saturating_add(*len)
                    )
                })
            }
        }
    }

    /// The runs of the whole tensor (of `shape`, which the region fits) that the region holds,
    /// in increasing order, which is also the piece's own row-major order.
    pub(crate) fn runs(&self, shape: &[usize]) -> Vec<Run> {
        match self {
            Region::Flat { start, len } => match len {
                0 => Vec::new(),
                _ => vec![Run {
                    start: *start,
                    len: *len,
                    local: 0,
                }],
            },
            Region::Box { offsets, sizes } => box_runs(shape, offsets, sizes),
        }
    }
}

/// The runs of a box: the trailing dimensions it spans whole merge into each run.
fn box_runs(shape: &[usize], offsets: &[usize], sizes: &[usize]) -> Vec<Run> {
    if sizes.contains(&0) {
        return Vec::new();
    }
    let n = shape.len();
    let mut strides = vec![1usize; n];
    for d in (0..n.saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    if n == 0 {
        return vec![Run {
            start: 0,
            len: 1,
            local: 0,
        }];
    }
    // The outermost dimension `k` after which the box spans every dimension whole: each run
    // is `sizes[k]` rows of everything inside.
    let mut k = n - 1;
    while k > 0 && offsets[k] == 0 && sizes[k] == shape[k] {
        k -= 1;
    }
    // Dimension `k` is the outermost of the run: its size times the rest.
    let len = sizes[k] * strides[k];
    let count: usize = sizes[..k].iter().product();
    let mut runs = Vec::with_capacity(count);
    let mut index = vec![0usize; k];
    for i in 0..count {
        let start = offsets[k] * strides[k]
            + (0..k)
                .map(|d| (offsets[d] + index[d]) * strides[d])
                .sum::<usize>();
        runs.push(Run {
            start,
            len,
            local: i * len,
        });
        for d in (0..k).rev() {
            index[d] += 1;
            if index[d] < sizes[d] {
                break;
            }
            index[d] = 0;
        }
    }
    runs
}

/// A copy from one piece to another: `len` elements from element `from` of the source piece
/// to element `to` of the destination piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Copy {
    pub from: usize,
    pub to: usize,
    pub len: usize,
}

/// Where the runs `source` and `dest` (each in increasing order) share elements: the copies
/// that move the shared elements from the source piece into the destination piece.
pub(crate) fn overlaps(source: &[Run], dest: &[Run]) -> Vec<Copy> {
    let (mut i, mut j) = (0, 0);
    let mut out = Vec::new();
    while i < source.len() && j < dest.len() {
        let (s, d) = (source[i], dest[j]);
        let lo = s.start.max(d.start);
        let hi = (s.start + s.len).min(d.start + d.len);
        if lo < hi {
            out.push(Copy {
                from: s.local + (lo - s.start),
                to: d.local + (lo - d.start),
                len: hi - lo,
            });
        }
        if s.start + s.len <= d.start + d.len {
            i += 1;
        } else {
            j += 1;
        }
    }
    out
}

/// Whether `regions` of a tensor of `shape` cover it exactly once; if not, the first element
/// range that is missing or held twice, said in words.
pub(crate) fn tiling_fault(shape: &[usize], regions: &[&Region]) -> Option<String> {
    let runs: Vec<Vec<Run>> = regions.iter().map(|r| r.runs(shape)).collect();
    runs_tiling_fault(shape.iter().product(), &runs)
}

/// [`tiling_fault`] of regions already made runs (each region's, of a tensor of `numel`
/// elements).
pub(crate) fn runs_tiling_fault(numel: usize, regions: &[Vec<Run>]) -> Option<String> {
    let mut runs: Vec<&Run> = regions.iter().flatten().collect();
    runs.sort_by_key(|r| r.start);
    let mut next = 0;
    for r in runs {
        if r.start > next {
            return Some(format!("elements {next}..{} are in no piece", r.start));
        }
        if r.start < next {
            return Some(format!(
                "elements {}..{} are in two different pieces",
                r.start,
                next.min(r.start + r.len)
            ));
        }
        next = r.start + r.len;
    }
    (next < numel).then(|| format!("elements {next}..{numel} are in no piece"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The elements of `region` of a tensor of `shape`, listed one by one.
    fn elements(shape: &[usize], region: &Region) -> Vec<usize> {
        region
            .runs(shape)
            .iter()
            .flat_map(|r| r.start..r.start + r.len)
            .collect()
    }

    /// The same, computed element by element from the box's definition.
    fn box_elements(shape: &[usize], offsets: &[usize], sizes: &[usize]) -> Vec<usize> {
        let numel: usize = shape.iter().product();
        (0..numel)
            .filter(|&flat| {
                let mut rest = flat;
                let mut inside = true;
                for d in (0..shape.len()).rev() {
                    let i = rest % shape[d];
                    rest /= shape[d];
                    inside &= i >= offsets[d] && i < offsets[d] + sizes[d];
                }
                inside
            })
            .collect()
    }

    #[test]
    fn box_runs_list_the_boxes_elements_in_order() {
        let cases: &[(&[usize], &[usize], &[usize])] = &[
            (&[4, 6], &[0, 3], &[4, 3]),
            (&[4, 6], &[2, 0], &[2, 6]),
            (&[4, 6], &[0, 0], &[4, 6]),
            (&[2, 3, 5], &[1, 1, 0], &[1, 2, 5]),
            (&[2, 3, 5], &[0, 1, 2], &[2, 2, 2]),
            (&[3, 1, 4], &[1, 0, 0], &[2, 1, 4]),
            (&[7], &[2], &[3]),
            (&[], &[], &[]),
            (&[3, 0], &[0, 0], &[3, 0]),
        ];
        for (shape, offsets, sizes) in cases {
            let region = Region::Box {
                offsets: offsets.to_vec(),
                sizes: sizes.to_vec(),
            };
            assert_eq!(region.misfit(shape), None);
            assert_eq!(
                elements(shape, &region),
                box_elements(shape, offsets, sizes),
                "{shape:?} {offsets:?} {sizes:?}"
            );
            let runs = region.runs(shape);
            let locals: usize = runs.iter().map(|r| r.len).sum();
            assert_eq!(locals, region.elem_count());
            for w in runs.windows(2) {
                assert_eq!(w[1].local, w[0].local + w[0].len);
            }
        }
    }

    #[test]
    fn overlaps_move_the_shared_elements_between_any_two_layouts() {
        let shape = [6, 4];
        let numel = 24;
        // Source pieces: column halves (tensor parallel). Destination: flat thirds (ZeRO).
        let sources = [
            Region::Box {
                offsets: vec![0, 0],
                sizes: vec![6, 2],
            },
            Region::Box {
                offsets: vec![0, 2],
                sizes: vec![6, 2],
            },
        ];
        let dests: Vec<Region> = (0..3)
            .map(|i| Region::Flat {
                start: i * 8,
                len: 8,
            })
            .collect();
        let whole: Vec<usize> = (0..numel).collect();
        let pieces: Vec<Vec<usize>> = sources
            .iter()
            .map(|r| elements(&shape, r).iter().map(|&e| whole[e]).collect())
            .collect();
        for d in &dests {
            let mut out = vec![usize::MAX; d.elem_count()];
            for (s, data) in sources.iter().zip(&pieces) {
                for c in overlaps(&s.runs(&shape), &d.runs(&shape)) {
                    out[c.to..c.to + c.len].copy_from_slice(&data[c.from..c.from + c.len]);
                }
            }
            assert_eq!(out, elements(&shape, d));
        }
        let refs: Vec<&Region> = sources.iter().collect();
        assert_eq!(tiling_fault(&shape, &refs), None);
        let refs: Vec<&Region> = dests.iter().collect();
        assert_eq!(tiling_fault(&shape, &refs), None);
        let gap = tiling_fault(&shape, &[&dests[0], &dests[2]]).unwrap();
        assert!(gap.contains("elements 8..16 are in no piece"), "{gap}");
        let twice = tiling_fault(&shape, &[&dests[0], &dests[1], &dests[2], &sources[0]]).unwrap();
        assert!(twice.contains("in two different pieces"), "{twice}");
        assert!(Region::Flat { start: 20, len: 8 }
            .misfit(&shape)
            .unwrap()
            .contains("reach past"));
    }
}
