/*
 * The bfloat16 block with BF16 dot products (ISA_AVX512_DOT: AVX-512 BF16): keys hold two
 * channels of a position per 32-bit word, vdpbf16ps's operand, multiplied with the query split
 * into bfloat16 pieces once per work item. Values widened as in block_avx512.c.
 */
#include "gqa_avx512.h"

/* Blocks of up to this many positions (a short ring's) take the widening block
 * (block_avx512_bf16's 8-lane scores, each key line read once for every head): there
 * vdpbf16ps' 16 lanes are mostly masked off and the query's split is pure overhead. Sapphire
 * Rapids, 64 short caches hot: 154 -> 132 us a call (docs/design.md, twenty-second session). */
#ifndef BF16_WIDEN_MAX_T
#define BF16_WIDEN_MAX_T 8
#endif

#if GQA_X86_64
/* bfloat16 with BF16 dot products: the query of one head as bfloat16 pieces per channel,
 * pairs of channels a word, padded with zeros to key_width channels, in st->qb. A bfloat16
 * query (a dense cache's) is its own one exact piece, the scores then times qscale (st->qmul);
 * any other query is qf (scaled) in BPIECES pieces, each what the ones before left (2 hold 16
 * of float32's 24 bits). Portable and deterministic: the same pieces whichever thread. */
static void split_query_bf16(const gqa_cache_t *cc, int64_t h, const float *qf, state_t *st) {
    const int64_t G = cc->g, d = cc->d, dk = cc->dk, dq = dk + cc->no, kp = key_width(cc);
    const int exact = cc->io == ENC_BF16 && !cc->order;
    uint16_t *out = st->qb;
    st->qpieces = exact ? 1 : BPIECES;
    st->qmul = exact ? cc->qscale : 1.0f;
    for (int64_t g = 0; g < G; g++) {
        uint16_t *row = out + g * BPIECES * kp; /* piece p of head g at row + p * kp */
        if (exact) { /* the pieces past the first are never read */
            memcpy(row, (const uint16_t *)cc->q + (h * G + g) * d, (size_t)dk * sizeof *row);
            memset(row + dk, 0, (size_t)(kp - dk) * sizeof *row);
            continue;
        }
        memset(row, 0, (size_t)(BPIECES * kp) * sizeof *row);
        for (int64_t j = 0; j < dk; j++) {
            float r = qf[g * dq + j];
            for (int p = 0; p < BPIECES; p++) {
                const uint16_t b = float_to_bf16(r);
                row[p * kp + j] = b;
                r -= bf16_to_float(b);
            }
        }
    }
    st->qready = 1;
}

/* bfloat16 scores with vdpbf16ps: a word of 2 key channels of a position against the same 2
 * channels of a query piece, every piece into the same float32 accumulators. */
AVX512DOT static inline __attribute__((always_inline)) void scores_dpbf16(
    const uint16_t *qb, const int pieces, float mul, int64_t kp, const char *kb, int64_t kline, int64_t nt,
    const int gt, const int ng, drip_t *dr, float *out) {
    __m512 acc[TILE_G][4];
    __mmask16 mask[4];
    for (int i = 0; i < 4; i++) {
        mask[i] = lanes16(nt, i);
        for (int g = 0; g < gt; g++) acc[g][i] = _mm512_setzero_ps();
    }
    for (int64_t l = 0; 2 * l < kp; l++) {
        const char *row = kb + l * kline * 2;
        if (dr) drip(dr, 1);
        __m512i kw[4];
        for (int i = 0; i < ng; i++) kw[i] = _mm512_maskz_loadu_epi32(mask[i], row + 64 * i);
        for (int g = 0; g < gt; g++)
            for (int p = 0; p < pieces; p++) {
                int32_t word;
                memcpy(&word, qb + (g * BPIECES + p) * kp + 2 * l, 4);
                const __m512bh qw = (__m512bh)_mm512_set1_epi32(word);
                for (int i = 0; i < ng; i++) acc[g][i] = _mm512_dpbf16_ps(acc[g][i], (__m512bh)kw[i], qw);
            }
    }
    const __m512 m = _mm512_set1_ps(mul);
    for (int i = 0; i < 4; i++)
        for (int g = 0; g < gt; g++)
            _mm512_storeu_ps(out + g * TILE_T + 16 * i,
                             _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mask[i], _mm512_mul_ps(acc[g][i], m)));
}

/* tile_avx512 for bfloat16 with its scores by vdpbf16ps (the query split once per work item). */
AVX512DOT static inline __attribute__((always_inline)) void tile_dot(
    const int enc, const gqa_cache_t *cc, int64_t g0, const int gt, const char *kb, int64_t kline, const char *vb,
    const float *vs, int64_t nt, state_t *st, drip_t *pf) {
    const int64_t d = cc->d, kp = key_width(cc);
    float *p = st->p;
    const uint16_t *qb = st->qb + g0 * BPIECES * kp;
    /* the pieces and the groups of 16 positions as constants: the accumulators stay in registers */
    if (st->qpieces == 1) {
        if (nt <= 16) scores_dpbf16(qb, 1, st->qmul, kp, kb, kline, nt, gt, 1, pf, p);
        else scores_dpbf16(qb, 1, st->qmul, kp, kb, kline, nt, gt, 4, pf, p);
    } else {
        if (nt <= 16) scores_dpbf16(qb, BPIECES, st->qmul, kp, kb, kline, nt, gt, 1, pf, p);
        else scores_dpbf16(qb, BPIECES, st->qmul, kp, kb, kline, nt, gt, 4, pf, p);
    }
    if (nt <= 16) softmax_avx512(p, nt, vs, d, gt, 1, st->m + g0, st->l + g0, st->acc + g0 * d, pf);
    else softmax_avx512(p, nt, vs, d, gt, 4, st->m + g0, st->l + g0, st->acc + g0 * d, pf);
    void *out = st->out ? (char *)st->out + g0 * d * enc_size(enc) : NULL; /* as tile_avx512 */
    pv_block_avx512(enc, st->acc + g0 * d, d, vb, p, nt, gt, pf, out, st->l + g0);
}

AVX512DOT static inline __attribute__((always_inline)) void block_dot_enc(
    const int enc, const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    if (nt <= BF16_WIDEN_MAX_T) { /* a short block: the widening block's (above) */
        block_avx512_bf16(cc, qf, h, phys, nt, st);
        return;
    }
    if (!st->qready) split_query_bf16(cc, h, qf, st);
    int64_t kline, knline = 0;
    const char *kb, *kn, *vb;
    const float *ks, *vs;
    block_setup_avx512(enc, cc, h, phys, nt, st, &kb, &kline, &kn, &knline, &vb, &ks, &vs);
    const int64_t krows = key_width(cc) / 2; /* each a slot of the scores loop */
    drip_t room;
    drip_t *pf = drip_next(enc, cc, st, krows, kn, knline, vb, phys, nt, krows, &room);
    for (int64_t g0 = 0; g0 < cc->g; g0 += TILE_G) {
        switch (cc->g - g0 >= TILE_G ? TILE_G : (int)(cc->g - g0)) {
            case 4: tile_dot(enc, cc, g0, 4, kb, kline, vb, vs, nt, st, pf); break;
            case 3: tile_dot(enc, cc, g0, 3, kb, kline, vb, vs, nt, st, pf); break;
            case 2: tile_dot(enc, cc, g0, 2, kb, kline, vb, vs, nt, st, pf); break;
            default: tile_dot(enc, cc, g0, 1, kb, kline, vb, vs, nt, st, pf); break;
        }
    }
    if (pf) drip_rest(pf);
}
AVX512DOT GQA_INTERNAL void block_dot_bf16(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys,
                                           int64_t nt, state_t *st) {
    block_dot_enc(ENC_BF16, cc, qf, h, phys, nt, st);
}
#endif /* GQA_X86_64 */
