//! The crate's internals, shared by its layers and used by no user: poison-tolerant locking,
//! the forward of autograd-hook ops, and CUDA-to-CUDA copies ordered on both streams. They sit
//! below every other module (the process groups' threads backend uses the ordered copies too).

pub(crate) mod ordered_copy;
pub(crate) mod pass_through;
pub(crate) mod sync;
