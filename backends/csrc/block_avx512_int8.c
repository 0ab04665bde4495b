/*
 * The int8 block with integer dot products (ISA_AVX512_DOT, whose CPUs have AVX-512 VNNI):
 * both of a block's products are vpdpwssd (pairs of int16 multiplied and summed into int32)
 * instead of widening every code to float32 and one FMA per query head.
 *
 * - Scores: the query of each head quantized once per work item to int16 against its own
 *   absmax (one piece, 15 bits); a key channel pair (two lines of the block) widened to int16
 *   and interleaved, so one vpdpwssd adds two channels of 16 positions for one query head;
 *   the int32 sum times (query scale x key scale) in float32, then the float16 outlier channels
 *   in float32 as in block_avx512.c.
 * - Values: the softmax weights (times the value scales) of a block quantized to int16 per
 *   query head against the block's largest weight; two value rows widened and interleaved,
 *   so one vpdpwssd adds two positions of 16 channels; the int32 sums times the block's weight
 *   scale added into the float32 accumulator once per block.
 *
 * Integer sums are exact, so the result depends only on the block's data (the same bits alone,
 * batched and on any thread count); the only rounding added to the float32 path's is the two
 * 15-bit quantizations, ~1e-5 of the output, far below the int8 cache's own error (~1e-2):
 * docs/design.md, "int8 by integer dot products" has the bound and the measurements.
 */
#include "gqa_avx512.h"

#if GQA_X86_64
/* acc += the pairwise products of a's and b's int16 lanes, in place: GCC's intrinsic copies
 * every accumulator to a fresh register and back around each instruction. Both operands in
 * registers, the query's (or weights') word broadcast once for all the products that use it:
 * a {1to16} memory operand is a 512-bit load per instruction, and an Ice Lake issues those once
 * a cycle against two vpdpwssd, so the block was load-bound (docs/design.md, "int8: one
 * broadcast per word, not per product"). */
#ifdef GQA_EMULATE_AVX512
#define DPWSSD(acc, a, b) ((acc) = _mm512_dpwssd_epi32((acc), (a), (b)))
#else
#define DPWSSD(acc, a, b) __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))
#endif

/* The int32 word at p in every lane (vpbroadcastd from memory: a load, no vector port). */
AVX512VNNI static inline __m512i word_bcast(const void *p) {
    int32_t w;
    memcpy(&w, p, sizeof w);
    return _mm512_set1_epi32(w);
}

/* The int16 lanes of the i-th group of 32 positions (or channels) that n fill. */
static inline __mmask32 lanes32(int64_t n, int i) {
    const int64_t left = n - 32 * i;
    return left >= 32 ? (__mmask32)0xFFFFFFFFu : left <= 0 ? 0 : (__mmask32)((1u << left) - 1);
}

/* Head h's query (qf: G rows of dk + no float32, scaled) as int16 channel pairs, one int32 word
 * per pair (the odd last channel paired with 0), (dk + 1) / 2 words per query head at st->qb,
 * then each head's scale (float32): q ~= word halves x scale. Made on an item's first block. */
AVX512VNNI static void query_int16(const gqa_cache_t *cc, const float *qf, state_t *st) {
    const int64_t G = cc->g, dk = cc->dk, dq = dk + cc->no, words = (dk + 1) / 2;
    int16_t *q16 = (int16_t *)st->qb;
    float *scale = (float *)(q16 + 2 * G * words);
    for (int64_t g = 0; g < G; g++) {
        const float *q = qf + g * dq;
        __m512 mx = _mm512_setzero_ps();
        for (int64_t j = 0; j < dk; j += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes16(dk - j, 0), q + j)));
        const float amax = _mm512_reduce_max_ps(mx), inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        const __m512 vinv = _mm512_set1_ps(inv);
        int16_t *row = q16 + 2 * g * words;
        for (int64_t j = 0; j < 2 * words; j += 16) { /* round to nearest even; the pad channel 0 */
            const __mmask16 m = lanes16(dk - j, 0);
            const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, q + j), vinv));
            const __m512i lim = _mm512_set1_epi32(32767);
            _mm256_mask_storeu_epi16(row + j, lanes16(2 * words - j, 0),
                                     _mm512_cvtepi32_epi16(_mm512_max_epi32(_mm512_min_epi32(c, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim))));
        }
        scale[g] = amax / 32767.0f;
    }
    st->qready = 1;
}

/* Positions 0..31 of a pair of int32 vectors made by unpacklo/hi_epi16 of two 32-lane int16
 * vectors (lo: 0-3, 8-11, 16-19, 24-27; hi: 4-7, 12-15, 20-23, 28-31) back in order: the
 * first 16 (half 0) or the last 16 (half 1). */
AVX512VNNI static inline __m512i in_order(__m512i lo, __m512i hi, const int half) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    return _mm512_permutex2var_epi32(lo, half ? second : first, hi);
}

/* Two rows of 32 int8 codes (b NULL: zeros, a constant after inlining) widened to int16 and
 * interleaved: lo, hi as in in_order, each lane an (a, b) pair for vpdpwssd. */
AVX512VNNI static inline __attribute__((always_inline)) void pairs16(const char *a, const char *b, __mmask32 m,
                                                                      __m512i *lo, __m512i *hi) {
    const __m512i x = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, a));
    const __m512i y = b ? _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, b)) : _mm512_setzero_si512();
    *lo = _mm512_unpacklo_epi16(x, y);
    *hi = _mm512_unpackhi_epi16(x, y);
}

/* One channel pair (r1 NULL: the odd last channel alone) of the block's nh halves into the
 * gt heads' accumulators: query word l of each head (words apart); each half a slot of the
 * next block's drip dr, its line asked for before the half's loads. */
AVX512VNNI static inline __attribute__((always_inline)) void score_pair(__m512i acc[TILE_G][4], const int32_t *qw,
                                                                         int64_t words, int64_t l, const char *r0,
                                                                         const char *r1, const __mmask32 *m32,
                                                                         const int gt, const int nh, drip_t *dr) {
    __m512i qb[TILE_G];
    for (int g = 0; g < gt; g++) qb[g] = word_bcast(qw + g * words + l);
    for (int s = 0; s < nh; s++) {
        drip_slot(dr, 1);
        drip_line(dr);
        __m512i lo, hi;
        pairs16(r0 + 32 * s, r1 ? r1 + 32 * s : NULL, m32[s], &lo, &hi);
        for (int g = 0; g < gt; g++) {
            DPWSSD(acc[g][2 * s], lo, qb[g]);
            DPWSSD(acc[g][2 * s + 1], hi, qb[g]);
        }
    }
}

/* Scores of `gt` query heads (from g0) against one block to out[g * TILE_T + t] (-inf past nt):
 * the coded channels two lines at a time; nh (a constant): the block's 32-position halves;
 * dr: the next block's drip, a slot a half (score_pair). */
AVX512VNNI static inline __attribute__((always_inline)) void scores_vnni(
    const gqa_cache_t *cc, const float *qf, const state_t *st, int64_t g0, int64_t h, int64_t phys,
    const char *kb, int64_t kline, const float *ks, int64_t nt, const int gt, const int nh, drip_t *dr, float *out) {
    const int64_t dk = cc->dk, no = cc->no, dq = dk + no, words = (dk + 1) / 2;
    const int32_t *qw = (const int32_t *)st->qb + g0 * words;
    const float *qscale = (const float *)((const int16_t *)st->qb + 2 * cc->g * words) + g0;
    __m512i acc[TILE_G][4];
    const __mmask32 m32[2] = {lanes32(nt, 0), lanes32(nt, 1)};
    for (int g = 0; g < gt; g++)
        for (int i = 0; i < 2 * nh; i++) acc[g][i] = _mm512_setzero_si512();
    for (int64_t l = 0; l < dk / 2; l++) {
        const char *r0 = kb + 2 * l * kline;
        score_pair(acc, qw, words, l, r0, r0 + kline, m32, gt, nh, dr);
    }
    if (dk % 2) score_pair(acc, qw, words, dk / 2, kb + (dk - 1) * kline, NULL, m32, gt, nh, dr);
    /* the sums in position order, as float32 (in registers: constant indices only) */
    __m512 f[TILE_G][4];
    for (int g = 0; g < gt; g++)
        for (int s = 0; s < 2; s++) {
            f[g][2 * s] = f[g][2 * s + 1] = _mm512_setzero_ps();
            if (s < nh) {
                f[g][2 * s] = _mm512_cvtepi32_ps(in_order(acc[g][2 * s], acc[g][2 * s + 1], 0));
                f[g][2 * s + 1] = _mm512_cvtepi32_ps(in_order(acc[g][2 * s], acc[g][2 * s + 1], 1));
            }
        }
    const uint16_t *kob = cc->ko + h * no * cc->c + phys;
    for (int i = 0; i < 4; i++) {
        const __mmask16 mask = lanes16(nt, i);
        const __m512 s = _mm512_maskz_loadu_ps(mask, ks + 16 * i);
        __m512 y[TILE_G];
        for (int g = 0; g < gt; g++) y[g] = _mm512_mul_ps(_mm512_mul_ps(f[g][i], _mm512_set1_ps(qscale[g])), s);
        for (int64_t o = 0; o < no; o++) { /* float16 channels: not scaled */
            const __m512 x = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, kob + o * cc->c + 16 * i));
            for (int g = 0; g < gt; g++) y[g] = _mm512_fmadd_ps(_mm512_set1_ps(qf[(g0 + g) * dq + dk + o]), x, y[g]);
        }
        for (int g = 0; g < gt; g++)
            _mm512_storeu_ps(out + g * TILE_T + 16 * i, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mask, y[g]));
    }
}

/* The block's weights p (gt x TILE_T, valid below nt) as int16 against each head's largest:
 * wq[g * TILE_T + t] (0 from nt on), p ~= wq x scale[g]. Weights are >= 0. */
AVX512VNNI static inline __attribute__((always_inline)) void weights_int16(const float *p, int64_t nt, const int gt,
                                                                            int16_t *wq, float *scale) {
    for (int g = 0; g < gt; g++) {
        __m512 v[4], mx = _mm512_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm512_maskz_loadu_ps(lanes16(nt, i), p + g * TILE_T + 16 * i);
            mx = _mm512_max_ps(mx, v[i]);
        }
        const float wmax = _mm512_reduce_max_ps(mx), inv = wmax > 0.0f ? 32767.0f / wmax : 0.0f;
        scale[g] = wmax / 32767.0f;
        for (int i = 0; i < 4; i++) {
            const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(inv)));
            _mm256_storeu_si256((__m256i *)(wq + g * TILE_T + 16 * i),
                                _mm512_cvtepi32_epi16(_mm512_min_epi32(c, _mm512_set1_epi32(32767))));
        }
    }
}

/* Value rows t and t + 1 (r1 NULL: zeros) of nc groups of 32 channels into the gt heads'
 * accumulators, times the weights of t and t + 1 (wq[t + 1] is 0 past nt); each group a slot
 * of the drip dr, its line asked for before the group's loads. */
AVX512VNNI static inline __attribute__((always_inline)) void value_pair(__m512i acc[TILE_G][4], const char *r0,
                                                                         const char *r1, const int16_t *wq, int64_t t,
                                                                         const __mmask32 *m32, const int gt, const int nc,
                                                                         drip_t *dr) {
    __m512i lo[2], hi[2];
    for (int c = 0; c < nc; c++) {
        drip_slot(dr, 1);
        drip_line(dr);
        pairs16(r0 + 32 * c, r1 ? r1 + 32 * c : NULL, m32[c], &lo[c], &hi[c]);
    }
    for (int g = 0; g < gt; g++) {
        const __m512i w = word_bcast(wq + g * TILE_T + t);
        for (int c = 0; c < nc; c++) {
            DPWSSD(acc[g][2 * c], lo[c], w);
            DPWSSD(acc[g][2 * c + 1], hi[c], w);
        }
    }
}

/* acc[g][j0 : j0 + n] += scale[g] x sum_t wq[g][t] value[t][j0 : ...], n <= 64 channels in nc
 * (a constant) groups of 32: two value rows at a time, the sums in int32 registers; dr: the
 * next block's drip, a slot a group of a row pair (value_pair). */
AVX512VNNI static inline __attribute__((always_inline)) void pv_vnni(
    float *acc_mem, int64_t d, int64_t j0, int64_t n, const char *vb, const int16_t *wq, const float *scale,
    int64_t nt, const int gt, const int nc, drip_t *dr) {
    __m512i acc[TILE_G][4];
    const __mmask32 m32[2] = {lanes32(n, 0), lanes32(n, 1)};
    for (int g = 0; g < gt; g++)
        for (int i = 0; i < 2 * nc; i++) acc[g][i] = _mm512_setzero_si512();
    int64_t t = 0;
    for (; t + 1 < nt; t += 2) {
        const char *r0 = vb + t * d + j0;
        value_pair(acc, r0, r0 + d, wq, t, m32, gt, nc, dr);
    }
    if (t < nt) value_pair(acc, vb + t * d + j0, NULL, wq, t, m32, gt, nc, dr); /* the odd last row, with zeros */
    for (int g = 0; g < gt; g++) {
        const __m512 s = _mm512_set1_ps(scale[g]);
        for (int c = 0; c < nc; c++)
            for (int half = 0; half < 2; half++) {
                if (32 * c + 16 * half >= n) continue;
                float *at = acc_mem + g * d + j0 + 32 * c + 16 * half;
                const __m512 x = _mm512_cvtepi32_ps(in_order(acc[g][2 * c], acc[g][2 * c + 1], half));
                _mm512_storeu_ps(at, _mm512_fmadd_ps(x, s, _mm512_loadu_ps(at)));
            }
    }
}

/* Scores, online softmax and the weighted sum of the values for one query tile; dr: the next
 * block's drip, asked for by the first tile (per 0 for the others). */
AVX512VNNI static inline __attribute__((always_inline)) void tile_vnni(
    const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t g0, const int gt, const char *kb,
    int64_t kline, const char *vb, const float *ks, const float *vs, int64_t nt, state_t *st, drip_t *dr) {
    const int64_t d = cc->d;
    float *p = st->p;
    if (nt <= 32) scores_vnni(cc, qf, st, g0, h, phys, kb, kline, ks, nt, gt, 1, dr, p);
    else scores_vnni(cc, qf, st, g0, h, phys, kb, kline, ks, nt, gt, 2, dr, p);
    softmax_groups(p, nt, vs, d, gt, st->m + g0, st->l + g0, st->acc + g0 * d, NULL);
    int16_t wq[TILE_G * TILE_T];
    float scale[TILE_G];
    weights_int16(p, nt, gt, wq, scale);
    float *acc = st->acc + g0 * d;
    int64_t j0 = 0;
    for (; j0 + 64 <= d; j0 += 64) pv_vnni(acc, d, j0, 64, vb, wq, scale, nt, gt, 2, dr);
    if (j0 + 32 < d) pv_vnni(acc, d, j0, d - j0, vb, wq, scale, nt, gt, 2, dr);
    else if (j0 < d) pv_vnni(acc, d, j0, d - j0, vb, wq, scale, nt, gt, 1, dr);
}

AVX512VNNI GQA_INTERNAL void block_dot_int8(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys,
                                            int64_t nt, state_t *st) {
    if (cc->dk > 512) { /* int32 sums of more channel pairs could overflow */
        block_avx512_int8(cc, qf, h, phys, nt, st);
        return;
    }
    if (!st->qready) query_int16(cc, qf, st);
    int64_t kline, knline = 0;
    const char *kb, *kn, *vb;
    const float *ks, *vs;
    block_setup_avx512(ENC_INT8, cc, h, phys, nt, st, &kb, &kline, &kn, &knline, &vb, &ks, &vs);
    /* the next block's key lines then value rows, one line a slot (a score half, a group of a
     * value row pair: about as many slots as lines) */
    drip_t next = drip_next(ENC_INT8, cc, st, cc->dk, kn, knline, vb, phys, nt, 0), *dr = &next;
    if (dr->per) dr->per = 1;
    for (int64_t g0 = 0; g0 < cc->g; g0 += TILE_G) {
        if (g0) dr->per = 0; /* asked for by the first tile */
        switch (cc->g - g0 >= TILE_G ? TILE_G : (int)(cc->g - g0)) {
            case 4: tile_vnni(cc, qf, h, phys, g0, 4, kb, kline, vb, ks, vs, nt, st, dr); break;
            case 3: tile_vnni(cc, qf, h, phys, g0, 3, kb, kline, vb, ks, vs, nt, st, dr); break;
            case 2: tile_vnni(cc, qf, h, phys, g0, 2, kb, kline, vb, ks, vs, nt, st, dr); break;
            default: tile_vnni(cc, qf, h, phys, g0, 1, kb, kline, vb, ks, vs, nt, st, dr); break;
        }
    }
    drip_rest(dr);
}
#endif /* GQA_X86_64 */
