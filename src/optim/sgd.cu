// Sgd's step on CUDA for f32 parameters, in place, one pass (see sgd_cuda.rs): the arithmetic
// of the CPU kernel (sgd_kernel.rs) and of the tensor ops, in their order. Products and sums
// are rounded one by one (__fmul_rn, __fadd_rn), never contracted into a fused multiply-add,
// so that the GPU gives the bits the CPU gives. `buf` is null without momentum.
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
