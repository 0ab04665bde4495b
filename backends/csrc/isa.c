/*
 * Which implementations this CPU runs (detected once), and the block function a cache gets.
 */
#include "gqa_internal.h"
#if GQA_X86_64
#include <cpuid.h>

/* Whether this is AMD's family 19h with AVX-512 (Zen 4), by CPUID: vendor and family. */
static int amd_zen4(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    const int amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u; /* "AuthenticAMD" */
    if (!amd || !__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const unsigned base = (a >> 8) & 0xf, family = base == 0xf ? base + ((a >> 20) & 0xff) : base;
    return family == 0x19;
}
#endif

/* The vector ISAs this CPU has (a bit per ISA_* value, whatever the head width), probed once;
 * CPU_BF16 besides where ISA_AVX512_DOT also has AVX-512 BF16, and CPU_BF16_FAST where its
 * vdpbf16ps is the faster way to a bfloat16 block (gqa_auto_isa). */
enum { CPU_BF16 = 1 << 8, CPU_BF16_FAST = 1 << 9 };

#if GQA_X86_64 && defined(GQA_EMULATE_AVX512)
/* The test build's AVX-512 paths run on AVX2 (gqa_emu512.h): each AVX-512 feature counts as
 * present wherever AVX2 is, and the rules below choose among them as on a CPU that has them. */
#define AVX512_SUPPORTS(feature) \
    (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
#else
#define AVX512_SUPPORTS(feature) __builtin_cpu_supports(feature)
#endif

static int cpu_isas(void) {
#if GQA_X86_64
    static atomic_int known = -1;
    int v = atomic_load(&known);
    if (v < 0) {
        __builtin_cpu_init();
        v = 0;
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
            v |= 1 << ISA_AVX2;
        if (AVX512_SUPPORTS("avx512f") && AVX512_SUPPORTS("avx512bw") && AVX512_SUPPORTS("avx512vl") &&
            AVX512_SUPPORTS("avx512dq")) {
            v |= 1 << ISA_AVX512;
            /* the dot products: VNNI (Ice Lake on) for int8; BF16 too (Cooper Lake, Sapphire Rapids,
             * Zen 4 on) for bfloat16. Every CPU with BF16 has VNNI. */
            if (AVX512_SUPPORTS("avx512vnni")) {
                v |= 1 << ISA_AVX512_DOT;
                if (AVX512_SUPPORTS("avx512bf16")) v |= CPU_BF16;
                if ((v & CPU_BF16) && amd_zen4()) v |= CPU_BF16_FAST;
            }
        }
        atomic_store(&known, v);
    }
    return v;
#else
    return 0;
#endif
}

int gqa_avx512_usable(void) { return (cpu_isas() >> ISA_AVX512) & 1; }
int gqa_avx2_usable(void) { return (cpu_isas() >> ISA_AVX2) & 1; }

/* The implementations that can run here for head width d (a bit per ISA_* value). */
int gqa_usable_isas(int64_t d) {
    const int cpu = cpu_isas();
    int m = 1 << ISA_PORTABLE;
    if (d % 8 == 0) m |= cpu & (1 << ISA_AVX2);
    if (d % 16 == 0) m |= cpu & (1 << ISA_AVX512 | 1 << ISA_AVX512_DOT);
    return m;
}

/* The implementation ISA_AUTO takes for a cache of storage `enc` at head width d: the fastest
 * usable (the highest bit), except a bfloat16 cache's. vdpbf16ps is taken where it was measured
 * the faster way to a bfloat16 block: on AMD's Zen 4 (family 19h), where every 512-bit operation
 * issues at the same rate, it halves the scores' instructions and the value sum's two-piece
 * products pay too (S=2048 hot 0.31 against 0.39 ms; value sum 0.90). On Intel's Xeons with AMX,
 * which issue two 512-bit FMAs a cycle but one vdpbf16ps, the widening block is faster (hot
 * 0.71x, cold 0.88-0.89x at S=2048 and 8192; docs/design.md, "bfloat16's block by CPU"), and on
 * any CPU not measured it is the one never seen to lose by much. An explicit ISA_AVX512_DOT still
 * takes vdpbf16ps (the tests do). */
int gqa_auto_isa(int64_t d, int enc) {
    const int usable = gqa_usable_isas(d);
    int isa = ISA_AVX512_DOT;
    while (!(usable & (1 << isa))) isa--;
    if (isa == ISA_AVX512_DOT && enc == ENC_BF16 && !(cpu_isas() & CPU_BF16_FAST)) isa = ISA_AVX512;
    return isa;
}

GQA_INTERNAL block_fn choose_block(int enc, int isa) {
#if GQA_X86_64
    if (isa == ISA_AVX512_DOT && enc == ENC_BF16 && BF16_PACK == 2 && (cpu_isas() & CPU_BF16)) return block_dot_bf16;
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
            default: return block_avx2_dot_int8;
        }
    }
#endif
    (void)enc;
    (void)isa;
    return block_portable;
}
