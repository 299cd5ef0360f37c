/* Weight-only GEMV over the packed layouts of kernels/weight_only.py (gemv.c). */
#ifndef PAGEDSERVE_GEMV_H
#define PAGEDSERVE_GEMV_H

#include "common.h"

enum { GEMV_MAX_ROWS = 8 };    /* input rows one call takes: each row's sums stay in registers / L1 */

typedef struct {
    const uint8_t *packed;     /* torch's CPU int4 pack: [n / 64, k, 32] */
    const uint16_t *sz;        /* bfloat16 [k / group, n, sz_stride]: scale, then zero where sz_stride is 2 */
    int64_t n, k, group;
    int64_t sz_stride;         /* 1: symmetric groups (GGUF Q4_0), zero is 0 and not stored; 2: (scale, zero) */
} GemvInt4;

#ifdef __AVX512F__
#include <immintrin.h>
/* Channels c0..c0+15 of group g: their scale, and zero - 8 * scale (the codes' -8 folded in). */
static inline void ps_int4_scale_zero16(const GemvInt4 *w, int64_t g, int64_t c0, __m512 *scale, __m512 *zero) {
    const uint16_t *sz = w->sz + (g * w->n + c0) * w->sz_stride;
    if (w->sz_stride == 1) {
        const __m512i s = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)sz));
        *scale = _mm512_castsi512_ps(_mm512_slli_epi32(s, 16));
        *zero = _mm512_mul_ps(_mm512_set1_ps(-8.0f), *scale);
        return;
    }
    const __m512i pairs = _mm512_loadu_si512(sz);
    *scale = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    *zero = _mm512_fmadd_ps(_mm512_set1_ps(-8.0f), *scale,
                            _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000u))));
}
#endif

/* Groups ahead of the one being read whose scales a block's pass prefetches. A group's scales for 64 channels
   are one or two cache lines n * 2 * sz_stride bytes past the last group's: each on a page of its own at the
   1.7B model's widths, where the hardware prefetchers stop, so without this every group waited on memory
   (a third of the 1.7B decode step's GEMV time sat on that load, issue 25). */
enum { SCALE_PREFETCH_GROUPS = 8 };

static inline void ps_int4_prefetch_scales(const GemvInt4 *w, int64_t g, int64_t nb) {
    const char *p = (const char *)(w->sz + (g * w->n + nb * 64) * w->sz_stride);
    for (int64_t b = 0; b < 128 * w->sz_stride; b += 64) __builtin_prefetch(p + b, 0, 3);
}

/* Scalar form of the above for channel c of group g. */
static inline void ps_int4_scale_zero(const GemvInt4 *w, int64_t g, int64_t c, float *scale, float *zero) {
    const uint16_t *sz = w->sz + (g * w->n + c) * w->sz_stride;
    *scale = bf16_to_f32(sz[0]);
    *zero = (w->sz_stride == 2 ? bf16_to_f32(sz[1]) : 0.0f) - 8.0f * *scale;
}

typedef struct {
    const int8_t *q;           /* [chunks, n, chunk] */
    const uint16_t *scale;     /* bfloat16 [chunks, n] */
    int64_t chunks, n, chunk;
} GemvInt8;

/* y [rows, n] = x [rows, k] @ w^T for the entry points below; 0 on success, 2 for shapes they do not take. */
/* One thread's share: output blocks of 64 channels nb0..nb1-1 (int4), output channels r0..r1-1 (others).
   x [rows, k] and y [rows, n] are float32, row-major. */
void ps_gemv_int4_blocks(const GemvInt4 *w, const float *x, int64_t rows, float *y, int64_t nb0, int64_t nb1);
void ps_gemv_int8_rows(const GemvInt8 *w, const float *x, int64_t rows, float *y, int64_t r0, int64_t r1);

#endif
