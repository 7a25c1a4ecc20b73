//! Our CUDA kernels' sources compiled at run time by NVRTC (no headers, no nvcc where the
//! binary runs): once per process and source.

use candle_core::cuda_backend::cudarc::nvrtc;
use candle_core::Result;
use std::sync::OnceLock;

/// The PTX of the CUDA source `src` (`what` names it in errors), compiled by NVRTC into `cell`
/// on first use, once per process.
pub(crate) fn compiled(
    cell: &'static OnceLock<std::result::Result<String, String>>,
    src: &str,
    what: &str,
) -> Result<&'static str> {
    let ptx = cell.get_or_init(|| {
        nvrtc::compile_ptx(src)
            .map(|ptx| ptx.to_src())
            .map_err(|e| e.to_string())
    });
    match ptx {
        Ok(ptx) => Ok(ptx),
        Err(e) => candle_core::bail!(
            "compiling candle_parallel's {what} with NVRTC failed: {e}; libnvrtc.so and \
             libnvrtc-builtins.so (CUDA 12 or 13) must be on the library path"
        ),
    }
}
