/* What normwatch's C library shares (rows.c, grads.c, sample.c, folds.c; compiled at first
 * use by normwatch.measure.backends.native.build): the 16-bit formats read as float32,
 * the float32 vector types, how a kernel splits its rows over torch's threads.
 *
 * float32 is compared as floats; the 16-bit formats as order-preserving integers
 * (sign-magnitude to two's complement: an integer max, which compilers vectorise
 * without fast-math). A row holding a NaN gives NaN for both its max and its min, as
 * torch's amax and amin do. */
#pragma once
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

static inline float from_f32(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline float from_bf16(uint16_t b) { return from_f32((uint32_t)b << 16); }
static inline float from_f16(uint16_t b) {
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
static inline void team(int64_t *t, int64_t *k) {
#ifdef _OPENMP
    *t = omp_get_thread_num();
    *k = omp_get_num_threads();
#else
    *t = 0;
    *k = 1;
#endif
}

/* float64 vectors, for sums that float32 would round or overflow */
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

static inline float same(float f) { return f; }
