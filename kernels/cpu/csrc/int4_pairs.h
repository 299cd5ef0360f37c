/* What the int16-input GEMMs of 4-bit codes (gemm_int4.c) and of 5/6-bit codes (gemm_intn.c) share: the
unpacking of a pair of columns of torch's int4 pack into vpdpwssd's operands, and vpdpwssd itself. */
#ifndef PAGEDSERVE_INT4_PAIRS_H
#define PAGEDSERVE_INT4_PAIRS_H

#include "gemv.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
/* One pair of columns (64 bytes: column 2i's 32, then 2i + 1's; channel j the low nibble of a column's byte j,
   channel j + 32 the high one) as int16 (2i, 2i + 1) pairs: w[c] holds channels 16c..16c+15. */
#ifdef __AVX512VBMI__
/* vpermb's byte order: byte j of each column to bytes 4j and 4j + 2 of a lane, channels 0-15 (idx[0]) or
   16-31 (idx[1]); the odd bytes are zeroed by the mask. Then a mask keeps the low nibbles (channels c) and a
   shift the high ones (c + 32): two shuffles and two masks a pair, where widening byte by byte (below) takes
   a dozen instructions. */
typedef struct {
    __m512i idx[2], low;
} PairShuffle;

static inline PairShuffle pair_shuffle(void) {
    uint8_t i0[64] = {0}, i1[64] = {0};
    for (int j = 0; j < 16; ++j) {
        i0[4 * j] = (uint8_t)j;
        i0[4 * j + 2] = (uint8_t)(32 + j);
        i1[4 * j] = (uint8_t)(16 + j);
        i1[4 * j + 2] = (uint8_t)(48 + j);
    }
    return (PairShuffle){{_mm512_loadu_si512(i0), _mm512_loadu_si512(i1)}, _mm512_set1_epi16(0x0F)};
}

static inline __attribute__((always_inline)) void unpack_pair(const PairShuffle *sh, const uint8_t *p, __m512i *w) {
    const __mmask64 even = 0x5555555555555555ull;
    const __m512i z = _mm512_loadu_si512(p);
    const __m512i v0 = _mm512_maskz_permutexvar_epi8(even, sh->idx[0], z);
    const __m512i v1 = _mm512_maskz_permutexvar_epi8(even, sh->idx[1], z);
    w[0] = _mm512_and_si512(v0, sh->low);
    w[1] = _mm512_and_si512(v1, sh->low);
    w[2] = _mm512_srli_epi16(v0, 4);
    w[3] = _mm512_srli_epi16(v1, 4);
}
#else
typedef struct {
    __m512i low, high;
} PairShuffle;

static inline PairShuffle pair_shuffle(void) {
    return (PairShuffle){_mm512_set1_epi32(0x0F), _mm512_set1_epi32(0x000F0000)};
}

static inline __attribute__((always_inline)) void unpack_pair(const PairShuffle *sh, const uint8_t *p, __m512i *w) {
    const __m512i a0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i a1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
    const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 32)));
    const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 48)));
    w[0] = _mm512_or_si512(_mm512_and_si512(a0, sh->low), _mm512_slli_epi32(_mm512_and_si512(b0, sh->low), 16));
    w[1] = _mm512_or_si512(_mm512_and_si512(a1, sh->low), _mm512_slli_epi32(_mm512_and_si512(b1, sh->low), 16));
    w[2] = _mm512_or_si512(_mm512_srli_epi32(a0, 4), _mm512_and_si512(_mm512_slli_epi32(b0, 12), sh->high));
    w[3] = _mm512_or_si512(_mm512_srli_epi32(a1, 4), _mm512_and_si512(_mm512_slli_epi32(b1, 12), sh->high));
}
#endif

/* vpdpwssd as inline assembly: through the intrinsic gcc 12 copied every sum to a new register after each
   one and kept some on the stack (read in its assembly), at about half the speed. */
static inline __m512i dpwssd(__m512i acc, __m512i w, __m512i x) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
    return acc;
}
#endif

#endif
