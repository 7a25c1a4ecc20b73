//! The crate's internals, shared by its layers and used by no user: poison-tolerant locking,
//! the forward of autograd-hook ops, CUDA-to-CUDA copies ordered on both streams, and which
//! variables are buffers. They sit below every other module (the process groups' threads
//! backend uses the ordered copies too).

#[cfg(feature = "cuda")]
pub(crate) mod nvrtc;
pub(crate) mod ordered_copy;
pub(crate) mod pass_through;
pub(crate) mod plain_join;
pub(crate) mod sync;

use candle_core::DType;

/// The last path components of candle-nn's and torch's buffers, which live among the
/// variables but never get a gradient.
pub(crate) const BUFFER_NAMES: [&str; 3] = ["running_mean", "running_var", "num_batches_tracked"];

/// Whether the variable `name` of `dtype` is a buffer by default: an integer, or named as
/// candle-nn's and torch's buffers are ([`BUFFER_NAMES`]).
pub(crate) fn is_default_buffer(name: &str, dtype: DType) -> bool {
    let last = name.rsplit('.').next().unwrap_or(name);
    !dtype.is_float() || BUFFER_NAMES.contains(&last)
}
