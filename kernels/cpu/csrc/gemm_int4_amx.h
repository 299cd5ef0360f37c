/* The int8-input int4 GEMM's many-row tile on Intel AMX (gemm_int4_amx.c). */
#ifndef PAGEDSERVE_GEMM_INT4_AMX_H
#define PAGEDSERVE_GEMM_INT4_AMX_H

#include "int4_quads.h"

#if GEMM_INT4_S8 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define GEMM_INT4_AMX 1
#else
#define GEMM_INT4_AMX 0
#endif

/* Input rows a tile holds, and the multiple the caller pads its rows to (a step takes two row tiles). */
enum { AMX_TILE_ROWS = 16, AMX_PAD_ROWS = 32 };
/* Rows from which a call takes the AMX tile (below it the padding would cost more than it saves). */
enum { AMX_MIN_ROWS = 16 };

/* 1 where this build has the kernel and the kernel lets this process use the tile registers (Linux grants
   them on request, asked once per process); 0 elsewhere. */
int ps_gemm_int4_amx_ready(void);

/* y [rows, n] for 64-channel blocks nb0..nb1-1 (one thread's share). xb: the inputs rounded to int8 as
   gemm_int4_s8.c rounds them, rows padded with zeros to `padded` (a multiple of AMX_PAD_ROWS), each 16-row
   tile laid out four columns at a time: byte (r % 16) * 4 + c % 4 of line c / 4 of tile r / 16 (one line is
   a row of tdpbusd's second tile). xscale / xsum as that file's but [k / group, padded] (a group's rows side by
   side; zero for the padding). Only the first `rows` rows of y are written, with the very bits the VNNI tile
   gives them. 0, or 1 out of memory. */
int ps_gemm_int4_amx_blocks(const GemvInt4 *w, const uint8_t *xb, const float *xscale, const float *xsum,
                            int64_t rows, int64_t padded, float *y, int64_t nb0, int64_t nb1);

#endif
