//! Device meshes: the ranks of a group laid out as an n-dimensional array with named
//! dimensions, and a process group along each dimension (torch's `init_device_mesh`).
//!
//! The layout is torch's: `torch.arange(world).reshape(shape)`, row-major, so the last dimension
//! holds consecutive ranks. In a `[("dp", 2), ("tp", 4)]` mesh of 8 ranks the "tp" groups are
//! `[0, 1, 2, 3]` and `[4, 5, 6, 7]`, the "dp" groups `[0, 4]`, `[1, 5]`, `[2, 6]` and `[3, 7]`:
//! put the dimension whose traffic is heaviest (tensor parallel) last, so that its ranks are
//! neighbours on one machine. The arithmetic ([`MeshLayout`]) is pure; [`DeviceMesh`] adds the
//! groups, made by [`ProcessGroup::new_group`] on every rank in one order. A group is accepted
//! wherever a group is: `DistributedDataParallel::new(&varmap, mesh.get_group("dp")?, ...)`
//! averages gradients over the "dp" dimension only.
//!
//! ```rust
//! use candle_core::{Device, Tensor};
//! use candle_parallel::distributed::{self, DeviceMesh, ReduceOp};
//! # fn main() -> candle_parallel::Result<()> {
//! let sums = distributed::spawn_threads(4, |pg| {
//!     let mesh = DeviceMesh::new(&pg, &[("dp", 2), ("tp", 2)])?;
//!     let x = Tensor::new(&[pg.rank() as f32], &Device::Cpu)?;
//!     let dp_sum = mesh.get_group("dp")?.all_reduce(&x, ReduceOp::Sum)?;
//!     Ok((mesh.coordinate().to_vec(), dp_sum.to_vec1::<f32>()?[0]))
//! })?;
//! // Ranks 0 and 2 form one "dp" group, ranks 1 and 3 the other.
//! assert_eq!(sums[0], (vec![0, 0], 2.0));
//! assert_eq!(sums[1], (vec![0, 1], 4.0));
//! assert_eq!(sums[2], (vec![1, 0], 2.0));
//! assert_eq!(sums[3], (vec![1, 1], 4.0));
//! # Ok(()) }
//! ```

use super::group::ProcessGroup;
use crate::error::{Error, Result};
use candle_core::Device;
use std::fmt;

/// The shape and names of a mesh and its coordinate arithmetic, without any group: which ranks
/// share a group along which dimensions. The same on every rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeshLayout {
    names: Vec<String>,
    shape: Vec<usize>,
}

impl fmt::Display for MeshLayout {
    /// "[dp 2, tp 4]".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> = self
            .names
            .iter()
            .zip(&self.shape)
            .map(|(n, s)| format!("{n} {s}"))
            .collect();
        write!(f, "[{}]", dims.join(", "))
    }
}

fn invalid(what: &'static str, detail: String) -> Error {
    Error::InvalidArgument { what, detail }
}

impl MeshLayout {
    /// A layout of named dimensions, outermost first. Names must be non-empty and distinct,
    /// sizes at least 1, and there must be at least one dimension.
    pub fn new(dims: &[(&str, usize)]) -> Result<Self> {
        if dims.is_empty() {
            return Err(invalid(
                "device mesh shape",
                "no dimensions given; name at least one, e.g. &[(\"dp\", world_size)]".into(),
            ));
        }
        for (i, &(name, size)) in dims.iter().enumerate() {
            if name.is_empty() {
                return Err(invalid(
                    "device mesh dimension name",
                    format!("dimension {i} has an empty name; give every dimension a name"),
                ));
            }
            if dims[..i].iter().any(|&(n, _)| n == name) {
                return Err(invalid(
                    "device mesh dimension name",
                    format!("`{name}` names two dimensions; give each dimension its own name"),
                ));
            }
            if size == 0 {
                return Err(invalid(
                    "device mesh shape",
                    format!("dimension `{name}` has size 0; every dimension needs at least 1 rank"),
                ));
            }
        }
        let layout = Self {
            names: dims.iter().map(|&(n, _)| n.to_string()).collect(),
            shape: dims.iter().map(|&(_, s)| s).collect(),
        };
        if layout
            .shape
            .iter()
            .try_fold(1usize, |a, &s| a.checked_mul(s))
            .is_none()
        {
            return Err(invalid(
                "device mesh shape",
                format!("{layout} holds more ranks than a usize counts"),
            ));
        }
        Ok(layout)
    }

    /// The sizes of the dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The names of the dimensions, outermost first.
    pub fn dim_names(&self) -> &[String] {
        &self.names
    }

    /// The number of ranks the mesh holds: the product of its sizes.
    pub fn world_size(&self) -> usize {
        self.shape.iter().product()
    }

    /// The index of the dimension called `name`.
    pub fn dim(&self, name: &str) -> Result<usize> {
        self.names.iter().position(|n| n == name).ok_or_else(|| {
            invalid(
                "device mesh dimension",
                format!(
                    "no dimension is called `{name}`; {self} has {}",
                    self.names.join(", ")
                ),
            )
        })
    }

    /// The coordinate of `rank`, one index per dimension (row-major: the last varies fastest).
    pub fn coordinate(&self, rank: usize) -> Result<Vec<usize>> {
        self.check_rank(rank)?;
        let mut rest = rank;
        let mut coordinate = vec![0; self.shape.len()];
        for (c, &s) in coordinate.iter_mut().zip(&self.shape).rev() {
            *c = rest % s;
            rest /= s;
        }
        Ok(coordinate)
    }

    /// The rank at `coordinate`.
    pub fn rank(&self, coordinate: &[usize]) -> Result<usize> {
        if coordinate.len() != self.shape.len()
            || coordinate.iter().zip(&self.shape).any(|(c, s)| c >= s)
        {
            return Err(invalid(
                "device mesh coordinate",
                format!(
                    "{coordinate:?} is outside {self}; give one index per dimension, each below \
                     its size"
                ),
            ));
        }
        Ok(coordinate
            .iter()
            .zip(&self.shape)
            .fold(0, |rank, (c, s)| rank * s + c))
    }

    /// The ranks that share a group with `rank` along the dimensions `dims` (indices, in
    /// increasing order): those whose coordinates differ from its own in `dims` only, in
    /// increasing order (row-major over `dims`). Along one dimension `d`, the rank at index `i`
    /// of the list has coordinate `i` there.
    pub fn group_of(&self, rank: usize, dims: &[usize]) -> Result<Vec<usize>> {
        self.check_dims(dims)?;
        let mut coordinate = self.coordinate(rank)?;
        let size: usize = dims.iter().map(|&d| self.shape[d]).product();
        let mut members = Vec::with_capacity(size);
        for mut i in 0..size {
            for &d in dims.iter().rev() {
                coordinate[d] = i % self.shape[d];
                i /= self.shape[d];
            }
            members.push(self.rank(&coordinate)?);
        }
        Ok(members)
    }

    /// Every group along `dims`, ordered by their first rank: the order in which every rank
    /// creates them.
    pub fn groups(&self, dims: &[usize]) -> Result<Vec<Vec<usize>>> {
        self.check_dims(dims)?;
        (0..self.world_size())
            .filter(|&r| {
                let c = self.coordinate(r).expect("a rank of the mesh");
                dims.iter().all(|&d| c[d] == 0)
            })
            .map(|r| self.group_of(r, dims))
            .collect()
    }

    fn check_rank(&self, rank: usize) -> Result<()> {
        if rank >= self.world_size() {
            return Err(invalid(
                "device mesh rank",
                format!(
                    "rank {rank} is outside {self}, which holds ranks 0..{}",
                    self.world_size()
                ),
            ));
        }
        Ok(())
    }

    fn check_dims(&self, dims: &[usize]) -> Result<()> {
        if dims.is_empty()
            || dims.windows(2).any(|w| w[0] >= w[1])
            || dims.iter().any(|&d| d >= self.shape.len())
        {
            return Err(invalid(
                "device mesh dimensions",
                format!(
                    "{dims:?} for {self}: name one or more of its dimensions, each once, in the \
                     mesh's order"
                ),
            ));
        }
        Ok(())
    }
}

/// A mesh over the ranks of a group, with this rank's group along each dimension (torch's
/// `DeviceMesh`). Every rank builds the same mesh, at the same point of its program: building
/// it is a collective on the group it is made from.
#[derive(Clone, Debug)]
pub struct DeviceMesh {
    layout: MeshLayout,
    world: ProcessGroup,
    coordinate: Vec<usize>,
    groups: Vec<ProcessGroup>,
}

impl DeviceMesh {
    /// Lays the ranks of `group` out as `dims` (name and size, outermost first; the sizes must
    /// multiply to the group's size) and makes the groups along every dimension. Every rank of
    /// `group` must call it with the same `dims`. A dimension that spans the whole group reuses
    /// `group` itself, as torch does.
    pub fn new(group: &ProcessGroup, dims: &[(&str, usize)]) -> Result<Self> {
        let layout = MeshLayout::new(dims)?;
        if layout.world_size() != group.world_size() {
            return Err(invalid(
                "device mesh shape",
                format!(
                    "{layout} holds {} ranks but the group has {}; choose sizes whose product \
                     is the world size (rank {})",
                    layout.world_size(),
                    group.world_size(),
                    group.rank()
                ),
            ));
        }
        let coordinate = layout.coordinate(group.rank())?;
        let whole: Vec<usize> = (0..group.world_size()).collect();
        let mut groups = Vec::with_capacity(dims.len());
        for d in 0..dims.len() {
            let all = layout.groups(&[d])?;
            if all.len() == 1 && all[0] == whole {
                groups.push(group.clone());
                continue;
            }
            let mut mine = None;
            for members in &all {
                if let Some(g) = group.new_group(members)? {
                    mine = Some(g);
                }
            }
            groups.push(mine.expect("every rank is in one group along each dimension"));
        }
        Ok(Self {
            layout,
            world: group.clone(),
            coordinate,
            groups,
        })
    }

    /// Joins the group the launcher's environment describes ([`ProcessGroup::from_env`]) and
    /// lays it out as `dims`: torch's `init_device_mesh`.
    pub fn from_env(device: &Device, dims: &[(&str, usize)]) -> Result<Self> {
        Self::new(&ProcessGroup::from_env(device)?, dims)
    }

    /// The mesh's shape, names and arithmetic.
    pub fn layout(&self) -> &MeshLayout {
        &self.layout
    }

    /// The group the mesh was made from: all of its ranks.
    pub fn world(&self) -> &ProcessGroup {
        &self.world
    }

    /// This rank's coordinate, one index per dimension.
    pub fn coordinate(&self) -> &[usize] {
        &self.coordinate
    }

    /// This rank's group along dimension `name`.
    pub fn get_group(&self, name: &str) -> Result<&ProcessGroup> {
        Ok(&self.groups[self.layout.dim(name)?])
    }

    /// The size of dimension `name`.
    pub fn size(&self, name: &str) -> Result<usize> {
        Ok(self.layout.shape[self.layout.dim(name)?])
    }

    /// This rank's index along dimension `name`: its rank in [`DeviceMesh::get_group`]'s group.
    pub fn local_rank(&self, name: &str) -> Result<usize> {
        Ok(self.coordinate[self.layout.dim(name)?])
    }

    /// One group along several dimensions taken as one (torch's `_flatten`: `["dp", "cp"]`
    /// gives the ranks that differ only in "dp" and "cp"), named in the mesh's order. A
    /// collective on the mesh's group: every rank calls it with the same names.
    pub fn flatten(&self, names: &[&str]) -> Result<ProcessGroup> {
        let dims = names
            .iter()
            .map(|n| self.layout.dim(n))
            .collect::<Result<Vec<_>>>()?;
        let mut mine = None;
        for members in self.layout.groups(&dims)? {
            if let Some(g) = self.world.new_group(&members)? {
                mine = Some(g);
            }
        }
        Ok(mine.expect("every rank is in one group along any dimensions"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_2_by_4_mesh_has_torchs_groups() -> Result<()> {
        // torch: init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp")).
        let mesh = MeshLayout::new(&[("dp", 2), ("tp", 4)])?;
        assert_eq!(mesh.groups(&[1])?, [[0, 1, 2, 3], [4, 5, 6, 7]]);
        assert_eq!(mesh.groups(&[0])?, [[0, 4], [1, 5], [2, 6], [3, 7]]);
        assert_eq!(mesh.groups(&[0, 1])?, [[0, 1, 2, 3, 4, 5, 6, 7]]);
        assert_eq!(mesh.coordinate(6)?, [1, 2]);
        assert_eq!(mesh.rank(&[1, 2])?, 6);
        assert_eq!(mesh.group_of(6, &[0])?, [2, 6]);
        Ok(())
    }

    #[test]
    fn coordinates_and_ranks_invert_each_other_in_three_dimensions() -> Result<()> {
        let mesh = MeshLayout::new(&[("pp", 3), ("dp", 2), ("tp", 2)])?;
        for rank in 0..12 {
            let c = mesh.coordinate(rank)?;
            assert_eq!(mesh.rank(&c)?, rank);
            // Row-major: the last dimension holds consecutive ranks.
            assert_eq!(rank, c[0] * 4 + c[1] * 2 + c[2]);
            for d in 0..3 {
                let g = mesh.group_of(rank, &[d])?;
                assert_eq!(g[c[d]], rank, "rank {rank} sits at its own index along {d}");
            }
        }
        assert_eq!(mesh.groups(&[0])?[..2], [[0, 4, 8], [1, 5, 9]]);
        assert_eq!(mesh.groups(&[0, 2])?[1], [2, 3, 6, 7, 10, 11]);
        Ok(())
    }

    #[test]
    fn the_groups_along_a_dimension_cover_every_rank_once() -> Result<()> {
        let mesh = MeshLayout::new(&[("a", 2), ("b", 3), ("c", 1), ("d", 2)])?;
        for dims in [
            vec![0],
            vec![1],
            vec![2],
            vec![3],
            vec![1, 3],
            vec![0, 1, 2, 3],
        ] {
            let mut seen: Vec<usize> = mesh.groups(&dims)?.concat();
            seen.sort();
            assert_eq!(seen, (0..12).collect::<Vec<_>>(), "{dims:?}");
        }
        Ok(())
    }

    #[test]
    fn bad_shapes_names_and_coordinates_are_refused_with_what_to_do() {
        let err = |r: Result<MeshLayout>| r.unwrap_err().to_string();
        assert!(err(MeshLayout::new(&[])).contains("at least one"));
        assert!(err(MeshLayout::new(&[("", 2)])).contains("empty name"));
        assert!(err(MeshLayout::new(&[("dp", 2), ("dp", 2)])).contains("`dp` names two"));
        assert!(err(MeshLayout::new(&[("dp", 0)])).contains("size 0"));
        assert!(err(MeshLayout::new(&[("a", usize::MAX), ("b", 2)])).contains("more ranks"));
        let mesh = MeshLayout::new(&[("dp", 2), ("pp", 2)]).unwrap();
        let e = mesh.dim("tp").unwrap_err().to_string();
        assert!(e.contains("`tp`") && e.contains("dp, pp"), "{e}");
        assert!(mesh.coordinate(4).unwrap_err().to_string().contains("0..4"));
        assert!(mesh.rank(&[0, 2]).is_err());
        assert!(mesh.rank(&[0]).is_err());
        assert!(mesh.groups(&[1, 0]).is_err());
        assert!(mesh.groups(&[]).is_err());
        assert!(mesh.groups(&[2]).is_err());
    }
}
