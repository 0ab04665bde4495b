/*
 * GQA decode attention straight from an int8 KV cache, on the CPU.
 *
 * One call computes, for every (batch x KV head) n and each of its G query heads g,
 *
 *     score[t] = (q[n,g,:dk] . kcode[n,:,t]) * kscale[n,t] + q[n,g,dk:] . kout[n,:,t]
 *     out[n,g] = sum_t softmax(score)[t] * vscale[n,t] * vcode[n,t,:]
 *
 * (q already scaled, its channels in the cache's key order: the dk channels stored as int8
 * codes, then the `no` outlier channels stored as float16 in kout, see backends/int8.py)
 * over the attended positions, which lie in the cache's ring as a few physical runs [a, b).
 * The codes are read once, a block of TILE_T positions at a time, widened to float32 in
 * registers and never written anywhere: no full-precision copy of the cache exists at any time.
 * Softmax is online (flash-decoding): each work item keeps a running max, a running sum and an
 * output accumulator, so scores need no buffer beyond one block. Work items are (n, split) with
 * the attended positions cut into `nsplit` equal chunks, so that few KV heads still fill every
 * thread; their partial results are merged at the end.
 *
 * Layout: q (N, G, dk + no) float32; key codes (N, dk, C) int8, transposed so that a block
 * of positions of one channel is contiguous, rows `kstride` >= C apart (the cache pads them to
 * whole lines); outlier channels kout (N, no, C) float16; value codes (N, C, D) int8; scales
 * (N, C) float32 or float16 (converted a block at a time) by physical position, row n at
 * ks + n * scale_stride; out (N, G, D) float32. Blocks follow the
 * physical 64-position grid, so with line-aligned rows each block of a key channel is one line.
 *
 * Two implementations of the block: AVX-512 (F, BW, VL, DQ; chosen at run time when the CPU
 * has it and D is a multiple of 16) and portable C. The file builds with no -march flag, so one
 * build runs on any x86-64 (and the portable path anywhere). The AVX-512 path prefetches the
 * next block: the D key channels are D separate streams, more than the hardware prefetcher
 * follows (measured: 16 ms -> 8.5 ms at S = 32768 on the reference VM).
 *
 * Threads: the caller's count (the service runs one per step); the calling thread works too.
 * Returns 0, or a negative errno-style code (no memory, bad arguments) with `out` unspecified.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define GQA_HAVE_AVX512 1
#else
#define GQA_HAVE_AVX512 0
#endif

#define TILE_T 64 /* positions per block: 64 key codes of one channel are one cache line */
#define TILE_G 4  /* query heads scored together against one block */
#define MAX_THREADS 256
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 1 /* measured against 2, 4, 8, 16, 32 and L2 hints: 1 is as fast or faster */
#endif

enum { ISA_AUTO = 0, ISA_PORTABLE = 1, ISA_AVX512 = 2 };

typedef struct {
    const float *q;
    const int8_t *k, *v;
    const void *ks, *vs; /* scales (n, c) by physical position, float32 or float16 bits */
    int64_t scale_stride;
    int half_scales;
    int64_t n, g, d, c, s;
    int64_t kstride; /* key codes: elements from one channel's row to the next (>= c) */
    int64_t dk, no;  /* key channels stored as codes, and as float16 outlier channels */
    const uint16_t *ko; /* outlier channels (n, no, c), float16 bits */
    const int64_t *runs; /* 2 * nruns: physical [a, b) pairs in logical order */
    int64_t nruns;
    int64_t nsplit, chunk;
    float *part; /* (n * nsplit, g, d + 2): accumulator, then running max and sum */
    int isa;
    atomic_long next;
    atomic_int failed;
} job_t;

/* Per-work-item state of one query head: running max m, running sum l, accumulator acc[D]. */
typedef struct {
    float *m, *l, *acc; /* m[G], l[G], acc[G * D] */
    float *p;           /* weights of one block: p[TILE_G * TILE_T] */
    float *ksb, *vsb;   /* one block's float16 scales as float32: ksb[TILE_T], vsb[TILE_T] */
} state_t;

/* IEEE binary16 bits to float (every value: subnormals, infinities, NaN). */
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

/* ---------------------------------------------------------------------------------------------
 * Portable block: plain loops (the compiler vectorizes what it can at the baseline ISA).
 */
/* The block's scales as float32: in place for float32 scales, converted into the state's
 * buffers for float16 ones. */
static void block_scales(const job_t *job, int64_t h, int64_t phys, int64_t nt, state_t *st, const float **ks,
                         const float **vs) {
    const int64_t at = h * job->scale_stride + phys;
    if (!job->half_scales) {
        *ks = (const float *)job->ks + at;
        *vs = (const float *)job->vs + at;
        return;
    }
    const uint16_t *kh = (const uint16_t *)job->ks + at, *vh = (const uint16_t *)job->vs + at;
    for (int64_t t = 0; t < nt; t++) {
        st->ksb[t] = half_to_float(kh[t]);
        st->vsb[t] = half_to_float(vh[t]);
    }
    *ks = st->ksb;
    *vs = st->vsb;
}

static void block_portable(const job_t *job, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    const int64_t d = job->d, c = job->c, G = job->g, dk = job->dk, no = job->no, dq = dk + no;
    const int8_t *kb = job->k + h * dk * job->kstride + phys;
    const uint16_t *kob = job->ko + h * no * c + phys;
    const int8_t *vb = job->v + (h * c + phys) * d;
    const float *ks, *vs;
    block_scales(job, h, phys, nt, st, &ks, &vs);
    float sc[TILE_T];
    for (int64_t g = 0; g < G; g++) {
        const float *q = job->q + (h * G + g) * dq;
        for (int64_t t = 0; t < nt; t++) sc[t] = 0.0f;
        for (int64_t j = 0; j < dk; j++) {
            const float qj = q[j];
            const int8_t *row = kb + j * job->kstride;
            for (int64_t t = 0; t < nt; t++) sc[t] += qj * (float)row[t];
        }
        for (int64_t t = 0; t < nt; t++) sc[t] *= ks[t];
        for (int64_t o = 0; o < no; o++) {
            const float qo = q[dk + o];
            const uint16_t *row = kob + o * c;
            for (int64_t t = 0; t < nt; t++) sc[t] += qo * half_to_float(row[t]);
        }
        float bmax = -INFINITY;
        for (int64_t t = 0; t < nt; t++)
            if (sc[t] > bmax) bmax = sc[t];
        float *acc = st->acc + g * d;
        if (bmax > st->m[g]) {
            const float alpha = expf(st->m[g] - bmax); /* 0 on the first block (m = -inf) */
            st->l[g] *= alpha;
            for (int64_t j = 0; j < d; j++) acc[j] *= alpha;
            st->m[g] = bmax;
        }
        float sum = 0.0f;
        for (int64_t t = 0; t < nt; t++) {
            const float e = expf(sc[t] - st->m[g]);
            sum += e;
            sc[t] = e * vs[t];
        }
        st->l[g] += sum;
        for (int64_t t = 0; t < nt; t++) {
            const float w = sc[t];
            const int8_t *row = vb + t * d;
            for (int64_t j = 0; j < d; j++) acc[j] += w * (float)row[j];
        }
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

AVX512 static inline __m512 widen16(const int8_t *p, __mmask16 mask) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p)));
}

/* Scores of `gt` (<= TILE_G, a constant after inlining) query heads against one block of up to
 * 64 positions: 4 x gt accumulators of 16 positions, one channel (one 64-byte line) at a time. */
AVX512 static inline __attribute__((always_inline)) void scores_avx512(
    const float *q, int64_t dk, int64_t no, const int8_t *kb, int64_t kstride, const uint16_t *kob, int64_t c,
    const float *ks, int64_t nt, const int gt, float *out) {
    const int64_t dq = dk + no;
    __m512 acc[TILE_G][4];
    __mmask16 mask[4];
    for (int i = 0; i < 4; i++) {
        mask[i] = lanes16(nt, i);
        for (int g = 0; g < gt; g++) acc[g][i] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < dk; j++) {
        const int8_t *row = kb + j * kstride;
        /* each channel's line of a later block (see the header; a no-op past the end) */
        _mm_prefetch((const char *)(row + PREFETCH_BLOCKS * TILE_T), _MM_HINT_T0);
        __m512 kf[4];
        for (int i = 0; i < 4; i++) kf[i] = widen16(row + 16 * i, mask[i]);
        for (int g = 0; g < gt; g++) {
            const __m512 qj = _mm512_set1_ps(q[g * dq + j]);
            for (int i = 0; i < 4; i++) acc[g][i] = _mm512_fmadd_ps(qj, kf[i], acc[g][i]);
        }
    }
    for (int i = 0; i < 4; i++) {
        const __m512 s = _mm512_maskz_loadu_ps(mask[i], ks + 16 * i);
        for (int g = 0; g < gt; g++) acc[g][i] = _mm512_mul_ps(acc[g][i], s);
    }
    for (int64_t o = 0; o < no; o++) { /* float16 channels: not scaled */
        const uint16_t *row = kob + o * c;
        for (int i = 0; i < 4; i++) {
            const __m512 x = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask[i], row + 16 * i));
            for (int g = 0; g < gt; g++) acc[g][i] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * dq + dk + o]), x, acc[g][i]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int g = 0; g < gt; g++)
            _mm512_storeu_ps(out + g * TILE_T + 16 * i, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mask[i], acc[g][i]));
}

/* acc[g][j0 : j0 + 16 nv] += sum_t p[g][t] * vcode[t][j0 : ...] for a block: nv registers of
 * 16 channels per query head, all constants after inlining so the accumulators stay in
 * registers. The first pass over a block also prefetches the rows of a later block. */
AVX512 static inline __attribute__((always_inline)) void pv_avx512(
    float *acc_mem, int64_t d, int64_t j0, const int8_t *vb, const float *p, int64_t nt, const int gt,
    const int nv) {
    __m512 acc[TILE_G][4];
    for (int g = 0; g < gt; g++)
        for (int i = 0; i < nv; i++) acc[g][i] = _mm512_loadu_ps(acc_mem + g * d + j0 + 16 * i);
    for (int64_t t = 0; t < nt; t++) {
        const int8_t *row = vb + t * d + j0;
        if (j0 == 0)
            for (int64_t x = 0; x < d; x += 64)
                _mm_prefetch((const char *)(row + PREFETCH_BLOCKS * TILE_T * d + x), _MM_HINT_T0);
        __m512 vf[4];
        for (int i = 0; i < nv; i++) vf[i] = widen16(row + 16 * i, 0xFFFF);
        for (int g = 0; g < gt; g++) {
            const __m512 w = _mm512_set1_ps(p[g * TILE_T + t]);
            for (int i = 0; i < nv; i++) acc[g][i] = _mm512_fmadd_ps(w, vf[i], acc[g][i]);
        }
    }
    for (int g = 0; g < gt; g++)
        for (int i = 0; i < nv; i++) _mm512_storeu_ps(acc_mem + g * d + j0 + 16 * i, acc[g][i]);
}

/* Online softmax of one block for `gt` query heads: p[g][t] holds the scores (-inf past nt) and
 * becomes exp(score - m) * vscale; the running max m, sum l and accumulators acc (gt x d) are
 * rescaled when the max grows. */
AVX512 static inline __attribute__((always_inline)) void softmax_block(
    float *p, int64_t nt, const float *vs, int64_t d, const int gt, float *ms, float *ls, float *accs) {
    __mmask16 mask[4];
    for (int i = 0; i < 4; i++) {
        mask[i] = lanes16(nt, i);
    }
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
            _mm512_storeu_ps(pg + 16 * i, _mm512_mul_ps(e, _mm512_maskz_loadu_ps(mask[i], vs + 16 * i)));
        }
        *l += _mm512_reduce_add_ps(sum);
    }
}

/* Scores, online softmax and the weighted sum of the value codes for one query tile. */
AVX512 static inline __attribute__((always_inline)) void tile_avx512(
    const job_t *job, int64_t h, int64_t phys, int64_t g0, const int gt, const int8_t *kb, const int8_t *vb,
    const float *ks, const float *vs, int64_t nt, state_t *st) {
    const int64_t d = job->d;
    float *p = st->p;
    const int64_t dq = job->dk + job->no;
    scores_avx512(job->q + (h * job->g + g0) * dq, job->dk, job->no, kb, job->kstride,
                  job->ko + h * job->no * job->c + phys, job->c, ks, nt, gt, p);
    softmax_block(p, nt, vs, d, gt, st->m + g0, st->l + g0, st->acc + g0 * d);
    int64_t j0 = 0;
    for (; j0 + 64 <= d; j0 += 64) pv_avx512(st->acc + g0 * d, d, j0, vb, p, nt, gt, 4);
    for (; j0 < d; j0 += 16) pv_avx512(st->acc + g0 * d, d, j0, vb, p, nt, gt, 1);
}

AVX512 static void block_avx512(const job_t *job, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    const int64_t d = job->d, c = job->c;
    const int8_t *kb = job->k + h * job->dk * job->kstride + phys;
    const int8_t *vb = job->v + (h * c + phys) * d;
    const float *ks, *vs;
    if (job->half_scales) { /* 64 scales in four conversions */
        const int64_t at = h * job->scale_stride + phys;
        for (int i = 0; i < 4; i++) {
            const __mmask16 m = lanes16(nt, i);
            _mm512_storeu_ps(st->ksb + 16 * i, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)job->ks + at + 16 * i)));
            _mm512_storeu_ps(st->vsb + 16 * i, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)job->vs + at + 16 * i)));
        }
        ks = st->ksb;
        vs = st->vsb;
    } else {
        ks = (const float *)job->ks + h * job->scale_stride + phys;
        vs = (const float *)job->vs + h * job->scale_stride + phys;
    }
    for (int64_t g0 = 0; g0 < job->g; g0 += TILE_G) {
        switch (job->g - g0 >= TILE_G ? TILE_G : (int)(job->g - g0)) {
            case 4: tile_avx512(job, h, phys, g0, 4, kb, vb, ks, vs, nt, st); break;
            case 3: tile_avx512(job, h, phys, g0, 3, kb, vb, ks, vs, nt, st); break;
            case 2: tile_avx512(job, h, phys, g0, 2, kb, vb, ks, vs, nt, st); break;
            default: tile_avx512(job, h, phys, g0, 1, kb, vb, ks, vs, nt, st); break;
        }
    }
}

#endif /* GQA_HAVE_AVX512 */

/* One work item: head h over logical positions [l0, l1), block by block through the runs. */
static void work_item(const job_t *job, int64_t item, state_t *st) {
    const int64_t h = item / job->nsplit, split = item % job->nsplit;
    const int64_t l0 = split * job->chunk;
    const int64_t l1 = l0 + job->chunk < job->s ? l0 + job->chunk : job->s;
    const int64_t G = job->g, d = job->d;
    for (int64_t g = 0; g < G; g++) {
        st->m[g] = -INFINITY;
        st->l[g] = 0.0f;
    }
    memset(st->acc, 0, (size_t)(G * d) * sizeof(float));
    int64_t base = 0; /* logical position of the current run's start */
    for (int64_t r = 0; r < job->nruns && base < l1; r++) {
        const int64_t a = job->runs[2 * r], b = job->runs[2 * r + 1];
        const int64_t lo = l0 > base ? l0 : base, hi = l1 < base + (b - a) ? l1 : base + (b - a);
        for (int64_t x = lo, nt; x < hi; x += nt) {
            /* blocks on the physical 64-position grid: with line-aligned rows, whole lines */
            const int64_t to_grid = TILE_T - (a + (x - base)) % TILE_T;
            nt = hi - x < to_grid ? hi - x : to_grid;
#if GQA_HAVE_AVX512
            if (job->isa == ISA_AVX512) {
                block_avx512(job, h, a + (x - base), nt, st);
                continue;
            }
#endif
            block_portable(job, h, a + (x - base), nt, st);
        }
        base += b - a;
    }
    float *part = job->part + item * G * (d + 2);
    for (int64_t g = 0; g < G; g++) {
        memcpy(part + g * (d + 2), st->acc + g * d, (size_t)d * sizeof(float));
        part[g * (d + 2) + d] = st->m[g];
        part[g * (d + 2) + d + 1] = st->l[g];
    }
}

static void *worker(void *arg) {
    job_t *job = arg;
    const int64_t G = job->g, d = job->d;
    float *mem = aligned_alloc(64, ((size_t)(2 * G + G * d + (TILE_G + 2) * TILE_T) * sizeof(float) + 63) / 64 * 64);
    if (!mem) {
        atomic_store(&job->failed, 1);
        return NULL;
    }
    float *p = mem + 2 * G + G * d;
    state_t st = {.m = mem, .l = mem + G, .acc = mem + 2 * G, .p = p, .ksb = p + TILE_G * TILE_T,
                  .vsb = p + (TILE_G + 1) * TILE_T};
    const int64_t items = job->n * job->nsplit;
    for (;;) {
        const int64_t item = atomic_fetch_add(&job->next, 1);
        if (item >= items) break;
        work_item(job, item, &st);
    }
    free(mem);
    return NULL;
}

int gqa_int8_avx512_usable(void) {
#if GQA_HAVE_AVX512
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
    return 0;
#endif
}

/* The implementations that can run here for head width d (a bit per ISA_* value). */
int gqa_int8_usable_isas(int64_t d) {
    int m = 1 << ISA_PORTABLE;
    if (gqa_int8_avx512_usable() && d % 16 == 0) m |= 1 << ISA_AVX512;
    return m;
}

int gqa_int8_attend(const float *q, const int8_t *k, const int8_t *v, const void *ks, const void *vs,
                    int half_scales, int64_t scale_stride, int64_t n, int64_t g, int64_t d, int64_t dk, int64_t c, int64_t kstride,
                    const uint16_t *ko, int64_t no, const int64_t *runs, int64_t nruns, int64_t nsplit, float *out,
                    int nthreads, int isa) {
    int64_t s = 0;
    for (int64_t r = 0; r < nruns; r++) {
        if (runs[2 * r] < 0 || runs[2 * r + 1] > c || runs[2 * r] >= runs[2 * r + 1]) return -EINVAL;
        s += runs[2 * r + 1] - runs[2 * r];
    }
    if (n < 1 || g < 1 || d < 1 || s < 1 || nsplit < 1 || nthreads < 1 || kstride < c) return -EINVAL;
    if (dk < 0 || no < 0 || dk + no < 1 || (no && !ko)) return -EINVAL;
    const int usable = gqa_int8_usable_isas(d);
    if (isa == ISA_AUTO)
        isa = usable & (1 << ISA_AVX512) ? ISA_AVX512 : ISA_PORTABLE;
    if (isa < ISA_PORTABLE || isa > ISA_AVX512 || !(usable & (1 << isa))) return -ENOTSUP;
    if (nsplit > s) nsplit = s;
    /* chunks of whole blocks, so only a chunk's last block is partial */
    int64_t chunk = (s + nsplit - 1) / nsplit;
    chunk = (chunk + TILE_T - 1) / TILE_T * TILE_T;
    nsplit = (s + chunk - 1) / chunk;

    job_t job = {.q = q, .k = k, .v = v, .ks = ks, .vs = vs, .half_scales = half_scales, .scale_stride = scale_stride, .n = n, .g = g,
                 .d = d, .c = c, .kstride = kstride, .dk = dk, .no = no, .ko = ko, .s = s, .runs = runs, .nruns = nruns, .nsplit = nsplit, .chunk = chunk,
                 .isa = isa};
    atomic_init(&job.next, 0);
    atomic_init(&job.failed, 0);
    job.part = malloc((size_t)(n * nsplit * g * (d + 2)) * sizeof(float));
    if (!job.part) return -ENOMEM;

    const int64_t items = n * nsplit;
    int helpers = nthreads - 1;
    if (helpers > items - 1) helpers = (int)(items - 1);
    if (helpers > MAX_THREADS - 1) helpers = MAX_THREADS - 1;
    pthread_t tids[MAX_THREADS];
    int started = 0;
    for (; started < helpers; started++)
        if (pthread_create(&tids[started], NULL, worker, &job)) break; /* fewer threads: still correct */
    worker(&job);
    for (int i = 0; i < started; i++) pthread_join(tids[i], NULL);
    if (atomic_load(&job.failed)) {
        free(job.part);
        return -ENOMEM;
    }

    /* merge the splits of each (head, query head): rescale every partial to the common max */
    for (int64_t h = 0; h < n; h++) {
        for (int64_t gi = 0; gi < g; gi++) {
            float mmax = -INFINITY;
            for (int64_t sp = 0; sp < nsplit; sp++) {
                const float m = job.part[((h * nsplit + sp) * g + gi) * (d + 2) + d];
                if (m > mmax) mmax = m;
            }
            float *o = out + (h * g + gi) * d;
            memset(o, 0, (size_t)d * sizeof(float));
            float total = 0.0f;
            for (int64_t sp = 0; sp < nsplit; sp++) {
                const float *pt = job.part + ((h * nsplit + sp) * g + gi) * (d + 2);
                if (pt[d + 1] == 0.0f) continue;
                const float w = expf(pt[d] - mmax);
                total += w * pt[d + 1];
                for (int64_t j = 0; j < d; j++) o[j] += w * pt[j];
            }
            const float inv = 1.0f / total;
            for (int64_t j = 0; j < d; j++) o[j] *= inv;
        }
    }
    free(job.part);
    return 0;
}

/* x (rows, d) float32 times the normalized block-diagonal Sylvester Hadamard matrix with blocks
 * of `block` (a power of two dividing d), in place: quant.hadamard_rotation's H, which is
 * symmetric, so this is also H x. A fast Walsh-Hadamard transform, d log(block) adds, and no
 * threads: torch's matrix product here would start its thread pool, whose idle spinning then
 * competes with the attention kernel for the cores. */
int gqa_hadamard_rows(float *x, int64_t rows, int64_t d, int64_t block) {
    if (rows < 0 || d < 1 || block < 1 || (block & (block - 1)) || d % block) return -EINVAL;
    const float norm = 1.0f / sqrtf((float)block);
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

/* The bandwidth floor: read `nbytes` once with `nthreads` threads (an xor of 8-byte words, so
 * nothing is optimized away and the loop is bound by memory at any ISA). The benchmark times it
 * over the cache's codes and scales. */
typedef struct {
    const uint8_t *p;
    int64_t nbytes;
    int nthreads;
    int index;
    uint64_t sum;
} read_job_t;

static void *read_worker(void *arg) {
    read_job_t *job = arg;
    const int64_t words = job->nbytes / 8;
    const int64_t per = (words + job->nthreads - 1) / job->nthreads;
    const int64_t lo = per * job->index, hi = lo + per < words ? lo + per : words;
    uint64_t x = 0;
    for (int64_t i = lo; i < hi; i++) {
        uint64_t w;
        memcpy(&w, job->p + 8 * i, 8);
        x ^= w;
    }
    if (job->index == 0)
        for (int64_t i = 8 * words; i < job->nbytes; i++) x ^= job->p[i];
    job->sum = x;
    return NULL;
}

uint64_t gqa_read_bytes(const void *p, int64_t nbytes, int nthreads) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    read_job_t jobs[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    for (int i = 0; i < nthreads; i++)
        jobs[i] = (read_job_t){.p = p, .nbytes = nbytes, .nthreads = nthreads, .index = i};
    int started = 1;
    for (; started < nthreads; started++)
        if (pthread_create(&tids[started], NULL, read_worker, &jobs[started])) break;
    read_worker(&jobs[0]);
    uint64_t x = jobs[0].sum;
    for (int i = 1; i < started; i++) {
        pthread_join(tids[i], NULL);
        x ^= jobs[i].sum;
    }
    for (int i = started; i < nthreads; i++) { /* threads that could not start: read here */
        read_worker(&jobs[i]);
        x ^= jobs[i].sum;
    }
    return x;
}
