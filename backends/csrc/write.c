/*
 * The step's write: the new token's key and value into ring row write_row. Dense caches per KV
 * head (by the work item that reads the row, or before the items when the row is not
 * attended); int8 caches quantized whole, before their attention, then stored whole by the
 * cache's work item when its heads are one (int8_write), else head by head by the items that
 * read the row (int8_quantize before the items, int8_store_head by them).
 *
 * A step is atomic because nothing can fail once its write has begun: every check, every
 * allocation and int8's quantization come first (run.c, int8_quantize), and a cache refused there
 * is not written at all. So the bytes a write overwrites are kept (in `saved`, for `restore` to
 * put back) only where a failure after the write exists: a test build's injected one
 * (test_hooks.c), which checks that such a failure would leave the cache byte-identical. The
 * production library keeps nothing: the copy cost 6-11% of a hot step of 16 short caches
 * (docs/design.md, "Short blocks").
 */
#include <float.h>

#include "gqa_internal.h"

#ifdef GQA_TEST_HOOKS
#define KEEP_OVERWRITTEN 1
#else
#define KEEP_OVERWRITTEN 0
#endif

/* Whether the n elements at p (encoding enc) are finite and within +-limit. */
static int within(int enc, const void *p, int64_t n, float limit) {
    int ok = 1; /* no early exit: the loops vectorize (NaN compares false, so fails too) */
#if GQA_X86_64
    if (enc == ENC_F32 && gqa_avx512_usable()) return within_f32_avx512(p, n, limit);
    if (enc == ENC_F32 && gqa_avx2_usable()) return within_f32_avx2(p, n, limit);
#endif
    if (enc == ENC_F32) {
        const float *f = p;
        for (int64_t i = 0; i < n; i++) ok &= fabsf(f[i]) <= limit;
    } else if (enc == ENC_BF16) {
        const uint16_t *h = p;
        for (int64_t i = 0; i < n; i++) ok &= fabsf(bf16_to_float(h[i])) <= limit;
    } else {
        for (int64_t i = 0; i < n; i++) ok &= fabsf(load_elem(enc, p, i)) <= limit;
    }
    return ok;
}

/* int8: the row's query and value finite, its key finite and within float16's range (outlier
 * channels are stored as float16), as backends/int8_storage.check_values requires. */
static int int8_values_ok(const gqa_cache_t *x) {
    const int64_t nd = x->n * x->d;
    /* FLT_MAX, not INFINITY: |inf| <= inf would pass */
    return within(x->io, x->q, nd * x->g, FLT_MAX) && within(x->io, x->new_k, nd, 65504.0f) &&
           within(x->io, x->new_v, nd, FLT_MAX);
}

/* int8: the new token's bytes per KV head in `saved` (key codes, outlier channels, value codes,
 * two scales), so that a failure puts them back. */
static int64_t int8_saved_bytes(const gqa_cache_t *cc) {
    return cc->dk + 2 * cc->no + cc->d + 2 * ((cc->flags & FLAG_HALF_SCALES) ? 2 : 4);
}

/* int8: KV head h's bytes of the new token's row to its part of `saved` (restore: back), in a
 * test build; nothing in production. */
static void int8_swap_head(const gqa_cache_t *cc, int64_t h, int restore) {
    if (!KEEP_OVERWRITTEN) return;
    const int64_t d = cc->d, dk = cc->dk, no = cc->no, c = cc->c, row = cc->write_row;
    const int64_t sel = (cc->flags & FLAG_HALF_SCALES) ? 2 : 4, per = int8_saved_bytes(cc);
    char *sv = (char *)cc->saved + h * per;
    char *cells[4];
    int64_t sizes[4];
    int64_t line; /* int8 keys: one code a word, channel j's at column + j * line */
    char *column = (char *)cc->k + key_block(cc, h, row, &line);
    for (int64_t j = 0; j < dk; j++) {
        char *cell = column + j * line;
        if (restore) *cell = sv[j];
        else sv[j] = *cell;
    }
    for (int64_t o = 0; o < no; o++) {
        char *cell = (char *)(cc->ko + (h * no + o) * c + row);
        if (restore) memcpy(cell, sv + dk + 2 * o, 2);
        else memcpy(sv + dk + 2 * o, cell, 2);
    }
    cells[0] = (char *)cc->v + (h * c + row) * d;
    sizes[0] = d;
    cells[1] = (char *)cc->ks + (h * cc->scale_stride + row) * sel;
    cells[2] = (char *)cc->vs + (h * cc->scale_stride + row) * sel;
    sizes[1] = sizes[2] = sel;
    char *at = sv + dk + 2 * no;
    for (int x = 0; x < 3; x++) {
        if (restore) memcpy(cells[x], at, (size_t)sizes[x]);
        else memcpy(at, cells[x], (size_t)sizes[x]);
        at += sizes[x];
    }
}

GQA_INTERNAL void int8_swap_row(const gqa_cache_t *cc, int restore) {
    for (int64_t h = 0; h < cc->n; h++) int8_swap_head(cc, h, restore);
}

/* int8: the step's row checked and quantized into buf (2 N D floats and 2 N D + 2 N bytes of
 * room), nothing written to the cache: keys in the stored order, coded channels quantized,
 * outlier ones kept as float32; values rotated (FLAG_ROTATE) and quantized. -EDOM for a value
 * int8_values_ok refuses (the caller names the tensor), -ERANGE if a scale overflows; 0 and
 * the row in buf for int8_store_head otherwise. */
GQA_INTERNAL int int8_quantize(const gqa_cache_t *cc, float *buf) {
    if (!int8_values_ok(cc)) return -EDOM;
    const int64_t n = cc->n, d = cc->d, dk = cc->dk, no = cc->no;
    float *keys = buf, *vals = buf + n * d, *ksc = buf + 2 * n * d, *vsc = ksc + n;
    int8_t *kcodes = (int8_t *)(vsc + n), *vcodes = kcodes + n * d;
    float *coded = keys; /* (n, dk) packed, then the outliers (n, no) at keys + n * dk */
    for (int64_t h = 0; h < n; h++) {
        const int64_t *order = cc->order + h * d;
        if (cc->io == ENC_F32) { /* a plain gather */
            const float *src = (const float *)cc->new_k + h * d;
            for (int64_t j = 0; j < dk; j++) coded[h * dk + j] = src[order[j]];
            for (int64_t j = dk; j < d; j++) vals[h * no + (j - dk)] = src[order[j]]; /* outliers, parked */
            continue;
        }
        for (int64_t j = 0; j < d; j++) {
            const float x = load_elem(cc->io, cc->new_k, h * d + order[j]);
            if (j < dk) coded[h * dk + j] = x;
            else vals[h * no + (j - dk)] = x; /* outliers parked in vals for now */
        }
    }
    memmove(keys + n * dk, vals, (size_t)(n * no) * sizeof(float));
    int rc = dk ? quantize_rows(coded, n, dk, cc->flags, kcodes, ksc) : 0;
    if (rc) return rc;
    if (cc->io == ENC_F32) memcpy(vals, cc->new_v, (size_t)(n * d) * sizeof(float));
    else
        for (int64_t x = 0; x < n * d; x++) vals[x] = load_elem(cc->io, cc->new_v, x);
    if (cc->flags & FLAG_ROTATE) gqa_hadamard_rows(vals, n, d, d & -d);
    return quantize_rows(vals, n, d, cc->flags, vcodes, vsc);
}

/* int8: KV head h's part of the row int8_quantize left in buf, stored into ring row write_row
 * (key codes down their column, outlier channels as float16, value codes, two scales; the old
 * bytes to saved first in a test build). */
GQA_INTERNAL void int8_store_head(const gqa_cache_t *cc, const float *buf, int64_t h) {
    int8_swap_head(cc, h, 0);
    const int64_t n = cc->n, d = cc->d, dk = cc->dk, no = cc->no, c = cc->c, row = cc->write_row;
    const float *outl = buf + n * dk, *ksc = buf + 2 * n * d, *vsc = ksc + n;
    const int8_t *kcodes = (const int8_t *)(vsc + n), *vcodes = kcodes + n * d;
    int64_t line;
    int8_t *column = (int8_t *)cc->k + key_block(cc, h, row, &line);
    for (int64_t j = 0; j < dk; j++) column[j * line] = kcodes[h * dk + j];
    for (int64_t o = 0; o < no; o++) ((uint16_t *)cc->ko)[(h * no + o) * c + row] = float_to_half(outl[h * no + o]);
    memcpy((int8_t *)cc->v + (h * c + row) * d, vcodes + h * d, (size_t)d);
    const int64_t at = h * cc->scale_stride + row;
    if (cc->flags & FLAG_HALF_SCALES) {
        ((uint16_t *)cc->ks)[at] = float_to_half(ksc[h]);
        ((uint16_t *)cc->vs)[at] = float_to_half(vsc[h]);
    } else {
        ((float *)cc->ks)[at] = ksc[h];
        ((float *)cc->vs)[at] = vsc[h];
    }
}

/* int8: every head's part of the row int8_quantize left in buf, stored (int8_store_head). */
GQA_INTERNAL void int8_store(const gqa_cache_t *cc, const float *buf) {
    for (int64_t h = 0; h < cc->n; h++) int8_store_head(cc, buf, h);
}

/* int8: the step's write, whole. buf: as int8_quantize's. Nothing written when it fails
 * (int8_quantize's codes). */
GQA_INTERNAL int int8_write(const gqa_cache_t *cc, float *buf) {
    const int rc = int8_quantize(cc, buf);
    if (!rc) int8_store(cc, buf);
    return rc;
}

/* A key column's `words` words of `word` bytes (a line's P channels of one position), one per
 * line, `line` bytes apart, written from src (the old bytes to sv first in a test build;
 * restore: sv's back).
 * word is a constant after inlining: one load and one store per line, no division. */
static inline __attribute__((always_inline)) void swap_words(char *kk, char *sv, const char *src, int64_t words,
                                                             int64_t line, const int64_t word, int restore) {
    for (int64_t l = 0; l < words; l++) {
        char *cell = kk + l * line;
        if (restore) {
            memcpy(cell, sv + l * word, (size_t)word);
        } else {
            if (KEEP_OVERWRITTEN) memcpy(sv + l * word, cell, (size_t)word);
            memcpy(cell, src + l * word, (size_t)word);
        }
    }
}

/* The step's write for KV head h: its key column and value row of ring row `write_row`, the
 * old bytes to saved in a test build (or back, restore). */
GQA_INTERNAL void write_head(const gqa_cache_t *cc, int64_t h, int restore) {
    const int64_t el = enc_size(cc->enc), n = cc->n, d = cc->d, row = cc->write_row;
    char *saved = cc->saved;
    int64_t line;
    const int64_t p = kpack(cc->enc), word = p * el;
    char *kk = (char *)cc->k + key_block(cc, h, row, &line) * el, *sv = saved + h * d * el;
    const char *src = (const char *)cc->new_k + h * d * el;
    line *= el;
    if (word == 4) swap_words(kk, sv, src, d / p, line, 4, restore);
    else swap_words(kk, sv, src, d / p, line, 2, restore);
    if (d % p) /* an odd bfloat16 width: the last line's first channel alone (the other is padding) */
        swap_words(kk + d / p * line, sv + d / p * word, src + d / p * word, 1, line, 2, restore);
    char *cell = (char *)cc->v + (h * cc->c + row) * d * el, *keep = saved + (n + h) * d * el;
    if (restore) {
        memcpy(cell, keep, (size_t)(d * el));
    } else {
        if (KEEP_OVERWRITTEN) memcpy(keep, cell, (size_t)(d * el));
        memcpy(cell, (const char *)cc->new_v + h * d * el, (size_t)(d * el));
    }
}

/* The step's write: key column and value row of ring row `write_row` (the old bytes to saved in
 * a test build). */
GQA_INTERNAL void write_row(const gqa_cache_t *cc, int restore) {
    for (int64_t h = 0; h < cc->n; h++) write_head(cc, h, restore);
}
