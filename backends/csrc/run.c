/*
 * gqa_run: the steps (or attentions) of many caches in one call. Each cache is checked and its
 * work items laid out (a split of SPLIT_T positions per item, or a short cache's heads in one),
 * the call's memory carved from the calling thread's arenas, the int8 writes and the dense
 * writes of unattended rows done, then the items run on the pool (the attended rows' dense
 * writes and the merges within them).
 */
#include "gqa_internal.h"

static int check_cache(const gqa_cache_t *cc, int isa, int64_t *attended, int *chosen) {
    if (cc->enc < ENC_F32 || cc->enc > ENC_INT8 || cc->io < ENC_F32 || cc->io > ENC_F16) return -EINVAL;
    if (cc->n < 1 || cc->g < 1 || cc->d < 1 || cc->c < 1 || cc->dk < 0 || cc->kstride < cc->c * key_width(cc))
        return -EINVAL;
    if (cc->nruns < 1 || cc->nruns > MAX_RUNS || !cc->k || !cc->v || !cc->q || !cc->out) return -EINVAL;
    if (cc->enc == ENC_INT8) {
        if (cc->dk < 0 || cc->no < 0 || cc->dk + cc->no < 1 || (cc->no && !cc->ko) || !cc->ks || !cc->vs) return -EINVAL;
        if (cc->scale_stride < cc->c || cc->dk + cc->no != cc->d || cc->write_row >= cc->c) return -EINVAL;
        if (cc->write_row >= 0 && (!cc->new_k || !cc->new_v || !cc->saved || !cc->order)) return -EINVAL;
    } else {
        if (cc->dk != cc->d || cc->no != 0) return -EINVAL;
        if (cc->write_row >= cc->c || (cc->write_row >= 0 && (cc->io != cc->enc || !cc->new_k || !cc->new_v || !cc->saved)))
            return -EINVAL;
    }
    int64_t s = 0;
    for (int64_t r = 0; r < cc->nruns; r++) {
        if (cc->runs[2 * r] < 0 || cc->runs[2 * r + 1] > cc->c || cc->runs[2 * r] >= cc->runs[2 * r + 1]) return -EINVAL;
        s += cc->runs[2 * r + 1] - cc->runs[2 * r];
    }
    const int usable = gqa_usable_isas(cc->d), own = (cc->flags >> FLAG_ISA_SHIFT) & FLAG_ISA_MASK;
    if (own) isa = own;
    if (isa == ISA_AUTO) isa = gqa_auto_isa(cc->d, cc->enc);
    if (isa < ISA_PORTABLE || isa > ISA_AVX512_DOT || !(usable & (1 << isa))) return -ENOTSUP;
    *attended = s;
    *chosen = isa;
    return 0;
}

/* What a call needs besides its per-cache arrays (floats, or counts). */
typedef struct {
    int64_t items, heads, parts, scratch, work, wneed, splits, coded;
} call_size_t;

/* The per-cache arrays of a call, from the calling thread's ARENA_CACHES. */
static int call_arrays(call_t *call, gqa_cache_t *caches, int64_t ncaches) {
    const size_t nc = (size_t)ncaches;
    char *at = arena_get(ARENA_CACHES, 6 * 64 + (7 * nc + 2) * sizeof(int64_t) + nc * (sizeof(block_fn) + 2));
    if (!at) return -ENOMEM;
    int64_t *ints = carve(&at, (7 * nc + 2) * sizeof(int64_t));
    *call = (call_t){.caches = caches, .ncaches = ncaches, .item_off = ints, .head_off = ints + nc + 1,
                     .nsplit = ints + 2 * nc + 2, .s = ints + 3 * nc + 2, .part_off = ints + 4 * nc + 2,
                     .hpi = ints + 5 * nc + 2, .coded_at = ints + 6 * nc + 2};
    call->block = carve(&at, nc * sizeof(block_fn));
    call->wide = carve(&at, nc);
    call->deferred = carve(&at, nc);
    return 0;
}

/* The most work items one claim of the call takes (pool.c's runs), in a call of call_splits
 * splits (every several-split cache's heads x splits, each split an item): enough for every
 * thread to make RUNS_PER_THREAD claims of the call's splits at the start, at most
 * MAX_RUN_ITEMS (the claims shrink as the work runs out). A thread reads on from one split into
 * the next within a run and from a run into its next when that follows (the caller's always
 * do), so a long head is one stream; a worker's runs descend, each a fresh stream. 1 for a call
 * of few splits, or of one-split caches alone (whose items, a head or a few each, are claimed
 * one at a time). Outputs do not depend on it: every split's partial is the same whichever
 * thread computes it. */
static int64_t claim_chunk(int64_t call_splits, int threads) {
    const int64_t per = call_splits / ((int64_t)threads * RUNS_PER_THREAD);
    return per < 1 ? 1 : per > MAX_RUN_ITEMS ? MAX_RUN_ITEMS : per;
}

/* Cache i checked, its block chosen and its sizes counted (size so far). */
static int check_and_count(call_t *call, int64_t i, int isa, call_size_t *size) {
    gqa_cache_t *cc = &call->caches[i];
    int chosen;
    const int rc = check_cache(cc, isa, &call->s[i], &chosen);
    if (rc) return rc;
    cc->status = 0;
    call->block[i] = choose_block(cc->enc, chosen);
    call->wide[i] = (char)(chosen >= ISA_AVX512 ? ISA_AVX512 : chosen == ISA_AVX2 ? ISA_AVX2 : 0);
    call->nsplit[i] = (call->s[i] + SPLIT_T - 1) / SPLIT_T;
    if (call->nsplit[i] > 1) size->splits += cc->n * call->nsplit[i];
    const int64_t need = 2 * cc->g + 3 * cc->g * cc->d + 2 * cc->g + (TILE_G + 2) * TILE_T + 16 +
                         cc->g * (key_width(cc) * BPIECES / 2 + 2) + 1; /* split_query_bf16's, query_int16's */
    if (need > size->scratch) size->scratch = need;
    size->work += cache_work(cc->n, call->s[i]);
    if (cc->enc == ENC_INT8 && cc->write_row >= 0) {
        const int64_t w = 2 * cc->n * cc->d + 2 * cc->n + (2 * cc->n * cc->d + 3) / 4 + 1;
        if (w > size->wneed) size->wneed = w;
    }
    return 0;
}

/* Cache i's work items laid out after those of the caches before it. */
static void lay_out_cache(call_t *call, int64_t i, call_size_t *size) {
    const gqa_cache_t *cc = &call->caches[i];
    call->item_off[i] = size->items;
    call->head_off[i] = size->heads;
    call->part_off[i] = size->parts;
    if (call->nsplit[i] > 1) { /* a split an item */
        call->hpi[i] = 1;
        size->items += cc->n * call->nsplit[i];
        size->parts += cc->n * call->nsplit[i] * cc->g * (cc->d + 2);
    } else { /* heads per item: as many as make up HEADS_ITEM_T positions */
        const int64_t per = HEADS_ITEM_T / (call->s[i] ? call->s[i] : 1);
        call->hpi[i] = per < 1 ? 1 : per > cc->n ? cc->n : per;
        size->items += (cc->n + call->hpi[i] - 1) / call->hpi[i];
    }
    size->heads += cc->n;
    /* an int8 row its heads' items store (DEFER_CODES): its quantized row kept until then */
    call->coded_at[i] = -1;
    if (cc->enc == ENC_INT8 && cc->write_row >= 0 && !(call->nsplit[i] == 1 && call->hpi[i] >= cc->n))
        call->coded_at[i] = size->coded++;
}

/* The call's shared memory (partials, per-thread scratch and int8_write room, the merge
 * counters) from ARENA_CALL. */
static int call_memory(call_t *call, const call_size_t *size, int threads) {
    call->scratch_floats = (size->scratch + 15) / 16 * 16;
    call->wfloats = (size->wneed + 15) / 16 * 16;
    const size_t bytes = 6 * 64 + (size_t)threads * 64 + (size_t)size->parts * sizeof(float) +
                         (size_t)(threads * call->scratch_floats) * sizeof(float) +
                         (size_t)((threads + size->coded) * call->wfloats) * sizeof(float) +
                         (size_t)size->heads * sizeof(atomic_int);
    char *at = arena_get(ARENA_CALL, bytes);
    if (!at) return -ENOMEM;
    call->part = carve(&at, (size_t)size->parts * sizeof(float));
    call->scratch = carve(&at, (size_t)(threads * call->scratch_floats) * sizeof(float));
    call->wbuf = carve(&at, (size_t)(threads * call->wfloats) * sizeof(float));
    call->coded = carve(&at, (size_t)(size->coded * call->wfloats) * sizeof(float));
    call->done = carve(&at, (size_t)size->heads * sizeof(atomic_int));
    call->ahead = carve(&at, (size_t)threads * 64); /* a cache line each: written by its thread alone */
    for (int x = 0; x < threads; x++) call->ahead[x * AHEAD_STRIDE] = -1;
    for (int64_t x = 0; x < size->heads; x++) atomic_init(&call->done[x], 0);
    return 0;
}

/* Cache i's write before the items run, or who does it (call->deferred): int8's whole row
 * (its status: -ERANGE for a scale out of range, nothing written) by the cache's item when it
 * has one, else here; a dense row nobody attends here; an attended dense row by the item that
 * reads it. */
static void write_before(call_t *call, int64_t i) {
    gqa_cache_t *cc = &call->caches[i];
    call->deferred[i] = DEFER_NONE;
#ifdef GQA_TEST_HOOKS
    if (injected_failure(cc, call->wbuf)) return;
#endif
    if (cc->write_row < 0) return;
    if (cc->enc == ENC_INT8 && call->coded_at[i] < 0) { /* its heads are one item */
        call->deferred[i] = DEFER_ROW;
        return;
    }
    int attended = 0;
    for (int64_t r = 0; r < cc->nruns; r++)
        attended |= cc->write_row >= cc->runs[2 * r] && cc->write_row < cc->runs[2 * r + 1];
    if (cc->enc == ENC_INT8) { /* checked and quantized now: a refused row is not written at all */
        float *coded = call->coded + call->coded_at[i] * call->wfloats;
        cc->status = int8_quantize(cc, coded);
        if (cc->status) return;
        if (attended) call->deferred[i] = DEFER_CODES;
        else int8_store(cc, coded);
        return;
    }
    if (attended) call->deferred[i] = DEFER_HEAD;
    else write_row(cc, 0);
}

/* Computes the steps (or attentions) of `ncaches` caches; see gqa_internal.h. threads: at most
 * this many (0: the pool's size). isa: ISA_* for every cache (ISA_AUTO: the fastest each can
 * run). Returns 0 (each cache's own `status` then says whether it was computed), or a negative
 * errno-style code for the whole call with nothing written (bad arguments, no memory). */
int gqa_run(gqa_cache_t *caches, int64_t ncaches, int threads, int isa) {
    if (ncaches < 1) return ncaches == 0 ? 0 : -EINVAL;
    if (threads <= 0) threads = gqa_threads();
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    call_t call;
    int rc = call_arrays(&call, caches, ncaches);
    call_size_t size = {.wneed = 1};
    for (int64_t i = 0; i < ncaches && !rc; i++) rc = check_and_count(&call, i, isa, &size);
    if (rc) return rc;
    if (size.work < PARALLEL_MIN_WORK) threads = 1;
    call.chunk = claim_chunk(size.splits, threads);
    for (int64_t i = 0; i < ncaches; i++) lay_out_cache(&call, i, &size);
    call.item_off[ncaches] = size.items;
    call.head_off[ncaches] = size.heads;
    if (threads > size.items) threads = (int)size.items;
    rc = call_memory(&call, &size, threads);
    if (rc) return rc;
    /* from here on a cache fails alone (its status; its output then is not stored) */
    STAMP(0, -1, STAMP_WRITES);
    for (int64_t i = 0; i < ncaches; i++) write_before(&call, i);
    STAMP(0, -1, STAMP_ITEMS);
    pool_run(attend_item, &call, size.items, call.chunk, threads); /* and the merges */
    STAMP(0, -1, STAMP_ITEMS_END);
    arena_trim(ARENA_CALL);
    arena_trim(ARENA_CACHES);
    return 0;
}

/* gqa_run over descriptors that live apart (each cache keeps its own): copied into one array,
 * computed, and each one's `status` copied back. The same return codes as gqa_run. */
int gqa_run_ptrs(gqa_cache_t *const *ptrs, int64_t ncaches, int threads, int isa) {
    if (ncaches < 1) return ncaches == 0 ? 0 : -EINVAL;
    gqa_cache_t *caches = arena_get(ARENA_DESCS, (size_t)ncaches * sizeof *caches);
    if (!caches) return -ENOMEM;
    for (int64_t i = 0; i < ncaches; i++) {
        if (!ptrs[i]) return -EINVAL;
        caches[i] = *ptrs[i];
    }
    const int rc = gqa_run(caches, ncaches, threads, isa);
    if (!rc)
        for (int64_t i = 0; i < ncaches; i++) ptrs[i]->status = caches[i].status;
    arena_trim(ARENA_DESCS);
    return rc;
}
