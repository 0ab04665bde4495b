/*
 * The layout the library was built with, for backends/native.py to compare with its mirror
 * before it calls anything (a library and a Python module out of step are refused, not trusted).
 */
#include "gqa_internal.h"

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
        MAX_RUNS, SPLIT_T, ISA_AUTO, ISA_PORTABLE, ISA_AVX2, ISA_AVX512, ISA_AVX512_DOT, ENC_F32, ENC_BF16, ENC_F16, ENC_INT8, FLAG_HALF_SCALES,
        FLAG_FAIL_AFTER_WRITE, FLAG_ROTATE, FLAG_RECIPROCAL, FLAG_ISA_SHIFT, POLICY_NONE, POLICY_STRICT,
        POLICY_GREEDY, POLICY_SINK, R_T, R_RESIDENT, R_FIRST, R_LAST, R_EVICTED, R_REACH, R_ATTENDED, R_WRITE_ROW, R_COLS};
    const int64_t count = (int64_t)(sizeof v / sizeof v[0]);
    for (int64_t i = 0; i < n && i < count; i++) out[i] = v[i];
    return count;
}
