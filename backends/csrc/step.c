/*
 * gqa_step: the steps of many caches in one call, each planned from its own state (plan.c),
 * then computed together by gqa_run (which checks an int8 row's values where it writes the
 * row); the caches' T advanced for the rows that succeeded.
 */
#include "gqa_internal.h"

/* A step of several caches alerts the pool's sleeping workers before it plans them, as the
 * public step does before its checks (gqa_prewake): a worker's wake-up takes 20-100 us on a
 * VM, which the plans and the row writes then hide (docs/design.md, thirty-ninth session).
 * Counted as gqa_prewake_heads counts: every cache's heads, each attending at least one
 * position. A caller that alerted already (a Batch session's CacheSet.expect) makes this a
 * no-op: the workers are awake. */
static void alert_pool(gqa_cache_t *const *caches, int64_t n) {
    int64_t heads = 0;
    for (int64_t i = 0; i < n; i++)
        if (caches[i] && caches[i]->t >= caches[i]->python_below) heads += caches[i]->n;
    gqa_prewake_heads(heads);
}

/* n steps, one per row: row i appends to and attends over the cache at caches[i] (distinct
 * caches), planned from its state. The row's query, new key, new value and output: io[4 * i
 * + 0..3] when io is given (pointers), else base[j] + i * stride[j] (bytes) for j = q, k, v,
 * out. Per row: status[i] = 0 (results[i * rcols ..] = the first rcols R_* numbers after the
 * step, T incremented), or the refusal with nothing written and results zero: -EAGAIN (the
 * caller's own path: T below python_below), -ENOSPC (policy none, full), -EDOM (int8: a
 * non-finite input, or a key beyond float16's range), -ERANGE (int8 scale),
 * -EIO (injected failure), -EINVAL (no cache). Returns 0, or a negative errno for the whole
 * call (nothing written, no status). */
int gqa_step(gqa_cache_t *const *caches, int64_t n, const void *const *io, const void *const *base,
             const int64_t *stride, int64_t *results, int64_t rcols, int32_t *status, int threads, int isa) {
    if (n < 0 || rcols < 0 || (!io && (!base || !stride))) return -EINVAL;
    if (n == 0) return 0;
    STAMP(0, -1, STAMP_STEP);
    if (n > 1 && threads != 1) alert_pool(caches, n);
    gqa_cache_t *work = arena_get(ARENA_DESCS, (size_t)n * (sizeof *work + sizeof(int64_t)));
    if (!work) return -ENOMEM;
    int64_t *row_of = (int64_t *)(work + n);
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t *res = results + i * rcols;
        memset(res, 0, (size_t)rcols * sizeof(int64_t));
        gqa_cache_t *cc = caches[i];
        if (!cc) {
            status[i] = -EINVAL;
            continue;
        }
        if (cc->t < cc->python_below) {
            status[i] = -EAGAIN;
            continue;
        }
        gqa_cache_t *x = &work[m];
        *x = *cc;
        const int rc = plan_step(x, res, rcols);
        status[i] = rc;
        if (rc) {
            memset(res, 0, (size_t)rcols * sizeof(int64_t));
            continue;
        }
        if (io) {
            x->q = io[4 * i];
            x->new_k = io[4 * i + 1];
            x->new_v = io[4 * i + 2];
            x->out = (void *)io[4 * i + 3];
        } else {
            x->q = (const char *)base[0] + i * stride[0];
            x->new_k = (const char *)base[1] + i * stride[1];
            x->new_v = (const char *)base[2] + i * stride[2];
            x->out = (char *)base[3] + i * stride[3];
        }
        row_of[m++] = i;
    }
    const int rc = gqa_run(work, m, threads, isa);
    if (rc) {
        memset(results, 0, (size_t)(n * rcols) * sizeof(int64_t));
        arena_trim(ARENA_DESCS);
        return rc;
    }
    for (int64_t x = 0; x < m; x++) {
        const int64_t i = row_of[x];
        status[i] = work[x].status;
        if (work[x].status) memset(results + i * rcols, 0, (size_t)rcols * sizeof(int64_t));
        else caches[i]->t++;
    }
    arena_trim(ARENA_DESCS);
    STAMP(0, -1, STAMP_STEP_END);
    return 0;
}
