/*
 * A probe, not a target: how fast one core reads a cold buffer under the request patterns a
 * long step can use (tests/bench/stream_probe.py builds and runs it; docs/design.md, "What one
 * core's memory gives a long step").
 *
 * Each thread (pinned to core i) owns `mib` MiB laid out as a cache head is: a key region and
 * a value region, each a run of blocks of 64 rows of 256 bytes (a bfloat16 block of 64
 * positions x 128 channels). Before every timed pass the threads write an eviction buffer
 * together; then they read their regions at once, each under one pattern, and report GB/s.
 *
 *     read       every line once, in order, no software prefetch
 *     read+pf    the same, each load preceded by a prefetch (T1) of the line one block ahead
 *     kernel     the long blocks' order: a block's key rows, each with a prefetch (T1) of the
 *                next block's row; its value rows twice (the two passes of the value sum), the
 *                first pass with a prefetch (T1) of the next block's row
 *     kernel+near  the same loads, each row's prefetch 2 KiB ahead of it (T0) instead of a block
 *
 * Loads feed an XOR, so the arithmetic is negligible: the figures are the memory's, for the
 * pattern alone. A line is one AVX-512 load where the build has AVX-512 (-march=native on such a
 * CPU), else two AVX2 loads (the loads the AVX2 blocks make).
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#if defined(__AVX512F__)
typedef __m512i line_t;
#define LINE_ZERO() _mm512_setzero_si512()
#define LINE_XOR(a, p) _mm512_xor_si512((a), _mm512_load_si512(p))
#define LINE_SUM(a) _mm512_reduce_add_epi32(a)
#elif defined(__AVX2__)
typedef __m256i line_t;
#define LINE_ZERO() _mm256_setzero_si256()
#define LINE_XOR(a, p) \
    _mm256_xor_si256(_mm256_xor_si256((a), _mm256_load_si256((const __m256i *)(p))), \
                     _mm256_load_si256((const __m256i *)(p) + 1))
#define LINE_SUM(a) (_mm256_extract_epi32((a), 0) + _mm256_extract_epi32((a), 7))
#else
#error "stream_probe reads with AVX-512 or AVX2 loads: built with -march=native on a CPU with neither"
#endif

#define ROW 256
#define BLOCK_ROWS 64
#define BLOCK (ROW * BLOCK_ROWS)
#define NEAR 2048

enum { READ, READ_PF, KERNEL, KERNEL_NEAR, PATTERNS };
static const char *NAMES[PATTERNS] = {"read", "read+pf", "kernel", "kernel+near"};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void *huge_buffer(size_t n) {
    void *p = aligned_alloc(2 << 20, n);
    if (!p) return NULL;
    madvise(p, n, MADV_HUGEPAGE);
    memset(p, 1, n);
    return p;
}

/* One pass of `pattern` over the key region k and the value region v, nblk blocks each. */
static int read_pass(const char *k, const char *v, size_t nblk, int pattern) {
    line_t a = LINE_ZERO();
    const char *kend = k + nblk * BLOCK, *vend = v + nblk * BLOCK;
    if (pattern == READ || pattern == READ_PF) {
        for (const char *r = k; r < vend; r = r + 64 == kend ? v : r + 64) {
            if (pattern == READ_PF && r + BLOCK < (r < kend ? kend : vend)) _mm_prefetch(r + BLOCK, _MM_HINT_T1);
            a = LINE_XOR(a, r);
        }
        return LINE_SUM(a);
    }
    const int near = pattern == KERNEL_NEAR;
    for (size_t b = 0; b < nblk; b++) {
        const char *kb = k + b * BLOCK, *vb = v + b * BLOCK;
        const int more = b + 1 < nblk;
        for (int l = 0; l < BLOCK_ROWS; l++) {
            const char *row = kb + l * ROW;
            if (near && row + NEAR < kend)
                for (int x = 0; x < ROW; x += 64) _mm_prefetch(row + NEAR + x, _MM_HINT_T0);
            if (!near && more)
                for (int x = 0; x < ROW; x += 64) _mm_prefetch(row + BLOCK + x, _MM_HINT_T1);
            for (int x = 0; x < ROW; x += 64) a = LINE_XOR(a, row + x);
        }
        for (int pass = 0; pass < 2; pass++)
            for (int t = 0; t < BLOCK_ROWS; t++) {
                const char *row = vb + t * ROW;
                if (pass == 0 && near && row + NEAR < vend)
                    for (int x = 0; x < ROW; x += 64) _mm_prefetch(row + NEAR + x, _MM_HINT_T0);
                if (pass == 0 && !near && more)
                    for (int x = 0; x < ROW; x += 64) _mm_prefetch(row + BLOCK + x, _MM_HINT_T1);
                for (int x = 0; x < ROW; x += 64) a = LINE_XOR(a, row + x);
            }
    }
    return LINE_SUM(a);
}

typedef struct {
    int core, pattern;
    char *region, *evict;
    size_t bytes, evict_bytes;
    pthread_barrier_t *barrier;
    double seconds;
    int sink;
} worker_t;

static void *worker(void *arg) {
    worker_t *w = arg;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(w->core, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    for (size_t i = 0; i < w->evict_bytes; i += 64) w->evict[i]++; /* plain stores: the caches' lines replaced */
    pthread_barrier_wait(w->barrier);
    const double t0 = now();
    w->sink = read_pass(w->region, w->region + w->bytes / 2, w->bytes / 2 / BLOCK, w->pattern);
    w->seconds = now() - t0;
    return NULL;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s THREADS MIB_PER_THREAD EVICT_MIB REPEATS\n", argv[0]);
        return 2;
    }
    const int threads = atoi(argv[1]), reps = atoi(argv[4]);
    const size_t bytes = (size_t)atoi(argv[2]) << 20, evict_bytes = ((size_t)atoi(argv[3]) << 20) / (size_t)threads;
    if (threads < 1 || threads > 256 || bytes < 2 * BLOCK || reps < 1) {
        fprintf(stderr, "stream_probe: bad arguments\n");
        return 2;
    }
    worker_t w[256];
    pthread_t tid[256];
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, (unsigned)threads);
    for (int i = 0; i < threads; i++) {
        w[i] = (worker_t){.core = i, .bytes = bytes, .evict_bytes = evict_bytes, .barrier = &barrier};
        w[i].region = huge_buffer(bytes);
        w[i].evict = huge_buffer(evict_bytes ? evict_bytes : 64);
        if (!w[i].region || !w[i].evict) {
            fprintf(stderr, "stream_probe: out of memory\n");
            return 1;
        }
    }
    double *rate = malloc(sizeof(double) * (size_t)reps * (size_t)threads);
    for (int p = 0; p < PATTERNS; p++) {
        for (int r = 0; r < reps; r++) {
            for (int i = 0; i < threads; i++) {
                w[i].pattern = p;
                pthread_create(&tid[i], NULL, worker, &w[i]);
            }
            for (int i = 0; i < threads; i++) {
                pthread_join(tid[i], NULL);
                rate[r * threads + i] = (double)bytes / w[i].seconds / 1e9;
            }
        }
        qsort(rate, (size_t)reps * (size_t)threads, sizeof *rate, cmp_double);
        printf("%-12s %6.1f GB/s per core (min %.1f, max %.1f; %d cores at once, %d passes)\n", NAMES[p],
               rate[(size_t)reps * (size_t)threads / 2], rate[0], rate[(size_t)reps * (size_t)threads - 1], threads, reps);
        fflush(stdout);
    }
    free(rate);
    return 0;
}
