/* ps_run_split on OpenMP threads. The library is linked with -fopenmp against libgomp.so.1, the soname of the
   runtime torch already loaded, so the dynamic linker binds it to torch's copy: one thread pool for torch's
   ops and ours. With a pool of our own (condition-variable workers, before), our worker and torch's
   OpenMP worker, still spin-waiting after a torch op, fought over the second core: a batch-2 decode step took
   12.4 ms instead of 7.4 (docs/cpu_performance.md), and waking a sleeping worker cost ~30 us a call. */
#include <omp.h>

#include "common.h"

int ps_run_split(int threads, int64_t total, void *jobs, size_t job_size, void *(*fn)(void *),
                 void (*set_range)(void *, int64_t, int64_t)) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > total) threads = (int)total;
    if (threads < 1) threads = 1;
    const int64_t step = (total + threads - 1) / threads;
    for (int t = 0; t < threads; ++t) {
        int64_t a = t * step < total ? t * step : total, b = a + step < total ? a + step : total;
        set_range((char *)jobs + (size_t)t * job_size, a, b);
    }
    int failed = 0;
    /* The runtime may give fewer threads than asked: each runs every job its index stands for. */
#pragma omp parallel num_threads(threads) reduction(| : failed)
    for (int t = omp_get_thread_num(); t < threads; t += omp_get_num_threads())
        failed |= fn((char *)jobs + (size_t)t * job_size) != NULL;
    return failed;
}
