/* Weight-only GEMV over the packed layouts of kernels/weight_only.py (gemv.c). */
#ifndef PAGEDSERVE_GEMV_H
#define PAGEDSERVE_GEMV_H

#include "common.h"

enum { GEMV_MAX_ROWS = 8 };    /* input rows one call takes: each row's sums stay in registers / L1 */

typedef struct {
    const uint8_t *packed;     /* torch's CPU int4 pack: [n / 64, k, 32] */
    const uint16_t *sz;        /* bfloat16 [k / group, n, 2]: scale, zero */
    int64_t n, k, group;
} GemvInt4;

typedef struct {
    const int8_t *q;           /* [chunks, n, chunk] */
    const uint16_t *scale;     /* bfloat16 [chunks, n] */
    int64_t chunks, n, chunk;
} GemvInt8;

/* One thread's share: output blocks of 64 channels nb0..nb1-1 (int4), output channels r0..r1-1 (others).
   x [rows, k] and y [rows, n] are float32, row-major. */
void ps_gemv_int4_blocks(const GemvInt4 *w, const float *x, int64_t rows, float *y, int64_t nb0, int64_t nb1);
void ps_gemv_int8_rows(const GemvInt8 *w, const float *x, int64_t rows, float *y, int64_t r0, int64_t r1);

#endif
