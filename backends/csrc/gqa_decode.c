/*
 * GQA decode attention on the CPU, straight from a cache's storage: dense float32, bfloat16 or
 * float16 keys and values, or int8 codes plus scales. One library, one core.
 *
 * For every cache of a call, every KV head n (N = B * Hkv) and each of its G query heads g:
 *
 *     score[t] = q[n,g,:] . key[n,:,t]                    (q scaled by qscale first)
 *     out[n,g] = sum_t softmax(score)[t] * value[n,t,:]
 *
 * over the attended positions, which lie in the cache's ring as a few physical runs [a, b)
 * (a wrapped window, sinks plus window), read where they are, never copied.
 *
 * Encodings (gqa_cache_t.enc). Dense: keys in blocks (key_block / key_cell below, defined by
 * backends/key_layout.py: per KV head, TILE_T ring rows at a time, each block one contiguous
 * run of its channels' rows; heads kstride elements apart), values (N, C, D), both in the
 * stream dtype. int8: key codes in blocks likewise, of the dk coded channels, `no` outlier channels
 * ko (N, no, C) float16, value codes (N, C, D), scales (N, C) float32 or float16 by physical
 * position (row n at ks + n * scale_stride), so that
 *
 *     score[t] = (q[:dk] . kcode[:,t]) * kscale[t] + q[dk:] . kout[:,t]
 *     out      = sum_t (softmax[t] * vscale[t]) * vcode[t,:]
 *
 * (q in the cache's key channel order, see backends/int8.py).
 *
 * The core, shared by every encoding: each work item is one (cache, KV head, split), a split
 * being SPLIT_T consecutive attended positions (in logical order); it walks its positions a
 * block of up to TILE_T at a time on the physical TILE_T grid, scores the block for TILE_G query
 * heads at once (each key row is read once for the G heads that share it), keeps an online
 * softmax (running max, sum and float32 accumulator), and leaves a partial result; the item
 * that completes a head's splits merges them by log-sum-exp in split order. Because the split
 * size is fixed in tokens and the merge order is fixed, an output does not depend on the other
 * caches of the call, on the number of threads or on which thread ran which item: it is
 * bit-identical alone or batched. Items are taken from one counter by the threads, so the work
 * spreads by positions (bytes of KV) read, at most SPLIT_T positions per item.
 *
 * Per encoding only the block's loads differ (widen16 / load_elem): keys and values are read
 * once and widened to float32 in registers. Three implementations of the block, chosen at run
 * time per cache: AVX-512 (F, BW, VL, DQ; when the CPU has it and D is a multiple of 16),
 * AVX-512 with BF16 (ISA_AVX512_DOT: bfloat16 scores by vdpbf16ps on the query's own bfloat16;
 * the other encodings as AVX-512) and portable C (the specification the fast paths are tested
 * against). The file builds with no -march flag. The AVX-512 blocks prefetch the next block
 * into L2 as they go (its key block is one contiguous run, its value rows another).
 * docs/design.md ("The C kernel") has the measurements behind these choices.
 *
 * Threads: a pool created once (gqa_set_threads sizes it; started on first use, restarted after
 * fork), the calling thread working too. Parallel calls from several threads are serialized on
 * the pool; calls small enough to run on the calling thread alone run concurrently.
 *
 * The step (gqa_run with write_row >= 0): the new key and value are written into their ring
 * row, what they overwrite saved in `saved` (dense: by the work item that reads that row, per
 * KV head; int8: before the attention, keys put in the stored channel order and quantized, the
 * outlier channels as float16, values Hadamard-rotated (FLAG_ROTATE) and quantized as
 * quant.quantize_int8 does); a failure after the write restores it, so a failed step leaves the
 * cache byte-identical. The output is written in the stream dtype (int8: rotated back first).
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define GQA_HAVE_AVX512 1
#else
#define GQA_HAVE_AVX512 0
#endif

#define TILE_T 64   /* positions per block: 64 int8 codes of one channel are one cache line */
#define TILE_G 4    /* query heads scored together against one block */
#ifndef SPLIT_T
#define SPLIT_T 512 /* positions per work item: fixed, so results never depend on the split */
#endif
#define MAX_RUNS 4
#define MAX_THREADS 256
#define PARALLEL_MIN_WORK (1 << 13) /* (positions x KV heads) below which one thread does all */
#ifndef BPIECES
#define BPIECES 2 /* bfloat16 pieces of a query for BF16 dot products (split_query_bf16) */
#endif
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 1 /* blocks prefetched ahead (docs/design.md: 1 against 2, 4, ...) */
#endif

/* ISA_AVX512: F, BW, VL, DQ. ISA_AVX512_DOT: also BF16 (bfloat16 scores by vdpbf16ps; the
 * other encodings as ISA_AVX512). */
enum { ISA_AUTO = 0, ISA_PORTABLE = 1, ISA_AVX512 = 2, ISA_AVX512_DOT = 3 };
enum { ENC_F32 = 0, ENC_BF16 = 1, ENC_F16 = 2, ENC_INT8 = 3 };
enum { FLAG_HALF_SCALES = 1, FLAG_FAIL_AFTER_WRITE = 2, FLAG_ROTATE = 4, FLAG_RECIPROCAL = 8 };
#define FLAG_ISA_SHIFT 4 /* flags bits 4-5: this cache's ISA_* (ISA_AUTO: the call's) */
enum { POLICY_NONE = 0, POLICY_STRICT = 1, POLICY_GREEDY = 2, POLICY_SINK = 3 };
/* gqa_step's result columns, per row (a caller asks for the first rcols >= 6 of them) */
enum { R_T = 0, R_RESIDENT, R_FIRST, R_LAST, R_EVICTED, R_REACH, R_ATTENDED, R_WRITE_ROW, R_COLS };

/* One cache's part of a call (mirrored by backends/native.py's CacheDesc). */
typedef struct {
    int32_t enc;   /* storage: ENC_* */
    int32_t io;    /* q, new_k, new_v and out: ENC_F32, ENC_BF16 or ENC_F16 */
    int32_t flags; /* FLAG_* */
    int32_t nruns;
    int64_t n, g, d, c; /* KV heads (B * Hkv), query heads per KV head, head width, capacity */
    int64_t kstride;    /* keys: elements from one KV head's key blocks to the next (>= c * dk) */
    int64_t dk, no;     /* key channels stored in `enc`, and as float16 outliers (int8 only) */
    int64_t scale_stride;
    int64_t runs[2 * MAX_RUNS]; /* physical [a, b) pairs in logical order */
    int64_t write_row;          /* the ring row the new token goes to; -1: attention only */
    float qscale;               /* q is multiplied by it (1/sqrt(D), or 1 when pre-scaled) */
    int32_t status;             /* out: 0, or -errno for this cache (its rows restored) */
    void *k, *v;                /* keys in blocks (key_block), values (N, C, D) */
    const void *ks, *vs;        /* int8: scales */
    const uint16_t *ko;         /* int8: outlier channels (N, no, C) float16 bits */
    const void *q;              /* (N, G, D) in io; int8: channels in the stored key order, or
                                   in model order with `order` given */
    const int64_t *order;       /* int8: (N, D) the stored key order (coded, then outliers); or NULL */
    const void *new_k, *new_v;  /* (N, D) in io (= enc): the step's token */
    void *saved;                /* the overwritten row: dense 2 * N * D elements of enc; int8
                                   N * (dk + 2 no + D + 2 * scale bytes) bytes */
    void *out;                  /* (N, G, D) in io */
    /* The cache's state for gqa_step, which plans each step from it (the C twin of
     * backends/policy.py): the policy (POLICY_*, its window and sinks; its capacity is c), the
     * tokens seen, and below which T the caller steps the cache itself (gqa_step refuses the
     * row with -EAGAIN: the int8 cache's calibration). Owned by the library once created:
     * Python reads t, and writes it only for a rollback, prefill or restore. */
    int32_t policy;
    int32_t reserved;
    int64_t window, sinks;
    int64_t t;
    int64_t python_below;
} gqa_cache_t;

/* Per-thread state of one work item: running max m, running sum l, accumulator acc[G * D]. */
typedef struct {
    float *m, *l, *acc;
    float *p;         /* weights of one block: p[TILE_G * TILE_T] */
    float *ksb, *vsb; /* one block's float16 scales as float32 */
    int prefetch;     /* the item reads the next block of this run: prefetch it */
    float *q;         /* the head's query (G, D), float32, scaled, in key order */
    /* bfloat16 with dot products (ISA_AVX512_DOT): the query as bfloat16 pieces, made on the
     * item's first block by split_query_bf16 (qpieces per query head, scores times qmul) */
    uint16_t *qb;
    float qmul;
    int qpieces, qready;
} state_t;

static inline int64_t enc_size(int enc) { return enc == ENC_F32 ? 4 : enc == ENC_INT8 ? 1 : 2; }

/* ---------------------------------------------------------------------------------------------
 * The key layout, as backends/key_layout.py's KeyBlocks defines it (the one definition): per KV
 * head, the C ring rows in blocks of TILE_T (the last one C mod TILE_T rows when shorter), one
 * block after the other; a block of w rows holds its dk channels as dk / P lines of w words of
 * P channels (kpack: 4 for int8, else 1; dk padded to a multiple of P). A
 * block of positions is then one contiguous run (D x 64 elements), read front to back, where
 * the transposed layout before it was D streams of a few lines each at a stride of C.
 */

/* Channels per word of a key line (key_layout.PACK): bfloat16 keeps 2 channels of a row in a
 * 32-bit word, the operand of vdpbf16ps (and two channels widened by one shift or mask); the
 * rest 1. The key channels are padded with zero channels to a multiple of it. */
#ifndef BF16_PACK
#define BF16_PACK 2
#endif
static inline int64_t kpack(int enc) { return enc == ENC_BF16 ? BF16_PACK : 1; }
static inline int64_t key_width(const gqa_cache_t *cc) { return (cc->dk + kpack(cc->enc) - 1) / kpack(cc->enc) * kpack(cc->enc); }

/* Element offset of KV head h's key block holding ring row `phys`, at that row's first word;
 * *line: the elements from one line (P channels, w rows) to the next in that block. */
static inline int64_t key_block(const gqa_cache_t *cc, int64_t h, int64_t phys, int64_t *line) {
    const int64_t p = kpack(cc->enc), b0 = phys - phys % TILE_T, w = cc->c - b0 < TILE_T ? cc->c - b0 : TILE_T;
    *line = w * p;
    return h * cc->kstride + b0 * key_width(cc) + (phys - b0) * p;
}

/* Element offset of KV head h's key channel j (stored order) at ring row `row`. */
static inline int64_t key_cell(const gqa_cache_t *cc, int64_t h, int64_t j, int64_t row) {
    int64_t line;
    const int64_t at = key_block(cc, h, row, &line), p = kpack(cc->enc);
    return at + (j / p) * line + j % p;
}

/* ---------------------------------------------------------------------------------------------
 * Scalar conversions (IEEE binary16 and bfloat16, round to nearest even).
 */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
    if (exp == 0x1Fu) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (!mant) {
        bits = sign;
    } else { /* subnormal: normalize */
        exp = 113u;
        while (!(mant & 0x400u)) {
            mant <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return sign | 0x7E00u; /* NaN */
    if (ax >= 0x477FF000u) return sign | 0x7C00u; /* rounds to infinity */
    if (ax < 0x38800000u) {                       /* a binary16 subnormal (or zero) */
        float a;
        memcpy(&a, &ax, sizeof a);
        return sign | (uint16_t)lrintf(a * 16777216.0f); /* units of 2^-24, exact scaling */
    }
    return sign | (uint16_t)((ax - 0x38000000u + 0xFFFu + ((ax >> 13) & 1u)) >> 13);
}

static inline float bf16_to_float(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

/* Element i of an array in encoding enc, as float (a constant enc folds the switch away). */
static inline float load_elem(const int enc, const void *p, int64_t i) {
    switch (enc) {
        case ENC_F32: return ((const float *)p)[i];
        case ENC_BF16: return bf16_to_float(((const uint16_t *)p)[i]);
        case ENC_F16: return half_to_float(((const uint16_t *)p)[i]);
        default: return (float)((const int8_t *)p)[i];
    }
}

static inline void store_elem(int enc, void *p, int64_t i, float x) {
    switch (enc) {
        case ENC_F32: ((float *)p)[i] = x; break;
        case ENC_BF16: ((uint16_t *)p)[i] = float_to_bf16(x); break;
        default: ((uint16_t *)p)[i] = float_to_half(x); break;
    }
}

/* ---------------------------------------------------------------------------------------------
 * The shared online-softmax update, portable: sc[t] holds a block's scores and becomes the
 * weights exp(score - m) (times vs[t] when vs is given: int8's value scales).
 */
static void softmax_portable(float *sc, int64_t nt, const float *vs, int64_t d, float *m, float *l, float *acc) {
    float bmax = -INFINITY;
    for (int64_t t = 0; t < nt; t++)
        if (sc[t] > bmax) bmax = sc[t];
    if (bmax > *m) {
        const float alpha = expf(*m - bmax); /* 0 on the first block (m = -inf) */
        *l *= alpha;
        for (int64_t j = 0; j < d; j++) acc[j] *= alpha;
        *m = bmax;
    }
    float sum = 0.0f;
    for (int64_t t = 0; t < nt; t++) {
        const float e = expf(sc[t] - *m);
        sum += e;
        sc[t] = vs ? e * vs[t] : e;
    }
    *l += sum;
}

/* int8: the block's scales as float32, in place for float32 scales, else converted. */
static void block_scales(const gqa_cache_t *cc, int64_t h, int64_t phys, int64_t nt, state_t *st, const float **ks,
                         const float **vs) {
    const int64_t at = h * cc->scale_stride + phys;
    if (!(cc->flags & FLAG_HALF_SCALES)) {
        *ks = (const float *)cc->ks + at;
        *vs = (const float *)cc->vs + at;
        return;
    }
    const uint16_t *kh = (const uint16_t *)cc->ks + at, *vh = (const uint16_t *)cc->vs + at;
    for (int64_t t = 0; t < nt; t++) {
        st->ksb[t] = half_to_float(kh[t]);
        st->vsb[t] = half_to_float(vh[t]);
    }
    *ks = st->ksb;
    *vs = st->vsb;
}

/* Portable block of any encoding: plain loops (the compiler vectorizes what it can at the
 * baseline ISA). qf is head h's (G, dk + no) float32 query, already scaled. */
static inline __attribute__((always_inline)) void block_portable_enc(
    const int enc, const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    const int64_t d = cc->d, c = cc->c, G = cc->g, dk = cc->dk, no = cc->no, dq = dk + no, el = enc_size(enc);
    int64_t line;
    const char *kb = (const char *)cc->k + key_block(cc, h, phys, &line) * el;
    const char *vb = (const char *)cc->v + (h * c + phys) * d * el;
    const float *ks = NULL, *vs = NULL;
    if (enc == ENC_INT8) block_scales(cc, h, phys, nt, st, &ks, &vs);
    float sc[TILE_T];
    for (int64_t g = 0; g < G; g++) {
        const float *q = qf + g * dq;
        for (int64_t t = 0; t < nt; t++) sc[t] = 0.0f;
        for (int64_t j = 0; j < dk; j++) {
            const float qj = q[j];
            const int64_t p = kpack(enc);
            const char *row = kb + ((j / p) * line + j % p) * el;
            for (int64_t t = 0; t < nt; t++) sc[t] += qj * load_elem(enc, row, t * p);
        }
        if (enc == ENC_INT8) {
            for (int64_t t = 0; t < nt; t++) sc[t] *= ks[t];
            const uint16_t *kob = cc->ko + h * no * c + phys;
            for (int64_t o = 0; o < no; o++) {
                const float qo = q[dk + o];
                for (int64_t t = 0; t < nt; t++) sc[t] += qo * half_to_float(kob[o * c + t]);
            }
        }
        float *acc = st->acc + g * d;
        softmax_portable(sc, nt, vs, d, st->m + g, st->l + g, acc);
        for (int64_t t = 0; t < nt; t++) {
            const float w = sc[t];
            const char *row = vb + t * d * el;
            for (int64_t j = 0; j < d; j++) acc[j] += w * load_elem(enc, row, j);
        }
    }
}

static void block_portable(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    switch (cc->enc) {
        case ENC_F32: block_portable_enc(ENC_F32, cc, qf, h, phys, nt, st); break;
        case ENC_BF16: block_portable_enc(ENC_BF16, cc, qf, h, phys, nt, st); break;
        case ENC_F16: block_portable_enc(ENC_F16, cc, qf, h, phys, nt, st); break;
        default: block_portable_enc(ENC_INT8, cc, qf, h, phys, nt, st); break;
    }
}

#if GQA_HAVE_AVX512
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

/* exp(x) for x <= 0 (x = -inf gives 0): 2^n * e^r with |r| <= ln2 / 2, a degree-7 Taylor
 * polynomial for e^r (relative error below 1e-8, under float32's rounding). */
AVX512 static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f)); /* below: 0 after scalef */
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

/* acc[g][j0 : j0 + 16 nv] += sum_t p[g][t] * value[t][j0 : ...] for a block: nv registers of
 * 16 channels per query head, all constants after inlining so the accumulators stay in
 * registers. The first pass over a block also prefetches the rows of a later block. */
AVX512 static inline __attribute__((always_inline)) void pv_avx512(
    const int enc, float *acc_mem, int64_t d, int64_t j0, const char *vb, const float *p, int64_t nt, const int gt,
    const int nv, const int prefetch) {
    const int64_t el = enc_size(enc);
    __m512 acc[TILE_G][4];
    for (int g = 0; g < gt; g++)
        for (int i = 0; i < nv; i++) acc[g][i] = _mm512_loadu_ps(acc_mem + g * d + j0 + 16 * i);
    for (int64_t t = 0; t < nt; t++) {
        const char *row = vb + (t * d + j0) * el;
        if (j0 == 0 && prefetch) {
            for (int64_t x = 0; x < d * el; x += 64) _mm_prefetch(row + PREFETCH_BLOCKS * TILE_T * d * el + x, _MM_HINT_T1);
        }
        __m512 vf[4];
        for (int i = 0; i < nv; i++) vf[i] = widen16(enc, row + 16 * i * el, 0xFFFF);
        for (int g = 0; g < gt; g++) {
            const __m512 w = _mm512_set1_ps(p[g * TILE_T + t]);
            for (int i = 0; i < nv; i++) acc[g][i] = _mm512_fmadd_ps(w, vf[i], acc[g][i]);
        }
    }
    for (int g = 0; g < gt; g++)
        for (int i = 0; i < nv; i++) _mm512_storeu_ps(acc_mem + g * d + j0 + 16 * i, acc[g][i]);
}

/* The shared online-softmax update of one block for `gt` query heads: p[g][t] holds the scores
 * (-inf past nt) and becomes exp(score - m) (times vs[t] when given); the running max m, sum l
 * and accumulators acc (gt x d) are rescaled when the max grows. */
AVX512 static inline __attribute__((always_inline)) void softmax_avx512(
    float *p, int64_t nt, const float *vs, int64_t d, const int gt, float *ms, float *ls, float *accs) {
    __mmask16 mask[4];
    for (int i = 0; i < 4; i++) mask[i] = lanes16(nt, i);
    for (int g = 0; g < gt; g++) {
        float *pg = p + g * TILE_T;
        __m512 mx = _mm512_max_ps(_mm512_max_ps(_mm512_loadu_ps(pg), _mm512_loadu_ps(pg + 16)),
                                  _mm512_max_ps(_mm512_loadu_ps(pg + 32), _mm512_loadu_ps(pg + 48)));
        const float bmax = _mm512_reduce_max_ps(mx);
        float *m = ms + g, *l = ls + g, *acc = accs + g * d;
        if (bmax > *m) {
            const float alpha = expf(*m - bmax);
            *l *= alpha;
            const __m512 a = _mm512_set1_ps(alpha);
            for (int64_t j = 0; j < d; j += 16) _mm512_storeu_ps(acc + j, _mm512_mul_ps(a, _mm512_loadu_ps(acc + j)));
            *m = bmax;
        }
        const __m512 mm = _mm512_set1_ps(*m);
        __m512 sum = _mm512_setzero_ps();
        for (int i = 0; i < 4; i++) {
            const __m512 e = _mm512_maskz_mov_ps(mask[i], exp512(_mm512_sub_ps(_mm512_loadu_ps(pg + 16 * i), mm)));
            sum = _mm512_add_ps(sum, e);
            _mm512_storeu_ps(pg + 16 * i, vs ? _mm512_mul_ps(e, _mm512_maskz_loadu_ps(mask[i], vs + 16 * i)) : e);
        }
        *l += _mm512_reduce_add_ps(sum);
    }
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
    softmax_avx512(p, nt, vs, d, gt, st->m + g0, st->l + g0, st->acc + g0 * d);
    int64_t j0 = 0;
    for (; j0 + 64 <= d; j0 += 64) pv_avx512(enc, st->acc + g0 * d, d, j0, vb, p, nt, gt, 4, pf);
    for (; j0 < d; j0 += 16) pv_avx512(enc, st->acc + g0 * d, d, j0, vb, p, nt, gt, 1, pf);
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

/* bfloat16 with BF16 dot products: the query of one head as bfloat16 pieces per channel,
 * pairs of channels a word, padded with zeros to key_width channels, in st->qb. A bfloat16
 * query (a dense cache's) is its own one exact piece, the scores then times qscale (st->qmul);
 * any other query is qf (scaled) in BPIECES pieces, each what the ones before left (2 hold 16
 * of float32's 24 bits). Portable and deterministic: the same pieces whichever thread. */
static void split_query_bf16(const gqa_cache_t *cc, int64_t h, const float *qf, state_t *st) {
    const int64_t G = cc->g, dk = cc->dk, dq = dk + cc->no, kp = key_width(cc);
    const int exact = cc->io == ENC_BF16 && !cc->order;
    uint16_t *out = st->qb;
    st->qpieces = exact ? 1 : BPIECES;
    st->qmul = exact ? cc->qscale : 1.0f;
    memset(out, 0, (size_t)(G * BPIECES * kp) * sizeof *out);
    for (int64_t g = 0; g < G; g++)
        for (int64_t j = 0; j < dk; j++) {
            if (exact) {
                out[g * BPIECES * kp + j] = ((const uint16_t *)cc->q)[(h * G + g) * cc->d + j];
                continue;
            }
            float r = qf[g * dq + j];
            for (int p = 0; p < BPIECES; p++) {
                const uint16_t b = float_to_bf16(r);
                out[(g * BPIECES + p) * kp + j] = b;
                r -= bf16_to_float(b);
            }
        }
    st->qready = 1;
}

#define AVX512DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

/* bfloat16 scores with vdpbf16ps: a word of 2 key channels of a position against the same 2
 * channels of a query piece, every piece into the same float32 accumulators. */
AVX512DOT static inline __attribute__((always_inline)) void scores_dpbf16(
    const uint16_t *qb, int pieces, float mul, int64_t kp, const char *kb, int64_t kline, const char *kn,
    int64_t knline, int64_t nt, const int gt, const int ng, const int prefetch, float *out) {
    __m512 acc[TILE_G][4];
    __mmask16 mask[4];
    for (int i = 0; i < 4; i++) {
        mask[i] = lanes16(nt, i);
        for (int g = 0; g < gt; g++) acc[g][i] = _mm512_setzero_ps();
    }
    for (int64_t l = 0; 2 * l < kp; l++) {
        const char *row = kb + l * kline * 2;
        if (prefetch) {
            const char *next = kn + l * knline * 2;
            for (int64_t x = 0; x < knline * 2; x += 64) _mm_prefetch(next + x, _MM_HINT_T1);
        }
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
    const int enc, const gqa_cache_t *cc, int64_t g0, const int gt, const char *kb, int64_t kline, const char *kn,
    int64_t knline, const char *vb, const float *vs, int64_t nt, state_t *st) {
    const int64_t d = cc->d, kp = key_width(cc);
    float *p = st->p;
    const uint16_t *qb = st->qb + g0 * BPIECES * kp;
    const int pf = g0 == 0 && st->prefetch;
    if (nt <= 16) scores_dpbf16(qb, st->qpieces, st->qmul, kp, kb, kline, kn, knline, nt, gt, 1, pf, p);
    else scores_dpbf16(qb, st->qpieces, st->qmul, kp, kb, kline, kn, knline, nt, gt, 4, pf, p);
    softmax_avx512(p, nt, vs, d, gt, st->m + g0, st->l + g0, st->acc + g0 * d);
    int64_t j0 = 0;
    for (; j0 + 64 <= d; j0 += 64) pv_avx512(enc, st->acc + g0 * d, d, j0, vb, p, nt, gt, 4, pf);
    for (; j0 < d; j0 += 16) pv_avx512(enc, st->acc + g0 * d, d, j0, vb, p, nt, gt, 1, pf);
}

AVX512DOT static inline __attribute__((always_inline)) void block_dot_enc(
    const int enc, const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    if (!st->qready) split_query_bf16(cc, h, qf, st);
    int64_t kline, knline = 0;
    const char *kb, *kn, *vb;
    const float *ks, *vs;
    block_setup_avx512(enc, cc, h, phys, nt, st, &kb, &kline, &kn, &knline, &vb, &ks, &vs);
    for (int64_t g0 = 0; g0 < cc->g; g0 += TILE_G) {
        switch (cc->g - g0 >= TILE_G ? TILE_G : (int)(cc->g - g0)) {
            case 4: tile_dot(enc, cc, g0, 4, kb, kline, kn, knline, vb, vs, nt, st); break;
            case 3: tile_dot(enc, cc, g0, 3, kb, kline, kn, knline, vb, vs, nt, st); break;
            case 2: tile_dot(enc, cc, g0, 2, kb, kline, kn, knline, vb, vs, nt, st); break;
            default: tile_dot(enc, cc, g0, 1, kb, kline, kn, knline, vb, vs, nt, st); break;
        }
    }
}
AVX512DOT static void block_dot_bf16(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt,
                                     state_t *st) {
    block_dot_enc(ENC_BF16, cc, qf, h, phys, nt, st);
}

AVX512 static void block_avx512_f32(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    block_avx512_enc(ENC_F32, cc, qf, h, phys, nt, st);
}
AVX512 static void block_avx512_bf16(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    block_avx512_enc(ENC_BF16, cc, qf, h, phys, nt, st);
}
AVX512 static void block_avx512_f16(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    block_avx512_enc(ENC_F16, cc, qf, h, phys, nt, st);
}
AVX512 static void block_avx512_int8(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    block_avx512_enc(ENC_INT8, cc, qf, h, phys, nt, st);
}
#endif /* GQA_HAVE_AVX512 */

#if GQA_HAVE_AVX512
/* n float16/bfloat16 elements (enc) to float32 times scale: load_elem(enc, src, i) * scale,
 * 16 lanes at a time. */
AVX512 static void widen_row_avx512(const int enc, const uint16_t *src, float *dst, int64_t n, float scale) {
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t x = 0; x < n; x += 16) {
        const __mmask16 m = lanes16(n - x, 0);
        _mm512_mask_storeu_ps(dst + x, m, _mm512_mul_ps(widen16(enc, src + x, m), s));
    }
}

/* n float32 elements to float16/bfloat16 (enc), bit for bit as store_elem: round to nearest
 * even; a NaN becomes float_to_half's or float_to_bf16's quiet NaN of the same sign. */
AVX512 static void narrow_row_avx512(const int enc, const float *src, uint16_t *dst, int64_t n) {
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
#endif

typedef void (*block_fn)(const gqa_cache_t *, const float *, int64_t, int64_t, int64_t, state_t *);

static block_fn choose_block(int enc, int isa) {
#if GQA_HAVE_AVX512
    if (isa == ISA_AVX512_DOT && enc == ENC_BF16 && BF16_PACK == 2) return block_dot_bf16;
    if (isa == ISA_AVX512 || isa == ISA_AVX512_DOT) {
        switch (enc) {
            case ENC_F32: return block_avx512_f32;
            case ENC_BF16: return block_avx512_bf16;
            case ENC_F16: return block_avx512_f16;
            default: return block_avx512_int8;
        }
    }
#endif
    (void)enc;
    (void)isa;
    return block_portable;
}

/* ---------------------------------------------------------------------------------------------
 * The thread pool: created once, sized by gqa_set_threads, the caller working as thread 0.
 */
typedef void (*task_fn)(void *ctx, int64_t item, int tid);

static struct {
    pthread_mutex_t call_lock; /* one parallel call at a time */
    pthread_mutex_t m;
    pthread_cond_t wake, done;
    pthread_t tids[MAX_THREADS];
    int size;    /* threads in all, the caller included; 0 until set */
    int started; /* workers running (size - 1 once started) */
    int stop;
    uint64_t gen, start_gen;
    task_fn fn;
    void *ctx;
    int64_t nitems;
    atomic_long next;
    int want, finished;
} pool = {.call_lock = PTHREAD_MUTEX_INITIALIZER, .m = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER};

static void run_items(task_fn fn, void *ctx, int64_t nitems, int tid) {
    for (;;) {
        const int64_t item = atomic_fetch_add(&pool.next, 1);
        if (item >= nitems) break;
        fn(ctx, item, tid);
    }
}

static void *pool_worker(void *arg) {
    const int idx = (int)(intptr_t)arg; /* 1 .. started */
    pthread_mutex_lock(&pool.m);
    uint64_t seen = pool.start_gen; /* the generation before its first task, however late it runs */
    for (;;) {
        while (pool.gen == seen && !pool.stop) pthread_cond_wait(&pool.wake, &pool.m);
        if (pool.stop) break;
        seen = pool.gen;
        const int part = idx <= pool.want;
        task_fn fn = pool.fn;
        void *ctx = pool.ctx;
        const int64_t nitems = pool.nitems;
        pthread_mutex_unlock(&pool.m);
        if (part) run_items(fn, ctx, nitems, idx);
        pthread_mutex_lock(&pool.m);
        if (part && ++pool.finished == pool.want) pthread_cond_signal(&pool.done);
    }
    pthread_mutex_unlock(&pool.m);
    return NULL;
}

static void pool_stop_locked(void) { /* call_lock held */
    pthread_mutex_lock(&pool.m);
    pool.stop = 1;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.m);
    for (int i = 0; i < pool.started; i++) pthread_join(pool.tids[i], NULL);
    pool.started = 0;
    pool.stop = 0;
}

static void pool_start_locked(void) { /* call_lock held, no workers running */
    const int want = (pool.size > 0 ? pool.size : 1) - 1;
    pool.start_gen = pool.gen;
    for (int i = 0; i < want && i < MAX_THREADS - 1; i++) {
        if (pthread_create(&pool.tids[i], NULL, pool_worker, (void *)(intptr_t)(i + 1))) break; /* fewer: still correct */
        pool.started = i + 1;
    }
}

static void pool_after_fork_child(void) { /* the workers did not survive the fork */
    pthread_mutex_init(&pool.call_lock, NULL);
    pthread_mutex_init(&pool.m, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.started = 0;
    pool.stop = 0;
}

__attribute__((constructor)) static void pool_init(void) { pthread_atfork(NULL, NULL, pool_after_fork_child); }

/* Runs fn(ctx, item, tid) for item in [0, nitems) on up to `threads` threads (tid < threads). */
static void pool_run(task_fn fn, void *ctx, int64_t nitems, int threads) {
    if (threads <= 1 || nitems <= 1) {
        for (int64_t i = 0; i < nitems; i++) fn(ctx, i, 0);
        return;
    }
    pthread_mutex_lock(&pool.call_lock);
    if (pool.started + 1 < pool.size) {
        if (pool.started) pool_stop_locked();
        pool_start_locked();
    }
    int want = threads - 1;
    if (want > pool.started) want = pool.started;
    if (want > nitems - 1) want = (int)(nitems - 1);
    pthread_mutex_lock(&pool.m);
    pool.fn = fn;
    pool.ctx = ctx;
    pool.nitems = nitems;
    atomic_store(&pool.next, 0);
    pool.want = want;
    pool.finished = 0;
    pool.gen++;
    if (want) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.m);
    run_items(fn, ctx, nitems, 0);
    pthread_mutex_lock(&pool.m);
    while (pool.finished < want) pthread_cond_wait(&pool.done, &pool.m);
    pthread_mutex_unlock(&pool.m);
    pthread_mutex_unlock(&pool.call_lock);
}

int gqa_set_threads(int n) {
    if (n < 1 || n > MAX_THREADS) return -EINVAL;
    pthread_mutex_lock(&pool.call_lock);
    if (pool.started) pool_stop_locked();
    pool.size = n;
    pthread_mutex_unlock(&pool.call_lock);
    return 0;
}

int gqa_threads(void) { return pool.size > 0 ? pool.size : 1; }

/* ---------------------------------------------------------------------------------------------
 * A call: writes, work items (cache, head, split), merge.
 */
int gqa_hadamard_rows(float *x, int64_t rows, int64_t d, int64_t block);

typedef struct {
    gqa_cache_t *caches;
    int64_t ncaches;
    int64_t *item_off;  /* ncaches + 1: first work item of each cache */
    int64_t *head_off;  /* ncaches + 1: first (cache, head) of each cache, for the merge */
    int64_t *nsplit, *s, *part_off;
    int64_t *hpi;       /* per cache: KV heads per work item (one-split caches: as many as fit SPLIT_T) */
    block_fn *block;
    float *part; /* per cache (N * nsplit, G, D + 2): accumulator, then running max and sum */
    float *scratch;
    int64_t scratch_floats; /* per thread */
    atomic_int *done;       /* per (cache, head): splits finished */
    char *deferred;         /* per cache: its dense write is done by the item reading the row */
    char *wide;             /* per cache: its kernel is the AVX-512 one (vector 16-bit conversions) */
} call_t;

static int64_t find_cache(const int64_t *off, int64_t ncaches, int64_t item) {
    int64_t lo = 0, hi = ncaches - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (off[mid] <= item) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

static state_t thread_state(const call_t *call, const gqa_cache_t *cc, int tid) {
    float *mem = call->scratch + tid * call->scratch_floats;
    const int64_t G = cc->g, d = cc->d;
    float *p = mem + 2 * G + G * d;
    p = (float *)(((uintptr_t)p + 63) & ~(uintptr_t)63);
    float *q = p + (TILE_G + 2) * TILE_T; /* then split_query_bf16's room: G * BPIECES * key_width */
    return (state_t){.m = mem, .l = mem + G, .acc = mem + 2 * G, .p = p, .ksb = p + TILE_G * TILE_T,
                     .vsb = p + (TILE_G + 1) * TILE_T, .q = q, .qb = (uint16_t *)(q + G * d)};
}

/* Head h's query as float32 times qscale, in the stored key order (int8 with `order`). */
static void convert_query(const gqa_cache_t *cc, int64_t h, float *qf, int wide) {
    const int64_t G = cc->g, d = cc->d;
    if (!cc->order && cc->io == ENC_F32) {
        const float *q = (const float *)cc->q + h * G * d;
        for (int64_t x = 0; x < G * d; x++) qf[x] = q[x] * cc->qscale;
        return;
    }
#if GQA_HAVE_AVX512
    if (!cc->order && wide) {
        widen_row_avx512(cc->io, (const uint16_t *)cc->q + h * G * d, qf, G * d, cc->qscale);
        return;
    }
#else
    (void)wide;
#endif
    const int64_t *order = cc->order ? cc->order + h * d : NULL;
    if (order && cc->io == ENC_F32) { /* int8 with float32 tensors: a plain gather */
        const float *q = (const float *)cc->q + h * G * d;
        for (int64_t g = 0; g < G; g++)
            for (int64_t j = 0; j < d; j++) qf[g * d + j] = q[g * d + order[j]] * cc->qscale;
        return;
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t j = 0; j < d; j++)
            qf[g * d + j] = load_elem(cc->io, cc->q, (h * G + g) * d + (order ? order[j] : j)) * cc->qscale;
}

static void merge_head(const call_t *call, int64_t i, int64_t h, const float *base, int tid);
static void finish_head(const call_t *call, int64_t i, int64_t h, const state_t *st);

/* Asks for every line of an item's first block at once (its key lines and value rows): the
 * misses then overlap instead of following one another. */
static void prefetch_block(const gqa_cache_t *cc, int64_t h, int64_t phys, int64_t nt) {
    const int64_t el = enc_size(cc->enc), d = cc->d;
    int64_t line;
    const char *kb = (const char *)cc->k + key_block(cc, h, phys, &line) * el;
    for (int64_t j = 0; j < key_width(cc) / kpack(cc->enc); j++)
        for (int64_t x = 0; x < nt * kpack(cc->enc) * el; x += 64) __builtin_prefetch(kb + j * line * el + x, 0, 3);
    const char *vb = (const char *)cc->v + (h * cc->c + phys) * d * el;
    for (int64_t x = 0; x < nt * d * el; x += 64) __builtin_prefetch(vb + x, 0, 3);
}
static void write_head(const gqa_cache_t *cc, int64_t h, int restore);

/* Head h of cache i over its logical positions [l0, l1) of split `split`, block by block. The
 * item that completes a head's splits merges them (in split order, whoever runs it), while
 * its partials are still in cache. */
static void attend_head(const call_t *call, int64_t i, int64_t h, int64_t split, int tid) {
    const gqa_cache_t *cc = &call->caches[i];
    const int64_t nsplit = call->nsplit[i], local = h * nsplit + split, s = call->s[i];
    const int64_t l0 = split * SPLIT_T, l1 = l0 + SPLIT_T < s ? l0 + SPLIT_T : s;
    const int64_t G = cc->g, d = cc->d;
    state_t st = thread_state(call, cc, tid);
    for (int64_t g = 0; g < G; g++) {
        st.m[g] = -INFINITY;
        st.l[g] = 0.0f;
    }
    memset(st.acc, 0, (size_t)(G * d) * sizeof(float));
    const block_fn block = call->block[i];
    convert_query(cc, h, st.q, call->wide[i]);
    const float *qf = st.q;
    if (call->deferred[i]) { /* a dense step's write of this head, by the split that reads the row */
        int64_t at = 0;
        for (int64_t r = 0; r < cc->nruns; r++) {
            const int64_t a = cc->runs[2 * r], b = cc->runs[2 * r + 1];
            if (cc->write_row >= a && cc->write_row < b) {
                at += cc->write_row - a;
                break;
            }
            at += b - a;
        }
        if (at >= l0 && at < l1) write_head(cc, h, 0);
    }
    int64_t base = 0; /* logical position of the current run's start */
    for (int64_t r = 0; r < cc->nruns && base < l1; r++) {
        const int64_t a = cc->runs[2 * r], b = cc->runs[2 * r + 1];
        const int64_t lo = l0 > base ? l0 : base, hi = l1 < base + (b - a) ? l1 : base + (b - a);
        for (int64_t x = lo, nt; x < hi; x += nt) {
            /* blocks on the physical 64-position grid: with line-aligned rows, whole lines */
            const int64_t to_grid = TILE_T - (a + (x - base)) % TILE_T;
            nt = hi - x < to_grid ? hi - x : to_grid;
            if (x == lo) prefetch_block(cc, h, a + (x - base), nt); /* later blocks: by the block before */
            st.prefetch = x + nt < hi;
            block(cc, qf, h, a + (x - base), nt, &st);
        }
        base += b - a;
    }
    /* a head's partials: in the thread's state when it has one split, else in the call's */
    if (nsplit == 1) {
        finish_head(call, i, h, &st);
        return;
    }
    float *part = call->part + call->part_off[i] + local * G * (d + 2);
    for (int64_t g = 0; g < G; g++) {
        memcpy(part + g * (d + 2), st.acc + g * d, (size_t)d * sizeof(float));
        part[g * (d + 2) + d] = st.m[g];
        part[g * (d + 2) + d + 1] = st.l[g];
    }
    if (atomic_fetch_add(&call->done[call->head_off[i] + h], 1) + 1 == nsplit)
        merge_head(call, i, h, call->part + call->part_off[i] + h * nsplit * G * (d + 2), tid);
}

/* One work item: a (cache, head, split) of a cache with several splits; of a one-split cache,
 * `hpi` consecutive heads (a short cache's heads in one item: its set-up, the item's lookup,
 * paid once for all of them). Which heads share an item changes no output. */
static void attend_item(void *ctx, int64_t item, int tid) {
    const call_t *call = ctx;
    const int64_t i = find_cache(call->item_off, call->ncaches, item);
    const int64_t local = item - call->item_off[i], nsplit = call->nsplit[i];
    if (nsplit > 1) {
        attend_head(call, i, local / nsplit, local % nsplit, tid);
        return;
    }
    const int64_t n = call->caches[i].n, h0 = local * call->hpi[i];
    const int64_t h1 = h0 + call->hpi[i] < n ? h0 + call->hpi[i] : n;
    for (int64_t h = h0; h < h1; h++) attend_head(call, i, h, 0, tid);
}

/* Merge of one (cache, head): every split's partial rescaled to the common max, in split order. */
/* One output row (D floats, scratch: rotated in place for int8) to cache i's output at `at`. */
static void store_row(const call_t *call, int64_t i, int64_t at, float *o) {
    const gqa_cache_t *cc = &call->caches[i];
    const int64_t d = cc->d;
    if (cc->flags & FLAG_ROTATE) gqa_hadamard_rows(o, 1, d, d & -d); /* int8 values stored rotated */
    if (cc->io == ENC_F32) memcpy((float *)cc->out + at, o, (size_t)d * sizeof(float));
#if GQA_HAVE_AVX512
    else if (call->wide[i]) narrow_row_avx512(cc->io, o, (uint16_t *)cc->out + at, d);
#endif
    else if (cc->io == ENC_BF16) for (int64_t j = 0; j < d; j++) ((uint16_t *)cc->out)[at + j] = float_to_bf16(o[j]);
    else for (int64_t j = 0; j < d; j++) ((uint16_t *)cc->out)[at + j] = float_to_half(o[j]);
}

static void merge_head(const call_t *call, int64_t i, int64_t h, const float *base, int tid) {
    /* base: head h's partials (nsplit, G, D + 2) */
    const gqa_cache_t *cc = &call->caches[i];
    if (cc->status) return;
    const int64_t nsplit = call->nsplit[i], G = cc->g, d = cc->d;
    float *o = call->scratch + tid * call->scratch_floats; /* the state's m, l, acc: done with */
    for (int64_t gi = 0; gi < G; gi++) {
        float mmax = -INFINITY;
        for (int64_t sp = 0; sp < nsplit; sp++) {
            const float m = base[(sp * G + gi) * (d + 2) + d];
            if (m > mmax) mmax = m;
        }
        memset(o, 0, (size_t)d * sizeof(float));
        float total = 0.0f;
        for (int64_t sp = 0; sp < nsplit; sp++) {
            const float *pt = base + (sp * G + gi) * (d + 2);
            if (pt[d + 1] == 0.0f) continue;
            const float w = expf(pt[d] - mmax);
            total += w * pt[d + 1];
            for (int64_t j = 0; j < d; j++) o[j] += w * pt[j];
        }
        const float inv = 1.0f / total;
        for (int64_t j = 0; j < d; j++) o[j] *= inv;
        store_row(call, i, (h * G + gi) * d, o);
    }
}

/* A one-split head's output from its own state, in place: what merge_head computes for it (its
 * one partial has weight expf(0) = 1, so o = (0 + acc) / l, bit for bit; NaN rows for l = 0, as
 * there), without copying the partial out and back. */
static void finish_head(const call_t *call, int64_t i, int64_t h, const state_t *st) {
    const gqa_cache_t *cc = &call->caches[i];
    if (cc->status) return;
    const int64_t G = cc->g, d = cc->d;
    for (int64_t gi = 0; gi < G; gi++) {
        float *o = st->acc + gi * d;
        const float l = st->l[gi], inv = 1.0f / l;
        if (l == 0.0f)
            for (int64_t j = 0; j < d; j++) o[j] = 0.0f * inv;
        else
            for (int64_t j = 0; j < d; j++) o[j] = (0.0f + o[j]) * inv;
        store_row(call, i, (h * G + gi) * d, o);
    }
}

/* int8: quantizes rows (rows, len) float32 per row, absmax / 127, as quant.quantize_int8 does:
 * float16 scales: codes = round(x / stored scale) (a stored 0 divides by 1), clamped to 127;
 * float32 scales with FLAG_RECIPROCAL (bitsandbytes' rounding, which quant uses when it loads):
 * codes = round(x * (127 / absmax)) unless some row's absmax is tiny but not 0 (then all rows
 * the plain way, as quant does). Codes to codes[r * len + j], scales as float32 to scale[r];
 * -ERANGE when a float16 scale would overflow. */
static int quantize_rows(const float *x, int64_t rows, int64_t len, int flags, int8_t *codes, float *scale) {
    const int half = flags & FLAG_HALF_SCALES;
    int reciprocal = !half && (flags & FLAG_RECIPROCAL);
    const float tiny = (float)(127.0 / 3.4028234663852886e38);
    for (int64_t r = 0; r < rows; r++) {
        float amax = 0.0f;
        for (int64_t j = 0; j < len; j++) amax = fmaxf(amax, fabsf(x[r * len + j]));
        scale[r] = amax;
        if (amax < tiny && amax > 0.0f) reciprocal = 0;
    }
    for (int64_t r = 0; r < rows; r++) {
        const float amax = scale[r], s32 = amax / 127.0f;
        const float *xr = x + r * len;
        int8_t *cr = codes + r * len;
        if (reciprocal) {
            const float inv = amax == 0.0f ? 0.0f : (1.0f / amax) * 127.0f; /* torch's 127 / t: reciprocal, then product */
            for (int64_t j = 0; j < len; j++) cr[j] = amax == 0.0f ? 0 : (int8_t)rintf(xr[j] * inv);
            scale[r] = s32;
            continue;
        }
        float stored = s32;
        if (half) {
            if (s32 > 65504.0f) return -ERANGE;
            stored = half_to_float(float_to_half(s32));
        }
        scale[r] = stored;
        const float div = stored == 0.0f ? 1.0f : stored;
        for (int64_t j = 0; j < len; j++) {
            float c = rintf(xr[j] / div);
            c = c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c;
            cr[j] = (int8_t)c;
        }
    }
    return 0;
}

/* int8: the new token's bytes per KV head in `saved` (key codes, outlier channels, value codes,
 * two scales), so that a failure puts them back. */
static int64_t int8_saved_bytes(const gqa_cache_t *cc) {
    return cc->dk + 2 * cc->no + cc->d + 2 * ((cc->flags & FLAG_HALF_SCALES) ? 2 : 4);
}

static void int8_swap_row(const gqa_cache_t *cc, int restore) {
    const int64_t n = cc->n, d = cc->d, dk = cc->dk, no = cc->no, c = cc->c, row = cc->write_row;
    const int64_t sel = (cc->flags & FLAG_HALF_SCALES) ? 2 : 4, per = int8_saved_bytes(cc);
    for (int64_t h = 0; h < n; h++) {
        char *sv = (char *)cc->saved + h * per;
        char *cells[4];
        int64_t sizes[4];
        for (int64_t j = 0; j < dk; j++) {
            char *cell = (char *)cc->k + key_cell(cc, h, j, row);
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
}

/* int8: the step's write (the old bytes to saved first). buf: 2 N D floats and 2 N D + 2 N
 * bytes of room. Keys in the stored order, coded channels quantized, outlier ones as float16;
 * values rotated (FLAG_ROTATE) and quantized. -ERANGE (nothing written) if a scale overflows. */
static int int8_write(const gqa_cache_t *cc, float *buf) {
    const int64_t n = cc->n, d = cc->d, dk = cc->dk, no = cc->no, c = cc->c, row = cc->write_row;
    float *keys = buf, *vals = buf + n * d, *ksc = buf + 2 * n * d, *vsc = ksc + n;
    int8_t *kcodes = (int8_t *)(vsc + n), *vcodes = kcodes + n * d;
    float *coded = keys; /* (n, dk) packed, then the outliers (n, no) at keys + n * dk */
    for (int64_t h = 0; h < n; h++)
        for (int64_t j = 0; j < d; j++) {
            const float x = load_elem(cc->io, cc->new_k, h * d + cc->order[h * d + j]);
            if (j < dk) coded[h * dk + j] = x;
            else vals[h * no + (j - dk)] = x; /* outliers parked in vals for now */
        }
    float *outl = keys + n * dk;
    memmove(outl, vals, (size_t)(n * no) * sizeof(float));
    int rc = dk ? quantize_rows(coded, n, dk, cc->flags, kcodes, ksc) : 0;
    if (rc) return rc;
    for (int64_t x = 0; x < n * d; x++) vals[x] = load_elem(cc->io, cc->new_v, x);
    if (cc->flags & FLAG_ROTATE) gqa_hadamard_rows(vals, n, d, d & -d);
    rc = quantize_rows(vals, n, d, cc->flags, vcodes, vsc);
    if (rc) return rc;
    int8_swap_row(cc, 0);
    const int half = cc->flags & FLAG_HALF_SCALES;
    for (int64_t h = 0; h < n; h++) {
        for (int64_t j = 0; j < dk; j++) ((int8_t *)cc->k)[key_cell(cc, h, j, row)] = kcodes[h * dk + j];
        for (int64_t o = 0; o < no; o++) ((uint16_t *)cc->ko)[(h * no + o) * c + row] = float_to_half(outl[h * no + o]);
        memcpy((int8_t *)cc->v + (h * c + row) * d, vcodes + h * d, (size_t)d);
        const int64_t at = h * cc->scale_stride + row;
        if (half) {
            ((uint16_t *)cc->ks)[at] = float_to_half(ksc[h]);
            ((uint16_t *)cc->vs)[at] = float_to_half(vsc[h]);
        } else {
            ((float *)cc->ks)[at] = ksc[h];
            ((float *)cc->vs)[at] = vsc[h];
        }
    }
    return 0;
}

/* The step's write for KV head h: its key column and value row of ring row `write_row`, the
 * old bytes to saved (or back, restore). */
static void write_head(const gqa_cache_t *cc, int64_t h, int restore) {
    const int64_t el = enc_size(cc->enc), n = cc->n, d = cc->d, row = cc->write_row;
    char *k = cc->k, *v = cc->v, *saved = cc->saved;
    const char *nk = cc->new_k, *nv = cc->new_v;
    /* one key column: a strided gather and scatter within the row's block, its offsets walked
     * line by line (key_cell's arithmetic without a division per channel) */
    int64_t line;
    const int64_t first = key_block(cc, h, row, &line), p = kpack(cc->enc);
    if (el == 4) {
        float *kk = (float *)k + first, *sv = (float *)saved + h * d;
        const float *src = (const float *)nk + h * d;
        for (int64_t j = 0; j < d; j++) {
            float *cell = kk + (j / p) * line + j % p;
            if (restore) *cell = sv[j];
            else {
                sv[j] = *cell;
                *cell = src[j];
            }
        }
    } else {
        uint16_t *kk = (uint16_t *)k + first, *sv = (uint16_t *)saved + h * d;
        const uint16_t *src = (const uint16_t *)nk + h * d;
        for (int64_t j = 0; j < d; j++) {
            uint16_t *cell = kk + (j / p) * line + j % p;
            if (restore) *cell = sv[j];
            else {
                sv[j] = *cell;
                *cell = src[j];
            }
        }
    }
    char *cell = v + (h * cc->c + row) * d * el, *keep = saved + (n + h) * d * el;
    if (restore) {
        memcpy(cell, keep, (size_t)(d * el));
    } else {
        memcpy(keep, cell, (size_t)(d * el));
        memcpy(cell, nv + h * d * el, (size_t)(d * el));
    }
}

/* The step's write: key column and value row of ring row `write_row`, the old bytes to saved. */
static void write_row(const gqa_cache_t *cc, int restore) {
    for (int64_t h = 0; h < cc->n; h++) write_head(cc, h, restore);
}

int gqa_avx512_usable(void) {
#if GQA_HAVE_AVX512
    static atomic_int known = -1;
    int v = atomic_load(&known);
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
        atomic_store(&known, v);
    }
    return v;
#else
    return 0;
#endif
}

/* Whether the CPU has AVX-512 BF16 besides gqa_avx512_usable's. */
static int gqa_avx512_dot_usable(void) {
#if GQA_HAVE_AVX512
    static atomic_int known = -1;
    int v = atomic_load(&known);
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx512bf16");
        atomic_store(&known, v);
    }
    return v;
#else
    return 0;
#endif
}

/* The implementations that can run here for head width d (a bit per ISA_* value). */
int gqa_usable_isas(int64_t d) {
    int m = 1 << ISA_PORTABLE;
    if (gqa_avx512_usable() && d % 16 == 0) {
        m |= 1 << ISA_AVX512;
        if (gqa_avx512_dot_usable()) m |= 1 << ISA_AVX512_DOT;
    }
    return m;
}

static int check_cache(const gqa_cache_t *cc, int isa, int64_t *attended, int *chosen) {
    if (cc->enc < ENC_F32 || cc->enc > ENC_INT8 || cc->io < ENC_F32 || cc->io > ENC_F16) return -EINVAL;
    if (cc->n < 1 || cc->g < 1 || cc->d < 1 || cc->c < 1 || cc->dk < 0 || cc->kstride < cc->c * key_width(cc))
        return -EINVAL;
    if (cc->nruns < 1 || cc->nruns > MAX_RUNS || !cc->k || !cc->v || !cc->q || !cc->out) return -EINVAL;
    if (cc->enc == ENC_INT8) {
        if (cc->dk < 0 || cc->no < 0 || cc->dk + cc->no < 1 || (cc->no && !cc->ko) || !cc->ks || !cc->vs) return -EINVAL;
        if (cc->scale_stride < cc->c || cc->dk + cc->no != cc->d || cc->write_row >= cc->c) return -EINVAL;
        if (cc->write_row >= 0 && (!cc->new_k || !cc->new_v || !cc->saved || !cc->order)) return -EINVAL;
    } else {
        if (cc->dk != cc->d || cc->no != 0) return -EINVAL;
        if (cc->write_row >= cc->c || (cc->write_row >= 0 && (cc->io != cc->enc || !cc->new_k || !cc->new_v || !cc->saved)))
            return -EINVAL;
    }
    int64_t s = 0;
    for (int64_t r = 0; r < cc->nruns; r++) {
        if (cc->runs[2 * r] < 0 || cc->runs[2 * r + 1] > cc->c || cc->runs[2 * r] >= cc->runs[2 * r + 1]) return -EINVAL;
        s += cc->runs[2 * r + 1] - cc->runs[2 * r];
    }
    const int usable = gqa_usable_isas(cc->d), own = (cc->flags >> FLAG_ISA_SHIFT) & 3;
    if (own) isa = own;
    if (isa == ISA_AUTO)
        isa = usable & (1 << ISA_AVX512_DOT) ? ISA_AVX512_DOT : usable & (1 << ISA_AVX512) ? ISA_AVX512 : ISA_PORTABLE;
    if (isa < ISA_PORTABLE || isa > ISA_AVX512_DOT || !(usable & (1 << isa))) return -ENOTSUP;
    *attended = s;
    *chosen = isa;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Per-thread memory of a call: the calling thread's arenas, grown as needed and kept for its
 * next call (a call of 64 short caches would otherwise spend a visible part of its time in
 * malloc and in page faults of fresh scratch). Freed when the thread exits; an arena grown
 * past ARENA_KEEP bytes by one large call is released after it.
 */
#define ARENA_KEEP ((size_t)32 << 20)
enum { ARENA_CALL = 0, ARENA_DESCS = 1, ARENAS = 2 };
typedef struct {
    void *p[ARENAS];
    size_t n[ARENAS];
} arenas_t;
static pthread_key_t arena_key;
static pthread_once_t arena_once = PTHREAD_ONCE_INIT;
static __thread arenas_t *arenas;

static void arenas_free(void *x) {
    arenas_t *a = x;
    for (int i = 0; i < ARENAS; i++) free(a->p[i]);
    free(a);
}
static void arena_key_init(void) { (void)pthread_key_create(&arena_key, arenas_free); }

/* At least `bytes` bytes, 64-byte aligned, of the calling thread's arena `which`; NULL when out
 * of memory. The contents are not kept from one use to the next. */
static void *arena_get(int which, size_t bytes) {
    if (!arenas) {
        pthread_once(&arena_once, arena_key_init);
        arenas = calloc(1, sizeof *arenas);
        if (!arenas) return NULL;
        (void)pthread_setspecific(arena_key, arenas);
    }
    if (bytes <= arenas->n[which]) return arenas->p[which];
    size_t size = arenas->n[which] * 2;
    if (size < bytes) size = bytes;
    size = (size + 63) & ~(size_t)63;
    free(arenas->p[which]);
    arenas->p[which] = aligned_alloc(64, size);
    arenas->n[which] = arenas->p[which] ? size : 0;
    return arenas->p[which];
}

static void arena_trim(int which) {
    if (arenas && arenas->n[which] > ARENA_KEEP) {
        free(arenas->p[which]);
        arenas->p[which] = NULL;
        arenas->n[which] = 0;
    }
}

/* Carves n bytes, 64-byte aligned, off *at. */
static void *carve(char **at, size_t n) {
    void *p = *at;
    *at += (n + 63) & ~(size_t)63;
    return p;
}

/* Computes the steps (or attentions) of `ncaches` caches; see the header. threads: at most this
 * many (0: the pool's size). isa: ISA_* for every cache (ISA_AUTO: the fastest each can run).
 * Returns 0 (each cache's own `status` then says whether it was computed), or a negative
 * errno-style code for the whole call with nothing written (bad arguments, no memory). */
int gqa_run(gqa_cache_t *caches, int64_t ncaches, int threads, int isa) {
    if (ncaches < 1) return ncaches == 0 ? 0 : -EINVAL;
    if (threads <= 0) threads = gqa_threads();
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    const size_t nc = (size_t)ncaches;
    char *at = arena_get(ARENA_CALL, 6 * 64 + (6 * nc + 2) * sizeof(int64_t) + nc * (sizeof(block_fn) + 2));
    if (!at) return -ENOMEM;
    int64_t *ints = carve(&at, (6 * nc + 2) * sizeof(int64_t));
    call_t call = {.caches = caches, .ncaches = ncaches, .item_off = ints, .head_off = ints + nc + 1,
                   .nsplit = ints + 2 * nc + 2, .s = ints + 3 * nc + 2, .part_off = ints + 4 * nc + 2,
                   .hpi = ints + 5 * nc + 2};
    call.block = carve(&at, nc * sizeof(block_fn));
    call.wide = carve(&at, nc);
    call.deferred = carve(&at, nc);
    int64_t items = 0, heads = 0, parts = 0, scratch = 0, work = 0, wneed = 1;
    for (int64_t i = 0; i < ncaches; i++) {
        gqa_cache_t *cc = &caches[i];
        int chosen;
        const int rc = check_cache(cc, isa, &call.s[i], &chosen);
        if (rc) return rc;
        cc->status = 0;
        call.block[i] = choose_block(cc->enc, chosen);
        call.wide[i] = chosen >= ISA_AVX512;
        call.nsplit[i] = (call.s[i] + SPLIT_T - 1) / SPLIT_T;
        call.item_off[i] = items;
        call.head_off[i] = heads;
        call.part_off[i] = parts;
        if (call.nsplit[i] > 1) {
            call.hpi[i] = 1;
            items += cc->n * call.nsplit[i];
            parts += cc->n * call.nsplit[i] * cc->g * (cc->d + 2);
        } else { /* heads per item: as many as make up one split's positions */
            const int64_t per = SPLIT_T / (call.s[i] ? call.s[i] : 1);
            call.hpi[i] = per < 1 ? 1 : per > cc->n ? cc->n : per;
            items += (cc->n + call.hpi[i] - 1) / call.hpi[i];
        }
        heads += cc->n;
        const int64_t need = 2 * cc->g + 3 * cc->g * cc->d + 2 * cc->g + (TILE_G + 2) * TILE_T + 16 +
                             cc->g * key_width(cc) * BPIECES / 2 + 1; /* split_query_bf16's */
        if (need > scratch) scratch = need;
        work += cc->n * call.s[i];
        if (cc->enc == ENC_INT8 && cc->write_row >= 0) {
            const int64_t w = 2 * cc->n * cc->d + 2 * cc->n + (2 * cc->n * cc->d + 3) / 4 + 1;
            if (w > wneed) wneed = w;
        }
    }
    call.item_off[ncaches] = items;
    call.head_off[ncaches] = heads;
    if (work < PARALLEL_MIN_WORK) threads = 1;
    if (threads > items) threads = (int)items;
    call.scratch_floats = (scratch + 15) / 16 * 16;
    const size_t used = (size_t)(at - (char *)arenas->p[ARENA_CALL]);
    const size_t more = 4 * 64 + (size_t)parts * sizeof(float) + (size_t)(threads * call.scratch_floats) * sizeof(float) +
                        (size_t)wneed * sizeof(float) + (size_t)heads * sizeof(atomic_int);
    if (used + more > arenas->n[ARENA_CALL]) { /* grow, keeping what is carved so far */
        char *old = arenas->p[ARENA_CALL];
        char *fresh = aligned_alloc(64, ((used + more) * 2 + 63) & ~(size_t)63);
        if (!fresh) return -ENOMEM;
        memcpy(fresh, old, used);
        const ptrdiff_t shift = fresh - old;
        ints = (int64_t *)((char *)ints + shift);
        call.item_off = ints;
        call.head_off = ints + nc + 1;
        call.nsplit = ints + 2 * nc + 2;
        call.s = ints + 3 * nc + 2;
        call.part_off = ints + 4 * nc + 2;
        call.hpi = ints + 5 * nc + 2;
        call.block = (block_fn *)((char *)call.block + shift);
        call.wide += shift;
        call.deferred += shift;
        free(old);
        arenas->p[ARENA_CALL] = fresh;
        arenas->n[ARENA_CALL] = ((used + more) * 2 + 63) & ~(size_t)63;
        at = fresh + used;
    }
    call.part = carve(&at, (size_t)parts * sizeof(float));
    call.scratch = carve(&at, (size_t)(threads * call.scratch_floats) * sizeof(float));
    float *wbuf = carve(&at, (size_t)wneed * sizeof(float));
    call.done = carve(&at, (size_t)heads * sizeof(atomic_int));
    for (int64_t x = 0; x < heads; x++) atomic_init(&call.done[x], 0);
    /* From here on a cache fails alone (its status; its output then is not stored): an int8
     * scale out of range before its write, or an injected failure after it, which restores
     * the row. */
    for (int64_t i = 0; i < ncaches; i++) {
        gqa_cache_t *cc = &caches[i];
        call.deferred[i] = 0;
        if (cc->flags & FLAG_FAIL_AFTER_WRITE) { /* tests: a failure after the write */
            if (cc->write_row >= 0) {
                if (cc->enc == ENC_INT8) {
                    cc->status = int8_write(cc, wbuf);
                    if (!cc->status) int8_swap_row(cc, 1);
                } else {
                    write_row(cc, 0);
                    write_row(cc, 1);
                }
            }
            if (!cc->status) cc->status = -EIO;
            continue;
        }
        if (cc->write_row >= 0) {
            if (cc->enc == ENC_INT8) {
                cc->status = int8_write(cc, wbuf);
            } else { /* written by the work item that reads the row, if an attended row */
                int attended = 0;
                for (int64_t r = 0; r < cc->nruns; r++)
                    attended |= cc->write_row >= cc->runs[2 * r] && cc->write_row < cc->runs[2 * r + 1];
                if (attended) call.deferred[i] = 1;
                else write_row(cc, 0);
            }
        }
    }
    pool_run(attend_item, &call, items, threads); /* and the merges */
    arena_trim(ARENA_CALL);
    return 0;
}

/* gqa_run over descriptors that live apart (each cache keeps its own): copied into one array,
 * computed, and each one's `status` copied back. The same return codes as gqa_run. */
int gqa_run_ptrs(gqa_cache_t *const *ptrs, int64_t ncaches, int threads, int isa) {
    if (ncaches < 1) return ncaches == 0 ? 0 : -EINVAL;
    gqa_cache_t *caches = arena_get(ARENA_DESCS, (size_t)ncaches * sizeof *caches);
    if (!caches) return -ENOMEM;
    for (int64_t i = 0; i < ncaches; i++) {
        if (!ptrs[i]) return -EINVAL;
        caches[i] = *ptrs[i];
    }
    const int rc = gqa_run(caches, ncaches, threads, isa);
    if (!rc)
        for (int64_t i = 0; i < ncaches; i++) ptrs[i]->status = caches[i].status;
    arena_trim(ARENA_DESCS);
    return rc;
}

/* ---------------------------------------------------------------------------------------------
 * The plan: a step's ring and policy arithmetic from the cache's state, as backends/policy.py
 * specifies it (tests/test_policy.py steps both side by side).
 */
static int64_t resident_length(const gqa_cache_t *cc, int64_t t) {
    const int64_t c = cc->c, w = cc->window, s = cc->sinks;
    switch (cc->policy) {
        case POLICY_NONE: return t;
        case POLICY_STRICT: return t < w ? t : w;
        case POLICY_GREEDY: {
            if (t <= c) return t;
            const int64_t g = c - w + 1;
            return t - g * ((t - c + g - 1) / g);
        }
        default: {
            const int64_t tail = t - s < 0 ? 0 : t - s;
            return (t < s ? t : s) + (tail < w ? tail : w);
        }
    }
}

static int64_t ring_row(const gqa_cache_t *cc, int64_t p) {
    if (cc->policy == POLICY_SINK) return p < cc->sinks ? p : cc->sinks + (p - cc->sinks) % cc->window;
    return p % cc->c;
}

/* The rows of positions [a, b) (consecutive, a < b) in the ring region [lo, hi): one or two runs. */
static int add_runs(const gqa_cache_t *cc, int64_t *runs, int nr, int64_t a, int64_t b, int64_t lo, int64_t hi) {
    const int64_t first = ring_row(cc, a), n = b - a;
    if (first + n <= hi) {
        runs[2 * nr] = first;
        runs[2 * nr + 1] = first + n;
        return nr + 1;
    }
    runs[2 * nr] = first;
    runs[2 * nr + 1] = hi;
    runs[2 * nr + 2] = lo;
    runs[2 * nr + 3] = lo + n - (hi - first);
    return nr + 2;
}

/* The plan of the step from T = cc->t: the attended runs (sorted, joined where they touch:
 * base.merge_runs) and the row written into cc's runs / nruns / write_row; -ENOSPC when the
 * policy has no room (none, full). With res: the rcols first R_* numbers after the step. */
static int plan_step(gqa_cache_t *cc, int64_t *res, int64_t rcols) {
    const int64_t t = cc->t, u = t + 1, w = cc->window, s = cc->sinks;
    if (t < 0) return -EINVAL;
    if (cc->policy == POLICY_NONE && t >= cc->c) return -ENOSPC;
    int64_t runs[2 * MAX_RUNS];
    int nr = 0;
    if (cc->policy == POLICY_NONE) {
        nr = add_runs(cc, runs, nr, 0, u, 0, cc->c);
    } else if (cc->policy == POLICY_SINK) {
        const int64_t head = u < s ? u : s, from = u - w > s ? u - w : s;
        if (head) nr = add_runs(cc, runs, nr, 0, head, 0, cc->c);
        if (from < u) nr = add_runs(cc, runs, nr, from, u, s, cc->c);
    } else {
        nr = add_runs(cc, runs, nr, u - (u < w ? u : w), u, 0, cc->c);
    }
    int64_t attended = 0;
    for (int r = 0; r < nr; r++) attended += runs[2 * r + 1] - runs[2 * r];
    for (int r = 1; r < nr; r++) /* sort by (a, b): at most four */
        for (int x = r; x > 0 && (runs[2 * x - 2] > runs[2 * x] ||
                                  (runs[2 * x - 2] == runs[2 * x] && runs[2 * x - 1] > runs[2 * x + 1]));
             x--) {
            const int64_t a = runs[2 * x - 2], b = runs[2 * x - 1];
            runs[2 * x - 2] = runs[2 * x];
            runs[2 * x - 1] = runs[2 * x + 1];
            runs[2 * x] = a;
            runs[2 * x + 1] = b;
        }
    int m = 0;
    for (int r = 0; r < nr; r++) {
        if (m && cc->runs[2 * m - 1] == runs[2 * r]) {
            cc->runs[2 * m - 1] = runs[2 * r + 1];
        } else {
            cc->runs[2 * m] = runs[2 * r];
            cc->runs[2 * m + 1] = runs[2 * r + 1];
            m++;
        }
    }
    cc->nruns = m;
    cc->write_row = ring_row(cc, t);
    if (res) {
        int64_t r[R_COLS];
        const int64_t lu = resident_length(cc, u);
        r[R_T] = u;
        r[R_RESIDENT] = lu;
        r[R_FIRST] = cc->policy == POLICY_SINK ? (s ? 0 : (u - w > 0 ? u - w : 0)) : u - lu;
        r[R_LAST] = t;
        r[R_EVICTED] = resident_length(cc, t) + 1 - lu;
        if (lu == u) r[R_REACH] = u;
        else if (cc->policy == POLICY_GREEDY) {
            const int64_t g = cc->c - w + 1;
            r[R_REACH] = ((u - cc->c - 1) % g + g) % g;
        } else r[R_REACH] = 0;
        r[R_ATTENDED] = attended;
        r[R_WRITE_ROW] = cc->write_row;
        for (int64_t x = 0; x < rcols && x < R_COLS; x++) res[x] = r[x];
    }
    return 0;
}

/* The plan of one step from the cache's state, computed and not taken (tests: the C twin of
 * backends/policy.py). out: R_COLS numbers, then nruns, then the runs. 0 or -ENOSPC/-EINVAL. */
int gqa_plan(const gqa_cache_t *cache, int64_t *out) {
    gqa_cache_t cc = *cache;
    const int rc = plan_step(&cc, out, R_COLS);
    if (rc) return rc;
    out[R_COLS] = cc.nruns;
    for (int r = 0; r < 2 * cc.nruns; r++) out[R_COLS + 1 + r] = cc.runs[r];
    return 0;
}

/* The rollback reach of a cache at its T (policy.rollback_reach), for Python's rollback. */
int64_t gqa_rollback_reach(const gqa_cache_t *cc) {
    const int64_t t = cc->t, lt = resident_length(cc, t);
    if (lt == t) return t;
    if (cc->policy != POLICY_GREEDY) return 0;
    const int64_t g = cc->c - cc->window + 1;
    return ((t - cc->c - 1) % g + g) % g;
}

/* Whether the n elements at p (encoding enc) are finite and within +-limit. */
static int within(int enc, const void *p, int64_t n, float limit) {
    int ok = 1; /* no early exit: the loops vectorize (NaN compares false, so fails too) */
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
    return within(x->io, x->q, nd * x->g, INFINITY) && within(x->io, x->new_k, nd, 65504.0f) &&
           within(x->io, x->new_v, nd, INFINITY);
}

/* n steps, one per row: row i appends to and attends over the cache at caches[i] (distinct
 * caches), planned from its state. The row's query, new key, new value and output: io[4 * i
 * + 0..3] when io is given (pointers), else base[j] + i * stride[j] (bytes) for j = q, k, v,
 * out. Per row: status[i] = 0 (results[i * rcols ..] = the first rcols R_* numbers after the
 * step, T incremented), or the refusal with nothing written and results zero: -EAGAIN (the
 * caller's own path: T below python_below), -ENOSPC (policy none, full), -EDOM (int8: a
 * non-finite input, or a key beyond float16's range), -ERANGE (int8 scale),
 * -EIO (injected failure), -EINVAL (no cache). Returns 0, or a negative errno for the whole
 * call (nothing written, no status). */
int gqa_step(gqa_cache_t *const *caches, int64_t n, const void *const *io, const void *const *base,
             const int64_t *stride, int64_t *results, int64_t rcols, int32_t *status, int threads, int isa) {
    if (n < 0 || rcols < 0 || (!io && (!base || !stride))) return -EINVAL;
    if (n == 0) return 0;
    gqa_cache_t *work = arena_get(ARENA_DESCS, (size_t)n * (sizeof *work + sizeof(int64_t)));
    if (!work) return -ENOMEM;
    int64_t *row_of = (int64_t *)(work + n);
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t *res = results + i * rcols;
        memset(res, 0, (size_t)rcols * sizeof(int64_t));
        gqa_cache_t *cc = caches[i];
        if (!cc) {
            status[i] = -EINVAL;
            continue;
        }
        if (cc->t < cc->python_below) {
            status[i] = -EAGAIN;
            continue;
        }
        gqa_cache_t *x = &work[m];
        *x = *cc;
        const int rc = plan_step(x, res, rcols);
        status[i] = rc;
        if (rc) {
            memset(res, 0, (size_t)rcols * sizeof(int64_t));
            continue;
        }
        if (io) {
            x->q = io[4 * i];
            x->new_k = io[4 * i + 1];
            x->new_v = io[4 * i + 2];
            x->out = (void *)io[4 * i + 3];
        } else {
            x->q = (const char *)base[0] + i * stride[0];
            x->new_k = (const char *)base[1] + i * stride[1];
            x->new_v = (const char *)base[2] + i * stride[2];
            x->out = (char *)base[3] + i * stride[3];
        }
        if (x->enc == ENC_INT8 && !int8_values_ok(x)) { /* nothing written: the caller names the value */
            status[i] = -EDOM;
            memset(res, 0, (size_t)rcols * sizeof(int64_t));
            continue;
        }
        row_of[m++] = i;
    }
    const int rc = gqa_run(work, m, threads, isa);
    if (rc) {
        memset(results, 0, (size_t)(n * rcols) * sizeof(int64_t));
        arena_trim(ARENA_DESCS);
        return rc;
    }
    for (int64_t x = 0; x < m; x++) {
        const int64_t i = row_of[x];
        status[i] = work[x].status;
        if (work[x].status) memset(results + i * rcols, 0, (size_t)rcols * sizeof(int64_t));
        else caches[i]->t++;
    }
    arena_trim(ARENA_DESCS);
    return 0;
}

/* The layout the library was built with, for backends/native.py to compare with its mirror:
 * sizeof(gqa_cache_t), every field's offset in declaration order, then the enums. Writes at
 * most n numbers; returns how many there are. */
#define LAYOUT_FIELDS(X)                                                                                            \
    X(enc) X(io) X(flags) X(nruns) X(n) X(g) X(d) X(c) X(kstride) X(dk) X(no) X(scale_stride) X(runs) X(write_row) \
        X(qscale) X(status) X(k) X(v) X(ks) X(vs) X(ko) X(q) X(order) X(new_k) X(new_v) X(saved) X(out) X(policy)  \
            X(reserved) X(window) X(sinks) X(t) X(python_below)
int64_t gqa_layout(int64_t *out, int64_t n) {
    const int64_t v[] = {
        (int64_t)sizeof(gqa_cache_t),
#define OFFSET(f) (int64_t) offsetof(gqa_cache_t, f),
        LAYOUT_FIELDS(OFFSET)
#undef OFFSET
        MAX_RUNS, ISA_AUTO, ISA_PORTABLE, ISA_AVX512, ISA_AVX512_DOT, ENC_F32, ENC_BF16, ENC_F16, ENC_INT8, FLAG_HALF_SCALES,
        FLAG_FAIL_AFTER_WRITE, FLAG_ROTATE, FLAG_RECIPROCAL, FLAG_ISA_SHIFT, POLICY_NONE, POLICY_STRICT,
        POLICY_GREEDY, POLICY_SINK, R_T, R_RESIDENT, R_FIRST, R_LAST, R_EVICTED, R_REACH, R_ATTENDED, R_WRITE_ROW, R_COLS};
    const int64_t count = (int64_t)(sizeof v / sizeof v[0]);
    for (int64_t i = 0; i < n && i < count; i++) out[i] = v[i];
    return count;
}

/* ---------------------------------------------------------------------------------------------
 * The int8 cache's value rotation.
 */

/* x (rows, d) float32 times the normalized block-diagonal Sylvester Hadamard matrix with blocks
 * of `block` (a power of two dividing d), in place: quant.hadamard_rotation's H, which is
 * symmetric, so this is also H x. A fast Walsh-Hadamard transform, d log(block) adds, and no
 * threads: torch's matrix product here would start its thread pool, whose idle spinning then
 * competes with the attention kernel for the cores. */
#if GQA_HAVE_AVX512
/* The same transform 16 lanes at a time (block a multiple of 16), the same additions and
 * subtractions in the same order, so bit for bit the scalar loop's result. Stages of span
 * len < 16 are within a register: lane j takes its partner j ^ len by a permutation, the lower
 * lane of a pair keeps a + b, the upper one a - b. */
AVX512 static void hadamard_rows_avx512(float *x, int64_t rows, int64_t d, int64_t block, float norm) {
    __m512i perm[4];
    __mmask16 upper[4];
    for (int s = 0; s < 4; s++) {
        int idx[16];
        unsigned m = 0;
        for (int j = 0; j < 16; j++) {
            idx[j] = j ^ (1 << s);
            if (j & (1 << s)) m |= 1u << j;
        }
        perm[s] = _mm512_loadu_si512(idx);
        upper[s] = (__mmask16)m;
    }
    const __m512 vn = _mm512_set1_ps(norm);
    for (int64_t r = 0; r < rows; r++) {
        float *row = x + r * d;
        for (int64_t b0 = 0; b0 < d; b0 += block) {
            float *y = row + b0;
            for (int64_t j = 0; j < block; j += 16) {
                __m512 v = _mm512_loadu_ps(y + j);
                for (int s = 0; s < 4; s++) {
                    const __m512 p = _mm512_permutexvar_ps(perm[s], v);
                    v = _mm512_mask_blend_ps(upper[s], _mm512_add_ps(v, p), _mm512_sub_ps(p, v));
                }
                _mm512_storeu_ps(y + j, v);
            }
            for (int64_t len = 16; len < block; len <<= 1)
                for (int64_t i = 0; i < block; i += 2 * len)
                    for (int64_t j = i; j < i + len; j += 16) {
                        const __m512 a = _mm512_loadu_ps(y + j), b = _mm512_loadu_ps(y + j + len);
                        _mm512_storeu_ps(y + j, _mm512_add_ps(a, b));
                        _mm512_storeu_ps(y + j + len, _mm512_sub_ps(a, b));
                    }
            for (int64_t j = 0; j < block; j += 16) _mm512_storeu_ps(y + j, _mm512_mul_ps(_mm512_loadu_ps(y + j), vn));
        }
    }
}
#endif

int gqa_hadamard_rows(float *x, int64_t rows, int64_t d, int64_t block) {
    if (rows < 0 || d < 1 || block < 1 || (block & (block - 1)) || d % block) return -EINVAL;
    const float norm = 1.0f / sqrtf((float)block);
#if GQA_HAVE_AVX512
    if (block % 16 == 0 && gqa_avx512_usable()) {
        hadamard_rows_avx512(x, rows, d, block, norm);
        return 0;
    }
#endif
    for (int64_t r = 0; r < rows; r++) {
        float *row = x + r * d;
        for (int64_t b0 = 0; b0 < d; b0 += block) {
            float *y = row + b0;
            for (int64_t len = 1; len < block; len <<= 1)
                for (int64_t i = 0; i < block; i += 2 * len)
                    for (int64_t j = i; j < i + len; j++) {
                        const float a = y[j], b = y[j + len];
                        y[j] = a + b;
                        y[j + len] = a - b;
                    }
            for (int64_t j = 0; j < block; j++) y[j] *= norm;
        }
    }
    return 0;
}
