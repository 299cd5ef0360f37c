/* Paged decode attention (decode_attention.c): one query token per sequence, the cache read in place. */
#ifndef PAGEDSERVE_DECODE_ATTENTION_H
#define PAGEDSERVE_DECODE_ATTENTION_H

#include "common.h"

enum { MAX_GROUP = 16, MAX_HEAD_DIM = 256, MAX_BLOCK = 128 };

typedef struct {
    const float *q;              /* [n, hq, d] */
    const void *k, *v;           /* [num_blocks, hkv, block_size, d], float32 or bfloat16 */
    const int32_t *tables;       /* [n, table_stride] block ids */
    const int32_t *lens;         /* [n] context lengths, this step's token included */
    float *out;                  /* [n, hq, d] */
    int64_t hq, hkv, block_size, d, table_stride, t0, t1;
    float scale;
    int bf16;
} DecodeJob;

/* Sequence seq's query heads that share KV head `head`: one (sequence, KV head) task. */
void ps_decode_task(const DecodeJob *j, int64_t seq, int64_t head);

/* 1 where this build has vector loops for the usual head sizes (AVX-512: d % 64 == 0; AVX2: d % 32 == 0). */
int ps_decode_attention_vectorized(void);

#endif
