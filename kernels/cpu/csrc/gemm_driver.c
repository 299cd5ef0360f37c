/* The integer GEMMs' driver (gemm_driver.h): buffers for the rounded inputs, then the rows rounded and the
   blocks multiplied, split over threads or on the caller's thread alone. */
#include <stdlib.h>

#include "gemm_driver.h"

static int64_t sums_floats(const GemmRun *g) {
    const int64_t groups = g->k / g->group;
    return g->padded * ((g->scale_per_group ? groups : 1) + groups);
}

/* Points g's buffers at xq and sums, and clears what padding the blocks read. */
static void place(GemmRun *g, void *xq, float *sums) {
    g->in = (Rounded){g->in.x, xq, sums, sums + g->padded * (g->scale_per_group ? g->k / g->group : 1)};
    if (g->padded > g->rows) {
        const int64_t row_bytes = g->k * g->x_bytes;
        memset((char *)xq + g->cleared_from * row_bytes, 0, (size_t)((g->padded - g->cleared_from) * row_bytes));
        memset(sums, 0, sizeof(float) * (size_t)sums_floats(g));
    }
}

int ps_gemm_part(GemmRun g, int64_t nb0, int64_t nb1) {
    enum { STACK_BYTES = 131072, STACK_SUMS = 4096 };
    const int64_t bytes = g.padded * g.k * g.x_bytes, floats = sums_floats(&g);
    const int heap = bytes > STACK_BYTES || floats > STACK_SUMS;
    uint64_t on_stack[heap ? 1 : STACK_BYTES / 8];
    float sums_on_stack[heap ? 1 : STACK_SUMS];
    void *xq = heap ? malloc((size_t)bytes) : on_stack;
    float *sums = heap ? malloc(sizeof(float) * (size_t)floats) : sums_on_stack;
    int status = 1;
    if (xq && sums) {
        place(&g, xq, sums);
        g.a = 0;
        g.b = g.rows;
        g.round(&g);
        g.a = nb0;
        g.b = nb1;
        status = g.blocks(&g);
    }
    if (heap) {
        free(xq);
        free(sums);
    }
    return status;
}

static void *round_job(void *arg) {
    const GemmRun *g = (const GemmRun *)arg;
    g->round(g);
    return NULL;
}

static void *blocks_job(void *arg) {
    const GemmRun *g = (const GemmRun *)arg;
    return g->blocks(g) ? arg : NULL;
}

static void set_range(void *job, int64_t a, int64_t b) { ((GemmRun *)job)->a = a; ((GemmRun *)job)->b = b; }

int ps_gemm_threads(GemmRun g, int threads) {
    void *xq = malloc((size_t)(g.padded * g.k * g.x_bytes));
    float *sums = malloc(sizeof(float) * (size_t)sums_floats(&g));
    int rc = 1;
    if (xq && sums) {
        place(&g, xq, sums);
        /* ps_run_split takes at most `threads` jobs (and MAX_THREADS): only those are filled, a copy each. */
        const int used = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
        GemmRun jobs[MAX_THREADS];
        for (int t = 0; t < used; ++t) jobs[t] = g;
        rc = ps_run_split(threads, g.rows, jobs, sizeof(GemmRun), round_job, set_range);
        if (!rc) rc = ps_run_split(threads, g.n / 64, jobs, sizeof(GemmRun), blocks_job, set_range);
    }
    free(xq);
    free(sums);
    return rc;
}
