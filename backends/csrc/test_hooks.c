/*
 * Test-only hooks, compiled into a test build alone (-DGQA_TEST_HOOKS: native_build.py's
 * GQA_KERNEL_TEST_HOOKS=1 and the sanitizer build): the production library has none of this
 * and ignores FLAG_FAIL_AFTER_WRITE.
 */
#include "gqa_internal.h"

#ifdef GQA_TEST_HOOKS
/* Whether this library has the hooks (native.py's Kernel.test_hooks; absent from production). */
int gqa_test_hooks(void) { return 1; }

/* A cache flagged FLAG_FAIL_AFTER_WRITE: its step's write done, then restored, then -EIO, as a
 * failure after the write would leave it (the cache byte-identical, the output not stored).
 * Returns whether the cache was flagged (then nothing else is done for it). */
GQA_INTERNAL int injected_failure(gqa_cache_t *cc, float *wbuf) {
    if (!(cc->flags & FLAG_FAIL_AFTER_WRITE)) return 0;
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
    return 1;
}
#else
typedef int gqa_no_test_hooks; /* ISO C wants a translation unit to declare something */
#endif
