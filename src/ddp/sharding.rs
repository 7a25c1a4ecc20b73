//! ZeRO-2 inside DistributedDataParallel: gradients and optimizer state sharded over the ranks.

/// What each rank of [`DistributedDataParallel`](super::DistributedDataParallel) keeps.
///
/// With [`Sharding::Zero2`] (ZeRO stage 2, torch FSDP's `SHARD_GRAD_OP`), each gradient bucket
/// is laid out flat ([`crate::shard::FlatLayout`]) and reduce-scattered instead of all-reduced,
/// as soon as it is ready in backward. Each rank keeps its shard of each bucket's averaged
/// gradient, and of the parameters as variables of their own:
/// [`parameters`](super::DistributedDataParallel::parameters) gives those shards, `backward`
/// returns their gradients, and an optimizer made over them keeps state for its shard only
/// (the training loop is the same as without sharding). The next forward all-gathers the
/// updated shards into the model's parameters, bucket after bucket.
///
/// The optimizer must update each element on its own (SGD, Adam, AdamW:
/// [`crate::optim::Sgd`], candle-nn's): one that looks across a whole tensor (LAMB, a gradient
/// norm) would see a shard. A parameter used on no rank gets zeros within its shard (it is still
/// reported), and the buckets are not rebuilt after the first iteration, since the optimizer
/// holds the shards cut from them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Sharding {
    /// Every rank keeps every parameter, gradient and optimizer state (torch's DDP; default).
    #[default]
    None,
    /// Gradients and optimizer state sharded over the ranks (ZeRO-2).
    Zero2,
}
