/*
 * gqa_avx2.h: the AVX2 pieces the block files share (block_avx2.c, block_avx2_int8.c): exp, the
 * lane masks, widening 8 elements of any encoding (whole or the first n), a key line's 16
 * positions, the end of a block's scores, the online-softmax update of a block and an int8
 * block's scales. All inline: each block function gets its own copy, specialized to its
 * encoding and tile by constant folding.
 */
#ifndef GQA_AVX2_H
#define GQA_AVX2_H

#include "gqa_internal.h"

#if GQA_X86_64
#include <immintrin.h>

/* exp(x) for x <= 0: 2^n * e^r with |r| <= ln2 / 2, the degree-7 polynomial of exp512; x is
 * clamped at -87 (2^n stays a normal float: e^-87 ~ 1.6e-38 stands for 0, which the callers'
 * lanes past nt get by masking). A NaN (a score of inf - inf: no finite score in a head) stays
 * NaN, as expf's does: maxps returns its second operand when one is NaN. */
AVX2 static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945309f));
    __m256 y = _mm256_set1_ps(1.0f / 5040.0f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 720.0f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 120.0f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 24.0f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 6.0f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* All ones in the lanes i < n of 8 (n <= 0: none, n >= 8: all). */
AVX2 static inline __m256 lanes8(int64_t n) {
    const int32_t k = n < 0 ? 0 : n > 8 ? 8 : (int32_t)n;
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

AVX2 static inline float hmax8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

AVX2 static inline float hsum8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 consecutive elements of encoding enc widened to float32 (bfloat16 key lines hold channel
 * pairs: words16 reads those). */
AVX2 static inline __attribute__((always_inline)) __m256 widen8(const int enc, const void *p) {
    switch (enc) {
        case ENC_F32: return _mm256_loadu_ps(p);
        case ENC_BF16:
            return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
        case ENC_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        default: return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    }
}

/* The first n (<= 16) bytes at p in a register, zeros after, reading no byte past them: gathered
 * byte by byte (a copy through memory would stall the vector load that reads it back). */
AVX2 static inline __attribute__((always_inline)) __m128i bytes16(const char *p, int64_t n) {
    uint64_t lo = 0, hi = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint64_t b = (uint8_t)p[i];
        if (i < 8) lo |= b << (8 * i);
        else hi |= b << (8 * (i - 8));
    }
    return _mm_set_epi64x((long long)hi, (long long)lo);
}

/* The first n (< 8) of 8 elements of encoding enc at p widened to float32, zeros after, reading
 * no byte past them: 32-bit elements by a masked load, narrower ones by bytes16. */
AVX2 static inline __attribute__((always_inline)) __m256 partial8(const int enc, const char *p, int64_t n) {
    if (enc == ENC_F32) return _mm256_maskload_ps((const float *)p, _mm256_castps_si256(lanes8(n)));
    const __m128i raw = bytes16(p, n * enc_size(enc));
    switch (enc) {
        case ENC_BF16: return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
        case ENC_F16: return _mm256_cvtph_ps(raw);
        default: return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
    }
}

/* Two registers of 16 positions of a key line (nt16 < 16: the first nt16 of them, zeros after). */
AVX2 static inline __attribute__((always_inline)) void key16(const int enc, const char *row, int64_t nt16, __m256 *k0,
                                                              __m256 *k1) {
    const int64_t el = enc_size(enc);
    if (nt16 >= 16) {
        *k0 = widen8(enc, row);
        *k1 = widen8(enc, row + 8 * el);
        return;
    }
    *k0 = nt16 >= 8 ? widen8(enc, row) : partial8(enc, row, nt16);
    *k1 = nt16 <= 8 ? _mm256_setzero_ps() : partial8(enc, row + 8 * el, nt16 - 8);
}

/* The end of an int8 block's scores for 16 positions from t0 (left of them readable; attended
 * of them valid), y (gt heads x 2 registers) already times the key scales: the float16 outlier
 * channels (rows of kob, c apart; q's channels dk.. of each head, dq apart) added, then the
 * scores to out[g * TILE_T + t0 ...], -inf past the attended ones. A dense block (no = 0) only
 * stores. */
AVX2 static inline __attribute__((always_inline)) void scores16_finish(__m256 y[TILE_G][2], const float *q, int64_t dq,
                                                                        int64_t dk, int64_t no, const uint16_t *kob,
                                                                        int64_t c, int64_t t0, int64_t left,
                                                                        int64_t attended, const int gt, float *out) {
    for (int64_t o = 0; o < no; o++) { /* float16 channels: not scaled */
        __m256 x0, x1;
        key16(ENC_F16, (const char *)(kob + o * c + t0), left, &x0, &x1);
        for (int g = 0; g < gt; g++) {
            const __m256 qo = _mm256_broadcast_ss(q + g * dq + dk + o);
            y[g][0] = _mm256_fmadd_ps(qo, x0, y[g][0]);
            y[g][1] = _mm256_fmadd_ps(qo, x1, y[g][1]);
        }
    }
    const __m256 ninf = _mm256_set1_ps(-INFINITY), m0 = lanes8(attended), m1 = lanes8(attended - 8);
    for (int g = 0; g < gt; g++) {
        _mm256_storeu_ps(out + g * TILE_T + t0, _mm256_blendv_ps(ninf, y[g][0], m0));
        _mm256_storeu_ps(out + g * TILE_T + t0 + 8, _mm256_blendv_ps(ninf, y[g][1], m1));
    }
}

/* The online-softmax update of one block for `gt` query heads: p[g][t] holds the scores of
 * the block's first `ng` groups of 8 (-inf past nt) and becomes exp(score - m) (times vs[t]
 * when given, 0 past nt); the running max m, sum l and accumulators acc (gt x d) are rescaled
 * when the max grows. pmax (or NULL, a constant): each head's largest weight as stored, for the
 * int8 block's quantization of them (weights_int16_avx2). Only a short block's last group of 8
 * is masked. */
AVX2 static inline __attribute__((always_inline)) void softmax_avx2(float *p, int64_t nt, const float *vs, int64_t d,
                                                                     const int gt, float *ms, float *ls, float *accs,
                                                                     float *pmax) {
    const int64_t ng = (nt + 7) / 8, whole = nt / 8;
    for (int g = 0; g < gt; g++) {
        float *pg = p + g * TILE_T;
        __m256 mx = _mm256_loadu_ps(pg);
        for (int64_t i = 1; i < ng; i++) mx = _mm256_max_ps(mx, _mm256_loadu_ps(pg + 8 * i));
        const float bmax = hmax8(mx);
        float *m = ms + g, *l = ls + g, *acc = accs + g * d;
        if (bmax > *m) {
            if (*l != 0.0f) { /* l == 0: no block summed yet, acc all +0, which alpha (0) leaves as it is */
                const float alpha = expf(*m - bmax);
                *l *= alpha;
                const __m256 a = _mm256_set1_ps(alpha);
                for (int64_t j = 0; j < d; j += 8) _mm256_storeu_ps(acc + j, _mm256_mul_ps(a, _mm256_loadu_ps(acc + j)));
            }
            *m = bmax;
        }
        const __m256 mm = _mm256_set1_ps(*m);
        __m256 sum = _mm256_setzero_ps(), top = _mm256_setzero_ps();
        for (int64_t i = 0; i < ng; i++) {
            __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(pg + 8 * i), mm));
            if (i == whole) e = _mm256_and_ps(lanes8(nt - 8 * i), e); /* the short last group */
            sum = _mm256_add_ps(sum, e);
            const __m256 w = vs ? _mm256_mul_ps(e, _mm256_loadu_ps(vs + 8 * i)) : e;
            _mm256_storeu_ps(pg + 8 * i, w);
            if (pmax) top = _mm256_max_ps(top, w);
        }
        *l += hsum8(sum);
        if (pmax) pmax[g] = hmax8(top);
    }
}

/* The next block's lines [x, x + per) below `asks` asked for (kn's, 64 bytes each). `asking`, a
 * constant: 0 none (no next block), 1 at most one (per 1, the usual geometry: one test, no
 * loop), 2 any number. A loop of asks inside a row loop made GCC copy the loop's sums
 * register to register at its end and spill one to the stack (the int8 value sum's: a fifth
 * of its samples on the add after that reload), so each kind of asking gets a row loop of its
 * own (docs/design.md, "Row loops without a loop of asks inside (AVX2)"). */
AVX2 static inline __attribute__((always_inline)) void ask_lines(const char *kn, int64_t x, int64_t per, int64_t asks,
                                                                  const int asking) {
    if (asking == 1) {
        if (x < asks) _mm_prefetch(kn + x * 64, _MM_HINT_T1);
    } else if (asking == 2) {
        for (int64_t e = x + per; x < e && x < asks; x++) _mm_prefetch(kn + x * 64, _MM_HINT_T1);
    }
}

/* An int8 block's key and value scales (nt of them from ring row phys of KV head h) as float32 in
 * st->ksb and st->vsb, zeros from nt to TILE_T. */
AVX2 static inline void block_scales_avx2(const gqa_cache_t *cc, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    const int64_t at = h * cc->scale_stride + phys;
    for (int64_t t = 0; t < TILE_T; t += 8) {
        __m256 k, v;
        if (t + 8 <= nt && (cc->flags & FLAG_HALF_SCALES)) {
            k = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cc->ks + at + t)));
            v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cc->vs + at + t)));
        } else if (t + 8 <= nt) {
            k = _mm256_loadu_ps((const float *)cc->ks + at + t);
            v = _mm256_loadu_ps((const float *)cc->vs + at + t);
        } else {
            _Alignas(32) float kt[8] = {0}, vt[8] = {0};
            for (int64_t x = t; x < nt; x++) {
                kt[x - t] = load_elem(cc->flags & FLAG_HALF_SCALES ? ENC_F16 : ENC_F32, cc->ks, at + x);
                vt[x - t] = load_elem(cc->flags & FLAG_HALF_SCALES ? ENC_F16 : ENC_F32, cc->vs, at + x);
            }
            k = _mm256_load_ps(kt);
            v = _mm256_load_ps(vt);
        }
        _mm256_storeu_ps(st->ksb + t, k);
        _mm256_storeu_ps(st->vsb + t, v);
    }
}

#endif /* GQA_X86_64 */
#endif /* GQA_AVX2_H */
