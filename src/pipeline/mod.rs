//! Pipeline parallelism (`torch.distributed.pipelining`).

pub mod schedule;
