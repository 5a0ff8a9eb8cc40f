/* The update monitor's sample in one call (normwatch.measure.backends.native.sampler). */
#include "native.h"

/* The update monitor's sample (normwatch.measure.backends.native.sampler): per tensor, `blocks`
 * blocks of `width` elements `stride` elements apart, read from its parameter (and its
 * gradient, laid out alike), against the values kept from the last read (`kept`, the
 * samples end to end, in the parameters' format). Sums of squares in float64, each
 * tensor's weighted by its elements per sampled element (`scale`):
 *   out[0] = gradients (grads not NULL), out[1] = kept minus now (MEASURE),
 *   out[2] = now (SIZE); then kept = now. Without MEASURE it only keeps. */
#define MEASURE 1
#define AHEAD 16 /* blocks prefetched ahead: each is a miss of its own */
#define SIZE 2
/* Sum of squares of n values got by GET(j) into the 4 lanes of acc (four independent
 * chains: a float64 add waits for the one before it in its own lane only) */
#define SQUARES(acc, n, GET)                                                          \
    do {                                                                              \
        int64_t j = 0;                                                                \
        for (; j + 4 <= (n); j += 4)                                                  \
            for (int k = 0; k < 4; k++) {                                             \
                double v = GET(j + k);                                                \
                acc[k] += v * v;                                                      \
            }                                                                         \
        for (; j < (n); j++) {                                                        \
            double v = GET(j);                                                        \
            acc[0] += v * v;                                                          \
        }                                                                             \
    } while (0)
#define CHANGE(j) ((double)conv(kept[j]) - (double)conv(row[j]))
#define NOW(j) ((double)conv(row[j]))
#define GRAD(j) ((double)conv(grow[j]))
#define SAMPLE(NAME, T, TOFLOAT)                                                      \
    __attribute__((target_clones("avx2", "default")))                                 \
    static void NAME(int64_t n, const int64_t *blocks, const int64_t *width,          \
                     const int64_t *stride, const double *scale, void *const *params, \
                     void *const *grads, T *base, int mode, double *out, int64_t t,   \
                     int64_t k) {                                                     \
        float (*const conv)(T) = TOFLOAT;                                             \
        double gs = 0, us = 0, ss = 0;                                                \
        for (int64_t i = 0; i < n; base += blocks[i] * width[i], i++) {              \
            const T *p = (const T *)params[i];                                        \
            const T *q = grads ? (const T *)grads[i] : 0;                             \
            int64_t w = width[i], step = stride[i];                                   \
            int64_t first = blocks[i] * t / k, end = blocks[i] * (t + 1) / k;         \
            T *kept = base + first * w; /* (CHANGE reads it) */                       \
            double g[4] = {0}, u[4] = {0}, s[4] = {0};                                \
            for (int64_t b = first; b < end; b++, kept += w) {                        \
                const T *row = p + b * step;                                          \
                if (b + AHEAD < end) {  /* memory-level parallelism */                \
                    __builtin_prefetch(row + AHEAD * step);                           \
                    if (q) __builtin_prefetch(q + (b + AHEAD) * step);                \
                }                                                                     \
                if (mode & MEASURE) SQUARES(u, w, CHANGE);                            \
                if (mode & SIZE) SQUARES(s, w, NOW);                                  \
                if (q) { const T *grow = q + b * step; SQUARES(g, w, GRAD); }         \
                memcpy(kept, row, (size_t)w * sizeof(T));                             \
            }                                                                         \
            double sc = scale[i];                                                     \
            gs += (g[0] + g[1] + g[2] + g[3]) * sc;                                   \
            us += (u[0] + u[1] + u[2] + u[3]) * sc;                                   \
            ss += (s[0] + s[1] + s[2] + s[3]) * sc;                                   \
        }                                                                             \
        out[0] = gs; out[1] = us; out[2] = ss;                                        \
    }

SAMPLE(sample_f32, float, same)
SAMPLE(sample_bf16, uint16_t, from_bf16)
SAMPLE(sample_f16, uint16_t, from_f16)

/* kind as for normwatch_rows; mode: MEASURE | SIZE bits (0: keep the values only);
 * threads: each tensor's blocks split over them in contiguous runs (its misses are
 * waited on by each core apart), their sums added in thread order (the same threads,
 * the same sums). */
int normwatch_sample(int64_t n, int kind, const int64_t *blocks, const int64_t *width,
                     const int64_t *stride, const double *scale, void *const *params,
                     void *const *grads, void *kept, int mode, double *out, int threads) {
    if (kind < 0 || kind > 2 || threads < 1)
        return -1;
    threads = threads > MAX_THREADS ? MAX_THREADS : threads;
    double part[3 * MAX_THREADS];
    int64_t used = 1;
    SPLIT
    {
        int64_t t, k;
        team(&t, &k);
        double *o = part + 3 * t;
        switch (kind) {
        case 0: sample_f32(n, blocks, width, stride, scale, params, grads, (float *)kept,
                           mode, o, t, k); break;
        case 1: sample_bf16(n, blocks, width, stride, scale, params, grads,
                            (uint16_t *)kept, mode, o, t, k); break;
        default: sample_f16(n, blocks, width, stride, scale, params, grads,
                            (uint16_t *)kept, mode, o, t, k); break;
        }
        if (t == 0)
            used = k;
    }
    out[0] = out[1] = out[2] = 0;
    for (int64_t t = 0; t < used; t++)
        for (int c = 0; c < 3; c++)
            out[c] += part[3 * t + c];
    return 0;
}

