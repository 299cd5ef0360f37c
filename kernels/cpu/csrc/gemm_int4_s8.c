/* int4 weight-only GEMM with int8 inputs: vpdpbusd multiplies the codes (unsigned bytes 0..15) by the inputs
(signed bytes), 64 multiply-adds an instruction where the int16 form's vpdpwssd does 32 (issue 25: batched
decode and prefill chunks were bound by those instructions, at about llama.cpp's rate, which multiplies its
Q4_0 codes by Q8_0 inputs the same way).

Inputs are rounded per row and weight group (max |x| / 127 each, as llama.cpp's Q8_0 activations per 32), so
a row's numbers depend on nothing but that row: its group sums are exact int32 (group * 15 * 127 < 2^31) and
are scaled into the float32 outputs group by group in one fixed order, in the 1-3-row form as in the tile.
A speculative verify pass of k + 1 rows, or any batch, gives each row the bits a one-row decode gives it.
The codes are unpacked four columns at a time (int4_quads.h); many rows take the AMX tile where the CPU has
it (gemm_int4_amx.c, the same bits). */
#include "gemm_int4_amx.h"
#include "gemm_int4_s8.h"

#if GEMM_INT4_S8
#include "gemm_driver.h"

/* vpdpbusd as inline assembly, as int4_pairs.h's vpdpwssd (the intrinsic spilled sums under gcc 12). */
static inline __m512i dpbusd(__m512i acc, __m512i w, __m512i x) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
    return acc;
}

/* The format's parts (gemm_blocks.h): int8 inputs, a scale a row and group; a step is a quad of columns.
   1-3 rows unpack the codes in registers (no tile to repay), four and more into the tile. */
enum { FMT_X_BYTES = 1, FMT_SCALE_PER_GROUP = 1, FMT_TILE_FROM_ROWS = 4 };
#define fmt_shuffle quad_shuffle
#define fmt_unpack(sh, p, wv, V) unpack_quad(sh, p, wv)
#define fmt_dot dpbusd
#include "gemm_blocks.h"

static int vnni_blocks(const GemmRun *j) { return gemm_blocks(j, 0); }

static int amx_blocks(const GemmRun *j) {
    return ps_gemm_int4_amx_blocks(j->w, j->in.xq, j->in.xscale, j->in.xsum, j->rows, j->padded, j->y, j->a, j->b);
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

/* Rows g->a..g->b-1, each group's inputs as int8 (max |x| / 127 a step, round to nearest even). */
static inline __attribute__((always_inline)) void round_rows(const GemmRun *g, Layout layout) {
    const int64_t k = g->k, group = g->group, groups = k / group;
    int8_t *xq = g->in.xq;
    for (int64_t r = g->a; r < g->b; ++r)
        for (int64_t gi = 0; gi < groups; ++gi) {
            const float *xg = g->in.x + r * k + gi * group;
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
                store16(xq, k, r, gi * group + i, _mm512_cvtsepi32_epi8(v), layout);
            }
            const int64_t at = layout.amx ? gi * layout.padded + r : r * groups + gi;
            g->in.xscale[at] = (float)((double)m / 127.0);
            g->in.xsum[at] = (float)_mm512_reduce_add_epi32(sum) * g->in.xscale[at];
        }
}

static void round_vnni(const GemmRun *g) { round_rows(g, (Layout){0, 0}); }

static void round_amx(const GemmRun *g) { round_rows(g, (Layout){1, g->padded}); }

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
    return rows >= 1 && n % 64 == 0 && group >= 16 && group % 16 == 0 && group <= GEMM_MAX_GROUP && k % group == 0
           && ps_int4_sz_takes(sz_form, k, group);
}

int ps_gemm_int4_s8(const uint8_t *packed, const uint16_t *sz, int64_t sz_form, int64_t n, int64_t k,
                    int64_t group, const float *x, int64_t rows, float *y, int threads) {
    const GemvInt4 w = {packed, sz, n, k, group, sz_form, PACK_AVX512};
    return takes_s8(n, k, group, sz_form, rows) ? gemm_s8(&w, x, rows, y, threads, 1) : 2;
}

int ps_gemm_int4_s8_vnni(const uint8_t *packed, const uint16_t *sz, int64_t sz_form, int64_t n, int64_t k,
                         int64_t group, const float *x, int64_t rows, float *y, int threads) {
    const GemvInt4 w = {packed, sz, n, k, group, sz_form, PACK_AVX512};
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
