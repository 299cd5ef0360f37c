/* Widening of packed int4 / int8 weights to bfloat16, for CPU steps with many rows.

torch's weight-only CPU kernels re-widen every weight for each block of input rows, so their cost grows with
the rows as fast as a dense GEMM's while running at a fraction of its speed (docs/cpu_performance.md).
For a prefill chunk or a large decode batch it is cheaper to widen a layer's weights once into a scratch
bfloat16 matrix and hand that to oneDNN's bfloat16 GEMM. This file does only the widening; it reads torch's
own packed layouts, so the weights are stored once. Built at first use by kernels/cpu/native.py. */
#include <stdlib.h>

#include "gemv.h"

typedef struct {
    GemvInt4 w;               /* torch's CPU int4 pack, in any of its forms (gemv.h) */
    uint16_t *out;            /* bfloat16 [k, n]: the transposed weight, rows k0..k1 written by this job */
    int64_t k0, k1;
} Int4Job;

static void *int4_job(void *arg) {
    const Int4Job *j = (const Int4Job *)arg;
    const GemvInt4 *w = &j->w;
    const int64_t n = w->n;
    float *scale = malloc(sizeof(float) * 2 * n);
    if (!scale) return (void *)1;
    float *zero = scale + n;
    int64_t loaded = -1;
    for (int64_t kk = j->k0; kk < j->k1; ++kk) {
        int64_t g = kk / w->group;
        if (g != loaded) {    /* one group's scales serve `group` rows: widen them once */
            int64_t c = 0;
#ifdef __AVX512F__
            for (; c < n; c += 16) {      /* n % 64 == 0; the vector form: SZ_K's halves widen 16 at a time */
                __m512 s, z;
                ps_int4_scale_zero16(w, g, c, &s, &z);
                _mm512_storeu_ps(scale + c, s);
                _mm512_storeu_ps(zero + c, z);
            }
#endif
            for (; c < n; ++c) ps_int4_scale_zero(w, g, c, &scale[c], &zero[c]);
            loaded = g;
        }
        uint16_t *o = j->out + kk * n;
        if (w->layout != PACK_AVX512) {
            for (int64_t c = 0; c < n; ++c)
                o[c] = f32_to_bf16((float)ps_int4_code(w->packed, w->layout, w->k, c, kk) * scale[c] + zero[c]);
            continue;
        }
        for (int64_t nb = 0; nb < n / 64; ++nb) {
            const uint8_t *p = w->packed + (nb * w->k + kk) * 32;
            const float *s = scale + nb * 64, *z = zero + nb * 64;
            uint16_t *ob = o + nb * 64;
            for (int i = 0; i < 32; ++i) {
                ob[i] = f32_to_bf16((float)(p[i] & 15) * s[i] + z[i]);
                ob[i + 32] = f32_to_bf16((float)(p[i] >> 4) * s[i + 32] + z[i + 32]);
            }
        }
    }
    free(scale);
    return NULL;
}

typedef struct {
    const int8_t *q;          /* [chunks, rows, chunk] */
    const uint16_t *scale;    /* bfloat16 [chunks, rows]; w = q * scale */
    uint16_t *out;            /* bfloat16 [r1 - r0, chunks * chunk] for the caller's row range */
    int64_t chunks, rows, chunk, r0, r1, first;
} Int8Job;

#ifdef __AVX512F__
#include <immintrin.h>
/* Sixteen codes times s, rounded to bfloat16 as f32_to_bf16 rounds (nearest even): a chunk of 16 or 32 codes
   (Q6_K, Q8_0) left the scalar loop's vector form one short run per row and chunk, 5-9x slower than a whole
   row's widening. */
static inline void widen16(const int8_t *src, float s, uint16_t *dst) {
    const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src))),
                                   _mm512_set1_ps(s));
    __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}
#endif

static void *int8_job(void *arg) {
    const Int8Job *j = (const Int8Job *)arg;
    int64_t width = j->chunks * j->chunk;
    /* Blocks of rows, chunk by chunk: each chunk's codes are read in runs of ROW_BLOCK rows, not one
       chunk-sized piece per row from every chunk's plane (measured 2x slower for a Q8_0 head). */
    enum { ROW_BLOCK = 64 };
    for (int64_t r0 = j->r0; r0 < j->r1; r0 += ROW_BLOCK) {
        int64_t r1 = r0 + ROW_BLOCK < j->r1 ? r0 + ROW_BLOCK : j->r1;
        for (int64_t c = 0; c < j->chunks; ++c) {
            for (int64_t r = r0; r < r1; ++r) {
                float s = bf16_to_f32(j->scale[c * j->rows + r]);
                const int8_t *src = j->q + (c * j->rows + r) * j->chunk;
                uint16_t *dst = j->out + (r - j->first) * width + c * j->chunk;
                int64_t i = 0;
#ifdef __AVX512F__
                for (; i + 16 <= j->chunk; i += 16) widen16(src + i, s, dst + i);
#endif
                for (; i < j->chunk; ++i) dst[i] = f32_to_bf16((float)src[i] * s);
            }
        }
    }
    return NULL;
}

static void int4_range(void *job, int64_t a, int64_t b) { ((Int4Job *)job)->k0 = a; ((Int4Job *)job)->k1 = b; }
static void int8_range(void *job, int64_t a, int64_t b) {
    Int8Job *j = (Int8Job *)job;
    j->r0 = j->first + a;
    j->r1 = j->first + b;
}

/* Returns 0 on success. n must be a multiple of 64 (the pack's block of output channels). */
int ps_dequant_int4_t(const uint8_t *packed, const uint16_t *sz, int64_t sz_form, int64_t layout, uint16_t *out,
                      int64_t n, int64_t k, int64_t group, int threads) {
    if (n % 64 || group <= 0 || k % group || !ps_int4_sz_takes(sz_form, k, group) || !ps_int4_pack_takes(layout))
        return 2;
    Int4Job jobs[MAX_THREADS];
    for (int t = 0; t < MAX_THREADS; ++t) jobs[t] = (Int4Job){{packed, sz, n, k, group, sz_form, layout}, out, 0, 0};
    return ps_run_split(threads, k, jobs, sizeof(Int4Job), int4_job, int4_range);
}

/* Output channels ids[0..t-1] of an int4 pack, widened to float32 rows of out [t, k]: the lookups of an
   embedding table kept in the pack its tied head's GEMV streams (4-bit sources). Returns 2 for an id outside
   0..n-1 or shapes the pack does not have. */
int ps_int4_rows(const uint8_t *packed, const uint16_t *sz, int64_t sz_form, int64_t layout, int64_t n, int64_t k,
                 int64_t group, const int64_t *ids, int64_t t, float *out) {
    if (n % 64 || group <= 0 || k % group || !ps_int4_sz_takes(sz_form, k, group) || !ps_int4_pack_takes(layout))
        return 2;
    const GemvInt4 w = {packed, sz, n, k, group, sz_form, layout};
    for (int64_t r = 0; r < t; ++r) {
        const int64_t c = ids[r];
        if (c < 0 || c >= n) return 2;
        float *o = out + r * k;
        for (int64_t g = 0; g < k / group; ++g) {
            float s, z;
            ps_int4_scale_zero(&w, g, c, &s, &z);
            for (int64_t kk = g * group; kk < (g + 1) * group; ++kk)
                o[kk] = (float)ps_int4_code(packed, layout, k, c, kk) * s + z;
        }
    }
    return 0;
}

/* Rows first..last-1 of an int8 weight, widened into out [last - first, chunks * chunk]. */
int ps_dequant_int8_rows(const int8_t *q, const uint16_t *scale, uint16_t *out, int64_t chunks, int64_t rows,
                         int64_t chunk, int64_t first, int64_t last, int threads) {
    if (first < 0 || last > rows || first > last) return 2;
    Int8Job jobs[MAX_THREADS];
    for (int t = 0; t < MAX_THREADS; ++t) jobs[t] = (Int8Job){q, scale, out, chunks, rows, chunk, 0, 0, first};
    return ps_run_split(threads, last - first, jobs, sizeof(Int8Job), int8_job, int8_range);
}
