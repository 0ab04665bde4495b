/*
 * The plan of a step: its ring and policy arithmetic from the cache's state, as
 * backends/policy.py specifies it (tests/test_plane.py steps both side by side): the attended
 * runs, the row written, and the numbers after the step.
 */
#include "gqa_internal.h"

static int64_t resident_length(const gqa_cache_t *cc, int64_t t) {
    const int64_t c = cc->c, w = cc->window, s = cc->sinks;
    switch (cc->policy) {
        case POLICY_NONE: return t;
        case POLICY_STRICT: return t < w ? t : w;
        case POLICY_GREEDY: {
            if (t <= c) return t;
            const int64_t g = c - w + 1;
            return t - g * ((t - c + g - 1) / g);
        }
        default: {
            const int64_t tail = t - s < 0 ? 0 : t - s;
            return (t < s ? t : s) + (tail < w ? tail : w);
        }
    }
}

static int64_t ring_row(const gqa_cache_t *cc, int64_t p) {
    if (cc->policy == POLICY_SINK) return p < cc->sinks ? p : cc->sinks + (p - cc->sinks) % cc->window;
    return p % cc->c;
}

/* The rows of positions [a, b) (consecutive, a < b) in the ring region [lo, hi): one or two runs. */
static int add_runs(const gqa_cache_t *cc, int64_t *runs, int nr, int64_t a, int64_t b, int64_t lo, int64_t hi) {
    const int64_t first = ring_row(cc, a), n = b - a;
    if (first + n <= hi) {
        runs[2 * nr] = first;
        runs[2 * nr + 1] = first + n;
        return nr + 1;
    }
    runs[2 * nr] = first;
    runs[2 * nr + 1] = hi;
    runs[2 * nr + 2] = lo;
    runs[2 * nr + 3] = lo + n - (hi - first);
    return nr + 2;
}

/* The plan of the step from T = cc->t: the attended runs (sorted, joined where they touch:
 * ring.merge_runs) and the row written into cc's runs / nruns / write_row; -ENOSPC when the
 * policy has no room (none, full). With res: the rcols first R_* numbers after the step. */
GQA_INTERNAL int plan_step(gqa_cache_t *cc, int64_t *res, int64_t rcols) {
    const int64_t t = cc->t, u = t + 1, w = cc->window, s = cc->sinks;
    if (t < 0) return -EINVAL;
    if (cc->policy == POLICY_NONE && t >= cc->c) return -ENOSPC;
    int64_t runs[2 * MAX_RUNS];
    int nr = 0;
    if (cc->policy == POLICY_NONE) {
        nr = add_runs(cc, runs, nr, 0, u, 0, cc->c);
    } else if (cc->policy == POLICY_SINK) {
        const int64_t head = u < s ? u : s, from = u - w > s ? u - w : s;
        if (head) nr = add_runs(cc, runs, nr, 0, head, 0, cc->c);
        if (from < u) nr = add_runs(cc, runs, nr, from, u, s, cc->c);
    } else {
        nr = add_runs(cc, runs, nr, u - (u < w ? u : w), u, 0, cc->c);
    }
    int64_t attended = 0;
    for (int r = 0; r < nr; r++) attended += runs[2 * r + 1] - runs[2 * r];
    for (int r = 1; r < nr; r++) /* sort by (a, b): at most four */
        for (int x = r; x > 0 && (runs[2 * x - 2] > runs[2 * x] ||
                                  (runs[2 * x - 2] == runs[2 * x] && runs[2 * x - 1] > runs[2 * x + 1]));
             x--) {
            const int64_t a = runs[2 * x - 2], b = runs[2 * x - 1];
            runs[2 * x - 2] = runs[2 * x];
            runs[2 * x - 1] = runs[2 * x + 1];
            runs[2 * x] = a;
            runs[2 * x + 1] = b;
        }
    int m = 0;
    for (int r = 0; r < nr; r++) {
        if (m && cc->runs[2 * m - 1] == runs[2 * r]) {
            cc->runs[2 * m - 1] = runs[2 * r + 1];
        } else {
            cc->runs[2 * m] = runs[2 * r];
            cc->runs[2 * m + 1] = runs[2 * r + 1];
            m++;
        }
    }
    cc->nruns = m;
    cc->write_row = ring_row(cc, t);
    if (res) {
        int64_t r[R_COLS];
        const int64_t lu = resident_length(cc, u);
        r[R_T] = u;
        r[R_RESIDENT] = lu;
        r[R_FIRST] = cc->policy == POLICY_SINK ? (s ? 0 : (u - w > 0 ? u - w : 0)) : u - lu;
        r[R_LAST] = t;
        r[R_EVICTED] = resident_length(cc, t) + 1 - lu;
        if (lu == u) r[R_REACH] = u;
        else if (cc->policy == POLICY_GREEDY) {
            const int64_t g = cc->c - w + 1;
            r[R_REACH] = ((u - cc->c - 1) % g + g) % g;
        } else r[R_REACH] = 0;
        r[R_ATTENDED] = attended;
        r[R_WRITE_ROW] = cc->write_row;
        for (int64_t x = 0; x < rcols && x < R_COLS; x++) res[x] = r[x];
    }
    return 0;
}

/* The plan of one step from the cache's state, computed and not taken (tests: the C twin of
 * backends/policy.py). out: R_COLS numbers, then nruns, then the runs. 0 or -ENOSPC/-EINVAL. */
int gqa_plan(const gqa_cache_t *cache, int64_t *out) {
    gqa_cache_t cc = *cache;
    const int rc = plan_step(&cc, out, R_COLS);
    if (rc) return rc;
    out[R_COLS] = cc.nruns;
    for (int r = 0; r < 2 * cc.nruns; r++) out[R_COLS + 1 + r] = cc.runs[r];
    return 0;
}

/* The rollback reach of a cache at its T (policy.rollback_reach), for Python's rollback. */
int64_t gqa_rollback_reach(const gqa_cache_t *cc) {
    const int64_t t = cc->t, lt = resident_length(cc, t);
    if (lt == t) return t;
    if (cc->policy != POLICY_GREEDY) return 0;
    const int64_t g = cc->c - cc->window + 1;
    return ((t - cc->c - 1) % g + g) % g;
}
