/* int4 weight-only GEMM straight from torch's CPU int4 pack, integer dot products (AVX512-VNNI).

The inputs are rounded to int16 (one scale per row, |error| <= max|x| / 65534: finer than the bfloat16 that
torch's int4 kernel and the widen-then-oneDNN path round them to) and the codes are multiplied as integers
with vpdpwssd: 32 multiply-adds of int16 pairs per instruction, twice a float FMA's 16. With AVX512-VBMI each
pair of columns of a 64-channel block is unpacked in registers by two byte shuffles and serves four input rows
at once (block_few_rows, every row count); without it each group of codes is unpacked once into (k, k+1) int16
pairs in an L1 tile that serves every input row;
a group's int32 sums are exact (at most group * 15 * 32767 < 2^31) and are scaled into the float32 outputs
once per group. Measured on the embedded model's 30 layers (docs/cpu_performance.md): from 2 to ~200
rows it beats the float GEMVs, torch's int4 kernel and widening the weights for oneDNN (1.5x the next best
at 32-96 rows). */
#include <math.h>

#include "gemm_int4.h"
#include "int4_pairs.h"

/* Rows per pass (16 int32 sums in registers beside 4 weight vectors); group sizes up to 256
   (kernels/weight_only.INT4_GROUP_SIZES). */
enum { TILE_ROWS = 4, MAX_GROUP_PAIRS = 128 };
/* Bytes ahead of the codes being read that block_few_rows prefetches (the stream of one 64-channel block).
   On the 1.7B model 2048 ran 27-32 ms a token and 4160 / 8256 19-20 in the same minutes (issue 25, the 2-core
   EPYC VM, whose read bandwidth itself switches between ~43 and ~72 GiB/s phases: compare within one). */
enum { FEW_ROWS_PREFETCH = 4160 };
/* Rows block_few_rows takes in one pass over a block (16 int32 sums in registers beside 4 weight vectors). */
enum { FEW_ROWS = 4 };

typedef GemmRun GemmJob;          /* w: a GemvInt4 */

void ps_round_int16(const GemmRun *g) {
    const int64_t k = g->k, group = g->group;
    const Rounded *in = &g->in;
    for (int64_t r = g->a; r < g->b; ++r) {
        const float *xr = in->x + r * k;
        int16_t *q = (int16_t *)in->xq + r * k;
        float top = 0.0f;
        for (int64_t i = 0; i < k; ++i) top = fabsf(xr[i]) > top ? fabsf(xr[i]) : top;   /* vectorized by gcc */
        /* In double, then rounded once: -ffast-math may turn a float division into a reciprocal and a
           multiply, which moves the last bit and with it which way a value on a half step rounds. */
        const float inv = top > 0.0f ? (float)(32767.0 / (double)top) : 0.0f;
        in->xscale[r] = (float)((double)top / 32767.0);
        int64_t i = 0;
#ifdef __AVX512F__
        /* Vectorized, as the scalar loop rounds (to nearest even, the default mode lrintf uses too): at 1-3
           rows this runs once per thread per linear, and scalar it cost 1.7B's decode step ~2 ms. */
        for (const __m512 vinv = _mm512_set1_ps(inv); i + 16 <= k; i += 16)
            _mm256_storeu_si256((__m256i *)(q + i),
                                _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xr + i), vinv))));
#endif
        for (; i < k; ++i) q[i] = (int16_t)lrintf(xr[i] * inv);
        for (int64_t gi = 0; gi < k / group; ++gi) {
            int32_t s = 0;
            for (int64_t i = gi * group; i < (gi + 1) * group; ++i) s += q[i];
            in->xsum[r * (k / group) + gi] = (float)s * in->xscale[r];
        }
    }
}

static int takes(const GemvInt4 *w, int64_t rows) {
    return rows >= 1 && w->n % 64 == 0 && w->group >= 2 && w->group / 2 <= MAX_GROUP_PAIRS && w->k % w->group == 0
           && ps_int4_sz_takes(w->sz_form, w->k, w->group);
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define GEMM_INT4_BUILT 1

/* One group's codes of one 64-channel block as int16 (k, k+1) pairs: tile[p][c] holds channels 16c..16c+15
   of columns g0 + 2p and g0 + 2p + 1 (the two columns' 32-byte rows are adjacent in the pack: channel i is
   the low nibble of byte i, channel i + 32 the high one). */
static void unpack_group(const uint8_t *p, int64_t pairs, __m512i (*tile)[4]) {
#ifdef __AVX512VBMI__
    /* Two shuffles and two masks a pair, where widening byte by byte below takes a dozen instructions. */
    const PairShuffle sh = pair_shuffle();
    for (int64_t i = 0; i < pairs; ++i, p += 64) unpack_pair(&sh, p, tile[i]);
#else
    const __m512i low = _mm512_set1_epi32(0x0F), high = _mm512_set1_epi32(0x000F0000);
    for (int64_t i = 0; i < pairs; ++i, p += 64) {
        __m512i a0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
        __m512i a1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
        __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 32)));
        __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 48)));
        tile[i][0] = _mm512_or_si512(_mm512_and_si512(a0, low), _mm512_slli_epi32(_mm512_and_si512(b0, low), 16));
        tile[i][1] = _mm512_or_si512(_mm512_and_si512(a1, low), _mm512_slli_epi32(_mm512_and_si512(b1, low), 16));
        tile[i][2] = _mm512_or_si512(_mm512_srli_epi32(a0, 4), _mm512_and_si512(_mm512_slli_epi32(b0, 12), high));
        tile[i][3] = _mm512_or_si512(_mm512_srli_epi32(a1, 4), _mm512_and_si512(_mm512_slli_epi32(b1, 12), high));
    }
#endif
}

/* The group's integer sums of R input rows (a constant at each call) into acc[r][c]; separate local
   variables, so that all sixteen stay in registers. */
static inline __attribute__((always_inline)) void dot_group(const int16_t *const *x, const __m512i (*tile)[4],
                                                            int64_t pairs, __m512i (*acc)[4], const int R) {
    __m512i a00 = _mm512_setzero_si512(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
            a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    for (int64_t i = 0; i < pairs; ++i) {
        const __m512i w0 = tile[i][0], w1 = tile[i][1], w2 = tile[i][2], w3 = tile[i][3];
        int32_t pair;                                   /* inputs 2i and 2i + 1, as vpdpwssd pairs them */
#define ROW(r, v0, v1, v2, v3)                                                                              \
        if (R > r) {                                                                                        \
            memcpy(&pair, x[r] + 2 * i, sizeof pair);                                                       \
            const __m512i xb = _mm512_set1_epi32(pair);                                                     \
            v0 = dpwssd(v0, w0, xb);                                                                        \
            v1 = dpwssd(v1, w1, xb);                                                                        \
            v2 = dpwssd(v2, w2, xb);                                                                        \
            v3 = dpwssd(v3, w3, xb);                                                                        \
        }
        ROW(0, a00, a01, a02, a03)
        ROW(1, a10, a11, a12, a13)
        ROW(2, a20, a21, a22, a23)
        ROW(3, a30, a31, a32, a33)
#undef ROW
    }
    acc[0][0] = a00; acc[0][1] = a01; acc[0][2] = a02; acc[0][3] = a03;
    acc[1][0] = a10; acc[1][1] = a11; acc[1][2] = a12; acc[1][3] = a13;
    acc[2][0] = a20; acc[2][1] = a21; acc[2][2] = a22; acc[2][3] = a23;
    acc[3][0] = a30; acc[3][1] = a31; acc[3][2] = a32; acc[3][3] = a33;
}

/* R rows from r0 against one unpacked group g: y += scale * xscale * sum(q * xq) + (zero - 8 * scale) * xsum. */
static inline __attribute__((always_inline)) void rows_group(const GemmJob *j, const __m512i (*tile)[4],
                                                             const __m512 *scale, const __m512 *zero, int64_t g,
                                                             int64_t nb, int64_t r0, const int R) {
    const GemvInt4 *w = j->w;
    const int64_t k = w->k, group = w->group, groups = k / group;
    const int16_t *x[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; ++r) x[r] = (const int16_t *)j->in.xq + (r0 + (r < R ? r : 0)) * k + g * group;
    __m512i acc[TILE_ROWS][4];
    dot_group(x, tile, group / 2, acc, R);
    ps_scale_group(&j->in, j->y, w->n, nb, groups, g, r0, R, (const __m512i (*)[4])acc, scale, zero);
}

static void block(const GemmJob *j, int64_t nb, __m512i (*tile)[4]) {
    const GemvInt4 *w = j->w;
    for (int64_t r = 0; r < j->rows; ++r) memset(j->y + r * w->n + nb * 64, 0, 64 * sizeof(float));
    for (int64_t g = 0; g < w->k / w->group; ++g) {
        unpack_group(w->packed + (nb * w->k + g * w->group) * 32, w->group / 2, tile);
        __m512 scale[4], zero[4];
        for (int c = 0; c < 4; ++c) ps_int4_scale_zero16(w, g, nb * 64 + 16 * c, &scale[c], &zero[c]);
        int64_t r = 0;
        for (; r + TILE_ROWS <= j->rows; r += TILE_ROWS) rows_group(j, tile, scale, zero, g, nb, r, TILE_ROWS);
        switch (j->rows - r) {
            case 1: rows_group(j, tile, scale, zero, g, nb, r, 1); break;
            case 2: rows_group(j, tile, scale, zero, g, nb, r, 2); break;
            case 3: rows_group(j, tile, scale, zero, g, nb, r, 3); break;
            default: break;
        }
    }
}

#ifdef __AVX512VBMI__
/* Rows r0..r0+R-1 (R <= FEW_ROWS) of one 64-channel block: each pair of columns unpacked in registers by two
   byte shuffles and used at once by every row, no tile, the codes streamed once with a prefetch ahead. A batch-1 decode's GEMV, and
   a few rows' (a verify pass, a small decode batch): its sums are the tile path's, exact int32 per group,
   scaled in the same order, so a row's bits do not depend on which path or which rows ran beside it. */
static inline __attribute__((always_inline)) void block_few_rows(const GemmJob *j, int64_t nb, int64_t r0,
                                                                 const int R) {
    const GemvInt4 *w = j->w;
    const int64_t k = w->k, group = w->group, groups = k / group;
    const PairShuffle sh = pair_shuffle();
    const uint8_t *p = w->packed + nb * k * 32;
    const int16_t *xq = (const int16_t *)j->in.xq + r0 * k;
    for (int r = 0; r < R; ++r) memset(j->y + (r0 + r) * w->n + nb * 64, 0, 64 * sizeof(float));
    for (int64_t g = 0; g < SCALE_PREFETCH_GROUPS && g < groups; ++g) ps_int4_prefetch_scales(w, g, nb);
    for (int64_t g = 0; g < groups; ++g) {
        if (g + SCALE_PREFETCH_GROUPS < groups) ps_int4_prefetch_scales(w, g + SCALE_PREFETCH_GROUPS, nb);
        __m512i a00 = _mm512_setzero_si512(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
                a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
        for (int64_t i = 0; i < group / 2; ++i, p += 64) {
            _mm_prefetch((const char *)(p + FEW_ROWS_PREFETCH), _MM_HINT_T0);
            __m512i wv[4];
            unpack_pair(&sh, p, wv);
            const int16_t *xi = xq + g * group + 2 * i;
            PS_PAIR_ROW(R, 0, xi, wv, a00, a01, a02, a03)
            PS_PAIR_ROW(R, 1, xi + k, wv, a10, a11, a12, a13)
            PS_PAIR_ROW(R, 2, xi + 2 * k, wv, a20, a21, a22, a23)
            PS_PAIR_ROW(R, 3, xi + 3 * k, wv, a30, a31, a32, a33)
        }
        const __m512i acc[FEW_ROWS][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23},
                                          {a30, a31, a32, a33}};
        __m512 scale[4], zero[4];
        for (int c = 0; c < 4; ++c) ps_int4_scale_zero16(w, g, nb * 64 + 16 * c, &scale[c], &zero[c]);
        ps_scale_group(&j->in, j->y, w->n, nb, groups, g, r0, R, acc, scale, zero);
    }
}
#endif

static int blocks(const GemmJob *j) {
#ifdef __AVX512VBMI__
    /* Every row count, four rows a pass over each block (the passes after the first read its codes from L2):
       1.1-1.8x the tile's speed from 4 to 200 rows on the 1.7B and 135M models' layer shapes (issue 26,
       docs/cpu_performance.md 2026-11-28). The tile serves CPUs without VBMI. */
    for (int64_t nb = j->a; nb < j->b; ++nb) {
        for (int64_t r0 = 0; r0 < j->rows; r0 += FEW_ROWS) {
            switch (j->rows - r0 < FEW_ROWS ? j->rows - r0 : FEW_ROWS) {
                case 1: block_few_rows(j, nb, r0, 1); break;
                case 2: block_few_rows(j, nb, r0, 2); break;
                case 3: block_few_rows(j, nb, r0, 3); break;
                default: block_few_rows(j, nb, r0, 4); break;
            }
        }
    }
#else
    __m512i tile[MAX_GROUP_PAIRS][4];
    for (int64_t nb = j->a; nb < j->b; ++nb) block(j, nb, tile);
#endif
    return 0;
}
#else
#define GEMM_INT4_BUILT 0
static int blocks(const GemmJob *j) { return (void)j, 2; }
#endif

int ps_gemm_int4_vectorized(void) { return GEMM_INT4_BUILT; }

int ps_gemm_int4_min_rows(void) { return GEMM_INT4_MIN_ROWS; }

int ps_gemm_int4_part(const GemvInt4 *w, const float *x, int64_t rows, float *y, int64_t nb0, int64_t nb1) {
    if (!GEMM_INT4_BUILT || rows < GEMM_INT4_MIN_ROWS || !takes(w, rows)) return 2;
    return ps_gemm_part(ps_int16_run(w, w->n, w->k, w->group, x, rows, y, blocks), nb0, nb1);
}

int ps_gemm_int4(const uint8_t *packed, const uint16_t *sz, int64_t sz_form, int64_t n, int64_t k, int64_t group,
                 const float *x, int64_t rows, float *y, int threads) {
    const GemvInt4 w = {packed, sz, n, k, group, sz_form};
    if (!GEMM_INT4_BUILT || !takes(&w, rows)) return 2;
    return ps_gemm_threads(ps_int16_run(&w, n, k, group, x, rows, y, blocks), threads);
}
