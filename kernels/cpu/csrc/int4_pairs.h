/* What the int16-input GEMMs of 4-bit codes (gemm_int4.c) and of 5/6-bit codes (gemm_intn.c) share: the
unpacking of a pair of columns of torch's int4 pack into vpdpwssd's operands, and vpdpwssd itself. */
#ifndef PAGEDSERVE_INT4_PAIRS_H
#define PAGEDSERVE_INT4_PAIRS_H

#include "gemm_int4.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#ifdef __AVX512VBMI__
/* vpermb's byte order for one pair of columns (64 bytes: column 2i's 32, then 2i + 1's): byte j of each
   column to bytes 4j and 4j + 2 of a lane, channels 0-15 (idx[0]) or 16-31 (idx[1]); the odd bytes are
   zeroed by the mask. Then a mask keeps the low nibbles (channels c) and a shift the high ones (c + 32). */
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
#endif

/* vpdpwssd as inline assembly: through the intrinsic gcc 12 copied every sum to a new register after each
   one and kept some on the stack (read in its assembly), at about half the speed. */
static inline __m512i dpwssd(__m512i acc, __m512i w, __m512i x) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
    return acc;
}

/* Row r of a pass of R (a constant) rows: its inputs 2i and 2i + 1 (x points at the first) times one pair of
   columns' unpacked codes wv, into the row's four sums, named variables: gcc kept an array's on the stack. */
#define PS_PAIR_ROW(R, r, x, wv, v0, v1, v2, v3)                                                            \
    if ((R) > (r)) {                                                                                        \
        int32_t pair_;                                                                                      \
        memcpy(&pair_, (x), sizeof pair_);                                                                  \
        const __m512i xb_ = _mm512_set1_epi32(pair_);                                                       \
        v0 = dpwssd(v0, (wv)[0], xb_);                                                                      \
        v1 = dpwssd(v1, (wv)[1], xb_);                                                                      \
        v2 = dpwssd(v2, (wv)[2], xb_);                                                                      \
        v3 = dpwssd(v3, (wv)[3], xb_);                                                                      \
    }

/* Group g's int32 sums of rows r0..r0+R-1 for the 64 channels of block nb scaled into y [rows, n]:
   y += scale * xscale * sum(q * xq) + zero * xsum (zero with the codes' offset folded in). */
static inline __attribute__((always_inline)) void ps_scale_group(const Rounded *in, float *y, int64_t n, int64_t nb,
                                                                 int64_t groups, int64_t g, int64_t r0, const int R,
                                                                 const __m512i (*acc)[4], const __m512 *scale,
                                                                 const __m512 *zero) {
    for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const __m512 xs = _mm512_set1_ps(in->xscale[row]), sum = _mm512_set1_ps(in->xsum[row * groups + g]);
        float *yr = y + row * n + nb * 64;
        for (int c = 0; c < 4; ++c) {
            const __m512 v = _mm512_fmadd_ps(zero[c], sum, _mm512_loadu_ps(yr + 16 * c));
            _mm512_storeu_ps(yr + 16 * c, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), _mm512_mul_ps(scale[c], xs), v));
        }
    }
}
#endif

#endif
