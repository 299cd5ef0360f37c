/* 5- and 6-bit weight-only GEMM (gemm_intn.c): GGUF Q5_0 / Q5_1 / Q5_K / Q6_K layers at their own width. */
#ifndef PAGEDSERVE_GEMM_INTN_H
#define PAGEDSERVE_GEMM_INTN_H

#include "gemv.h"

/* The pack (kernels/weights/weight_intn.py writes it): per 64-channel block and pair of input columns (2i, 2i + 1) one
   record of 64 + 16 * (bits - 4) bytes. Its first 64 are torch's int4 pack of the two columns (each column's
   32 bytes: channel j's low four bits in the low nibble of byte j, channel j + 32's in the high one); then a
   plane per further bit, four little-endian uint32 each, word c's bit 2j + t being that bit of channel
   16c + j at column 2i + t: the order in which vpdpwssd's operands hold the pair's int16 codes, so one masked
   add puts a plane's bit in place. w = (q - 2^(bits-1)) * scale + zero per group of input columns, the scales
   as the int4 pack's ([k / group, n, sz_form] bfloat16, zero stored where sz_form is SZ_PAIRS; no SZ_K). */
typedef struct {
    const uint8_t *packed;
    const uint16_t *sz;
    int64_t n, k, group, sz_form, bits;
} GemvIntN;

static inline int64_t ps_intn_record_bytes(int64_t bits) { return 64 + 16 * (bits - 4); }

/* 1 where this build has the kernels below (AVX512-VNNI, -VBMI and -BW); elsewhere they return 2 and the
   loader keeps such layers as int8 (kernels/weights/weight_intn.py). */
int ps_gemm_intn_built(void);

/* One thread's share (64-channel blocks nb0..nb1-1) of y [rows, n] = x [rows, k] @ w^T for any number of rows
   (the decode step's), x rounded to int16 here as gemm_int4.c rounds it. 0 on success, 2 where it does not
   apply, 1 out of memory. */
int ps_gemm_intn_part(const GemvIntN *w, const float *x, int64_t rows, float *y, int64_t nb0, int64_t nb1);

#endif
