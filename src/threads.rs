//! Where a training loop on the CPU runs: on a worker of rayon's pool ([`in_pool`]), and with
//! candle's elementwise ops on the calling thread ([`one_pool`]).
//!
//! Matrix products (`gemm`) and this crate's kernels split their work over rayon's global pool
//! (`RAYON_NUM_THREADS` workers). Called from `main`, which is no worker, each split hands its
//! pieces to the workers and puts the thread to sleep until they are done: a transformer step of
//! small layers makes dozens of such splits, and each pays a wake-up and a sleep (a fifth of the
//! CPU time of `transformer_ddp` on 2 threads went to the scheduler). A loop run by
//! [`in_pool`] runs on a worker: its splits start on the thread itself, and the other workers
//! take pieces when they are awake. The same 2-thread `transformer_ddp` trained at 65,780–71,609
//! tokens/s inside the pool against 54,904–63,622 outside, and at 56,032–59,351 against
//! 38,102–42,770 on one thread (`--time-steps 300`, interleaved runs on the 2-core machine).
//!
//! candle 0.11 runs its own elementwise ops (adds, products, candle-nn's ReLU, their backward)
//! on a second pool, `candle-bp-N`, whose workers spin 25,000 rounds after every op before they
//! sleep, on the cores the next product wants. [`one_pool`] keeps those ops on the calling
//! thread (`CANDLE_NUM_THREADS=1`): inside the pool, the 2-thread transformer trained at
//! 62,481–71,609 tokens/s with it and 55,234–60,307 without; the 25 M MLP, whose time is in
//! products, saw no difference.
//!
//! Both are the program's choice, made at the start of `main`, as
//! [`crate::memory::keep_freed_memory`] is; `transformer_ddp` and `transformer_pp` make them.
//!
//! ```rust
//! fn main() -> candle_core::Result<()> {
//!     candle_parallel::threads::one_pool();
//!     candle_parallel::threads::in_pool(train)
//! }
//!
//! fn train() -> candle_core::Result<()> {
//!     assert!(rayon::current_thread_index().is_some());
//!     let x = candle_core::Tensor::ones((64, 64), candle_core::DType::F32, &candle_core::Device::Cpu)?;
//!     let y = x.matmul(&x)?;
//!     assert_eq!(y.sum_all()?.to_scalar::<f32>()?, 64.0 * 64.0 * 64.0);
//!     Ok(())
//! }
//! ```

/// candle's variable for the size of its elementwise pool.
pub const CANDLE_NUM_THREADS: &str = "CANDLE_NUM_THREADS";

/// Makes candle run its elementwise ops on the calling thread (sets [`CANDLE_NUM_THREADS`]
/// to one) unless the variable is set already; returns whether it set it. Call it at the start of
/// `main`, before other threads start and before candle's first op on the CPU (candle reads
/// the variable once, when its pool starts).
pub fn one_pool() -> bool {
    if std::env::var_os(CANDLE_NUM_THREADS).is_some() {
        return false;
    }
    std::env::set_var(CANDLE_NUM_THREADS, "1");
    true
}

/// Runs `f` on a worker thread of rayon's global pool and returns what it returns (a panic in
/// `f` comes back as a panic here); on a worker already, runs it in place. Before that it sizes
/// the pool as the process group will ([`crate::distributed::honour_omp_num_threads`], so that
/// `OMP_NUM_THREADS` from torchrun still counts) and gives each worker the main thread's stack
/// ([`crate::distributed::WORKER_STACK`]), where this call is the first to start the pool. Where
/// tensor work started the pool before (workers of rayon's 2 MiB stack, on which the backward
/// of a graph some thousands of ops deep overflows), it says so in the log: call it first thing
/// in `main`.
///
/// One training loop per process: `f` holds its worker while it waits, so threads that wait
/// for each other (the ranks of [`crate::distributed::spawn_threads`], each in its own
/// `in_pool`) hang when the pool has fewer workers than they are.
pub fn in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    crate::distributed::honour_omp_num_threads();
    let started_here = crate::distributed::build_global_pool(candle_core::utils::get_num_threads());
    if !started_here && !crate::distributed::global_pool_built_here() {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            log::warn!(
                "threads::in_pool: rayon's pool was started before it, by tensor work, with \
                 rayon's default 2 MiB stacks; the training loop runs on one of them, where the \
                 backward of a graph some thousands of ops deep overflows the stack (the main \
                 thread has 8 MiB): call in_pool first thing in main"
            )
        });
    }
    rayon::join(f, || ()).0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_pool_runs_on_a_worker_returns_the_result_and_passes_panics_on() {
        let caller = std::thread::current().id();
        let (on_worker, thread, nested) = in_pool(|| {
            let thread = std::thread::current().id();
            // Inside, a second call runs in place.
            let nested = in_pool(|| std::thread::current().id());
            (rayon::current_thread_index().is_some(), thread, nested)
        });
        assert!(on_worker);
        assert_ne!(thread, caller);
        assert_eq!(nested, thread);
        let caught = std::panic::catch_unwind(|| in_pool(|| panic!("inside the pool")));
        let message = caught.expect_err("the panic came back");
        assert_eq!(message.downcast_ref::<&str>(), Some(&"inside the pool"));
    }
}
