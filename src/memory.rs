//! The C allocator tuned for training loops: freed tensor memory kept for the next step.
//!
//! candle allocates a fresh buffer for every op's output and frees it when the tensor drops, so
//! a training step allocates and frees the same few megabytes again and again. glibc's
//! allocator gives freed memory at the top of its heaps back to the kernel (its trim and mmap
//! thresholds) and the next step faults it back in page by page: on the CIFAR-10 Net at batch
//! 128 on 2 cores, a third of the step went to page faults, and keeping the memory made the
//! step 1.6x faster (`cargo bench --bench dp_throughput`).
//!
//! This is a process-wide choice that belongs to the program, not to a library it links, so
//! nothing here runs unless the program asks: the examples and benchmarks call
//! [`keep_freed_memory`] first. The same can be had without code from the environment
//! (`MALLOC_TRIM_THRESHOLD_=134217728 MALLOC_MMAP_THRESHOLD_=33554432`).
//!
//! ```rust
//! // At the start of main, before threads start.
//! let tuned = candle_parallel::memory::keep_freed_memory();
//! assert_eq!(tuned, cfg!(all(target_os = "linux", target_env = "gnu")));
//! ```

/// Blocks up to this size come from the heap, where freed memory is reused (glibc's default
/// starts at 128 KiB and rises only as far as blocks are freed).
pub const MMAP_THRESHOLD: usize = 32 << 20;

/// Free memory at the top of a heap is kept up to this size.
pub const TRIM_THRESHOLD: usize = 128 << 20;

/// Makes glibc's allocator keep freed memory (up to [`TRIM_THRESHOLD`] per heap) and serve
/// blocks up to [`MMAP_THRESHOLD`] from its heaps. Returns whether it did: `false` where the C
/// library is not glibc, where this does nothing.
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let threshold = |v: usize| libc::c_int::try_from(v).unwrap_or(libc::c_int::MAX);
        // SAFETY: mallopt only sets allocator parameters; it is safe to call at any time.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, threshold(MMAP_THRESHOLD)) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, threshold(TRIM_THRESHOLD)) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
