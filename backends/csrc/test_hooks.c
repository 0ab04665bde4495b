/*
 * Test-only hooks, compiled into a test build alone (-DGQA_TEST_HOOKS: native_build.py's
 * GQA_KERNEL_TEST_HOOKS=1 and the sanitizer build): the production library has none of this
 * and ignores FLAG_FAIL_AFTER_WRITE.
 */
#include "gqa_internal.h"

#ifdef GQA_TEST_HOOKS
/* Whether this library has the hooks (native.py's Kernel.test_hooks; absent from production). */
int gqa_test_hooks(void) { return 1; }

/* A cache flagged FLAG_FAIL_AFTER_WRITE: its step's write done, then restored, then -EIO, as a
 * failure after the write would leave it (the cache byte-identical, the output not stored).
 * Returns whether the cache was flagged (then nothing else is done for it). */
GQA_INTERNAL int injected_failure(gqa_cache_t *cc, float *wbuf) {
    if (!(cc->flags & FLAG_FAIL_AFTER_WRITE)) return 0;
    if (cc->write_row >= 0) {
        if (cc->enc == ENC_INT8) {
            cc->status = int8_write(cc, wbuf);
            if (!cc->status) int8_swap_row(cc, 1);
        } else {
            write_row(cc, 0);
            write_row(cc, 1);
        }
    }
    if (!cc->status) cc->status = -EIO;
    return 1;
}

/* pool.c's order, recorded: one pool_run of `nitems` items on up to `threads` threads, claimed
 * in runs of at most `chunk`, each item a ~spin_ns busy wait (long enough for a woken worker to
 * join); item x's thread in tid[x], its place among that thread's items (0, 1, ...) in seq[x],
 * and the next item its thread was told of in next[x]. */
typedef struct {
    int64_t *tid, *seq, *next, spin_ns;
    int64_t ran[MAX_THREADS * AHEAD_STRIDE]; /* per thread, a cache line apart */
} order_t;

static void record_item(void *ctx, int64_t item, int64_t next, int tid) {
    order_t *o = ctx;
    o->tid[item] = tid;
    o->seq[item] = o->ran[tid * AHEAD_STRIDE]++;
    o->next[item] = next;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (elapsed_ns(&t0) < o->spin_ns) continue;
}

int gqa_test_pool_order(int64_t nitems, int threads, int64_t chunk, int64_t spin_ns, int64_t *tid, int64_t *seq,
                        int64_t *next) {
    if (threads < 1 || threads > MAX_THREADS || nitems < 0 || chunk < 1) return -EINVAL;
    order_t *o = calloc(1, sizeof *o);
    if (!o) return -ENOMEM;
    o->tid = tid;
    o->seq = seq;
    o->next = next;
    o->spin_ns = spin_ns;
    for (int64_t x = 0; x < nitems; x++) tid[x] = seq[x] = next[x] = -1;
    pool_run(record_item, o, nitems, chunk, threads);
    free(o);
    return 0;
}
#else
typedef int gqa_no_test_hooks; /* ISO C wants a translation unit to declare something */
#endif
