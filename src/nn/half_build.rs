//! Whether this build leaves candle's bf16 and f16 element-wise CPU ops on their slow path
//! ([`half_build_flags_missing`]), and the warning the layers and the data-parallel wrappers
//! log when they compute in those dtypes there.

use candle_core::DType;
use std::sync::Once;

/// The `-C target-feature` flags that this build lacks for candle's element-wise CPU ops in
/// `dtype` to take their fast path on this CPU: `+avx512bf16,+avx512vl` for bf16 on a CPU with
/// AVX512-BF16 and AVX512-VL, `+f16c` for f16 on a CPU with F16C; `None` where the build has
/// them, the CPU has not, or `dtype` is another. `RUSTFLAGS="-C target-cpu=native"` enables
/// them all, for this CPU's kind only.
///
/// candle 0.11's bf16 and f16 element-wise ops (every add, and in backward the add of every
/// gradient to its store) convert 8 values at a time with the CPU's conversion instructions,
/// found at run time. Where the build does not enable them, each conversion is a call the
/// compiler cannot inline (bf16) or a loop over the values (f16): a zeros-and-add of a million
/// values took 36 ms in bf16 and 10.5 ms in f16 on the Xeon of `docs/BENCHMARKS.md`, against
/// 0.47 ms in both with the features (and 2 ms in f32), and `transformer_ddp --precision bf16`
/// ran 5-7x faster built with them (`docs/CPU_SPEED.md`). Built with AVX512-BF16, candle's
/// bf16 adds round through `vcvtneps2bf16`, which treats subnormal inputs as zero and flushes
/// subnormal results: results near zero may differ from the default build's.
///
/// This crate's layers, and `DistributedDataParallel` and `FullyShardedDataParallel` with
/// mixed precision, log what this returns once per dtype when they compute in bf16 or f16 on
/// the CPU (a program that turns this crate's CPU kernels off and computes in bf16 with
/// candle's own layers is as slow, and is not told).
///
/// ```rust
/// use candle_core::DType;
/// use candle_parallel::nn::half_build_flags_missing;
/// // f32 never needs them; on a CPU without the instructions nothing is missing either.
/// assert_eq!(half_build_flags_missing(DType::F32), None);
/// if let Some(flags) = half_build_flags_missing(DType::BF16) {
///     println!("build with RUSTFLAGS=\"-C target-feature={flags}\" for fast bf16 tensors");
/// }
/// ```
pub fn half_build_flags_missing(dtype: DType) -> Option<&'static str> {
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    {
        match dtype {
            DType::BF16 => {
                let built = cfg!(all(
                    target_feature = "avx512bf16",
                    target_feature = "avx512vl"
                ));
                let here =
                    is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512vl");
                (here && !built).then_some("+avx512bf16,+avx512vl")
            }
            DType::F16 => {
                let built = cfg!(target_feature = "f16c");
                (is_x86_feature_detected!("f16c") && !built).then_some("+f16c")
            }
            _ => None,
        }
    }
    #[cfg(not(any(target_arch = "x86", target_arch = "x86_64")))]
    {
        let _ = dtype;
        None
    }
}

/// Logs, once per process and dtype, that `dtype` tensors on the CPU are slow in this build,
/// with the flags to build with ([`half_build_flags_missing`]); `why` says what computes in
/// that dtype. Nothing where the build has them.
pub(crate) fn warn_if_half_is_slow(dtype: DType, why: &str) {
    static BF16: Once = Once::new();
    static F16: Once = Once::new();
    let once = match dtype {
        DType::BF16 => &BF16,
        DType::F16 => &F16,
        _ => return,
    };
    if once.is_completed() {
        return; // said already (the layers call this on every forward)
    }
    let Some(flags) = half_build_flags_missing(dtype) else {
        return;
    };
    once.call_once(|| {
        let instead = if dtype == DType::BF16 && super::bf16_tiles_available() {
            ", or keep the model in f32 and call candle_parallel::nn::\
             set_float32_matmul_precision(MatmulPrecision::Medium), whose linear layers round \
             their products' operands to bf16 on this CPU's AMX tiles"
        } else {
            ""
        };
        log::warn!(
            "{why} computes in {dtype:?} on the CPU, and this build leaves candle's {dtype:?} \
             element-wise ops (and the add of every gradient in backward) on their slow path, \
             20-80x slower than built for this CPU (a zeros-and-add of 1 M values: 36 ms in \
             bf16, 10.5 ms in f16, 0.47 ms built with the features): build with \
             RUSTFLAGS=\"-C target-feature={flags}\" (or \"-C target-cpu=native\" for this \
             CPU's kind only){instead}; see docs/CPU_SPEED.md"
        );
    });
}
