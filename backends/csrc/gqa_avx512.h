/*
 * gqa_avx512.h: the AVX-512 pieces the block files share (block_avx512.c, block_avx512_bf16.c):
 * exp, the lane masks, widening 16 elements of any encoding, the online-softmax update of a
 * block, the weighted sum of its value rows and a block's addresses. All inline: each block
 * function gets its own copy, specialized to its encoding and tile by constant folding.
 */
#ifndef GQA_AVX512_H
#define GQA_AVX512_H

#include "gqa_internal.h"

#if GQA_X86_64
#include <immintrin.h>
#ifdef GQA_EMULATE_AVX512
#include "gqa_emu512.h"
#endif

/* exp(x) for x <= 0 (x = -inf gives 0): 2^n * e^r with |r| <= ln2 / 2, a degree-7 Taylor
 * polynomial for e^r (relative error below 1e-8, under float32's rounding). */
AVX512 static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x); /* below: 0 after scalef; a NaN stays NaN (exp256) */
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
    __m512 y = _mm512_set1_ps(1.0f / 5040.0f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 720.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 120.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 24.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 6.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* The lanes of the i-th group of 16 positions that a block of nt positions fills. */
static inline __mmask16 lanes16(int64_t nt, int i) {
    const int64_t left = nt - 16 * i;
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

/* 16 consecutive elements of encoding enc widened to float32 in a register (masked lanes 0). */
AVX512 static inline __attribute__((always_inline)) __m512 widen16(const int enc, const void *p, __mmask16 mask) {
    switch (enc) {
        case ENC_F32: return _mm512_maskz_loadu_ps(mask, p);
        case ENC_BF16:
            return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
        case ENC_F16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
        default: return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p)));
    }
}

/* 16 float32 lanes to float16/bfloat16 (enc), bit for bit as store_elem: round to nearest
 * even; a NaN becomes float_to_half's or float_to_bf16's quiet NaN of the same sign. */
AVX512 static inline __attribute__((always_inline)) __m256i narrow16(const int enc, __m512 v) {
    const __m512i bits = _mm512_castps_si512(v), high = _mm512_srli_epi32(bits, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (enc == ENC_F16) {
        const __m512i qnan = _mm512_or_si512(_mm512_and_si512(high, _mm512_set1_epi32(0x8000)), _mm512_set1_epi32(0x7E00));
        return _mm256_mask_mov_epi16(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), nan,
                                     _mm512_cvtepi32_epi16(qnan));
    }
    /* rounded in the high halves, which one word permutation gathers: a narrowing store
     * (vpmovdw to memory) costs several times a plain one here */
    const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    r = _mm512_mask_or_epi32(r, nan, bits, _mm512_set1_epi32(0x400000));
    const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27,
                                         25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_castsi512_si256(_mm512_permutexvar_epi16(odd, r));
}

/* 16 lanes of a one-split head's output row, finished as attend.c's finish_head does it:
 * (0 + acc) x inv, or 0 x inv (a NaN row) where the head's sum l is 0 (`empty`); stored from
 * element x of `row` on, in encoding enc, under mask m. */
AVX512 static inline __attribute__((always_inline)) void store_finished16(const int enc, void *row, int64_t x,
                                                                          __mmask16 m, __m512 acc, __m512 vinv,
                                                                          int empty) {
    const __m512 zero = _mm512_setzero_ps();
    const __m512 f = _mm512_mul_ps(empty ? zero : _mm512_add_ps(zero, acc), vinv);
    if (enc == ENC_F32) _mm512_mask_storeu_ps((float *)row + x, m, f);
    else _mm256_mask_storeu_epi16((uint16_t *)row + x, m, narrow16(enc, f));
}

#ifndef DRIP_SOFTMAX
#define DRIP_SOFTMAX 4 /* a head's softmax, in drip slots (a key row or a value row each one) */
#endif

/* The next block's lines, asked for a few at a time through the whole of this block: its key
 * rows, then its value rows, `per` lines a slot. A slot is a key row of the scores, a head's
 * softmax (DRIP_SOFTMAX slots) or a value row of one pass of the value sum, so the requests keep
 * pace with the block's arithmetic. Asked for only by the loops that read the same kind of rows
 * (the next keys from the scores, the next values from the first pass), they stopped through
 * the softmax and the later passes, and the core's fill buffers sat idle: the cold step took the
 * sum of its arithmetic and its memory time (docs/design.md, "The next block, asked for a few
 * lines at a time").
 *
 * A slot's lines are asked for one before each of its loads (drip_slot, then drip_line), what
 * is left at the block's end (drip_rest): a slot's `per` requests issued together, then its
 * loads, read 10-12% slower cold on a Sapphire Rapids core, where a loop of loads and FMAs read
 * 18.5 GB/s a core with one request before each load and 11.5 with four before every four
 * (docs/design.md, "One request before each load"). */
typedef struct {
    const char *at, *end; /* the range being asked for */
    const char *v, *vend; /* the value rows, after the keys */
    int64_t per;          /* lines a slot (0: none, an idle drip or a tile after the first) */
    int64_t owed;         /* lines the slots so far have earned and not asked for (drip_line's) */
} drip_t;

/* `slots` slots begin: their lines are owed, for the loads that follow to ask for (drip_line). */
static inline __attribute__((always_inline)) void drip_slot(drip_t *c, int64_t slots) { c->owed += c->per * slots; }

/* One owed line asked for, before one load of this block. */
AVX512 static inline __attribute__((always_inline)) void drip_line(drip_t *c) {
    if (c->owed <= 0) return;
    c->owed--;
    const char *at = c->at;
    if (at >= c->end) {
        if (c->v >= c->vend) {
            c->owed = 0;
            return;
        }
        at = c->v;
        c->end = c->vend;
        c->v = c->vend;
    }
    _mm_prefetch(at, _MM_HINT_T1);
    c->at = at + 64;
}

/* What the slots left of the block's lines (rounding), asked for at once at its end. */
AVX512 static inline __attribute__((always_inline)) void drip_rest(drip_t *c) {
    for (const char *at = c->at; at < c->end; at += 64) _mm_prefetch(at, _MM_HINT_T1);
    for (const char *at = c->v; at < c->vend; at += 64) _mm_prefetch(at, _MM_HINT_T1);
    c->at = c->end;
    c->v = c->vend;
    c->owed = 0;
}

/* Passes of pv_block_avx512 over a block's value rows for gt query heads. */
static inline int64_t pv_passes(int enc, int64_t d, int64_t gt) {
    return d == 128 && enc != ENC_F16 ? (gt + 1) / 2 : d / 64 + (d % 64) / 16;
}

/* The drip of the block after [phys, phys + nt) of a head, when the item reads that block
 * (st->prefetch; else an idle drip, per 0, which asks for nothing): its key rows (krows of
 * knline elements from kn), then its value rows (after this block's nt from vb, a block's worth
 * or up to the ring's end), spread over this block's slots in every tile: kslots key rows (0
 * where the scores do not drip), each head's softmax, each pass of the value sum over the nt
 * rows. Returned by value: a block keeps it in a local whose address only its inlined code
 * sees, so the compiler keeps its fields in registers (in memory, each slot's bookkeeping was
 * a chain of stores and reloads through the whole block). */
static inline __attribute__((always_inline)) drip_t drip_next(const int enc, const gqa_cache_t *cc,
                                                              const state_t *st, int64_t krows, const char *kn,
                                                              int64_t knline, const char *vb, int64_t phys,
                                                              int64_t nt, int64_t kslots) {
    const int64_t d = cc->d;
    const char *k = kn, *v = vb + nt * d * enc_size(enc);
    int64_t kbytes, vbytes;
    if (st->prefetch) {
        const int64_t next = phys + nt, vrows = cc->c - next < TILE_T ? cc->c - next : TILE_T;
        kbytes = krows * knline * enc_size(enc);
        vbytes = vrows * d * enc_size(enc);
    } else if (st->after_kbytes) { /* an item's last block: the next item's first */
        k = st->after_k;
        kbytes = st->after_kbytes;
        v = st->after_v;
        vbytes = st->after_vbytes;
    } else {
        return (drip_t){k, k, v, v, 0, 0};
    }
    const int64_t lines = (kbytes + 63) / 64 + (vbytes + 63) / 64;
    int64_t slots = 0;
    for (int64_t g0 = 0; g0 < cc->g; g0 += TILE_G) {
        const int64_t gt = cc->g - g0 < TILE_G ? cc->g - g0 : TILE_G;
        slots += kslots + gt * DRIP_SOFTMAX + pv_passes(enc, d, gt) * nt;
    }
    return (drip_t){k, k + kbytes, v, v + vbytes, slots > 0 ? (lines + slots - 1) / slots : lines, 0};
}

/* acc[g][j0 : j0 + 16 nv] += sum_t p[g][t] * value[t][j0 : ...] for a block: nv (at most 8)
 * registers of 16 channels per query head, gt x nv at most 16, all constants after inlining so
 * the accumulators stay in registers. Every row of every pass is a slot of the drip dr.
 * out (or NULL): the block is its heads' only one (st->out, a dense cache): the
 * sums start at 0 in registers (acc_mem is not read) and end as the heads' output rows (gt rows
 * of d in the stream's dtype from out), finished as finish_rows_avx512 does: the same bits,
 * without clearing, storing and reading the accumulators again. */
AVX512 static inline __attribute__((always_inline)) void pv_avx512(
    const int enc, float *acc_mem, int64_t d, int64_t j0, const char *vb, const float *p, int64_t nt, const int gt,
    const int nv, drip_t *dr, void *out, const float *l) {
    const int64_t el = enc_size(enc);
    __m512 acc[TILE_G][8];
    for (int g = 0; g < gt; g++)
        for (int i = 0; i < nv; i++) acc[g][i] = out ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_mem + g * d + j0 + 16 * i);
    for (int64_t t = 0; t < nt; t++) {
        const char *row = vb + (t * d + j0) * el;
        drip_slot(dr, 1);
        __m512 vf[8];
        for (int i = 0; i < nv; i++) {
            drip_line(dr);
            vf[i] = widen16(enc, row + 16 * i * el, 0xFFFF);
        }
        for (int g = 0; g < gt; g++) {
            const __m512 w = _mm512_set1_ps(p[g * TILE_T + t]);
            for (int i = 0; i < nv; i++) acc[g][i] = _mm512_fmadd_ps(w, vf[i], acc[g][i]);
        }
    }
    if (out) { /* the heads' only block: their output rows, finished in registers */
        for (int g = 0; g < gt; g++) {
            const __m512 vinv = _mm512_set1_ps(1.0f / l[g]);
            const int empty = l[g] == 0.0f;
            char *row = (char *)out + g * d * enc_size(enc);
            for (int i = 0; i < nv; i++) store_finished16(enc, row, j0 + 16 * i, 0xFFFF, acc[g][i], vinv, empty);
        }
        return;
    }
    for (int g = 0; g < gt; g++)
        for (int i = 0; i < nv; i++) _mm512_storeu_ps(acc_mem + g * d + j0 + 16 * i, acc[g][i]);
}

/* A block's weighted value sum for `gt` query heads (acc: gt x d, p: gt x TILE_T; out and l:
 * pv_avx512's, the output rows of the tile and its heads' sums). For d = 128
 * (the common head width) the query heads go two at a time over whole rows: each pass reads the
 * block's rows in order, where four heads at a time fit only half a row's 8 registers each and
 * read every row in two strided halves (docs/design.md, "The value sum over whole rows": 9-14%
 * of a long float32 step). Otherwise, and for float16 at any width, 64 channels at a time for
 * all gt heads: float16's rows are then widened once for all the heads, not once per pair, which
 * on a CPU that issues few 512-bit operations a cycle outweighs the strided halves (bfloat16,
 * whose widening is two operations, measured the other way; docs/design.md, twenty-seventh
 * session). The same sums in the same order either way. */
AVX512 static inline __attribute__((always_inline)) void pv_block_avx512(
    const int enc, float *acc_mem, int64_t d, const char *vb, const float *p, int64_t nt, const int gt,
    drip_t *dr, void *out, const float *l) {
    if (d == 128 && enc != ENC_F16) {
        int g = 0;
        for (; g + 2 <= gt; g += 2)
            pv_avx512(enc, acc_mem + g * d, d, 0, vb, p + g * TILE_T, nt, 2, 8, dr,
                      out ? (char *)out + g * d * enc_size(enc) : NULL, l + g);
        if (g < gt)
            pv_avx512(enc, acc_mem + g * d, d, 0, vb, p + g * TILE_T, nt, 1, 8, dr,
                      out ? (char *)out + g * d * enc_size(enc) : NULL, l + g);
        return;
    }
    int64_t j0 = 0;
    for (; j0 + 64 <= d; j0 += 64) pv_avx512(enc, acc_mem, d, j0, vb, p, nt, gt, 4, dr, out, l);
    for (; j0 < d; j0 += 16) pv_avx512(enc, acc_mem, d, j0, vb, p, nt, gt, 1, dr, out, l);
}

/* The shared online-softmax update of one block for `gt` query heads: p[g][t] holds the scores
 * (-inf past nt) and becomes exp(score - m) (times vs[t] when given); the running max m, sum l
 * and accumulators acc (gt x d) are rescaled when the max grows. */
AVX512 static inline __attribute__((always_inline)) void softmax_avx512(
    float *p, int64_t nt, const float *vs, int64_t d, const int gt, const int ng, float *ms, float *ls, float *accs,
    drip_t *dr) {
    /* ng (a constant): the groups of 16 lanes that can hold a position (1 for nt <= 16); the
     * others are all -inf, weight 0, and add nothing to the sum: skipped, the same bits */
    __mmask16 mask[4];
    for (int i = 0; i < 4; i++) mask[i] = lanes16(nt, i);
    for (int g = 0; g < gt; g++) {
        if (dr) drip_slot(dr, DRIP_SOFTMAX); /* asked for by the value sum's loads */
        float *pg = p + g * TILE_T;
        __m512 mx = _mm512_max_ps(_mm512_max_ps(_mm512_loadu_ps(pg), _mm512_loadu_ps(pg + 16)),
                                  _mm512_max_ps(_mm512_loadu_ps(pg + 32), _mm512_loadu_ps(pg + 48)));
        const float bmax = _mm512_reduce_max_ps(mx);
        float *m = ms + g, *l = ls + g, *acc = accs + g * d;
        if (bmax > *m) {
            if (*l != 0.0f) { /* l == 0: no block summed yet, acc all +0 (or not kept: st->out), as alpha leaves it */
                const float alpha = expf(*m - bmax);
                *l *= alpha;
                const __m512 a = _mm512_set1_ps(alpha);
                for (int64_t j = 0; j < d; j += 16) _mm512_storeu_ps(acc + j, _mm512_mul_ps(a, _mm512_loadu_ps(acc + j)));
            }
            *m = bmax;
        }
        const __m512 mm = _mm512_set1_ps(*m);
        __m512 sum = _mm512_setzero_ps();
        for (int i = 0; i < ng; i++) {
            const __m512 e = _mm512_maskz_mov_ps(mask[i], exp512(_mm512_sub_ps(_mm512_loadu_ps(pg + 16 * i), mm)));
            sum = _mm512_add_ps(sum, e);
            _mm512_storeu_ps(pg + 16 * i, vs ? _mm512_mul_ps(e, _mm512_maskz_loadu_ps(mask[i], vs + 16 * i)) : e);
        }
        *l += _mm512_reduce_add_ps(sum);
    }
}

/* softmax_avx512 over the groups of 16 positions that hold a block's nt (1 to 4, each a
 * constant there). */
AVX512 static inline __attribute__((always_inline)) void softmax_groups(float *p, int64_t nt, const float *vs, int64_t d,
                                                                        const int gt, float *ms, float *ls, float *accs,
                                                                        drip_t *dr) {
    switch ((nt + 15) / 16) {
        case 1: softmax_avx512(p, nt, vs, d, gt, 1, ms, ls, accs, dr); break;
        case 2: softmax_avx512(p, nt, vs, d, gt, 2, ms, ls, accs, dr); break;
        case 3: softmax_avx512(p, nt, vs, d, gt, 3, ms, ls, accs, dr); break;
        default: softmax_avx512(p, nt, vs, d, gt, 4, ms, ls, accs, dr); break;
    }
}

/* A block's addresses: its keys kb (lines kline elements apart), the next block's kn (knline;
 * kb when the item does not read it), its values vb, and int8's scales as float32 (ks, vs). */
AVX512 static inline __attribute__((always_inline)) void block_setup_avx512(
    const int enc, const gqa_cache_t *cc, int64_t h, int64_t phys, int64_t nt, state_t *st, const char **kbp,
    int64_t *kline, const char **knp, int64_t *knline, const char **vbp, const float **ksp, const float **vsp) {
    const int64_t d = cc->d, c = cc->c, el = enc_size(enc);
    const char *kb = (const char *)cc->k + key_block(cc, h, phys, kline) * el, *kn = kb;
    *knline = 0;
    if (st->prefetch) kn = (const char *)cc->k + key_block(cc, h, phys + nt, knline) * el;
    *kbp = kb;
    *knp = kn;
    *vbp = (const char *)cc->v + (h * c + phys) * d * el;
    const float *ks = NULL, *vs = NULL;
    if (enc == ENC_INT8) {
        const int64_t at = h * cc->scale_stride + phys;
        if (cc->flags & FLAG_HALF_SCALES) { /* 64 scales in four conversions */
            for (int i = 0; i < 4; i++) {
                const __mmask16 m = lanes16(nt, i);
                _mm512_storeu_ps(st->ksb + 16 * i, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)cc->ks + at + 16 * i)));
                _mm512_storeu_ps(st->vsb + 16 * i, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)cc->vs + at + 16 * i)));
            }
            ks = st->ksb;
            vs = st->vsb;
        } else {
            ks = (const float *)cc->ks + at;
            vs = (const float *)cc->vs + at;
        }
    }
    *ksp = ks;
    *vsp = vs;
    if (enc == ENC_INT8 && st->prefetch) prefetch_int8_side(cc, h, phys + nt, TILE_T, 2); /* the next block's */
}

#endif /* GQA_X86_64 */
#endif /* GQA_AVX512_H */
