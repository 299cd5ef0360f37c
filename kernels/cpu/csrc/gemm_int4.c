/* int4 weight-only GEMM straight from torch's CPU int4 pack, integer dot products (AVX512-VNNI).

The inputs are rounded to int16 (one scale per row, |error| <= max|x| / 65534: finer than the bfloat16 that
torch's int4 kernel and the widen-then-oneDNN path round them to) and the codes are multiplied as integers
with vpdpwssd: 32 multiply-adds of int16 pairs per instruction, twice a float FMA's 16. With AVX512-VBMI each
pair of columns of a 64-channel block is unpacked in registers by two byte shuffles and serves four input rows
at once (gemm_blocks.h's few_rows, every row count); without it each group of codes is unpacked once into
(k, k+1) int16 pairs in an L1 tile that serves every input row. A group's int32 sums are exact (at most
group * 15 * 32767 < 2^31) and are scaled into the float32 outputs once per group. Measured on the embedded
model's 30 layers (docs/cpu_performance.md): from 2 to ~200 rows it beats the float GEMVs, torch's int4
kernel and widening the weights for oneDNN (1.5x the next best at 32-96 rows). */
#include <math.h>

#include "gemm_int4.h"
#include "int4_pairs.h"

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
    return rows >= 1 && w->n % 64 == 0 && w->group >= 2 && w->group <= GEMM_MAX_GROUP
           && w->k % w->group == 0 && ps_int4_sz_takes(w->sz_form, w->k, w->group);
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define GEMM_INT4_BUILT 1

/* The format's parts (gemm_blocks.h): int16 inputs, one scale a row; a step is a pair of columns. */
#ifdef __AVX512VBMI__
/* Every row count, four rows a pass over each block: 1.1-1.8x the tile's speed from 4 to 200 rows on the
   1.7B and 135M models' layer shapes (issue 26, docs/cpu_performance.md 2026-11-28). The tile serves CPUs
   without VBMI, whose unpacking takes a dozen instructions a pair. */
enum { FMT_X_BYTES = 2, FMT_SCALE_PER_GROUP = 0, FMT_TILE_FROM_ROWS = 0 };
#else
enum { FMT_X_BYTES = 2, FMT_SCALE_PER_GROUP = 0, FMT_TILE_FROM_ROWS = 1 };
#endif
#define fmt_shuffle pair_shuffle
#define fmt_unpack(sh, p, wv, V) unpack_pair(sh, p, wv)
#define fmt_dot dpwssd
#include "gemm_blocks.h"

static int blocks(const GemmRun *j) { return gemm_blocks(j, 0); }
#else
#define GEMM_INT4_BUILT 0
static int blocks(const GemmRun *j) { return (void)j, 2; }
#endif

int ps_gemm_int4_vectorized(void) { return GEMM_INT4_BUILT; }

int ps_gemm_int4_min_rows(void) { return GEMM_INT4_MIN_ROWS; }

int ps_gemm_int4_part(const GemvInt4 *w, const float *x, int64_t rows, float *y, int64_t nb0, int64_t nb1) {
    if (!GEMM_INT4_BUILT || rows < GEMM_INT4_MIN_ROWS || !takes(w, rows)) return 2;
    return ps_gemm_part(ps_int16_run(w, w->n, w->k, w->group, x, rows, y, blocks), nb0, nb1);
}

int ps_gemm_int4(const uint8_t *packed, const uint16_t *sz, int64_t sz_form, int64_t n, int64_t k, int64_t group,
                 const float *x, int64_t rows, float *y, int threads) {
    const GemvInt4 w = {packed, sz, n, k, group, sz_form, PACK_AVX512};
    if (!GEMM_INT4_BUILT || !takes(&w, rows)) return 2;
    return ps_gemm_threads(ps_int16_run(&w, n, k, group, x, rows, y, blocks), threads);
}
