/*
 * The int8 block of the AVX2 path with integer dot products: vpmaddwd (pairs of int16
 * multiplied and summed into int32) and vpaddd in place of widening every code to float32 and
 * one FMA per query head. block_avx512_int8.c's block_dot_int8 at 8 lanes, for the CPUs
 * without AVX-512 (AVX2 has no vpdpwssd: the product and the sum are two instructions).
 *
 * - Scores: the query of each head quantized once per work item to int16 against its own
 *   absmax (15 bits); two key channel lines of 16 positions widened to int16 and interleaved,
 *   so one vpmaddwd adds two channels of 8 positions for one query head; the int32 sums times
 *   (query scale x key scale) in float32, then the float16 outlier channels in float32.
 * - Values: the softmax weights (times the value scales) of a block quantized to int16 per query
 *   head against the block's largest; two value rows widened and interleaved, so one vpmaddwd
 *   adds two positions of 8 channels; the int32 sums times the block's weight scale go into the
 *   float32 accumulator once per block.
 *
 * The outputs are block_dot_int8's figures to its tolerance (the same two 15-bit roundings, the
 * same integer sums), and depend only on the block's data: bit-identical alone, batched and on
 * any thread count. The next block is asked for as block_avx2.c's blocks ask: evenly over the
 * passes, each run's lines in ascending order. Head widths of more than 512 coded channels (an
 * int32 sum could overflow) or not a multiple of 16 take block_avx2.c's float block.
 */
#include "gqa_avx2.h"

/* GCC's partial redundancy elimination (tree-pre) made the value and score row loops below copy
 * each of their int32 sums register to register on every pass (eight vmovdqa a pass) and store
 * one to the stack: without it the loops are their loads, products and sums alone, and the block
 * runs ~5% faster (docs/design.md, "int8's block on Zen 3"). Other compilers ignore the line. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-tree-pre")
#endif

/* The row loops with two passes written out as one: a pass is ~30 instructions, ~8 of them the
 * loop's own counting, addressing and asking, where Zen 3 dispatches six a cycle. The block ran
 * ~6% faster cold and hot (docs/design.md, "The int8 row loops two passes at a time"). */
#define UNROLL2 _Pragma("GCC unroll 2")

#if GQA_X86_64

/* n (<= 16) int8 codes at p widened to 16 int16 lanes (zeros past n), reading no byte past them. */
AVX2 static inline __attribute__((always_inline)) __m256i codes16(const char *p, int64_t n) {
    return _mm256_cvtepi8_epi16(n >= 16 ? _mm_loadu_si128((const __m128i *)p) : bytes16(p, n));
}

/* 8 int32 lanes (each within [-32767, 32767]) as int16 into dst[0..8). */
AVX2 static inline void store8_int16(int16_t *dst, __m256i c) {
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(c, c), 0xD8);
    _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(packed));
}

/* The int32 sums of a pair of registers made from unpacklo/hi_epi16 (lo: positions or channels
 * 0-3 and 8-11, hi: 4-7 and 12-15) as float32 in order: the first 8 (half 0) or the last 8. */
AVX2 static inline __m256 in_order8(__m256i lo, __m256i hi, const int half) {
    return _mm256_cvtepi32_ps(half ? _mm256_permute2x128_si256(lo, hi, 0x31) : _mm256_permute2x128_si256(lo, hi, 0x20));
}

/* Head h's query (qf: G rows of dk + no float32, scaled) as int16 channel pairs, one int32 word
 * per pair (the odd last channel paired with 0), (dk + 1) / 2 words per query head at st->qb,
 * then each head's scale (float32): q ~= word halves x scale. Made on an item's first block. */
AVX2 static void query_int16_avx2(const gqa_cache_t *cc, const float *qf, state_t *st) {
    const int64_t G = cc->g, dk = cc->dk, dq = dk + cc->no, words = (dk + 1) / 2;
    int16_t *q16 = (int16_t *)st->qb;
    float *scale = (float *)(q16 + 2 * G * words);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t g = 0; g < G; g++) {
        const float *q = qf + g * dq;
        __m256 mx = _mm256_setzero_ps();
        for (int64_t j = 0; j < dk; j += 8)
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_maskload_ps(q + j, _mm256_castps_si256(lanes8(dk - j)))));
        const float amax = hmax8(mx), inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        const __m256 vinv = _mm256_set1_ps(inv);
        const __m256i lim = _mm256_set1_epi32(32767), nlim = _mm256_set1_epi32(-32767);
        int16_t *row = q16 + 2 * g * words;
        for (int64_t j = 0; j < 2 * words; j += 8) { /* round to nearest even; the pad channel 0 */
            const __m256 x = _mm256_maskload_ps(q + j, _mm256_castps_si256(lanes8(dk - j)));
            const __m256i c = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(x, vinv)), lim), nlim);
            if (j + 8 <= 2 * words) store8_int16(row + j, c);
            else {
                _Alignas(32) int32_t tmp[8];
                _mm256_store_si256((__m256i *)tmp, c);
                for (int64_t x8 = j; x8 < 2 * words; x8++) row[x8] = (int16_t)tmp[x8 - j];
            }
        }
        scale[g] = amax / 32767.0f;
    }
    st->qready = 1;
}

/* One channel pair (two key lines at r0 and r0 + kline; pair 0: the odd last channel alone) of
 * 16 positions (left of them read) into the gt heads' accumulators: query word l of each. */
AVX2 static inline __attribute__((always_inline)) void score_pair(__m256i acc[TILE_G][2], const int32_t *qw,
                                                                   int64_t words, int64_t l, const char *r0,
                                                                   int64_t kline, int64_t left, const int pair,
                                                                   const int gt) {
    const __m256i x = codes16(r0, left), y = pair ? codes16(r0 + kline, left) : _mm256_setzero_si256();
    const __m256i lo = _mm256_unpacklo_epi16(x, y), hi = _mm256_unpackhi_epi16(x, y);
    for (int g = 0; g < gt; g++) {
        const __m256i w = _mm256_set1_epi32(qw[g * words + l]);
        acc[g][0] = _mm256_add_epi32(acc[g][0], _mm256_madd_epi16(lo, w));
        acc[g][1] = _mm256_add_epi32(acc[g][1], _mm256_madd_epi16(hi, w));
    }
}

/* Scores of `gt` query heads against positions [t0, t0 + 16) of a block of nt, into
 * out[g * TILE_T + t0 ...] (-inf past nt), as block_avx2.c's scores16_avx2: `full` the 16
 * positions lie inside the block's lines; kn (or NULL) the next block's key lines, asked for
 * evenly over the block's passes in ascending order. */
AVX2 static inline __attribute__((always_inline)) void scores16_int8(
    const int32_t *qw, const float *qscale, const float *q, int64_t dk, int64_t no, const char *kb, int64_t kline,
    const uint16_t *kob, int64_t c, const float *ks, int64_t t0, int64_t nt, const int gt, const int full,
    const char *kn, int64_t knline, float *out) {
    const int64_t dq = dk + no, words = (dk + 1) / 2, left = full ? 16 : nt - t0, attended = nt - t0;
    const int64_t passes = (nt + 15) / 16, asks = (dk * knline + 63) / 64;
    const int64_t per = (asks + passes * words - 1) / (passes * words), ask0 = t0 / 16 * words * per;
    __m256i acc[TILE_G][2];
    for (int g = 0; g < gt; g++) acc[g][0] = acc[g][1] = _mm256_setzero_si256();
    if (kn && per > 1) /* each kind of asking its own loop (ask_lines) */
        UNROLL2
        for (int64_t l = 0; l < dk / 2; l++) {
            ask_lines(kn, ask0 + l * per, per, asks, 2);
            score_pair(acc, qw, words, l, kb + 2 * l * kline + t0, kline, left, 1, gt);
        }
    else if (kn)
        UNROLL2
        for (int64_t l = 0; l < dk / 2; l++) {
            ask_lines(kn, ask0 + l, 1, asks, 1);
            score_pair(acc, qw, words, l, kb + 2 * l * kline + t0, kline, left, 1, gt);
        }
    else
        UNROLL2
        for (int64_t l = 0; l < dk / 2; l++) score_pair(acc, qw, words, l, kb + 2 * l * kline + t0, kline, left, 1, gt);
    if (dk % 2) score_pair(acc, qw, words, dk / 2, kb + (dk - 1) * kline + t0, kline, left, 0, gt);
    const __m256 s0 = _mm256_loadu_ps(ks + t0), s1 = _mm256_loadu_ps(ks + t0 + 8);
    __m256 y[TILE_G][2];
    for (int g = 0; g < gt; g++) {
        const __m256 qs = _mm256_set1_ps(qscale[g]);
        y[g][0] = _mm256_mul_ps(_mm256_mul_ps(in_order8(acc[g][0], acc[g][1], 0), qs), s0);
        y[g][1] = _mm256_mul_ps(_mm256_mul_ps(in_order8(acc[g][0], acc[g][1], 1), qs), s1);
    }
    scores16_finish(y, q, dq, dk, no, kob, c, t0, left, attended, gt, out);
}

/* The block's weights p (gt x TILE_T, valid below nt, 0 from nt to the end of its group of 8:
 * softmax_avx2's) as int16 against each head's largest, pmax[g] (softmax_avx2's): wq[g * TILE_T
 * + t], p ~= wq x scale[g]. Weights are >= 0. */
AVX2 static inline __attribute__((always_inline)) void weights_int16_avx2(const float *p, int64_t nt, const int gt,
                                                                           const float *pmax, int16_t *wq,
                                                                           float *scale) {
    const int64_t ng = (nt + 7) / 8;
    for (int g = 0; g < gt; g++) {
        const float wmax = pmax[g], inv = wmax > 0.0f ? 32767.0f / wmax : 0.0f;
        const __m256 vinv = _mm256_set1_ps(inv);
        scale[g] = wmax / 32767.0f;
        for (int64_t i = 0; i < ng; i++) {
            const __m256 v = _mm256_loadu_ps(p + g * TILE_T + 8 * i);
            store8_int16(wq + g * TILE_T + 8 * i, _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v, vinv)), _mm256_set1_epi32(32767)));
        }
    }
}

/* Value rows t and t + 1 (pair 0: row t alone) of nc groups of 16 channels at r0 into the gt
 * heads' accumulators, times the weights of t and t + 1: wt[g * TILE_T], head g's two int16
 * weights (weights_int16_avx2's wq at row t), broadcast as one int32 word into the register
 * its two products share. A table of the broadcast words made once a block, read by the
 * products, cost the block ~5% more (building it, and 4 KiB more in L1): docs/design.md, "The
 * int8 value sum's loop, trimmed". */
AVX2 static inline __attribute__((always_inline)) void value_pair(__m256i acc[TILE_G][4], const char *r0, int64_t d,
                                                                   const int16_t *wt, const int pair, const int gt,
                                                                   const int nc) {
    __m256i lo[2], hi[2];
    for (int i = 0; i < nc; i++) {
        const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(r0 + 16 * i)));
        const __m256i y = pair ? _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(r0 + d + 16 * i))) : _mm256_setzero_si256();
        lo[i] = _mm256_unpacklo_epi16(x, y);
        hi[i] = _mm256_unpackhi_epi16(x, y);
    }
    for (int g = 0; g < gt; g++) {
        int32_t wpair;
        memcpy(&wpair, wt + g * TILE_T, sizeof wpair);
        const __m256i w = _mm256_set1_epi32(wpair);
        for (int i = 0; i < nc; i++) {
            acc[g][2 * i] = _mm256_add_epi32(acc[g][2 * i], _mm256_madd_epi16(lo[i], w));
            acc[g][2 * i + 1] = _mm256_add_epi32(acc[g][2 * i + 1], _mm256_madd_epi16(hi[i], w));
        }
    }
}

/* acc[g][j0 : j0 + 16 nc] += scale[g] x sum_t wq[g][t] value[t][j0 : ...] for gt heads, nc (1 or
 * 2, gt x nc <= 4) groups of 16 channels: two value rows at a time, the sums in int32 registers.
 * vn (or NULL): the next block's values (vbytes), asked for a line per row read across the
 * passes (row t: lines slot0 + t, slot0 + t + slots, ...). */
AVX2 static inline __attribute__((always_inline)) void pv_int8(float *acc_mem, int64_t d, int64_t j0, const char *vb,
                                                                const int16_t *wq, const float *scale, int64_t nt,
                                                                const int gt, const int nc, const char *vn,
                                                                int64_t vbytes, int64_t slot0, int64_t slots) {
    __m256i acc[TILE_G][4];
    for (int g = 0; g < gt; g++)
        for (int i = 0; i < 2 * nc; i++) acc[g][i] = _mm256_setzero_si256();
    int64_t t = 0;
    if (vn && slots * 64 < vbytes) /* rows that ask for several lines each (a short block's) */
        UNROLL2
        for (; t + 1 < nt; t += 2) {
            for (int64_t x = (slot0 + t) * 64; x < vbytes; x += slots * 64) {
                _mm_prefetch(vn + x, _MM_HINT_T1);
                if (x + 64 < vbytes) _mm_prefetch(vn + x + 64, _MM_HINT_T1);
            }
            value_pair(acc, vb + t * d + j0, d, wq + t, 1, gt, nc);
        }
    else if (vn) { /* one line a row at most: first the pairs whose two lines both lie below vbytes,
                    * asking unchecked, then the rest, asking nothing. No loop of asks (the sums stay in
                    * registers) and no test a row: ~40 instructions a pair were ~30 (docs/design.md,
                    * "The int8 value sum's loop, trimmed") */
        const int64_t asked = vbytes / 64 - slot0; /* rows t < asked ask for line slot0 + t */
        const int64_t both = asked < nt ? asked : nt;
        const char *ask = vn + slot0 * 64, *row = vb + j0;
        const int16_t *w = wq;
        UNROLL2
        for (; t + 1 < both; t += 2, ask += 128, row += 2 * d, w += 2) {
            _mm_prefetch(ask, _MM_HINT_T1);
            _mm_prefetch(ask + 64, _MM_HINT_T1);
            value_pair(acc, row, d, w, 1, gt, nc);
        }
        if (t + 1 < nt && t < asked) { /* the last asking row's pair */
            _mm_prefetch(ask, _MM_HINT_T1);
            value_pair(acc, row, d, w, 1, gt, nc);
            t += 2;
            row += 2 * d;
            w += 2;
        }
        UNROLL2
        for (; t + 1 < nt; t += 2, row += 2 * d, w += 2) value_pair(acc, row, d, w, 1, gt, nc);
    } else
        UNROLL2
        for (; t + 1 < nt; t += 2) value_pair(acc, vb + t * d + j0, d, wq + t, 1, gt, nc);
    if (t < nt) { /* the odd last row, paired with zeros */
        if (vn)
            for (int64_t x = (slot0 + t) * 64; x < vbytes; x += slots * 64) _mm_prefetch(vn + x, _MM_HINT_T1);
        value_pair(acc, vb + t * d + j0, d, wq + t, 0, gt, nc);
    }
    for (int g = 0; g < gt; g++) {
        const __m256 s = _mm256_set1_ps(scale[g]);
        for (int i = 0; i < nc; i++)
            for (int half = 0; half < 2; half++) {
                float *at = acc_mem + g * d + j0 + 16 * i + 8 * half;
                _mm256_storeu_ps(at, _mm256_fmadd_ps(in_order8(acc[g][2 * i], acc[g][2 * i + 1], half), s, _mm256_loadu_ps(at)));
            }
    }
}

/* Scores, online softmax and value sum of one tile of gt query heads (g0 the first). */
AVX2 static inline __attribute__((always_inline)) void tile_int8(const gqa_cache_t *cc, const float *qf, int64_t h,
                                                                  int64_t phys, int64_t g0, const int gt,
                                                                  const char *kb, int64_t kline, const char *vb,
                                                                  int64_t nt, state_t *st) {
    const float *ks = st->ksb, *vs = st->vsb; /* the block's scales (block_scales_avx2) */
    int64_t knline = 0; /* the first tile of a block that has a next one in the item's reach asks for it */
    const char *kn = g0 == 0 && st->prefetch ? (const char *)cc->k + key_block(cc, h, phys + nt, &knline) : NULL;
    const int64_t d = cc->d, dk = cc->dk, no = cc->no, words = (dk + 1) / 2;
    const int32_t *qw = (const int32_t *)st->qb + g0 * words;
    const float *qscale = (const float *)((const int16_t *)st->qb + 2 * cc->g * words) + g0;
    const float *q = qf + g0 * (dk + no);
    const uint16_t *ko = cc->ko + h * no * cc->c + phys;
    float *p = st->p;
    /* positions from phys to the end of its block's lines: what a load may read */
    const int64_t b0 = phys - phys % TILE_T, room = (cc->c - b0 < TILE_T ? cc->c - b0 : TILE_T) - (phys - b0);
    for (int64_t t0 = 0; t0 < nt; t0 += 16) {
        if (t0 + 16 <= room) scores16_int8(qw, qscale, q, dk, no, kb, kline, ko, cc->c, ks, t0, nt, gt, 1, kn, knline, p);
        else scores16_int8(qw, qscale, q, dk, no, kb, kline, ko, cc->c, ks, t0, nt, gt, 0, kn, knline, p);
    }
    float pmax[TILE_G];
    softmax_avx2(p, nt, vs, d, gt, st->m + g0, st->l + g0, st->acc + g0 * d, pmax);
    _Alignas(32) int16_t wq[TILE_G * TILE_T];
    float scale[TILE_G];
    weights_int16_avx2(p, nt, gt, pmax, wq, scale);
    const int nc = gt >= 3 ? 1 : 2;
    const int64_t w = 16 * nc, slots = (d / w + d % w / 16) * nt;
    const char *vn = kn ? vb + nt * d : NULL;
    int64_t j0 = 0, slot0 = 0;
    for (; j0 + w <= d; j0 += w, slot0 += nt) pv_int8(st->acc + g0 * d, d, j0, vb, wq, scale, nt, gt, nc, vn, TILE_T * d, slot0, slots);
    for (; j0 < d; j0 += 16, slot0 += nt) pv_int8(st->acc + g0 * d, d, j0, vb, wq, scale, nt, gt, 1, vn, TILE_T * d, slot0, slots);
}

AVX2 GQA_INTERNAL void block_avx2_dot_int8(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys,
                                           int64_t nt, state_t *st) {
    if (cc->dk > 512 || cc->d % 16) { /* int32 sums could overflow; value rows in 16s */
        block_avx2_int8(cc, qf, h, phys, nt, st);
        return;
    }
    if (!st->qready) query_int16_avx2(cc, qf, st);
    int64_t kline;
    const char *kb = (const char *)cc->k + key_block(cc, h, phys, &kline);
    const char *vb = (const char *)cc->v + (h * cc->c + phys) * cc->d;
    block_scales_avx2(cc, h, phys, nt, st);
    if (st->prefetch) prefetch_int8_side(cc, h, phys + nt, TILE_T, 2); /* the next block's, with its keys */
    for (int64_t g0 = 0; g0 < cc->g; g0 += TILE_G) {
        switch (cc->g - g0 >= TILE_G ? TILE_G : (int)(cc->g - g0)) {
            case 4: tile_int8(cc, qf, h, phys, g0, 4, kb, kline, vb, nt, st); break;
            case 3: tile_int8(cc, qf, h, phys, g0, 3, kb, kline, vb, nt, st); break;
            case 2: tile_int8(cc, qf, h, phys, g0, 2, kb, kline, vb, nt, st); break;
            default: tile_int8(cc, qf, h, phys, g0, 1, kb, kline, vb, nt, st); break;
        }
    }
}
#endif /* GQA_X86_64 */
