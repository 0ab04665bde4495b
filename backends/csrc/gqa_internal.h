/*
 * gqa_internal.h: what every file of the decode library shares (the descriptor, the enums, the
 * key layout, the scalar conversions) and the functions one file offers another. Not a public
 * header: the library's interface is its exported gqa_* functions, mirrored by
 * backends/native.py (which checks gqa_layout against its own copy before it calls anything).
 *
 * GQA decode attention on the CPU, straight from a cache's storage: dense float32, bfloat16 or
 * float16 keys and values, or int8 codes plus scales. One library, one core.
 *
 * For every cache of a call, every KV head n (N = B * Hkv) and each of its G query heads g:
 *
 *     score[t] = qscale * (q[n,g,:] . key[n,:,t])         (the query scaled first, or the score)
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
 * The core, shared by every encoding: a split is SPLIT_T consecutive attended positions of a
 * (cache, KV head) (in logical order), a work item one split (a short cache's heads share one
 * item instead; threads claim runs of consecutive items, so a thread streams on from one split
 * into the next); each split walks its positions a
 * block of up to TILE_T at a time on the physical TILE_T grid, scores the block for TILE_G query
 * heads at once (each key row is read once for the G heads that share it), keeps an online
 * softmax (running max, sum and float32 accumulator), and leaves a partial result; the item
 * that completes a head's splits merges them by log-sum-exp in split order. Because the split
 * size is fixed in tokens and the merge order is fixed, an output does not depend on the other
 * caches of the call, on the number of threads or on which thread ran which item: it is
 * bit-identical alone or batched, whichever splits share an item. Items are taken from one
 * counter by the threads, so the work spreads by positions (bytes of KV) read.
 *
 * Per encoding only the block's loads differ (widen16 / load_elem): keys and values are read
 * once and widened to float32 in registers. Four implementations of the block, chosen at run
 * time per cache: AVX2 (with FMA and F16C; D a multiple of 8; int8 scores and values by
 * vpmaddwd on an int16 query and int16 block weights, within 2e-4 of the float paths), AVX-512
 * (F, BW, VL, DQ; when the CPU has it and D is a multiple of 16), AVX-512 with VNNI
 * (ISA_AVX512_DOT: int8 scores and values by vpdpwssd, as AVX2's by vpmaddwd; where the CPU
 * also has BF16, bfloat16 scores by vdpbf16ps on the query's own bfloat16; the rest as
 * AVX-512) and portable C
 * (the specification the fast paths are tested against). The library builds with no -march
 * flag. The vector blocks prefetch the next block as they go (its key block is one contiguous
 * run, its value rows another; the AVX-512 blocks but the VNNI int8 one a few lines at every
 * step of the block, gqa_avx512.h's drip).
 * docs/design.md ("The C kernel") has the measurements behind these choices.
 *
 * Threads: a pool created once (gqa_set_threads sizes it; started on first use, restarted after
 * fork), the calling thread working too. A call of PARALLEL_MIN_WORK or more shares its items
 * with the pool's workers; one that finds the pool taken by another thread's call runs its
 * items on its own thread instead of waiting (a server's compute threads keep stepping side by
 * side), as does a smaller call.
 *
 * The step (gqa_run with write_row >= 0): the new key and value are written into their ring
 * row (dense: by the work item that reads that row, per KV head; int8: before the attention,
 * keys put in the stored channel order and quantized, the outlier channels as float16, values
 * Hadamard-rotated (FLAG_ROTATE) and quantized as quant.quantize_int8 does). Every check and
 * allocation comes before the write, so a refused step leaves the cache byte-identical and
 * nothing fails after it (a test build keeps the overwritten bytes in `saved` for its injected
 * failure, write.c). The output is written in the stream dtype (int8: rotated back first).
 *
 * The files (one job each; native_build.py compiles them all into one shared library):
 *
 *     gqa_internal.h      this: shared definitions
 *     gqa_avx512.h        AVX-512 helpers the block files share (exp, widening, softmax, P.V)
 *     block_portable.c    the portable block (the specification the fast paths are tested against)
 *     gqa_avx2.h          AVX2 helpers the AVX2 block files share (exp, widening, softmax, scales)
 *     block_avx2.c        the AVX2 blocks of every encoding (x86-64 without AVX-512)
 *     block_avx2_int8.c   the AVX2 int8 block with vpmaddwd: int16 query and weights
 *     block_avx512.c      the AVX-512 blocks of every encoding, and row widening / narrowing
 *     block_avx512_bf16.c the bfloat16 block with vdpbf16ps (AVX-512 BF16)
 *     block_avx512_int8.c the int8 block with vpdpwssd (AVX-512 VNNI): int16 query and weights
 *     isa.c               which ISAs this CPU runs, and the block a cache gets
 *     pool.c              the thread pool
 *     arena.c             per-thread memory kept between calls
 *     attend.c            the work items: a head's blocks, its split partials and their merge
 *     write.c             the step's write of the new token (and its restore after a failure)
 *     int8_code.c         int8 coding: quantization and the Hadamard rotation
 *     run.c               gqa_run: check the caches, lay out a call, write, run the items
 *     plan.c              the step's ring and policy arithmetic (the C twin of policy.py)
 *     step.c              gqa_step: plan, check and run many caches' steps in one call
 *     layout.c            gqa_layout: the descriptor's layout for native.py's check
 *     test_hooks.c        failure injection, compiled only into test builds (-DGQA_TEST_HOOKS)
 *     torch_step.cpp      not in the library: the public step's optional C++ entry from Python,
 *                         a module of its own against torch's headers that calls gqa_step
 */
#ifndef GQA_INTERNAL_H
#define GQA_INTERNAL_H

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* the AVX-512 code is built on x86-64 whatever the -march (chosen at run time); the intrinsics
 * header, large, only where it is used (gqa_avx512.h) */
#if defined(__x86_64__) && defined(__GNUC__)
#define GQA_X86_64 1
#else
#define GQA_X86_64 0
#endif

#define TILE_T 64   /* positions per block: 64 int8 codes of one channel are one cache line */
#define TILE_G 4    /* query heads scored together against one block */
/* Positions per split: fixed, so results never depend on how the work is shared. Each split
 * costs its own partial (written, then read by the merge) and set-up: 1024 against 512 took a
 * cold step 1-5% less time in every encoding at S = 2048 and 8192, and 64 mixed caches 1.5-3.5%
 * (docs/design.md, forty-first session); the pool still gets 2 splits a head from S = 1025. */
#ifndef SPLIT_T
#define SPLIT_T 1024
#endif
/* A one-split cache's heads share a work item up to this many positions in all (its set-up paid
 * once for them all), so a cache of a few hundred positions still makes an item a head or two. */
#define HEADS_ITEM_T 512
#define RUNS_PER_THREAD 8 /* a long call's claims per thread at its start (run.c: claim_chunk) */
#define MAX_RUN_ITEMS 16  /* the most work items one claim takes (pool.c's runs) */
#define MAX_RUNS 4
#define MAX_THREADS 256
/* A call's work, in positions read: each (cache, KV head) counts its attended positions plus
 * HEAD_WORK for what it costs whatever its length (query in, state, output out: a float32 head
 * of 1 position took as long as one of ~8 on Zen 1). Below PARALLEL_MIN_WORK the calling thread
 * does all: a parallel call's own cost (the workers' wake-up, a futex call) is a few us, and
 * from ~1000 positions x heads two threads were faster, cold and hot (docs/design.md, "Short
 * caches on both threads"). */
#define HEAD_WORK 8
#define PARALLEL_MIN_WORK (1 << 10)
/* A cache's share of a call's work: its heads, each over `positions` (run.c, pool.c's alert). */
static inline int64_t cache_work(int64_t heads, int64_t positions) { return heads * (positions + HEAD_WORK); }
#ifndef BPIECES
#define BPIECES 2 /* bfloat16 pieces of a query for BF16 dot products (split_query_bf16) */
#endif


/* In order of speed. ISA_AVX2: AVX2 with FMA and F16C. ISA_AVX512: F, BW, VL, DQ.
 * ISA_AVX512_DOT: also VNNI (int8 scores and values by vpdpwssd), and where the CPU has BF16 as
 * well, bfloat16 scores by vdpbf16ps; the other encodings as ISA_AVX512 (isa.c). */
enum { ISA_AUTO = 0, ISA_PORTABLE = 1, ISA_AVX2 = 2, ISA_AVX512 = 3, ISA_AVX512_DOT = 4 };
enum { ENC_F32 = 0, ENC_BF16 = 1, ENC_F16 = 2, ENC_INT8 = 3 };
/* FLAG_FAIL_AFTER_WRITE: acted on only by a test build (test_hooks.c); part of the layout either way */
enum { FLAG_HALF_SCALES = 1, FLAG_FAIL_AFTER_WRITE = 2, FLAG_ROTATE = 4, FLAG_RECIPROCAL = 8 };
#define FLAG_ISA_SHIFT 4 /* flags bits 4-6: this cache's ISA_* (ISA_AUTO: the call's) */
#define FLAG_ISA_MASK 7
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
    void *saved;                /* a test build's copy of the overwritten row (write.c): dense
                                   2 * N * D elements of enc; int8 N * (dk + 2 no + D + 2 * scale
                                   bytes) bytes */
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
    /* or, on an item's last block, the block this thread reads next (the first of its next
     * item, elsewhere): its key bytes then its value rows, asked for by the same drip (an
     * AVX-512 widening or bfloat16 dot block; attend.c sets it only for those). kbytes 0: none */
    const char *after_k, *after_v;
    int64_t after_kbytes, after_vbytes;
    float *q;         /* room for the head's query (G, D), float32, scaled, in key order */
    /* bfloat16 with dot products (ISA_AVX512_DOT): the query as bfloat16 pieces, made on the
     * item's first block by split_query_bf16 (qpieces per query head, scores times qmul) */
    uint16_t *qb;
    float qmul;
    /* the blocks' scores times smul: qscale where q is the stream's float32 query unscaled
     * (attend.c, a float32 cache on AVX-512), else 1 */
    float smul;
    int qpieces, qready;
    /* q not made yet (a bfloat16 query for the BF16 dot block, which splits the stream's
     * query itself): a block that reads q makes it first (block_avx512_bf16.c) */
    int qlazy;
    /* a one-split head read in one block by an AVX2 dense block: its output rows (the stream's
     * dtype), which that block finishes itself from an accumulator that starts in registers;
     * acc is then neither cleared nor read. NULL otherwise. */
    void *out;
} state_t;

static inline int64_t enc_size(int enc) { return enc == ENC_F32 ? 4 : enc == ENC_INT8 ? 1 : 2; }

/* ---------------------------------------------------------------------------------------------
 * The key layout, as backends/key_layout.py's KeyBlocks defines it (the one definition): per KV
 * head, the C ring rows in blocks of TILE_T (the last one C mod TILE_T rows when shorter), one
 * block after the other; a block of w rows holds its dk channels as dk / P lines of w words of
 * P channels (kpack: 2 for bfloat16, else 1; dk padded to a multiple of P). A
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

/* Asks for every 64-byte line of [p, p + bytes) (locality as __builtin_prefetch's). */
static inline __attribute__((always_inline)) void prefetch_lines(const void *p, int64_t bytes, const int locality) {
    const uintptr_t end = (uintptr_t)p + (uintptr_t)bytes;
    for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)63; a < end; a += 64) __builtin_prefetch((const void *)a, 0, locality);
}

/* int8: asks for the lines of KV head h's scales and float16 outlier channel rows at ring rows
 * [row, row + n) (locality as __builtin_prefetch's). Six short runs a block beside its key and
 * value blocks, read where the block's scores and softmax use them: the blocks' own prefetches
 * did not cover them, and each was a miss of its own (docs/design.md, "int8's side rows"). */
static inline __attribute__((always_inline)) void prefetch_int8_side(const gqa_cache_t *cc, int64_t h, int64_t row,
                                                                     int64_t n, const int locality) {
    n = cc->c - row < n ? cc->c - row : n; /* not past the ring's end */
    if (n <= 0) return;
    const int64_t el = cc->flags & FLAG_HALF_SCALES ? 2 : 4, at = (h * cc->scale_stride + row) * el;
    prefetch_lines((const char *)cc->ks + at, n * el, locality);
    prefetch_lines((const char *)cc->vs + at, n * el, locality);
    for (int64_t o = 0; o < cc->no; o++) prefetch_lines(cc->ko + (h * cc->no + o) * cc->c + row, n * 2, locality);
}

/* Whether the block of nt rows at ring row phys is a whole key block of 1, 2 or 4 rows read from
 * its first row (a short ring, or a ring's last short block): its key lines are nt rows apart,
 * several to an 8-lane register (block_avx2.c, scores_lines_avx2). Not int8, no outlier
 * channels, dk a multiple of 16 (a register's channels). */
static inline int whole_short_block(int enc, const gqa_cache_t *cc, int64_t phys, int64_t nt) {
    const int64_t b0 = phys - phys % TILE_T, rows = cc->c - b0 < TILE_T ? cc->c - b0 : TILE_T;
    return enc != ENC_INT8 && cc->no == 0 && phys == b0 && nt == rows && (nt == 1 || nt == 2 || nt == 4) &&
           cc->dk % 16 == 0;
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
 * Between the files. Internal functions are hidden: the library exports only gqa_*.
 */
#define GQA_INTERNAL __attribute__((visibility("hidden")))
#if GQA_X86_64 && defined(GQA_EMULATE_AVX512)
/* The test build whose AVX-512 paths run on AVX2 (gqa_emu512.h): their functions are AVX2's. */
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 AVX2
#define AVX512DOT AVX2
#define AVX512VNNI AVX2
#elif GQA_X86_64
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define AVX512DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#endif

/* A block of nt positions at ring row phys of KV head h: scores, online softmax, values. */
typedef void (*block_fn)(const gqa_cache_t *, const float *, int64_t, int64_t, int64_t, state_t *);

/* A call of gqa_run: its caches, their work items and the memory they share (run.c lays it out,
 * attend.c's items read it). */
typedef struct {
    gqa_cache_t *caches;
    int64_t ncaches;
    int64_t *item_off; /* ncaches + 1: first work item of each cache */
    int64_t *head_off; /* ncaches + 1: first (cache, head) of each cache, for the merge */
    int64_t *nsplit, *s, *part_off;
    int64_t *hpi; /* per cache: KV heads per work item (one-split caches: as many as fit HEADS_ITEM_T;
                     several-split caches: 1, each item one split of a head) */
    int64_t chunk; /* the most items one claim takes (pool.c) */
    block_fn *block;
    float *part; /* per cache (N * nsplit, G, D + 2): accumulator, then running max and sum */
    float *scratch;
    int64_t scratch_floats; /* per thread */
    atomic_int *done;       /* per (cache, head): splits finished */
    char *deferred;         /* per cache: DEFER_*, whose work item does the step's write */
    char *wide;             /* per cache: its ISA's 16-bit row conversions (ISA_AVX2 or ISA_AVX512; 0: scalar) */
    float *wbuf;            /* per thread: int8_write's room, wfloats floats each (thread 0's also the caller's) */
    int64_t wfloats;
    float *coded;           /* per DEFER_CODES cache: its quantized row, wfloats floats at coded_at[i] */
    int64_t *coded_at;      /* per cache: its room in coded (floats), or -1 */
    int64_t *ahead; /* per thread (AHEAD_STRIDE apart): [0] the item whose first block its last item
                       asked for (attend.c), -1: none; [1] how (CONT_SPLIT or CONT_ITEM) */
} call_t;
#define AHEAD_STRIDE (64 / (int)sizeof(int64_t))

/* Who writes a cache's step row: the caller before the items (DEFER_NONE), the item that reads
 * the row, head by head (DEFER_HEAD: dense caches; DEFER_CODES: int8 caches whose heads are
 * several items, the row checked and quantized by the caller before the items, each head's
 * codes stored by its item: the ~1000 key lines a row's codes touch, cold, no longer on the
 * caller's path before the items), or the cache's only item, before its heads (DEFER_ROW: an
 * int8 cache whose heads are one item, so its quantization runs on the pool beside the other
 * caches' instead of one after the other on the caller's thread). */
enum { DEFER_NONE = 0, DEFER_HEAD = 1, DEFER_ROW = 2, DEFER_CODES = 3 };

/* block_portable.c, block_avx2.c, block_avx2_int8.c, block_avx512.c, block_avx512_bf16.c, block_avx512_int8.c */
GQA_INTERNAL void block_portable(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt,
                                 state_t *st);
/* The run of `order` from j (of d): how many of order[j], order[j + 1], .. are consecutive
 * (order[j] + 1, ..); gather_rows_avx2 and gather_rows_avx512 move an int8 cache's query run
 * by run. */
static inline int64_t order_run(const int64_t *order, int64_t j, int64_t d) {
    int64_t len = 1;
    while (j + len < d && order[j + len] == order[j] + len) len++;
    return len;
}

#if GQA_X86_64
AVX2 GQA_INTERNAL void block_avx2_f32(const gqa_cache_t *, const float *, int64_t, int64_t, int64_t, state_t *);
AVX2 GQA_INTERNAL void block_avx2_bf16(const gqa_cache_t *, const float *, int64_t, int64_t, int64_t, state_t *);
AVX2 GQA_INTERNAL void block_avx2_f16(const gqa_cache_t *, const float *, int64_t, int64_t, int64_t, state_t *);
AVX2 GQA_INTERNAL void block_avx2_int8(const gqa_cache_t *, const float *, int64_t, int64_t, int64_t, state_t *);
AVX2 GQA_INTERNAL void block_avx2_dot_int8(const gqa_cache_t *, const float *, int64_t, int64_t, int64_t, state_t *);
AVX2 GQA_INTERNAL void widen_row_avx2(int enc, const uint16_t *src, float *dst, int64_t n, float scale);
AVX2 GQA_INTERNAL void gather_rows_avx2(int enc, const void *src, const int64_t *order, int64_t G, int64_t d,
                                        float scale, float *dst);
AVX2 GQA_INTERNAL int within_f32_avx2(const float *p, int64_t n, float limit);
AVX2 GQA_INTERNAL void narrow_row_avx2(int enc, const float *src, uint16_t *dst, int64_t n);
AVX2 GQA_INTERNAL void unpair_row_avx2(float *o, int64_t d);
AVX2 GQA_INTERNAL void finish_rows_avx2(int enc, const float *acc, const float *l, int64_t gn, int64_t d, void *out);
AVX2 GQA_INTERNAL void scores_lines_avx2_call(int enc, const float *q, int64_t dk, int64_t dq, const char *kb, int64_t nt,
                                              int gt, float *out);
AVX512 GQA_INTERNAL void block_avx512_f32(const gqa_cache_t *, const float *, int64_t, int64_t, int64_t, state_t *);
AVX512 GQA_INTERNAL void block_avx512_bf16(const gqa_cache_t *, const float *, int64_t, int64_t, int64_t, state_t *);
AVX512 GQA_INTERNAL void block_avx512_f16(const gqa_cache_t *, const float *, int64_t, int64_t, int64_t, state_t *);
AVX512 GQA_INTERNAL void block_avx512_int8(const gqa_cache_t *, const float *, int64_t, int64_t, int64_t, state_t *);
AVX512DOT GQA_INTERNAL void block_dot_bf16(const gqa_cache_t *, const float *, int64_t, int64_t, int64_t, state_t *);
AVX512VNNI GQA_INTERNAL void block_dot_int8(const gqa_cache_t *, const float *, int64_t, int64_t, int64_t, state_t *);
AVX512 GQA_INTERNAL int within_f32_avx512(const float *p, int64_t n, float limit);
AVX512 GQA_INTERNAL void widen_row_avx512(int enc, const void *src, float *dst, int64_t n, float scale);
AVX512 GQA_INTERNAL void gather_rows_avx512(int enc, const void *src, const int64_t *order, int64_t G, int64_t d,
                                            float scale, float *dst);
AVX512 GQA_INTERNAL void narrow_row_avx512(int enc, const float *src, uint16_t *dst, int64_t n);
AVX512 GQA_INTERNAL void finish_rows_avx512(int enc, const float *acc, const float *l, int64_t gn, int64_t d,
                                          void *out);
#endif

/* isa.c */
int gqa_avx512_usable(void);
int gqa_avx2_usable(void);
int gqa_usable_isas(int64_t d);
GQA_INTERNAL block_fn choose_block(int enc, int isa);
int gqa_auto_isa(int64_t d, int enc);

/* pool.c: fn(ctx, item, next, tid) for item in [0, nitems) on up to `threads` threads (tid <
 * threads), claimed in runs of at most `chunk` consecutive items; next: the item this thread
 * likely runs after this one (-1: none) */
typedef void (*task_fn)(void *ctx, int64_t item, int64_t next, int tid);
GQA_INTERNAL void pool_run(task_fn fn, void *ctx, int64_t nitems, int64_t chunk, int threads);
/* ns on CLOCK_MONOTONIC since *t0 (pool.c's spins; test_hooks.c's) */
GQA_INTERNAL int64_t elapsed_ns(const struct timespec *t0);
int gqa_threads(void);
void gqa_prewake(const gqa_cache_t *cc);
void gqa_prewake_heads(int64_t heads);
int gqa_may_use_pool(const gqa_cache_t *cc);

/* arena.c: the calling thread's memory, kept between its calls */
enum { ARENA_CALL = 0, ARENA_CACHES = 1, ARENA_DESCS = 2, ARENAS = 3 };
GQA_INTERNAL void *arena_get(int which, size_t bytes);
GQA_INTERNAL void arena_trim(int which);
GQA_INTERNAL void *carve(char **at, size_t n);

/* stamps.c: a stamps build's time stamps (ns on CLOCK_MONOTONIC), of these kinds */
enum { STAMP_ITEM = 0, STAMP_BLOCK = 1, STAMP_ITEM_END = 2, STAMP_WRITES = 10, STAMP_ITEMS = 11,
       STAMP_ITEMS_END = 12, STAMP_STEP = 20, STAMP_STEP_END = 21 };
typedef struct {
    int64_t ns;
    int32_t tid, item, block, kind; /* item -1: none; block: split * 1000 + block in the split */
} gqa_stamp_t;
#ifdef GQA_STAMPS
extern __thread int32_t gqa_stamp_item; /* the work item the thread runs (-1: none) */
GQA_INTERNAL void stamp_at(int tid, int32_t block, int32_t kind);
#define STAMP(tid, block, kind) stamp_at(tid, block, kind)
#define STAMP_SET_ITEM(item) (gqa_stamp_item = (int32_t)(item))
#else
#define STAMP(tid, block, kind) ((void)0)
#define STAMP_SET_ITEM(item) ((void)0)
#endif

/* attend.c: one work item of a call (task_fn); head h's query as float32 times qscale, in the
 * stored key order, into qf (wide: the cache's vector width, ISA_AVX512 / ISA_AVX2 / 0) */
GQA_INTERNAL void attend_item(void *ctx, int64_t item, int64_t next, int tid);
GQA_INTERNAL void convert_query(const gqa_cache_t *cc, int64_t h, float *qf, int wide);

/* write.c: the step's write of ring row write_row (restore: the saved bytes back) */
GQA_INTERNAL void write_head(const gqa_cache_t *cc, int64_t h, int restore);
GQA_INTERNAL void write_row(const gqa_cache_t *cc, int restore);
GQA_INTERNAL int int8_write(const gqa_cache_t *cc, float *buf);
GQA_INTERNAL int int8_quantize(const gqa_cache_t *cc, float *buf);
GQA_INTERNAL void int8_store_head(const gqa_cache_t *cc, const float *buf, int64_t h);
GQA_INTERNAL void int8_store(const gqa_cache_t *cc, const float *buf);
GQA_INTERNAL void int8_swap_row(const gqa_cache_t *cc, int restore);

/* int8_code.c */
GQA_INTERNAL int quantize_rows(const float *x, int64_t rows, int64_t len, int flags, int8_t *codes, float *scale);
int gqa_hadamard_rows(float *x, int64_t rows, int64_t d, int64_t block);

/* plan.c */
GQA_INTERNAL int plan_step(gqa_cache_t *cc, int64_t *res, int64_t rcols);

/* run.c */
int gqa_run(gqa_cache_t *caches, int64_t ncaches, int threads, int isa);

/* test_hooks.c, defined in a test build alone (called under -DGQA_TEST_HOOKS, which only the
 * sources that test it get: native_build.py): a cache flagged FLAG_FAIL_AFTER_WRITE writes,
 * restores and fails (-EIO) */
GQA_INTERNAL int injected_failure(gqa_cache_t *cc, float *wbuf);

#endif /* GQA_INTERNAL_H */
