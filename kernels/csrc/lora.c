/* LoRA's delta on CPU for tokens that each use their own adapter slot (decode rows of several adapters,
   interleaved): per token, xa = A[slot] x (the shrink), then y += B[slot] xa (the expand), in one call.

   In torch this took a gather, two batched matmuls, an index_select and an index_add per linear layer, each a
   trip through the dispatcher for a few kilobytes of work. A slot's A [wmax, in] and B [out, wmax] (float32,
   zeros past its width) stay in cache across its tokens; tokens split over threads. Tokens of slot -1 are
   left alone (the base model, or tokens the caller handles as a long run). A merged layer's B is block-shaped
   (piece i: output rows bounds[i]..bounds[i+1], columns i*r..(i+1)*r): the expand reads only those blocks. */
#include "common.h"

enum { LORA_MAX_WIDTH = 1024 };

typedef struct {
    const float *x, *a, *b;
    const int32_t *slots;
    const int64_t *widths, *bounds;
    float *y;
    int64_t pieces, in, out, wmax, begin, end;
} LoraJob;

static void *lora_range(void *arg) {
    const LoraJob *j = arg;
    float xa[LORA_MAX_WIDTH];
    for (int64_t t = j->begin; t < j->end; ++t) {
        const int32_t s = j->slots[t];
        if (s < 0) continue;
        const int64_t w = j->widths[s];
        const float *xt = j->x + t * j->in, *as = j->a + (int64_t)s * j->wmax * j->in;
        for (int64_t r = 0; r < w; ++r) {
            const float *row = as + r * j->in;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t k = 0; k < j->in; ++k) acc += row[k] * xt[k];
            xa[r] = acc;
        }
        const float *bs = j->b + (int64_t)s * j->out * j->wmax;
        float *yt = j->y + t * j->out;
        const int64_t rank = w / j->pieces;
        for (int64_t p = 0; p < j->pieces; ++p) {
            const float *xp = xa + p * rank;
            for (int64_t n = j->bounds[p]; n < j->bounds[p + 1]; ++n) {
                const float *row = bs + n * j->wmax + p * rank;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t r = 0; r < rank; ++r) acc += row[r] * xp[r];
                yt[n] += acc;
            }
        }
    }
    return NULL;
}

static void lora_set_range(void *arg, int64_t begin, int64_t end) {
    ((LoraJob *)arg)->begin = begin;
    ((LoraJob *)arg)->end = end;
}

int ps_lora_bgmv(const float *x, const float *a, const float *b, const int32_t *slots, const int64_t *widths,
                 const int64_t *bounds, int64_t pieces, float *y, int64_t tokens, int64_t in, int64_t out,
                 int64_t wmax, int threads) {
    if (wmax > LORA_MAX_WIDTH || pieces < 1) return 1;
    LoraJob jobs[MAX_THREADS];
    for (int i = 0; i < MAX_THREADS; ++i)
        jobs[i] = (LoraJob){x, a, b, slots, widths, bounds, y, pieces, in, out, wmax, 0, 0};
    return ps_run_split(threads, tokens, jobs, sizeof(LoraJob), lora_range, lora_set_range);
}
