/*
 * The AVX2 blocks (with FMA and F16C) of every encoding: what x86-64 CPUs without AVX-512 run
 * (AMD Zen 1-3, most Intel client cores). int8 takes the integer block of block_avx2_int8.c
 * and this file's float one only where that cannot (D not a multiple of 16, over 512 coded
 * channels). The walk of block_avx512.c at 8 lanes with 16 registers instead of 32:
 *
 * - scores: 16 positions of a block at a time (two registers) for up to TILE_G query heads,
 *   one key channel line after the other (2 x TILE_G accumulators, two key registers, one
 *   broadcast); the lanes past the block's nt positions end as -inf; a whole float16 block for
 *   four heads as two pairs at 32 positions (a whole key line a channel: scores32_pair_f16);
 * - the online softmax of gqa_avx512.h's, the exponential from its exponent bits (no scalef);
 * - the value sum for all the tile's query heads at once over a slice of each row (16 channels
 *   for 3 or 4 heads, 32 for 1 or 2: up to 8 accumulators), every row of the block in order, so
 *   each value line is read (and widened) once per tile; four heads of a 16-bit encoding as two
 *   pairs of 32 channels instead, the second pair on the lines the first just read (fewer loads
 *   a line: pv_block_avx2); bfloat16 rows widened as the keys are,
 *   a 16-channel run's words split by a shift and a mask into its even and odd channels (the
 *   accumulators take that lane order for the block), two instructions where widening each half
 *   took four: on a CPU with 128-bit vector units (Zen 1) the widening had held the sum back.
 *
 * Registers load 16 positions whole wherever the block's lines hold them (the lanes past nt are
 * masked); where a line ends sooner (the ring's last, short block; a cache of fewer than 16
 * rows) they load whole still while the load ends inside the block (reading on into the next
 * lines, lanes masked after), and by a masked load or a register built byte by byte only near
 * the block's end, so no load reaches past a block. The first tile of a block asks for the next block
 * evenly as it goes, each run's cache lines in ascending order: its keys' with the key lines the
 * scores read, its values' with the value rows the sum reads (docs/design.md, "Asking for the
 * next block evenly": bursts of asks hold up the loads the arithmetic waits on, and asks in
 * ascending order let the L2's own prefetcher run ahead of them).
 */
#include "gqa_avx2.h"

#if GQA_X86_64

/* Two registers of 16 positions of a bfloat16 key line of channel pairs, as 32-bit words. */
AVX2 static inline __attribute__((always_inline)) void words16(const char *row, int64_t nt16, __m256i *w0, __m256i *w1) {
    if (nt16 >= 16) {
        *w0 = _mm256_loadu_si256((const __m256i *)row);
        *w1 = _mm256_loadu_si256((const __m256i *)(row + 32));
        return;
    }
    *w0 = nt16 >= 8 ? _mm256_loadu_si256((const __m256i *)row)
                    : _mm256_maskload_epi32((const int *)row, _mm256_castps_si256(lanes8(nt16)));
    *w1 = nt16 <= 8 ? _mm256_setzero_si256()
                    : _mm256_maskload_epi32((const int *)(row + 32), _mm256_castps_si256(lanes8(nt16 - 8)));
}

/* Scores of `gt` query heads against positions [t0, t0 + 16) of a block of nt, into
 * out[g * TILE_T + t0 ...] (-inf past nt); int8: times the key scales ks (zero-padded to
 * TILE_T), plus the float16 outlier channels (rows of kob, c apart). `full`: the 16 positions
 * lie inside the block's lines (those past nt are read, then masked), so whole registers load.
 * nreg 1: the pass holds at most 8 positions (t0 + 8 >= nt), so only the first register of them
 * is read and summed (`full`: 8 positions inside the lines), the second left at -inf.
 * kn (or NULL): the next block's keys (one contiguous run of `asks` cache lines): the block's
 * (nt + 15) / 16 passes ask for its lines in ascending order, this pass its share, `per` with
 * each key line it reads (ask_lines, as `asking` says: scores16_avx2 below). */
AVX2 static inline __attribute__((always_inline)) void scores16_asking(
    const int enc, const float *q, int64_t dk, int64_t no, const char *kb, int64_t kline, const uint16_t *kob,
    int64_t c, const float *ks, int64_t t0, int64_t nt, const int gt, const int full, const int nreg, const char *kend,
    const char *kn, int64_t asks, int64_t per, float *out, const int asking) {
    const int64_t dq = dk + no, el = enc_size(enc), left = full ? 16 : nt - t0, attended = nt - t0;
    const int64_t krows = (dk + kpack(enc) - 1) / kpack(enc);
    const int64_t ask0 = t0 / 16 * krows * per;
    __m256 acc[TILE_G][2];
    for (int g = 0; g < gt; g++) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
    if (kpack(enc) == 1) {
        for (int64_t j = 0; j < dk; j++) {
            const char *row = kb + (j * kline + t0) * el;
            ask_lines(kn, ask0 + j * per, per, asks, asking);
            __m256 k0, k1;
            if (nreg == 2) key16(enc, row, row + 16 * el <= kend ? 16 : left, &k0, &k1);
            else key16(enc, row, left >= 8 || row + 8 * el <= kend ? 8 : left, &k0, &k1);
            for (int g = 0; g < gt; g++) {
                const __m256 qj = _mm256_broadcast_ss(q + g * dq + j);
                acc[g][0] = _mm256_fmadd_ps(qj, k0, acc[g][0]);
                if (nreg == 2) acc[g][1] = _mm256_fmadd_ps(qj, k1, acc[g][1]);
            }
        }
    } else { /* bfloat16, lines of 2 channels a word: the low half, then the high */
        const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
        for (int64_t l = 0; 2 * l < dk; l++) {
            const char *row = kb + (l * kline + 2 * t0) * 2;
            ask_lines(kn, ask0 + l * per, per, asks, asking);
            __m256i w0, w1;
            if (nreg == 2) words16(row, row + 64 <= kend ? 16 : left, &w0, &w1);
            else words16(row, left >= 8 || row + 32 <= kend ? 8 : left, &w0, &w1);
            for (int r = 0; r < 2 && 2 * l + r < dk; r++) {
                const __m256 k0 = _mm256_castsi256_ps(r == 0 ? _mm256_slli_epi32(w0, 16) : _mm256_and_si256(w0, high));
                const __m256 k1 = _mm256_castsi256_ps(r == 0 ? _mm256_slli_epi32(w1, 16) : _mm256_and_si256(w1, high));
                for (int g = 0; g < gt; g++) {
                    const __m256 qj = _mm256_broadcast_ss(q + g * dq + 2 * l + r);
                    acc[g][0] = _mm256_fmadd_ps(qj, k0, acc[g][0]);
                    if (nreg == 2) acc[g][1] = _mm256_fmadd_ps(qj, k1, acc[g][1]);
                }
            }
        }
    }
    if (enc == ENC_INT8) {
        const __m256 s0 = _mm256_loadu_ps(ks + t0), s1 = _mm256_loadu_ps(ks + t0 + 8);
        for (int g = 0; g < gt; g++) {
            acc[g][0] = _mm256_mul_ps(acc[g][0], s0);
            acc[g][1] = _mm256_mul_ps(acc[g][1], s1);
        }
    }
    scores16_finish(acc, q, dq, dk, enc == ENC_INT8 ? no : 0, kob, c, t0, nreg == 2 || left < 8 ? left : 8, attended, gt,
                    out);
}

/* scores16_asking with its kind of asking (ask_lines): kn (or NULL) the next block's keys, krows
 * lines knline elements apart. */
AVX2 static inline __attribute__((always_inline)) void scores16_avx2(
    const int enc, const float *q, int64_t dk, int64_t no, const char *kb, int64_t kline, const uint16_t *kob,
    int64_t c, const float *ks, int64_t t0, int64_t nt, const int gt, const int full, const int nreg, const char *kend,
    const char *kn, int64_t knline, float *out) {
    const int64_t krows = (dk + kpack(enc) - 1) / kpack(enc), passes = (nt + 15) / 16;
    const int64_t asks = (krows * knline * enc_size(enc) + 63) / 64, per = (asks + passes * krows - 1) / (passes * krows);
    if (!kn) scores16_asking(enc, q, dk, no, kb, kline, kob, c, ks, t0, nt, gt, full, nreg, kend, kn, asks, per, out, 0);
    else if (per == 1) scores16_asking(enc, q, dk, no, kb, kline, kob, c, ks, t0, nt, gt, full, nreg, kend, kn, asks, per, out, 1);
    else scores16_asking(enc, q, dk, no, kb, kline, kob, c, ks, t0, nt, gt, full, nreg, kend, kn, asks, per, out, 2);
}

/* 16 float32 channels at m as their even channels (0, 2, .., 14) and their odd ones: the lane
 * order of a bfloat16 row's 16 channels split by a shift and a mask. pairs_store puts them back. */
AVX2 static inline __attribute__((always_inline)) void pairs_load(const float *m, __m256 *even, __m256 *odd) {
    const __m256 x = _mm256_loadu_ps(m), y = _mm256_loadu_ps(m + 8);
    const __m256 lo = _mm256_permute2f128_ps(x, y, 0x20), hi = _mm256_permute2f128_ps(x, y, 0x31);
    *even = _mm256_shuffle_ps(lo, hi, 0x88);
    *odd = _mm256_shuffle_ps(lo, hi, 0xDD);
}

AVX2 static inline __attribute__((always_inline)) void pairs_store(float *m, __m256 even, __m256 odd) {
    const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
    _mm256_storeu_ps(m, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(m + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* Scores of gt query heads against a whole short ring: a block of nt = w rows (1, 2 or 4) at
 * its first row, no outlier channels. A key line holds w positions, so a register of 8 lines'
 * words holds 8 / w consecutive lines (of 1 channel; bfloat16: of 2, split by a shift and a
 * mask into the even channels' register and the odd ones'). It multiplies the query's matching
 * channels, each repeated w times, and each position's score is the sum of its 8 / w lanes at
 * the end. The pass of 16 positions (scores16_avx2) used 8 lanes of a register for one
 * channel's w positions: 8 / w times the loads, broadcasts and FMAs.
 * - float32, float16: the key register reordered position-major (lane p * 8 / w + c, one
 *   cross-lane permute a register, for all gt heads), the query's channels broadcast;
 * - bfloat16 (w 2, 4): the key register as loaded (lane c * w + p), the query's channels
 *   repeated in place by in-lane shuffles (vmovsldup / vmovshdup, vpermilps): a cross-lane
 *   permute of the query per head and register had cost Zen 1 more than the FMAs. Each lane
 *   sums the same products in the same order, and the positions' sums add the same pairs
 *   (hadd's tree), so the scores are bit for bit the position-major ones.
 * out[g * TILE_T ...]: the scores, -inf past nt to TILE_T (the AVX-512 softmax, whose block
 * calls this through scores_lines_avx2_call, takes its max over all TILE_T lanes). */
AVX2 static inline __attribute__((always_inline)) void scores_lines_avx2(const int enc, const float *q, int64_t dk,
                                                                          int64_t dq, const char *kb, const int w,
                                                                          const int gt, float *out) {
    const int64_t el = enc_size(enc), cpl = 8 / w;
    const __m256i order = w == 2 ? _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7) : _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 acc[TILE_G];
    for (int g = 0; g < gt; g++) acc[g] = _mm256_setzero_ps();
    if (enc != ENC_BF16) {
        for (int64_t j = 0; j < dk; j += cpl) {
            __m256 k = widen8(enc, kb + j * w * el);
            if (w > 1) k = _mm256_permutevar8x32_ps(k, order);
            for (int g = 0; g < gt; g++) {
                const float *qj = q + g * dq + j;
                const __m256 qv = w == 1   ? _mm256_loadu_ps(qj)
                                  : w == 2 ? _mm256_broadcast_ps((const __m128 *)qj)
                                           : _mm256_castpd_ps(_mm256_broadcast_sd((const double *)qj));
                acc[g] = _mm256_fmadd_ps(qv, k, acc[g]);
            }
        }
    } else { /* 2 channels a word: 16 / w channels a register, lane c * w + p as loaded */
        const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
        const __m256i even4 = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2), odd4 = _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3);
        for (int64_t j = 0; j < dk; j += 2 * cpl) {
            const __m256i words = _mm256_loadu_si256((const __m256i *)(kb + j * w * el));
            const __m256 k0 = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
            const __m256 k1 = _mm256_castsi256_ps(_mm256_and_si256(words, high));
            for (int g = 0; g < gt; g++) {
                const float *qj = q + g * dq + j;
                __m256 q0, q1;
                if (w == 1) {
                    pairs_load(qj, &q0, &q1);
                } else if (w == 2) { /* channels j + 2c (and + 1), each twice */
                    const __m256 x = _mm256_loadu_ps(qj);
                    q0 = _mm256_moveldup_ps(x);
                    q1 = _mm256_movehdup_ps(x);
                } else { /* channels j, j + 2 (and + 1), each four times */
                    const __m256 x = _mm256_broadcast_ps((const __m128 *)qj);
                    q0 = _mm256_permutevar_ps(x, even4);
                    q1 = _mm256_permutevar_ps(x, odd4);
                }
                acc[g] = _mm256_fmadd_ps(q1, k1, _mm256_fmadd_ps(q0, k0, acc[g]));
            }
        }
    }
    const __m256 ninf = _mm256_set1_ps(-INFINITY), live = lanes8(w);
    for (int g = 0; g < gt; g++) {
        __m256 s;
        if (w == 1) {
            s = _mm256_set1_ps(hsum8(acc[g]));
        } else if (enc == ENC_BF16) { /* lane c * w + p: hadd's pairs, (c0 + c1) + (c2 + c3) */
            const __m256 a = acc[g];
            const __m256 pairs = w == 2 ? _mm256_add_ps(a, _mm256_permute_ps(a, _MM_SHUFFLE(1, 0, 3, 2))) : a;
            s = _mm256_add_ps(pairs, _mm256_permute2f128_ps(pairs, pairs, 1));
        } else {
            const __m256 pairs = _mm256_hadd_ps(acc[g], acc[g]); /* w 4: (p0 p1 p0 p1 | p2 p3 p2 p3) */
            s = w == 2 ? _mm256_permutevar8x32_ps(_mm256_hadd_ps(pairs, pairs), _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0))
                       : _mm256_permutevar8x32_ps(pairs, _mm256_setr_epi32(0, 1, 4, 5, 0, 0, 0, 0));
        }
        _mm256_storeu_ps(out + g * TILE_T, _mm256_blendv_ps(ninf, s, live));
        for (int i = 8; i < TILE_T; i += 8) _mm256_storeu_ps(out + g * TILE_T + i, ninf);
    }
}

/* scores_lines_avx2 for another ISA's block (block_avx512.c) of nt = 1, 2 or 4 rows: one call a
 * tile, each (encoding, rows, heads) its own constant-folded copy. */
AVX2 static inline __attribute__((always_inline)) void lines_w(const int enc, const float *q, int64_t dk, int64_t dq,
                                                                const char *kb, const int w, int gt, float *out) {
    switch (gt) {
        case 4: scores_lines_avx2(enc, q, dk, dq, kb, w, 4, out); break;
        case 3: scores_lines_avx2(enc, q, dk, dq, kb, w, 3, out); break;
        case 2: scores_lines_avx2(enc, q, dk, dq, kb, w, 2, out); break;
        default: scores_lines_avx2(enc, q, dk, dq, kb, w, 1, out); break;
    }
}

AVX2 static inline __attribute__((always_inline)) void lines_enc(const int enc, const float *q, int64_t dk, int64_t dq,
                                                                  const char *kb, int64_t nt, int gt, float *out) {
    switch (nt) {
        case 1: lines_w(enc, q, dk, dq, kb, 1, gt, out); break;
        case 2: lines_w(enc, q, dk, dq, kb, 2, gt, out); break;
        default: lines_w(enc, q, dk, dq, kb, 4, gt, out); break;
    }
}

AVX2 GQA_INTERNAL void scores_lines_avx2_call(int enc, const float *q, int64_t dk, int64_t dq, const char *kb, int64_t nt,
                                              int gt, float *out) {
    switch (enc) {
        case ENC_F32: lines_enc(ENC_F32, q, dk, dq, kb, nt, gt, out); break;
        case ENC_BF16: lines_enc(ENC_BF16, q, dk, dq, kb, nt, gt, out); break;
        default: lines_enc(ENC_F16, q, dk, dq, kb, nt, gt, out); break;
    }
}

/* 8 float32 values as float16/bfloat16 (enc) bits in the low half of each 32-bit lane, bit for
 * bit as store_elem (round to nearest even; a NaN becomes float_to_half's or float_to_bf16's
 * quiet NaN of the same sign). */
AVX2 static inline __attribute__((always_inline)) __m256i narrow8_bits(const int enc, __m256 v) {
    const __m256i bits = _mm256_castps_si256(v), high = _mm256_srli_epi32(bits, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    if (enc == ENC_F16) {
        const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i qnan = _mm256_or_si256(_mm256_and_si256(high, _mm256_set1_epi32(0x8000)), _mm256_set1_epi32(0x7E00));
        return _mm256_blendv_epi8(_mm256_cvtepu16_epi32(h), qnan, nan);
    }
    const __m256i lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
    return _mm256_blendv_epi8(r, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
}

/* 8 lanes of narrow8_bits stored as 8 halves, in order. */
AVX2 static inline __attribute__((always_inline)) void store_halves8(uint16_t *dst, __m256i r) {
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(packed));
}

/* 8 output elements from their sums a: (0 + a) x vinv (vinv = 1 / l), as finish_head computes
 * them; a row with l = 0 (`empty`): 0 x (1 / 0), NaN, as there. */
AVX2 static inline __attribute__((always_inline)) __m256 finished8(__m256 a, __m256 vinv, int empty) {
    const __m256 zero = _mm256_setzero_ps();
    return _mm256_mul_ps(empty ? zero : _mm256_add_ps(zero, a), vinv);
}

/* A 16-channel slice summed as its even channels, then its odd ones (pv_avx2's bfloat16 order),
 * stored in channel order as bfloat16: the even channel's bits are the low half of each pair's
 * word and the odd one's the high half, so the order comes back without a permute. */
AVX2 static inline __attribute__((always_inline)) void store_pairs16(uint16_t *dst, __m256 even, __m256 odd) {
    _mm256_storeu_si256((__m256i *)dst,
                        _mm256_or_si256(narrow8_bits(ENC_BF16, even), _mm256_slli_epi32(narrow8_bits(ENC_BF16, odd), 16)));
}

/* One value row's slice of 8 nv channels (pv_avx2's) into the gt heads' accumulators, times
 * their weights p[g * TILE_T] (p at the row's position). */
AVX2 static inline __attribute__((always_inline)) void pv_row(const int enc, __m256 acc[TILE_G][4], const char *row,
                                                               const float *p, const int gt, const int nv,
                                                               const int pairs) {
    const int64_t el = enc_size(enc);
    __m256 vf[4];
    if (pairs)
        for (int i = 0; i < nv; i += 2) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(row + 8 * i * el));
            vf[i] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
            vf[i + 1] = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xFFFF0000u)));
        }
    else
        for (int i = 0; i < nv; i++) vf[i] = widen8(enc, row + 8 * i * el);
    for (int g = 0; g < gt; g++) {
        const __m256 w = _mm256_broadcast_ss(p + g * TILE_T);
        for (int i = 0; i < nv; i++) acc[g][i] = _mm256_fmadd_ps(w, vf[i], acc[g][i]);
    }
}

/* acc[g][j0 : j0 + 8 nv] += sum_t p[g][t] * value[t][j0 : ...] for gt (<= 4) query heads and
 * nv (<= 4, gt * nv <= 8) registers of 8 channels, constants after inlining (the accumulators
 * in registers).
 * vn (or NULL): the next block's values, vbytes long; row t asks for its cache lines
 * slot0 + t, slot0 + t + slots, ... (the block's passes share them out).
 * out (or NULL): the block is its heads' only one (st->out): the sums start at 0 in registers
 * (acc_mem is not read) and end as the heads' output rows (the stream's dtype, gt rows of d
 * from out), each element (0 + acc) x (1 / l[g]) narrowed as finish_rows_avx2 does, instead of
 * going back to acc_mem: the same bits, without clearing, storing and reading the
 * accumulator again. */
AVX2 static inline __attribute__((always_inline)) void pv_avx2(const int enc, float *acc_mem, int64_t d, int64_t j0,
                                                                const char *vb, const float *p, int64_t nt,
                                                                const int gt, const int nv, const char *vn,
                                                                int64_t vbytes, int64_t slot0, int64_t slots,
                                                                void *out, const float *l) {
    const int64_t el = enc_size(enc);
    /* bfloat16 in whole 16-channel slices: the channel pairs' words split by a shift and a mask,
     * where the accumulators hold each slice's even channels, then its odd ones (the state's
     * order for this block: store_row puts a row back in channel order, unpair_row_avx2) */
    const int pairs = enc == ENC_BF16 && nv % 2 == 0;
    __m256 acc[TILE_G][4];
    for (int g = 0; g < gt; g++)
        for (int i = 0; i < nv; i++) acc[g][i] = out ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_mem + g * d + j0 + 8 * i);
    /* each kind of asking its own row loop (ask_lines): one ask a row at most when the passes'
     * rows outnumber the next block's lines */
    if (!vn)
        for (int64_t t = 0; t < nt; t++) pv_row(enc, acc, vb + (t * d + j0) * el, p + t, gt, nv, pairs);
    else if (slots * 64 >= vbytes)
        for (int64_t t = 0; t < nt; t++) {
            ask_lines(vn, slot0 + t, 1, vbytes / 64, 1);
            pv_row(enc, acc, vb + (t * d + j0) * el, p + t, gt, nv, pairs);
        }
    else
        for (int64_t t = 0; t < nt; t++) {
            for (int64_t x = (slot0 + t) * 64; x < vbytes; x += slots * 64) _mm_prefetch(vn + x, _MM_HINT_T1);
            pv_row(enc, acc, vb + (t * d + j0) * el, p + t, gt, nv, pairs);
        }
    if (out) {
        for (int g = 0; g < gt; g++) {
            const __m256 vinv = _mm256_set1_ps(1.0f / l[g]);
            const int empty = l[g] == 0.0f;
            __m256 f[4];
            for (int i = 0; i < nv; i++) f[i] = finished8(acc[g][i], vinv, empty);
            if (enc == ENC_F32) {
                float *row = (float *)out + g * d + j0;
                for (int i = 0; i < nv; i++) _mm256_storeu_ps(row + 8 * i, f[i]);
            } else {
                uint16_t *row = (uint16_t *)out + g * d + j0;
                if (pairs)
                    for (int i = 0; i < nv; i += 2) store_pairs16(row + 8 * i, f[i], f[i + 1]);
                else
                    for (int i = 0; i < nv; i++) store_halves8(row + 8 * i, narrow8_bits(enc, f[i]));
            }
        }
        return;
    }
    for (int g = 0; g < gt; g++)
        for (int i = 0; i < nv; i++) _mm256_storeu_ps(acc_mem + g * d + j0 + 8 * i, acc[g][i]);
}

/* A block's weighted value sum for gt (<= 4) query heads (acc: gt x d; d a multiple of 8), a
 * slice of 8 nv channels of every row per pass, then one of 16 and one of 8 for what is left
 * (so every whole 16-channel slice of a bfloat16 row is summed as even and odd channels, for
 * every tile alike); vn (or NULL): the next block's values (vbytes), asked for a line per row
 * read across the passes.
 * Four heads of a 16-bit encoding go as two pairs, each pass 32 channels (a row's whole 64-byte
 * line) for heads 0-1, then the same lines, still in L1, for heads 2-3: two value loads and two
 * weight broadcasts a row of a pair where four heads at 16 channels took one and four a row of
 * 32 bytes. Fewer loads a line let the core run further ahead of its misses: on a Zen 3 the
 * blocks read cold 3-7% (bfloat16) and 10% (float16) faster (docs/design.md, "Four heads as two
 * pairs"). Each (head, channel) sums the same products in the same order: the same bits.
 * float32's 32 channels are two lines a row, read twice, and measured slower: it keeps 16
 * channels for four heads. */
AVX2 static inline __attribute__((always_inline)) void pv_block_avx2(const int enc, float *acc, int64_t d,
                                                                      const char *vb, const float *p, int64_t nt,
                                                                      const int gt, const char *vn, int64_t vbytes,
                                                                      void *out, const float *l) {
    if (gt == 4 && d % 32 == 0 && enc_size(enc) == 2) { /* two pairs of heads, a 64-byte line of each row a pass */
        const int64_t slots = d / 32 * nt;
        char *out2 = out ? (char *)out + 2 * d * enc_size(enc) : NULL;
        for (int64_t j0 = 0, slot0 = 0; j0 < d; j0 += 32, slot0 += nt) {
            pv_avx2(enc, acc, d, j0, vb, p, nt, 2, 4, vn, vbytes, slot0, slots, out, l); /* it asks */
            pv_avx2(enc, acc + 2 * d, d, j0, vb, p + 2 * TILE_T, nt, 2, 4, NULL, vbytes, slot0, slots, out2, l + 2);
        }
        return;
    }
    const int nv = gt >= 3 ? 2 : 4;
    const int64_t w = 8 * nv, rest = d % w, slots = (d / w + rest / 16 + rest % 16 / 8) * nt;
    int64_t j0 = 0, slot0 = 0;
    for (; j0 + w <= d; j0 += w, slot0 += nt)
        pv_avx2(enc, acc, d, j0, vb, p, nt, gt, nv, vn, vbytes, slot0, slots, out, l);
    if (nv == 4 && j0 + 16 <= d) {
        pv_avx2(enc, acc, d, j0, vb, p, nt, gt, 2, vn, vbytes, slot0, slots, out, l);
        j0 += 16;
        slot0 += nt;
    }
    for (; j0 < d; j0 += 8, slot0 += nt) pv_avx2(enc, acc, d, j0, vb, p, nt, gt, 1, vn, vbytes, slot0, slots, out, l);
}

/* A row the bfloat16 block summed (pv_avx2: each whole 16-channel slice as its even channels,
 * then its odd ones) back in channel order, in place. */
AVX2 GQA_INTERNAL void unpair_row_avx2(float *o, int64_t d) {
    for (int64_t j = 0; j + 16 <= d; j += 16) pairs_store(o + j, _mm256_loadu_ps(o + j), _mm256_loadu_ps(o + j + 8));
}

/* float16 scores of two query heads (q, the second dq after) against positions [t0, t0 + 32)
 * of a whole block (64 positions, all attended), into out[g * TILE_T + t0 ..]: each channel's
 * key line of those 32 positions, one whole 64-byte line, widened once for both heads, two
 * query broadcasts a line. scores16_asking reads a float16 line as two halves of 16 positions
 * in two passes, each half with four broadcasts for four heads: fewer loads a line let the core
 * run further ahead of its misses, as in the value sum (pv_block_avx2), and a float16 block read
 * 10% faster cold and 12% hot (docs/design.md, "float16 keys as two pairs"). Each score sums the
 * same products in the same order: the same bits. kn (or NULL): the next block's keys, line
 * ask0 + j asked with channel j's, below asks. */
AVX2 static inline __attribute__((always_inline)) void scores32_pair_f16(const float *q, int64_t dq, int64_t dk,
                                                                          const char *kb, int64_t kline, int64_t t0,
                                                                          const char *kn, int64_t ask0, int64_t asks,
                                                                          float *out) {
    __m256 acc[2][4];
    for (int g = 0; g < 2; g++)
        for (int i = 0; i < 4; i++) acc[g][i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < dk; j++) {
        const char *row = kb + (j * kline + t0) * 2;
        if (kn) ask_lines(kn, ask0 + j, 1, asks, 1);
        const __m256 a = _mm256_broadcast_ss(q + j), b = _mm256_broadcast_ss(q + dq + j);
        for (int i = 0; i < 4; i++) {
            const __m256 k = widen8(ENC_F16, row + 16 * i);
            acc[0][i] = _mm256_fmadd_ps(a, k, acc[0][i]);
            acc[1][i] = _mm256_fmadd_ps(b, k, acc[1][i]);
        }
    }
    for (int g = 0; g < 2; g++)
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + g * TILE_T + t0 + 8 * i, acc[g][i]);
}

/* Scores, online softmax and value sum of one tile of gt query heads (g0 the first). */
AVX2 static inline __attribute__((always_inline)) void tile_avx2(const int enc, const gqa_cache_t *cc, const float *qf,
                                                                  int64_t h, int64_t phys, int64_t g0, const int gt,
                                                                  const char *kb, int64_t kline, const char *vb,
                                                                  const float *ks, const float *vs, int64_t nt,
                                                                  state_t *st) {
    /* the first tile of a block that has a next one in the item's reach asks for it */
    const int64_t el = enc_size(enc);
    int64_t knline = 0;
    const char *kn = g0 == 0 && st->prefetch ? (const char *)cc->k + key_block(cc, h, phys + nt, &knline) * el : NULL;
    const int64_t d = cc->d, dq = cc->dk + cc->no;
    float *p = st->p;
    const float *q = qf + g0 * dq;
    const uint16_t *ko = enc == ENC_INT8 ? cc->ko + h * cc->no * cc->c + phys : NULL;
    /* positions from phys to the end of its block's lines: what a load may read */
    const int64_t b0 = phys - phys % TILE_T, room = (cc->c - b0 < TILE_T ? cc->c - b0 : TILE_T) - (phys - b0);
    /* the end of the block's key lines: a short line's load may read on into the next line
     * (lanes masked after) but not past the last */
    const char *kend = kb + ((cc->dk + kpack(enc) - 1) / kpack(enc) * kline - (phys - b0) * kpack(enc)) * el;
    const int lines = whole_short_block(enc, cc, phys, nt);
    if (lines) lines_enc(enc, q, cc->dk, dq, kb, nt, gt, p); /* a whole short ring: several channels' lines a register */
    /* a whole float16 block for four heads: two pairs at 32 positions (scores32_pair_f16); the
     * first pair asks for the next block */
    const int pairs32 = enc == ENC_F16 && gt == 4 && nt == TILE_T && phys % TILE_T == 0;
    if (pairs32) {
        const int64_t asks = kn ? (cc->dk * knline * el + 63) / 64 : 0;
        for (int64_t t0 = 0; t0 < TILE_T; t0 += 32) {
            scores32_pair_f16(q, dq, cc->dk, kb, kline, t0, kn, t0 / 32 * cc->dk, asks, p);
            scores32_pair_f16(q + 2 * dq, dq, cc->dk, kb, kline, t0, NULL, 0, 0, p + 2 * TILE_T);
        }
    }
    for (int64_t t0 = 0; t0 < nt && !lines && !pairs32; t0 += 16) {
        if (nt - t0 <= 8) { /* a pass of 8 positions or fewer (a short cache's block): one register */
            if (t0 + 8 <= room)
                scores16_avx2(enc, q, cc->dk, cc->no, kb, kline, ko, cc->c, ks, t0, nt, gt, 1, 1, kend, kn, knline, p);
            else scores16_avx2(enc, q, cc->dk, cc->no, kb, kline, ko, cc->c, ks, t0, nt, gt, 0, 1, kend, kn, knline, p);
        }
        else if (t0 + 16 <= room)
            scores16_avx2(enc, q, cc->dk, cc->no, kb, kline, ko, cc->c, ks, t0, nt, gt, 1, 2, kend, kn, knline, p);
        else scores16_avx2(enc, q, cc->dk, cc->no, kb, kline, ko, cc->c, ks, t0, nt, gt, 0, 2, kend, kn, knline, p);
    }
    softmax_avx2(p, nt, vs, d, gt, st->m + g0, st->l + g0, st->acc + g0 * d, NULL);
    /* a dense head's only block: its rows finished here (st->out) */
    void *out = enc != ENC_INT8 && st->out ? (char *)st->out + g0 * d * el : NULL;
    pv_block_avx2(enc, st->acc + g0 * d, d, vb, p, nt, gt, kn ? vb + nt * d * el : NULL, TILE_T * d * el, out,
                  st->l + g0);
}

AVX2 static inline __attribute__((always_inline)) void block_avx2_enc(const int enc, const gqa_cache_t *cc,
                                                                       const float *qf, int64_t h, int64_t phys,
                                                                       int64_t nt, state_t *st) {
    const int64_t d = cc->d, el = enc_size(enc);
    int64_t kline;
    const char *kb = (const char *)cc->k + key_block(cc, h, phys, &kline) * el;
    const char *vb = (const char *)cc->v + (h * cc->c + phys) * d * el;
    const float *ks = NULL, *vs = NULL;
    if (enc == ENC_INT8) {
        block_scales_avx2(cc, h, phys, nt, st);
        ks = st->ksb;
        vs = st->vsb;
    }
    for (int64_t g0 = 0; g0 < cc->g; g0 += TILE_G) {
        switch (cc->g - g0 >= TILE_G ? TILE_G : (int)(cc->g - g0)) {
            case 4: tile_avx2(enc, cc, qf, h, phys, g0, 4, kb, kline, vb, ks, vs, nt, st); break;
            case 3: tile_avx2(enc, cc, qf, h, phys, g0, 3, kb, kline, vb, ks, vs, nt, st); break;
            case 2: tile_avx2(enc, cc, qf, h, phys, g0, 2, kb, kline, vb, ks, vs, nt, st); break;
            default: tile_avx2(enc, cc, qf, h, phys, g0, 1, kb, kline, vb, ks, vs, nt, st); break;
        }
    }
}

AVX2 GQA_INTERNAL void block_avx2_f32(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    block_avx2_enc(ENC_F32, cc, qf, h, phys, nt, st);
}
AVX2 GQA_INTERNAL void block_avx2_bf16(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    block_avx2_enc(ENC_BF16, cc, qf, h, phys, nt, st);
}
AVX2 GQA_INTERNAL void block_avx2_f16(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    block_avx2_enc(ENC_F16, cc, qf, h, phys, nt, st);
}
AVX2 GQA_INTERNAL void block_avx2_int8(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    block_avx2_enc(ENC_INT8, cc, qf, h, phys, nt, st);
}
/* n float16/bfloat16 elements (enc) to float32 times scale: load_elem(enc, src, i) * scale. */
AVX2 GQA_INTERNAL void widen_row_avx2(const int enc, const uint16_t *src, float *dst, int64_t n, float scale) {
    const __m256 s = _mm256_set1_ps(scale);
    int64_t x = 0;
    for (; x + 8 <= n; x += 8) _mm256_storeu_ps(dst + x, _mm256_mul_ps(widen8(enc, src + x), s));
    for (; x < n; x++) dst[x] = load_elem(enc, src, x) * scale;
}

/* G rows of d elements of encoding enc (float32, float16 or bfloat16; src, one after another)
 * to float32 times scale, each row's elements taken in `order`: dst[g * d + j] =
 * load_elem(enc, src, g * d + order[j]) * scale, as gather_rows_avx512 moves them: run by run
 * (consecutive channels to consecutive places), 8 lanes at a time, a run's last few one by one.
 * An int8 cache's key order is its coded channels ascending with the outliers cut out, then the
 * outliers: a few long runs. */
AVX2 GQA_INTERNAL void gather_rows_avx2(const int enc, const void *src, const int64_t *order, int64_t G, int64_t d,
                                        float scale, float *dst) {
    const __m256 s = _mm256_set1_ps(scale);
    const int64_t el = enc_size(enc);
    for (int64_t j = 0; j < d;) {
        const int64_t from = order[j], len = order_run(order, j, d);
        for (int64_t g = 0; g < G; g++) {
            const char *a = (const char *)src + (g * d + from) * el;
            float *b = dst + g * d + j;
            int64_t x = 0;
            for (; x + 8 <= len; x += 8) _mm256_storeu_ps(b + x, _mm256_mul_ps(widen8(enc, a + x * el), s));
            for (; x < len; x++) b[x] = load_elem(enc, a, x) * scale;
        }
        j += len;
    }
}

/* Whether n float32 values at p are all within +-limit (NaN: not), 8 at a time. */
AVX2 GQA_INTERNAL int within_f32_avx2(const float *p, int64_t n, float limit) {
    const __m256 lim = _mm256_set1_ps(limit), magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 bad = _mm256_setzero_ps();
    int64_t x = 0;
    for (; x + 8 <= n; x += 8) /* not (|a| <= limit): NaN too */
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(p + x), magnitude), lim, _CMP_NLE_UQ));
    int ok = _mm256_movemask_ps(bad) == 0;
    for (; x < n; x++) ok &= fabsf(p[x]) <= limit;
    return ok;
}

/* n float32 elements to float16/bfloat16 (enc), bit for bit as store_elem. */
AVX2 GQA_INTERNAL void narrow_row_avx2(const int enc, const float *src, uint16_t *dst, int64_t n) {
    int64_t x = 0;
    for (; x + 8 <= n; x += 8) store_halves8(dst + x, narrow8_bits(enc, _mm256_loadu_ps(src + x)));
    for (; x < n; x++) store_elem(enc, dst, x, src[x]);
}

/* A one-split head's gn output rows from the block's state (acc: gn x d, sums l) straight into
 * `out` in the stream's dtype (enc; d a multiple of 8): each element (0 + acc) / l as
 * finish_head computes it (a row with l = 0: 0 x (1 / 0), NaN, as there), then stored as
 * store_row stores it, in one pass. A bfloat16 row's whole 16-channel slices, summed as their
 * even channels then their odd ones (pv_avx2), come back in channel order for free: the even
 * channel's bits are the low half of each pair's word and the odd one's the high half. */
AVX2 GQA_INTERNAL void finish_rows_avx2(const int enc, const float *acc, const float *l, int64_t gn, int64_t d,
                                        void *out) {
    for (int64_t g = 0; g < gn; g++) {
        const float *o = acc + g * d;
        const int empty = l[g] == 0.0f;
        const __m256 vinv = _mm256_set1_ps(1.0f / l[g]);
#define FINISHED(at) finished8(_mm256_loadu_ps(o + (at)), vinv, empty)
        int64_t j = 0;
        if (enc == ENC_F32) {
            float *dst = (float *)out + g * d;
            for (; j < d; j += 8) _mm256_storeu_ps(dst + j, FINISHED(j));
            continue;
        }
        uint16_t *dst = (uint16_t *)out + g * d;
        if (enc == ENC_BF16)
            for (; j + 16 <= d; j += 16) store_pairs16(dst + j, FINISHED(j), FINISHED(j + 8));
        for (; j < d; j += 8) store_halves8(dst + j, narrow8_bits(enc, FINISHED(j)));
#undef FINISHED
    }
}
#endif /* GQA_X86_64 */
