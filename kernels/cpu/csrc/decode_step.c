/* A whole decode step of a Llama-family model with weight-only int4/int8 linears, for a few sequences, in C.

At batch 1 the weights took ~6 ms of a ~16 ms CPU step; the rest was ~150 PyTorch ops per layer, the casts
around torch's bfloat16-only weight-only kernels and the Python between them (docs/cpu_performance.md).
Here one OpenMP team (torch's threads, see parallel.c) runs the whole step: each GEMV and the attention are
split between its threads; the norms run on every thread alike (one thread's result would need a barrier
before the others read it), rotary and SiLU on each thread's own share; barriers separate only the phases
that read other threads' outputs, and the team is formed once per step. Math as the PyTorch path does it:
float32 activations, RMSNorm in float32, neox rotary, the same paged cache (written here, then read in place
by decode_attention.c).
LoRA rows (a step's rows each name an adapter slot, or -1) add their adapter's delta after each linear's GEMV
(lora.c); a step without them passes no slots and runs exactly as before. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "decode_attention.h"
#include "gemm_int4.h"
#include "gemm_intn.h"
#include "lora.h"
#include "step_barrier.h"

enum { LINEAR_INT4 = 1, LINEAR_INT8 = 2, LINEAR_INTN = 3, LINEAR_SPLIT = 4 };

typedef struct LinearDesc {
    int64_t kind, n, k, group, chunks;     /* group: int4 group size or int8 chunk width */
    const void *w;                          /* int4 / 5-6 bit pack or int8 codes (kernels/weight_*.py) */
    const uint16_t *scales;                 /* int4 / 5-6 bit scales_and_zeros or int8 scales, bfloat16 */
    const float *bias;                      /* [n] or NULL */
    int64_t sz_form;                        /* int4, 5-6 bit: GemvInt4.sz_form */
    int64_t bits;                           /* 5-6 bit: GemvIntN.bits */
    int64_t layout;                         /* int4: GemvInt4.layout, the form torch wrote the pack in */
    const struct LinearDesc *parts;         /* split: the parts' descriptions, side by side in y (no bias here) */
    int64_t num_parts;
} LinearDesc;

typedef struct {
    const float *in_norm, *post_norm, *q_norm, *k_norm;     /* q/k norms: Qwen3, else NULL */
    void *k_cache, *v_cache;                                /* [num_blocks, hkv, block_size, d] */
    LinearDesc qkv, o, gate_up, down;
    LoraDesc qkv_lora, o_lora, gate_up_lora, down_lora;     /* a == NULL: no adapter slots */
} LayerDesc;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, block_size, cache_bf16;
    float eps, scale;
    const float *final_norm;
    const LayerDesc *layers;
    int64_t lora_width;           /* the widest LoraDesc's wmax: the step's xa scratch a row (0: no LoRA) */
} ModelDesc;

typedef struct {
    const ModelDesc *m;
    float *hidden;                /* [rows, hidden]: the embeddings in, the final-normed states out */
    int64_t rows, table_stride;
    const float *cos, *sin;       /* [rows, head_dim] */
    const int64_t *slots;         /* [rows] cache slots (block * block_size + offset) */
    const int32_t *tables, *lens;
    const int32_t *lora_slots;    /* [rows] each row's adapter slot (-1: none), or NULL: no LoRA rows */
    float *scratch;
    Barrier *barrier;
    int threads, tid;
} StepJob;

static void split(int64_t total, int tid, int threads, int64_t *a, int64_t *b) {
    const int64_t step = (total + threads - 1) / threads;
    *a = tid * step < total ? tid * step : total;
    *b = *a + step < total ? *a + step : total;
}

/* Half this CPU's 2 MiB L2: what a wait reads ahead is still there when its GEMV starts. */
enum { AHEAD_MAX_BYTES = 1 << 20 };

/* Points `ahead` at the start of this thread's share of l's weights (its first part's, for a split linear). */
static void aim(Ahead *ahead, const LinearDesc *l, int tid, int threads) {
    if (!ahead || ahead->target == l) return;
    ahead->target = l;
    if (l->kind == LINEAR_SPLIT) l = l->parts;
    int64_t a, b, unit, bytes;
    if (l->kind == LINEAR_INT4 || l->kind == LINEAR_INTN) {
        split(l->n / 64, tid, threads, &a, &b);
        unit = l->kind == LINEAR_INT4 ? l->k * 32 : l->k / 2 * ps_intn_record_bytes(l->bits);
    } else {
        split(l->n, tid, threads, &a, &b);
        unit = l->group;                   /* int8: a row of the first chunk plane */
    }
    bytes = (b - a) * unit;
    ahead->next = (const char *)l->w + a * unit;
    ahead->left = bytes < AHEAD_MAX_BYTES ? bytes : AHEAD_MAX_BYTES;
}

/* This thread's share of y [rows, n] = x [rows, k] @ W^T + bias, for one kernel form: its columns a..b. */
static void form_part(const LinearDesc *l, const float *x, int64_t rows, float *y, int tid, int threads,
                      int64_t *a, int64_t *b) {
    if (l->kind == LINEAR_INT4) {
        const GemvInt4 w = {(const uint8_t *)l->w, l->scales, l->n, l->k, l->group, l->sz_form, l->layout};
        split(l->n / 64, tid, threads, a, b);
        /* the GEMM reads the AVX-512 form alone; 1 row without VBMI: the GEMV, 8 rows a call */
        if (l->layout != PACK_AVX512 || ps_gemm_int4_part(&w, x, rows, y, *a, *b))
            for (int64_t t = 0; t < rows; t += GEMV_MAX_ROWS)
                ps_gemv_int4_blocks(&w, x + t * l->k, rows - t < GEMV_MAX_ROWS ? rows - t : GEMV_MAX_ROWS,
                                    y + t * l->n, *a, *b);
        *a *= 64;
        *b *= 64;
    } else if (l->kind == LINEAR_INTN) {
        const GemvIntN w = {(const uint8_t *)l->w, l->scales, l->n, l->k, l->group, l->sz_form, l->bits};
        split(l->n / 64, tid, threads, a, b);
        const int failed = ps_gemm_intn_part(&w, x, rows, y, *a, *b);
        *a *= 64;
        *b *= 64;
        if (failed)                    /* out of memory: NaN outputs, not stale scratch taken for sums */
            for (int64_t t = 0; t < rows; ++t)
                for (int64_t c = *a; c < *b; ++c) y[t * l->n + c] = NAN;
    } else {
        const GemvInt8 w = {(const int8_t *)l->w, l->scales, l->chunks, l->n, l->group};
        split(l->n, tid, threads, a, b);
        ps_gemv_int8_rows(&w, x, rows, y, *a, *b);
    }
    if (l->bias)
        for (int64_t t = 0; t < rows; ++t)
            for (int64_t c = *a; c < *b; ++c) y[t * l->n + c] += l->bias[c];
}

/* This thread's share of y [rows, n] = x [rows, k] @ W^T + bias. A split linear's parts each write rows of
   their own width: one row lands in place at the part's columns; more go through tmp [rows, n], and each
   thread moves the columns it computed itself, so a split adds no barrier. */
static void linear_part(const LinearDesc *l, const float *x, int64_t rows, float *y, float *tmp, int tid,
                        int threads) {
    int64_t a, b;
    if (l->kind != LINEAR_SPLIT) {
        form_part(l, x, rows, y, tid, threads, &a, &b);
        return;
    }
    for (int64_t p = 0, col = 0; p < l->num_parts; col += l->parts[p++].n) {
        const LinearDesc *part = l->parts + p;
        float *out = rows == 1 ? y + col : tmp + rows * col;
        form_part(part, x, rows, out, tid, threads, &a, &b);
        if (rows > 1)
            for (int64_t t = 0; t < rows; ++t)
                memcpy(y + t * l->n + col + a, out + t * part->n + a, sizeof(float) * (b - a));
    }
}

/* The LoRA rows' deltas on a linear's output y (this thread's share of the GEMV's phase done): the shrink,
   a barrier, then the expand; the caller's barrier follows. Nothing in a step without LoRA rows. */
static void lora_part(const StepJob *j, const LoraDesc *l, const float *x, int64_t in, float *y, int64_t out,
                      float *xa, int *sense) {
    if (!j->lora_slots || !l->a) return;
    ps_lora_step_shrink(l, x, in, j->lora_slots, j->rows, xa, j->tid, j->threads);
    barrier_wait(j->barrier, j->threads, sense);
    ps_lora_step_expand(l, xa, j->lora_slots, j->rows, y, out, j->tid, j->threads);
}

static void rms_norm(const float *x, const float *weight, int64_t n, float eps, float *out) {
    float sq = 0.0f;
    for (int64_t i = 0; i < n; ++i) sq += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sq / (float)n + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv);
}

/* Optional per-head norm, then neox rotary, of one token's head in place. */
static void norm_rope(float *x, const float *norm, float eps, const float *cos, const float *sin, int64_t d) {
    if (norm) rms_norm(x, norm, d, eps, x);
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; ++i) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

static void write_row(void *cache, int bf16, int64_t row, const float *src, int64_t d) {
    if (bf16) {
        uint16_t *dst = (uint16_t *)cache + row * d;
        for (int64_t i = 0; i < d; ++i) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)cache + row * d, src, sizeof(float) * d);
    }
}

/* Row t's rotary on the q heads of KV head h's group and on k head h, k and v head h into the cache, and the
   group's q heads copied out for the attention (decode_attention.c takes q [rows, hq, d] densely). */
static void rope_task(const StepJob *j, const LayerDesc *layer, float *qkv, float *q, int64_t t, int64_t h) {
    const ModelDesc *m = j->m;
    const int64_t d = m->head_dim, hq = m->num_heads, hkv = m->num_kv_heads, group = hq / hkv;
    float *row = qkv + t * (hq + 2 * hkv) * d;
    const float *cos = j->cos + t * d, *sin = j->sin + t * d;
    for (int64_t g = h * group; g < (h + 1) * group; ++g) {
        norm_rope(row + g * d, layer->q_norm, m->eps, cos, sin, d);
        memcpy(q + (t * hq + g) * d, row + g * d, sizeof(float) * d);
    }
    norm_rope(row + (hq + h) * d, layer->k_norm, m->eps, cos, sin, d);
    const int64_t block = j->slots[t] / m->block_size, offset = j->slots[t] % m->block_size;
    const int64_t cache_row = (block * hkv + h) * m->block_size + offset;
    write_row(layer->k_cache, (int)m->cache_bf16, cache_row, row + (hq + h) * d, d);
    write_row(layer->v_cache, (int)m->cache_bf16, cache_row, row + (hq + hkv + h) * d, d);
}

/* Whether two rows may be tokens of one sequence (a verify pass, a short chunk): a row then attends to K/V
   another row writes, so every row's must be in the cache first. Rows whose tables start with the same block
   are taken for one sequence (prefix-sharing sequences too, which only costs them a barrier). */
static int rows_share_a_sequence(const StepJob *j) {
    for (int64_t t = 1; t < j->rows; ++t)
        for (int64_t u = 0; u < t; ++u)
            if (j->tables[t * j->table_stride] == j->tables[u * j->table_stride]) return 1;
    return 0;
}

/* Rotary, cache writes and attention, this thread's share of the (row, KV head) tasks. Rows of distinct
   sequences each write only what their own task reads, so one pass needs no barrier; rows that may share a
   sequence write everything first (one thread), then a barrier. */
static void attention_part(const StepJob *j, const LayerDesc *layer, float *qkv, float *q, float *out,
                           int shared, int *sense) {
    const ModelDesc *m = j->m;
    const int64_t hkv = m->num_kv_heads, tasks = j->rows * hkv;
    if (shared) {
        if (j->tid == 0)
            for (int64_t task = 0; task < tasks; ++task) rope_task(j, layer, qkv, q, task / hkv, task % hkv);
        barrier_wait(j->barrier, j->threads, sense);
    }
    DecodeJob dj = {q, layer->k_cache, layer->v_cache, j->tables, j->lens, out, m->num_heads, hkv,
                    m->block_size, m->head_dim, j->table_stride, 0, 0, m->scale, (int)m->cache_bf16};
    int64_t a, b;
    split(tasks, j->tid, j->threads, &a, &b);
    for (int64_t task = a; task < b; ++task) {
        if (!shared) rope_task(j, layer, qkv, q, task / hkv, task % hkv);
        ps_decode_task(&dj, task / hkv, task % hkv);
    }
}

/* residual += add, then dst = norm(residual) * weight, row by row. Every thread keeps its own residual and
   normed rows and computes them alike (the same operations on the same inputs, so the same bits): a few KB a
   row, cheaper than the barrier that one shared copy would need before the next linear reads it. */
static void add_norm(const ModelDesc *m, int64_t rows, float *residual, const float *add, const float *weight,
                     float *dst) {
    const int64_t hd = m->hidden;
    for (int64_t t = 0; t < rows; ++t) {
        float *res = residual + t * hd;
        for (int64_t i = 0; i < hd; ++i) res[i] += add[t * hd + i];
        rms_norm(res, weight, hd, m->eps, dst + t * hd);
    }
}

/* act = silu(gate) * up for this thread's channels of every row: contiguous runs, so that gcc vectorizes
   expf (libmvec), where one index over rows and channels kept it scalar (~13 cycles an element). */
static void silu_part(const StepJob *j, const float *gate_up, float *act) {
    const int64_t inter = j->m->inter;
    int64_t a, b;
    split(inter, j->tid, j->threads, &a, &b);
    for (int64_t t = 0; t < j->rows; ++t) {
        const float *restrict g = gate_up + t * 2 * inter, *restrict u = g + inter;
        float *restrict o = act + t * inter;
#pragma omp simd
        for (int64_t c = a; c < b; ++c) o[c] = g[c] / (1.0f + expf(-g[c])) * u[c];
    }
}

/* The step's buffers: shared ones, then each thread's residual and normed rows. */
typedef struct {
    float *residual, *h, *qkv, *q, *attn, *gate_up, *act, *out, *xa, *tmp;
} StepBuffers;

static int64_t widest_output(const ModelDesc *m) {
    const int64_t width = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    const int64_t widest = width > 2 * m->inter ? width : 2 * m->inter;
    return m->hidden > widest ? m->hidden : widest;
}

static int64_t shared_floats(const ModelDesc *m, int64_t rows) {
    const int64_t qd = m->num_heads * m->head_dim, width = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    return rows * (m->hidden + width + 2 * qd + 3 * m->inter + m->lora_width + widest_output(m));
}

static StepBuffers step_buffers(const StepJob *j) {
    const ModelDesc *m = j->m;
    const int64_t rows = j->rows, hd = m->hidden, qd = m->num_heads * m->head_dim;
    const int64_t width = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    StepBuffers s;
    s.qkv = j->scratch;
    s.q = s.qkv + rows * width;
    s.attn = s.q + rows * qd;
    s.gate_up = s.attn + rows * qd;
    s.act = s.gate_up + rows * 2 * m->inter;
    s.out = s.act + rows * m->inter;               /* each layer's output (o_proj, then down_proj) */
    s.xa = s.out + rows * hd;                      /* LoRA rows' shrunk inputs [rows, lora_width] */
    s.tmp = s.xa + rows * m->lora_width;           /* split linears' parts [rows, n] (linear_part) */
    s.residual = j->scratch + shared_floats(m, rows) + j->tid * 2 * rows * hd;
    s.h = s.residual + rows * hd;
    return s;
}

/* One layer. Barriers where a phase reads what other threads wrote: the qkv rows (attention), the attention
   (o_proj), o_proj's output (the norm), gate_up (SiLU), SiLU (down_proj), down_proj's (the next layer). */
static void layer_step(const StepJob *j, const LayerDesc *layer, const LayerDesc *next, const StepBuffers *s,
                       const float *add, int shared, int *sense, Ahead *ahead) {
    const ModelDesc *m = j->m;
    const int64_t rows = j->rows, hd = m->hidden, qd = m->num_heads * m->head_dim;
    const int64_t width = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    const int tid = j->tid, threads = j->threads;
    add_norm(m, rows, s->residual, add, layer->in_norm, s->h);
    linear_part(&layer->qkv, s->h, rows, s->qkv, s->tmp, tid, threads);
    lora_part(j, &layer->qkv_lora, s->h, hd, s->qkv, width, s->xa, sense);
    aim(ahead, &layer->o, tid, threads);
    barrier_wait_ahead(j->barrier, threads, sense, ahead);
    attention_part(j, layer, s->qkv, s->q, s->attn, shared, sense);
    barrier_wait_ahead(j->barrier, threads, sense, ahead);
    linear_part(&layer->o, s->attn, rows, s->out, s->tmp, tid, threads);
    lora_part(j, &layer->o_lora, s->attn, qd, s->out, hd, s->xa, sense);
    aim(ahead, &layer->gate_up, tid, threads);
    barrier_wait_ahead(j->barrier, threads, sense, ahead);
    add_norm(m, rows, s->residual, s->out, layer->post_norm, s->h);
    linear_part(&layer->gate_up, s->h, rows, s->gate_up, s->tmp, tid, threads);
    lora_part(j, &layer->gate_up_lora, s->h, hd, s->gate_up, 2 * m->inter, s->xa, sense);
    aim(ahead, &layer->down, tid, threads);
    barrier_wait_ahead(j->barrier, threads, sense, ahead);
    silu_part(j, s->gate_up, s->act);
    barrier_wait_ahead(j->barrier, threads, sense, ahead);
    linear_part(&layer->down, s->act, rows, s->out, s->tmp, tid, threads);
    lora_part(j, &layer->down_lora, s->act, m->inter, s->out, hd, s->xa, sense);
    if (next) aim(ahead, &next->qkv, tid, threads);
    barrier_wait_ahead(j->barrier, threads, sense, next ? ahead : NULL);
}

static void step_job(const StepJob *j) {
    const ModelDesc *m = j->m;
    const StepBuffers s = step_buffers(j);
    const int shared = rows_share_a_sequence(j);
    int sense = 0;
    memset(s.residual, 0, sizeof(float) * j->rows * m->hidden);     /* layer 0 adds the embeddings to it */
    Ahead ahead = {NULL, 0, NULL};
    for (int64_t li = 0; li < m->num_layers; ++li)
        layer_step(j, m->layers + li, li + 1 < m->num_layers ? m->layers + li + 1 : NULL, &s,
                   li == 0 ? j->hidden : s.out, shared, &sense, &ahead);
    /* j->hidden was last read before layer 0's first barrier. */
    if (j->tid == 0) add_norm(m, j->rows, s.residual, s.out, m->final_norm, j->hidden);
}

/* Floats of scratch a step of `rows` sequences on `threads` threads needs. */
int64_t ps_decode_step_scratch(const ModelDesc *m, int64_t rows, int64_t threads) {
    return shared_floats(m, rows) + (threads < 1 ? 1 : threads) * 2 * rows * m->hidden;
}

/* Rows a step takes: where the int4 GEMM is built (it takes any row count) up to DECODE_STEP_MAX_ROWS, so that
   decode batches of 9-32 sequences run in one call too (at 16 rows, 1.7B's PyTorch layers spent a fifth of a
   step outside the linears: norms, rotary, SiLU, cache writes, attention launches); elsewhere the GEMV's 8. */
enum { DECODE_STEP_MAX_ROWS = 32 };
int ps_decode_step_max_rows(void) { return ps_gemm_int4_vectorized() ? DECODE_STEP_MAX_ROWS : GEMV_MAX_ROWS; }

/* The int4 pack forms (bit PACK_x) for which every kernel a step calls has its vector path here: the int4 GEMV
   of that form, the int8 GEMV and the attention (5/6-bit layers exist only where their GEMM is built, and
   LoRA's loops are plain C elsewhere). Where a form is not here the PyTorch layers are faster than the step. */
int ps_decode_step_layouts(void) {
    return ps_gemv_int8_vectorized() && ps_decode_attention_vectorized() ? ps_gemv_int4_layouts() : 0;
}

/* One decode step: hidden [rows, hidden] holds the embeddings and receives the final-normed states;
   lora_slots [rows] each row's adapter slot (-1: none) or NULL. Returns 0 on success, 2 for shapes this path
   does not take (the caller checks them first). */
int ps_decode_step(const ModelDesc *m, float *hidden, int64_t rows, const float *cos, const float *sin,
                   const int64_t *slots, const int32_t *tables, int64_t table_stride, const int32_t *lens,
                   const int32_t *lora_slots, float *scratch, int threads) {
    if (rows < 1 || rows > ps_decode_step_max_rows() || m->head_dim > MAX_HEAD_DIM || m->block_size > MAX_BLOCK
        || m->num_kv_heads <= 0 || m->num_heads % m->num_kv_heads || m->num_heads / m->num_kv_heads > MAX_GROUP)
        return 2;
    if (threads < 1) threads = 1;
    Barrier barrier = {0, 0};
#pragma omp parallel num_threads(threads)
    {
        /* Every thread of the team takes part: they meet at the barriers between phases. */
        StepJob j = {m, hidden, rows, table_stride, cos, sin, slots, tables, lens, lora_slots, scratch, &barrier,
                     omp_get_num_threads(), omp_get_thread_num()};
        step_job(&j);
    }
    return 0;
}
