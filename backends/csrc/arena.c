/*
 * Per-thread memory of a call: the calling thread's arenas, grown as needed and kept for its
 * next call (a call of 64 short caches would otherwise spend a visible part of its time in
 * malloc and in page faults of fresh scratch). Freed when the thread exits; an arena grown
 * past ARENA_KEEP bytes by one large call is released after it.
 */
#include "gqa_internal.h"

#define ARENA_KEEP ((size_t)32 << 20)
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
GQA_INTERNAL void *arena_get(int which, size_t bytes) {
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

GQA_INTERNAL void arena_trim(int which) {
    if (arenas && arenas->n[which] > ARENA_KEEP) {
        free(arenas->p[which]);
        arenas->p[which] = NULL;
        arenas->n[which] = 0;
    }
}

/* Carves n bytes, 64-byte aligned, off *at. */
GQA_INTERNAL void *carve(char **at, size_t n) {
    void *p = *at;
    *at += (n + 63) & ~(size_t)63;
    return p;
}
