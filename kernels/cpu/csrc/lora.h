/* LoRA's delta on CPU (lora.c): the per-token kernel of the layer path and the decode step's two phases. */
#ifndef PAGEDSERVE_LORA_H
#define PAGEDSERVE_LORA_H

#include <stdint.h>

/* One linear layer's adapter slots, as executor/model/layers/lora.py keeps them (float32, or bfloat16 where
   bf16; scaling folded into B): per slot, A [wmax, in] (the pieces' A stacked) and B transposed [wmax, out],
   piece p's rows p*r..(p+1)*r nonzero only in its output columns bounds[p]..bounds[p+1]. widths[s] is
   pieces * r of the adapter in slot s (0: empty), r <= wmax / pieces. a == NULL: the layer has no slots. */
typedef struct {
    const void *a, *b_t;
    const int64_t *widths, *bounds;
    int64_t pieces, wmax, bf16;
} LoraDesc;

/* The decode step's LoRA of one linear (decode_step.c), in two phases its team of threads runs with a barrier
   between: this thread's share of xa [rows, wmax] = x A^T for the rows whose slot >= 0 (each row's width
   split over the threads), then its share of the output columns of y += xa B. A row's arithmetic is the same
   whatever rows run beside it; rows of slot -1 are not read or written. */
void ps_lora_step_shrink(const LoraDesc *l, const float *x, int64_t in, const int32_t *slots, int64_t rows,
                         float *xa, int tid, int threads);
void ps_lora_step_expand(const LoraDesc *l, const float *xa, const int32_t *slots, int64_t rows, float *y,
                         int64_t out, int tid, int threads);

#endif
