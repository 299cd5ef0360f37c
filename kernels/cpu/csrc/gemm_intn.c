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

/* Records ahead of the one being read that a pass prefetches: about gemm_blocks.h's FEW_ROWS_PREFETCH bytes
   of the int4 form's 64-byte pairs. */
enum { INTN_PREFETCH_RECORDS = 65 };

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

/* The format's parts (gemm_blocks.h): int16 inputs as the int4 form's; a step is a record (a pair of
   columns), P = bits - 4 planes, codes 0..2^bits-1 around 2^(bits-1), the scales as the int4 pack's. */
#define FmtWeight GemvIntN
#define FMT_STEP_BYTES(P) ps_intn_record_bytes(4 + (P))
#define FMT_PREFETCH_AHEAD(P) (INTN_PREFETCH_RECORDS * FMT_STEP_BYTES(P))
#define FMT_CODE_MID(P) (1 << (3 + (P)))
#define fmt_scales(w) ((GemvInt4){NULL, (w)->sz, (w)->n, (w)->k, (w)->group, (w)->sz_form, PACK_AVX512})
enum { FMT_X_BYTES = 2, FMT_SCALE_PER_GROUP = 0, FMT_TILE_FROM_ROWS = 0 };
#define fmt_shuffle pair_shuffle
#define fmt_unpack unpack_record
#define fmt_dot dpwssd

#include "gemm_blocks.h"

static int blocks(const GemmRun *j) {
    return ((const GemvIntN *)j->w)->bits == 5 ? gemm_blocks(j, 1) : gemm_blocks(j, 2);
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
static inline __attribute__((always_inline)) void widen(const WidenJob *j, const int P) {
    const GemvIntN *w = j->w;
    const int64_t k = w->k, n = w->n, rec = FMT_STEP_BYTES(P);
    const PairShuffle sh = pair_shuffle();
    const GemvInt4 s = fmt_scales(w);
    const __m512i low16 = _mm512_set1_epi32(0xFFFF);
    for (int64_t nb = j->a; nb < j->b; ++nb) {
        const uint8_t *p = w->packed + nb * (k / 2) * rec;
        for (int64_t g = 0; g < k / w->group; ++g) {
            __m512 scale[4], zero[4];
            group_scales(&s, g, nb, P, scale, zero);
            for (int64_t col = g * w->group; col < (g + 1) * w->group; col += 2, p += rec) {
                __m512i wv[4];
                unpack_record(&sh, p, wv, P);
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

static void widen_blocks(const WidenJob *j) { j->w->bits == 5 ? widen(j, 1) : widen(j, 2); }
#else
static int blocks(const GemmRun *j) { return (void)j, 2; }
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
