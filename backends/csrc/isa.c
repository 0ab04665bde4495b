/*
 * Which implementations this CPU runs (detected once), and the block function a cache gets.
 */
#include "gqa_internal.h"

int gqa_avx512_usable(void) {
#if GQA_X86_64
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

/* Whether the CPU has AVX2, FMA and F16C (the AVX2 blocks' instructions). */
static int gqa_avx2_usable(void) {
#if GQA_X86_64
    static atomic_int known = -1;
    int v = atomic_load(&known);
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        atomic_store(&known, v);
    }
    return v;
#else
    return 0;
#endif
}

/* Whether the CPU has AVX-512 BF16 and VNNI (every CPU with the first has the second) besides
 * gqa_avx512_usable's. */
static int gqa_avx512_dot_usable(void) {
#if GQA_X86_64
    static atomic_int known = -1;
    int v = atomic_load(&known);
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni");
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
    if (gqa_avx2_usable() && d % 8 == 0) m |= 1 << ISA_AVX2;
    if (gqa_avx512_usable() && d % 16 == 0) {
        m |= 1 << ISA_AVX512;
        if (gqa_avx512_dot_usable()) m |= 1 << ISA_AVX512_DOT;
    }
    return m;
}

GQA_INTERNAL block_fn choose_block(int enc, int isa) {
#if GQA_X86_64
    if (isa == ISA_AVX512_DOT && enc == ENC_BF16 && BF16_PACK == 2) return block_dot_bf16;
    if (isa == ISA_AVX512_DOT && enc == ENC_INT8) return block_dot_int8;
    if (isa == ISA_AVX512 || isa == ISA_AVX512_DOT) {
        switch (enc) {
            case ENC_F32: return block_avx512_f32;
            case ENC_BF16: return block_avx512_bf16;
            case ENC_F16: return block_avx512_f16;
            default: return block_avx512_int8;
        }
    }
    if (isa == ISA_AVX2) {
        switch (enc) {
            case ENC_F32: return block_avx2_f32;
            case ENC_BF16: return block_avx2_bf16;
            case ENC_F16: return block_avx2_f16;
            default: return block_avx2_int8;
        }
    }
#endif
    (void)enc;
    (void)isa;
    return block_portable;
}
