//! One iteration of DistributedDataParallel's reducer, from a forward to the end of its
//! backward: where it stands ([`Phase`]), the gradients that came in, and each bucket's
//! progress ([`Bucket`], torch's `Reducer::Bucket`). Everything here is forgotten at the end of
//! the iteration, in one assignment: `Iteration::default()`.

use crate::distributed::Work;
use crate::error::{Error, Result};
use candle_core::Tensor;

/// One bucket in the current iteration (torch's `Reducer::Bucket`).
pub(super) struct Bucket {
    /// Its parameters, in the order they travel.
    pub(super) params: Vec<usize>,
    /// How many of their gradients are still to come in.
    pub(super) pending: usize,
    /// Its all-reduce, once issued (never with one rank).
    pub(super) work: Option<Work<Vec<Tensor>>>,
}

impl Bucket {
    fn new(params: &[usize]) -> Self {
        Self {
            params: params.to_vec(),
            pending: params.len(),
            work: None,
        }
    }

    /// The bucket's gradients averaged over the world, in the order of its parameters: its
    /// all-reduce's result, or with one rank (nothing issued) the gradients themselves, taken
    /// from `grads`.
    pub(super) fn wait(&mut self, grads: &mut [Option<Tensor>]) -> Result<Vec<Tensor>> {
        match self.work.take() {
            Some(work) => work.wait(),
            None => Ok(self
                .params
                .iter()
                .map(|&i| grads[i].take().expect("every gradient is in"))
                .collect()),
        }
    }
}

/// Where the current iteration stands, and what becomes of its gradients.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Phase {
    /// Between a finished backward and the next forward.
    #[default]
    Idle,
    /// After a forward: gradients may come in, to be averaged over the world.
    Reducing,
    /// After a forward under no_sync: gradients may come in, to be summed on this rank.
    Accumulating,
}

/// Everything that lives for one iteration, from a forward to the end of its backward; the
/// default is the idle state between iterations, so that a reset is one assignment.
#[derive(Default)]
pub(super) struct Iteration {
    pub(super) phase: Phase,
    /// This iteration's gradients, per parameter (with any no_sync sums added).
    pub(super) grads: Vec<Option<Tensor>>,
    /// The buckets, in the order they are issued.
    pub(super) buckets: Vec<Bucket>,
    /// The next bucket to issue.
    pub(super) next: usize,
    /// Parameters in the order their gradients came in.
    pub(super) ready_order: Vec<usize>,
    /// The first failure, reported by `finalize_backward`.
    pub(super) error: Option<Error>,
}

impl Iteration {
    /// A new iteration over `buckets` (each a list of parameter indices) and `params`
    /// parameters, in `phase`.
    pub(super) fn start(phase: Phase, buckets: &[Vec<usize>], params: usize) -> Self {
        Self {
            phase,
            grads: vec![None; params],
            buckets: buckets.iter().map(|b| Bucket::new(b)).collect(),
            next: 0,
            ready_order: Vec::new(),
            error: None,
        }
    }
}
