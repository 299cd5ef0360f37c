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

enum { LORA_MAX_WIDTH = 1024, LANES = 16, BLOCK = 4, GROUP_TOKENS = 8 };

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Element i of a float32 (BF16 = 0) or bfloat16 (BF16 = 1) weight; BF16 is a constant at every call. */
static inline __attribute__((always_inline)) float weight(const void *w, int64_t i, const int BF16) {
    return BF16 ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* out[j] = a[j * in ..] . x for j < R: BLOCK rows' sums side by side (one sum's chain of FMAs ran at a quarter
   of the FMA units' rate, bound by their latency), x read once for them. R is a constant at each call. */
static inline __attribute__((always_inline)) void dot_rows(const void *a, int64_t in, const float *x, float *out,
                                                           const int R, const int BF16) {
    float acc[BLOCK][LANES] = {{0}};
    int64_t k = 0;
    for (; k + LANES <= in; k += LANES)
        for (int j = 0; j < R; ++j)
#pragma omp simd
            for (int c = 0; c < LANES; ++c) acc[j][c] += weight(a, j * in + k + c, BF16) * x[k + c];
    for (int j = 0; j < R; ++j) {
        for (int64_t c = 0; k + c < in; ++c) acc[j][c] += weight(a, j * in + k + c, BF16) * x[k + c];
        float sum = 0.0f;
        for (int c = 0; c < LANES; ++c) sum += acc[j][c];
        out[j] = sum;
    }
}

/* xa[i * ld + r] = A[slot][r] . x[tokens[i]] for r in r0..r1-1, BLOCK rows of A at a time for every token
   (those rows stay in L1 across the tokens). */
static inline __attribute__((always_inline)) void shrink_t(const LoraDesc *l, int64_t slot, const float *x,
                                                           int64_t in, const int32_t *tokens, int64_t count,
                                                           int64_t r0, int64_t r1, float *xa, int64_t ld,
                                                           const int BF16) {
    const char *as = (const char *)l->a + (slot * l->wmax + r0) * in * (BF16 ? 2 : 4);
    for (int64_t r = r0; r < r1; r += BLOCK, as += BLOCK * in * (BF16 ? 2 : 4)) {
        for (int64_t i = 0; i < count; ++i) {
            const float *xt = x + (int64_t)tokens[i] * in;
            float *out = xa + i * ld + r;
            switch (min64(r1 - r, BLOCK)) {
                case 1: dot_rows(as, in, xt, out, 1, BF16); break;
                case 2: dot_rows(as, in, xt, out, 2, BF16); break;
                case 3: dot_rows(as, in, xt, out, 3, BF16); break;
                default: dot_rows(as, in, xt, out, BLOCK, BF16); break;
            }
        }
    }
}

static void shrink(const LoraDesc *l, int64_t slot, const float *x, int64_t in, const int32_t *tokens,
                   int64_t count, int64_t r0, int64_t r1, float *xa, int64_t ld) {
    if (l->bf16) shrink_t(l, slot, x, in, tokens, count, r0, r1, xa, ld, 1);
    else shrink_t(l, slot, x, in, tokens, count, r0, r1, xa, ld, 0);
}

/* yt[0..m) += sum_r xp[r] * B[r * out + 0..m) (B: the columns' first element), r in order, for m <= BLOCK *
   LANES columns: BLOCK vectors of sums side by side. Each column's sum is the same whatever m is. */
static inline __attribute__((always_inline)) void expand_columns(const void *b, const float *xp, int64_t rank,
                                                                 int64_t out, float *yt, int64_t m,
                                                                 const int BF16) {
    float acc[BLOCK * LANES];
    if (m == BLOCK * LANES) {       /* the common case, a constant trip count: acc lives in registers */
#pragma omp simd
        for (int c = 0; c < BLOCK * LANES; ++c) acc[c] = yt[c];
        for (int64_t r = 0; r < rank; ++r) {
            const float v = xp[r];
#pragma omp simd
            for (int c = 0; c < BLOCK * LANES; ++c) acc[c] += v * weight(b, r * out + c, BF16);
        }
#pragma omp simd
        for (int c = 0; c < BLOCK * LANES; ++c) yt[c] = acc[c];
        return;
    }
    for (int64_t c = 0; c < m; ++c) acc[c] = yt[c];
    for (int64_t r = 0; r < rank; ++r)
        for (int64_t c = 0; c < m; ++c) acc[c] += xp[r] * weight(b, r * out + c, BF16);
    for (int64_t c = 0; c < m; ++c) yt[c] = acc[c];
}

/* y[tokens[i], n] += xa[i * ld + .] B[slot] for n in n0..n1-1, piece by piece: a block of B's columns is
   read once for all the tokens. */
static inline __attribute__((always_inline)) void expand_t(const LoraDesc *l, int64_t slot, const float *xa,
                                                           int64_t ld, const int32_t *tokens, int64_t count,
                                                           float *y, int64_t out, int64_t n0, int64_t n1,
                                                           const int BF16) {
    const int64_t rank = l->widths[slot] / l->pieces, size = BF16 ? 2 : 4;
    for (int64_t p = 0; p < l->pieces; ++p) {
        const int64_t lo = max64(l->bounds[p], n0), hi = min64(l->bounds[p + 1], n1);
        const char *bp = (const char *)l->b_t + (slot * l->wmax + p * rank) * out * size;
        for (int64_t n = lo; n < hi; n += BLOCK * LANES)
            for (int64_t i = 0; i < count; ++i)
                expand_columns(bp + n * size, xa + i * ld + p * rank, rank, out, y + (int64_t)tokens[i] * out + n,
                               min64(hi - n, BLOCK * LANES), BF16);
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
