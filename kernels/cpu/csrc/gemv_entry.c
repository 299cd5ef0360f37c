/* The GEMVs' entry points (kernels/weights/weight_only.py calls them through ctypes): each call split over
torch's OpenMP threads (parallel.c) by output blocks, and what this build has a vector path for. The loops
are gemv_int4.c's, gemv_int8.c's and gemv_avx2.c's. */
#include "gemv.h"

typedef struct {
    const GemvInt4 *i4;
    const GemvInt8 *i8;
    const float *x;
    float *y;
    int64_t rows, a, b;
} GemvJob;

static void *gemv_job(void *arg) {
    const GemvJob *j = (const GemvJob *)arg;
    if (j->i4) {
        /* GEMV_MAX_ROWS rows at a time (the decode step's loop too): a row's sums never depend on how many
           rows share its call, so a prompt's row gets the same bits in any chunk (docs/determinism.md) */
        for (int64_t t = 0; t < j->rows; t += GEMV_MAX_ROWS)
            ps_gemv_int4_blocks(j->i4, j->x + t * j->i4->k, j->rows - t < GEMV_MAX_ROWS ? j->rows - t : GEMV_MAX_ROWS,
                                j->y + t * j->i4->n, j->a, j->b);
    } else ps_gemv_int8_rows(j->i8, j->x, j->rows, j->y, j->a, j->b);
    return NULL;
}

static void gemv_range(void *job, int64_t a, int64_t b) { ((GemvJob *)job)->a = a; ((GemvJob *)job)->b = b; }

/* Both take any number of rows: int4 GEMV_MAX_ROWS at a time over a thread's blocks (its sums live in registers),
   int8 four rows at a time over each block's codes; weight_only.py says up to where each beats the other kernels. */
static int run_gemv(const GemvInt4 *i4, const GemvInt8 *i8, const float *x, int64_t rows, float *y, int64_t units,
                    int threads) {
    if (rows < 1) return 2;
    GemvJob jobs[MAX_THREADS];
    for (int t = 0; t < MAX_THREADS; ++t) jobs[t] = (GemvJob){i4, i8, x, y, rows, 0, 0};
    return ps_run_split(threads, units, jobs, sizeof(GemvJob), gemv_job, gemv_range);
}

/* y [rows, n] = x [rows, k] @ w^T; 0 on success, 2 for shapes these kernels do not take. */
int ps_gemv_int4(const uint8_t *packed, const uint16_t *sz, int64_t sz_form, int64_t layout, int64_t n, int64_t k,
                 int64_t group, const float *x, int64_t rows, float *y, int threads) {
    if (n % 64 || group <= 0 || k % group || !ps_int4_sz_takes(sz_form, k, group) || !ps_int4_pack_takes(layout))
        return 2;
    GemvInt4 w = {packed, sz, n, k, group, sz_form, layout};
    return run_gemv(&w, NULL, x, rows, y, n / 64, threads);
}

int ps_gemv_int8(const int8_t *q, const uint16_t *scale, int64_t chunks, int64_t n, int64_t chunk, const float *x,
                 int64_t rows, float *y, int threads) {
    GemvInt8 w = {q, scale, chunks, n, chunk};
    return run_gemv(NULL, &w, x, rows, y, n, threads);
}

/* What the GEMVs above were built with a vector path for (the portable loops are slower than torch's own
   kernels, so callers only choose these where these say so): the int4 pack forms, then int8. The AVX-512 int4
   path is counted with gemv_int8.c's (AVX512BW/VL), as the one flag these replace counted them. */
int ps_gemv_int4_layouts(void) {
    return (GEMV_INT8_AVX512 ? 1 << PACK_AVX512 : 0) | (GEMV_INT4_AVX2 ? 1 << PACK_AVX2 : 0);
}

int ps_gemv_int8_vectorized(void) { return GEMV_INT8_AVX512 || GEMV_INT8_AVX2; }
