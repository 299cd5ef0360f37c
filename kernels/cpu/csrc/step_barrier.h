/* The decode step's barrier between phases (decode_step.c), and what a thread that arrives first does while it
   waits: it pulls the start of its share of the next linear's weights into L2. */
#ifndef PAGEDSERVE_STEP_BARRIER_H
#define PAGEDSERVE_STEP_BARRIER_H

#include <sched.h>
#include <stdint.h>

typedef struct {
    int count, sense;
} Barrier;

/* A sense-reversing spin barrier: the team's threads are busy with this step alone, and libgomp's own
   barrier cost ~1 ms more per step at batch 1 (270 barriers a step). Past SPINS_BEFORE_YIELD a waiting
   thread yields: on a busy machine the thread it waits for may be off its core. */
enum { SPINS_BEFORE_YIELD = 1 << 14 };

/* The bytes of the weights a thread reads next that a wait at a barrier may pull into L2 ahead of the GEMV
   (next: where they start; left: how many are not yet asked for). */
typedef struct {
    const char *next;
    int64_t left;
    const void *target;        /* the LinearDesc they belong to */
} Ahead;

static inline void barrier_wait_ahead(Barrier *b, int threads, int *sense, Ahead *ahead) {
    if (threads == 1) return;
    const int mine = *sense = !*sense;
    if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == threads) {
        __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->sense, mine, __ATOMIC_RELEASE);
        return;
    }
    for (int spins = 0; __atomic_load_n(&b->sense, __ATOMIC_ACQUIRE) != mine; ++spins) {
        if (ahead && ahead->left > 0) {
            for (int i = 0; i < 4; ++i) __builtin_prefetch(ahead->next + 64 * i, 0, 2);
            ahead->next += 256;
            ahead->left -= 256;
        } else if (spins > SPINS_BEFORE_YIELD) {
            sched_yield();
        }
#if defined(__x86_64__)
        else __builtin_ia32_pause();
#endif
    }
}

static inline void barrier_wait(Barrier *b, int threads, int *sense) { barrier_wait_ahead(b, threads, sense, NULL); }

#endif
