/* The block loops of the integer weight-only GEMMs: a "template" each format's file (gemm_int4.c,
gemm_intn.c, gemm_int4_s8.c) includes once, after defining its parts, so that the compiler inlines them into
these loops (the per-format parts are a dozen instructions a step: a call there would cost more than they do).

A dot instruction (vpdpwssd on int16 inputs, vpdpbusd on int8 ones) takes a 32-bit word of a row's inputs,
broadcast, against four vectors of codes that hold the same input columns for 64 channels: a "step" of
4 / FMT_X_BYTES columns. A group's int32 sums are exact and are scaled into the float32 outputs once per group
in one fixed order, so a row's bits never depend on the path that ran it or on the rows beside it.

What the format defines before including this:
  FMT_X_BYTES             bytes of a rounded input: 2 (int16) or 1 (int8)
  FMT_SCALE_PER_GROUP     1 where its inputs have a scale per row and group ([rows, groups]), 0 one per row
  FMT_TILE_FROM_ROWS      rows from which each group's codes are unpacked once into an L1 tile that serves every
                          row; below, a block's codes are unpacked in registers and used at once, four rows a
                          pass (few_rows). 0: never the tile (nor its bound on the group), 1: always
  fmt_shuffle()           the constants its unpacking keeps in registers
  fmt_unpack(&sh, p, wv, V)   the step at p as the dot instruction's operands, channels 16c..16c+15 in wv[c]
  fmt_dot(acc, w, x)      the dot instruction
and, where its codes are not torch's int4 pack (gemv.h's GemvInt4: 32 bytes a column, codes 0..15 around 8):
  FmtWeight, FMT_STEP_BYTES(V), FMT_PREFETCH_AHEAD(V) (how far ahead of the codes being read few_rows prefetches
  them), FMT_CODE_MID(V), fmt_scales(w) (its group scales as a GemvInt4's)
V is a variant of the format, a constant wherever the format calls gemm_blocks (5 or 6 bits: the bit planes
a record holds). */
#ifndef PAGEDSERVE_GEMM_BLOCKS_H
#define PAGEDSERVE_GEMM_BLOCKS_H

#include "gemm_driver.h"
#include "gemv.h"

enum { STEP_COLS = 4 / FMT_X_BYTES };

#ifndef FmtWeight
#define FmtWeight GemvInt4
#define FMT_STEP_BYTES(V) (32 * STEP_COLS)
#define FMT_PREFETCH_AHEAD(V) FEW_ROWS_PREFETCH
#define FMT_CODE_MID(V) 8
#define fmt_scales(w) (*(w))
#endif

/* Rows a pass over a block's codes: 16 int32 sums in registers beside the 4 code vectors. */
enum { PASS_ROWS = 4 };
/* Rows the tile serves in one pass over a block's groups: their outputs (256 bytes a row) stay in L2.
   Unbounded, a 2048-row prefill chunk of the int8 form ran at 0.85x the rate of 128 rows. */
enum { TILE_PASS_ROWS = 256 };

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* The sixteen sums of a pass: named variables, not an array, which gcc kept on the stack. */
#define ZERO_SUMS                                                                                           \
    __m512i a00 = _mm512_setzero_si512(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, \
            a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00
#define SUMS {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}, {a30, a31, a32, a33}}

/* Row r of a pass of R (a constant) rows: the word of its inputs at x times one step's codes wv. */
#define DOT_ROW(R, r, x, wv, v0, v1, v2, v3)                                                                \
    if ((R) > (r)) {                                                                                        \
        int32_t word_;                                                                                      \
        memcpy(&word_, (x), sizeof word_);                                                                  \
        const __m512i xb_ = _mm512_set1_epi32(word_);                                                       \
        v0 = fmt_dot(v0, (wv)[0], xb_);                                                                     \
        v1 = fmt_dot(v1, (wv)[1], xb_);                                                                     \
        v2 = fmt_dot(v2, (wv)[2], xb_);                                                                     \
        v3 = fmt_dot(v3, (wv)[3], xb_);                                                                     \
    }

/* Group g's scales of block nb's channels, and zero - mid * scale (the codes' offset folded in). */
ALWAYS_INLINE void group_scales(const GemvInt4 *s, int64_t g, int64_t nb, const int V, __m512 *scale, __m512 *zero) {
    (void)V;                                    /* in FMT_CODE_MID alone, which the int4 pack's ignores */
    for (int c = 0; c < 4; ++c) {
        ps_int4_scale_zero16(s, g, nb * 64 + 16 * c, &scale[c], &zero[c]);         /* zero - 8 * scale */
        if (FMT_CODE_MID(V) != 8)
            zero[c] = _mm512_fmadd_ps(_mm512_set1_ps(8.0f - (float)FMT_CODE_MID(V)), scale[c], zero[c]);
    }
}

/* Group g's sums of rows r0..r0+R-1 for block nb's 64 channels into y: y + cvt(acc) * (scale * xscale) +
   zero * xsum (zero with the codes' offset folded in). gemm_int4_amx.c's tile computes the same products.
   groups comes from the caller: read here, after the outputs' stores (may_alias, as every unaligned intrinsic
   store), gcc would reload k and group and divide again. */
ALWAYS_INLINE void scale_group(const GemmRun *j, int64_t groups, int64_t nb, int64_t g, int64_t r0, const int R,
                               const __m512i (*acc)[4], const __m512 *scale, const __m512 *zero) {
    for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const __m512 xs = _mm512_set1_ps(j->in.xscale[FMT_SCALE_PER_GROUP ? row * groups + g : row]);
        const __m512 sum = _mm512_set1_ps(j->in.xsum[row * groups + g]);
        float *yr = j->y + row * j->n + nb * 64;
        for (int c = 0; c < 4; ++c) {
            const __m512 v = _mm512_fmadd_ps(zero[c], sum, _mm512_loadu_ps(yr + 16 * c));
            const __m512 products = _mm512_cvtepi32_ps(acc[r][c]);
            _mm512_storeu_ps(yr + 16 * c, _mm512_fmadd_ps(products, _mm512_mul_ps(scale[c], xs), v));
        }
    }
}

ALWAYS_INLINE void zero_outputs(const GemmRun *j, int64_t nb, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) memset(j->y + r * j->n + nb * 64, 0, 64 * sizeof(float));
}

/* Rows r0..r0+R-1 of block nb, every group: each step unpacked in registers and used at once by every row,
   no tile to repay, the codes streamed once with a prefetch ahead. A batch-1 decode's GEMV. */
ALWAYS_INLINE void few_rows(const GemmRun *j, int64_t nb, int64_t r0, const int R, const int V) {
    const FmtWeight *w = j->w;
    const GemvInt4 scales = fmt_scales(w), *sz = &scales;
    const int64_t k = j->k, group = j->group, groups = k / group, row_bytes = k * FMT_X_BYTES;
    const int64_t step = FMT_STEP_BYTES(V), ahead = FMT_PREFETCH_AHEAD(V);
    const __typeof__(fmt_shuffle()) sh = fmt_shuffle();
    const uint8_t *p = w->packed + nb * (k / STEP_COLS) * step;
    const uint8_t *xq = (const uint8_t *)j->in.xq + r0 * row_bytes;
    zero_outputs(j, nb, r0, r0 + R);
    for (int64_t g = 0; g < SCALE_PREFETCH_GROUPS && g < groups; ++g) ps_int4_prefetch_scales(sz, g, nb);
    for (int64_t g = 0; g < groups; ++g) {
        if (g + SCALE_PREFETCH_GROUPS < groups) ps_int4_prefetch_scales(sz, g + SCALE_PREFETCH_GROUPS, nb);
        ZERO_SUMS;
        for (int64_t i = 0; i < group / STEP_COLS; ++i, p += step) {
            for (int64_t b = 0; b < step; b += 64) _mm_prefetch((const char *)(p + ahead + b), _MM_HINT_T0);
            __m512i wv[4];
            fmt_unpack(&sh, p, wv, V);
            const uint8_t *xi = xq + (g * group + STEP_COLS * i) * FMT_X_BYTES;
            DOT_ROW(R, 0, xi, wv, a00, a01, a02, a03)
            DOT_ROW(R, 1, xi + row_bytes, wv, a10, a11, a12, a13)
            DOT_ROW(R, 2, xi + 2 * row_bytes, wv, a20, a21, a22, a23)
            DOT_ROW(R, 3, xi + 3 * row_bytes, wv, a30, a31, a32, a33)
        }
        const __m512i acc[PASS_ROWS][4] = SUMS;
        __m512 scale[4], zero[4];
        group_scales(sz, g, nb, V, scale, zero);
        scale_group(j, groups, nb, g, r0, R, acc, scale, zero);
    }
}

/* R rows from r0 against group g's codes unpacked in the tile. */
ALWAYS_INLINE void tile_rows(const GemmRun *j, int64_t groups, const __m512i (*tile)[4], const __m512 *scale,
                             const __m512 *zero, int64_t g, int64_t nb, int64_t r0, const int R) {
    const int64_t group = j->group, row_bytes = j->k * FMT_X_BYTES;
    const uint8_t *x[PASS_ROWS];
    for (int r = 0; r < PASS_ROWS; ++r)
        x[r] = (const uint8_t *)j->in.xq + (r0 + (r < R ? r : 0)) * row_bytes + g * group * FMT_X_BYTES;
    ZERO_SUMS;
    for (int64_t i = 0; i < group / STEP_COLS; ++i) {
        const __m512i wv[4] = {tile[i][0], tile[i][1], tile[i][2], tile[i][3]};
        DOT_ROW(R, 0, x[0] + 4 * i, wv, a00, a01, a02, a03)
        DOT_ROW(R, 1, x[1] + 4 * i, wv, a10, a11, a12, a13)
        DOT_ROW(R, 2, x[2] + 4 * i, wv, a20, a21, a22, a23)
        DOT_ROW(R, 3, x[3] + 4 * i, wv, a30, a31, a32, a33)
    }
    const __m512i acc[PASS_ROWS][4] = SUMS;
    scale_group(j, groups, nb, g, r0, R, acc, scale, zero);
}

/* Rows r_first..r_end-1 of block nb: each group's codes unpacked once into the tile that serves them all. */
ALWAYS_INLINE void tile_block(const GemmRun *j, int64_t nb, int64_t r_first, int64_t r_end, __m512i (*tile)[4],
                              const int V) {
    const FmtWeight *w = j->w;
    const GemvInt4 scales = fmt_scales(w), *sz = &scales;
    const int64_t k = j->k, group = j->group, groups = k / group, step = FMT_STEP_BYTES(V);
    const __typeof__(fmt_shuffle()) sh = fmt_shuffle();
    const __m512i (*unpacked)[4] = (const __m512i (*)[4])tile;
    zero_outputs(j, nb, r_first, r_end);
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *p = w->packed + (nb * (k / STEP_COLS) + g * (group / STEP_COLS)) * step;
        for (int64_t i = 0; i < group / STEP_COLS; ++i) fmt_unpack(&sh, p + step * i, tile[i], V);
        __m512 scale[4], zero[4];
        group_scales(sz, g, nb, V, scale, zero);
        int64_t r = r_first;
        for (; r + PASS_ROWS <= r_end; r += PASS_ROWS)
            tile_rows(j, groups, unpacked, scale, zero, g, nb, r, PASS_ROWS);
        switch (r_end - r) {
            case 1: tile_rows(j, groups, unpacked, scale, zero, g, nb, r, 1); break;
            case 2: tile_rows(j, groups, unpacked, scale, zero, g, nb, r, 2); break;
            case 3: tile_rows(j, groups, unpacked, scale, zero, g, nb, r, 3); break;
            default: break;
        }
    }
}

/* Rows a pass of few_rows takes at most: fewer where the tile takes the rest (0: the tile takes every row). */
enum {
    FEW_PASS_ROWS = FMT_TILE_FROM_ROWS == 0 || FMT_TILE_FROM_ROWS > (int)PASS_ROWS ? (int)PASS_ROWS
                                                                                 : FMT_TILE_FROM_ROWS - 1
};

/* Blocks j->a..j->b-1 for all j->rows rows (a GemmRun's blocks). */
ALWAYS_INLINE int gemm_blocks(const GemmRun *j, const int V) {
    for (int64_t nb = j->a; nb < j->b; ++nb) {
        if (FEW_PASS_ROWS > 0 && (FMT_TILE_FROM_ROWS == 0 || j->rows < FMT_TILE_FROM_ROWS)) {
            /* FEW_PASS_ROWS rows a pass: the passes after the first read the block's codes from L2. */
            for (int64_t r0 = 0; r0 < j->rows; r0 += FEW_PASS_ROWS) {
                switch (j->rows - r0 < FEW_PASS_ROWS ? j->rows - r0 : FEW_PASS_ROWS) {
                    case 1: few_rows(j, nb, r0, 1, V); break;
                    case 2: few_rows(j, nb, r0, 2, V); break;
                    case 3: few_rows(j, nb, r0, 3, V); break;
                    default: few_rows(j, nb, r0, 4, V); break;       /* where FEW_PASS_ROWS is 4 */
                }
            }
        } else {
            __m512i tile[GEMM_MAX_GROUP / STEP_COLS][4];
            for (int64_t r = 0; r < j->rows; r += TILE_PASS_ROWS)
                tile_block(j, nb, r, r + TILE_PASS_ROWS < j->rows ? r + TILE_PASS_ROWS : j->rows, tile, V);
        }
    }
    return 0;
}

#endif
