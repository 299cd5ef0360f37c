/* The driver every integer weight-only GEMM runs under (gemm_driver.c): its inputs rounded, then its 64-channel
   blocks multiplied. gemm_blocks.h has the block loops; a format's file (gemm_int4.c, gemm_intn.c,
   gemm_int4_s8.c) holds only how its inputs are rounded and how its codes are unpacked and multiplied. */
#ifndef PAGEDSERVE_GEMM_DRIVER_H
#define PAGEDSERVE_GEMM_DRIVER_H

#include "common.h"

/* Group sizes up to 256 (kernels/weight_only.INT4_GROUP_SIZES): a group's unpacked codes fill an L1 tile. */
enum { GEMM_MAX_GROUP = 256 };
/* Bytes ahead of the codes being read that the int4 forms' register-unpacked passes (gemm_blocks.h's
   few_rows) prefetch: the stream of one 64-channel block. On the 1.7B model 2048 ran 27-32 ms a token and
   4160 / 8256 19-20 in the same minutes (issue 25, the 2-core EPYC VM, whose read bandwidth itself switches
   between ~43 and ~72 GiB/s phases: compare within one). */
enum { FEW_ROWS_PREFETCH = 4160 };

/* Inputs rounded to integers: what every thread's blocks read. */
typedef struct {
    const float *x;            /* [rows, k] float32 */
    void *xq;                  /* [padded, k] of x_bytes each (or the layout the format's blocks read) */
    float *xscale;             /* [padded] or, scale_per_group, [padded * groups] */
    float *xsum;               /* [padded * groups]: each group's sum of the rounded inputs times its scale */
} Rounded;

typedef struct GemmRun GemmRun;
struct GemmRun {
    const void *w;                      /* the format's weight */
    int64_t n, k, group;
    int64_t rows;
    /* Rows the buffers hold (rows, or more where the blocks read whole tiles) and the first whose rounded
       bytes the driver clears: the padding, and rows that share its tiles. The sums of padding rows are 0. */
    int64_t padded, cleared_from;
    int x_bytes, scale_per_group;
    /* Called once a thread (no function pointer reaches an inner loop): round rows a..b-1, then multiply
       blocks a..b-1 (0, or 1 out of memory). */
    void (*round)(const GemmRun *);
    int (*blocks)(const GemmRun *);
    Rounded in;
    float *y;                           /* [rows, n] */
    int64_t a, b;
};

/* The whole product on `threads` OpenMP threads: the rows rounded split between them, then the blocks.
   0 on success, 1 out of memory. */
int ps_gemm_threads(GemmRun g, int threads);

/* One thread's share (blocks nb0..nb1-1) with every row rounded by it, into its own stack (144 KB at most,
   past it the heap: a decode step of 16-32 rows at a wide down_proj). 0 on success, 1 out of memory. */
int ps_gemm_part(GemmRun g, int64_t nb0, int64_t nb1);

#endif
