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

/// What a rank holds for training, in bytes: parameters, gradients and optimizer state, as the
/// sharded wrappers report them, and the process's peak resident memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// Parameters kept between steps.
    pub parameters: usize,
    /// Gradients handed to the optimizer.
    pub gradients: usize,
    /// The optimizer's state ([`optimizer_state_bytes`]).
    pub optimizer: usize,
    /// The process's peak resident memory so far ([`peak_rss_bytes`]), where known.
    pub peak_rss: Option<usize>,
}

/// The process's peak resident memory so far, in bytes (`VmHWM` in `/proc/self/status`);
/// `None` where there is no such file.
///
/// ```rust
/// if let Some(peak) = candle_parallel::memory::peak_rss_bytes() {
///     assert!(peak > 0);
/// }
/// ```
pub fn peak_rss_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: usize = line
        .trim_start_matches("VmHWM:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// The bytes of the elements of `tensors` (each as its shape and dtype say; views count whole).
pub fn tensor_bytes<'a>(tensors: impl IntoIterator<Item = &'a candle_core::Tensor>) -> usize {
    tensors
        .into_iter()
        .map(|t| t.elem_count() * t.dtype().size_in_bytes())
        .sum()
}

/// The bytes of an optimizer's state: every per-variable state tensor (momentum buffers,
/// AdamW's moments) of [`crate::optim::ElementwiseOptimizer::state`].
pub fn optimizer_state_bytes(optimizer: &impl crate::optim::ElementwiseOptimizer) -> usize {
    let state = optimizer.state();
    tensor_bytes(state.per_var.iter().flat_map(|m| m.values()))
}

/// Allocations from this size up are fresh pages from the kernel (glibc maps blocks above its
/// mmap threshold, at most 32 MiB, on their own), faulted in on first write.
const HUGE_FROM: usize = 32 << 20;

/// A huge page, as transparent huge pages map them on x86-64 and arm64.
const HUGE_PAGE: usize = 2 << 20;

/// `len` zeros, for a buffer written whole right away (a large weight gradient): from
/// [`HUGE_FROM`] bytes up, the C allocator maps fresh pages each time, and writing them faults
/// them in 4 KiB at a time (16,384 faults for a 64 MiB gradient, every step); here the kernel is
/// asked to back them with 2 MiB pages where transparent huge pages are on `madvise`.
pub(crate) fn zeroed_f32(len: usize) -> Vec<f32> {
    let v = vec![0f32; len];
    #[cfg(target_os = "linux")]
    {
        let bytes = len * std::mem::size_of::<f32>();
        let start = v.as_ptr() as usize;
        let (first, end) = (
            start.next_multiple_of(HUGE_PAGE),
            (start + bytes) & !(HUGE_PAGE - 1),
        );
        if bytes >= HUGE_FROM && end > first {
            // SAFETY: the range lies inside `v`'s allocation, which lives; MADV_HUGEPAGE only
            // advises the kernel and changes no contents. Its failure (no THP) is harmless.
            unsafe {
                libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
            }
        }
    }
    v
}
