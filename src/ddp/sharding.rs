//! ZeRO-2 inside DistributedDataParallel: gradients and optimizer state sharded over the ranks.

/// What each rank of [`DistributedDataParallel`](super::DistributedDataParallel) keeps.
///
/// With [`Sharding::Zero2`] (ZeRO stage 2, torch FSDP's `SHARD_GRAD_OP`), each parameter is cut
/// into one chunk per rank ([`crate::shard`]) and each gradient bucket is reduce-scattered
/// instead of all-reduced, as soon as it is ready in backward. Each rank keeps its piece of
/// each parameter as a variable of its own:
/// [`parameters`](super::DistributedDataParallel::parameters) gives the pieces (in the order,
/// and under the names, of the unsharded parameters), `backward` returns their averaged
/// gradients, and an optimizer made over them keeps state for its pieces only (the training
/// loop is the same as without sharding). A parameter that got a gradient on no rank gets none,
/// nor do its pieces: the optimizer leaves it and its state as they are, as in one process.
///
/// The pieces are put together into the model's parameters by an all-gather per bucket: at the
/// end of each step of this crate's optimizers ([`crate::optim::managed`]), so that the model,
/// its `VarMap` and an evaluation on any rank are current with no collective; with another
/// optimizer, by the next training forward, or by
/// [`gather_parameters`](super::DistributedDataParallel::gather_parameters) (an evaluation of a
/// model behind its pieces is [`crate::Error::StaleParameters`], at once).
///
/// The optimizer must update each element on its own (SGD, Adam, AdamW:
/// [`crate::optim::Sgd`], candle-nn's): one that looks across a whole tensor (LAMB, a gradient
/// norm) would see a piece.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Sharding {
    /// Every rank keeps every parameter, gradient and optimizer state (torch's DDP; default).
    #[default]
    None,
    /// Gradients and optimizer state sharded over the ranks (ZeRO-2).
    Zero2,
}
