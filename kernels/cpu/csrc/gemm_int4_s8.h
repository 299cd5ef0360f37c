/* The int4 GEMM's int8-input form (gemm_int4_s8.c): codes as unsigned bytes times inputs as signed bytes. */
#ifndef PAGEDSERVE_GEMM_INT4_S8_H
#define PAGEDSERVE_GEMM_INT4_S8_H

#include "int4_quads.h"

/* 1 where this build has it; elsewhere ps_gemm_int4_s8 returns 2. */
int ps_gemm_int4_s8_built(void);

/* y [rows, n] = x [rows, k] @ w^T over torch's CPU int4 pack (ps_gemm_int4's arguments), x rounded to int8
   per row and group (max |x| / 127 each, round to nearest even), on `threads` OpenMP threads: 0 on success,
   2 for shapes it does not take (or no build), 1 when out of memory. A row's outputs depend on that row
   alone: the 1-3-row form and the tile sum every row in one order, whatever `rows` is. */
int ps_gemm_int4_s8(const uint8_t *packed, const uint16_t *sz, int64_t sz_form, int64_t n, int64_t k,
                    int64_t group, const float *x, int64_t rows, float *y, int threads);

/* 1 where ps_gemm_int4_s8 multiplies AMX_MIN_ROWS rows and more on AMX tiles (gemm_int4_amx.h). */
int ps_gemm_int4_s8_amx(void);

/* ps_gemm_int4_s8 on the VNNI tiles alone, for any rows: the AMX tile's reference, bit for bit. */
int ps_gemm_int4_s8_vnni(const uint8_t *packed, const uint16_t *sz, int64_t sz_form, int64_t n, int64_t k,
                         int64_t group, const float *x, int64_t rows, float *y, int threads);

#endif
