/* int4 weight-only GEMM with int8 inputs: vpdpbusd multiplies the codes (unsigned bytes 0..15) by the inputs
(signed bytes), 64 multiply-adds an instruction where the int16 form's vpdpwssd does 32 (issue 25: batched
decode and prefill chunks were bound by those instructions, at about llama.cpp's rate, which multiplies its
Q4_0 codes by Q8_0 inputs the same way).

Inputs are rounded per row and weight group (max |x| / 127 each, as llama.cpp's Q8_0 activations per 32), so
a row's numbers depend on nothing but that row: its group sums are exact int32 (group * 15 * 127 < 2^31) and
are scaled into the float32 outputs group by group in one fixed order, in the 1-3-row form as in the tile.
A speculative verify pass of k + 1 rows, or any batch, gives each row the bits a one-row decode gives it.

Four columns of a 64-channel block are 128 bytes of torch's pack (column j's 32 bytes: channel i the low nibble
of byte i, channel i + 32 the high one). Two vpermt2b put the four codes of each channel side by side in a
32-bit lane (channels 0-15 and 16-31), a mask keeps the low nibbles and a shift the high ones (32-63). */
#include "gemm_int4_amx.h"
#include "gemm_int4_s8.h"

#if GEMM_INT4_S8
#include <immintrin.h>

#include "gemm_driver.h"

enum { TILE_ROWS = 4, MAX_GROUP_QUADS = 64 };     /* group sizes up to 256 (weight_only.INT4_GROUP_SIZES) */
/* Rows one pass over a block's groups serves: their outputs (256 bytes a row) stay in L2. Unbounded, a
   2048-row prefill chunk ran at 0.85x the rate of 128 rows. */
enum { TILE_PASS_ROWS = 256 };
/* Bytes ahead of the codes being read that the 1-3-row form prefetches (the stream of one 64-channel block).
   On the 1.7B model 2048 ran 27-32 ms a token and 4160 / 8256 19-20 in the same minutes (issue 25, the 2-core
   EPYC VM, whose read bandwidth itself switches between ~43 and ~72 GiB/s phases: compare within one). */
enum { FEW_ROWS_PREFETCH = 4160 };

/* vpdpbusd as inline assembly, as gemm_int4.c's vpdpwssd (the intrinsic spilled sums under gcc 12). */
static inline __m512i dpbusd(__m512i acc, __m512i w, __m512i x) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
    return acc;
}

/* Four inputs of row r from column 4i, broadcast to every lane. */
static inline __m512i quad_of(const int8_t *xr, int64_t i) {
    int32_t q;
    memcpy(&q, xr + 4 * i, sizeof q);
    return _mm512_set1_epi32(q);
}

/* y[row] += cvt(acc) * scale * xscale + zero * xsum for one group: the one order every row is summed in. */
static inline __attribute__((always_inline)) void add_group(float *y, const __m512i *acc, const __m512 *scale,
                                                            const __m512 *zero, float xs, float xsum) {
    for (int c = 0; c < 4; ++c)
        _mm512_storeu_ps(y + 16 * c, s8_add16(_mm512_loadu_ps(y + 16 * c), acc[c], scale[c], zero[c], xs, xsum));
}

typedef struct {
    const GemvInt4 *w;
    const int8_t *xq;
    const float *xscale, *xsum;
    float *y;
} Job;

/* R rows from r0 (R a constant at each call) against one unpacked group g of block nb. */
static inline __attribute__((always_inline)) void rows_group(const Job *j, const __m512i (*tile)[4],
                                                             const __m512 *scale, const __m512 *zero, int64_t g,
                                                             int64_t nb, int64_t r0, const int R) {
    const int64_t k = j->w->k, group = j->w->group, groups = k / group;
    const int8_t *x[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; ++r) x[r] = j->xq + (r0 + (r < R ? r : 0)) * k + g * group;
    __m512i a00 = _mm512_setzero_si512(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
            a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    for (int64_t i = 0; i < group / 4; ++i) {
        const __m512i w0 = tile[i][0], w1 = tile[i][1], w2 = tile[i][2], w3 = tile[i][3];
#define ROW(r, v0, v1, v2, v3)                                                                              \
        if (R > r) {                                                                                        \
            const __m512i xb = quad_of(x[r], i);                                                            \
            v0 = dpbusd(v0, w0, xb);                                                                        \
            v1 = dpbusd(v1, w1, xb);                                                                        \
            v2 = dpbusd(v2, w2, xb);                                                                        \
            v3 = dpbusd(v3, w3, xb);                                                                        \
        }
        ROW(0, a00, a01, a02, a03)
        ROW(1, a10, a11, a12, a13)
        ROW(2, a20, a21, a22, a23)
        ROW(3, a30, a31, a32, a33)
#undef ROW
    }
    const __m512i acc[TILE_ROWS][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23},
                                       {a30, a31, a32, a33}};
    for (int r = 0; r < R; ++r)
        add_group(j->y + (r0 + r) * j->w->n + nb * 64, acc[r], scale, zero, j->xscale[(r0 + r) * groups + g],
                  j->xsum[(r0 + r) * groups + g]);
}

/* Rows r..rows-1 (four or more): each group's codes unpacked once into an L1 tile that serves them all. */
static void block_tile(const Job *j, int64_t r_first, int64_t rows, int64_t nb, __m512i (*tile)[4]) {
    const GemvInt4 *w = j->w;
    const QuadShuffle sh = quad_shuffle();
    for (int64_t g = 0; g < w->k / w->group; ++g) {
        const uint8_t *p = w->packed + (nb * w->k + g * w->group) * 32;
        for (int64_t i = 0; i < w->group / 4; ++i) unpack_quad(&sh, p + 128 * i, tile[i]);
        __m512 scale[4], zero[4];
        for (int c = 0; c < 4; ++c) ps_int4_scale_zero16(w, g, nb * 64 + 16 * c, &scale[c], &zero[c]);
        int64_t r = r_first;
        for (; r + TILE_ROWS <= rows; r += TILE_ROWS) rows_group(j, tile, scale, zero, g, nb, r, TILE_ROWS);
        switch (rows - r) {
            case 1: rows_group(j, tile, scale, zero, g, nb, r, 1); break;
            case 2: rows_group(j, tile, scale, zero, g, nb, r, 2); break;
            case 3: rows_group(j, tile, scale, zero, g, nb, r, 3); break;
            default: break;
        }
    }
}

/* 1-3 rows: each quad of columns unpacked in registers and used at once (no tile to repay), the codes
   streamed once with a prefetch ahead. A batch-1 decode's GEMV. */
static inline __attribute__((always_inline)) void block_few(const Job *j, int64_t nb, const int R) {
    const GemvInt4 *w = j->w;
    const int64_t k = w->k, group = w->group, groups = k / group;
    const QuadShuffle sh = quad_shuffle();
    const uint8_t *p = w->packed + nb * k * 32;
    for (int64_t g = 0; g < SCALE_PREFETCH_GROUPS && g < groups; ++g) ps_int4_prefetch_scales(w, g, nb);
    for (int64_t g = 0; g < groups; ++g) {
        if (g + SCALE_PREFETCH_GROUPS < groups) ps_int4_prefetch_scales(w, g + SCALE_PREFETCH_GROUPS, nb);
        const int8_t *x0 = j->xq + g * group, *x1 = x0 + (R > 1 ? k : 0), *x2 = x0 + (R > 2 ? 2 * k : 0);
        __m512i a00 = _mm512_setzero_si512(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
                a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
        for (int64_t i = 0; i < group / 4; ++i, p += 128) {
            _mm_prefetch((const char *)(p + FEW_ROWS_PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + FEW_ROWS_PREFETCH + 64), _MM_HINT_T0);
            __m512i wv[4];
            unpack_quad(&sh, p, wv);
#define ROW(r, xr, v0, v1, v2, v3)                                                                          \
            if (R > r) {                                                                                    \
                const __m512i xb = quad_of(xr, i);                                                          \
                v0 = dpbusd(v0, wv[0], xb);                                                                 \
                v1 = dpbusd(v1, wv[1], xb);                                                                 \
                v2 = dpbusd(v2, wv[2], xb);                                                                 \
                v3 = dpbusd(v3, wv[3], xb);                                                                 \
            }
            ROW(0, x0, a00, a01, a02, a03)
            ROW(1, x1, a10, a11, a12, a13)
            ROW(2, x2, a20, a21, a22, a23)
#undef ROW
        }
        const __m512i acc[3][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}};
        __m512 scale[4], zero[4];
        for (int c = 0; c < 4; ++c) ps_int4_scale_zero16(w, g, nb * 64 + 16 * c, &scale[c], &zero[c]);
        for (int r = 0; r < R; ++r)
            add_group(j->y + r * w->n + nb * 64, acc[r], scale, zero, j->xscale[r * groups + g],
                      j->xsum[r * groups + g]);
    }
}

static void blocks(const GemvInt4 *w, const int8_t *xq, const float *xscale, const float *xsum, int64_t rows,
                         float *y, int64_t nb0, int64_t nb1) {
    const Job j = {w, xq, xscale, xsum, y};
    for (int64_t nb = nb0; nb < nb1; ++nb)
        for (int64_t r = 0; r < rows; ++r) memset(y + r * w->n + nb * 64, 0, 64 * sizeof(float));
    if (rows <= 3) {
        for (int64_t nb = nb0; nb < nb1; ++nb) {
            if (rows == 1) block_few(&j, nb, 1);
            else if (rows == 2) block_few(&j, nb, 2);
            else block_few(&j, nb, 3);
        }
        return;
    }
    __m512i tile[MAX_GROUP_QUADS][4];
    for (int64_t nb = nb0; nb < nb1; ++nb)
        for (int64_t r = 0; r < rows; r += TILE_PASS_ROWS)
            block_tile(&j, r, r + TILE_PASS_ROWS < rows ? r + TILE_PASS_ROWS : rows, nb, tile);
}

/* Where rows a..b-1 go: as rows ([rows, k], the scales and sums [rows, groups]), or laid out for the AMX tile
   (gemm_int4_amx.h: 16-row tiles four columns a line, the scales and sums [groups, padded]). */
typedef struct {
    int amx;
    int64_t padded;
} Layout;

static inline void store16(int8_t *xq, int64_t k, int64_t r, int64_t col, __m128i q, Layout at) {
    if (!at.amx) {
        _mm_storeu_si128((__m128i *)(xq + r * k + col), q);
        return;
    }
    int8_t *line = xq + (r / 16) * 16 * k + (col / 4) * 64 + (r % 16) * 4;
    int32_t d[4];
    _mm_storeu_si128((__m128i *)d, q);
    for (int j = 0; j < 4; ++j) memcpy(line + 64 * j, &d[j], sizeof d[j]);
}

static void round_rows(const float *x, int64_t k, int64_t group, int8_t *xq, float *xscale, float *xsum,
                       int64_t a, int64_t b, Layout layout) {
    const int64_t groups = k / group;
    for (int64_t r = a; r < b; ++r)
        for (int64_t g = 0; g < groups; ++g) {
            const float *xg = x + r * k + g * group;
            __m512 top = _mm512_setzero_ps();
            for (int64_t i = 0; i < group; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(xg + i)));
            const float m = _mm512_reduce_max_ps(top);
            /* In double, then rounded once: -ffast-math may turn a float division into a reciprocal and a
               multiply, which moves the last bit and with it which way a value on a half step rounds. */
            const __m512 inv = _mm512_set1_ps(m > 0.0f ? (float)(127.0 / (double)m) : 0.0f);
            __m512i sum = _mm512_setzero_si512();
            for (int64_t i = 0; i < group; i += 16) {
                const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + i), inv));
                sum = _mm512_add_epi32(sum, v);
                store16(xq, k, r, g * group + i, _mm512_cvtsepi32_epi8(v), layout);
            }
            const int64_t at = layout.amx ? g * layout.padded + r : r * groups + g;
            xscale[at] = (float)((double)m / 127.0);
            xsum[at] = (float)_mm512_reduce_add_epi32(sum) * xscale[at];
        }
}

static void round_vnni(const GemmRun *g) {
    round_rows(g->in.x, g->k, g->group, g->in.xq, g->in.xscale, g->in.xsum, g->a, g->b, (Layout){0, 0});
}

static void round_amx(const GemmRun *g) {
    round_rows(g->in.x, g->k, g->group, g->in.xq, g->in.xscale, g->in.xsum, g->a, g->b, (Layout){1, g->padded});
}

static int vnni_blocks(const GemmRun *j) {
    blocks(j->w, j->in.xq, j->in.xscale, j->in.xsum, j->rows, j->y, j->a, j->b);
    return 0;
}

static int amx_blocks(const GemmRun *j) {
    return ps_gemm_int4_amx_blocks(j->w, j->in.xq, j->in.xscale, j->in.xsum, j->rows, j->padded, j->y, j->a, j->b);
}

/* allow_amx: whether many rows may take the AMX tile (same bits as the VNNI tile; 0 to measure one against
   the other). The AMX tile reads whole tiles: the rounded rows are padded with zeros to AMX_PAD_ROWS. Only the
   padding reads zeros: it shares its 16-row tiles with the last rows, so the whole last tile is cleared before
   the rounding writes them (a whole-buffer calloc cleared a prefill chunk's ~MB per call). */
static int gemm_s8(const GemvInt4 *w, const float *x, int64_t rows, float *y, int threads, int allow_amx) {
    const int amx = allow_amx && rows >= AMX_MIN_ROWS && w->k % 64 == 0 && ps_gemm_int4_amx_ready();
    const int64_t padded = amx ? (rows + AMX_PAD_ROWS - 1) / AMX_PAD_ROWS * AMX_PAD_ROWS : rows;
    return ps_gemm_threads((GemmRun){.w = w, .n = w->n, .k = w->k, .group = w->group, .rows = rows, .padded = padded,
                                     .cleared_from = rows / AMX_TILE_ROWS * AMX_TILE_ROWS, .x_bytes = 1,
                                     .scale_per_group = 1, .round = amx ? round_amx : round_vnni,
                                     .blocks = amx ? amx_blocks : vnni_blocks, .in = {.x = x}, .y = y},
                           threads);
}

static int takes_s8(int64_t n, int64_t k, int64_t group, int64_t sz_form, int64_t rows) {
    return rows >= 1 && n % 64 == 0 && group >= 16 && group % 16 == 0 && group / 4 <= MAX_GROUP_QUADS && k % group == 0
           && ps_int4_sz_takes(sz_form, k, group);
}

int ps_gemm_int4_s8(const uint8_t *packed, const uint16_t *sz, int64_t sz_form, int64_t n, int64_t k,
                    int64_t group, const float *x, int64_t rows, float *y, int threads) {
    const GemvInt4 w = {packed, sz, n, k, group, sz_form};
    return takes_s8(n, k, group, sz_form, rows) ? gemm_s8(&w, x, rows, y, threads, 1) : 2;
}

int ps_gemm_int4_s8_vnni(const uint8_t *packed, const uint16_t *sz, int64_t sz_form, int64_t n, int64_t k,
                         int64_t group, const float *x, int64_t rows, float *y, int threads) {
    const GemvInt4 w = {packed, sz, n, k, group, sz_form};
    return takes_s8(n, k, group, sz_form, rows) ? gemm_s8(&w, x, rows, y, threads, 0) : 2;
}
#else
int ps_gemm_int4_s8(const uint8_t *packed, const uint16_t *sz, int64_t sz_form, int64_t n, int64_t k,
                    int64_t group, const float *x, int64_t rows, float *y, int threads) {
    (void)packed, (void)sz, (void)sz_form, (void)n, (void)k, (void)group, (void)x, (void)rows, (void)y, (void)threads;
    return 2;
}

int ps_gemm_int4_s8_vnni(const uint8_t *packed, const uint16_t *sz, int64_t sz_form, int64_t n, int64_t k,
                         int64_t group, const float *x, int64_t rows, float *y, int threads) {
    return ps_gemm_int4_s8(packed, sz, sz_form, n, k, group, x, rows, y, threads);
}

#endif

int ps_gemm_int4_s8_built(void) { return GEMM_INT4_S8; }

int ps_gemm_int4_s8_amx(void) { return ps_gemm_int4_amx_ready(); }
