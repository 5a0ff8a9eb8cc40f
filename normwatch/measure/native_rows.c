/* normwatch's CPU kernels: each row's max and min of up to two 2-D tensors in one
 * pass, written as float32 (exact: a max or min is one of the values), and the moments;
 * the folds of staged calls and gradients; the update monitor's sample. Compiled at
 * first use by normwatch.measure.native; see there.
 *
 * float32 is compared as floats; the 16-bit formats as order-preserving integers
 * (sign-magnitude to two's complement: an integer max, which compilers vectorise
 * without fast-math). A row holding a NaN gives NaN for both, as torch's amax and amin
 * do. */
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

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

static float from_f32(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static float from_bf16(uint16_t b) { return from_f32((uint32_t)b << 16); }
static float from_f16(uint16_t b) {
    uint32_t sign = (uint32_t)(b & 0x8000) << 16, e = (b >> 10) & 0x1f, m = b & 0x3ff;
    if (e == 0x1f) return from_f32(sign | 0x7f800000u | (m << 13));    /* inf, NaN */
    if (e) return from_f32(sign | ((e + 112) << 23) | (m << 13));       /* normal */
    float f = (float)m * (1.0f / 16777216.0f);                         /* subnormal: m 2^-24 */
    return sign ? -f : f;
}

/* float32: float compares, 16 lanes in two accumulators, NaN noted apart */
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t m8 __attribute__((vector_size(32)));
static inline f8 pick(m8 take, f8 a, f8 b) { return (f8)((take & (m8)a) | (~take & (m8)b)); }

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
typedef double d4 __attribute__((vector_size(32)));
/* 8 values from p as float32 */
#define LOAD8(v, p, conv)                                                             \
    do {                                                                              \
        if (sizeof(*(p)) == 4) memcpy(&(v), (p), 32);                                 \
        else for (int k_ = 0; k_ < 8; k_++) (v)[k_] = conv((p)[k_]);                  \
    } while (0)
/* v's 8 float32 as two float64 vectors */
#define WIDEN(v, x, y)                                                                \
    d4 x = __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3), d4);    \
    d4 y = __builtin_convertvector(__builtin_shufflevector(v, v, 4, 5, 6, 7), d4)
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

static float same(float f) { return f; }
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

/* The block after it runs on `threads` threads (a variable of that name in scope) where
 * there are several and OpenMP, else once */
#ifdef _OPENMP
#define SPLIT _Pragma("omp parallel num_threads(threads) if (threads > 1)")
#else
#define SPLIT (void)threads;
#endif
#define MAX_THREADS 256 /* a team's threads at most (kernels keep a part per thread) */
/* This thread's index in its team and the team's size (0 and 1 outside a parallel
 * region, or without OpenMP) */
static void team(int64_t *t, int64_t *k) {
#ifdef _OPENMP
    *t = omp_get_thread_num();
    *k = omp_get_num_threads();
#else
    *t = 0;
    *k = 1;
#endif
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

/* A gradient's rows (normwatch.measure.gradients.token_rows): per row of w elements of
 * a (plus b's, where b is not NULL: two parts of one gradient, added in float32), its L2
 * norm (the sum of squares in float32, as torch's vector_norm: NaN/inf where the row
 * holds NaN/inf or the sum overflows) to norm[0:n]; the whole gradient's min and max and
 * whether it holds a NaN to e. One pass. */
typedef struct { float lo, hi; int bad; } Bounds;
#define GRADS(NAME, T, TOFLOAT)                                                       \
    __attribute__((target_clones("avx2", "default")))                                 \
    static void NAME(const T *a, const T *b, int64_t n, int64_t w, float *norm,       \
                     Bounds *e) {                                                     \
        float (*const conv)(T) = TOFLOAT;                                             \
        float hi = -__builtin_inff(), lo = __builtin_inff();                          \
        int bad = 0;                                                                  \
        f8 top = {0}, bottom = {0};                                                   \
        m8 nan = {0};                                                                 \
        top += hi, bottom += lo;                                                      \
        for (int64_t i = 0; i < n; i++, a += w, b = b ? b + w : b) {                  \
            f8 q = {0};                                                               \
            int64_t j = 0;                                                            \
            for (; j + 8 <= w; j += 8) {                                              \
                f8 v, u;                                                              \
                LOAD8(v, a + j, conv);                                                \
                if (b) {                                                              \
                    LOAD8(u, b + j, conv);                                            \
                    v += u;                                                           \
                }                                                                     \
                top = pick(v > top, v, top), bottom = pick(v < bottom, v, bottom);    \
                nan |= v != v;                                                        \
                q += v * v;                                                           \
            }                                                                         \
            float squares = ((q[0] + q[1]) + (q[2] + q[3])) + ((q[4] + q[5]) + (q[6] + q[7])); \
            for (; j < w; j++) {                                                      \
                float v = conv(a[j]) + (b ? conv(b[j]) : 0.0f);                       \
                hi = v > hi ? v : hi, lo = v < lo ? v : lo, bad |= v != v;            \
                squares += v * v;                                                     \
            }                                                                         \
            norm[i] = __builtin_sqrtf(squares);                                       \
        }                                                                             \
        for (int k = 0; k < 8; k++) {                                                 \
            hi = top[k] > hi ? top[k] : hi, lo = bottom[k] < lo ? bottom[k] : lo;     \
            bad |= nan[k] != 0;                                                       \
        }                                                                             \
        e->lo = lo, e->hi = hi, e->bad = bad;                                         \
    }
GRADS(grads_plain, float, same)
GRADS(grads_bf16, uint16_t, from_bf16)
GRADS(grads_f16, uint16_t, from_f16)

#if defined(__x86_64__) || defined(__i386__)
/* float32 with AVX2: max and min one instruction each (vmaxps(v, t) is v > t ? v : t,
 * so a NaN in v leaves t: the running extremes never turn NaN; NaN is noted apart) */
__attribute__((target("avx2")))
static void grads_avx2(const float *a, const float *b, int64_t n, int64_t w, float *norm,
                       Bounds *e) {
    __m256 top = _mm256_set1_ps(-__builtin_inff()), bottom = _mm256_set1_ps(__builtin_inff());
    __m256 nan = _mm256_setzero_ps();
    float hi = -__builtin_inff(), lo = __builtin_inff();
    int bad = 0;
    for (int64_t i = 0; i < n; i++, a += w, b = b ? b + w : b) {
        __m256 q0 = _mm256_setzero_ps(), q1 = q0;
        int64_t j = 0;
        for (; j + 16 <= w; j += 16) {
            __m256 v = _mm256_loadu_ps(a + j), u = _mm256_loadu_ps(a + j + 8);
            if (b) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(b + j));
                u = _mm256_add_ps(u, _mm256_loadu_ps(b + j + 8));
            }
            top = _mm256_max_ps(v, _mm256_max_ps(u, top));
            bottom = _mm256_min_ps(v, _mm256_min_ps(u, bottom));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, u, _CMP_UNORD_Q));
            q0 = _mm256_add_ps(q0, _mm256_mul_ps(v, v));
            q1 = _mm256_add_ps(q1, _mm256_mul_ps(u, u));
        }
        q0 = _mm256_add_ps(q0, q1);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(q0), _mm256_extractf128_ps(q0, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        float squares = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
        for (; j < w; j++) {
            float v = a[j] + (b ? b[j] : 0.0f);
            hi = v > hi ? v : hi, lo = v < lo ? v : lo, bad |= v != v;
            squares += v * v;
        }
        norm[i] = __builtin_sqrtf(squares);
    }
    float t[8], m[8];
    _mm256_storeu_ps(t, top);
    _mm256_storeu_ps(m, bottom);
    for (int k = 0; k < 8; k++) hi = t[k] > hi ? t[k] : hi, lo = m[k] < lo ? m[k] : lo;
    e->lo = lo, e->hi = hi, e->bad = bad | _mm256_movemask_ps(nan);
}
#define AVX2 __builtin_cpu_supports("avx2")
#else
#define grads_avx2 grads_plain
#define AVX2 0
#endif

static void grads_f32(const float *a, const float *b, int64_t n, int64_t w, float *norm,
                      Bounds *e) {
    if (AVX2) grads_avx2(a, b, n, w, norm, e);
    else grads_plain(a, b, n, w, norm, e);
}

int normwatch_grad_rows(const void *a, const void *b, int kind, int64_t n, int64_t w,
                        float *out, int threads) {
    if (kind < 0 || kind > 2 || threads < 1) return -1;
    threads = threads > MAX_THREADS ? MAX_THREADS : threads;
    Bounds parts[MAX_THREADS];
    int used = 1;
    SPLIT
    {
        int64_t t, k;
        team(&t, &k);
        if (t == 0) used = (int)k;
        int64_t first = n * t / k, m = n * (t + 1) / k - first, at = first * w;
        int size = kind ? 2 : 4;
        const char *pa = (const char *)a + at * size;
        const char *pb = b ? (const char *)b + at * size : 0;
        Bounds *e = parts + t;
        switch (kind) {
        case 0: grads_f32((const float *)pa, (const float *)pb, m, w, out + first, e); break;
        case 1: grads_bf16((const uint16_t *)pa, (const uint16_t *)pb, m, w, out + first, e);
            break;
        default: grads_f16((const uint16_t *)pa, (const uint16_t *)pb, m, w, out + first, e);
            break;
        }
    }
    float lo = __builtin_inff(), hi = -__builtin_inff();
    int bad = 0;
    for (int t = 0; t < used; t++) {
        lo = parts[t].lo < lo ? parts[t].lo : lo;
        hi = parts[t].hi > hi ? parts[t].hi : hi;
        bad |= parts[t].bad;
    }
    out[n] = bad ? __builtin_nanf("") : lo;
    out[n + 1] = bad ? __builtin_nanf("") : hi;
    return 0;
}

/* normwatch_grad_rows with its layout in `plan`: the kind, the row count, the width and
 * the threads (see normwatch_rows_planned) */
int normwatch_grad_rows_planned(const void *a, const void *b, float *out, const int64_t *plan) {
    return normwatch_grad_rows(a, b, (int)plan[0], plan[1], plan[2], out, (int)plan[3]);
}

/* The gradient through a layer or RMS norm (normwatch.measure.gradients.through_formula)
 * from its output's gradient g, its input x (n rows of d float32 each, contiguous) and
 * its weight w (d float32, scaling by w + plus; NULL: none), row by row, in float32:
 *   RMS:     r = 1/sqrt(mean x^2 + eps),  dx = r wg - x r^3 mean(x wg)
 *   centred: c = x - mean x, r = 1/sqrt(mean c^2 + eps),
 *            dx = r (wg - mean wg - c r^2 mean(wg c))
 * (wg = g (w + plus)). Two passes over each row while it is in cache: the first reads g
 * (its L2 norm, min, max and NaN, as grads_f32 reads a gradient) and the sums the formula
 * needs (centred: taken about the row's first element, then moved to its mean: no
 * cancellation beyond the row's own spread), the second makes dx and reads it the same
 * way; dx is never stored. g's rows go to dg and eg, dx's to din and ei. */
typedef struct { f8 top, bottom; m8 nan; } Track;
static inline void track8(Track *t, f8 v) {
    t->top = pick(v > t->top, v, t->top), t->bottom = pick(v < t->bottom, v, t->bottom);
    t->nan |= v != v;
}
static inline void track1(Bounds *e, float v) {
    e->hi = v > e->hi ? v : e->hi, e->lo = v < e->lo ? v : e->lo, e->bad |= v != v;
}
static void tracked(const Track *t, Bounds *e) {
    for (int k = 0; k < 8; k++) {
        e->hi = t->top[k] > e->hi ? t->top[k] : e->hi;
        e->lo = t->bottom[k] < e->lo ? t->bottom[k] : e->lo;
        e->bad |= t->nan[k] != 0;
    }
}
static inline f8 at8(const float *p) { f8 v; memcpy(&v, p, 32); return v; }
static inline float sum8(f8 q) {
    return ((q[0] + q[1]) + (q[2] + q[3])) + ((q[4] + q[5]) + (q[6] + q[7]));
}
__attribute__((target_clones("avx2", "default")))
static void through_f32(const float *g, const float *x, const float *w, float plus,
                        int64_t n, int64_t d, int centred, float eps, float *dg, float *din,
                        Bounds *eg, Bounds *ei) {
    const float inv = 1.0f / (float)d, inf = __builtin_inff();
    Track tg, ti;
    tg.top = ti.top = (f8){0} - inf, tg.bottom = ti.bottom = (f8){0} + inf;
    tg.nan = ti.nan = (m8){0};
    Bounds bg = {inf, -inf, 0}, bi = {inf, -inf, 0};
    f8 ones = (f8){0} + 1.0f;
    for (int64_t i = 0; i < n; i++, g += d, x += d) {
        /* pass 1: g's squares; about x0 (0 for RMS): sums of c, c^2, wg, wg c */
        float x0 = centred ? x[0] : 0.0f;
        f8 q = {0}, sc = {0}, scc = {0}, sw = {0}, swc = {0};
        f8 q1 = {0}, sc1 = {0}, scc1 = {0}, sw1 = {0}, swc1 = {0};  /* (two chains each) */
        int64_t j = 0;
        for (; j + 16 <= d; j += 16) {
            f8 gv = at8(g + j), c = at8(x + j) - x0, hv = at8(g + j + 8);
            f8 e = at8(x + j + 8) - x0;
            f8 u = gv * (w ? at8(w + j) + plus : ones), v = hv * (w ? at8(w + j + 8) + plus : ones);
            track8(&tg, gv), track8(&tg, hv);
            q += gv * gv, sc += c, scc += c * c, sw += u, swc += u * c;
            q1 += hv * hv, sc1 += e, scc1 += e * e, sw1 += v, swc1 += v * e;
        }
        for (; j + 8 <= d; j += 8) {
            f8 gv = at8(g + j), c = at8(x + j) - x0;
            f8 u = gv * (w ? at8(w + j) + plus : ones);
            track8(&tg, gv);
            q += gv * gv, sc += c, scc += c * c, sw += u, swc += u * c;
        }
        q += q1, sc += sc1, scc += scc1, sw += sw1, swc += swc1;
        float squares = sum8(q), a = sum8(sc), b = sum8(scc), e = sum8(sw), f = sum8(swc);
        for (; j < d; j++) {
            float gv = g[j], c = x[j] - x0, u = gv * (w ? w[j] + plus : 1.0f);
            track1(&bg, gv);
            squares += gv * gv, a += c, b += c * c, e += u, f += u * c;
        }
        dg[i] = __builtin_sqrtf(squares);
        float mean = 0.0f, mwg = 0.0f, var = b * inv, cov = f * inv;
        if (centred) {  /* about the mean: c' = c - m */
            float m = a * inv;
            var -= m * m, cov -= m * e * inv;
            var = var > 0.0f ? var : 0.0f;
            mean = x0 + m, mwg = e * inv;
        }
        float r = 1.0f / __builtin_sqrtf(var + eps);
        float k = r * r * cov * (centred ? 1.0f : r);
        /* pass 2: dx (centred: r (wg - mwg) - c r^2 cov r; RMS: r wg - x r^3 cov) */
        f8 p = {0}, p1 = {0};
        float tail = 0.0f;
        for (j = 0; j + 16 <= d; j += 16) {
            f8 gv = at8(g + j), c = at8(x + j) - mean, hv = at8(g + j + 8);
            f8 ce = at8(x + j + 8) - mean;
            f8 u = gv * (w ? at8(w + j) + plus : ones), uu = hv * (w ? at8(w + j + 8) + plus : ones);
            f8 v = centred ? r * (u - mwg - c * k) : r * u - c * k;
            f8 vv = centred ? r * (uu - mwg - ce * k) : r * uu - ce * k;
            track8(&ti, v), track8(&ti, vv);
            p += v * v, p1 += vv * vv;
        }
        p += p1;
        for (; j + 8 <= d; j += 8) {
            f8 gv = at8(g + j), c = at8(x + j) - mean;
            f8 u = gv * (w ? at8(w + j) + plus : ones);
            f8 v = centred ? r * (u - mwg - c * k) : r * u - c * k;
            track8(&ti, v);
            p += v * v;
        }
        for (; j < d; j++) {
            float c = x[j] - mean, u = g[j] * (w ? w[j] + plus : 1.0f);
            float v = centred ? r * (u - mwg - c * k) : r * u - c * k;
            track1(&bi, v);
            tail += v * v;
        }
        din[i] = __builtin_sqrtf(sum8(p) + tail);
    }
    tracked(&tg, &bg), tracked(&ti, &bi);
    *eg = bg, *ei = bi;
}

static void bounds_of(Bounds *all, const Bounds *one) {
    all->lo = one->lo < all->lo ? one->lo : all->lo;
    all->hi = one->hi > all->hi ? one->hi : all->hi;
    all->bad |= one->bad;
}

/* through_f32 over `threads` threads (rows split in contiguous runs); plan: n, d,
 * centred, the weight's form (0: w, 1: 1 + w), threads. Writes g's rows to dg and dx's
 * to din (each n + 2: the rows' norms, then the min and max, NaN both where a NaN
 * is), as normwatch_grad_rows writes a gradient's. */
int normwatch_through(const float *g, const float *x, const float *w, float *dg, float *din,
                      const int64_t *plan, double eps) {
    int64_t n = plan[0], d = plan[1];
    int centred = (int)plan[2], threads = (int)plan[4];
    float plus = plan[3] ? 1.0f : 0.0f;
    if (d < 1 || threads < 1) return -1;
    threads = threads > MAX_THREADS ? MAX_THREADS : threads;
    Bounds pg[MAX_THREADS], pi[MAX_THREADS];
    int used = 1;
    SPLIT
    {
        int64_t t, k;
        team(&t, &k);
        if (t == 0) used = (int)k;
        int64_t first = n * t / k, m = n * (t + 1) / k - first;
        through_f32(g + first * d, x + first * d, w, plus, m, d, centred, (float)eps,
                    dg + first, din + first, pg + t, pi + t);
    }
    for (int t = 1; t < used; t++) bounds_of(pg, pg + t), bounds_of(pi, pi + t);
    dg[n] = pg->bad ? __builtin_nanf("") : pg->lo;
    dg[n + 1] = pg->bad ? __builtin_nanf("") : pg->hi;
    din[n] = pi->bad ? __builtin_nanf("") : pi->lo;
    din[n + 1] = pi->bad ? __builtin_nanf("") : pi->hi;
    return 0;
}

/* normwatch_rows with its layout in `plan`: x's kind, width and row stride, y's, the
 * row count, the threads and the moments (one pointer: the per-call argument
 * conversions of the caller cost more than the call's own work on small calls) */
int normwatch_rows_planned(const void *x, const void *y, float *out, const int64_t *plan) {
    return normwatch_rows(x, (int)plan[0], plan[1], plan[2], y, (int)plan[3], plan[4],
                          plan[5], plan[6], out, (int)plan[7], (int)plan[8]);
}

/* The replay log's batch hash (normwatch.measure.replay.hashed) of n integers (kind 0:
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

/* The update monitor's sample (normwatch.measure.native_updates): per tensor, `blocks`
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

/* The fold of staged norm calls (normwatch.measure.reductions.fold_calls, whose
 * arithmetic this repeats op for op in float32, so that it gives the same values, but
 * for rms_sum, summed here in float64): per call, its float32 rows (`rows[c]`: hi, lo,
 * lined up: the output's hi, lo, full tier: sum, L2 norm, spread; `per[c]` below) into
 * its line of `out` (calls x `columns` float64, at the reduction identities), each
 * result at its column `column[F_...]`. A token counts when its extremes are finite.
 *
 * Every value compared here is >= 0 or not finite (|x|, an L2 norm, a ratio of them),
 * so it is compared as its bits, an unsigned integer: loops compilers vectorise
 * without fast-math. A finite value's bits are below INF_BITS. */
enum { P_TOKENS, P_LINED_UP, P_WIDTH, P_EPS, P_INV_WIDTH, P_INV_SQRT_WIDTH, P_BELOW,
       P_OFFSET, P_COUNT };
enum { F_CALLS, F_TOKENS, F_FINITE, F_OVERFLOW, F_NONFINITE, F_OUT_NONFINITE, F_ABSMAX,
       F_OUT_ABSMAX, F_ARRIVED, F_BORN, F_STATS, F_COMMON, F_DOMINATED, F_RMS_SUM,
       F_RMS_MAX, F_RMS_MIN, F_COMMON_MAX, F_SUMSQ_MAX, F_DOMINANCE, F_COUNT };
#define INF_BITS 0x7f800000u
#define CHUNK 65536 /* tokens per pass: 32-bit counts and lanes */

static uint32_t bits_of(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }
static int finite(float f) { return (bits_of(f) & 0x7fffffffu) < INF_BITS; }
/* the least bits of a finite |x| that is > f (none: past INF_BITS) */
static uint32_t above(float f) {
    return f != f ? 0xffffffffu : f < 0 ? 0u : bits_of(f == 0 ? 0.0f : f) + 1;
}
/* the largest of the finite values seen, given max(bits + 1) (0: none seen) */
static double top_of(uint32_t t) { return t ? (double)from_f32(t - 1) : -__builtin_inf(); }

typedef struct { int64_t finite, over; uint32_t top; } Extremes;

/* tokens with finite extremes, how many reach `over` (bits), max |x| + 1 among them */
__attribute__((target_clones("avx2", "default")))
static void extremes(const uint32_t *hi, const uint32_t *lo, int64_t n, uint32_t over,
                     Extremes *e) {
    for (int64_t a = 0; a < n; a += CHUNK) {
        int64_t m = n - a < CHUNK ? n - a : CHUNK;
        uint32_t fin = 0, big = 0, top = e->top;
        for (int64_t t = a; t < a + m; t++) {
            uint32_t h = hi[t] & 0x7fffffffu, l = lo[t] & 0x7fffffffu;
            uint32_t mag = h > l ? h : l, ok = mag < INF_BITS, seen = (mag + 1) & -ok;
            fin += ok;
            big += ok & (mag >= over);
            top = top > seen ? top : seen;
        }
        e->finite += fin;
        e->over += big;
        e->top = top;
    }
}

typedef struct { int64_t common, dominated; uint32_t rms_top, cm_top, rms_low, root_low;
                 double rms_sum; } Moments;

/* the full tier's per-token statistics (fold_calls' float32 ops) */
__attribute__((target_clones("avx2", "default")))
static void moments(const float *sum, const float *l2, const float *spread, int64_t n,
                    float iw, float isw, uint32_t common, float below, Moments *o) {
    for (int64_t a = 0; a < n; a += CHUNK) {
        int64_t m = n - a < CHUNK ? n - a : CHUNK;
        uint32_t cm_n = 0, dom_n = 0, rt = o->rms_top, ct = o->cm_top, rl = o->rms_low,
                 sl = o->root_low;
        double lane[4] = {0, 0, 0, 0};
        for (int64_t t = a; t < a + m; t++) {
            float rms = l2[t] * isw, root = spread[t] * isw, mean = sum[t] * iw;
            float floor = rms < 1e-30f ? 1e-30f : rms; /* NaN stays NaN */
            uint32_t r = bits_of(rms) & 0x7fffffffu, s = bits_of(root) & 0x7fffffffu;
            uint32_t c = bits_of(mean / floor) & 0x7fffffffu; /* |mean| / floor */
            uint32_t r_ok = r < INF_BITS, s_ok = s < INF_BITS, c_ok = c < INF_BITS;
            uint32_t r_seen = (r + 1) & -r_ok, c_seen = (c + 1) & -c_ok;
            uint32_t r_low = r | (INF_BITS & -!r_ok), s_low = s | (INF_BITS & -!s_ok);
            cm_n += c_ok & (c >= common);
            dom_n += root < below; /* false where not finite */
            rt = rt > r_seen ? rt : r_seen;
            ct = ct > c_seen ? ct : c_seen;
            rl = rl < r_low ? rl : r_low;
            sl = sl < s_low ? sl : s_low;
            lane[t & 3] += r_ok ? (double)rms : 0.0;
        }
        o->common += cm_n;
        o->dominated += dom_n;
        o->rms_top = rt;
        o->cm_top = ct;
        o->rms_low = rl;
        o->root_low = sl;
        o->rms_sum += (lane[0] + lane[1]) + (lane[2] + lane[3]);
    }
}

int normwatch_fold(int64_t calls, const float *const *rows, const double *per, int full,
                   float fp16_limit, float common_tol, double score0, const int64_t *column,
                   int64_t columns, double *out) {
    const float big = 3.40282347e38f;
    uint32_t over = above(fp16_limit), common = above(common_tol);
    for (int64_t c = 0; c < calls; c++) {
        const double *q = per + c * P_COUNT;
        int64_t n = (int64_t)q[P_TOKENS], lined = q[P_LINED_UP] != 0.0;
        const uint32_t *r = (const uint32_t *)rows[c];
        Extremes in = {0, 0, 0}, outs = {0, 0, 0};
        extremes(r, r + n, n, over, &in);
        if (lined) extremes(r + 2 * n, r + 3 * n, n, 0xffffffffu, &outs);
        double *o = out + c * columns;
        int64_t nonfinite = n - in.finite, out_bad = lined ? n - outs.finite : 0;
        double score = score0 - q[P_OFFSET];
        o[column[F_CALLS]] = 1.0;
        o[column[F_TOKENS]] = (double)n;
        o[column[F_FINITE]] = (double)in.finite;
        o[column[F_OVERFLOW]] = (double)in.over;
        o[column[F_NONFINITE]] = (double)nonfinite;
        o[column[F_OUT_NONFINITE]] = (double)out_bad;
        o[column[F_ABSMAX]] = top_of(in.top);
        o[column[F_OUT_ABSMAX]] = top_of(outs.top);
        o[column[F_ARRIVED]] = score * (double)(nonfinite > 0);
        o[column[F_BORN]] = score * (double)(out_bad > 0 && nonfinite == 0);
        if (!full) continue;
        const float *m = rows[c] + (lined ? 4 : 2) * n;
        Moments s = {0, 0, 0, 0, INF_BITS, INF_BITS, 0.0};
        moments(m, m + n, m + 2 * n, n, (float)q[P_INV_WIDTH], (float)q[P_INV_SQRT_WIDTH],
                common, (float)q[P_BELOW], &s);
        float eps = (float)q[P_EPS], root_min = from_f32(s.root_low);
        float ratio = eps / (root_min * root_min + eps);
        ratio = ratio != ratio ? 1.0f : ratio > big ? big : ratio < -big ? -big : ratio;
        double top = top_of(s.rms_top);
        o[column[F_STATS]] = (double)in.finite;
        o[column[F_COMMON]] = (double)s.common;
        o[column[F_DOMINATED]] = (double)s.dominated;
        o[column[F_RMS_SUM]] = s.rms_sum;
        o[column[F_RMS_MAX]] = top;
        o[column[F_RMS_MIN]] = from_f32(s.rms_low);
        o[column[F_COMMON_MAX]] = top_of(s.cm_top);
        o[column[F_SUMSQ_MAX]] = top * (top < 0 ? -top : top) * (double)(float)q[P_WIDTH];
        o[column[F_DOMINANCE]] = in.finite > 0 ? (double)ratio : -__builtin_inf();
    }
    return 0;
}

/* A fold's lines (`lines`: calls x columns float64) into the state `block` (rows of
 * `columns` float64), each call's into its row `row[c]`: the first `n_sum` columns added
 * in call order, then up to `max_end` the max, then the min; a NaN line value leaves
 * the state as it is (the torch path's nan_to_num to -inf/+inf, then amax/amin), a NaN
 * in the state stays. */
int normwatch_accumulate(int64_t calls, const double *lines, int64_t columns,
                         const int64_t *row, int64_t n_sum, int64_t max_end, double *block) {
    for (int64_t c = 0; c < calls; c++) {
        const double *v = lines + c * columns;
        double *b = block + row[c] * columns;
        for (int64_t j = 0; j < n_sum; j++) b[j] += v[j];
        for (int64_t j = n_sum; j < max_end; j++) b[j] = v[j] > b[j] ? v[j] : b[j];
        for (int64_t j = max_end; j < columns; j++) b[j] = v[j] < b[j] ? v[j] : b[j];
    }
    return 0;
}

/* The gradients' fold (normwatch.measure.gradients.fold_grads; its sums of squares
 * here in float64, which does not overflow where float32's does): per gradient g, its
 * rows (`norms[g]`, float32, as normwatch_grad_rows writes them: its n tokens' L2 norms,
 * then its min and max), added into `block` (float64) at `per[g]`'s offsets: tokens,
 * finite tokens, their sum of squares and elements from SUMS on, and max |g| (where the
 * whole gradient is finite) folded in at PEAK. A token counts as finite where its norm
 * is, or where the whole gradient is (then only its sum of squares overflowed). Then per
 * weight gradient w, its norm (`weights[w]`, one float32): one more gradient and its
 * square, added at `at[w]` and the cell after it. */
enum { G_TOKENS, G_WIDTH, G_SUMS, G_PEAK, G_COUNT };

int normwatch_fold_grads(int64_t grads, const float *const *norms, const double *per,
                         int64_t n_weights, const float *const *weights, const double *at,
                         double *block) {
    for (int64_t w = 0; w < n_weights; w++) {
        double norm = (double)*weights[w], *cell = block + (int64_t)at[w];
        cell[0] += 1.0;
        cell[1] += norm * norm;
    }
    for (int64_t g = 0; g < grads; g++) {
        const double *q = per + g * G_COUNT;
        int64_t n = (int64_t)q[G_TOKENS];
        float lo = norms[g][n], hi = norms[g][n + 1];
        float peak = lo != lo || hi != hi ? __builtin_nanf("") : hi > -lo ? hi : -lo;
        int whole = finite(peak);
        const float *v = norms[g];
        int64_t ok_n = 0;
        double lane[4] = {0, 0, 0, 0};
        for (int64_t t = 0; t < n; t++) {
            int ok = whole | finite(v[t]);
            ok_n += ok;
            lane[t & 3] += ok ? (double)v[t] * (double)v[t] : 0.0;
        }
        double *sums = block + (int64_t)q[G_SUMS], *top = block + (int64_t)q[G_PEAK];
        sums[0] += (double)n;
        sums[1] += (double)ok_n;
        sums[2] += (lane[0] + lane[1]) + (lane[2] + lane[3]);
        sums[3] += (double)ok_n * q[G_WIDTH];
        double known = whole ? (double)peak : -__builtin_inf();
        if (!(*top >= known)) *top = known;
    }
    return 0;
}
