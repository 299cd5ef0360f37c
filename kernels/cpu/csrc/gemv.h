/* Weight-only GEMV over the packed layouts of kernels/weights/weight_only.py (the loops: gemv_int4.c, gemv_int8.c,
   gemv_avx2.c; the entry points: gemv_entry.c). */
#ifndef PAGEDSERVE_GEMV_H
#define PAGEDSERVE_GEMV_H

#include "common.h"

#include <math.h>

enum { GEMV_MAX_ROWS = 8 };    /* input rows one call takes: each row's sums stay in registers / L1 */

/* The forms of an int4 weight's group scales (GemvInt4.sz_form; kernels/weights/weight_only.py's Int4Weight.sz_form).
   SZ_SCALES and SZ_PAIRS are also the bfloat16 values stored per group and channel. SZ_K keeps a GGUF K-quant's
   two-level scales at their size (5 bits a weight with bfloat16 pairs, 4.625 with these against Q4_K's 4.5):
   words [groups, n] of (scale code | zero code << 8), then float16 super-scales [groups / SZ_K_GROUPS, 2, n]
   (d, then o), scale = d * scale code and zero = o * zero code, exactly Q4_K's d * sc and -dmin * m. */
enum { SZ_SCALES = 1, SZ_PAIRS = 2, SZ_K = 3 };
enum { SZ_K_GROUPS = 8 };          /* groups that share a super-scale: Q4_K's 256 weights in groups of 32 */

/* torch's CPU int4 pack follows the CPU dispatch torch runs (aten's weight_to_int4pack_kernel). Under AVX-512:
   blocks of 64 output channels, [n / 64, k, 32] bytes, byte j of a column holding channel j in its low nibble
   and j + 32 in its high one. Under AVX2: blocks of 32, [n / 32, k, 16], channels j and j + 16. Without either:
   blocks of 32 whose byte j holds channels 2j and 2j + 1. The AVX-512 kernels read the AVX-512 form, the AVX2
   GEMV (gemv_avx2.c) the AVX2 one (ps_gemv_int4_layouts says which this build has);
   kernels/cpu/int4_pack.py finds which form this process's torch writes. */
enum { PACK_AVX512 = 0, PACK_AVX2 = 1, PACK_PLAIN = 2 };

static inline int ps_int4_pack_takes(int64_t layout) {
    return layout == PACK_AVX512 || layout == PACK_AVX2 || layout == PACK_PLAIN;
}

/* Channel c's code of input column kk, in any of the forms. */
static inline int ps_int4_code(const uint8_t *packed, int64_t layout, int64_t k, int64_t c, int64_t kk) {
    const int64_t block = layout == PACK_AVX512 ? 64 : 32, half = block / 2, j = c % block;
    const int64_t byte = layout == PACK_PLAIN ? j / 2 : j % half;
    const int shift = (int)(layout == PACK_PLAIN ? j % 2 : j / half) * 4;
    return (packed[((c / block) * k + kk) * half + byte] >> shift) & 15;
}

typedef struct {
    const uint8_t *packed;     /* torch's CPU int4 pack, in form `layout` */
    const uint16_t *sz;        /* the group scales, in form sz_form */
    int64_t n, k, group;
    int64_t sz_form;           /* SZ_SCALES: symmetric groups (GGUF Q4_0), zero 0 and not stored; SZ_PAIRS: bfloat16
                                  (scale, zero) [k / group, n, 2]; SZ_K: see above */
    int64_t layout;            /* PACK_*: PACK_AVX512 for the kernels that read no other (the GEMMs) */
} GemvInt4;

/* Whether the kernels take scales of this form for k input columns in groups of `group`. */
static inline int ps_int4_sz_takes(int64_t form, int64_t k, int64_t group) {
    return form == SZ_SCALES || form == SZ_PAIRS || (form == SZ_K && (k / group) % SZ_K_GROUPS == 0);
}

/* SZ_K: the super-scales of group g, d for channel c at [c] and o at [c + n]. */
static inline const uint16_t *ps_k_supers(const GemvInt4 *w, int64_t g) {
    return w->sz + (w->k / w->group + (g / SZ_K_GROUPS) * 2) * w->n;
}

#ifdef __AVX512F__
#include <immintrin.h>
/* Channels c0..c0+15 of group g: their scale, and zero - 8 * scale (the codes' -8 folded in; SZ_K's zero has
   no offset to fold: its codes are the file's, 0..15). */
static inline void ps_int4_scale_zero16(const GemvInt4 *w, int64_t g, int64_t c0, __m512 *scale, __m512 *zero) {
    if (w->sz_form == SZ_K) {
        const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w->sz + g * w->n + c0)));
        const uint16_t *sup = ps_k_supers(w, g) + c0;
        *scale = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sup)),
                               _mm512_cvtepi32_ps(_mm512_and_si512(words, _mm512_set1_epi32(0xFF))));
        *zero = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sup + w->n))),
                              _mm512_cvtepi32_ps(_mm512_srli_epi32(words, 8)));
        return;
    }
    const uint16_t *sz = w->sz + (g * w->n + c0) * w->sz_form;
    if (w->sz_form == SZ_SCALES) {
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
   are one or two cache lines n * 2 * sz_form bytes past the last group's: each on a page of its own at the
   1.7B model's widths, where the hardware prefetchers stop, so without this every group waited on memory
   (a third of the 1.7B decode step's GEMV time sat on that load, issue 25). */
enum { SCALE_PREFETCH_GROUPS = 8 };

static inline void ps_int4_prefetch_scales(const GemvInt4 *w, int64_t g, int64_t nb) {
    if (w->sz_form == SZ_K) {
        const char *words = (const char *)(w->sz + g * w->n + nb * 64);
        __builtin_prefetch(words, 0, 3);
        __builtin_prefetch(words + 64, 0, 3);
        if (g % SZ_K_GROUPS == 0) {          /* d and o, 128 bytes each, for the next SZ_K_GROUPS groups */
            const char *sup = (const char *)(ps_k_supers(w, g) + nb * 64), *o = sup + 2 * w->n;
            for (int b = 0; b < 128; b += 64) {
                __builtin_prefetch(sup + b, 0, 3);
                __builtin_prefetch(o + b, 0, 3);
            }
        }
        return;
    }
    const char *p = (const char *)(w->sz + (g * w->n + nb * 64) * w->sz_form);
    for (int64_t b = 0; b < 128 * w->sz_form; b += 64) __builtin_prefetch(p + b, 0, 3);
}

/* Scalar form of the above for channel c of group g. */
static inline void ps_int4_scale_zero(const GemvInt4 *w, int64_t g, int64_t c, float *scale, float *zero) {
    if (w->sz_form == SZ_K) {
        const uint16_t word = w->sz[g * w->n + c], *sup = ps_k_supers(w, g) + c;
        *scale = f16_to_f32(sup[0]) * (float)(word & 0xFF);
        *zero = f16_to_f32(sup[w->n]) * (float)(word >> 8);
        return;
    }
    const uint16_t *sz = w->sz + (g * w->n + c) * w->sz_form;
    *scale = bf16_to_f32(sz[0]);
    *zero = (w->sz_form == SZ_PAIRS ? bf16_to_f32(sz[1]) : 0.0f) - 8.0f * *scale;
}

typedef struct {
    const int8_t *q;           /* [chunks, n, chunk] */
    const uint16_t *scale;     /* bfloat16 [chunks, n] */
    int64_t chunks, n, chunk;
} GemvInt8;

/* x as int16 with one scale per row (|error| <= max|x| / 65534 per element, far below the int8 weights' own
   rounding), so that vpmaddwd multiplies 32 codes by 32 inputs and adds pairs in one instruction: a third of
   the float path's instructions per weight, which made a Q8_0 head compute-bound (measured 5.6 GB/s on one
   thread where int4 layers stream at 13). Returns the scale. Both int8 GEMVs (gemv_int8.c, gemv_avx2.c) round
   their input with it. */
static inline float ps_row_to_i16(const float *x, int64_t k, int16_t *out) {
    float top = 0.0f;
    for (int64_t i = 0; i < k; ++i) top = fabsf(x[i]) > top ? fabsf(x[i]) : top;
    if (top == 0.0f) {
        memset(out, 0, sizeof(int16_t) * k);
        return 0.0f;
    }
    const float inv = 32767.0f / top;
    for (int64_t i = 0; i < k; ++i) out[i] = (int16_t)lrintf(x[i] * inv);
    return top / 32767.0f;
}

/* y [rows, n] = x [rows, k] @ w^T for the entry points below; 0 on success, 2 for shapes they do not take. */
/* One thread's share: output blocks of 64 channels nb0..nb1-1 (int4), output channels r0..r1-1 (others).
   x [rows, k] and y [rows, n] are float32, row-major. */
void ps_gemv_int4_blocks(const GemvInt4 *w, const float *x, int64_t rows, float *y, int64_t nb0, int64_t nb1);
void ps_gemv_int8_rows(const GemvInt8 *w, const float *x, int64_t rows, float *y, int64_t r0, int64_t r1);

/* The AVX2 + FMA kernels (gemv_avx2.c). The int4 one reads PACK_AVX2 and is built wherever the CPU has AVX2
   (the pack's form picks it); the int8 one where gemv_int8.c's AVX-512 path is not. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GEMV_INT4_AVX2 1
void ps_gemv_int4_blocks_avx2(const GemvInt4 *w, const float *x, int64_t rows, float *y, int64_t nb0, int64_t nb1);
#else
#define GEMV_INT4_AVX2 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define GEMV_INT8_AVX512 1
#define GEMV_INT8_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__)
#define GEMV_INT8_AVX512 0
#define GEMV_INT8_AVX2 1
/* 0 on success, 1 out of memory (nothing written). */
int ps_gemv_int8_rows_avx2(const GemvInt8 *w, const float *x, int64_t rows, float *y, int64_t r0, int64_t r1);
#else
#define GEMV_INT8_AVX512 0
#define GEMV_INT8_AVX2 0
#endif

/* Bit PACK_x set where the int4 GEMV has a vector path for torch's pack form x (0: the portable loop alone). */
int ps_gemv_int4_layouts(void);
/* 1 where the int8 GEMV has a vector path (AVX-512 or AVX2). */
int ps_gemv_int8_vectorized(void);

#endif
