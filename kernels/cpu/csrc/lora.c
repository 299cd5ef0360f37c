/* LoRA's delta on CPU: per token, xa = A[slot] x (the shrink), then y += xa B[slot] (the expand).

   Two callers. The layer path (ps_lora_bgmv) takes the decode rows of several adapters, interleaved, in one
   call per linear layer, where torch took a gather, two batched matmuls, an index_select and an index_add,
   each a trip through the dispatcher for a few kilobytes of work: the caller hands the tokens sorted by slot,
   so a slot's A and B are read once for all its tokens, and threads split the sorted list. The one-call decode
   step (decode_step.c) runs the two phases on its own team, between its base GEMVs and what reads their
   output (ps_lora_step_shrink, ps_lora_step_expand). Both use the same shrink and expand below.

   B is kept transposed ([wmax, out] a slot, lora.h), so the expand is a sum of rows of B scaled by xa, 64
   output columns at a time in registers across the rank, with no horizontal sums; a merged layer's piece p
   reads only its own rows of B and its own output columns (the rest of the block layout is zeros). The shrink
   runs four rows of A side by side. With few tokens a step these kernels stream every adapter's A and B from
   memory: weights kept in bfloat16 (lora.h) halve those bytes, widened to float32 as they are read (x, xa and
   the sums stay float32). */
#include "lora.h"

#include "common.h"

enum { LORA_MAX_WIDTH = 1024, LANES = 16, BLOCK = 4, TOKENS = 4, GROUP_TOKENS = 8, PF_BYTES = 512 };

#define INLINE static inline __attribute__((always_inline))

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* The two blocks every product here is made of. R (rows of A), TK (tokens) and BF16 (the weights' type) are
   constants at each call; a token's sums do not depend on R, TK or the tokens beside it.
   dot_block: out[i * ld + j] = A[j] . xs[i] for j < R, i < TK: R * TK sums side by side (one sum's chain of
   FMAs ran at a quarter of the FMA units' rate, bound by their latency), each weight widened once for the
   tokens.
   expand_block: yts[i][0..m) += sum_r xps[i][r] * B[r * out + 0..m) (B: the columns' first weight), r in order,
   for m <= 64 columns and TK tokens, each row of B widened once for the tokens. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

/* 16 weights from element i on, widened to float32; with MASKED, only the lanes of `mask` (the others 0). */
INLINE __m512 load16(const void *w, int64_t i, __mmask16 mask, const int BF16, const int MASKED) {
    if (BF16) {
        const uint16_t *p = (const uint16_t *)w + i;
        const __m256i h = MASKED ? _mm256_maskz_loadu_epi16(mask, p) : _mm256_loadu_si256((const __m256i *)p);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return MASKED ? _mm512_maskz_loadu_ps(mask, (const float *)w + i) : _mm512_loadu_ps((const float *)w + i);
}

/* The first n of 16 lanes. */
static inline __mmask16 lanes(int64_t n) {
    return n >= LANES ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}

/* acc[j][i] += A[j][k..k+16) * xs[i][k..k+16), the lanes of m only where MASKED (the row's last few inputs). */
INLINE void dot_step(__m512 acc[BLOCK][TOKENS], const void *a, int64_t in, const float *const *xs, int64_t k,
                     __mmask16 m, const int R, const int TK, const int BF16, const int MASKED) {
    __m512 xv[TOKENS];
    for (int i = 0; i < TK; ++i) xv[i] = MASKED ? _mm512_maskz_loadu_ps(m, xs[i] + k) : _mm512_loadu_ps(xs[i] + k);
    for (int j = 0; j < R; ++j) {
        if (!MASKED) _mm_prefetch((const char *)a + (j * in + k) * (BF16 ? 2 : 4) + PF_BYTES, _MM_HINT_T0);
        const __m512 w = load16(a, j * in + k, m, BF16, MASKED);
        for (int i = 0; i < TK; ++i) acc[j][i] = _mm512_fmadd_ps(w, xv[i], acc[j][i]);
    }
}

INLINE void dot_block(const void *a, int64_t in, const float *const *xs, float *out, int64_t ld, const int R,
                      const int TK, const int BF16) {
    __m512 acc[BLOCK][TOKENS];
    for (int j = 0; j < R; ++j)
        for (int i = 0; i < TK; ++i) acc[j][i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + LANES <= in; k += LANES) dot_step(acc, a, in, xs, k, 0xFFFF, R, TK, BF16, 0);
    if (k < in) dot_step(acc, a, in, xs, k, lanes(in - k), R, TK, BF16, 1);
    for (int j = 0; j < R; ++j)
        for (int i = 0; i < TK; ++i) out[i * ld + j] = _mm512_reduce_add_ps(acc[j][i]);
}

INLINE void expand_masked(const void *b, const float *const *xps, int64_t rank, int64_t out, float *const *yts,
                          int64_t m, const int TK, const int BF16, const int MASKED) {
    __mmask16 mk[BLOCK];
    __m512 acc[TOKENS][BLOCK];
    for (int q = 0; q < BLOCK; ++q) mk[q] = lanes(m - q * LANES);
    for (int i = 0; i < TK; ++i)
        for (int q = 0; q < BLOCK; ++q)
            acc[i][q] = MASKED ? _mm512_maskz_loadu_ps(mk[q], yts[i] + q * LANES) : _mm512_loadu_ps(yts[i] + q * LANES);
    for (int64_t r = 0; r < rank; ++r) {
        __m512 w[BLOCK];
        if (!MASKED)      /* this row's next 64 columns: B's rank rows are as many streams, too many to guess */
            for (int line = 0; line < (BF16 ? 2 : 4); ++line)
                _mm_prefetch((const char *)b + (r * out + BLOCK * LANES) * (BF16 ? 2 : 4) + 64 * line, _MM_HINT_T0);
        for (int q = 0; q < BLOCK; ++q) w[q] = load16(b, r * out + q * LANES, mk[q], BF16, MASKED);
        for (int i = 0; i < TK; ++i) {
            const __m512 v = _mm512_set1_ps(xps[i][r]);
            for (int q = 0; q < BLOCK; ++q) acc[i][q] = _mm512_fmadd_ps(v, w[q], acc[i][q]);
        }
    }
    for (int i = 0; i < TK; ++i)
        for (int q = 0; q < BLOCK; ++q) {
            if (MASKED) _mm512_mask_storeu_ps(yts[i] + q * LANES, mk[q], acc[i][q]);
            else _mm512_storeu_ps(yts[i] + q * LANES, acc[i][q]);
        }
}

INLINE void expand_block(const void *b, const float *const *xps, int64_t rank, int64_t out, float *const *yts,
                         int64_t m, const int TK, const int BF16) {
    if (m == BLOCK * LANES) expand_masked(b, xps, rank, out, yts, m, TK, BF16, 0);
    else expand_masked(b, xps, rank, out, yts, m, TK, BF16, 1);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* The same blocks in eight lanes (AVX2 has no masked 16-bit loads: a row's last few elements go through a
   buffer). Each token's sums are made as for any TK, so its bits do not depend on the tokens beside it. */

/* 8 elements from i on as float32 (the first m where m < 8, the rest 0): of a weight (BF16 as above) or of x. */
INLINE __m256 load8(const void *w, int64_t i, int64_t m, const int BF16) {
    if (m >= 8) {
        if (!BF16) return _mm256_loadu_ps((const float *)w + i);
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    float buf[8] = {0};
    for (int64_t e = 0; e < m; ++e) buf[e] = BF16 ? bf16_to_f32(((const uint16_t *)w)[i + e]) : ((const float *)w)[i + e];
    return _mm256_loadu_ps(buf);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

INLINE void dot_block(const void *a, int64_t in, const float *const *xs, float *out, int64_t ld, const int R,
                      const int TK, const int BF16) {
    __m256 acc[BLOCK][TOKENS];
    for (int j = 0; j < R; ++j)
        for (int i = 0; i < TK; ++i) acc[j][i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < in; k += 8) {
        const int64_t m = in - k;
        __m256 xv[TOKENS];
        for (int i = 0; i < TK; ++i) xv[i] = load8(xs[i], k, m, 0);
        for (int j = 0; j < R; ++j) {
            if (!(k & 15)) _mm_prefetch((const char *)a + (j * in + k) * (BF16 ? 2 : 4) + PF_BYTES, _MM_HINT_T0);
            const __m256 w = load8(a, j * in + k, m, BF16);
            for (int i = 0; i < TK; ++i) acc[j][i] = _mm256_fmadd_ps(w, xv[i], acc[j][i]);
        }
    }
    for (int j = 0; j < R; ++j)
        for (int i = 0; i < TK; ++i) out[i * ld + j] = hsum8(acc[j][i]);
}

/* Columns c0..c0+15 (the first m of them) of expand_block: 2 TK sums in registers across the rank. */
INLINE void expand16(const void *b, const float *const *xps, int64_t rank, int64_t out, float *const *yts,
                     int64_t c0, int64_t m, const int TK, const int BF16) {
    __m256 acc[TOKENS][2];
    __m256i mk[2];
    for (int h = 0; h < 2; ++h) {
        const int64_t left = m - c0 - 8 * h;
        mk[h] = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 0 ? 0 : left > 8 ? 8 : left)),
                                   _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (int i = 0; i < TK; ++i) acc[i][h] = _mm256_maskload_ps(yts[i] + c0 + 8 * h, mk[h]);
    }
    for (int64_t r = 0; r < rank; ++r) {
        const __m256 w0 = load8(b, r * out + c0, m - c0, BF16), w1 = load8(b, r * out + c0 + 8, m - c0 - 8, BF16);
        for (int i = 0; i < TK; ++i) {
            const __m256 v = _mm256_set1_ps(xps[i][r]);
            acc[i][0] = _mm256_fmadd_ps(v, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(v, w1, acc[i][1]);
        }
    }
    for (int i = 0; i < TK; ++i)
        for (int h = 0; h < 2; ++h) _mm256_maskstore_ps(yts[i] + c0 + 8 * h, mk[h], acc[i][h]);
}

INLINE void expand_block(const void *b, const float *const *xps, int64_t rank, int64_t out, float *const *yts,
                         int64_t m, const int TK, const int BF16) {
    for (int64_t c0 = 0; c0 < m; c0 += LANES) expand16(b, xps, rank, out, yts, c0, m, TK, BF16);
}
#else
/* Element i of a float32 (BF16 = 0) or bfloat16 (BF16 = 1) weight. */
INLINE float weight(const void *w, int64_t i, const int BF16) {
    return BF16 ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

INLINE void dot_block(const void *a, int64_t in, const float *const *xs, float *out, int64_t ld, const int R,
                      const int TK, const int BF16) {
    for (int j = 0; j < R; ++j)
        for (int i = 0; i < TK; ++i) {
            float acc = 0.0f;
            for (int64_t k = 0; k < in; ++k) acc += weight(a, j * in + k, BF16) * xs[i][k];
            out[i * ld + j] = acc;
        }
}

INLINE void expand_block(const void *b, const float *const *xps, int64_t rank, int64_t out, float *const *yts,
                         int64_t m, const int TK, const int BF16) {
    for (int i = 0; i < TK; ++i)
        for (int64_t c = 0; c < m; ++c) {
            float acc = yts[i][c];
            for (int64_t r = 0; r < rank; ++r) acc += xps[i][r] * weight(b, r * out + c, BF16);
            yts[i][c] = acc;
        }
}
#endif

#define DOT_CASE(R, TK) case (R) * 8 + (TK): dot_block(a, in, xs, out, ld, R, TK, BF16); break;

INLINE void dot_any(const void *a, int64_t in, const float *const *xs, float *out, int64_t ld, int64_t rows,
                    int64_t tokens, const int BF16) {
    switch (rows * 8 + tokens) {
        DOT_CASE(1, 1) DOT_CASE(1, 2) DOT_CASE(1, 3) DOT_CASE(1, 4)
        DOT_CASE(2, 1) DOT_CASE(2, 2) DOT_CASE(2, 3) DOT_CASE(2, 4)
        DOT_CASE(3, 1) DOT_CASE(3, 2) DOT_CASE(3, 3) DOT_CASE(3, 4)
        DOT_CASE(4, 1) DOT_CASE(4, 2) DOT_CASE(4, 3) DOT_CASE(4, 4)
        default: break;
    }
}

/* xa[i * ld + r] = A[slot][r] . x[tokens[i]] for r in r0..r1-1: BLOCK rows of A by TOKENS tokens at a time. */
INLINE void shrink_t(const LoraDesc *l, int64_t slot, const float *x, int64_t in, const int32_t *tokens,
                     int64_t count, int64_t r0, int64_t r1, float *xa, int64_t ld, const int BF16) {
    const int64_t size = BF16 ? 2 : 4;
    for (int64_t r = r0; r < r1; r += BLOCK) {
        const char *rows = (const char *)l->a + (slot * l->wmax + r) * in * size;
        for (int64_t i = 0; i < count; i += TOKENS) {
            const float *xs[TOKENS] = {0};
            const int64_t tk = min64(count - i, TOKENS);
            for (int64_t q = 0; q < tk; ++q) xs[q] = x + (int64_t)tokens[i + q] * in;
            dot_any(rows, in, xs, xa + i * ld + r, ld, min64(r1 - r, BLOCK), tk, BF16);
        }
    }
}

static void shrink(const LoraDesc *l, int64_t slot, const float *x, int64_t in, const int32_t *tokens,
                   int64_t count, int64_t r0, int64_t r1, float *xa, int64_t ld) {
    if (l->bf16) shrink_t(l, slot, x, in, tokens, count, r0, r1, xa, ld, 1);
    else shrink_t(l, slot, x, in, tokens, count, r0, r1, xa, ld, 0);
}

/* y[tokens[i], n] += xa[i * ld + .] B[slot] for n in n0..n1-1, piece by piece, 64 columns by TOKENS tokens at
   a time. */
INLINE void expand_t(const LoraDesc *l, int64_t slot, const float *xa, int64_t ld, const int32_t *tokens,
                     int64_t count, float *y, int64_t out, int64_t n0, int64_t n1, const int BF16) {
    const int64_t rank = l->widths[slot] / l->pieces, size = BF16 ? 2 : 4;
    for (int64_t p = 0; p < l->pieces; ++p) {
        const int64_t lo = max64(l->bounds[p], n0), hi = min64(l->bounds[p + 1], n1);
        const char *bp = (const char *)l->b_t + (slot * l->wmax + p * rank) * out * size;
        for (int64_t n = lo; n < hi; n += BLOCK * LANES)
            for (int64_t i = 0; i < count; i += TOKENS) {
                const float *xps[TOKENS] = {0};
                float *yts[TOKENS] = {0};
                const int64_t tk = min64(count - i, TOKENS), m = min64(hi - n, BLOCK * LANES);
                for (int64_t q = 0; q < tk; ++q) {
                    xps[q] = xa + (i + q) * ld + p * rank;
                    yts[q] = y + (int64_t)tokens[i + q] * out + n;
                }
                switch (tk) {
                    case 1: expand_block(bp + n * size, xps, rank, out, yts, m, 1, BF16); break;
                    case 2: expand_block(bp + n * size, xps, rank, out, yts, m, 2, BF16); break;
                    case 3: expand_block(bp + n * size, xps, rank, out, yts, m, 3, BF16); break;
                    default: expand_block(bp + n * size, xps, rank, out, yts, m, TOKENS, BF16); break;
                }
            }
    }
}

static void expand(const LoraDesc *l, int64_t slot, const float *xa, int64_t ld, const int32_t *tokens,
                   int64_t count, float *y, int64_t out, int64_t n0, int64_t n1) {
    if (l->bf16) expand_t(l, slot, xa, ld, tokens, count, y, out, n0, n1, 1);
    else expand_t(l, slot, xa, ld, tokens, count, y, out, n0, n1, 0);
}

/* ---------------------------------------------------------------- the layer path */

typedef struct {
    LoraDesc l;
    const float *x;
    const int32_t *order, *slots;
    float *y;
    int64_t in, out, begin, end;
} LoraJob;

/* This thread's tokens (a range of `order`), in runs of one slot of at most GROUP_TOKENS. */
static void *lora_range(void *arg) {
    const LoraJob *j = arg;
    float xa[GROUP_TOKENS * LORA_MAX_WIDTH];
    for (int64_t i = j->begin; i < j->end;) {
        const int64_t slot = j->slots[j->order[i]];
        int64_t count = 1;
        while (i + count < j->end && count < GROUP_TOKENS && j->slots[j->order[i + count]] == slot) ++count;
        const int64_t width = j->l.widths[slot];
        if (width) {
            shrink(&j->l, slot, j->x, j->in, j->order + i, count, 0, width, xa, j->l.wmax);
            expand(&j->l, slot, xa, j->l.wmax, j->order + i, count, j->y, j->out, 0, j->out);
        }
        i += count;
    }
    return NULL;
}

static void lora_set_range(void *arg, int64_t begin, int64_t end) {
    ((LoraJob *)arg)->begin = begin;
    ((LoraJob *)arg)->end = end;
}

/* y[t] += (x[t] A[s]^T) B[s] for the `count` tokens t of `order` (sorted by slot), s = slots[t] >= 0; a and
   b_t float32, or bfloat16 where bf16. */
int ps_lora_bgmv(const float *x, const void *a, const void *b_t, int64_t bf16, const int32_t *order,
                 int64_t count, const int32_t *slots, const int64_t *widths, const int64_t *bounds, int64_t pieces,
                 float *y, int64_t in, int64_t out, int64_t wmax, int threads) {
    if (wmax > LORA_MAX_WIDTH || pieces < 1) return 1;
    LoraJob jobs[MAX_THREADS];
    for (int i = 0; i < MAX_THREADS; ++i)
        jobs[i] = (LoraJob){{a, b_t, widths, bounds, pieces, wmax, bf16}, x, order, slots, y, in, out, 0, 0};
    return ps_run_split(threads, count, jobs, sizeof(LoraJob), lora_range, lora_set_range);
}

/* ---------------------------------------------------------------- the decode step's phases */

static void split(int64_t total, int tid, int threads, int64_t *a, int64_t *b) {
    const int64_t step = (total + threads - 1) / threads;
    *a = min64(tid * step, total);
    *b = min64(*a + step, total);
}

void ps_lora_step_shrink(const LoraDesc *l, const float *x, int64_t in, const int32_t *slots, int64_t rows,
                         float *xa, int tid, int threads) {
    for (int64_t t = 0; t < rows; ++t) {
        const int32_t slot = slots[t], token = (int32_t)t;
        if (slot < 0) continue;
        int64_t r0, r1;
        split(l->widths[slot], tid, threads, &r0, &r1);
        shrink(l, slot, x, in, &token, 1, r0, r1, xa + t * l->wmax, 0);
    }
}

void ps_lora_step_expand(const LoraDesc *l, const float *xa, const int32_t *slots, int64_t rows, float *y,
                         int64_t out, int tid, int threads) {
    int64_t n0, n1;
    split((out + LANES - 1) / LANES, tid, threads, &n0, &n1);     /* whole 16-column blocks a thread */
    n0 = min64(n0 * LANES, out);
    n1 = min64(n1 * LANES, out);
    for (int64_t t = 0; t < rows; ++t) {
        const int32_t slot = slots[t], token = (int32_t)t;
        if (slot >= 0 && l->widths[slot] && n0 < n1) expand(l, slot, xa + t * l->wmax, 0, &token, 1, y, out, n0, n1);
    }
}
