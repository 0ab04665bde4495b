/*
 * A probe, not a target: the real blocks of one ISA (block_avx2.c and block_avx2_int8.c, or those
 * and block_avx512.c and block_avx512_int8.c, built twice: side A from the working tree, side B
 * from another revision, its symbols renamed B_*)
 * run over long heads, cold and hot, the two sides alternated round by round in one process
 * (tests/bench/block_probe.py builds and runs it; docs/design.md, "A block probe").
 *
 * Each thread (pinned to the i-th allowed CPU) reads `heads` KV heads of C positions, laid out as
 * the cache lays them out (backends/csrc/gqa_internal.h's key_block: key blocks of 64 positions,
 * values (heads, C, 128); int8 as backends/int8.py's: 124 coded key channels, 4 float16 outlier
 * channel rows (heads, 4, C), float16 key and value scales (heads, C)), block after block for G = 4
 * query heads, each block asking for the
 * next as the step does (state_t.prefetch); a head's last block asks for nothing. Before every
 * cold pass one buffer of `evict_mib` MiB is written. The hot figure: 16 passes over one head's
 * first 8 blocks (in L2) on one thread.
 *
 * Both sides get the same descriptor: the revisions compared must share gqa_cache_t and state_t
 * (the driver checks). Pairing the sides round by round is what makes a few percent visible on a
 * VM whose memory speed moves by tens of percent from minute to minute: the figure to read is the
 * median of the rounds' ratios, not the ratio of the medians.
 *
 *     block_probe ENC ISA C HEADS THREADS ROUNDS EVICT_MIB
 *     ENC: 0 float32, 1 bfloat16, 2 float16, 3 int8; ISA: 2 AVX2, 3 AVX-512
 *
 * int8 runs the block the library takes on that ISA: block_avx2_dot_int8 on AVX2; on AVX-512
 * block_dot_int8 where the CPU has VNNI, else block_avx512_int8.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <sys/mman.h>

#include "gqa_internal.h"

typedef void (*block_t)(const gqa_cache_t *, const float *, int64_t, int64_t, int64_t, state_t *);
#define SIDE(name)                                                                        \
    __attribute__((weak)) void name(const gqa_cache_t *, const float *, int64_t, int64_t, \
                                    int64_t, state_t *)
SIDE(block_avx2_f32);
SIDE(block_avx2_bf16);
SIDE(block_avx2_f16);
SIDE(block_avx512_f32);
SIDE(block_avx512_bf16);
SIDE(block_avx512_f16);
SIDE(block_avx2_dot_int8);
SIDE(block_avx512_int8);
SIDE(block_dot_int8);
SIDE(B_block_avx2_f32);
SIDE(B_block_avx2_bf16);
SIDE(B_block_avx2_f16);
SIDE(B_block_avx512_f32);
SIDE(B_block_avx512_bf16);
SIDE(B_block_avx512_f16);
SIDE(B_block_avx2_dot_int8);
SIDE(B_block_avx512_int8);
SIDE(B_block_dot_int8);

#define G 4
#define D 128
#define OUTLIERS 4 /* int8: float16 key channels (backends/int8_calibration.py's count at D = 128) */
#define MAX_ROUNDS 256

static gqa_cache_t cache;
static int64_t C, HEADS;
static int cpus[2];
static _Alignas(64) float query[2][G * D];

typedef struct {
    int tid, hot;
    block_t block;
    double sec;
    float sink;
} job_t;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* One thread's heads, block by block, with a state as attend.c's one-split head has it. */
static void *run(void *arg) {
    job_t *job = arg;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpus[job->tid], &one);
    pthread_setaffinity_np(pthread_self(), sizeof one, &one);
    static _Alignas(64) float scratch[2][4096];
    float *m = scratch[job->tid];
    state_t st = {.m = m, .l = m + G, .acc = m + 64, .p = m + 64 + G * D, .smul = 1.0f};
    st.ksb = st.p + TILE_G * TILE_T;
    st.vsb = st.ksb + TILE_T;
    st.q = st.vsb + TILE_T;
    st.qb = (uint16_t *)(st.q + G * D);
    const double t0 = now();
    const int64_t heads = job->hot ? 1 : HEADS, length = job->hot ? 8 * TILE_T : C, passes = job->hot ? 16 : 1;
    for (int64_t x = 0; x < heads; x++) {
        const int64_t h = job->tid * HEADS + x;
        for (int64_t pass = 0; pass < passes; pass++) {
            for (int g = 0; g < G; g++) {
                st.m[g] = -INFINITY;
                st.l[g] = 0.0f;
            }
            memset(st.acc, 0, sizeof(float) * G * D);
            st.qready = 0; /* int8: the query quantized on the item's first block */
            for (int64_t at = 0; at < length; at += TILE_T) {
                st.prefetch = at + TILE_T < length;
                job->block(&cache, query[job->tid], h, at, TILE_T, &st);
            }
        }
    }
    job->sec = now() - t0;
    job->sink = st.l[0] + st.acc[D / 2];
    return NULL;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, by_value);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Seconds of one cold pass over every thread's heads (the slowest thread's). */
static double cold_pass(block_t block, int threads, char *evict, size_t evict_bytes) {
    for (size_t i = 0; i < evict_bytes; i += 64) evict[i]++;
    job_t jobs[2];
    pthread_t ids[2];
    double slowest = 0;
    for (int t = 0; t < threads; t++) {
        jobs[t] = (job_t){.tid = t, .block = block};
        pthread_create(&ids[t], NULL, run, &jobs[t]);
    }
    for (int t = 0; t < threads; t++) {
        pthread_join(ids[t], NULL);
        if (jobs[t].sec > slowest) slowest = jobs[t].sec;
    }
    return slowest;
}

static double hot_pass(block_t block) {
    job_t job = {.tid = 0, .hot = 1, .block = block};
    run(&job);
    return job.sec;
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: block_probe ENC ISA C HEADS THREADS ROUNDS EVICT_MIB\n");
        return 2;
    }
    const int enc = atoi(argv[1]), isa = atoi(argv[2]), threads = atoi(argv[5]), rounds = atoi(argv[6]);
    C = atoll(argv[3]);
    HEADS = atoll(argv[4]);
    const size_t evict_bytes = (size_t)atoll(argv[7]) << 20;
    if (enc < ENC_F32 || enc > ENC_INT8 || (isa != ISA_AVX2 && isa != ISA_AVX512) || C < TILE_T || C % TILE_T ||
        HEADS < 1 || threads < 1 || threads > 2 || rounds < 1 || rounds > MAX_ROUNDS) {
        fprintf(stderr, "block_probe: bad arguments\n");
        return 2;
    }
    const int vnni = isa == ISA_AVX512 && __builtin_cpu_supports("avx512vnni");
    const block_t a_blocks[2][4] = {{block_avx2_f32, block_avx2_bf16, block_avx2_f16, block_avx2_dot_int8},
                                    {block_avx512_f32, block_avx512_bf16, block_avx512_f16,
                                     vnni ? block_dot_int8 : block_avx512_int8}};
    const block_t b_blocks[2][4] = {{B_block_avx2_f32, B_block_avx2_bf16, B_block_avx2_f16, B_block_avx2_dot_int8},
                                    {B_block_avx512_f32, B_block_avx512_bf16, B_block_avx512_f16,
                                     vnni ? B_block_dot_int8 : B_block_avx512_int8}};
    const block_t side[2] = {a_blocks[isa == ISA_AVX512][enc], b_blocks[isa == ISA_AVX512][enc]};
    if (!side[0] || !side[1]) {
        fprintf(stderr, "block_probe: this build has no block for that ISA\n");
        return 2;
    }
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof allowed, &allowed)) CPU_ZERO(&allowed);
    for (int c = 0, t = 0; c < CPU_SETSIZE && t < 2; c++)
        if (CPU_ISSET(c, &allowed)) cpus[t++] = c;
    if (CPU_COUNT(&allowed) < threads) {
        fprintf(stderr, "block_probe: fewer CPUs than threads\n");
        return 2;
    }

    /* the cache: threads x HEADS KV heads, keys then values (int8: then the outlier channels and
     * the scales), on 2 MiB pages as host_memory's */
    const int int8 = enc == ENC_INT8, no = int8 ? OUTLIERS : 0, dk = D - no;
    const int64_t el = enc_size(enc), heads = threads * HEADS, half = heads * C * D * el;
    const int64_t side_row = int8 ? 2 * no + 2 * 2 : 0;                  /* float16 outliers, key and value scales */
    const int64_t side_bytes = heads * C * side_row, row_bytes = (dk + D) * el + side_row; /* a head's position */
    const size_t bytes = (size_t)(2 * half + side_bytes), huge = (size_t)2 << 20;
    char *raw = mmap(NULL, bytes + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *evict = malloc(evict_bytes ? evict_bytes : 1);
    if (raw == MAP_FAILED || !evict) {
        fprintf(stderr, "block_probe: out of memory\n");
        return 1;
    }
    char *base = (char *)(((uintptr_t)raw + huge - 1) & ~(uintptr_t)(huge - 1));
    madvise(base, bytes, MADV_HUGEPAGE);
    uint32_t x = 12345;
    for (size_t i = 0; i < (size_t)(2 * half / el); i++) { /* values in [-1, 1) (int8: codes in [-127, 127]) */
        x = x * 1664525u + 1013904223u;
        const float f = (float)(x >> 8) / (float)(1 << 24) * 2.0f - 1.0f;
        if (int8) base[i] = (char)(int)(127.0f * f);
        else store_elem(enc, base, (int64_t)i, f);
    }
    uint16_t *side16 = (uint16_t *)(base + 2 * half); /* int8: outliers (heads, no, C), then ks, then vs */
    for (int64_t i = 0; i < side_bytes / 2; i++) {
        x = x * 1664525u + 1013904223u;
        const float f = (float)(x >> 8) / (float)(1 << 24); /* outliers in [-2, 2), scales in [0.005, 0.01) */
        store_elem(ENC_F16, side16, i, i < heads * no * C ? 4.0f * f - 2.0f : 0.005f + 0.005f * f);
    }
    memset(evict, 0, evict_bytes);
    cache = (gqa_cache_t){.enc = enc, .io = int8 ? ENC_F32 : enc, .nruns = 1, .n = heads, .g = G, .d = D, .c = C,
                          .kstride = C * dk, .dk = dk, .no = no, .k = base, .v = base + half};
    if (int8) {
        cache.flags = FLAG_HALF_SCALES;
        cache.scale_stride = C;
        cache.ko = side16;
        cache.ks = side16 + heads * no * C;
        cache.vs = side16 + heads * (no + 1) * C;
    }
    cache.runs[0] = 0;
    cache.runs[1] = C;
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < G * D; i++) query[t][i] = 0.01f * (float)(i % 37) - 0.15f;

    double cold[2][MAX_ROUNDS], hot[2][MAX_ROUNDS], cold_ratio[MAX_ROUNDS], hot_ratio[MAX_ROUNDS];
    for (int r = -1; r < rounds; r++) { /* round -1: a warm-up, not kept */
        double c2[2], h2[2];
        for (int k = 0; k < 2; k++) {
            const int s = (r + k + 2) % 2; /* which side goes first alternates */
            c2[s] = cold_pass(side[s], threads, evict, evict_bytes);
            h2[s] = hot_pass(side[s]);
        }
        if (r < 0) continue;
        for (int s = 0; s < 2; s++) {
            cold[s][r] = c2[s];
            hot[s][r] = h2[s];
        }
        cold_ratio[r] = c2[1] / c2[0];
        hot_ratio[r] = h2[1] / h2[0];
    }
    const double lines_hot = 16.0 * 8 * TILE_T * row_bytes / 64;
    for (int s = 0; s < 2; s++)
        printf("%s: cold %.1f GB/s, hot %.2f ns a line\n", s ? "B" : "A",
               (double)(heads * C * row_bytes) / median(cold[s], rounds) / 1e9, median(hot[s], rounds) / lines_hot * 1e9);
    printf("B/A time, the median of %d paired rounds: cold %.3f, hot %.3f\n", rounds, median(cold_ratio, rounds),
           median(hot_ratio, rounds));
    munmap(raw, bytes + huge);
    free(evict);
    return 0;
}
