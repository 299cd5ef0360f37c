/* The int8 GEMV (gemv.h's ps_gemv_int8_rows): int8 weights in chunks of input columns (Q8_0, Q6_K, Q5 layers
kept as int8, the tied head), float32 in and out, any number of input rows. The entry point that splits it over
threads is gemv_entry.c's ps_gemv_int8. */
#include "gemv.h"
#include "int4_pairs.h"

#include <math.h>
#include <stdlib.h>

/* int8 in chunks of input columns, one scale per (chunk, output channel): q [chunks, n, chunk] with each
   chunk's codes contiguous per channel (a whole row is one chunk for plain int8). */
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define INT8_I16 1

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

/* The scales of channels r0..r0+15 for chunk c (lo) and c + 1 (hi, where paired; else lo again), as floats. */
static inline void int8_scales16(const GemvInt8 *w, int64_t c, int64_t r0, int paired, __m512 *lo, __m512 *hi) {
    const uint16_t *s = w->scale + c * w->n + r0;
    *lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)s)), 16));
    *hi = paired ? _mm512_castsi512_ps(_mm512_slli_epi32(
                       _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + w->n))), 16))
                 : *lo;
}

/* Channel r0 + r's scale over the 16 pair sums of chunk c (and of c + 1 in the high half where paired), from
   int8_scales16's vectors by one two-source permute, where each channel loaded, widened, broadcast and
   blended two scalars. Only a few percent of the 1.7B Q6_K head (49152 x 2048, warm: 7.28 -> 6.98 ms): its
   two 256-byte runs from two planes per pair of chunks cost more (chunks of 32: 4.3 ms). */
static inline __m512 int8_scale16(__m512 lo, __m512 hi, int r) {
    const __m512i pick = _mm512_add_epi32(_mm512_set1_epi32(r),
                                          _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16));
    return _mm512_permutex2var_ps(lo, pick, hi);
}

/* Prefetch of the codes PF_BLOCKS blocks ahead of channels r0..r0+15 at column i of chunk c (and c + 1), and
   at a chunk's first column their scales: a chunk's scales for 32 channels share one line, n * 2 bytes past
   the last chunk's (a page apart on a head), which the hardware prefetchers do not follow. */
static inline void int8_prefetch(const GemvInt8 *w, int64_t c, int64_t r0, int64_t i, int64_t ahead, int paired) {
    if (i == 0) {
        const uint16_t *s = w->scale + c * w->n + r0 + 16 * PF_BLOCKS;
        _mm_prefetch((const char *)s, _MM_HINT_T0);
        if (paired) _mm_prefetch((const char *)(s + w->n), _MM_HINT_T0);
    }
    const int8_t *q = w->q + (c * w->n + r0) * w->chunk + ahead + i;
    const int64_t step = paired ? 4 : 1;      /* paired: a 16-code run per channel, four channels a line */
    for (int r = 0; r < 16; r += step) {
        _mm_prefetch((const char *)(q + r * w->chunk), _MM_HINT_T0);
        if (paired) _mm_prefetch((const char *)(q + w->n * 16 + r * w->chunk), _MM_HINT_T0);
    }
}

#ifdef __AVX512VNNI__
/* Whole rows (one scale per channel: Q8_0 linears and the requantized ones) up to INT8_I32_MAX_K columns sum
   exactly in int32 with vpdpwssd: one instruction per 32 codes where the float form takes three (multiply-add
   pairs, convert, FMA), which left the 135M Q8_0 model's decode step compute-bound (issue 25). A lane sums
   k / 16 products of at most 127 * 32767, under 2^31 up to 8192 columns. */
enum { INT8_I32_MAX_K = 8192 };
#define INT8_I32 1

static inline int int8_whole_i32(const GemvInt8 *w) { return w->chunks == 1 && w->chunk <= INT8_I32_MAX_K; }

/* Channel r's output from its int32 lane sums: the same operations in every path, so a row's bits do not
   depend on which rows ran beside it. */
static inline float int8_i32_out(const GemvInt8 *w, int64_t r, __m512i acc, float x_scale) {
    return x_scale * bf16_to_f32(w->scale[r]) * _mm512_reduce_add_ps(_mm512_cvtepi32_ps(acc));
}

static void int8_block16_whole(const GemvInt8 *w, const int16_t *x, float x_scale, float *y, int64_t r0) {
    const int64_t k = w->chunk;
    const int64_t ahead = r0 + 16 * PF_BLOCKS < w->n ? 16 * PF_BLOCKS * k : 0;
    __m512i acc[16];
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_si512();
    for (int64_t i = 0; i < k; i += 32) {
        const __mmask32 m = k - i >= 32 ? 0xFFFFFFFFu : (1u << (k - i)) - 1;
        const __m512i xv = _mm512_maskz_loadu_epi16(m, x + i);
        if (ahead && !(i & 63)) int8_prefetch(w, 0, r0, i, ahead, 0);
        for (int r = 0; r < 16; ++r) acc[r] = dpwssd(acc[r], int8_codes32(w, 0, r0 + r, i, m, 0), xv);
    }
    for (int r = 0; r < 16; ++r) y[r0 + r] = int8_i32_out(w, r0 + r, acc[r], x_scale);
}
#else
#define INT8_I32 0
static inline int int8_whole_i32(const GemvInt8 *w) { (void)w; return 0; }
#endif

static void int8_block16_i16(const GemvInt8 *w, const int16_t *x, float x_scale, float *y, int64_t r0) {
    const int64_t chunks = w->chunks, n = w->n, chunk = w->chunk;
    const int paired = int8_paired(w);
#if INT8_I32
    if (int8_whole_i32(w)) {
        int8_block16_whole(w, x, x_scale, y, r0);
        return;
    }
#endif
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    const int64_t ahead = r0 + 16 * PF_BLOCKS < n ? 16 * PF_BLOCKS * chunk : 0;
    __m512 scale[16];          /* a chunk's, kept in L1: the FMAs read them as memory operands */
    for (int64_t c = 0; c < chunks; c += 1 + paired) {
        __m512 lo, hi;
        int8_scales16(w, c, r0, paired, &lo, &hi);
        for (int r = 0; r < 16; ++r) scale[r] = int8_scale16(lo, hi, r);
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

/* Paired chunks of 16 (int8_paired) at one input row, channels r0..r1 (a multiple of 16) in tiles of INT8_TILE:
   each chunk plane is read as one run of 4 KiB per tile, where 16 channels at a time read 128 runs of 256 bytes
   from planes 786 KB apart (the 1.7B model's Q6_K head, 49152 x 2048, streamed from memory on 2 threads: 7.1 ms
   a call that way, 6.1 in tiles). The tile's sums stay in L1; each channel takes int8_block16_i16's FMAs in its
   order, so a row gets the bits the other paths give it. */
enum { INT8_TILE = 256 };
static void int8_tiles_i16(const GemvInt8 *w, const int16_t *x, float x_scale, float *y, int64_t r0, int64_t r1) {
    const int64_t chunks = w->chunks, n = w->n;
    __m512 acc[INT8_TILE];
    for (int64_t t0 = r0; t0 < r1; t0 += INT8_TILE) {
        const int64_t nt = r1 - t0 < INT8_TILE ? r1 - t0 : INT8_TILE;
        for (int64_t r = 0; r < nt; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; c += 2) {
            const __m512i xv = _mm512_loadu_si512(x + c * 16);
            for (int64_t b = 0; b < nt; b += 16) {
                __m512 lo, hi;
                int8_scales16(w, c, t0 + b, 1, &lo, &hi);
                if (c + 2 < chunks) {     /* the next pair of planes' runs: without it 8.2 ms instead of 5.9 */
                    const int8_t *q = w->q + ((c + 2) * n + t0 + b) * 16;
                    for (int o = 0; o < 256; o += 64) {
                        _mm_prefetch((const char *)(q + o), _MM_HINT_T0);
                        _mm_prefetch((const char *)(q + n * 16 + o), _MM_HINT_T0);
                    }
                }
                for (int r = 0; r < 16; ++r) {
                    const __m512i pairs = _mm512_madd_epi16(int8_codes32(w, c, t0 + b + r, 0, 0, 1), xv);
                    acc[b + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pairs), int8_scale16(lo, hi, r), acc[b + r]);
                }
            }
        }
        for (int64_t r = 0; r < nt; ++r) y[t0 + r] = x_scale * _mm512_reduce_add_ps(acc[r]);
    }
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
#if INT8_I32
    if (int8_whole_i32(w)) {                /* int8_block16_whole's int32 sums, four channels at a time */
        for (int g = 0; g < 16; g += 4) {
            __m512i acc[4][4];
            for (int t = 0; t < 4; ++t)
                for (int j = 0; j < 4; ++j) acc[t][j] = _mm512_setzero_si512();
            for (int64_t i = 0; i < chunk; i += 32) {
                const __mmask32 m = chunk - i >= 32 ? 0xFFFFFFFFu : (1u << (chunk - i)) - 1;
                if (ahead && g == 0 && !(i & 63)) int8_prefetch(w, 0, r0, i, ahead, 0);
                __m512i qv[4];
                for (int j = 0; j < 4; ++j) qv[j] = int8_codes32(w, 0, r0 + g + j, i, m, 0);
                for (int t = 0; t < R; ++t) {
                    const __m512i xv = _mm512_maskz_loadu_epi16(m, x + t * k + i);
                    for (int j = 0; j < 4; ++j) acc[t][j] = dpwssd(acc[t][j], qv[j], xv);
                }
            }
            for (int t = 0; t < R; ++t)
                for (int j = 0; j < 4; ++j) y[t * n + r0 + g + j] = int8_i32_out(w, r0 + g + j, acc[t][j], x_scale[t]);
        }
        return;
    }
#endif
    for (int g = 0; g < 16; g += 4) {
        __m512 acc[4][4];
        for (int t = 0; t < 4; ++t)
            for (int j = 0; j < 4; ++j) acc[t][j] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; c += 1 + paired) {
            __m512 scale[4], lo, hi;
            int8_scales16(w, c, r0, paired, &lo, &hi);
            for (int j = 0; j < 4; ++j) scale[j] = int8_scale16(lo, hi, g + j);
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
#if INT8_I32
    if (k <= INT8_I32_MAX_K) {              /* exact int32 lane sums, as int8_block16_whole */
        __m512i a[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
        int64_t i = 0;
        for (; i + 128 <= k; i += 128)
            for (int j = 0; j < 4; ++j)
                a[j] = dpwssd(a[j], _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + i + 32 * j))),
                              _mm512_loadu_si512(x + i + 32 * j));
        for (; i < k; i += 32) {
            const __mmask32 m = k - i >= 32 ? 0xFFFFFFFFu : (1u << (k - i)) - 1;
            a[0] = dpwssd(a[0], _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, q + i)), _mm512_maskz_loadu_epi16(m, x + i));
        }
        const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_cvtepi32_ps(a[0]), _mm512_cvtepi32_ps(a[1])),
                                       _mm512_add_ps(_mm512_cvtepi32_ps(a[2]), _mm512_cvtepi32_ps(a[3])));
        return _mm512_reduce_add_ps(s);
    }
#endif
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
#if GEMV_INT8_AVX2
    if (!ps_gemv_int8_rows_avx2(w, x, rows, y, r0, r1)) return;     /* out of memory: the loop below */
#endif
#ifdef INT8_I16
    if (r1 - r0 >= 16) {
        enum { STACK_VALUES = 16384 };
        int16_t on_stack[STACK_VALUES];
        float scales_on_stack[GEMV_MAX_ROWS];
        int16_t *xq = rows * k <= STACK_VALUES ? on_stack : malloc(sizeof(int16_t) * rows * k);
        float *x_scale = rows <= GEMV_MAX_ROWS ? scales_on_stack : malloc(sizeof(float) * rows);
        if (xq && x_scale) {
            for (int64_t t = 0; t < rows; ++t) x_scale[t] = ps_row_to_i16(x + t * k, k, xq + t * k);
            if (chunks == 1 && chunk > INT8_LONG_ROW)
                for (; r < r1; ++r)
                    for (int64_t t = 0; t < rows; ++t)
                        y[t * n + r] = x_scale[t] * bf16_to_f32(w->scale[r]) * int8_dot_i16(w->q + r * k, xq + t * k, k);
            if (rows == 1 && int8_paired(w)) {
                const int64_t end = r0 + (r1 - r0) / 16 * 16;
                int8_tiles_i16(w, xq, x_scale[0], y, r, end);
                r = end;
            }
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
