/* Weight-only GEMV for a few input rows, straight from the packed weights, float32 in and out.

At batch 1 torch's weight-only CPU kernels want bfloat16 activations, so every linear costs two casts
around it, and each call is one more trip through the dispatcher. These read the same packed layouts
(kernels/weights/weight_only.py) with float32 activations and float32 sums; the decode step of kernels/cpu/csrc/
decode_step.c calls them with no Python in between. Each weight byte is read once for all the rows. */
#include "gemv.h"

#include <math.h>
#include <stdlib.h>

#ifdef __AVX512F__
/* Software prefetch ahead of the int4 codes (one stream per 64-channel block) and of the (scale, zero) rows
   of a later group (a second, strided stream): on the 2-core EPYC VM the 360M model's layers went from 38.6
   to 45.8 GiB/s with it (issue 25; docs/cpu_performance.md). */
enum { PF4_BYTES = 4096, PF4_GROUPS = 2 };

/* Codes to floats through a 16-entry table: vpermps reads only the low 4 bits of each lane, so a byte
   widened to 32 bits indexes its low nibble as it is and its high nibble after one shift. Up to four input
   rows share each widened code (R is a constant at each call: no work for rows that are not there; four
   rows' sums are 16 of the 32 vector registers). */
static inline __attribute__((always_inline)) void int4_rows_avx512(const GemvInt4 *w, const float *x, float *y,
                                                                   int64_t nb, const int R) {
    const int64_t k = w->k, n = w->n, group = w->group;
    const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 tot[4][4];
    for (int r = 0; r < R; ++r) for (int j = 0; j < 4; ++j) tot[r][j] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < k; g0 += group) {
        __m512 acc[4][4];
        float sum[4] = {0};
        for (int r = 0; r < R; ++r) for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
        const uint8_t *p = w->packed + (nb * k + g0) * 32;
        if (g0 + PF4_GROUPS * group < k) ps_int4_prefetch_scales(w, g0 / group + PF4_GROUPS, nb);
        for (int64_t kk = g0; kk < g0 + group; ++kk, p += 32) {
            if (!(kk & 1)) _mm_prefetch((const char *)(p + PF4_BYTES), _MM_HINT_T0);
            __m512i d0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
            __m512i d1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
            __m512 q[4] = {_mm512_permutexvar_ps(d0, lut), _mm512_permutexvar_ps(d1, lut),
                           _mm512_permutexvar_ps(_mm512_srli_epi32(d0, 4), lut),
                           _mm512_permutexvar_ps(_mm512_srli_epi32(d1, 4), lut)};
            for (int r = 0; r < R; ++r) {
                const float xv = x[r * k + kk];
                const __m512 xb = _mm512_set1_ps(xv);
                sum[r] += xv;
                for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(q[j], xb, acc[r][j]);
            }
        }
        for (int j = 0; j < 4; ++j) {
            __m512 scale, zero;
            ps_int4_scale_zero16(w, g0 / group, nb * 64 + 16 * j, &scale, &zero);
            for (int r = 0; r < R; ++r)
                tot[r][j] = _mm512_fmadd_ps(acc[r][j], scale, _mm512_fmadd_ps(zero, _mm512_set1_ps(sum[r]), tot[r][j]));
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + r * n + nb * 64 + 16 * j, tot[r][j]);
}

static void int4_block_avx512(const GemvInt4 *w, const float *x, int64_t rows, float *y, int64_t nb) {
    const int64_t k = w->k, n = w->n;
    for (int64_t t = 0; t < rows; t += 4) {
        const float *xt = x + t * k;
        float *yt = y + t * n;
        switch (rows - t < 4 ? rows - t : 4) {
            case 1: int4_rows_avx512(w, xt, yt, nb, 1); break;
            case 2: int4_rows_avx512(w, xt, yt, nb, 2); break;
            case 3: int4_rows_avx512(w, xt, yt, nb, 3); break;
            default: int4_rows_avx512(w, xt, yt, nb, 4); break;
        }
    }
}
#endif

/* The portable loop, for every form of torch's pack (gemv.h): a block of 64 output channels at a time.
   w = (q - 8) * scale + zero per group of input columns, so y = sum_g scale * (sum_k q x) + (zero - 8 scale) *
   (sum_k x). */
static void int4_blocks_portable(const GemvInt4 *w, const float *x, int64_t rows, float *y, int64_t nb0,
                                 int64_t nb1) {
    const int64_t k = w->k, n = w->n, group = w->group;
    for (int64_t nb = nb0; nb < nb1; ++nb) {
        float total[GEMV_MAX_ROWS][64] = {{0}};
        for (int64_t g0 = 0; g0 < k; g0 += group) {
            float acc[GEMV_MAX_ROWS][64] = {{0}}, xsum[GEMV_MAX_ROWS] = {0};
            for (int64_t kk = g0; kk < g0 + group; ++kk) {
                for (int64_t t = 0; t < rows; ++t) xsum[t] += x[t * k + kk];
                for (int i = 0; i < 64; ++i) {
                    const float q = (float)ps_int4_code(w->packed, w->layout, k, nb * 64 + i, kk);
                    for (int64_t t = 0; t < rows; ++t) acc[t][i] += q * x[t * k + kk];
                }
            }
            for (int i = 0; i < 64; ++i) {
                float scale, zero;
                ps_int4_scale_zero(w, g0 / group, nb * 64 + i, &scale, &zero);
                for (int64_t t = 0; t < rows; ++t) total[t][i] += acc[t][i] * scale + zero * xsum[t];
            }
        }
        for (int64_t t = 0; t < rows; ++t) memcpy(y + t * n + nb * 64, total[t], sizeof total[t]);
    }
}

void ps_gemv_int4_blocks(const GemvInt4 *w, const float *x, int64_t rows, float *y, int64_t nb0, int64_t nb1) {
#ifdef __AVX512F__
    if (w->layout == PACK_AVX512) {
        for (int64_t nb = nb0; nb < nb1; ++nb) int4_block_avx512(w, x, rows, y, nb);
        return;
    }
#endif
#if GEMV_INT4_AVX2
    if (w->layout == PACK_AVX2) {
        ps_gemv_int4_blocks_avx2(w, x, rows, y, nb0, nb1);
        return;
    }
#endif
    int4_blocks_portable(w, x, rows, y, nb0, nb1);
}
