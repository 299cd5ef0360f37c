/* The int4 GEMM's int8-input form (gemm_int4_s8.c): codes as unsigned bytes times inputs as signed bytes. */
#ifndef PAGEDSERVE_GEMM_INT4_S8_H
#define PAGEDSERVE_GEMM_INT4_S8_H

#include "gemv.h"

/* vpdpbusd (VNNI) takes the bytes, vpermt2b (VBMI) lays four columns' codes side by side. */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define GEMM_INT4_S8 1
#else
#define GEMM_INT4_S8 0
#endif

#if GEMM_INT4_S8
#include <immintrin.h>

/* Four columns of a 64-channel block are 128 bytes of torch's pack (column j's 32 bytes: channel i the low
   nibble of byte i, channel i + 32 the high one). Two vpermt2b put the four codes of each channel side by side
   in a 32-bit lane (channels 0-15 and 16-31), a mask keeps the low nibbles and a shift the high ones (32-63):
   vpdpbusd's operand, and a row of an AMX tile (gemm_int4_amx.c). */
typedef struct {
    __m512i idx[2], low;
} QuadShuffle;

static inline QuadShuffle quad_shuffle(void) {
    uint8_t i0[64], i1[64];
    for (int j = 0; j < 16; ++j)
        for (int m = 0; m < 4; ++m) {
            i0[4 * j + m] = (uint8_t)(32 * m + j);          /* column m's byte j: table z0 (m < 2) or z1 */
            i1[4 * j + m] = (uint8_t)(32 * m + 16 + j);
        }
    return (QuadShuffle){{_mm512_loadu_si512(i0), _mm512_loadu_si512(i1)}, _mm512_set1_epi8(0x0F)};
}

/* Columns 4i..4i+3 (128 bytes at p) as four vectors of byte quads: channels 0-15, 16-31, 32-47, 48-63. */
static inline __attribute__((always_inline)) void unpack_quad(const QuadShuffle *sh, const uint8_t *p, __m512i *w) {
    const __m512i z0 = _mm512_loadu_si512(p), z1 = _mm512_loadu_si512(p + 64);
    const __m512i v0 = _mm512_permutex2var_epi8(z0, sh->idx[0], z1);
    const __m512i v1 = _mm512_permutex2var_epi8(z0, sh->idx[1], z1);
    w[0] = _mm512_and_si512(v0, sh->low);
    w[1] = _mm512_and_si512(v1, sh->low);
    w[2] = _mm512_and_si512(_mm512_srli_epi16(v0, 4), sh->low);
    w[3] = _mm512_and_si512(_mm512_srli_epi16(v1, 4), sh->low);
}

/* One group's sums of 16 channels added into their outputs y: y + cvt(acc) * (scale * xscale) + zero * xsum,
   in the one order every row is summed in (the VNNI tiles and the AMX tile share it, so a row's bits never
   depend on which ran it). */
static inline __attribute__((always_inline)) __m512 s8_add16(__m512 y, __m512i acc, __m512 scale, __m512 zero,
                                                             float xs, float xsum) {
    const __m512 v = _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum), y);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(scale, _mm512_set1_ps(xs)), v);
}
#endif

/* 1 where this build has it; elsewhere ps_gemm_int4_s8 returns 2. */
int ps_gemm_int4_s8_built(void);

/* y [rows, n] = x [rows, k] @ w^T over torch's CPU int4 pack (ps_gemm_int4's arguments), x rounded to int8
   per row and group (max |x| / 127 each, round to nearest even), on `threads` OpenMP threads: 0 on success,
   2 for shapes it does not take (or no build), 1 when out of memory. A row's outputs depend on that row
   alone: the 1-3-row form and the tile sum every row in one order, whatever `rows` is. */
int ps_gemm_int4_s8(const uint8_t *packed, const uint16_t *sz, int64_t sz_stride, int64_t n, int64_t k,
                    int64_t group, const float *x, int64_t rows, float *y, int threads);

/* 1 where ps_gemm_int4_s8 multiplies AMX_MIN_ROWS rows and more on AMX tiles (gemm_int4_amx.h). */
int ps_gemm_int4_s8_amx(void);

/* ps_gemm_int4_s8 on the VNNI tiles alone, for any rows: the AMX tile's reference, bit for bit. */
int ps_gemm_int4_s8_vnni(const uint8_t *packed, const uint16_t *sz, int64_t sz_stride, int64_t n, int64_t k,
                         int64_t group, const float *x, int64_t rows, float *y, int threads);

#endif
