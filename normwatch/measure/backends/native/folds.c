/* The step's folds in one call each (normwatch.measure.backends.native.folds): the staged
 * calls' rows into one line per call, the lines into the state, the staged gradients. */
#include "native.h"

/* The fold of staged norm calls (normwatch.measure.state.fold.fold_calls, whose
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

/* The gradients' fold (normwatch.measure.state.grad_fold.fold_grads; its sums of squares
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
