/*
 * The thread pool: created once, sized by gqa_set_threads, started on first use and again
 * after a fork (the workers do not survive one), the calling thread working as thread 0.
 * Items are taken from one counter, so which thread runs which item varies from call to call;
 * nothing a thread computes depends on it.
 */
#include "gqa_internal.h"

static struct {
    pthread_mutex_t call_lock; /* one parallel call at a time */
    pthread_mutex_t m;
    pthread_cond_t wake, done;
    pthread_t tids[MAX_THREADS];
    int size;    /* threads in all, the caller included; 0 until set */
    int started; /* workers running (size - 1 once started) */
    int stop;
    uint64_t gen, start_gen;
    task_fn fn;
    void *ctx;
    int64_t nitems;
    atomic_long next;
    int want, finished;
} pool = {.call_lock = PTHREAD_MUTEX_INITIALIZER, .m = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER};

static void run_items(task_fn fn, void *ctx, int64_t nitems, int tid) {
    for (;;) {
        const int64_t item = atomic_fetch_add(&pool.next, 1);
        if (item >= nitems) break;
        fn(ctx, item, tid);
    }
}

static void *pool_worker(void *arg) {
    const int idx = (int)(intptr_t)arg; /* 1 .. started */
    pthread_mutex_lock(&pool.m);
    uint64_t seen = pool.start_gen; /* the generation before its first task, however late it runs */
    for (;;) {
        while (pool.gen == seen && !pool.stop) pthread_cond_wait(&pool.wake, &pool.m);
        if (pool.stop) break;
        seen = pool.gen;
        const int part = idx <= pool.want;
        task_fn fn = pool.fn;
        void *ctx = pool.ctx;
        const int64_t nitems = pool.nitems;
        pthread_mutex_unlock(&pool.m);
        if (part) run_items(fn, ctx, nitems, idx);
        pthread_mutex_lock(&pool.m);
        if (part && ++pool.finished == pool.want) pthread_cond_signal(&pool.done);
    }
    pthread_mutex_unlock(&pool.m);
    return NULL;
}

static void pool_stop_locked(void) { /* call_lock held */
    pthread_mutex_lock(&pool.m);
    pool.stop = 1;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.m);
    for (int i = 0; i < pool.started; i++) pthread_join(pool.tids[i], NULL);
    pool.started = 0;
    pool.stop = 0;
}

static void pool_start_locked(void) { /* call_lock held, no workers running */
    const int want = (pool.size > 0 ? pool.size : 1) - 1;
    pool.start_gen = pool.gen;
    for (int i = 0; i < want && i < MAX_THREADS - 1; i++) {
        if (pthread_create(&pool.tids[i], NULL, pool_worker, (void *)(intptr_t)(i + 1))) break; /* fewer: still correct */
        pool.started = i + 1;
    }
}

static void pool_after_fork_child(void) { /* the workers did not survive the fork */
    pthread_mutex_init(&pool.call_lock, NULL);
    pthread_mutex_init(&pool.m, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.started = 0;
    pool.stop = 0;
}

__attribute__((constructor)) static void pool_init(void) { pthread_atfork(NULL, NULL, pool_after_fork_child); }

GQA_INTERNAL void pool_run(task_fn fn, void *ctx, int64_t nitems, int threads) {
    if (threads <= 1 || nitems <= 1) {
        for (int64_t i = 0; i < nitems; i++) fn(ctx, i, 0);
        return;
    }
    pthread_mutex_lock(&pool.call_lock);
    if (pool.started + 1 < pool.size) {
        if (pool.started) pool_stop_locked();
        pool_start_locked();
    }
    int want = threads - 1;
    if (want > pool.started) want = pool.started;
    if (want > nitems - 1) want = (int)(nitems - 1);
    pthread_mutex_lock(&pool.m);
    pool.fn = fn;
    pool.ctx = ctx;
    pool.nitems = nitems;
    atomic_store(&pool.next, 0);
    pool.want = want;
    pool.finished = 0;
    pool.gen++;
    if (want) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.m);
    run_items(fn, ctx, nitems, 0);
    pthread_mutex_lock(&pool.m);
    while (pool.finished < want) pthread_cond_wait(&pool.done, &pool.m);
    pthread_mutex_unlock(&pool.m);
    pthread_mutex_unlock(&pool.call_lock);
}

int gqa_set_threads(int n) {
    if (n < 1 || n > MAX_THREADS) return -EINVAL;
    pthread_mutex_lock(&pool.call_lock);
    if (pool.started) pool_stop_locked();
    pool.size = n;
    pthread_mutex_unlock(&pool.call_lock);
    return 0;
}

int gqa_threads(void) { return pool.size > 0 ? pool.size : 1; }
