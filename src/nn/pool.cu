// The CUDA kernels of the CIFAR Net's convolution blocks (see conv_cuda.rs): bias, ReLU and
// max-pooling of a convolution's output in one pass that notes where each pooled value came
// from; the pooled gradient sent back there; and the patch layouts (im2col, col2im) of the
// convolution's backward. f32 only. Pooling windows do not overlap (stride = kernel), so each
// convolution output belongs to at most one window: every kernel gathers (one thread per output
// element, no atomics), and runs the same arithmetic in the same order each time.
// Compiled at run time by NVRTC, so they need no headers.

// Set in a `from` entry when the ReLU stops the gradient there (the input was negative or NaN).
#define STOPPED 0x80000000u

// out[p, oh, ow] = max over the k x k window of y[p] (+ bias[p % c]), ReLU'd when `relu` is set;
// from[...] = the window's position within its plane whose value was taken: the first maximum,
// as the CPU kernels and PyTorch. Without ReLU a NaN wins its window (PyTorch); with it,
// candle's ReLU makes a NaN 0, and the gradient is stopped where the input was not >= 0.
extern "C" __global__ void cp_pool_f32(const float *y, const float *bias, int relu, float *out,
                                      unsigned int *from, long long planes, int c, int h, int w,
                                      int ho, int wo, int k) {
    long long total = planes * ho * wo;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long p = i / (ho * wo);
        int q = (int)(i - p * ho * wo);
        int oh = q / wo, ow = q - (q / wo) * wo;
        const float *plane = y + p * h * w;
        float b = bias ? bias[p % c] : 0.0f;
        int best = oh * k * w + ow * k;
        float raw = plane[best] + b;
        float max = relu ? fmaxf(raw, 0.0f) : raw;
        for (int kh = 0; kh < k; ++kh) {
            int row = (oh * k + kh) * w + ow * k;
            for (int j = row; j < row + k; ++j) {
                float v = plane[j] + b;
                if (relu) {
                    float r = fmaxf(v, 0.0f);
                    if (r > max) {
                        max = r;
                        best = j;
                        raw = v;
                    }
                } else if (v > max || (v != v && max == max)) {
                    max = v;
                    best = j;
                }
            }
        }
        out[i] = max;
        from[i] = (unsigned int)best | ((relu && !(raw >= 0.0f)) ? STOPPED : 0u);
    }
}

// dy_in[p, q] = the pooled gradient of the window holding position q of plane p when that
// window took its value from q and the ReLU let it through; 0 elsewhere. Every element written.
extern "C" __global__ void cp_unpool_f32(const float *dy, const unsigned int *from, float *dx,
                                        long long planes, int h, int w, int ho, int wo, int k) {
    long long total = planes * h * w;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long p = i / (h * w);
        int q = (int)(i - p * h * w);
        int r = q / w, col = q - (q / w) * w;
        int ph = r / k, pw = col / k;
        float g = 0.0f;
        if (ph < ho && pw < wo) {
            long long at = p * ho * wo + ph * wo + pw;
            if (from[at] == (unsigned int)q) {
                g = dy[at];
            }
        }
        dx[i] = g;
    }
}

// cols[b, oh * wo + ow, (ci * kh + i) * kw + j] = x[b, ci, oh * s - pad + i * dil,
// ow * s - pad + j * dil], 0 in the padding: each image's patches as rows.
extern "C" __global__ void cp_im2col_f32(const float *x, float *cols, int n, int ci, int h,
                                        int w, int kh, int kw, int ho, int wo, int pad, int s,
                                        int dil) {
    long long patch = (long long)ci * kh * kw;
    long long total = (long long)n * ho * wo * patch;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long row = i / patch;
        int kk = (int)(i - row * patch);
        int b = (int)(row / (ho * wo));
        int q = (int)(row - (long long)b * ho * wo);
        int oh = q / wo, ow = q - (q / wo) * wo;
        int c = kk / (kh * kw);
        int rest = kk - c * kh * kw;
        int ki = rest / kw, kj = rest - (rest / kw) * kw;
        int yy = oh * s - pad + ki * dil, xx = ow * s - pad + kj * dil;
        float v = 0.0f;
        if (yy >= 0 && yy < h && xx >= 0 && xx < w) {
            v = x[(((long long)b * ci + c) * h + yy) * w + xx];
        }
        cols[i] = v;
    }
}

// dx[b, c, y, x] = the sum of dcols[(c * kh + i) * kw + j, b * ho * wo + oh * wo + ow] over the
// patches (i, j at output (oh, ow)) that read input (y, x): col2im, gathered.
extern "C" __global__ void cp_col2im_f32(const float *dcols, float *dx, int n, int ci, int h,
                                        int w, int kh, int kw, int ho, int wo, int pad, int s,
                                        int dil) {
    long long total = (long long)n * ci * h * w;
    long long columns = (long long)n * ho * wo;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long bc = i / (h * w);
        int q = (int)(i - bc * h * w);
        int b = (int)(bc / ci), c = (int)(bc - (bc / ci) * ci);
        int yy = q / w, xx = q - (q / w) * w;
        float sum = 0.0f;
        for (int ki = 0; ki < kh; ++ki) {
            int ty = yy + pad - ki * dil;
            if (ty < 0 || ty % s != 0 || ty / s >= ho) {
                continue;
            }
            for (int kj = 0; kj < kw; ++kj) {
                int tx = xx + pad - kj * dil;
                if (tx < 0 || tx % s != 0 || tx / s >= wo) {
                    continue;
                }
                long long row = (long long)(c * kh + ki) * kw + kj;
                long long col = (long long)b * ho * wo + (ty / s) * wo + tx / s;
                sum += dcols[row * columns + col];
            }
        }
        dx[i] = sum;
    }
}
