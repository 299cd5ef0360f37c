/* The int8-input int4 GEMM's many-row tile on Intel AMX (issue 25: prefill chunks and big mixed batches).

gemm_int4_s8.c's VNNI tile spends about half its instructions on vpdpbusd (64 multiply-adds each) and half on
scaling each group's int32 sums into the float outputs. One AMX tdpbusd multiplies a tile of 16 channels'
codes by a tile of 16 input rows over up to 64 columns (16 x 16 x 64 multiply-adds) on its own unit, so what
remains on the vector units is that scaling: the same products and sums in the same order per row and group as
the VNNI tile (gemm_blocks.h's scale_group), so every output gets the VNNI tile's bits.

tdpbusd multiplies unsigned bytes (its first tile) by signed bytes (its second): the codes (0..15) are the
first, the inputs the second, and the int32 sums are the VNNI tile's exactly. A tile's rows are the first
operand's rows: the codes are laid out channel by channel (a 64-channel block unpacked once a pass, 64 bytes a
column, read from L2), the inputs four columns of 16 rows a 64-byte line (gemm_int4_s8.c lays them out so when
it rounds them). The sums come out a channel a row, over 16 input rows: the scaling runs on those vectors and
the outputs are transposed once, when written. Two channel tiles by two row tiles a step: each tile loaded
serves two multiplies. */
#include <stdlib.h>

#include "gemm_int4_amx.h"

#if GEMM_INT4_AMX
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands out the tile registers' state (8 KB a thread) only to processes that ask (arch_prctl). */
enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
/* Input bytes a pass over the blocks keeps in L2 beside one unpacked block (64 bytes a column). */
enum { PASS_BYTES = 512 * 1024 };
/* Tiles (literals, as the intrinsics want): codes of channel tiles c and c + 1, inputs of row tiles t and
   t + 1, and the four products. */
#define CODES0 0
#define CODES1 1
#define ROWS0 2
#define ROWS1 3
#define C00 4
#define C01 5
#define C10 6
#define C11 7

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

int ps_gemm_int4_amx_ready(void) {
    /* Asked once: the answer is the process's for its lifetime (0 unknown, 1 granted, 2 refused). */
    static volatile int granted = 0;
    if (!granted) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : 2;
    return granted == 1;
}

/* kstep columns a tdpbusd: a whole group up to 64, else 64 at a time (groups of 128 and 256). */
static void configure(int64_t kstep) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = CODES0; t <= CODES1; ++t) c.rows[t] = 16, c.colsb[t] = (uint16_t)kstep;
    for (int t = ROWS0; t <= ROWS1; ++t) c.rows[t] = (uint8_t)(kstep / 4), c.colsb[t] = 64;
    for (int t = C00; t <= C11; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* Sixteen vectors of 16 32-bit lanes transposed in place (v[i] lane j <-> v[j] lane i). */
static inline void transpose16(__m512i *v) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4)
        for (int j = 0; j < 2; ++j) {
            v[i + 2 * j] = _mm512_unpacklo_epi64(t[i + j], t[i + j + 2]);
            v[i + 2 * j + 1] = _mm512_unpackhi_epi64(t[i + j], t[i + j + 2]);
        }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; ++j) {
            t[i + j] = _mm512_shuffle_i32x4(v[i + j], v[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(v[i + j], v[i + j + 4], 0xDD);
        }
    for (int j = 0; j < 8; ++j) {
        v[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        v[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xDD);
    }
}

/* One 64-channel block unpacked: each channel's codes (k bytes a channel), and each group's scales and zeros. */
typedef struct {
    uint8_t *codes;            /* [64][k] */
    float *scale, *zero;       /* [groups][64] */
} Block;

static void unpack_block(const GemvInt4 *w, int64_t nb, const Block *b) {
    const QuadShuffle sh = quad_shuffle();
    const uint8_t *p = w->packed + nb * w->k * 32;
    /* 64 columns at a time: 16 quads of 4 channel tiles, each tile's 16 x 16 lanes transposed to channels. */
    for (int64_t k0 = 0; k0 < w->k; k0 += 64) {
        __m512i q[4][16];
        for (int i = 0; i < 16; ++i, p += 128) {
            __m512i v[4];
            unpack_quad(&sh, p, v);
            for (int c = 0; c < 4; ++c) q[c][i] = v[c];
        }
        for (int c = 0; c < 4; ++c) {
            transpose16(q[c]);
            for (int ch = 0; ch < 16; ++ch) _mm512_storeu_si512(b->codes + (16 * c + ch) * w->k + k0, q[c][ch]);
        }
    }
    for (int64_t g = 0; g < w->k / w->group; ++g)
        for (int c = 0; c < 4; ++c) {
            __m512 s, z;
            ps_int4_scale_zero16(w, g, nb * 64 + 16 * c, &s, &z);
            _mm512_storeu_ps(b->scale + g * 64 + 16 * c, s);
            _mm512_storeu_ps(b->zero + g * 64 + 16 * c, z);
        }
}

/* One product tile's sums (channel ch a row, over 16 input rows) scaled into its outputs acc (the same). */
static inline __attribute__((always_inline)) void add_tile(__m512 *acc, int32_t (*sums)[16], const float *scale,
                                                           const float *zero, __m512 xs, __m512 xm) {
#pragma GCC unroll 16
    for (int ch = 0; ch < 16; ++ch) {
        /* scale_group's operations with the roles of the broadcast and the vector swapped: the same products. */
        const __m512 v = _mm512_fmadd_ps(_mm512_set1_ps(zero[ch]), xm, acc[ch]);
        acc[ch] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[ch])),
                                  _mm512_mul_ps(_mm512_set1_ps(scale[ch]), xs), v);
    }
}

/* acc (a channel a vector, 16 rows from r0) transposed into y's rows, channels c0..c0+15; padding not written. */
static void store_tile(__m512 *acc, float *y, int64_t n, int64_t rows, int64_t r0, int64_t c0) {
    transpose16((__m512i *)acc);
    for (int r = 0; r < 16 && r0 + r < rows; ++r) _mm512_storeu_ps(y + (r0 + r) * n + c0, acc[r]);
}

/* Group g's products into the four accumulator tiles: codes of two channel tiles (a0, a1) by two row tiles
   (b0, b1). */
#define GROUP_PRODUCTS(g)                                                                                   \
    do {                                                                                                    \
        _tile_zero(C00);                                                                                    \
        _tile_zero(C01);                                                                                    \
        _tile_zero(C10);                                                                                    \
        _tile_zero(C11);                                                                                    \
        for (int64_t k0 = (g) * group; k0 < ((g) + 1) * group; k0 += kstep) {                               \
            _tile_loadd(CODES0, a0 + k0, k);                                                                \
            _tile_loadd(CODES1, a1 + k0, k);                                                                \
            _tile_loadd(ROWS0, b0 + 16 * k0, 64);                                                           \
            _tile_loadd(ROWS1, b1 + 16 * k0, 64);                                                           \
            _tile_dpbusd(C00, CODES0, ROWS0);                                                               \
            _tile_dpbusd(C01, CODES0, ROWS1);                                                               \
            _tile_dpbusd(C10, CODES1, ROWS0);                                                               \
            _tile_dpbusd(C11, CODES1, ROWS1);                                                               \
        }                                                                                                   \
    } while (0)

/* Row tiles t, t + 1 (rows r0..r0+31) by channel tiles c, c + 1 of block nb, over every group. Group g + 1's
   products are issued before group g's sums are scaled, so the tile unit and the vector units overlap. */
static void four_tiles(const GemvInt4 *w, const Block *b, const uint8_t *xb, const float *xscale,
                       const float *xsum, int64_t rows, int64_t padded, float *y, int64_t nb, int c, int64_t r0) {
    const int64_t k = w->k, group = w->group, groups = k / group, kstep = group < 64 ? group : 64;
    const uint8_t *a0 = b->codes + 16 * c * k, *a1 = a0 + 16 * k;
    const uint8_t *b0 = xb + r0 * k, *b1 = b0 + 16 * k;         /* [k / 4][16 rows][4] a row tile */
    __m512 acc[4][16] __attribute__((aligned(64)));
    int32_t sums[2][4][16][16] __attribute__((aligned(64)));
    memset(acc, 0, sizeof acc);
    GROUP_PRODUCTS(0);
    for (int64_t g = 0; g < groups; ++g) {
        int32_t (*s)[16][16] = sums[g & 1];
        _tile_stored(C00, s[0], 64);
        _tile_stored(C01, s[1], 64);
        _tile_stored(C10, s[2], 64);
        _tile_stored(C11, s[3], 64);
        if (g + 1 < groups) GROUP_PRODUCTS(g + 1);
        const float *scale = b->scale + g * 64 + 16 * c, *zero = b->zero + g * 64 + 16 * c;
        const float *xs = xscale + g * padded + r0, *xm = xsum + g * padded + r0;
        const __m512 xs0 = _mm512_loadu_ps(xs), xs1 = _mm512_loadu_ps(xs + 16);
        const __m512 xm0 = _mm512_loadu_ps(xm), xm1 = _mm512_loadu_ps(xm + 16);
        add_tile(acc[0], s[0], scale, zero, xs0, xm0);
        add_tile(acc[1], s[1], scale, zero, xs1, xm1);
        add_tile(acc[2], s[2], scale + 16, zero + 16, xs0, xm0);
        add_tile(acc[3], s[3], scale + 16, zero + 16, xs1, xm1);
    }
    const int64_t c0 = nb * 64 + 16 * c;
    store_tile(acc[0], y, w->n, rows, r0, c0), store_tile(acc[1], y, w->n, rows, r0 + 16, c0);
    store_tile(acc[2], y, w->n, rows, r0, c0 + 16), store_tile(acc[3], y, w->n, rows, r0 + 16, c0 + 16);
}

int ps_gemm_int4_amx_blocks(const GemvInt4 *w, const uint8_t *xb, const float *xscale, const float *xsum,
                            int64_t rows, int64_t padded, float *y, int64_t nb0, int64_t nb1) {
    if (nb0 >= nb1) return 0;
    const int64_t groups = w->k / w->group;
    int64_t pass = PASS_BYTES / w->k / AMX_PAD_ROWS * AMX_PAD_ROWS;
    pass = pass < AMX_PAD_ROWS ? AMX_PAD_ROWS : pass;
    uint8_t *mem = aligned_alloc(64, (size_t)(64 * w->k) + 2 * sizeof(float) * (size_t)(64 * groups));
    if (!mem) return 1;
    const Block b = {mem, (float *)(mem + 64 * w->k), (float *)(mem + 64 * w->k) + 64 * groups};
    configure(w->group < 64 ? w->group : 64);
    /* Rows in passes of `pass`: a block is unpacked once a pass (a few percent of its multiply-adds). */
    for (int64_t p0 = 0; p0 < padded; p0 += pass)
        for (int64_t nb = nb0; nb < nb1; ++nb) {
            unpack_block(w, nb, &b);
            for (int64_t r0 = p0; r0 < p0 + pass && r0 < padded; r0 += AMX_PAD_ROWS)
                for (int c = 0; c < 4; c += 2) four_tiles(w, &b, xb, xscale, xsum, rows, padded, y, nb, c, r0);
        }
    _tile_release();
    free(mem);
    return 0;
}
#else
int ps_gemm_int4_amx_ready(void) { return 0; }

int ps_gemm_int4_amx_blocks(const GemvInt4 *w, const uint8_t *xb, const float *xscale, const float *xsum,
                            int64_t rows, int64_t padded, float *y, int64_t nb0, int64_t nb1) {
    (void)w, (void)xb, (void)xscale, (void)xsum, (void)rows, (void)padded, (void)y, (void)nb0, (void)nb1;
    return 2;
}
#endif
