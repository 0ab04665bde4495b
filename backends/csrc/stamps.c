/*
 * Time stamps of a step's parts, compiled into a stamps build alone (-DGQA_STAMPS:
 * native_build.py's GQA_KERNEL_STAMPS=1, for tests/bench/stamp_profile.py): the entry and return
 * of gqa_step, the row writes before the items and the items' pool call (run.c), each work
 * item's start and end and each block's start (attend.c), with the thread and the item. The
 * production library has none of it (the STAMP macro is empty there).
 */
#include "gqa_internal.h"

#ifdef GQA_STAMPS
#define STAMPS_MAX (1 << 20)
static gqa_stamp_t buf[STAMPS_MAX];
static atomic_llong used;
__thread int32_t gqa_stamp_item = -1;

GQA_INTERNAL void stamp_at(int tid, int32_t block, int32_t kind) {
    const long long at = atomic_fetch_add(&used, 1);
    if (at >= STAMPS_MAX) return; /* full: later stamps are dropped, gqa_stamps says how many */
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    buf[at] = (gqa_stamp_t){(int64_t)t.tv_sec * 1000000000LL + t.tv_nsec, tid, gqa_stamp_item, block, kind};
}

/* The stamps since the last reset (*out: the first), and how many were made (more than
 * STAMPS_MAX: the rest dropped). */
long long gqa_stamps(const gqa_stamp_t **out) {
    *out = buf;
    return atomic_load(&used);
}

void gqa_stamps_reset(void) { atomic_store(&used, 0); }
#else
typedef int gqa_no_stamps; /* ISO C wants a translation unit to declare something */
#endif
