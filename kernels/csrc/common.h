/* What the CPU kernels share: bfloat16 conversions and a split of a loop over a few threads. */
#ifndef PAGEDSERVE_COMMON_H
#define PAGEDSERVE_COMMON_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch's cast does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define MAX_THREADS 64

/* Splits [0, total) into at most `threads` ranges (set_range fills job i's) and runs fn on every job, on
   OpenMP threads (parallel.c). Returns nonzero if any job did. */
int ps_run_split(int threads, int64_t total, void *jobs, size_t job_size, void *(*fn)(void *),
                 void (*set_range)(void *, int64_t, int64_t));

#endif
