/* A norm call's rows in one pass: each row's max and min of up to two 2-D tensors,
 * written as float32 (exact: a max or min is one of the values), and on full-tier steps
 * the input's moments (normwatch.measure.backends.native.readers.row_stats); the replay
 * log's batch hash. */
#include "native.h"

#define ROWS(NAME, S, U, MAG, INF, TOFLOAT)                                            \
    __attribute__((target_clones("avx2", "default")))                                 \
    static void NAME(const U *p, int64_t n, int64_t w, int64_t stride, float *hi,     \
                     float *lo) {                                                     \
        for (int64_t i = 0; i < n; i++, p += stride) {                                \
            S top = (S)((U)1 << (8 * sizeof(U) - 1)), bottom = (S)~(U)top;            \
            U bad = 0;                                                                \
            for (int64_t j = 0; j < w; j++) {                                         \
                U b = p[j];                                                           \
                S k = (S)(b ^ ((U)((S)b >> (8 * sizeof(U) - 1)) & MAG));              \
                top = k > top ? k : top;                                              \
                bottom = k < bottom ? k : bottom;                                     \
                bad |= (U)((b & MAG) > INF);                                          \
            }                                                                         \
            U t = (U)top ^ ((U)(top >> (8 * sizeof(U) - 1)) & MAG);                   \
            U m = (U)bottom ^ ((U)(bottom >> (8 * sizeof(U) - 1)) & MAG);             \
            hi[i] = bad ? __builtin_nanf("") : TOFLOAT(t);                            \
            lo[i] = bad ? __builtin_nanf("") : TOFLOAT(m);                            \
        }                                                                             \
    }


__attribute__((target_clones("avx2", "default")))
static void rows_f32(const float *p, int64_t n, int64_t w, int64_t stride, float *hi,
                     float *lo) {
    for (int64_t i = 0; i < n; i++, p += stride) {
        float top = -__builtin_inff(), bottom = __builtin_inff();
        int bad = 0;
        int64_t j = 0;
        if (w >= 16) {
            f8 t0 = {0}, t1, b0, b1;
            m8 n0 = {0}, n1 = {0};
            t0 += top; t1 = t0; b0 = -t0; b1 = b0;
            for (; j + 16 <= w; j += 16) {
                f8 u, v;
                memcpy(&u, p + j, 32);
                memcpy(&v, p + j + 8, 32);
                t0 = pick(u > t0, u, t0); t1 = pick(v > t1, v, t1);
                b0 = pick(u < b0, u, b0); b1 = pick(v < b1, v, b1);
                n0 |= u != u; n1 |= v != v;
            }
            t0 = pick(t1 > t0, t1, t0); b0 = pick(b1 < b0, b1, b0); n0 |= n1;
            for (int k = 0; k < 8; k++) {
                top = t0[k] > top ? t0[k] : top;
                bottom = b0[k] < bottom ? b0[k] : bottom;
                bad |= n0[k];
            }
        }
        for (; j < w; j++) {
            float v = p[j];
            top = v > top ? v : top;
            bottom = v < bottom ? v : bottom;
            bad |= v != v;
        }
        hi[i] = bad ? __builtin_nanf("") : top;
        lo[i] = bad ? __builtin_nanf("") : bottom;
    }
}
ROWS(rows_bf16, int16_t, uint16_t, 0x7fff, 0x7f80, from_bf16)
ROWS(rows_f16, int16_t, uint16_t, 0x7fff, 0x7c00, from_f16)

/* Per row: the sum, the L2 norm and the spread (centred: the L2 norm about the row's
 * mean, read a second time from cache; else the L2 norm), summed in float64 in eight
 * lanes (two vectors of four), written as float32 (NaN/inf where the row holds NaN/inf). */
#define MOMENTS(NAME, T, TOFLOAT)                                                     \
    __attribute__((target_clones("avx2", "default")))                                 \
    static void NAME(const T *p, int64_t n, int64_t w, int64_t stride, int centred,   \
                     float *sum, float *l2, float *spread) {                          \
        float (*const conv)(T) = TOFLOAT;                                             \
        for (int64_t i = 0; i < n; i++, p += stride) {                                \
            d4 s0 = {0}, s1 = {0}, q0 = {0}, q1 = {0};                                \
            int64_t j = 0;                                                            \
            for (; j + 8 <= w; j += 8) {                                              \
                f8 v;                                                                 \
                LOAD8(v, p + j, conv);                                                \
                WIDEN(v, x, y);                                                       \
                s0 += x, s1 += y, q0 += x * x, q1 += y * y;                           \
            }                                                                         \
            s0 += s1, q0 += q1;                                                       \
            double total = (s0[0] + s0[1]) + (s0[2] + s0[3]);                         \
            double squares = (q0[0] + q0[1]) + (q0[2] + q0[3]);                       \
            for (; j < w; j++) {                                                      \
                double v = conv(p[j]);                                                \
                total += v, squares += v * v;                                         \
            }                                                                         \
            l2[i] = (float)__builtin_sqrt(squares);                                   \
            sum[i] = (float)total;                                                    \
            if (!centred) {                                                           \
                spread[i] = l2[i];                                                    \
                continue;                                                             \
            }                                                                         \
            double mean = total / (double)w, tail = 0;                                \
            d4 c0 = {0}, c1 = {0}, m = {mean, mean, mean, mean};                      \
            for (j = 0; j + 8 <= w; j += 8) {                                         \
                f8 v;                                                                 \
                LOAD8(v, p + j, conv);                                                \
                WIDEN(v, x, y);                                                       \
                x -= m, y -= m;                                                       \
                c0 += x * x, c1 += y * y;                                             \
            }                                                                         \
            c0 += c1;                                                                 \
            for (; j < w; j++) {                                                      \
                double v = conv(p[j]) - mean;                                         \
                tail += v * v;                                                        \
            }                                                                         \
            spread[i] = (float)__builtin_sqrt((c0[0] + c0[1]) + (c0[2] + c0[3]) + tail); \
        }                                                                             \
    }

MOMENTS(moments_f32, float, same)
MOMENTS(moments_bf16, uint16_t, from_bf16)
MOMENTS(moments_f16, uint16_t, from_f16)

static void moments_of(const char *p, int kind, int64_t n, int64_t w, int64_t stride,
                       int centred, float *sum, float *l2, float *spread) {
    switch (kind) {
    case 0: moments_f32((const float *)p, n, w, stride, centred, sum, l2, spread); break;
    case 1: moments_bf16((const uint16_t *)p, n, w, stride, centred, sum, l2, spread); break;
    default: moments_f16((const uint16_t *)p, n, w, stride, centred, sum, l2, spread); break;
    }
}

static void rows_of(const char *p, int kind, int64_t n, int64_t w, int64_t stride,
                    float *hi, float *lo) {
    switch (kind) {
    case 0: rows_f32((const float *)p, n, w, stride, hi, lo); break;
    case 1: rows_bf16((const uint16_t *)p, n, w, stride, hi, lo); break;
    default: rows_f16((const uint16_t *)p, n, w, stride, hi, lo); break;
    }
}

/* Each row's max and min of x (n rows of wx elements, sx apart) and, y not NULL, of y
 * (n rows of wy, sy apart); kind: 0 float32, 1 bfloat16, 2 float16. Writes x's hi to
 * out[0:n], lo to out[n:2n], then y's to out[2n:4n]; then, moments 1 (RMS) or 2
 * (centred), x's sum, L2 norm and spread (MOMENTS) to the next 3n. Built with OpenMP
 * (linked to the runtime torch's threads run on, so they are the same threads), the
 * rows are split over `threads` threads in contiguous runs, as torch's own row ops
 * split them. */
int normwatch_rows(const void *x, int kx, int64_t wx, int64_t sx, const void *y, int ky,
                   int64_t wy, int64_t sy, int64_t n, float *out, int threads, int moments) {
    if (kx < 0 || kx > 2 || (y && (ky < 0 || ky > 2)) || moments < 0 || moments > 2)
        return -1;
    SPLIT
    {
        int64_t t, k;
        team(&t, &k);
        int64_t a = n * t / k, m = n * (t + 1) / k - a;
        const char *xa = (const char *)x + a * sx * (kx ? 2 : 4);
        float *o = out + a;
        rows_of(xa, kx, m, wx, sx, o, o + n);
        o += 2 * n;
        if (y) {
            rows_of((const char *)y + a * sy * (ky ? 2 : 4), ky, m, wy, sy, o, o + n);
            o += 2 * n;
        }
        if (moments) moments_of(xa, kx, m, wx, sx, moments == 2, o, o + n, o + 2 * n);
    }
    return 0;
}

/* normwatch_rows with its layout in `plan`: x's kind, width and row stride, y's, the
 * row count, the threads and the moments (one pointer: the per-call argument
 * conversions of the caller cost more than the call's own work on small calls) */
int normwatch_rows_planned(const void *x, const void *y, float *out, const int64_t *plan) {
    return normwatch_rows(x, (int)plan[0], plan[1], plan[2], y, (int)plan[3], plan[4],
                          plan[5], plan[6], out, (int)plan[7], (int)plan[8]);
}

/* The replay log's batch hash (normwatch.measure.step.replay.hashed) of n integers (kind 0:
 * int64, 1: int32): sum(x_i * (2654435761 i + 1)) wrapping in 64 bits, then modulo
 * 2^31 - 1 as a floored remainder (torch's `remainder`: never negative) */
int64_t normwatch_hash(const void *p, int kind, int64_t n) {
    uint64_t total = 0;
    if (kind == 0)
        for (int64_t i = 0; i < n; i++)
            total += (uint64_t)((const int64_t *)p)[i] * (2654435761u * (uint64_t)i + 1);
    else
        for (int64_t i = 0; i < n; i++)
            total += (uint64_t)(int64_t)((const int32_t *)p)[i] * (2654435761u * (uint64_t)i + 1);
    int64_t r = (int64_t)total % 2147483647;
    return r < 0 ? r + 2147483647 : r;
}

/* 1: built with OpenMP (normwatch_rows uses its `threads`) */
int normwatch_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

