/* The int4 GEMM's int8-input form (gemm_int4_s8.c): codes as unsigned bytes times inputs as signed bytes. */
#ifndef PAGEDSERVE_GEMM_INT4_S8_H
#define PAGEDSERVE_GEMM_INT4_S8_H

#include "gemv.h"

/* vpdpbusd (VNNI) takes the bytes, vpermt2b (VBMI) lays four columns' codes side by side. */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define GEMM_INT4_S8 1
#else
#define GEMM_INT4_S8 0
#endif

/* 1 where this build has it; elsewhere ps_gemm_int4_s8 returns 2. */
int ps_gemm_int4_s8_built(void);

/* y [rows, n] = x [rows, k] @ w^T over torch's CPU int4 pack (ps_gemm_int4's arguments), x rounded to int8
   per row and group (max |x| / 127 each, round to nearest even), on `threads` OpenMP threads: 0 on success,
   2 for shapes it does not take (or no build), 1 when out of memory. A row's outputs depend on that row
   alone: the 1-3-row form and the tile sum every row in one order, whatever `rows` is. */
int ps_gemm_int4_s8(const uint8_t *packed, const uint16_t *sz, int64_t sz_stride, int64_t n, int64_t k,
                    int64_t group, const float *x, int64_t rows, float *y, int threads);

#endif
