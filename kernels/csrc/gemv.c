/* Weight-only GEMV for a few input rows, straight from the packed weights, float32 in and out.

At batch 1 torch's weight-only CPU kernels want bfloat16 activations, so every linear costs two casts
around it, and each call is one more trip through the dispatcher. These read the same packed layouts
(kernels/weight_only.py) with float32 activations and float32 sums; the decode step of kernels/csrc/
decode_step.c calls them with no Python in between. Each weight byte is read once for all the rows. */
#include "gemv.h"

#include <math.h>
#include <stdlib.h>

#ifdef __AVX512F__
/* Software prefetch ahead of the int4 codes (one stream per 64-channel block) and of the (scale, zero) rows
   of a later group (a second, strided stream): on the 2-core EPYC VM the 360M model's layers went from 38.6
   to 45.8 GiB/s with it (issue 25; docs/cpu_performance.md). */
enum { PF4_BYTES = 4096, PF4_GROUPS = 2 };

/* Codes to floats through a 16-entry table: vpermps reads only the low 4 bits of each lane, so a byte
   widened to 32 bits indexes its low nibble as it is and its high nibble after one shift. Up to four input
   rows share each widened code (R is a constant at each call: no work for rows that are not there; four
   rows' sums are 16 of the 32 vector registers). */
static inline __attribute__((always_inline)) void int4_rows_avx512(const GemvInt4 *w, const float *x, float *y,
                                                                   int64_t nb, const int R) {
    const int64_t k = w->k, n = w->n, group = w->group;
    const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 tot[4][4];
    for (int r = 0; r < R; ++r) for (int j = 0; j < 4; ++j) tot[r][j] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < k; g0 += group) {
        __m512 acc[4][4];
        float sum[4] = {0};
        for (int r = 0; r < R; ++r) for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
        const uint8_t *p = w->packed + (nb * k + g0) * 32;
        const uint16_t *szn = w->sz + ((g0 / group + PF4_GROUPS) * n + nb * 64) * w->sz_stride;
        if (g0 + PF4_GROUPS * group < k)
            for (int j = 0; j < 2 * w->sz_stride; ++j) _mm_prefetch((const char *)(szn + 32 * j), _MM_HINT_T0);
        for (int64_t kk = g0; kk < g0 + group; ++kk, p += 32) {
            if (!(kk & 1)) _mm_prefetch((const char *)(p + PF4_BYTES), _MM_HINT_T0);
            __m512i d0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
            __m512i d1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
            __m512 q[4] = {_mm512_permutexvar_ps(d0, lut), _mm512_permutexvar_ps(d1, lut),
                           _mm512_permutexvar_ps(_mm512_srli_epi32(d0, 4), lut),
                           _mm512_permutexvar_ps(_mm512_srli_epi32(d1, 4), lut)};
            for (int r = 0; r < R; ++r) {
                const float xv = x[r * k + kk];
                const __m512 xb = _mm512_set1_ps(xv);
                sum[r] += xv;
                for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(q[j], xb, acc[r][j]);
            }
        }
        for (int j = 0; j < 4; ++j) {
            __m512 scale, zero;
            ps_int4_scale_zero16(w, g0 / group, nb * 64 + 16 * j, &scale, &zero);
            for (int r = 0; r < R; ++r)
                tot[r][j] = _mm512_fmadd_ps(acc[r][j], scale, _mm512_fmadd_ps(zero, _mm512_set1_ps(sum[r]), tot[r][j]));
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + r * n + nb * 64 + 16 * j, tot[r][j]);
}

static void int4_block_avx512(const GemvInt4 *w, const float *x, int64_t rows, float *y, int64_t nb) {
    const int64_t k = w->k, n = w->n;
    for (int64_t t = 0; t < rows; t += 4) {
        const float *xt = x + t * k;
        float *yt = y + t * n;
        switch (rows - t < 4 ? rows - t : 4) {
            case 1: int4_rows_avx512(w, xt, yt, nb, 1); break;
            case 2: int4_rows_avx512(w, xt, yt, nb, 2); break;
            case 3: int4_rows_avx512(w, xt, yt, nb, 3); break;
            default: int4_rows_avx512(w, xt, yt, nb, 4); break;
        }
    }
}
#endif

/* torch's CPU int4 pack: blocks of 64 output channels; in a block, input column kk's 64 codes are 32 bytes,
   channel i in the low nibble of byte i and channel i + 32 in the high one. w = (q - 8) * scale + zero per
   group of input columns, so y = sum_g scale * (sum_k q x) + (zero - 8 scale) * (sum_k x). */
void ps_gemv_int4_blocks(const GemvInt4 *w, const float *x, int64_t rows, float *y, int64_t nb0, int64_t nb1) {
#ifdef __AVX512F__
    for (int64_t nb = nb0; nb < nb1; ++nb) int4_block_avx512(w, x, rows, y, nb);
#else
    const int64_t k = w->k, n = w->n, group = w->group;
    for (int64_t nb = nb0; nb < nb1; ++nb) {
        float total[GEMV_MAX_ROWS][64] = {{0}};
        for (int64_t g0 = 0; g0 < k; g0 += group) {
            float acc[GEMV_MAX_ROWS][64] = {{0}}, xsum[GEMV_MAX_ROWS] = {0};
            const uint8_t *p = w->packed + (nb * k + g0) * 32;
            for (int64_t kk = g0; kk < g0 + group; ++kk, p += 32) {
                for (int64_t t = 0; t < rows; ++t) {
                    const float xv = x[t * k + kk];
                    xsum[t] += xv;
                    for (int i = 0; i < 32; ++i) {
                        acc[t][i] += (float)(p[i] & 15) * xv;
                        acc[t][i + 32] += (float)(p[i] >> 4) * xv;
                    }
                }
            }
            for (int i = 0; i < 64; ++i) {
                float scale, zero;
                ps_int4_scale_zero(w, g0 / group, nb * 64 + i, &scale, &zero);
                for (int64_t t = 0; t < rows; ++t) total[t][i] += acc[t][i] * scale + zero * xsum[t];
            }
        }
        for (int64_t t = 0; t < rows; ++t) memcpy(y + t * n + nb * 64, total[t], sizeof total[t]);
    }
#endif
}

/* int8 in chunks of input columns, one scale per (chunk, output channel): q [chunks, n, chunk] with each
   chunk's codes contiguous per channel (a whole row is one chunk for plain int8). */
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define INT8_I16 1
/* x as int16 with one scale per row (|error| <= max|x| / 65534 per element, far below the int8 weights' own
   rounding), so that vpmaddwd multiplies 32 codes by 32 inputs and adds pairs in one instruction: a third of
   the float path's instructions per weight, which made a Q8_0 head compute-bound (measured 5.6 GB/s on one
   thread where int4 layers stream at 13). Returns the scale. */
static float row_to_i16(const float *x, int64_t k, int16_t *out) {
    float top = 0.0f;
    for (int64_t i = 0; i < k; ++i) top = fabsf(x[i]) > top ? fabsf(x[i]) : top;
    if (top == 0.0f) {
        memset(out, 0, sizeof(int16_t) * k);
        return 0.0f;
    }
    const float inv = 32767.0f / top;
    for (int64_t i = 0; i < k; ++i) out[i] = (int16_t)lrintf(x[i] * inv);
    return top / 32767.0f;
}

/* Sixteen output channels r0.. for one input row. Chunk by chunk, the sixteen channels' codes are one
   contiguous run of the chunk's plane (16 * chunk bytes), which the prefetchers follow; channel by channel,
   one row would hop between all the planes (measured half the speed on a Q8_0 head). The block's codes stay
   in L1 for the next input row. Each pair sum is at most 2 * 127 * 32767 < 2^24, exact as a float. */
/* The int8 codes of the block PF_BLOCKS blocks ahead are prefetched as this one is read. A block is one
   contiguous run per chunk plane (16 * chunk bytes), and a grouped head has a plane per 32 columns: 30 runs
   of 512 bytes at a 1.5 MB stride, more streams than the hardware prefetchers follow. The 360M model's tied
   Q8_0 head (49152 x 960) went from 3.2 to 1.1 ms on 2 threads (7 to 28 GiB/s on one). */
enum { PF_BLOCKS = 2, INT8_LONG_ROW = 1024 };
/* Chunks of 16 columns (GGUF Q6_K's sub-blocks) are read two at a time: 32 codes from two planes make one vector,
   whose low eight pair sums take chunk c's scale and high eight chunk c + 1's. One masked half-vector per chunk
   did half the work per instruction (1.7B's Q6_K head was compute-bound at one row). */
static inline int int8_paired(const GemvInt8 *w) { return w->chunk == 16 && w->chunks % 2 == 0; }

/* 32 codes of channel r from column i of chunk c on (m: the columns that exist, for chunks not paired). */
static inline __m512i int8_codes32(const GemvInt8 *w, int64_t c, int64_t r, int64_t i, __mmask32 m, int paired) {
    const int8_t *q = w->q + (c * w->n + r) * w->chunk + i;
    if (paired)
        return _mm512_cvtepi8_epi16(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)q)),
            _mm_loadu_si128((const __m128i *)(q + w->n * 16)), 1));
    return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, q));
}

/* Channel r's scale over the 16 pair sums of chunk c (and of c + 1 in the high half where paired). */
static inline __m512 int8_scale16(const GemvInt8 *w, int64_t c, int64_t r, int paired) {
    const __m512 lo = _mm512_set1_ps(bf16_to_f32(w->scale[c * w->n + r]));
    return paired ? _mm512_mask_blend_ps(0xFF00, lo, _mm512_set1_ps(bf16_to_f32(w->scale[(c + 1) * w->n + r])))
                  : lo;
}

/* Prefetch of the codes PF_BLOCKS blocks ahead of channels r0..r0+15 at column i of chunk c (and c + 1). */
static inline void int8_prefetch(const GemvInt8 *w, int64_t c, int64_t r0, int64_t i, int64_t ahead, int paired) {
    const int8_t *q = w->q + (c * w->n + r0) * w->chunk + ahead + i;
    const int64_t step = paired ? 4 : 1;      /* paired: a 16-code run per channel, four channels a line */
    for (int r = 0; r < 16; r += step) {
        _mm_prefetch((const char *)(q + r * w->chunk), _MM_HINT_T0);
        if (paired) _mm_prefetch((const char *)(q + w->n * 16 + r * w->chunk), _MM_HINT_T0);
    }
}

static void int8_block16_i16(const GemvInt8 *w, const int16_t *x, float x_scale, float *y, int64_t r0) {
    const int64_t chunks = w->chunks, n = w->n, chunk = w->chunk;
    const int paired = int8_paired(w);
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    const int64_t ahead = r0 + 16 * PF_BLOCKS < n ? 16 * PF_BLOCKS * chunk : 0;
    __m512 scale[16];          /* a chunk's, kept in L1: the FMAs read them as memory operands */
    for (int64_t c = 0; c < chunks; c += 1 + paired) {
        for (int r = 0; r < 16; ++r) scale[r] = int8_scale16(w, c, r0 + r, paired);
        for (int64_t i = 0; i < chunk; i += 32) {
            const __mmask32 m = chunk - i >= 32 ? 0xFFFFFFFFu : (1u << (chunk - i)) - 1;
            const __m512i xv = paired ? _mm512_loadu_si512(x + c * chunk) : _mm512_maskz_loadu_epi16(m, x + c * chunk + i);
            if (ahead && !(i & 63)) int8_prefetch(w, c, r0, i, ahead, paired);
            for (int r = 0; r < 16; ++r) {
                __m512 pairs = _mm512_cvtepi32_ps(_mm512_madd_epi16(int8_codes32(w, c, r0 + r, i, m, paired), xv));
                acc[r] = _mm512_fmadd_ps(pairs, scale[r], acc[r]);
            }
        }
    }
    for (int r = 0; r < 16; ++r) y[r0 + r] = x_scale * _mm512_reduce_add_ps(acc[r]);
}

/* The same sixteen channels for R (2..4) input rows at once: each group of four channels' codes is widened once
   per 32 columns for all R rows, where int8_block16_i16 row by row widens them again for every row (a speculative
   verify pass's head: 6 rows took 2.2 ms against 0.4 for one). Each row's sums are those int8_block16_i16 makes,
   in the same order, so a row's logits do not depend on the rows beside it. */
static inline __attribute__((always_inline)) void int8_block16_rows(const GemvInt8 *w, const int16_t *x, int64_t k,
                                                                    const float *x_scale, float *y, int64_t r0,
                                                                    const int R) {
    const int64_t chunks = w->chunks, n = w->n, chunk = w->chunk;
    const int paired = int8_paired(w);
    const int64_t ahead = r0 + 16 * PF_BLOCKS < n ? 16 * PF_BLOCKS * chunk : 0;
    for (int g = 0; g < 16; g += 4) {
        __m512 acc[4][4];
        for (int t = 0; t < 4; ++t)
            for (int j = 0; j < 4; ++j) acc[t][j] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; c += 1 + paired) {
            __m512 scale[4];
            for (int j = 0; j < 4; ++j) scale[j] = int8_scale16(w, c, r0 + g + j, paired);
            for (int64_t i = 0; i < chunk; i += 32) {
                const __mmask32 m = chunk - i >= 32 ? 0xFFFFFFFFu : (1u << (chunk - i)) - 1;
                if (ahead && g == 0 && !(i & 63)) int8_prefetch(w, c, r0, i, ahead, paired);
                __m512i qv[4];
                for (int j = 0; j < 4; ++j) qv[j] = int8_codes32(w, c, r0 + g + j, i, m, paired);
                for (int t = 0; t < R; ++t) {
                    const int16_t *xt = x + t * k + c * chunk + i;
                    const __m512i xv = paired ? _mm512_loadu_si512(xt) : _mm512_maskz_loadu_epi16(m, xt);
                    for (int j = 0; j < 4; ++j)
                        acc[t][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(qv[j], xv)), scale[j], acc[t][j]);
                }
            }
        }
        for (int t = 0; t < R; ++t)
            for (int j = 0; j < 4; ++j) y[t * n + r0 + g + j] = x_scale[t] * _mm512_reduce_add_ps(acc[t][j]);
    }
}

static void int8_block16_all_rows(const GemvInt8 *w, const int16_t *xq, int64_t k, const float *x_scale,
                                  int64_t rows, float *y, int64_t r0) {
    if (rows == 1) {
        int8_block16_i16(w, xq, x_scale[0], y, r0);
        return;
    }
    const int64_t n = w->n;
    for (int64_t t = 0; t < rows; t += 4) {
        const int16_t *xt = xq + t * k;
        float *yt = y + t * n;
        switch (rows - t < 4 ? rows - t : 4) {
            case 1: int8_block16_i16(w, xt, x_scale[t], yt, r0); break;
            case 2: int8_block16_rows(w, xt, k, x_scale + t, yt, r0, 2); break;
            case 3: int8_block16_rows(w, xt, k, x_scale + t, yt, r0, 3); break;
            default: int8_block16_rows(w, xt, k, x_scale + t, yt, r0, 4); break;
        }
    }
}

/* One channel of a plain int8 weight whose rows are long (k > INT8_LONG_ROW): its codes read front to back,
   one sequential stream, where 16 channels side by side were 16 streams a thread (1.7B's 8192-wide
   down_proj streamed at 32 GiB/s so). Four sums in flight: one FMA chain would cap it at 8 codes a cycle.
   Returns sum_i q[i] * x[i] (x in int16 steps). */
static float int8_dot_i16(const int8_t *q, const int16_t *x, int64_t k) {
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t i = 0;
    for (; i + 128 <= k; i += 128) {
        for (int j = 0; j < 4; ++j) {
            const __m512i qv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + i + 32 * j)));
            const __m512i xv = _mm512_loadu_si512(x + i + 32 * j);
            a[j] = _mm512_add_ps(a[j], _mm512_cvtepi32_ps(_mm512_madd_epi16(qv, xv)));
        }
    }
    for (; i < k; i += 32) {
        const __mmask32 m = k - i >= 32 ? 0xFFFFFFFFu : (1u << (k - i)) - 1;
        const __m512i qv = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, q + i));
        a[0] = _mm512_add_ps(a[0], _mm512_cvtepi32_ps(_mm512_madd_epi16(qv, _mm512_maskz_loadu_epi16(m, x + i))));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
}
#endif

void ps_gemv_int8_rows(const GemvInt8 *w, const float *x, int64_t rows, float *y, int64_t r0, int64_t r1) {
    const int64_t chunks = w->chunks, n = w->n, chunk = w->chunk, k = chunks * chunk;
    int64_t r = r0;
#ifdef INT8_I16
    if (r1 - r0 >= 16) {
        enum { STACK_VALUES = 16384 };
        int16_t on_stack[STACK_VALUES];
        float scales_on_stack[GEMV_MAX_ROWS];
        int16_t *xq = rows * k <= STACK_VALUES ? on_stack : malloc(sizeof(int16_t) * rows * k);
        float *x_scale = rows <= GEMV_MAX_ROWS ? scales_on_stack : malloc(sizeof(float) * rows);
        if (xq && x_scale) {
            for (int64_t t = 0; t < rows; ++t) x_scale[t] = row_to_i16(x + t * k, k, xq + t * k);
            if (chunks == 1 && chunk > INT8_LONG_ROW)
                for (; r < r1; ++r)
                    for (int64_t t = 0; t < rows; ++t)
                        y[t * n + r] = x_scale[t] * bf16_to_f32(w->scale[r]) * int8_dot_i16(w->q + r * k, xq + t * k, k);
            for (; r + 16 <= r1; r += 16) int8_block16_all_rows(w, xq, k, x_scale, rows, y, r);
        }
        if (xq != on_stack) free(xq);
        if (x_scale != scales_on_stack) free(x_scale);
    }
#endif
    for (; r < r1; ++r) {
        for (int64_t t = 0; t < rows; ++t) {
            float total = 0.0f;
            for (int64_t c = 0; c < chunks; ++c) {
                const int8_t *q = w->q + (c * n + r) * chunk;
                const float *xc = x + t * k + c * chunk;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t i = 0; i < chunk; ++i) s += (float)q[i] * xc[i];
                total += s * bf16_to_f32(w->scale[c * n + r]);
            }
            y[t * n + r] = total;
        }
    }
}

typedef struct {
    const GemvInt4 *i4;
    const GemvInt8 *i8;
    const float *x;
    float *y;
    int64_t rows, a, b;
} GemvJob;

static void *gemv_job(void *arg) {
    const GemvJob *j = (const GemvJob *)arg;
    if (j->i4) ps_gemv_int4_blocks(j->i4, j->x, j->rows, j->y, j->a, j->b);
    else ps_gemv_int8_rows(j->i8, j->x, j->rows, j->y, j->a, j->b);
    return NULL;
}

static void gemv_range(void *job, int64_t a, int64_t b) { ((GemvJob *)job)->a = a; ((GemvJob *)job)->b = b; }

/* int4 takes up to GEMV_MAX_ROWS rows (its sums live in registers); int8 any number, four rows at a time over
   each block's codes: weight_only.INT8_DENSE_MIN_ROWS says up to where that beats widening for oneDNN. */
static int run_gemv(const GemvInt4 *i4, const GemvInt8 *i8, const float *x, int64_t rows, float *y, int64_t units,
                    int threads) {
    if (rows < 1 || (i4 && rows > GEMV_MAX_ROWS)) return 2;
    GemvJob jobs[MAX_THREADS];
    for (int t = 0; t < MAX_THREADS; ++t) jobs[t] = (GemvJob){i4, i8, x, y, rows, 0, 0};
    return ps_run_split(threads, units, jobs, sizeof(GemvJob), gemv_job, gemv_range);
}

/* y [rows, n] = x [rows, k] @ w^T; 0 on success, 2 for shapes these kernels do not take. */
int ps_gemv_int4(const uint8_t *packed, const uint16_t *sz, int64_t sz_stride, int64_t n, int64_t k, int64_t group,
                 const float *x, int64_t rows, float *y, int threads) {
    if (n % 64 || group <= 0 || k % group || sz_stride < 1 || sz_stride > 2) return 2;
    GemvInt4 w = {packed, sz, n, k, group, sz_stride};
    return run_gemv(&w, NULL, x, rows, y, n / 64, threads);
}

int ps_gemv_int8(const int8_t *q, const uint16_t *scale, int64_t chunks, int64_t n, int64_t chunk, const float *x,
                 int64_t rows, float *y, int threads) {
    GemvInt8 w = {q, scale, chunks, n, chunk};
    return run_gemv(NULL, &w, x, rows, y, n, threads);
}

/* 1 where the GEMVs above were built with their AVX-512 paths (the portable loops are slower than torch's
   own kernels, so callers only choose these where this says 1). */
int ps_gemv_vectorized(void) {
#if defined(__AVX512F__) && defined(INT8_I16)
    return 1;
#else
    return 0;
#endif
}
