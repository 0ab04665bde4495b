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
    const int enc, const float *q, int64_t dk, int64_t no, const char *kb, int64_t kline, const uint16_t *kob,
    int64_t c, const float *ks, int64_t nt, const int gt, const int ng, drip_t *dr, float *out) {
    /* kb: the block's keys, channel lines kline elements apart; dr: the next block's drip (an idle one asks for nothing) */
    /* ng (a constant): the groups of 16 positions computed, ceil(nt / 16) (1 to 4) */
    const int64_t dq = dk + no, el = enc_size(enc);
    __m512 acc[TILE_G][4];
    __mmask16 mask[4];
    for (int i = 0; i < 4; i++) {
        mask[i] = lanes16(nt, i);
        for (int g = 0; g < gt; g++) acc[g][i] = _mm512_setzero_ps();
    }
    if (kpack(enc) == 1 && ng == 1) { /* one register of positions a head: even and odd channels in two chains */
        int64_t j = 0;
        for (; j + 2 <= dk; j += 2) {
            const char *row = kb + j * kline * el;
            drip_slot(dr, 2);
            drip_line(dr);
            const __m512 k0 = widen16(enc, row, mask[0]);
            drip_line(dr);
            const __m512 k1 = widen16(enc, row + kline * el, mask[0]);
            for (int g = 0; g < gt; g++) {
                acc[g][0] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * dq + j]), k0, acc[g][0]);
                acc[g][1] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * dq + j + 1]), k1, acc[g][1]);
            }
        }
        if (j < dk) {
            drip_slot(dr, 1);
            drip_line(dr);
            const __m512 k0 = widen16(enc, kb + j * kline * el, mask[0]);
            for (int g = 0; g < gt; g++) acc[g][0] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * dq + j]), k0, acc[g][0]);
        }
        for (int g = 0; g < gt; g++) {
            acc[g][0] = _mm512_add_ps(acc[g][0], acc[g][1]);
            acc[g][1] = _mm512_setzero_ps();
        }
    } else if (kpack(enc) == 1) {
        for (int64_t j = 0; j < dk; j++) {
            const char *row = kb + j * kline * el;
            /* a slot of the next block's drip (gqa_avx512.h) */
            drip_slot(dr, 1);
            __m512 kf[4];
            for (int i = 0; i < ng; i++) {
                drip_line(dr);
                kf[i] = widen16(enc, row + 16 * i * el, mask[i]);
            }
            for (int g = 0; g < gt; g++) {
                const __m512 qj = _mm512_set1_ps(q[g * dq + j]);
                for (int i = 0; i < ng; i++) acc[g][i] = _mm512_fmadd_ps(qj, kf[i], acc[g][i]);
            }
        }
    } else if (ng == 1) { /* bfloat16, one register of positions a head: the low halves (even
                            * channels) and the high ones in two chains of sums, as above */
        for (int64_t l = 0; 2 * l < dk; l++) {
            const char *row = kb + l * kline * 2;
            drip_slot(dr, 1);
            drip_line(dr);
            const __m512i kw = _mm512_maskz_loadu_epi32(mask[0], row);
            const __m512 k0 = _mm512_castsi512_ps(_mm512_slli_epi32(kw, 16));
            const __m512 k1 = _mm512_castsi512_ps(_mm512_and_si512(kw, _mm512_set1_epi32((int)0xFFFF0000u)));
            for (int g = 0; g < gt; g++) {
                acc[g][0] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * dq + 2 * l]), k0, acc[g][0]);
                if (2 * l + 1 < dk) acc[g][1] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * dq + 2 * l + 1]), k1, acc[g][1]);
            }
        }
        for (int g = 0; g < gt; g++) {
            acc[g][0] = _mm512_add_ps(acc[g][0], acc[g][1]);
            acc[g][1] = _mm512_setzero_ps();
        }
    } else { /* bfloat16, lines of 2 channels a word: the low half, then the high */
        for (int64_t l = 0; 2 * l < dk; l++) {
            const char *row = kb + l * kline * 2;
            drip_slot(dr, 1);
            __m512i kw[4];
            for (int i = 0; i < ng; i++) {
                drip_line(dr);
                kw[i] = _mm512_maskz_loadu_epi32(mask[i], row + 64 * i);
            }
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


/* 8 consecutive elements of encoding enc widened to float32 (masked lanes 0). */
AVX512 static inline __attribute__((always_inline)) __m256 widen8(const int enc, const void *p, __mmask8 mask) {
    switch (enc) {
        case ENC_F32: return _mm256_maskz_loadu_ps(mask, p);
        case ENC_BF16:
            return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_maskz_loadu_epi16(mask, p)), 16));
        case ENC_F16: return _mm256_maskz_cvtph_ps(0xFF, _mm_maskz_loadu_epi16(mask, p));
        default: return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p)));
    }
}

/* a * b + c in 8 lanes (AVX-512VL's form: the AVX512 target does not name FMA). */
AVX512 static inline __attribute__((always_inline)) __m256 fma8(__m256 a, __m256 b, __m256 c) {
    return _mm256_mask_fmadd_ps(a, 0xFF, b, c);
}

/* The channel loop of scores8_avx512: a0 gets the even channels, a1 the odd ones. */
AVX512 static inline __attribute__((always_inline)) void scores8_loop(
    const int enc, const float *q, int64_t dq, int64_t dk, const char *kb, int64_t kline, __mmask8 m8, const int gt,
    __m256 *a0, __m256 *a1) {
    const int64_t el = enc_size(enc);
    const float *qg[TILE_G];
    for (int g = 0; g < gt; g++) qg[g] = q + g * dq;
    if (kpack(enc) == 1) {
        const int64_t step = kline * el;
        int64_t j = 0;
        for (; j + 2 <= dk; j += 2) {
            const char *row = kb + j * step;
            const __m256 k0 = widen8(enc, row, m8), k1 = widen8(enc, row + step, m8);
            for (int g = 0; g < gt; g++) {
                a0[g] = fma8(_mm256_set1_ps(qg[g][j]), k0, a0[g]);
                a1[g] = fma8(_mm256_set1_ps(qg[g][j + 1]), k1, a1[g]);
            }
        }
        if (j < dk) {
            const __m256 k0 = widen8(enc, kb + j * step, m8);
            for (int g = 0; g < gt; g++) a0[g] = fma8(_mm256_set1_ps(qg[g][j]), k0, a0[g]);
        }
        return;
    }
    /* bfloat16, lines of 2 channels a word (dk padded to even with zero channels, which add
     * nothing: the query's are read only up to dk) */
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    int64_t l = 0;
    for (; 2 * l + 2 <= dk; l++) {
        const __m256i w = _mm256_maskz_loadu_epi32(m8, kb + l * kline * 2);
        const __m256 k0 = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), k1 = _mm256_castsi256_ps(_mm256_and_si256(w, high));
        for (int g = 0; g < gt; g++) {
            a0[g] = fma8(_mm256_set1_ps(qg[g][2 * l]), k0, a0[g]);
            a1[g] = fma8(_mm256_set1_ps(qg[g][2 * l + 1]), k1, a1[g]);
        }
    }
    if (2 * l < dk) {
        const __m256i w = _mm256_maskz_loadu_epi32(m8, kb + l * kline * 2);
        const __m256 k0 = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        for (int g = 0; g < gt; g++) a0[g] = fma8(_mm256_set1_ps(qg[g][2 * l]), k0, a0[g]);
    }
}

/* scores_avx512 for a block of at most 8 positions (a short cache's whole run): 8-lane
 * registers, whose loads and query broadcasts issue two a cycle on this core where 16-lane
 * ones issue one, and two accumulators per query head (even and odd channels) so that the
 * multiply-adds' latency does not bound a loop of one per head and channel (docs/design.md,
 * "Short blocks"). The same sums for a block whichever call or thread computes it. */
AVX512 static inline __attribute__((always_inline)) void scores8_avx512(
    const int enc, const float *q, int64_t dk, int64_t no, const char *kb, int64_t kline, const uint16_t *kob,
    int64_t c, const float *ks, int64_t nt, const int gt, float *out) {
    const __mmask8 m8 = (__mmask8)((1u << nt) - 1);
    __m256 a0[TILE_G], a1[TILE_G];
    for (int g = 0; g < gt; g++) a0[g] = a1[g] = _mm256_setzero_ps();
    scores8_loop(enc, q, dk + no, dk, kb, kline, m8, gt, a0, a1);
    __m512 acc[TILE_G][4];
    __mmask16 mask[4] = {lanes16(nt, 0), 0, 0, 0};
    for (int g = 0; g < gt; g++) {
        acc[g][0] = _mm512_zextps256_ps512(_mm256_add_ps(a0[g], a1[g]));
        acc[g][1] = acc[g][2] = acc[g][3] = _mm512_setzero_ps();
    }
    scores_int8_finish(enc, acc, mask, q, dk, no, kob, c, ks, gt, out);
}

/* Scores, online softmax and the weighted sum of the values for one query tile. */
AVX512 static inline __attribute__((always_inline)) void tile_avx512(
    const int enc, const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t g0, const int gt,
    const char *kb, int64_t kline, const char *vb, const float *ks, const float *vs,
    int64_t nt, state_t *st, drip_t *pf) {
    const int64_t d = cc->d, dq = cc->dk + cc->no;
    float *p = st->p;
    const float *q = qf + g0 * dq;
    const uint16_t *ko = enc == ENC_INT8 ? cc->ko + h * cc->no * cc->c + phys : NULL;
    if (whole_short_block(enc, cc, phys, nt)) /* several channels' key lines a register: the AVX2 block's sums */
        scores_lines_avx2_call(enc, q, cc->dk, dq, kb, nt, gt, p);
    else if (nt <= 8) /* its key rows are the drip's from the softmax on (kslots 0) */
        scores8_avx512(enc, q, cc->dk, cc->no, kb, kline, ko, cc->c, ks, nt, gt, p);
    else /* the groups of 16 positions that hold the block's: a short ring's or a head's last
          * block multiplies no empty group */
        switch ((nt + 15) / 16) {
            case 1: scores_avx512(enc, q, cc->dk, cc->no, kb, kline, ko, cc->c, ks, nt, gt, 1, pf, p); break;
            case 2: scores_avx512(enc, q, cc->dk, cc->no, kb, kline, ko, cc->c, ks, nt, gt, 2, pf, p); break;
            case 3: scores_avx512(enc, q, cc->dk, cc->no, kb, kline, ko, cc->c, ks, nt, gt, 3, pf, p); break;
            default: scores_avx512(enc, q, cc->dk, cc->no, kb, kline, ko, cc->c, ks, nt, gt, 4, pf, p); break;
        }
    if (enc == ENC_F32 && st->smul != 1.0f) { /* an unscaled query's scores (attend.c) */
        const __m512 s = _mm512_set1_ps(st->smul);
        for (int g = 0; g < gt; g++)
            for (int i = 0; i < (nt <= 16 ? 1 : 4); i++) {
                float *at = p + g * TILE_T + 16 * i;
                const __m512 x = _mm512_loadu_ps(at);
                _mm512_storeu_ps(at, _mm512_mask_mul_ps(x, lanes16(nt, i), x, s));
            }
    }
    softmax_groups(p, nt, vs, d, gt, st->m + g0, st->l + g0, st->acc + g0 * d, pf);
    /* a dense head's only block: its rows finished here (st->out) */
    void *out = enc != ENC_INT8 && st->out ? (char *)st->out + g0 * d * enc_size(enc) : NULL;
    pv_block_avx512(enc, st->acc + g0 * d, d, vb, p, nt, gt, pf, out, st->l + g0);
}


AVX512 static inline __attribute__((always_inline)) void block_avx512_enc(
    const int enc, const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    int64_t kline, knline;
    const char *kb, *kn, *vb;
    const float *ks, *vs;
    block_setup_avx512(enc, cc, h, phys, nt, st, &kb, &kline, &kn, &knline, &vb, &ks, &vs);
    const int64_t kp = kpack(enc);
    drip_t dr = drip_next(enc, cc, st, key_width(cc) / kp, kn, knline, vb, phys, nt, nt <= 8 ? 0 : (cc->dk + kp - 1) / kp);
    for (int64_t g0 = 0; g0 < cc->g; g0 += TILE_G) {
        switch (cc->g - g0 >= TILE_G ? TILE_G : (int)(cc->g - g0)) {
            case 4: tile_avx512(enc, cc, qf, h, phys, g0, 4, kb, kline, vb, ks, vs, nt, st, &dr); break;
            case 3: tile_avx512(enc, cc, qf, h, phys, g0, 3, kb, kline, vb, ks, vs, nt, st, &dr); break;
            case 2: tile_avx512(enc, cc, qf, h, phys, g0, 2, kb, kline, vb, ks, vs, nt, st, &dr); break;
            default: tile_avx512(enc, cc, qf, h, phys, g0, 1, kb, kline, vb, ks, vs, nt, st, &dr); break;
        }
    }
    drip_rest(&dr);
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

/* n elements of encoding enc (float32, float16 or bfloat16) to float32 times scale: load_elem(enc, src, i) * scale,
 * 16 lanes at a time. */
AVX512 GQA_INTERNAL void widen_row_avx512(const int enc, const void *src, float *dst, int64_t n, float scale) {
    const __m512 s = _mm512_set1_ps(scale);
    const int64_t el = enc_size(enc);
    for (int64_t x = 0; x < n; x += 16) {
        const __mmask16 m = lanes16(n - x, 0);
        _mm512_mask_storeu_ps(dst + x, m, _mm512_mul_ps(widen16(enc, (const char *)src + x * el, m), s));
    }
}

/* gather_rows_avx512 at d = 128 by permutations: each row's 8 registers (widened, times the
 * scale) are four tables of 32 lanes; an output register takes its lanes from each table by
 * vpermt2ps on the order's low 5 bits and keeps, lane by lane, the table its high bits name.
 * The same products in the same places as gather_rows_avx512's runs, without their scan and
 * masked moves (~400 of a head's ~550 cycles there: 64 short int8 caches, hot). */
AVX512 static void gather_rows_128(const int enc, const void *src, const int64_t *order, int64_t G, float scale,
                                   float *dst) {
    const int64_t el = enc_size(enc);
    const __m512 s = _mm512_set1_ps(scale);
    __m512i idx[8];
    __mmask16 from[8][3]; /* lanes taken from tables 1, 2, 3 (the rest: table 0) */
    for (int v = 0; v < 8; v++) {
        const __m256i a = _mm512_cvtepi64_epi32(_mm512_loadu_si512(order + 16 * v));
        const __m256i b = _mm512_cvtepi64_epi32(_mm512_loadu_si512(order + 16 * v + 8));
        idx[v] = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        const __m512i table = _mm512_srli_epi32(idx[v], 5);
        for (int t = 0; t < 3; t++) from[v][t] = _mm512_cmpeq_epi32_mask(table, _mm512_set1_epi32(t + 1));
    }
    for (int64_t g = 0; g < G; g++) {
        const char *row = (const char *)src + g * 128 * el;
        __m512 x[8];
        for (int i = 0; i < 8; i++) x[i] = _mm512_mul_ps(widen16(enc, row + 16 * i * el, 0xFFFF), s);
        for (int v = 0; v < 8; v++) {
            __m512 r = _mm512_permutex2var_ps(x[0], idx[v], x[1]);
            r = _mm512_mask_mov_ps(r, from[v][0], _mm512_permutex2var_ps(x[2], idx[v], x[3]));
            r = _mm512_mask_mov_ps(r, from[v][1], _mm512_permutex2var_ps(x[4], idx[v], x[5]));
            r = _mm512_mask_mov_ps(r, from[v][2], _mm512_permutex2var_ps(x[6], idx[v], x[7]));
            _mm512_storeu_ps(dst + g * 128 + 16 * v, r);
        }
    }
}

/* G rows of d elements of encoding enc (src, one after another) to float32 times scale, each
 * row's elements taken in `order`: dst[g * d + j] = load_elem(enc, src, g * d + order[j]) *
 * scale, as widen_row_avx512 makes them. At d = 128 by permutations (above); otherwise the
 * order is moved run by run (consecutive channels to consecutive places), 16 lanes at a time:
 * an int8 cache's key order is its coded channels ascending with the outliers cut out, then the
 * outliers, at most 2 x outliers + 1 runs. */
AVX512 GQA_INTERNAL void gather_rows_avx512(const int enc, const void *src, const int64_t *order, int64_t G, int64_t d,
                                            float scale, float *dst) {
    if (d == 128) {
        gather_rows_128(enc, src, order, G, scale, dst);
        return;
    }
    const __m512 s = _mm512_set1_ps(scale);
    const int64_t el = enc_size(enc);
    for (int64_t j = 0; j < d;) {
        const int64_t from = order[j], len = order_run(order, j, d);
        for (int64_t g = 0; g < G; g++) {
            const char *a = (const char *)src + (g * d + from) * el;
            float *b = dst + g * d + j;
            for (int64_t x = 0; x < len; x += 16) {
                const __mmask16 m = lanes16(len - x, 0);
                _mm512_mask_storeu_ps(b + x, m, _mm512_mul_ps(widen16(enc, a + x * el, m), s));
            }
        }
        j += len;
    }
}

/* Whether n float32 values at p are all within +-limit (NaN: not), 16 at a time. */
AVX512 GQA_INTERNAL int within_f32_avx512(const float *p, int64_t n, float limit) {
    const __m512 lim = _mm512_set1_ps(limit);
    __mmask16 bad = 0;
    for (int64_t x = 0; x < n; x += 16) {
        const __mmask16 m = lanes16(n - x, 0);
        const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(m, p + x));
        bad |= _mm512_mask_cmp_ps_mask(m, a, lim, _CMP_NLE_UQ); /* not (|a| <= limit): NaN too */
    }
    return !bad;
}

/* n float32 elements to float16/bfloat16 (enc), as narrow16. */
AVX512 GQA_INTERNAL void narrow_row_avx512(const int enc, const float *src, uint16_t *dst, int64_t n) {
    for (int64_t x = 0; x < n; x += 16) {
        const __mmask16 m = lanes16(n - x, 0);
        _mm256_mask_storeu_epi16(dst + x, m, narrow16(enc, _mm512_maskz_loadu_ps(m, src + x)));
    }
}

/* A one-split head's gn output rows from its accumulators in one pass: each element
 * (0 + acc) x (1 / l[g]) (0 x inf, a NaN row, where l[g] = 0), stored in encoding enc at out:
 * attend.c's finish_head and store_row, the same bits, without a second pass over the rows. */
AVX512 GQA_INTERNAL void finish_rows_avx512(const int enc, const float *acc, const float *l, int64_t gn, int64_t d,
                                          void *out) {
    for (int64_t g = 0; g < gn; g++) {
        const __m512 vinv = _mm512_set1_ps(1.0f / l[g]);
        const int empty = l[g] == 0.0f;
        char *row = (char *)out + g * d * enc_size(enc);
        for (int64_t x = 0; x < d; x += 16) {
            const __mmask16 m = lanes16(d - x, 0);
            store_finished16(enc, row, x, m, _mm512_maskz_loadu_ps(m, acc + g * d + x), vinv, empty);
        }
    }
}
#endif /* GQA_X86_64 */
