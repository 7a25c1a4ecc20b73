// The optimizers' steps on CUDA (see cuda.rs), compiled at run time by NVRTC. Products and
// sums are rounded one by one (__fmul_rn, __fadd_rn), never contracted into a fused
// multiply-add, so that the GPU gives the bits the CPU gives.

// Sgd's step for f32 parameters, in place, one pass: the arithmetic of the CPU kernel
// (sgd_kernel.rs) and of the tensor ops, in their order. `buf` is null without momentum.
extern "C" __global__ void cp_sgd_f32(float *p, const float *g, float *buf, long long n,
                                     float neg_lr, float momentum, float momentum_alpha,
                                     float keep, float weight_decay, int decay, int nesterov,
                                     int maximize, int first) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float pi = p[i];
        float d = maximize ? -g[i] : g[i];
        if (decay) {
            d = __fadd_rn(d, __fmul_rn(weight_decay, pi));
        }
        if (buf) {
            float b = first ? d : __fadd_rn(__fmul_rn(buf[i], momentum), __fmul_rn(keep, d));
            buf[i] = b;
            d = nesterov ? __fadd_rn(d, __fmul_rn(momentum_alpha, b)) : b;
        }
        p[i] = __fadd_rn(pi, __fmul_rn(neg_lr, d));
    }
}

// AdamW's step on CUDA for f32 parameters with f32 moments, in place, one pass: the tensor ops
// of adamw.rs (and the CPU kernel, adamw_kernel.rs) op for op, each rounded: candle's `affine`
// is `x * mul + add` (here `+ 0` or `* 1`, kept, as they turn -0 into +0 as the ops do),
// `maximum` keeps the first operand unless it is smaller. `max` is null without AMSGrad.
extern "C" __global__ void cp_adamw_f32(float *p, const float *g, float *m, float *v, float *max,
                                       long long n, float k, int decay, int maximize,
                                       int lerp_low, float weight, float one_minus_weight,
                                       float beta2, float one_minus_beta2, float step_size,
                                       float bias_correction2_sqrt, float eps) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float pi = p[i];
        if (decay) {
            pi = __fadd_rn(__fmul_rn(pi, k), 0.0f);
        }
        float gi = maximize ? -g[i] : g[i];
        float mi = m[i];
        float diff = __fsub_rn(gi, mi);
        if (lerp_low) {
            mi = __fadd_rn(mi, __fadd_rn(__fmul_rn(diff, weight), 0.0f));
        } else {
            mi = __fsub_rn(gi, __fadd_rn(__fmul_rn(diff, one_minus_weight), 0.0f));
        }
        float vi = __fadd_rn(__fadd_rn(__fmul_rn(v[i], beta2), 0.0f),
                             __fmul_rn(__fadd_rn(__fmul_rn(gi, one_minus_beta2), 0.0f), gi));
        float second = vi;
        if (max) {
            float kept = max[i] < vi ? vi : max[i];
            max[i] = kept;
            second = kept;
        }
        float denom = __fadd_rn(__fmul_rn(__fdiv_rn(__fsqrt_rn(second), bias_correction2_sqrt), 1.0f), eps);
        p[i] = __fsub_rn(pi, __fdiv_rn(__fadd_rn(__fmul_rn(mi, step_size), 0.0f), denom));
        m[i] = mi;
        v[i] = vi;
    }
}
