/*
 * The work items of a call: a head's positions block by block (each split of SPLIT_T positions
 * its own item, a short cache's heads together in one), its partials, and their merge in split
 * order by the item that completes a head, then the output row in the stream's dtype.
 */
#include "gqa_internal.h"

static int64_t find_cache(const int64_t *off, int64_t ncaches, int64_t item) {
    int64_t lo = 0, hi = ncaches - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (off[mid] <= item) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

static state_t thread_state(const call_t *call, const gqa_cache_t *cc, int tid) {
    float *mem = call->scratch + tid * call->scratch_floats;
    const int64_t G = cc->g, d = cc->d;
    float *p = mem + 2 * G + G * d;
    p = (float *)(((uintptr_t)p + 63) & ~(uintptr_t)63);
    float *q = p + (TILE_G + 2) * TILE_T; /* then split_query_bf16's room: G * BPIECES * key_width */
    return (state_t){.m = mem, .l = mem + G, .acc = mem + 2 * G, .p = p, .ksb = p + TILE_G * TILE_T,
                     .vsb = p + (TILE_G + 1) * TILE_T, .q = q, .qb = (uint16_t *)(q + G * d), .smul = 1.0f};
}

/* Head h's query as float32 times qscale, in the stored key order (int8 with `order`). */
GQA_INTERNAL void convert_query(const gqa_cache_t *cc, int64_t h, float *qf, int wide) {
    const int64_t G = cc->g, d = cc->d;
#if GQA_X86_64
    if (!cc->order && wide == ISA_AVX512) { /* any encoding, float32 too: 16 lanes at a time */
        widen_row_avx512(cc->io, (const char *)cc->q + h * G * d * enc_size(cc->io), qf, G * d, cc->qscale);
        return;
    }
#endif
    if (!cc->order && cc->io == ENC_F32) {
        const float *q = (const float *)cc->q + h * G * d;
        for (int64_t x = 0; x < G * d; x++) qf[x] = q[x] * cc->qscale;
        return;
    }
#if GQA_X86_64
    if (!cc->order && wide == ISA_AVX2) { /* float16 / bfloat16 (AVX-512 took every encoding above) */
        const uint16_t *q = (const uint16_t *)cc->q + h * G * d;
        widen_row_avx2(cc->io, q, qf, G * d, cc->qscale);
        return;
    }
#else
    (void)wide;
#endif
    const int64_t *order = cc->order ? cc->order + h * d : NULL;
#if GQA_X86_64
    if (order && wide == ISA_AVX512) { /* int8: the stored key order's runs, 16 lanes at a time */
        gather_rows_avx512(cc->io, (const char *)cc->q + h * G * d * enc_size(cc->io), order, G, d, cc->qscale, qf);
        return;
    }
    if (order && wide == ISA_AVX2) { /* int8: the stored key order's runs, 8 lanes at a time */
        gather_rows_avx2(cc->io, (const char *)cc->q + h * G * d * enc_size(cc->io), order, G, d, cc->qscale, qf);
        return;
    }
#endif
    if (order && cc->io == ENC_F32) { /* int8 with float32 tensors: a plain gather */
        const float *restrict q = (const float *)cc->q + h * G * d;
        const float qs = cc->qscale; /* a local: a store to qf may alias *cc, so cc->qscale was reloaded */
        for (int64_t g = 0; g < G; g++)
            for (int64_t j = 0; j < d; j++) qf[g * d + j] = q[g * d + order[j]] * qs;
        return;
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t j = 0; j < d; j++)
            qf[g * d + j] = load_elem(cc->io, cc->q, (h * G + g) * d + (order ? order[j] : j)) * cc->qscale;
}

static void merge_head(const call_t *call, int64_t i, int64_t h, const float *base, int tid);
static void finish_head(const call_t *call, int64_t i, int64_t h, const state_t *st);

/* Where a block's bytes lie: its `lines` key lines of `span` bytes each, `line` bytes apart from
 * k (one run of `run` bytes from k), and its value rows, vbytes from v. */
typedef struct {
    const char *k, *v;
    int64_t lines, line, span, run, vbytes;
} block_bytes_t;

static inline block_bytes_t block_bytes(const gqa_cache_t *cc, int64_t h, int64_t phys, int64_t nt) {
    const int64_t el = enc_size(cc->enc), lines = key_width(cc) / kpack(cc->enc);
    int64_t line;
    const char *k = (const char *)cc->k + key_block(cc, h, phys, &line) * el;
    const int64_t span = nt * kpack(cc->enc) * el;
    return (block_bytes_t){.k = k, .v = (const char *)cc->v + (h * cc->c + phys) * cc->d * el, .lines = lines,
                           .line = line * el, .span = span, .run = (lines - 1) * line * el + span,
                           .vbytes = nt * cc->d * el};
}

/* Asks for every line of a block at once (key lines, value rows; locality 3: into L1, 2: L2): the
 * misses then overlap instead of following one another. The key lines of a ring shorter than a
 * block are a few bytes each, many to a cache line: their run is asked for once, line by line. */
static inline __attribute__((always_inline)) void prefetch_block(const gqa_cache_t *cc, int64_t h, int64_t phys,
                                                                 int64_t nt, const int locality) {
    const block_bytes_t b = block_bytes(cc, h, phys, nt);
    if ((b.run + 63) / 64 < b.lines * ((b.span + 63) / 64)) /* lines of a short ring: the run, each cache line once */
        prefetch_lines(b.k, b.run, locality);
    else
        for (int64_t j = 0; j < b.lines; j++) prefetch_lines(b.k + j * b.line, b.span, locality);
    prefetch_lines(b.v, b.vbytes, locality);
    if (cc->enc == ENC_INT8) prefetch_int8_side(cc, h, phys, nt, locality);
}

/* A one-split head's first block into L2 (its positions from the ring's first run), its query
 * and new key and value rows too. */
static inline __attribute__((always_inline)) void prefetch_head_start(const gqa_cache_t *cc, int64_t h) {
    const int64_t a = cc->runs[0], to_grid = TILE_T - a % TILE_T, first = cc->runs[1] - a;
    prefetch_block(cc, h, a, first < to_grid ? first : to_grid, 2);
    const int64_t io = enc_size(cc->io), row = cc->d * io;
    prefetch_lines((const char *)cc->q + h * cc->g * row, cc->g * row, 2);
    if (cc->write_row >= 0) {
        prefetch_lines((const char *)cc->new_k + h * row, row, 2);
        prefetch_lines((const char *)cc->new_v + h * row, row, 2);
    }
}

/* Work item j's first head asked for (prefetch_head_start), when j is an item of a one-split
 * cache (a several-split cache's items ask for their own: item_first_block). */
static void prefetch_item_start(const call_t *call, int64_t j) {
    if (j < 0 || j >= call->item_off[call->ncaches]) return;
    const int64_t i = find_cache(call->item_off, call->ncaches, j);
    const gqa_cache_t *cc = &call->caches[i];
    if (call->nsplit[i] != 1 || cc->status || call->s[i] < 1) return;
    prefetch_head_start(cc, (j - call->item_off[i]) * call->hpi[i]);
}

/* Of cache i with several splits, its work item `local` (counted from the cache's first): one
 * split, head *h's split *sp. In head order, a head's splits ascending, when the call's claims
 * take runs of items (pool.c): a thread reads on from one split into the next, and the runs
 * shrink where the threads meet. When a claim takes one item (a call of few splits), the first
 * half of the heads' splits but their last, then every head's last split (the shortest, often
 * one position), then the other heads' splits but their last, so that the threads, one
 * ascending and the others descending, meet among the short items rather than in the middle of a
 * long one (int8 S=2048: 18.6 us between the threads' ends, 2.2 after). */
static void item_split(const call_t *call, int64_t i, int64_t local, int64_t *h, int64_t *sp) {
    const int64_t nsplit = call->nsplit[i];
    if (call->chunk > 1) {
        *h = local / nsplit;
        *sp = local % nsplit;
        return;
    }
    const int64_t n = call->caches[i].n, full = nsplit - 1, first = n / 2 * full;
    if (local < first) {
        *h = local / full;
        *sp = local % full;
    } else if (local < first + n) {
        *h = local - first;
        *sp = full;
    } else {
        *h = n / 2 + (local - first - n) / full;
        *sp = (local - first - n) % full;
    }
}

/* Whether block function b asks for the block after its own through gqa_avx512.h's drip, which
 * can take that block from st->after_* (an AVX-512 widening block, or bfloat16's dot block). */
static int drips(block_fn b) {
#if GQA_X86_64
    return b == block_avx512_f32 || b == block_avx512_bf16 || b == block_avx512_f16 || b == block_avx512_int8 ||
           b == block_dot_bf16 || b == block_dot_int8;
#else
    (void)b;
    return 0;
#endif
}

/* The block of cache cc's head h at ring row phys (nt positions) as the drip's next block (its
 * key lines' run, its value rows) in st->after_*: asked for through the current block, a line
 * before each load, instead of all at once before it (docs/design.md, fortieth session); an
 * int8 block's scales and outlier channel runs (a few lines) asked for now. */
static void after_block(const gqa_cache_t *cc, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    if (cc->enc == ENC_INT8) prefetch_int8_side(cc, h, phys, nt, 2);
    const block_bytes_t b = block_bytes(cc, h, phys, nt);
    const uintptr_t k0 = (uintptr_t)b.k & ~(uintptr_t)63, v0 = (uintptr_t)b.v & ~(uintptr_t)63;
    st->after_k = (const char *)k0;
    st->after_kbytes = (int64_t)((uintptr_t)b.k + b.run - k0);
    st->after_v = (const char *)v0;
    st->after_vbytes = (int64_t)((uintptr_t)b.v + b.vbytes - v0);
}

/* The first block of work item j, when j is an item of a several-split cache (else 0): its
 * cache, head, ring row and positions. */
static int item_first_block(const call_t *call, int64_t j, int64_t *ci, int64_t *hh, int64_t *phys, int64_t *nt) {
    if (j < 0 || j >= call->item_off[call->ncaches]) return 0;
    const int64_t i = find_cache(call->item_off, call->ncaches, j);
    if (call->nsplit[i] <= 1) return 0;
    const gqa_cache_t *cc = &call->caches[i];
    int64_t h, sp;
    item_split(call, i, j - call->item_off[i], &h, &sp);
    const int64_t l0 = sp * SPLIT_T;
    int64_t base = 0;
    for (int64_t r = 0; r < cc->nruns; r++) {
        const int64_t a = cc->runs[2 * r], b = cc->runs[2 * r + 1];
        if (l0 < base + (b - a)) {
            const int64_t at = a + (l0 - base), to_grid = TILE_T - at % TILE_T, left = b - at;
            *ci = i;
            *hh = h;
            *phys = at;
            *nt = left < to_grid ? left : to_grid;
            return 1;
        }
        base += b - a;
    }
    return 0;
}

/* How the first block of a split was asked for already: not (CONT_NONE), by the split before it
 * on this thread, the same head's (CONT_SPLIT, when it lies in the same run), or by this
 * thread's previous item (CONT_ITEM: item_first_block's, whatever its run). */
enum { CONT_NONE = 0, CONT_SPLIT = 1, CONT_ITEM = 2 };

/* Head h of cache i over its logical positions [l0, l1) of split `split`, block by block; the
 * thread reads on to logical position `end` (>= l1; beyond l1 when its next item is the head's
 * next split): the split's last block then prefetches the next split's first one when that lies
 * in the same run. Else its last block prefetches the first block of work item `next` (>= 0:
 * this thread's next item, by pool.c's order), so that the thread's next item starts on lines
 * already on their way. `continued`: CONT_*. The item that completes a head's splits merges them
 * (in split order, whoever runs it), while its partials are still in cache. */
static void attend_head(const call_t *call, int64_t i, int64_t h, int64_t split, int64_t end, int continued,
                        int tid, int64_t next) {
    const gqa_cache_t *cc = &call->caches[i];
    const int64_t nsplit = call->nsplit[i], local = h * nsplit + split, s = call->s[i];
    const int64_t l0 = split * SPLIT_T, l1 = l0 + SPLIT_T < s ? l0 + SPLIT_T : s;
    const int64_t G = cc->g, d = cc->d;
    state_t st = thread_state(call, cc, tid);
    for (int64_t g = 0; g < G; g++) {
        st.m[g] = -INFINITY;
        st.l[g] = 0.0f;
    }
#if GQA_X86_64
    /* the head's only block on an AVX2 or AVX-512 dense path: the block writes the output rows */
    if (nsplit == 1 && (call->wide[i] == ISA_AVX2 || call->wide[i] == ISA_AVX512) && cc->enc == cc->io &&
        !cc->status && cc->nruns == 1 && s <= TILE_T - cc->runs[0] % TILE_T)
        st.out = (char *)cc->out + h * G * d * enc_size(cc->io);
#endif
    if (!st.out) memset(st.acc, 0, (size_t)(G * d) * sizeof(float));
    const block_fn block = call->block[i];
    const float *qf = st.q;
    if (call->wide[i] == ISA_AVX512 && cc->io == ENC_F32 && cc->enc == ENC_F32) {
        /* a float32 query read where it is, its scores times qscale (block_avx512.c): no copy, which
         * was ~10% of a short head's time hot; its lines asked for at once, as the copy read them */
        qf = (const float *)cc->q + h * G * d;
        st.smul = cc->qscale;
        prefetch_lines(qf, G * d * (int64_t)sizeof(float), 3);
#if GQA_X86_64
    } else if (block == block_dot_bf16 && cc->io == ENC_BF16) {
        /* the BF16 dot block splits the stream's bfloat16 query itself: the float32 one is made
         * only for a block of at most 8 positions, if the head has one (a short ring's); the
         * query's lines asked for at once here, as the widening read them */
        st.qlazy = 1;
        prefetch_lines((const uint16_t *)cc->q + h * G * d, G * d * (int64_t)sizeof(uint16_t), 3);
#endif
    } else {
        convert_query(cc, h, st.q, call->wide[i]);
    }
    if (call->deferred[i] == DEFER_HEAD || call->deferred[i] == DEFER_CODES) { /* this head's write, by the split that reads the row */
        int64_t at = 0;
        for (int64_t r = 0; r < cc->nruns; r++) {
            const int64_t a = cc->runs[2 * r], b = cc->runs[2 * r + 1];
            if (cc->write_row >= a && cc->write_row < b) {
                at += cc->write_row - a;
                break;
            }
            at += b - a;
        }
        if (at >= l0 && at < l1) {
            if (call->deferred[i] == DEFER_HEAD) {
                write_head(cc, h, 0);
            } else {
                int8_store_head(cc, call->coded + call->coded_at[i] * call->wfloats, h);
            }
        }
    }
    int64_t base = 0; /* logical position of the current run's start */
    for (int64_t r = 0; r < cc->nruns && base < l1; r++) {
        const int64_t a = cc->runs[2 * r], b = cc->runs[2 * r + 1];
        const int64_t lo = l0 > base ? l0 : base, hi = l1 < base + (b - a) ? l1 : base + (b - a);
        const int64_t reach = end < base + (b - a) ? end : base + (b - a); /* what this run's blocks prefetch */
        for (int64_t x = lo, nt; x < hi; x += nt) {
            /* blocks on the physical 64-position grid: with line-aligned rows, whole lines */
            const int64_t to_grid = TILE_T - (a + (x - base)) % TILE_T;
            nt = hi - x < to_grid ? hi - x : to_grid;
            /* later blocks: prefetched by the block before (the previous split's last one too) */
            const int asked = lo == l0 && (continued == CONT_ITEM || (continued == CONT_SPLIT && l0 > base));
            if (x == lo && !asked) prefetch_block(cc, h, a + (x - base), nt, 3);
            st.prefetch = x + nt < reach;
            if (next >= 0 && x + nt >= reach) { /* the item's last block: the next item's first on its way */
                int64_t ni, nh, nphys, nnt;
                if (item_first_block(call, next, &ni, &nh, &nphys, &nnt)) {
                    if (drips(block)) after_block(&call->caches[ni], nh, nphys, nnt, &st);
                    else prefetch_block(&call->caches[ni], nh, nphys, nnt, 2);
                }
                next = -1;
            }
            STAMP(tid, (int32_t)(split * 1000 + (x - l0) / TILE_T), STAMP_BLOCK);
            block(cc, qf, h, a + (x - base), nt, &st);
            st.after_kbytes = 0;
        }
        base += b - a;
    }
    /* a head's partials: in the thread's state when it has one split, else in the call's */
    if (nsplit == 1) {
        if (!st.out) finish_head(call, i, h, &st); /* else the block wrote the rows */
        return;
    }
    float *part = call->part + call->part_off[i] + local * G * (d + 2);
    for (int64_t g = 0; g < G; g++) {
        memcpy(part + g * (d + 2), st.acc + g * d, (size_t)d * sizeof(float));
        part[g * (d + 2) + d] = st.m[g];
        part[g * (d + 2) + d + 1] = st.l[g];
    }
    if (atomic_fetch_add(&call->done[call->head_off[i] + h], 1) + 1 == nsplit)
        merge_head(call, i, h, call->part + call->part_off[i] + h * nsplit * G * (d + 2), tid);
}

/* One work item: of a cache with several splits, one split of a head (its own partial, as if
 * alone); of a one-split cache, `hpi` consecutive heads (a short cache's heads in one item: its
 * set-up, the item's lookup, paid once for all of them). Which heads share an item changes no
 * output. next: the item this thread likely runs next (pool.c). */
static void attend_item_(void *ctx, int64_t item, int64_t next, int tid);
GQA_INTERNAL void attend_item(void *ctx, int64_t item, int64_t next, int tid) {
    STAMP_SET_ITEM(item);
    STAMP(tid, -1, STAMP_ITEM);
    attend_item_(ctx, item, next, tid);
    STAMP(tid, -1, STAMP_ITEM_END);
    STAMP_SET_ITEM(-1);
}

static void attend_item_(void *ctx, int64_t item, int64_t next, int tid) {
    const call_t *call = ctx;
    const int64_t i = find_cache(call->item_off, call->ncaches, item);
    const int64_t local = item - call->item_off[i], nsplit = call->nsplit[i];
    if (nsplit > 1) {
        int64_t h, sp, nh = -1, nsp = -1;
        item_split(call, i, local, &h, &sp);
        /* this thread's next item the head's next split: the stream runs on into it, the split's
         * last block asking for the next one's first as every block asks for the one after it */
        if (next > item && next < call->item_off[i + 1]) item_split(call, i, next - call->item_off[i], &nh, &nsp);
        const int follows = nh == h && nsp == sp + 1;
        const int64_t end = (sp + 1 + follows) * SPLIT_T < call->s[i] ? (sp + 1 + follows) * SPLIT_T : call->s[i];
        int64_t *ahead = &call->ahead[tid * AHEAD_STRIDE];
        attend_head(call, i, h, sp, end, ahead[0] == item ? (int)ahead[1] : CONT_NONE, tid, follows ? -1 : next);
        ahead[0] = next;
        ahead[1] = follows ? CONT_SPLIT : CONT_ITEM;
        return;
    }
    gqa_cache_t *cc = &call->caches[i];
    if (call->deferred[i] == DEFER_ROW) { /* an int8 row, quantized and written before its heads read it */
        cc->status = int8_write(cc, call->wbuf + tid * call->wfloats);
        if (cc->status) return;
    }
    const int64_t h0 = local * call->hpi[i], h1 = h0 + call->hpi[i] < cc->n ? h0 + call->hpi[i] : cc->n;
    for (int64_t h = h0; h < h1; h++) {
        /* the last head asks for this thread's next item's first head (its first block, query
         * and new rows) while it computes: the next cache is elsewhere in memory, a fresh start
         * for the hardware's prefetcher. Within an item nothing is asked for: a cache's heads
         * follow one another in its key and value storage, two streams the hardware follows,
         * and asking for each next head's lines as well cost 5-15% of a short cache's head hot
         * and saved nothing cold (docs/design.md, forty-fourth session) */
        if (h + 1 == h1) prefetch_item_start(call, next);
        attend_head(call, i, h, 0, call->s[i], 0, tid, -1);
    }
}

static void store_row(const call_t *call, int64_t i, int64_t at, float *o, int rotate) {
    const gqa_cache_t *cc = &call->caches[i];
    const int64_t d = cc->d;
    if (rotate) gqa_hadamard_rows(o, 1, d, d & -d); /* int8 values stored rotated */
#if GQA_X86_64
    if (call->wide[i] == ISA_AVX2 && cc->enc == ENC_BF16) unpair_row_avx2(o, d); /* block_avx2_bf16's order */
#endif
    if (cc->io == ENC_F32) memcpy((float *)cc->out + at, o, (size_t)d * sizeof(float));
#if GQA_X86_64
    else if (call->wide[i] == ISA_AVX512) narrow_row_avx512(cc->io, o, (uint16_t *)cc->out + at, d);
    else if (call->wide[i] == ISA_AVX2) narrow_row_avx2(cc->io, o, (uint16_t *)cc->out + at, d);
#endif
    else if (cc->io == ENC_BF16) for (int64_t j = 0; j < d; j++) ((uint16_t *)cc->out)[at + j] = float_to_bf16(o[j]);
    else for (int64_t j = 0; j < d; j++) ((uint16_t *)cc->out)[at + j] = float_to_half(o[j]);
}

/* Merge of one (cache, head): every split's partial rescaled to the common max, in split order. */
static void merge_head(const call_t *call, int64_t i, int64_t h, const float *base, int tid) {
    /* base: head h's partials (nsplit, G, D + 2) */
    const gqa_cache_t *cc = &call->caches[i];
    if (cc->status) return;
    const int64_t nsplit = call->nsplit[i], G = cc->g, d = cc->d;
    float *o = call->scratch + tid * call->scratch_floats; /* the state's m, l, acc: done with */
    for (int64_t gi = 0; gi < G; gi++) {
        float mmax = -INFINITY;
        for (int64_t sp = 0; sp < nsplit; sp++) {
            const float m = base[(sp * G + gi) * (d + 2) + d];
            if (m > mmax) mmax = m;
        }
        memset(o, 0, (size_t)d * sizeof(float));
        float total = 0.0f;
        for (int64_t sp = 0; sp < nsplit; sp++) {
            const float *pt = base + (sp * G + gi) * (d + 2);
            if (pt[d + 1] == 0.0f) continue;
            const float w = expf(pt[d] - mmax);
            total += w * pt[d + 1];
            for (int64_t j = 0; j < d; j++) o[j] += w * pt[j];
        }
        const float inv = 1.0f / total;
        for (int64_t j = 0; j < d; j++) o[j] *= inv;
        store_row(call, i, (h * G + gi) * d, o, cc->flags & FLAG_ROTATE);
    }
}

/* A one-split head's output from its own state, in place: what merge_head computes for it (its
 * one partial has weight expf(0) = 1, so o = (0 + acc) / l, bit for bit; NaN rows for l = 0, as
 * there), without copying the partial out and back. */
static void finish_head(const call_t *call, int64_t i, int64_t h, const state_t *st) {
    const gqa_cache_t *cc = &call->caches[i];
    if (cc->status) return;
    const int64_t G = cc->g, d = cc->d;
#if GQA_X86_64
    if (call->wide[i] == ISA_AVX2 && cc->enc == cc->io) { /* a dense cache on AVX2: one pass */
        finish_rows_avx2(cc->io, st->acc, st->l, G, d, (char *)cc->out + h * G * d * enc_size(cc->io));
        return;
    }
    if (call->wide[i] == ISA_AVX512 && !(cc->flags & FLAG_ROTATE)) { /* one pass on AVX-512 too */
        finish_rows_avx512(cc->io, st->acc, st->l, G, d, (char *)cc->out + h * G * d * enc_size(cc->io));
        return;
    }
#endif
    for (int64_t gi = 0; gi < G; gi++) {
        float *o = st->acc + gi * d;
        const float l = st->l[gi], inv = 1.0f / l;
        if (l == 0.0f)
            for (int64_t j = 0; j < d; j++) o[j] = 0.0f * inv;
        else
            for (int64_t j = 0; j < d; j++) o[j] = (0.0f + o[j]) * inv;
    }
    /* int8 values stored rotated: the head's G rows rotated back in one call */
    if (cc->flags & FLAG_ROTATE) gqa_hadamard_rows(st->acc, G, d, d & -d);
    for (int64_t gi = 0; gi < G; gi++) store_row(call, i, (h * G + gi) * d, st->acc + gi * d, 0);
}
