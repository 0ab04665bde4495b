/*
 * The bfloat16 block with BF16 dot products (ISA_AVX512_DOT: AVX-512 BF16): keys hold two
 * channels of a position per 32-bit word, vdpbf16ps's operand, multiplied with the query split
 * into bfloat16 pieces once per work item. The value sum by vdpbf16ps too: two value rows
 * interleaved channel by channel against the block's softmax weights split into two bfloat16
 * pieces (16 of float32's 24 bits, as the query), where a head has more than one block; the
 * widening and FMAs of block_avx512.c otherwise. On a CPU that issues one 512-bit operation of
 * any kind a cycle or less, the widening cost as much as the products.
 */
#include "gqa_avx512.h"

/* Blocks of up to this many positions (a short ring's) take the widening block
 * (block_avx512_bf16's 8-lane scores, each key line read once for every head): there
 * vdpbf16ps' 16 lanes are mostly masked off and the query's split is pure overhead. Sapphire
 * Rapids, 64 short caches hot: 154 -> 132 us a call (docs/design.md, twenty-second session). */
#ifndef BF16_WIDEN_MAX_T
#define BF16_WIDEN_MAX_T 8
#endif

/* Widths the value sum by vdpbf16ps takes, in groups of 32 channels: two query heads' sums of a
 * whole row then fill 2 x 2 x PV_DP_MAX_NC of the 32 registers. */
#define PV_DP_MAX_NC 4

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
    if (ng == 1) { /* one register of positions a head: even and odd words in two chains of sums */
        int64_t l = 0;
        for (; 2 * l + 2 < kp; l += 2) {
            const char *row = kb + l * kline * 2;
            drip_slot(dr, 2);
            drip_line(dr);
            const __m512i k0 = _mm512_maskz_loadu_epi32(mask[0], row);
            drip_line(dr);
            const __m512i k1 = _mm512_maskz_loadu_epi32(mask[0], row + kline * 2);
            for (int g = 0; g < gt; g++)
                for (int p = 0; p < pieces; p++) {
                    int32_t w[2];
                    memcpy(w, qb + (g * BPIECES + p) * kp + 2 * l, 8);
                    acc[g][0] = _mm512_dpbf16_ps(acc[g][0], (__m512bh)k0, (__m512bh)_mm512_set1_epi32(w[0]));
                    acc[g][1] = _mm512_dpbf16_ps(acc[g][1], (__m512bh)k1, (__m512bh)_mm512_set1_epi32(w[1]));
                }
        }
        if (2 * l < kp) {
            drip_slot(dr, 1);
            drip_line(dr);
            const __m512i k0 = _mm512_maskz_loadu_epi32(mask[0], kb + l * kline * 2);
            for (int g = 0; g < gt; g++)
                for (int p = 0; p < pieces; p++) {
                    int32_t w;
                    memcpy(&w, qb + (g * BPIECES + p) * kp + 2 * l, 4);
                    acc[g][0] = _mm512_dpbf16_ps(acc[g][0], (__m512bh)k0, (__m512bh)_mm512_set1_epi32(w));
                }
        }
        for (int g = 0; g < gt; g++) {
            acc[g][0] = _mm512_add_ps(acc[g][0], acc[g][1]);
            acc[g][1] = _mm512_setzero_ps();
        }
    } else {
        for (int64_t l = 0; 2 * l < kp; l++) {
            const char *row = kb + l * kline * 2;
            drip_slot(dr, 1);
            __m512i kw[4];
            for (int i = 0; i < ng; i++) {
                drip_line(dr);
                kw[i] = _mm512_maskz_loadu_epi32(mask[i], row + 64 * i);
            }
            for (int g = 0; g < gt; g++)
                for (int p = 0; p < pieces; p++) {
                    int32_t word;
                    memcpy(&word, qb + (g * BPIECES + p) * kp + 2 * l, 4);
                    const __m512bh qw = (__m512bh)_mm512_set1_epi32(word);
                    for (int i = 0; i < ng; i++) acc[g][i] = _mm512_dpbf16_ps(acc[g][i], (__m512bh)kw[i], qw);
                }
        }
    }
    const __m512 m = _mm512_set1_ps(mul);
    for (int i = 0; i < 4; i++)
        for (int g = 0; g < gt; g++)
            _mm512_storeu_ps(out + g * TILE_T + 16 * i,
                             _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mask[i], _mm512_mul_ps(acc[g][i], m)));
}

/* A block's weights p (gt x TILE_T, valid below nt) as two bfloat16 pieces each, hi then what
 * hi left (16 of float32's 24 bits), 0 from nt on: wb[(g * 2 + piece) * TILE_T + t]. The word
 * at an even t is then the pair (t, t + 1) that vdpbf16ps multiplies with two value rows. */
AVX512DOT static inline __attribute__((always_inline)) void weights_bf16(const float *p, int64_t nt, const int gt,
                                                                          uint16_t *wb) {
    for (int g = 0; g < gt; g++)
        for (int i = 0; i < 4; i++) {
            const __m512 x = _mm512_maskz_loadu_ps(lanes16(nt, i), p + g * TILE_T + 16 * i);
            const __m256bh hi = _mm512_cvtneps_pbh(x);
            const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)hi), 16));
            const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(x, back));
            _mm256_storeu_si256((__m256i *)(wb + (g * 2) * TILE_T + 16 * i), (__m256i)hi);
            _mm256_storeu_si256((__m256i *)(wb + (g * 2 + 1) * TILE_T + 16 * i), (__m256i)lo);
        }
}

/* acc[g][c] += sum_t p[g][t] value[t][c] for a block, two query heads (gh: 1 or 2) over whole
 * rows of d = 32 nc channels (nc <= 4): value rows t and t + 1 interleaved channel by channel
 * (a row past nt: zeros), one vdpbf16ps a piece a head a 16 channels; each row a slot of the
 * drip. The sums start at 0 and are added to acc_mem at the end. */
AVX512DOT static inline __attribute__((always_inline)) void pv_dpbf16(float *acc_mem, int64_t d, const char *vb,
                                                                       const uint16_t *wb, int64_t nt, const int gh,
                                                                       const int nc, drip_t *dr) {
    __m512 acc[2][8];
    for (int g = 0; g < gh; g++)
        for (int i = 0; i < 2 * nc; i++) acc[g][i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < nt; t += 2) {
        const char *r0 = vb + t * d * 2, *r1 = r0 + d * 2;
        const int two = t + 1 < nt;
        drip_slot(dr, two ? 2 : 1);
        __m512 w[2][2];
        for (int g = 0; g < gh; g++)
            for (int k = 0; k < 2; k++) {
                int32_t word;
                memcpy(&word, wb + (g * 2 + k) * TILE_T + t, 4);
                w[g][k] = _mm512_castsi512_ps(_mm512_set1_epi32(word));
            }
        for (int c = 0; c < nc; c++) {
            drip_line(dr);
            const __m512i x = _mm512_loadu_si512(r0 + 64 * c);
            drip_line(dr);
            const __m512i y = two ? _mm512_loadu_si512(r1 + 64 * c) : _mm512_setzero_si512();
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y), hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
            for (int g = 0; g < gh; g++)
                for (int k = 0; k < 2; k++) {
                    acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], lo, (__m512bh)w[g][k]);
                    acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], hi, (__m512bh)w[g][k]);
                }
        }
    }
    /* lanes back in channel order: lo holds 0-3, 8-11, 16-19, 24-27 of its 32, hi the others */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int g = 0; g < gh; g++)
        for (int c = 0; c < nc; c++) {
            float *at = acc_mem + g * d + 32 * c;
            _mm512_storeu_ps(at, _mm512_add_ps(_mm512_loadu_ps(at), _mm512_permutex2var_ps(acc[g][2 * c], first, acc[g][2 * c + 1])));
            _mm512_storeu_ps(at + 16, _mm512_add_ps(_mm512_loadu_ps(at + 16), _mm512_permutex2var_ps(acc[g][2 * c], second, acc[g][2 * c + 1])));
        }
}

/* scores_dpbf16 with the query's pieces as a constant (the accumulators then stay in
 * registers), ng groups of 16 positions. */
AVX512DOT static inline __attribute__((always_inline)) void tile_dot_scores(
    const uint16_t *qb, const state_t *st, int64_t kp, const char *kb, int64_t kline, int64_t nt, const int gt,
    const int ng, drip_t *pf, float *p) {
    if (st->qpieces == 1) scores_dpbf16(qb, 1, st->qmul, kp, kb, kline, nt, gt, ng, pf, p);
    else scores_dpbf16(qb, BPIECES, st->qmul, kp, kb, kline, nt, gt, ng, pf, p);
}

/* tile_avx512 for bfloat16 with its scores by vdpbf16ps (the query split once per work item). */
AVX512DOT static inline __attribute__((always_inline)) void tile_dot(
    const int enc, const gqa_cache_t *cc, int64_t g0, const int gt, const char *kb, int64_t kline, const char *vb,
    const float *vs, int64_t nt, state_t *st, drip_t *pf) {
    const int64_t d = cc->d, kp = key_width(cc);
    float *p = st->p;
    const uint16_t *qb = st->qb + g0 * BPIECES * kp;
    /* the pieces and the groups of 16 positions as constants: the accumulators stay in registers */
    switch ((nt + 15) / 16) { /* the groups of 16 positions that hold the block's (1 to 4) */
        case 1: tile_dot_scores(qb, st, kp, kb, kline, nt, gt, 1, pf, p); break;
        case 2: tile_dot_scores(qb, st, kp, kb, kline, nt, gt, 2, pf, p); break;
        case 3: tile_dot_scores(qb, st, kp, kb, kline, nt, gt, 3, pf, p); break;
        default: tile_dot_scores(qb, st, kp, kb, kline, nt, gt, 4, pf, p); break;
    }
    softmax_groups(p, nt, vs, d, gt, st->m + g0, st->l + g0, st->acc + g0 * d, pf);
    void *out = st->out ? (char *)st->out + g0 * d * enc_size(enc) : NULL; /* as tile_avx512 */
    if (out || d % 32 || d > 32 * PV_DP_MAX_NC) { /* a head's only block (finished in registers), other widths */
        pv_block_avx512(enc, st->acc + g0 * d, d, vb, p, nt, gt, pf, out, st->l + g0);
        return;
    }
    uint16_t wb[TILE_G * 2 * TILE_T];
    weights_bf16(p, nt, gt, wb);
    for (int g = 0; g < gt; g += 2) {
        float *acc = st->acc + (g0 + g) * d;
        const uint16_t *w = wb + g * 2 * TILE_T;
        const int two = g + 1 < gt;
        switch (d / 32) { /* constants: the accumulators stay in registers */
            case 4: two ? pv_dpbf16(acc, d, vb, w, nt, 2, 4, pf) : pv_dpbf16(acc, d, vb, w, nt, 1, 4, pf); break;
            case 3: two ? pv_dpbf16(acc, d, vb, w, nt, 2, 3, pf) : pv_dpbf16(acc, d, vb, w, nt, 1, 3, pf); break;
            case 2: two ? pv_dpbf16(acc, d, vb, w, nt, 2, 2, pf) : pv_dpbf16(acc, d, vb, w, nt, 1, 2, pf); break;
            default: two ? pv_dpbf16(acc, d, vb, w, nt, 2, 1, pf) : pv_dpbf16(acc, d, vb, w, nt, 1, 1, pf); break;
        }
    }
}

AVX512DOT static inline __attribute__((always_inline)) void block_dot_enc(
    const int enc, const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    if (nt <= BF16_WIDEN_MAX_T) { /* a short block: the widening block's (above) */
        if (st->qlazy) { /* the query attend_head left to the first block that reads it */
            convert_query(cc, h, st->q, ISA_AVX512);
            st->qlazy = 0;
        }
        block_avx512_bf16(cc, st->q, h, phys, nt, st);
        return;
    }
    if (!st->qready) split_query_bf16(cc, h, qf, st);
    int64_t kline, knline = 0;
    const char *kb, *kn, *vb;
    const float *ks, *vs;
    block_setup_avx512(enc, cc, h, phys, nt, st, &kb, &kline, &kn, &knline, &vb, &ks, &vs);
    const int64_t krows = key_width(cc) / 2; /* each a slot of the scores loop */
    drip_t dr = drip_next(enc, cc, st, krows, kn, knline, vb, phys, nt, krows);
    for (int64_t g0 = 0; g0 < cc->g; g0 += TILE_G) {
        switch (cc->g - g0 >= TILE_G ? TILE_G : (int)(cc->g - g0)) {
            case 4: tile_dot(enc, cc, g0, 4, kb, kline, vb, vs, nt, st, &dr); break;
            case 3: tile_dot(enc, cc, g0, 3, kb, kline, vb, vs, nt, st, &dr); break;
            case 2: tile_dot(enc, cc, g0, 2, kb, kline, vb, vs, nt, st, &dr); break;
            default: tile_dot(enc, cc, g0, 1, kb, kline, vb, vs, nt, st, &dr); break;
        }
    }
    drip_rest(&dr);
}
AVX512DOT GQA_INTERNAL void block_dot_bf16(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys,
                                           int64_t nt, state_t *st) {
    block_dot_enc(ENC_BF16, cc, qf, h, phys, nt, st);
}
#endif /* GQA_X86_64 */
