/* What the int8-input int4 GEMM's VNNI tiles (gemm_int4_s8.c) and AMX tile (gemm_int4_amx.c) share: the codes
unpacked four columns at a time. */
#ifndef PAGEDSERVE_INT4_QUADS_H
#define PAGEDSERVE_INT4_QUADS_H

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

#endif

#endif
