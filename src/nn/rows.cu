// The CUDA kernels of candle_parallel::nn's row layers (see fused_cuda.rs): layer and RMS
// normalisation and softmax over the last dimension, one warp per row. They follow the CPU
// kernels' rule (rows.rs): sums in f32 (f64 for f64), the corrected two-pass variance (the mean
// as a shift plus the mean of the deviations from it), each output rounded once. Compiled at
// run time by NVRTC, so they need no headers: half types travel as their 16 bits.

struct F32 {
    typedef float T;
    typedef float A;
    static __device__ float up(float x) { return x; }
    static __device__ float down(float a) { return a; }
    static __device__ float neg_inf() { return __int_as_float(0xff800000); }
    static __device__ float exp_(float a) { return expf(a); }
    static __device__ float rsqrt_(float a) { return 1.0f / sqrtf(a); }
};

struct F64 {
    typedef double T;
    typedef double A;
    static __device__ double up(double x) { return x; }
    static __device__ double down(double a) { return a; }
    static __device__ double neg_inf() { return __longlong_as_double(0xfff0000000000000ULL); }
    static __device__ double exp_(double a) { return exp(a); }
    static __device__ double rsqrt_(double a) { return 1.0 / sqrt(a); }
};

struct F16 {
    typedef unsigned short T;
    typedef float A;
    static __device__ float up(unsigned short h) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
    }
    static __device__ unsigned short down(float f) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
        return h;
    }
    static __device__ float neg_inf() { return F32::neg_inf(); }
    static __device__ float exp_(float a) { return expf(a); }
    static __device__ float rsqrt_(float a) { return 1.0f / sqrtf(a); }
};

struct BF16 {
    typedef unsigned short T;
    typedef float A;
    static __device__ float up(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }
    // Round to nearest even; NaN stays a (quiet) NaN.
    static __device__ unsigned short down(float f) {
        unsigned int u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            return (unsigned short)((u >> 16) | 0x0040u);
        }
        u += 0x7fffu + ((u >> 16) & 1u);
        return (unsigned short)(u >> 16);
    }
    static __device__ float neg_inf() { return F32::neg_inf(); }
    static __device__ float exp_(float a) { return expf(a); }
    static __device__ float rsqrt_(float a) { return 1.0f / sqrtf(a); }
};

template <typename A>
__device__ A warp_sum(A v) {
    for (int mask = 16; mask > 0; mask >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, mask, 32);
    }
    return v;
}

// NaN is no maximum: a row holding one comes out NaN through its exponential.
template <typename A>
__device__ A warp_max(A v) {
    for (int mask = 16; mask > 0; mask >>= 1) {
        A other = __shfl_xor_sync(0xffffffffu, v, mask, 32);
        if (other > v) {
            v = other;
        }
    }
    return v;
}

// Layer (remove_mean) or RMS normalisation of row blockIdx.x * blockDim.y + threadIdx.y, by
// the warp of lanes threadIdx.x; beta may be null.
template <typename E>
__device__ void norm(const typename E::T *x, typename E::T *y, const typename E::T *alpha,
                     const typename E::T *beta, int rows, int n, float eps, int remove_mean) {
    typedef typename E::A A;
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows) {
        return;
    }
    const int lane = threadIdx.x;
    const typename E::T *xr = x + (size_t)row * n;
    typename E::T *yr = y + (size_t)row * n;
    const A count = (A)n;
    A shift = 0, correction = 0, rstd;
    if (remove_mean) {
        A s = 0;
        for (int j = lane; j < n; j += 32) {
            s += E::up(xr[j]);
        }
        shift = warp_sum(s) / count;
        A d1 = 0, d2 = 0;
        for (int j = lane; j < n; j += 32) {
            const A d = E::up(xr[j]) - shift;
            d1 += d;
            d2 += d * d;
        }
        d1 = warp_sum(d1);
        d2 = warp_sum(d2);
        correction = d1 / count;
        A var = d2 / count - correction * correction;
        if (var < 0) {
            var = 0;
        }
        rstd = E::rsqrt_(var + (A)eps);
    } else {
        A s2 = 0;
        for (int j = lane; j < n; j += 32) {
            const A v = E::up(xr[j]);
            s2 += v * v;
        }
        rstd = E::rsqrt_(warp_sum(s2) / count + (A)eps);
    }
    for (int j = lane; j < n; j += 32) {
        A v = ((E::up(xr[j]) - shift) - correction) * rstd * E::up(alpha[j]);
        if (beta != 0) {
            v += E::up(beta[j]);
        }
        yr[j] = E::down(v);
    }
}

// Softmax of row blockIdx.x * blockDim.y + threadIdx.y, by the warp of lanes threadIdx.x.
template <typename E>
__device__ void softmax(const typename E::T *x, typename E::T *y, int rows, int n) {
    typedef typename E::A A;
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows) {
        return;
    }
    const int lane = threadIdx.x;
    const typename E::T *xr = x + (size_t)row * n;
    typename E::T *yr = y + (size_t)row * n;
    A m = E::neg_inf();
    for (int j = lane; j < n; j += 32) {
        const A v = E::up(xr[j]);
        if (v > m) {
            m = v;
        }
    }
    m = warp_max(m);
    A s = 0;
    for (int j = lane; j < n; j += 32) {
        s += E::exp_(E::up(xr[j]) - m);
    }
    s = warp_sum(s);
    for (int j = lane; j < n; j += 32) {
        yr[j] = E::down(E::exp_(E::up(xr[j]) - m) / s);
    }
}

#define ROW_KERNELS(E, NAME)                                                                   \
    extern "C" __global__ void cp_norm_##NAME(const E::T *x, E::T *y, const E::T *alpha,      \
                                              const E::T *beta, int rows, int n, float eps,     \
                                              int remove_mean) {                                \
        norm<E>(x, y, alpha, beta, rows, n, eps, remove_mean);                                  \
    }                                                                                           \
    extern "C" __global__ void cp_softmax_##NAME(const E::T *x, E::T *y, int rows, int n) {   \
        softmax<E>(x, y, rows, n);                                                              \
    }

ROW_KERNELS(F32, f32)
ROW_KERNELS(F64, f64)
ROW_KERNELS(F16, f16)
ROW_KERNELS(BF16, bf16)
