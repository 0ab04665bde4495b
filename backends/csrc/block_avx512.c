/*
 * The AVX-512 blocks (F, BW, VL, DQ) of every encoding: a block's scores for up to TILE_G query
 * heads at once, one key channel line at a time against 16 positions a register, then the
 * shared softmax and value sum of gqa_avx512.h; and rows widened to / narrowed from float32
 * 16 lanes at a time (the query's widening and the output's store).
 */
#include "gqa_avx512.h"

#if GQA_X86_64
/* The end of a block's scores: int8's key scales and float16 outlier channels, then the scores
 * of the block's lanes to out[g * TILE_T + t] (-inf past nt). */
AVX512 static inline __attribute__((always_inline)) void scores_int8_finish(
    const int enc, __m512 acc[TILE_G][4], const __mmask16 *mask, const float *q, int64_t dk, int64_t no,
    const uint16_t *kob, int64_t c, const float *ks, const int gt, float *out) {
    const int64_t dq = dk + no;
    if (enc == ENC_INT8) {
        for (int i = 0; i < 4; i++) {
            const __m512 s = _mm512_maskz_loadu_ps(mask[i], ks + 16 * i);
            for (int g = 0; g < gt; g++) acc[g][i] = _mm512_mul_ps(acc[g][i], s);
        }
        for (int64_t o = 0; o < no; o++) { /* float16 channels: not scaled */
            const uint16_t *row = kob + o * c;
            for (int i = 0; i < 4; i++) {
                const __m512 x = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask[i], row + 16 * i));
                for (int g = 0; g < gt; g++)
                    acc[g][i] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * dq + dk + o]), x, acc[g][i]);
            }
        }
    }
    for (int i = 0; i < 4; i++)
        for (int g = 0; g < gt; g++)
            _mm512_storeu_ps(out + g * TILE_T + 16 * i, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mask[i], acc[g][i]));
}

/* Scores of `gt` (<= TILE_G, a constant after inlining) query heads against one block of up to
 * 64 positions: 4 x gt accumulators of 16 positions, one key channel row at a time. */
AVX512 static inline __attribute__((always_inline)) void scores_avx512(
    const int enc, const float *q, int64_t dk, int64_t no, const char *kb, int64_t kline, const char *kn,
    int64_t knline, const uint16_t *kob, int64_t c, const float *ks, int64_t nt, const int gt, const int ng,
    const int prefetch, float *out) {
    /* kb: the block's keys, channel lines kline elements apart; kn: the next block's (knline) */
    /* ng (a constant): groups of 16 positions computed, 1 for a block of up to 16, else 4 */
    const int64_t dq = dk + no, el = enc_size(enc);
    __m512 acc[TILE_G][4];
    __mmask16 mask[4];
    for (int i = 0; i < 4; i++) {
        mask[i] = lanes16(nt, i);
        for (int g = 0; g < gt; g++) acc[g][i] = _mm512_setzero_ps();
    }
    if (kpack(enc) == 1) {
        for (int64_t j = 0; j < dk; j++) {
            const char *row = kb + j * kline * el;
            /* the next block's line of this channel (see the header), when the item reads it */
            if (prefetch) {
                const char *next = kn + j * knline * el;
                for (int64_t x = 0; x < knline * el; x += 64) _mm_prefetch(next + x, _MM_HINT_T1);
            }
            __m512 kf[4];
            for (int i = 0; i < ng; i++) kf[i] = widen16(enc, row + 16 * i * el, mask[i]);
            for (int g = 0; g < gt; g++) {
                const __m512 qj = _mm512_set1_ps(q[g * dq + j]);
                for (int i = 0; i < ng; i++) acc[g][i] = _mm512_fmadd_ps(qj, kf[i], acc[g][i]);
            }
        }
    } else { /* bfloat16, lines of 2 channels a word: the low half, then the high */
        for (int64_t l = 0; 2 * l < dk; l++) {
            const char *row = kb + l * kline * 2;
            if (prefetch) {
                const char *next = kn + l * knline * 2;
                for (int64_t x = 0; x < knline * 2; x += 64) _mm_prefetch(next + x, _MM_HINT_T1);
            }
            __m512i kw[4];
            for (int i = 0; i < ng; i++) kw[i] = _mm512_maskz_loadu_epi32(mask[i], row + 64 * i);
            for (int r = 0; r < 2; r++) {
                const int64_t j = 2 * l + r;
                if (j >= dk) break;
                __m512 kf[4];
                for (int i = 0; i < ng; i++)
                    kf[i] = _mm512_castsi512_ps(r == 0 ? _mm512_slli_epi32(kw[i], 16)
                                                       : _mm512_and_si512(kw[i], _mm512_set1_epi32((int)0xFFFF0000u)));
                for (int g = 0; g < gt; g++) {
                    const __m512 qj = _mm512_set1_ps(q[g * dq + j]);
                    for (int i = 0; i < ng; i++) acc[g][i] = _mm512_fmadd_ps(qj, kf[i], acc[g][i]);
                }
            }
        }
    }
    scores_int8_finish(enc, acc, mask, q, dk, no, kob, c, ks, gt, out);
}


/* Scores, online softmax and the weighted sum of the values for one query tile. */
AVX512 static inline __attribute__((always_inline)) void tile_avx512(
    const int enc, const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t g0, const int gt,
    const char *kb, int64_t kline, const char *kn, int64_t knline, const char *vb, const float *ks, const float *vs,
    int64_t nt, state_t *st) {
    const int64_t d = cc->d, dq = cc->dk + cc->no;
    float *p = st->p;
    const float *q = qf + g0 * dq;
    const uint16_t *ko = enc == ENC_INT8 ? cc->ko + h * cc->no * cc->c + phys : NULL;
    const int pf = g0 == 0 && st->prefetch; /* the first tile brings the next block in */
    if (nt <= 16)
        scores_avx512(enc, q, cc->dk, cc->no, kb, kline, kn, knline, ko, cc->c, ks, nt, gt, 1, pf, p);
    else
        scores_avx512(enc, q, cc->dk, cc->no, kb, kline, kn, knline, ko, cc->c, ks, nt, gt, 4, pf, p);
    if (nt <= 16) softmax_avx512(p, nt, vs, d, gt, 1, st->m + g0, st->l + g0, st->acc + g0 * d);
    else softmax_avx512(p, nt, vs, d, gt, 4, st->m + g0, st->l + g0, st->acc + g0 * d);
    pv_block_avx512(enc, st->acc + g0 * d, d, vb, p, nt, gt, pf);
}


AVX512 static inline __attribute__((always_inline)) void block_avx512_enc(
    const int enc, const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    int64_t kline, knline;
    const char *kb, *kn, *vb;
    const float *ks, *vs;
    block_setup_avx512(enc, cc, h, phys, nt, st, &kb, &kline, &kn, &knline, &vb, &ks, &vs);
    for (int64_t g0 = 0; g0 < cc->g; g0 += TILE_G) {
        switch (cc->g - g0 >= TILE_G ? TILE_G : (int)(cc->g - g0)) {
            case 4: tile_avx512(enc, cc, qf, h, phys, g0, 4, kb, kline, kn, knline, vb, ks, vs, nt, st); break;
            case 3: tile_avx512(enc, cc, qf, h, phys, g0, 3, kb, kline, kn, knline, vb, ks, vs, nt, st); break;
            case 2: tile_avx512(enc, cc, qf, h, phys, g0, 2, kb, kline, kn, knline, vb, ks, vs, nt, st); break;
            default: tile_avx512(enc, cc, qf, h, phys, g0, 1, kb, kline, kn, knline, vb, ks, vs, nt, st); break;
        }
    }
}

AVX512 GQA_INTERNAL void block_avx512_f32(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    block_avx512_enc(ENC_F32, cc, qf, h, phys, nt, st);
}
AVX512 GQA_INTERNAL void block_avx512_bf16(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    block_avx512_enc(ENC_BF16, cc, qf, h, phys, nt, st);
}
AVX512 GQA_INTERNAL void block_avx512_f16(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    block_avx512_enc(ENC_F16, cc, qf, h, phys, nt, st);
}
AVX512 GQA_INTERNAL void block_avx512_int8(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    block_avx512_enc(ENC_INT8, cc, qf, h, phys, nt, st);
}

/* n float16/bfloat16 elements (enc) to float32 times scale: load_elem(enc, src, i) * scale,
 * 16 lanes at a time. */
AVX512 GQA_INTERNAL void widen_row_avx512(const int enc, const uint16_t *src, float *dst, int64_t n, float scale) {
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t x = 0; x < n; x += 16) {
        const __mmask16 m = lanes16(n - x, 0);
        _mm512_mask_storeu_ps(dst + x, m, _mm512_mul_ps(widen16(enc, src + x, m), s));
    }
}

/* n float32 elements to float16/bfloat16 (enc), bit for bit as store_elem: round to nearest
 * even; a NaN becomes float_to_half's or float_to_bf16's quiet NaN of the same sign. */
AVX512 GQA_INTERNAL void narrow_row_avx512(const int enc, const float *src, uint16_t *dst, int64_t n) {
    const __m512i one = _mm512_set1_epi32(1), round = _mm512_set1_epi32(0x7FFF);
    for (int64_t x = 0; x < n; x += 16) {
        const __mmask16 m = lanes16(n - x, 0);
        const __m512 v = _mm512_maskz_loadu_ps(m, src + x);
        const __m512i bits = _mm512_castps_si512(v), high = _mm512_srli_epi32(bits, 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        __m256i h;
        if (enc == ENC_F16) {
            const __m512i qnan = _mm512_or_si512(_mm512_and_si512(high, _mm512_set1_epi32(0x8000)), _mm512_set1_epi32(0x7E00));
            h = _mm256_mask_mov_epi16(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), nan,
                                      _mm512_cvtepi32_epi16(qnan));
        } else {
            const __m512i lsb = _mm512_and_si512(high, one);
            __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(round, lsb)), 16);
            r = _mm512_mask_or_epi32(r, nan, high, _mm512_set1_epi32(0x40));
            h = _mm512_cvtepi32_epi16(r);
        }
        _mm256_mask_storeu_epi16(dst + x, m, h);
    }
}
#endif /* GQA_X86_64 */
