//! Naming a group: the path of `new_group` calls that made it, from which every rank derives
//! the same keys in the store and the same id for its connections.

/// Which group a communicator serves: the whole world (the empty path) or a group made by
/// `new_group`, named by the path of `new_group` calls that made it. Every rank derives the
/// same name, so it keys the group's entries in the store and its connections.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct GroupPath(pub String);

impl GroupPath {
    /// The group made by the `new_group` call that was collective `seq` of this group.
    pub fn child(&self, seq: u64) -> Self {
        Self(format!("{}/{seq}", self.0))
    }

    /// A prefix for this group's store keys ("" for the world, whose keys predate groups).
    pub fn store_prefix(&self) -> String {
        if self.0.is_empty() {
            String::new()
        } else {
            format!("group{}/", self.0)
        }
    }

    /// This group's id within `job`: the job's own id for the world, a mix of both for others,
    /// so that connections meant for one group are refused by another.
    pub fn id_within(&self, job: u64) -> u64 {
        if self.0.is_empty() {
            job
        } else {
            crate::rng::fnv1a(self.0.as_bytes()) ^ job.rotate_left(17)
        }
    }
}
