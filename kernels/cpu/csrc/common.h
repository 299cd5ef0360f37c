/* What the CPU kernels share: bfloat16 and half conversions and a split of a loop over a few threads. */
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

/* IEEE half to float, exactly (subnormals included); GGUF's super-scales are halves. */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t u;
    if (exp == 0x1Fu) {
        u = sign | 0x7F800000u | (man << 13);                        /* inf, nan */
    } else if (exp) {
        u = sign | ((exp + 112u) << 23) | (man << 13);              /* normal: rebias 15 -> 127 */
    } else {                                                         /* zero or subnormal: man * 2^-24 */
        float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#define MAX_THREADS 64

/* Splits [0, total) into at most `threads` ranges (set_range fills job i's) and runs fn on every job, on
   OpenMP threads (parallel.c). Returns nonzero if any job did. */
int ps_run_split(int threads, int64_t total, void *jobs, size_t job_size, void *(*fn)(void *),
                 void (*set_range)(void *, int64_t, int64_t));

#endif
