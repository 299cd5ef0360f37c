/* Paged decode attention on CPU: one query token per sequence, keys and values read in place from the
cache blocks, one pass with an online softmax.

The PyTorch path (kernels/attention/cpu_paged.py) copies each group's context out of the cache, pads it to the
group's longest member and runs SDPA: at a 64-sequence decode step that copy and padding cost about as much
as all the GEMMs (docs/cpu_performance.md). Here every (sequence, KV head) pair is one task: its
query heads (GQA) share each key and value row as it is read, so the cache is read once and nothing is
written but the output. Float32 math whatever the cache holds (float32 or bfloat16). */
#include <math.h>

#include "decode_attention.h"

/* Built with -ffast-math (vectorized expf and dot products), which assumes no infinities: "no score yet"
   is a very negative finite number instead. */
#define NO_SCORE (-1e30f)

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

/* The rows first..first+n-1 of a cache as float32: in place for a float32 cache, else widened into buf. */
static inline const float *rows_f32(const DecodeJob *j, const void *base, int64_t first, int64_t n, float *buf) {
    if (!j->bf16) return (const float *)base + first * j->d;
    const uint16_t *src = (const uint16_t *)base + first * j->d;
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n * j->d; i += 16)
        _mm512_storeu_ps(buf + i, _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i))), 16)));
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n * j->d; i += 8)
        _mm256_storeu_ps(buf + i, _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i))), 16)));
#endif
    for (; i < n * j->d; ++i) buf[i] = bf16_to_f32(src[i]);
    return buf;
}

#ifdef __AVX512F__
/* Head sizes that are multiples of 64 (64, 128, 256) take the loops below, written with intrinsics: the
   compiler's vectorization of the generic loops spent ~230 cycles a cached token for the embedded model's
   three query heads per KV head (measured on one thread), these ~4x less. */
#define VECTOR_HEADS(d) ((d) % 64 == 0)

/* One query head's scores against n key rows: two accumulators, one horizontal sum per key. */
static void scores_v(const float *q, const float *keys, int64_t n, int64_t d, float *out) {
    for (int64_t t = 0; t < n; ++t) {
        const float *k = keys + t * d;
        __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
        __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(k + 16));
        for (int64_t c = 32; c < d; c += 32) {
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(k + c), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + c + 16), _mm512_loadu_ps(k + c + 16), a1);
        }
        out[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
}

/* acc += sum_t p[t] * values[t], 64 channels at a time in four registers across all n rows. */
static void weighted_rows_v(const float *p, const float *values, int64_t n, int64_t d, float *acc) {
    for (int64_t c = 0; c < d; c += 64) {
        __m512 a0 = _mm512_loadu_ps(acc + c), a1 = _mm512_loadu_ps(acc + c + 16);
        __m512 a2 = _mm512_loadu_ps(acc + c + 32), a3 = _mm512_loadu_ps(acc + c + 48);
        for (int64_t t = 0; t < n; ++t) {
            const float *v = values + t * d + c;
            const __m512 w = _mm512_set1_ps(p[t]);
            a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v), a0);
            a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16), a1);
            a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 32), a2);
            a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 48), a3);
        }
        _mm512_storeu_ps(acc + c, a0);
        _mm512_storeu_ps(acc + c + 16, a1);
        _mm512_storeu_ps(acc + c + 32, a2);
        _mm512_storeu_ps(acc + c + 48, a3);
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* The same loops in eight lanes, for head sizes that are multiples of 32 (64, 96, 128, 256): four accumulators
   a key (an FMA's latency is 4-5 cycles, two issue a cycle), 32 value channels a pass in four registers. */
#define VECTOR_HEADS(d) ((d) % 32 == 0)

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static void scores_v(const float *q, const float *keys, int64_t n, int64_t d, float *out) {
    for (int64_t t = 0; t < n; ++t) {
        const float *k = keys + t * d;
        __m256 a[4];
        for (int i = 0; i < 4; ++i) a[i] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * i), _mm256_loadu_ps(k + 8 * i));
        for (int64_t c = 32; c < d; c += 32)
            for (int i = 0; i < 4; ++i)
                a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + c + 8 * i), _mm256_loadu_ps(k + c + 8 * i), a[i]);
        out[t] = hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
    }
}

static void weighted_rows_v(const float *p, const float *values, int64_t n, int64_t d, float *acc) {
    for (int64_t c = 0; c < d; c += 32) {
        __m256 a[4];
        for (int i = 0; i < 4; ++i) a[i] = _mm256_loadu_ps(acc + c + 8 * i);
        for (int64_t t = 0; t < n; ++t) {
            const float *v = values + t * d + c;
            const __m256 w = _mm256_set1_ps(p[t]);
            for (int i = 0; i < 4; ++i) a[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), a[i]);
        }
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(acc + c + 8 * i, a[i]);
    }
}
#else
#define VECTOR_HEADS(d) 0
static void scores_v(const float *q, const float *keys, int64_t n, int64_t d, float *out) {
    (void)q; (void)keys; (void)n; (void)d; (void)out;
}
static void weighted_rows_v(const float *p, const float *values, int64_t n, int64_t d, float *acc) {
    (void)p; (void)values; (void)n; (void)d; (void)acc;
}
#endif

/* Scores of one query head against n key rows, four rows at a time: four independent dot products give
   the vector units work while each one's final horizontal sum completes. */
static inline void scores(const float *q, const float *keys, int64_t n, int64_t d, float *out) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        const float *k0 = keys + t * d, *k1 = k0 + d, *k2 = k1 + d, *k3 = k2 + d;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t c = 0; c < d; ++c) {
            s0 += q[c] * k0[c];
            s1 += q[c] * k1[c];
            s2 += q[c] * k2[c];
            s3 += q[c] * k3[c];
        }
        out[t] = s0;
        out[t + 1] = s1;
        out[t + 2] = s2;
        out[t + 3] = s3;
    }
    for (; t < n; ++t) {
        float s0 = 0.0f;
#pragma omp simd reduction(+ : s0)
        for (int64_t c = 0; c < d; ++c) s0 += q[c] * keys[t * d + c];
        out[t] = s0;
    }
}

void ps_decode_task(const DecodeJob *j, int64_t seq, int64_t head) {
    const int64_t group = j->hq / j->hkv, d = j->d, len = j->lens[seq];
    float q[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], m[MAX_GROUP], l[MAX_GROUP];
    float s[MAX_GROUP][MAX_BLOCK], buf[MAX_BLOCK * MAX_HEAD_DIM];
    for (int64_t g = 0; g < group; ++g) {
        const float *src = j->q + (seq * j->hq + head * group + g) * d;
        for (int64_t c = 0; c < d; ++c) { q[g][c] = src[c] * j->scale; acc[g][c] = 0.0f; }
        m[g] = NO_SCORE;
        l[g] = 0.0f;
    }
    for (int64_t b = 0; b * j->block_size < len; ++b) {
        int64_t first = (j->tables[seq * j->table_stride + b] * j->hkv + head) * j->block_size;
        int64_t n = len - b * j->block_size < j->block_size ? len - b * j->block_size : j->block_size;
        const float *keys = rows_f32(j, j->k, first, n, buf);
        for (int64_t g = 0; g < group; ++g) {
            if (VECTOR_HEADS(d)) scores_v(q[g], keys, n, d, s[g]);
            else scores(q[g], keys, n, d, s[g]);
        }
        /* One rescale of the running sums per block, not per key. */
        for (int64_t g = 0; g < group; ++g) {
            float top = m[g];
            for (int64_t t = 0; t < n; ++t) top = s[g][t] > top ? s[g][t] : top;
            float shrink = expf(m[g] - top);
            l[g] *= shrink;
            for (int64_t c = 0; c < d; ++c) acc[g][c] *= shrink;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; ++t) { s[g][t] = expf(s[g][t] - top); sum += s[g][t]; }
            l[g] += sum;
            m[g] = top;
        }
        const float *values = rows_f32(j, j->v, first, n, buf);
        if (VECTOR_HEADS(d)) {
            for (int64_t g = 0; g < group; ++g) weighted_rows_v(s[g], values, n, d, acc[g]);
            continue;
        }
        for (int64_t t = 0; t < n; ++t) {
            const float *row = values + t * d;
            for (int64_t g = 0; g < group; ++g) {
                float p = s[g][t];
                for (int64_t c = 0; c < d; ++c) acc[g][c] += p * row[c];
            }
        }
    }
    for (int64_t g = 0; g < group; ++g) {
        float *dst = j->out + (seq * j->hq + head * group + g) * d;
        float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int64_t c = 0; c < d; ++c) dst[c] = acc[g][c] * inv;
    }
}

static void *decode_job(void *arg) {
    const DecodeJob *j = (const DecodeJob *)arg;
    for (int64_t task = j->t0; task < j->t1; ++task) ps_decode_task(j, task / j->hkv, task % j->hkv);
    return NULL;
}

static void decode_range(void *job, int64_t a, int64_t b) { ((DecodeJob *)job)->t0 = a; ((DecodeJob *)job)->t1 = b; }

/* 1 where head sizes VECTOR_HEADS takes run vector loops (AVX-512 or AVX2): the rest are the generic loops,
   which gcc vectorizes less well. */
int ps_decode_attention_vectorized(void) { return VECTOR_HEADS(64); }

/* Returns 0 on success, 2 for shapes this kernel does not take (the caller checks them first). */
int ps_paged_decode(const float *q, const void *k, const void *v, int bf16, const int32_t *tables,
                    int64_t table_stride, const int32_t *lens, float *out, int64_t n, int64_t hq, int64_t hkv,
                    int64_t block_size, int64_t d, float scale, int threads) {
    if (hkv <= 0 || hq % hkv || hq / hkv > MAX_GROUP || d > MAX_HEAD_DIM || block_size > MAX_BLOCK) return 2;
    DecodeJob jobs[MAX_THREADS];
    for (int t = 0; t < MAX_THREADS; ++t)
        jobs[t] = (DecodeJob){q, k, v, tables, lens, out, hq, hkv, block_size, d, table_stride, 0, 0, scale, bf16};
    return ps_run_split(threads, n * hkv, jobs, sizeof(DecodeJob), decode_job, decode_range);
}
