/* The thread pool behind ps_run_split: workers start at first use and then wait on a condition variable
   between calls. A forked child starts with no workers (pthread_atfork), so it builds its own. */
#include <stdint.h>

#include "common.h"

static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;     /* one parallel call at a time */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;            /* guards everything below */
static pthread_cond_t go = PTHREAD_COND_INITIALIZER, done = PTHREAD_COND_INITIALIZER;
static int workers, remaining, failed, jobs_now, fork_hook;
static unsigned long generation;
static void *(*task)(void *);
static char *task_jobs;
static size_t task_size;

static void *worker_main(void *arg) {
    int index = (int)(intptr_t)arg;                 /* worker i runs job i; the caller runs the last job */
    unsigned long seen = 0;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (generation == seen) pthread_cond_wait(&go, &mu);
        seen = generation;
        if (index >= jobs_now - 1) continue;        /* not needed by this call */
        void *(*fn)(void *) = task;
        char *job = task_jobs + (size_t)index * task_size;
        pthread_mutex_unlock(&mu);
        void *ret = fn(job);
        pthread_mutex_lock(&mu);
        failed |= ret != NULL;
        if (--remaining == 0) pthread_cond_signal(&done);
    }
    return NULL;
}

static void after_fork_in_child(void) {
    pthread_mutex_t fresh_mutex = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t fresh_cond = PTHREAD_COND_INITIALIZER;
    call_lock = fresh_mutex;
    mu = fresh_mutex;
    go = fresh_cond;
    done = fresh_cond;
    workers = 0;
    generation = 0;
}

static int start_workers(int wanted) {              /* called with mu held; returns the workers running */
    if (!fork_hook) fork_hook = pthread_atfork(NULL, NULL, after_fork_in_child) == 0;
    while (workers < wanted) {
        pthread_t tid;
        if (pthread_create(&tid, NULL, worker_main, (void *)(intptr_t)workers) != 0) break;
        pthread_detach(tid);
        ++workers;
    }
    return workers;
}

int ps_pool_reserve(int threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1) return 1;
    pthread_mutex_lock(&mu);
    int running = start_workers(threads - 1);
    pthread_mutex_unlock(&mu);
    return threads < running + 1 ? threads : running + 1;
}

int ps_run_split(int threads, int64_t total, void *jobs, size_t job_size, void *(*fn)(void *),
                 void (*set_range)(void *, int64_t, int64_t)) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > total) threads = (int)total;
    if (threads < 1) threads = 1;
    pthread_mutex_lock(&call_lock);
    pthread_mutex_lock(&mu);
    if (threads > 1) {
        int running = start_workers(threads - 1);
        if (threads > running + 1) threads = running + 1;
    }
    int64_t step = (total + threads - 1) / threads;
    for (int t = 0; t < threads; ++t) {
        int64_t a = t * step < total ? t * step : total, b = a + step < total ? a + step : total;
        set_range((char *)jobs + (size_t)t * job_size, a, b);
    }
    task = fn;
    task_jobs = (char *)jobs;
    task_size = job_size;
    jobs_now = threads;
    remaining = threads - 1;
    failed = 0;
    if (threads > 1) {
        ++generation;
        pthread_cond_broadcast(&go);
    }
    pthread_mutex_unlock(&mu);
    void *ret = fn((char *)jobs + (size_t)(threads - 1) * job_size);
    pthread_mutex_lock(&mu);
    while (remaining > 0) pthread_cond_wait(&done, &mu);
    int result = failed || ret != NULL;
    pthread_mutex_unlock(&mu);
    pthread_mutex_unlock(&call_lock);
    return result;
}
