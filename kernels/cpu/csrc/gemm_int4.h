/* int4 weight-only GEMM with int16 inputs and integer dot products (gemm_int4.c). */
#ifndef PAGEDSERVE_GEMM_INT4_H
#define PAGEDSERVE_GEMM_INT4_H

#include "gemm_driver.h"
#include "gemv.h"

/* Rows g->a..g->b-1 of x as int16, one scale per row (round to nearest), and each group's sum of the rounded
   values: the rounding of this file's GEMM and of the 5/6-bit one (gemm_intn.c). */
void ps_round_int16(const GemmRun *g);

/* A product over inputs rounded by ps_round_int16: `blocks` multiplies the codes of w. */
static inline GemmRun ps_int16_run(const void *w, int64_t n, int64_t k, int64_t group, const float *x, int64_t rows,
                                   float *y, int (*blocks)(const GemmRun *)) {
    return (GemmRun){.w = w, .n = n, .k = k, .group = group, .rows = rows, .padded = rows, .cleared_from = rows,
                     .x_bytes = 2, .scale_per_group = 0, .round = ps_round_int16, .blocks = blocks,
                     .in = {.x = x}, .y = y};
}

/* 1 where this build has the kernel (AVX512-VNNI); elsewhere the calls below return 2. */
int ps_gemm_int4_vectorized(void);

/* Rows from which it pays. Without AVX512-VBMI a row or two stream the weights faster through the float
   GEMV (gemv_int4.c), which reads each code once, than through the tile this kernel unpacks them into
   (docs/cpu_performance.md, the embedded model's 30 layers: 0.65-0.84x the GEMV's speed at 1 row, 0.88-1.02x
   at 2, 1.08-1.11x at 4). With it, 1-3 rows unpack each pair of columns with two byte shuffles straight
   into the dot products, and take half the float GEMV's instructions (issue 25). */
#ifdef __AVX512VBMI__
enum { GEMM_INT4_MIN_ROWS = 1 };
#else
enum { GEMM_INT4_MIN_ROWS = 4 };
#endif
int ps_gemm_int4_min_rows(void);

/* One thread's share (64-channel blocks nb0..nb1-1) of y [rows, n] = x [rows, k] @ w^T, x rounded here:
   for the decode step's rows (from GEMM_INT4_MIN_ROWS; on the stack up to 144 KB of rounded rows). 0 on
   success, 2 where it does not apply (fewer rows included: the caller's GEMV serves them), 1 out of memory. */
int ps_gemm_int4_part(const GemvInt4 *w, const float *x, int64_t rows, float *y, int64_t nb0, int64_t nb1);

/* The whole product for any number of rows, on `threads` OpenMP threads: 0 on success, 2 where it does not
   apply (the caller keeps its other paths), 1 when out of memory. */
int ps_gemm_int4(const uint8_t *packed, const uint16_t *sz, int64_t sz_form, int64_t n, int64_t k, int64_t group,
                 const float *x, int64_t rows, float *y, int threads);

#endif
