/* A gradient's rows in one pass, two parts added as they are read
 * (normwatch.measure.backends.native.readers.grad_rows), and the gradient through a norm
 * computed with its output's (ThroughReader). */
#include "native.h"

/* A gradient's rows (normwatch.measure.backends.torchops.token_rows): per row of w elements of
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

/* The gradient through a layer or RMS norm (normwatch.measure.layer.gradients.through_formula)
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

