/* 5- and 6-bit weight-only GEMM straight from their pack (gemm_intn.h), integer dot products, and its widening.

GGUF's Q5_0 / Q5_1 / Q5_K / Q6_K layers went to int8 per channel (8 bits a weight where the file has 5.5-6.6):
llama-quantize writes most of a Q4_K_M file's layers as Q5_0 where a width is not a multiple of 256 (the 135M
and 360M models), so a token read 30 % more bytes than the file holds (issue 25). Here the codes keep their
width: the low four bits are unpacked as gemm_int4.c's VBMI path unpacks a pair of columns (two byte
shuffles, int4_pairs.h), and each further bit is one masked 16-bit add from a plane laid out in the same
order. Inputs are rounded to int16 as there (ps_round_int16), sums are exact int32 per group (at most
group * 63 * 32767 < 2^31) scaled into float32 once per group, four input rows a pass over a block's codes.
A many-row call (a prefill chunk) widens the weight to bfloat16 once for oneDNN instead (ps_dequant_intn_t). */

#include "gemm_int4.h"
#include "gemm_intn.h"
#include "int4_pairs.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define GEMM_INTN_BUILT 1
#else
#define GEMM_INTN_BUILT 0
#endif

enum { INTN_ROWS = 4 };            /* rows a pass: 16 int32 sums in registers beside the 4 code vectors */
/* Records ahead of the one being read that a pass prefetches: about gemm_int4.c's FEW_ROWS_PREFETCH bytes of
   its 64-byte pairs. */
enum { INTN_PREFETCH_RECORDS = 65 };

typedef GemmRun IntNJob;          /* w: a GemvIntN */

typedef struct {
    const GemvIntN *w;
    uint16_t *out;                 /* bfloat16 [k, n] */
    int64_t a, b;                  /* 64-channel blocks a..b-1 */
} WidenJob;

static int takes(const GemvIntN *w) {
    return w->n % 64 == 0 && (w->bits == 5 || w->bits == 6) && (w->sz_form == SZ_SCALES || w->sz_form == SZ_PAIRS)
           && w->group >= 2 && w->group % 2 == 0 && w->k % w->group == 0;
}

#if GEMM_INTN_BUILT
/* Channels 16c.. of group g: scale, and zero - 2^(bits-1) * scale (the codes' offset folded in). */
static inline void scale_zero16(const GemvIntN *w, int64_t g, int64_t c0, __m512 *scale, __m512 *zero) {
    const GemvInt4 s = {NULL, w->sz, w->n, w->k, w->group, w->sz_form};
    ps_int4_scale_zero16(&s, g, c0, scale, zero);           /* zero - 8 * scale */
    *zero = _mm512_fmadd_ps(_mm512_set1_ps(8.0f - (float)(1 << (w->bits - 1))), *scale, *zero);
}

/* One record's codes as int16 in vpdpwssd's operand order (int4_pairs.h): the low nibbles, then P planes. */
static inline __attribute__((always_inline)) void unpack_record(const PairShuffle *sh, const uint8_t *p,
                                                                __m512i *wv, const int P) {
    unpack_pair(sh, p, wv);
    const uint32_t *planes = (const uint32_t *)(p + 64);
    for (int b = 0; b < P; ++b) {
        const __m512i bit = _mm512_set1_epi16((short)(16 << b));
        for (int c = 0; c < 4; ++c) wv[c] = _mm512_mask_add_epi16(wv[c], planes[4 * b + c], wv[c], bit);
    }
}

/* Rows r0..r0+R-1 of one 64-channel block, every group: the codes streamed once for the R rows. */
static inline __attribute__((always_inline)) void block_rows(const IntNJob *j, int64_t nb, int64_t r0, const int R,
                                                             const int P) {
    const GemvIntN *w = j->w;
    const int64_t k = w->k, group = w->group, groups = k / group, rec = ps_intn_record_bytes(w->bits);
    const PairShuffle sh = pair_shuffle();
    const uint8_t *p = w->packed + nb * (k / 2) * rec;
    const int16_t *xq = (const int16_t *)j->in.xq + r0 * k;
    const GemvInt4 sz = {NULL, w->sz, w->n, k, group, w->sz_form};
    for (int r = 0; r < R; ++r) memset(j->y + (r0 + r) * w->n + nb * 64, 0, 64 * sizeof(float));
    for (int64_t g = 0; g < SCALE_PREFETCH_GROUPS && g < groups; ++g) ps_int4_prefetch_scales(&sz, g, nb);
    for (int64_t g = 0; g < groups; ++g) {
        if (g + SCALE_PREFETCH_GROUPS < groups) ps_int4_prefetch_scales(&sz, g + SCALE_PREFETCH_GROUPS, nb);
        /* Sixteen named sums, not an array: gcc kept an array's on the stack (as gemm_int4.c found). */
        __m512i a00 = _mm512_setzero_si512(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
                a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
        for (int64_t i = 0; i < group / 2; ++i, p += rec) {
            _mm_prefetch((const char *)(p + INTN_PREFETCH_RECORDS * rec), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + INTN_PREFETCH_RECORDS * rec + 64), _MM_HINT_T0);
            __m512i wv[4];
            unpack_record(&sh, p, wv, P);
            const int16_t *xi = xq + g * group + 2 * i;
            PS_PAIR_ROW(R, 0, xi, wv, a00, a01, a02, a03)
            PS_PAIR_ROW(R, 1, xi + k, wv, a10, a11, a12, a13)
            PS_PAIR_ROW(R, 2, xi + 2 * k, wv, a20, a21, a22, a23)
            PS_PAIR_ROW(R, 3, xi + 3 * k, wv, a30, a31, a32, a33)
        }
        const __m512i acc[INTN_ROWS][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23},
                                           {a30, a31, a32, a33}};
        __m512 scale[4], zero[4];
        for (int c = 0; c < 4; ++c) scale_zero16(w, g, nb * 64 + 16 * c, &scale[c], &zero[c]);
        ps_scale_group(&j->in, j->y, w->n, nb, groups, g, r0, R, acc, scale, zero);
    }
}

#define ROWS_CASES(P)                                                                                       \
    switch (j->rows - r0 < INTN_ROWS ? j->rows - r0 : INTN_ROWS) {                                          \
        case 1: block_rows(j, nb, r0, 1, P); break;                                                         \
        case 2: block_rows(j, nb, r0, 2, P); break;                                                         \
        case 3: block_rows(j, nb, r0, 3, P); break;                                                         \
        default: block_rows(j, nb, r0, 4, P); break;                                                        \
    }

static int blocks(const IntNJob *j) {
    for (int64_t nb = j->a; nb < j->b; ++nb)
        for (int64_t r0 = 0; r0 < j->rows; r0 += INTN_ROWS) {
            if (((const GemvIntN *)j->w)->bits == 5) ROWS_CASES(1)
            else ROWS_CASES(2)
        }
    return 0;
}

/* Sixteen floats to bfloat16, rounded to nearest even as f32_to_bf16 rounds. */
static inline __m256i bf16x16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

/* Blocks a..b-1 widened into out [k, n]: a record's int16 lane pairs hold columns 2i (low half) and 2i + 1
   (high half) of sixteen adjacent channels, which are sixteen adjacent bfloat16 of each column's row. */
static void widen_blocks(const WidenJob *j) {
    const GemvIntN *w = j->w;
    const int64_t k = w->k, n = w->n, rec = ps_intn_record_bytes(w->bits);
    const PairShuffle sh = pair_shuffle();
    const __m512i low16 = _mm512_set1_epi32(0xFFFF);
    for (int64_t nb = j->a; nb < j->b; ++nb) {
        const uint8_t *p = w->packed + nb * (k / 2) * rec;
        for (int64_t g = 0; g < k / w->group; ++g) {
            __m512 scale[4], zero[4];
            for (int c = 0; c < 4; ++c) scale_zero16(w, g, nb * 64 + 16 * c, &scale[c], &zero[c]);
            for (int64_t col = g * w->group; col < (g + 1) * w->group; col += 2, p += rec) {
                __m512i wv[4];
                if (w->bits == 5) unpack_record(&sh, p, wv, 1);
                else unpack_record(&sh, p, wv, 2);
                uint16_t *o = j->out + col * n + nb * 64;
                for (int c = 0; c < 4; ++c) {
                    const __m512 even = _mm512_cvtepi32_ps(_mm512_and_si512(wv[c], low16));
                    const __m512 odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(wv[c], 16));
                    _mm256_storeu_si256((__m256i *)(o + 16 * c), bf16x16(_mm512_fmadd_ps(even, scale[c], zero[c])));
                    _mm256_storeu_si256((__m256i *)(o + n + 16 * c), bf16x16(_mm512_fmadd_ps(odd, scale[c], zero[c])));
                }
            }
        }
    }
}
#else
static int blocks(const IntNJob *j) { return (void)j, 2; }
static void widen_blocks(const WidenJob *j) { (void)j; }
#endif

int ps_gemm_intn_built(void) { return GEMM_INTN_BUILT; }

int ps_gemm_intn_part(const GemvIntN *w, const float *x, int64_t rows, float *y, int64_t nb0, int64_t nb1) {
    if (!GEMM_INTN_BUILT || rows < 1 || !takes(w)) return 2;
    return ps_gemm_part(ps_int16_run(w, w->n, w->k, w->group, x, rows, y, blocks), nb0, nb1);
}

/* y [rows, n] = x [rows, k] @ w^T on `threads` OpenMP threads: 0 on success, 2 for what it does not take. */
int ps_gemm_intn(const uint8_t *packed, const uint16_t *sz, int64_t sz_form, int64_t bits, int64_t n, int64_t k,
                 int64_t group, const float *x, int64_t rows, float *y, int threads) {
    const GemvIntN w = {packed, sz, n, k, group, sz_form, bits};
    if (!GEMM_INTN_BUILT || rows < 1 || !takes(&w)) return 2;
    return ps_gemm_threads(ps_int16_run(&w, n, k, group, x, rows, y, blocks), threads);
}

static void *widen_job(void *arg) {
    widen_blocks((const WidenJob *)arg);
    return NULL;
}

static void widen_range(void *job, int64_t a, int64_t b) { ((WidenJob *)job)->a = a; ((WidenJob *)job)->b = b; }

/* The weight widened and transposed: out bfloat16 [k, n]. 0 on success, 2 for what it does not take. */
int ps_dequant_intn_t(const uint8_t *packed, const uint16_t *sz, int64_t sz_form, int64_t bits, uint16_t *out,
                      int64_t n, int64_t k, int64_t group, int threads) {
    const GemvIntN w = {packed, sz, n, k, group, sz_form, bits};
    if (!GEMM_INTN_BUILT || !takes(&w)) return 2;
    WidenJob jobs[MAX_THREADS];
    for (int t = 0; t < MAX_THREADS; ++t) jobs[t] = (WidenJob){&w, out, 0, 0};
    return ps_run_split(threads, n / 64, jobs, sizeof(WidenJob), widen_job, widen_range);
}
