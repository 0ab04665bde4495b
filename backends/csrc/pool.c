/*
 * The thread pool: created once, sized by gqa_set_threads, started on first use and again
 * after a fork (the workers do not survive one), the calling thread working as thread 0.
 * Items are claimed from one counter, so which thread runs which item varies from call to call;
 * nothing a thread computes depends on it.
 *
 * Items are taken from both ends, a run of consecutive items a claim: the caller's runs
 * ascending from the front, the workers' descending from the back, meeting wherever the work
 * divides. A thread runs a run's items in ascending order, so its next item is known (the one
 * after, or the next run's first as the counter stands) and an item can fetch the first block of
 * the next one while it computes its own last (attend.c): a long cache's items are a head's
 * consecutive splits, and each thread reads one stream through them instead of starting a fresh
 * one at every item (docs/design.md, "Items from both ends"). A claim takes a share of what is
 * left (guided self-scheduling), at most the call's `chunk`: long runs while there is much to
 * do, single items where the threads meet, so that neither waits long for the other's last run
 * (docs/design.md, "Runs of items that shrink as the call ends").
 *
 * A call ends when its items are done, not when every worker has answered: the caller starts on
 * the items at once, and a worker that wakes late (a sleeping thread takes 20 us to milliseconds
 * to run again on this VM, longer when the core is shared) finds them taken and costs nothing.
 * So that such a worker can never take an item of a later call with the earlier call's
 * arguments, the counter carries the call's generation in its high 32 bits: an item is claimed
 * (compare-and-swap) only while the counter is still its own call's.
 *
 * Each worker is kept on a CPU of its own, not the caller's (worker i on the i-th allowed CPU
 * after the caller's, set again when the caller is seen on another CPU). Left to the scheduler,
 * a worker woken by the caller was often queued on the caller's own CPU while the other one
 * idled, and the two then took turns there for the whole call: the load balancer does not move
 * a task that ran a moment ago (docs/design.md, "The pool's workers on the caller's CPU").
 *
 * A caller that knows a parallel call is coming (the public step, before its Python checks)
 * alerts the workers first (pool_prewake): each then waits for the call awake, for up to
 * PREWAKE_SPIN_NS, instead of asleep, so that the call finds it running rather than paying its
 * wake-up (docs/design.md, "The workers woken before the call").
 *
 * Both waits that spin (an alerted worker's for its call, the caller's for the workers' last
 * items) yield the CPU every few microseconds: a Batch server whose clients share its two cores
 * spent ~290 us of CPU per 64-sequence message in the worker's wait, and served 14% more
 * messages a second once that wait yielded (docs/design.md, "Waits that yield").
 *
 * One call has the workers at a time. A call that finds them taken runs its items on its own
 * thread: waiting for the pool would leave that thread idle while the other call's threads
 * hold every CPU, and a server's compute threads stepping side by side lost ~5% of their
 * throughput that way (docs/design.md, "Short caches on both threads").
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>

#include "gqa_internal.h"

static struct {
    pthread_mutex_t call_lock; /* one parallel call at a time (the others run alone) */
    pthread_mutex_t m;
    pthread_cond_t wake, done;
    pthread_t tids[MAX_THREADS];
    int size;    /* threads in all, the caller included; 0 until set */
    int started; /* workers running (size - 1 once started) */
    int stop;
    uint64_t gen, start_gen;
    uint64_t alert;            /* pool_prewake's count: a worker that sees it change wakes */
    atomic_ullong published;   /* gen, for workers that poll it without the mutex */
    task_fn fn;
    void *ctx;
    int64_t nitems, chunk; /* the call's items, and the most one claim takes */
    atomic_ullong next; /* (gen mod 2^32) << 32 | the items of that call claimed so far */
    atomic_llong front, back; /* the next item from the front; one past the next from the back */
    atomic_llong completed; /* items of the current call done: the workers add under m (their
                               last one signals `done`), the caller adds and spins without it */
    int want;
    cpu_set_t allowed;  /* the CPUs of the thread that started the workers (theirs too) */
    int nallowed;
    int placed_for; /* the caller's CPU the workers were last placed away from; -1: none */
} pool = {.call_lock = PTHREAD_MUTEX_INITIALIZER, .m = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER};

/* How many items a claim takes when `left` are unclaimed and `threads` share the call: a share
 * of them that shrinks with them, from `chunk` down to one. */
static int64_t claim_size(int64_t left, int threads, int64_t chunk) {
    const int64_t share = (left + 2 * threads - 1) / (2 * threads);
    return share > chunk ? chunk : share < 1 ? 1 : share;
}

/* Runs items of the call of generation `gen` while it has some left; returns how many. A claim
 * (k more of the call's items, while its generation holds) is the right to take k items: the
 * caller's from the front, the workers' from the back. Claims never exceed the items, so the
 * two ends never take the same one. Each item runs with the item this thread runs next: the one
 * after it in its run, or, after a run's last, where the next claim would start as the counter
 * stands now (a guess at the call's end: the other end may take it first). */
static int64_t run_items(task_fn fn, void *ctx, int64_t nitems, int64_t chunk, int threads, uint64_t gen, int tid) {
    const unsigned long long tag = (unsigned long long)(uint32_t)gen << 32;
    unsigned long long at = atomic_load(&pool.next);
    int64_t ran = 0;
    for (;;) {
        if ((at & ~0xFFFFFFFFull) != tag || (int64_t)(at & 0xFFFFFFFFull) >= nitems) break;
        const int64_t k = claim_size(nitems - (int64_t)(at & 0xFFFFFFFFull), threads, chunk);
        if (!atomic_compare_exchange_weak(&pool.next, &at, at + (unsigned long long)k)) continue; /* at reloaded */
        const int64_t first = tid == 0 ? atomic_fetch_add(&pool.front, k) : atomic_fetch_sub(&pool.back, k) - k;
        for (int64_t x = first; x < first + k; x++) {
            int64_t next = x + 1;
            if (x + 1 == first + k) { /* the run's last: the next run's first, if any is left */
                at = atomic_load(&pool.next);
                const int64_t left = (at & ~0xFFFFFFFFull) == tag ? nitems - (int64_t)(at & 0xFFFFFFFFull) : 0;
                next = left <= 0 ? -1 : tid == 0 ? first + k : atomic_load(&pool.back) - claim_size(left, threads, chunk);
            }
            fn(ctx, x, next, tid);
        }
        ran += k;
        at = atomic_load(&pool.next);
    }
    return ran;
}

/* Counts `ran` items of call `gen` done; the one that completes it wakes the caller. */
static void items_done(uint64_t gen, int64_t ran) {
    if (!ran) return; /* a late worker's empty visit: nothing to count, nobody waits on it */
    pthread_mutex_lock(&pool.m);
    if (pool.gen == gen && atomic_fetch_add(&pool.completed, ran) + ran == pool.nitems) pthread_cond_signal(&pool.done);
    pthread_mutex_unlock(&pool.m);
}

/* How long an alerted worker waits awake for the call (then asleep again). */
#ifndef PREWAKE_SPIN_NS
#define PREWAKE_SPIN_NS 300000
#endif

GQA_INTERNAL int64_t elapsed_ns(const struct timespec *t0) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (t.tv_sec - t0->tv_sec) * 1000000000LL + (t.tv_nsec - t0->tv_nsec);
}

/* Turn i of a wait that spins: a pause, and every 64th turn whether limit_ns have passed since
 * t0 (1: stop spinning) or else the CPU offered to any other runnable thread. On an idle core
 * sched_yield returns at once and the wait stays a spin; on a core that a server shares with its
 * clients, the waiting thread hands its time to them instead of burning it (docs/design.md,
 * "Waits that yield"). */
static int spin_turn(int i, const struct timespec *t0, int64_t limit_ns) {
#if GQA_X86_64
    __builtin_ia32_pause();
#endif
    if (i % 64) return 0;
    if (elapsed_ns(t0) > limit_ns) return 1;
    sched_yield();
    return 0;
}

/* An alerted worker: returns when a call after `seen` is published, or PREWAKE_SPIN_NS on. */
static void await_call(uint64_t seen) {
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 1;; i++) {
        if (atomic_load_explicit(&pool.published, memory_order_acquire) != seen) return;
        if (spin_turn(i, &t0, PREWAKE_SPIN_NS)) return;
    }
}

static void *pool_worker(void *arg) {
    const int idx = (int)(intptr_t)arg; /* 1 .. started */
    pthread_mutex_lock(&pool.m);
    uint64_t seen = pool.start_gen; /* the generation before its first task, however late it runs */
    uint64_t alerted = pool.alert;
    for (;;) {
        while (pool.gen == seen && pool.alert == alerted && !pool.stop) pthread_cond_wait(&pool.wake, &pool.m);
        if (pool.stop) break;
        if (pool.gen == seen) { /* alerted: a call is coming */
            alerted = pool.alert;
            pthread_mutex_unlock(&pool.m);
            await_call(seen);
            pthread_mutex_lock(&pool.m);
            continue;
        }
        seen = pool.gen;
        alerted = pool.alert; /* the alerts before this call are answered by it */
        const int part = idx <= pool.want;
        task_fn fn = pool.fn;
        void *ctx = pool.ctx; /* dangling once that call has returned: then no item is claimed */
        const int64_t nitems = pool.nitems, chunk = pool.chunk;
        const int threads = pool.want + 1;
        pthread_mutex_unlock(&pool.m);
        if (part) items_done(seen, run_items(fn, ctx, nitems, chunk, threads, seen, idx));
        pthread_mutex_lock(&pool.m);
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
    atomic_store(&pool.published, pool.gen);
    pool.placed_for = -1;
    pool.nallowed = sched_getaffinity(0, sizeof pool.allowed, &pool.allowed) ? 0 : CPU_COUNT(&pool.allowed);
    for (int i = 0; i < want && i < MAX_THREADS - 1; i++) {
        if (pthread_create(&pool.tids[i], NULL, pool_worker, (void *)(intptr_t)(i + 1))) break; /* fewer: still correct */
        /* named for top -H, perf and /proc (else each is one more "python"), by the thread that
         * starts it: named by itself, a worker that had not run yet when a call ended (it finds
         * the items taken) was still "python" after that call */
        char name[16];
        snprintf(name, sizeof name, "gqa-pool-%d", i + 1);
        pthread_setname_np(pool.tids[i], name);
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

/* Worker i (0-based) on the i-th allowed CPU after `cpu`, the caller's, round the allowed set:
 * never the caller's while another is allowed. Without a usable CPU number or with one CPU
 * allowed the workers are left where they are; a refused pin (a cpuset changed since) only
 * leaves that worker to the scheduler. */
static void place_workers_locked(int cpu) { /* call_lock held */
    if (cpu < 0 || cpu == pool.placed_for || pool.nallowed < 2 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &pool.allowed))
        return;
    int at = cpu;
    for (int i = 0; i < pool.started; i++) {
        do at = (at + 1) % CPU_SETSIZE;
        while (!CPU_ISSET(at, &pool.allowed) || at == cpu);
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(at, &one);
        pthread_setaffinity_np(pool.tids[i], sizeof one, &one);
    }
    pool.placed_for = cpu;
}

__attribute__((constructor)) static void pool_init(void) { pthread_atfork(NULL, NULL, pool_after_fork_child); }

/* Returns once the current call's items are all done or SPIN_WAIT_NS have passed. */
#define SPIN_WAIT_NS 300000
static void spin_until_done(int64_t nitems) {
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 1;; i++) {
        if (atomic_load_explicit(&pool.completed, memory_order_acquire) >= nitems) return;
        if (spin_turn(i, &t0, SPIN_WAIT_NS)) return;
    }
}

/* Every item on the calling thread, in order. */
static void run_alone(task_fn fn, void *ctx, int64_t nitems) {
    for (int64_t i = 0; i < nitems; i++) fn(ctx, i, i + 1 < nitems ? i + 1 : -1, 0);
}

GQA_INTERNAL void pool_run(task_fn fn, void *ctx, int64_t nitems, int64_t chunk, int threads) {
    if (chunk < 1) chunk = 1;
    /* one thread's work, or another call has the pool: this thread alone */
    if (threads <= 1 || nitems <= 1 || pthread_mutex_trylock(&pool.call_lock)) {
        run_alone(fn, ctx, nitems);
        return;
    }
    if (pool.started + 1 < pool.size) {
        if (pool.started) pool_stop_locked();
        pool_start_locked();
    }
    place_workers_locked(sched_getcpu());
    int want = threads - 1;
    if (want > pool.started) want = pool.started;
    if (want > nitems - 1) want = (int)(nitems - 1);
    if (nitems > 0xFFFFFFFFll) want = 0; /* beyond the counter's 32 bits of items: the caller alone */
    pthread_mutex_lock(&pool.m);
    pool.fn = fn;
    pool.ctx = ctx;
    pool.nitems = nitems;
    pool.chunk = chunk;
    pool.want = want;
    atomic_store(&pool.completed, 0);
    atomic_store(&pool.front, 0);
    atomic_store(&pool.back, nitems);
    const uint64_t gen = ++pool.gen;
    atomic_store(&pool.next, (unsigned long long)(uint32_t)gen << 32);
    atomic_store_explicit(&pool.published, gen, memory_order_release);
    if (want) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.m);
    if (!want) {
        run_alone(fn, ctx, nitems);
    } else {
        const int64_t ran = run_items(fn, ctx, nitems, chunk, want + 1, gen, 0);
        /* the items left are the workers' last ones, already running: wait for them awake for a
         * while (a thread put to sleep here took 30-70 us to run again on this VM once they
         * were done, docs/design.md "The caller waits awake"), then asleep */
        if (atomic_fetch_add(&pool.completed, ran) + ran < nitems) spin_until_done(nitems);
        pthread_mutex_lock(&pool.m);
        while (atomic_load(&pool.completed) < nitems) pthread_cond_wait(&pool.done, &pool.m);
        pthread_mutex_unlock(&pool.m);
    }
    pthread_mutex_unlock(&pool.call_lock);
}

/* Alerts the started workers that a parallel call is coming; nothing when there are none, or
 * when a call has them now. */
static void pool_prewake(void) {
    if (pthread_mutex_trylock(&pool.call_lock)) return;
    if (pool.started) {
        pthread_mutex_lock(&pool.m);
        pool.alert++;
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.m);
    }
    pthread_mutex_unlock(&pool.call_lock);
}

/* A hint before the step of cache cc: when that step is likely to run on more than one thread
 * (the positions it attends, by its T and capacity, times its heads: run.c's work), the workers
 * are alerted now, while the caller still has its own checks to make. */
void gqa_prewake(const gqa_cache_t *cc) {
    if (!cc || gqa_threads() < 2 || cc->t < cc->python_below) return; /* python_below: no call comes */
    const int64_t attended = cc->t + 1 < cc->c ? cc->t + 1 : cc->c;
    if (cache_work(cc->n, attended) >= PARALLEL_MIN_WORK) pool_prewake();
}

/* A hint before a step of many caches (a plane message: `heads` cache heads in all, each
 * attending at least one position): the workers alerted when even that least work shares the
 * call. The lengths are not added up; a message of a few long caches goes unalerted. */
void gqa_prewake_heads(int64_t heads) {
    if (gqa_threads() >= 2 && cache_work(heads, 1) >= PARALLEL_MIN_WORK) pool_prewake();
}

/* Whether a step of cache cc can ever run on more than one thread (all its capacity attended):
 * one that cannot never needs gqa_prewake (native_step.py asks once per cache). */
int gqa_may_use_pool(const gqa_cache_t *cc) { return cc && cache_work(cc->n, cc->c) >= PARALLEL_MIN_WORK; }

int gqa_set_threads(int n) {
    if (n < 1 || n > MAX_THREADS) return -EINVAL;
    pthread_mutex_lock(&pool.call_lock);
    if (pool.started) pool_stop_locked();
    pool.size = n;
    pthread_mutex_unlock(&pool.call_lock);
    return 0;
}

int gqa_threads(void) { return pool.size > 0 ? pool.size : 1; }
