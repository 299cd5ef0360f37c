/* The GEMVs of gemv.h for CPUs with AVX2 and FMA (most AMD Zen 2/3 machines): the int4 one over torch's AVX2 pack
(PACK_AVX2, gemv.h) and the int8 one, eight float lanes a register and 16 registers.

int4: the int4 GEMV for a 64-channel block of torch's AVX2 pack, which holds it as two blocks of 32 channels,
[k, 16] bytes each, byte j of a column holding channel j in its low nibble and j + 16 in its high one. Each
channel's sum is the AVX-512 kernel's (gemv_int4.c): one FMA chain over the group's columns, then
tot = acc * scale + (zero - 8 scale) * sum(x); so a row gets those bits whatever rows run beside it, and the
AVX-512 GEMV's bits on the same codes. Built wherever AVX2, FMA and F16C are (an AVX-512 build too: it is
chosen by the pack's form, which an ATEN_CPU_CAPABILITY override can make PACK_AVX2 there).

int8: as gemv_int8.c's AVX-512 path, x rounded to int16 (one scale a row) and vpmaddwd pairs. */
#include "gemv.h"

#include <math.h>
#include <stdlib.h>

#if GEMV_INT4_AVX2
#include <immintrin.h>

/* Eight channels c0.. of group g: their scale, and zero - 8 * scale (gemv.h's ps_int4_scale_zero16 in 8 lanes). */
static inline void scale_zero8(const GemvInt4 *w, int64_t g, int64_t c0, __m256 *scale, __m256 *zero) {
    if (w->sz_form == SZ_K) {
        const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w->sz + g * w->n + c0)));
        const uint16_t *sup = ps_k_supers(w, g) + c0;
        *scale = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sup)),
                               _mm256_cvtepi32_ps(_mm256_and_si256(words, _mm256_set1_epi32(0xFF))));
        *zero = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sup + w->n))),
                              _mm256_cvtepi32_ps(_mm256_srli_epi32(words, 8)));
        return;
    }
    const uint16_t *sz = w->sz + (g * w->n + c0) * w->sz_form;
    if (w->sz_form == SZ_SCALES) {
        const __m256i s = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)sz));
        *scale = _mm256_castsi256_ps(_mm256_slli_epi32(s, 16));
        *zero = _mm256_mul_ps(_mm256_set1_ps(-8.0f), *scale);
        return;
    }
    const __m256i pairs = _mm256_loadu_si256((const __m256i *)sz);
    *scale = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
    *zero = _mm256_fmadd_ps(_mm256_set1_ps(-8.0f), *scale,
                            _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32((int)0xFFFF0000u))));
}

/* Quarter Q (0..7) of a 64-channel block, channels 8Q..8Q+7, at one column: pack block Q / 4, bytes 0-7 or 8-15
   (Q odd), low nibbles (Q % 4 < 2) or high. vpmovzxbd widens 8 bytes to 32 bits, so the high nibble is one shift. */
static inline __m256 quarter(const uint8_t *col, int q) {
    const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(col + (q & 1) * 8)));
    return _mm256_cvtepi32_ps(q & 2 ? _mm256_srli_epi32(d, 4) : _mm256_and_si256(d, _mm256_set1_epi32(15)));
}

/* Quarters q0..q0+QN-1 of block nb for R rows (R * QN = 8 sums in flight where it can: an FMA's latency is 4-5
   cycles and two issue a cycle, so fewer chains leave the units idle; 16 registers hold no more). */
static inline __attribute__((always_inline)) void int4_quarters(const GemvInt4 *w, const float *x, float *y,
                                                                int64_t nb, int q0, const int R, const int QN) {
    const int64_t k = w->k, n = w->n, group = w->group;
    __m256 tot[4][8];
    for (int r = 0; r < R; ++r) for (int j = 0; j < QN; ++j) tot[r][j] = _mm256_setzero_ps();
    const uint8_t *blocks[2] = {w->packed + 2 * nb * k * 16, w->packed + (2 * nb + 1) * k * 16};
    for (int64_t g0 = 0; g0 < k; g0 += group) {
        __m256 acc[4][8];
        float sum[4] = {0};
        for (int r = 0; r < R; ++r) for (int j = 0; j < QN; ++j) acc[r][j] = _mm256_setzero_ps();
        if (q0 == 0 && g0 + 2 * group < k) ps_int4_prefetch_scales(w, g0 / group + 2, nb);
        for (int64_t kk = g0; kk < g0 + group; ++kk) {
            __m256 q[8];
            for (int j = 0; j < QN; ++j) q[j] = quarter(blocks[(q0 + j) >> 2] + kk * 16, q0 + j);
            for (int r = 0; r < R; ++r) {
                const float xv = x[r * k + kk];
                const __m256 xb = _mm256_set1_ps(xv);
                sum[r] += xv;
                for (int j = 0; j < QN; ++j) acc[r][j] = _mm256_fmadd_ps(q[j], xb, acc[r][j]);
            }
        }
        for (int j = 0; j < QN; ++j) {
            __m256 scale, zero;
            scale_zero8(w, g0 / group, nb * 64 + 8 * (q0 + j), &scale, &zero);
            for (int r = 0; r < R; ++r)
                tot[r][j] = _mm256_fmadd_ps(acc[r][j], scale, _mm256_fmadd_ps(zero, _mm256_set1_ps(sum[r]), tot[r][j]));
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < QN; ++j) _mm256_storeu_ps(y + r * n + nb * 64 + 8 * (q0 + j), tot[r][j]);
}

/* Up to four rows of block nb: one pass over its codes per QN quarters (a later pass finds them in L1/L2). */
static inline __attribute__((always_inline)) void int4_rows(const GemvInt4 *w, const float *x, float *y,
                                                            int64_t nb, const int R) {
    const int QN = R == 1 ? 8 : R == 2 ? 4 : 2;
    for (int q0 = 0; q0 < 8; q0 += QN) int4_quarters(w, x, y, nb, q0, R, QN);
}

void ps_gemv_int4_blocks_avx2(const GemvInt4 *w, const float *x, int64_t rows, float *y, int64_t nb0, int64_t nb1) {
    const int64_t k = w->k, n = w->n;
    for (int64_t nb = nb0; nb < nb1; ++nb)
        for (int64_t t = 0; t < rows; t += 4) {
            const float *xt = x + t * k;
            float *yt = y + t * n;
            switch (rows - t < 4 ? rows - t : 4) {
                case 1: int4_rows(w, xt, yt, nb, 1); break;
                case 2: int4_rows(w, xt, yt, nb, 2); break;
                case 3: int4_rows(w, xt, yt, nb, 3); break;
                default: int4_rows(w, xt, yt, nb, 4); break;
            }
        }
}
#endif

#if GEMV_INT8_AVX2
/* x as int16 (gemv.h's ps_row_to_i16), the row padded with zeros to `stride` so that a chunk's last 16 columns
   may read past its end. Returns the scale. */
static float row_i16(const float *x, int64_t k, int64_t stride, int16_t *out) {
    memset(out + k, 0, sizeof(int16_t) * (stride - k));
    return ps_row_to_i16(x, k, out);
}

/* 16 codes from q as int16; m < 16: the first m, the rest 0 (a chunk's tail: its padded x is then never summed). */
static inline __m256i codes16(const int8_t *q, int64_t m) {
    if (m >= 16) return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
    int8_t buf[16] = {0};
    memcpy(buf, q, (size_t)m);
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)buf));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Up to INT8_RUN steps of 16 codes sum exactly in int32 lanes: each lane takes one pair sum (at most
   2 * 128 * 32767 < 2^23) a step, under 2^31 for 256 steps. The run's lane sums are then scaled into float
   sums once, where gemv_int8.c's AVX-512 path takes a convert and an FMA per step. */
enum { INT8_RUN = 256 };

/* Channels of a tile (INT8_TILE2 channels, R rows): their float lane sums, kept in L1 across the chunks. */
enum { INT8_TILE2 = 128 };
typedef struct {
    __m256 acc[INT8_TILE2][4];
} Int8Tile;

/* Chunk ci's part of channels r..r+C-1 (tile slots s..s+C-1) for R rows (xq rows `stride` apart): 2 R C sums in
   registers. Each channel's operations are the same for every R and C, so a row's bits do not depend on the
   rows beside it. */
static inline __attribute__((always_inline)) void int8_chunk(const GemvInt8 *w, const int16_t *xq, int64_t stride,
                                                             Int8Tile *tile, int64_t ci, int64_t r, int64_t s,
                                                             const int R, const int C) {
    const int64_t n = w->n, chunk = w->chunk;
    const int8_t *q = w->q + (ci * n + r) * chunk;
    __m256 acc[4][4];
    for (int t = 0; t < R; ++t) for (int c = 0; c < C; ++c) acc[t][c] = tile->acc[s + c][t];
    for (int64_t i0 = 0; i0 < chunk; i0 += 16 * INT8_RUN) {
        __m256i isum[4][4];
        for (int t = 0; t < R; ++t) for (int c = 0; c < C; ++c) isum[t][c] = _mm256_setzero_si256();
        const int64_t end = i0 + 16 * INT8_RUN < chunk ? i0 + 16 * INT8_RUN : chunk;
        for (int64_t i = i0; i < end; i += 16) {
            __m256i qv[4];
            for (int c = 0; c < C; ++c) qv[c] = codes16(q + c * chunk + i, end - i);
            for (int t = 0; t < R; ++t) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + t * stride + ci * chunk + i));
                for (int c = 0; c < C; ++c) isum[t][c] = _mm256_add_epi32(isum[t][c], _mm256_madd_epi16(qv[c], xv));
            }
        }
        for (int c = 0; c < C; ++c) {
            const __m256 sc = _mm256_set1_ps(bf16_to_f32(w->scale[ci * n + r + c]));
            for (int t = 0; t < R; ++t) acc[t][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t][c]), sc, acc[t][c]);
        }
    }
    for (int t = 0; t < R; ++t) for (int c = 0; c < C; ++c) tile->acc[s + c][t] = acc[t][c];
}

/* Channels r0..r1-1 of up to four rows, INT8_TILE2 channels at a time with the chunks outermost: each chunk
   plane is then read as one run of INT8_TILE2 * chunk bytes, where a few channels at a time hop between planes
   n * chunk bytes apart (a Q8_0 head's are 1.5 MB apart: a page, and a TLB miss, every 128 bytes). Four
   channels a pass for one row, fewer for more (2 R C <= 16 registers). */
static inline __attribute__((always_inline)) void int8_rows(const GemvInt8 *w, const int16_t *xq, int64_t stride,
                                                            const float *x_scale, float *y, int64_t r0, int64_t r1,
                                                            const int R) {
    const int C = R == 1 ? 4 : R == 2 ? 2 : 1;
    Int8Tile tile;
    for (int64_t t0 = r0; t0 < r1; t0 += INT8_TILE2) {
        const int64_t nt = r1 - t0 < INT8_TILE2 ? r1 - t0 : INT8_TILE2;
        for (int64_t s = 0; s < nt; ++s) for (int t = 0; t < R; ++t) tile.acc[s][t] = _mm256_setzero_ps();
        for (int64_t ci = 0; ci < w->chunks; ++ci) {
            if (ci + 1 < w->chunks) {        /* the next plane's run and scales: the prefetchers do not jump there */
                for (int64_t o = 0; o < nt * w->chunk; o += 64)
                    _mm_prefetch((const char *)(w->q + ((ci + 1) * w->n + t0) * w->chunk + o), _MM_HINT_T0);
                for (int64_t o = 0; o < nt * 2; o += 64)
                    _mm_prefetch((const char *)(w->scale + (ci + 1) * w->n + t0) + o, _MM_HINT_T0);
            }
            int64_t s = 0;
            for (; s + C <= nt; s += C) int8_chunk(w, xq, stride, &tile, ci, t0 + s, s, R, C);
            for (; s < nt; ++s) int8_chunk(w, xq, stride, &tile, ci, t0 + s, s, R, 1);
        }
        for (int64_t s = 0; s < nt; ++s)
            for (int t = 0; t < R; ++t) y[t * w->n + t0 + s] = x_scale[t] * hsum8(tile.acc[s][t]);
    }
}

/* ps_gemv_int8_rows for channels r0..r1-1 of every row; 1 out of memory (nothing written). */
int ps_gemv_int8_rows_avx2(const GemvInt8 *w, const float *x, int64_t rows, float *y, int64_t r0, int64_t r1) {
    const int64_t k = w->chunks * w->chunk, stride = k + 16, n = w->n;
    enum { STACK_VALUES = 16384, STACK_ROWS = 16 };
    int16_t on_stack[STACK_VALUES];
    float scales_on_stack[STACK_ROWS];
    int16_t *xq = rows * stride <= STACK_VALUES ? on_stack : malloc(sizeof(int16_t) * rows * stride);
    float *x_scale = rows <= STACK_ROWS ? scales_on_stack : malloc(sizeof(float) * rows);
    const int failed = !xq || !x_scale;
    if (!failed) {
        for (int64_t t = 0; t < rows; ++t) x_scale[t] = row_i16(x + t * k, k, stride, xq + t * stride);
        for (int64_t t = 0; t < rows; t += 4) {
            const int16_t *xt = xq + t * stride;
            const float *st = x_scale + t;
            float *yt = y + t * n;
            switch (rows - t < 4 ? rows - t : 4) {
                case 1: int8_rows(w, xt, stride, st, yt, r0, r1, 1); break;
                case 2: int8_rows(w, xt, stride, st, yt, r0, r1, 2); break;
                case 3: int8_rows(w, xt, stride, st, yt, r0, r1, 3); break;
                default: int8_rows(w, xt, stride, st, yt, r0, r1, 4); break;
            }
        }
    }
    if (xq != on_stack) free(xq);
    if (x_scale != scales_on_stack) free(x_scale);
    return failed;
}
#endif
