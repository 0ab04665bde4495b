/*
 * The AVX-512 intrinsics the kernel uses, in portable C over GCC's vector types, for a test
 * build that runs the AVX-512 blocks on a CPU without AVX-512 (GQA_EMULATE_AVX512: the
 * `GQA_KERNEL_EMULATE_AVX512=1` library, tests/test_avx512_emulated.py). Never in the
 * production library: it only lets the tests check the AVX-512 paths' logic (layouts, masks,
 * block boundaries, lane orders) on machines that cannot run them, as CI's can not.
 *
 * gqa_avx512.h includes it after <immintrin.h>: the types (__m512, __m512i, __mmask16, ...)
 * stay GCC's, and each intrinsic name below is redefined to a function of the same meaning
 * lane by lane, as the Intel SDM states it:
 * - arithmetic is float32's own (a lane's fmadd is fmaf: one rounding, as vfmadd);
 * - conversions round to nearest even (the MXCSR default), float16's by F16C itself;
 * - the bfloat16 dot product (vdpbf16ps) adds its odd then its even product into each lane,
 *   its inputs' and result's subnormals taken as zero (DAZ and FTZ, as the instruction does);
 * - the reductions take GCC's order (halves, then quarters, then pairs);
 * - masked loads read only the lanes they load, as the instructions do not fault past them.
 * What it cannot check is speed: its code is nothing like the instructions' own.
 */
#ifndef GQA_EMU512_H
#define GQA_EMU512_H

#include <immintrin.h>
#include <math.h>
#include <string.h>

#define EMU static __attribute__((noinline, unused, target("avx2,fma,f16c")))

typedef float emu_f16x __attribute__((vector_size(64)));
typedef int emu_i16x __attribute__((vector_size(64)));
typedef short emu_h32x __attribute__((vector_size(64)));
typedef long long emu_q8x __attribute__((vector_size(64)));
typedef signed char emu_b64x __attribute__((vector_size(64)));

#define F(x) ((emu_f16x)(x))
#define I(x) ((emu_i16x)(x))
#define H(x) ((emu_h32x)(x))

/* -- set, load, store, casts ------------------------------------------------------------- */
EMU __m512 emu_set1_ps(float a) { return (__m512)((emu_f16x){0} + a); }
EMU __m512i emu_set1_epi32(int a) { return (__m512i)((emu_i16x){0} + a); }
EMU __m512 emu_setzero_ps(void) { return (__m512)(emu_f16x){0}; }
EMU __m512i emu_setzero_si512(void) { return (__m512i)(emu_i16x){0}; }
#define emu_setr_epi32(...) ((__m512i)(emu_i16x){__VA_ARGS__})
EMU __m512i emu_set_epi16(short e31, short e30, short e29, short e28, short e27, short e26, short e25, short e24,
                          short e23, short e22, short e21, short e20, short e19, short e18, short e17, short e16,
                          short e15, short e14, short e13, short e12, short e11, short e10, short e9, short e8,
                          short e7, short e6, short e5, short e4, short e3, short e2, short e1, short e0) {
    return (__m512i)(emu_h32x){e0,  e1,  e2,  e3,  e4,  e5,  e6,  e7,  e8,  e9,  e10, e11, e12, e13, e14, e15,
                               e16, e17, e18, e19, e20, e21, e22, e23, e24, e25, e26, e27, e28, e29, e30, e31};
}
EMU __m512 emu_loadu_ps(const void *p) {
    emu_f16x v;
    memcpy(&v, p, 64);
    return (__m512)v;
}
EMU __m512i emu_loadu_si512(const void *p) {
    emu_i16x v;
    memcpy(&v, p, 64);
    return (__m512i)v;
}
EMU void emu_storeu_ps(void *p, __m512 a) { memcpy(p, &a, 64); }
EMU __m512 emu_castsi512_ps(__m512i a) { return (__m512)a; }
EMU __m512i emu_castps_si512(__m512 a) { return (__m512i)a; }
EMU __m256i emu_castsi512_si256(__m512i a) {
    __m256i r;
    memcpy(&r, &a, 32);
    return r;
}
EMU __m512i emu_castsi256_si512(__m256i a) { /* the upper half undefined: zero here */
    __m512i r = (__m512i)(emu_i16x){0};
    memcpy(&r, &a, 32);
    return r;
}
EMU __m512 emu_zextps256_ps512(__m256 a) {
    __m512 r = (__m512)(emu_f16x){0};
    memcpy(&r, &a, 32);
    return r;
}
EMU __m512i emu_inserti64x4(__m512i a, __m256i b, int imm) {
    memcpy((char *)&a + 32 * (imm & 1), &b, 32);
    return a;
}

/* The lanes a mask loads: memcpy of one element each, nothing past them read. */
#define EMU_MASKZ_LOAD(name, vec, ret, el, n)                                   \
    EMU ret name(unsigned long long k, const void *p) {                         \
        vec r = (vec){0};                                                       \
        for (int i = 0; i < (n); i++)                                           \
            if ((k >> i) & 1) memcpy((char *)&r + i * (el), (const char *)p + i * (el), (el)); \
        return (ret)r;                                                          \
    }
typedef float emu_f8x __attribute__((vector_size(32)));
typedef int emu_i8x __attribute__((vector_size(32)));
typedef short emu_h16x __attribute__((vector_size(32)));
typedef signed char emu_b32x __attribute__((vector_size(32)));
typedef short emu_h8x __attribute__((vector_size(16)));
typedef signed char emu_b16x __attribute__((vector_size(16)));
EMU_MASKZ_LOAD(emu_maskz_loadu_ps, emu_f16x, __m512, 4, 16)
EMU_MASKZ_LOAD(emu_maskz_loadu_epi32, emu_i16x, __m512i, 4, 16)
EMU_MASKZ_LOAD(emu256_maskz_loadu_ps, emu_f8x, __m256, 4, 8)
EMU_MASKZ_LOAD(emu256_maskz_loadu_epi32, emu_i8x, __m256i, 4, 8)
EMU_MASKZ_LOAD(emu256_maskz_loadu_epi16, emu_h16x, __m256i, 2, 16)
EMU_MASKZ_LOAD(emu256_maskz_loadu_epi8, emu_b32x, __m256i, 1, 32)
EMU_MASKZ_LOAD(emu128_maskz_loadu_epi16, emu_h8x, __m128i, 2, 8)
EMU_MASKZ_LOAD(emu128_maskz_loadu_epi8, emu_b16x, __m128i, 1, 16)

EMU void emu_mask_storeu_ps(void *p, unsigned k, __m512 a) {
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) memcpy((char *)p + 4 * i, (char *)&a + 4 * i, 4);
}
EMU void emu256_mask_storeu_epi16(void *p, unsigned k, __m256i a) {
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) memcpy((char *)p + 2 * i, (char *)&a + 2 * i, 2);
}

/* -- float arithmetic -------------------------------------------------------------------- */
EMU __m512 emu_add_ps(__m512 a, __m512 b) { return (__m512)(F(a) + F(b)); }
EMU __m512 emu_sub_ps(__m512 a, __m512 b) { return (__m512)(F(a) - F(b)); }
EMU __m512 emu_mul_ps(__m512 a, __m512 b) { return (__m512)(F(a) * F(b)); }
EMU __m512 emu_fmadd_ps(__m512 a, __m512 b, __m512 c) {
    emu_f16x r;
    for (int i = 0; i < 16; i++) r[i] = fmaf(F(a)[i], F(b)[i], F(c)[i]);
    return (__m512)r;
}
EMU __m512 emu_max_ps(__m512 a, __m512 b) { /* maxps: a where a > b, else b (a NaN gives b) */
    emu_f16x r;
    for (int i = 0; i < 16; i++) r[i] = F(a)[i] > F(b)[i] ? F(a)[i] : F(b)[i];
    return (__m512)r;
}
EMU __m512 emu_abs_ps(__m512 a) { return (__m512)(I(a) & 0x7FFFFFFF); }
EMU __m512 emu_roundscale_ps(__m512 a, int imm) { /* to an integer, nearest even (imm 8) only */
    emu_f16x r;
    if ((imm & 0xF7) != 0) __builtin_trap(); /* another rounding or scale: not emulated yet */
    for (int i = 0; i < 16; i++) r[i] = nearbyintf(F(a)[i]);
    return (__m512)r;
}
EMU __m512 emu_scalef_ps(__m512 a, __m512 b) { /* a * 2^floor(b) */
    emu_f16x r;
    for (int i = 0; i < 16; i++) {
        const float x = F(a)[i], y = F(b)[i];
        if (isnan(x) || isnan(y)) r[i] = x + y;
        else if (y <= -512.0f) r[i] = x * 0.0f;
        else if (y >= 512.0f) r[i] = x * INFINITY;
        else r[i] = ldexpf(x, (int)floorf(y));
    }
    return (__m512)r;
}
EMU float emu_reduce_add_ps(__m512 a) { /* GCC's order: halves, quarters, then pairs */
    float t[8], u[4], w[4];
    for (int i = 0; i < 8; i++) t[i] = F(a)[8 + i] + F(a)[i];
    for (int i = 0; i < 4; i++) u[i] = t[4 + i] + t[i];
    for (int i = 0; i < 4; i++) w[i] = u[i] + u[(i + 2) % 4];
    return w[0] + w[1];
}
EMU float emu_maxf(float a, float b) { return a > b ? a : b; }
EMU float emu_reduce_max_ps(__m512 a) {
    float t[8], u[4], w[4];
    for (int i = 0; i < 8; i++) t[i] = emu_maxf(F(a)[8 + i], F(a)[i]);
    for (int i = 0; i < 4; i++) u[i] = emu_maxf(t[4 + i], t[i]);
    for (int i = 0; i < 4; i++) w[i] = emu_maxf(u[i], u[(i + 2) % 4]);
    return emu_maxf(w[0], w[1]);
}

/* -- masks and compares ------------------------------------------------------------------ */
EMU unsigned emu_cmp_ps_mask(__m512 a, __m512 b, int pred) {
    unsigned k = 0;
    for (int i = 0; i < 16; i++) {
        const float x = F(a)[i], y = F(b)[i];
        int t;
        switch (pred) {
            case _CMP_UNORD_Q: t = isnan(x) || isnan(y); break;
            case _CMP_NLE_UQ: t = !(x <= y); break;
            default: __builtin_trap(); /* a predicate this table does not know yet */
        }
        k |= (unsigned)t << i;
    }
    return k;
}
EMU unsigned emu_mask_cmp_ps_mask(unsigned m, __m512 a, __m512 b, int pred) { return m & emu_cmp_ps_mask(a, b, pred); }
EMU unsigned emu_cmpeq_epi32_mask(__m512i a, __m512i b) {
    unsigned k = 0;
    for (int i = 0; i < 16; i++) k |= (unsigned)(I(a)[i] == I(b)[i]) << i;
    return k;
}
EMU __m512 emu_mask_mov_ps(__m512 src, unsigned k, __m512 a) {
    emu_f16x r = F(src);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) r[i] = F(a)[i];
    return (__m512)r;
}
EMU __m512 emu_maskz_mov_ps(unsigned k, __m512 a) { return emu_mask_mov_ps(emu_setzero_ps(), k, a); }
EMU __m512 emu_mask_mul_ps(__m512 src, unsigned k, __m512 a, __m512 b) { return emu_mask_mov_ps(src, k, emu_mul_ps(a, b)); }
EMU __m512i emu_mask_or_epi32(__m512i src, unsigned k, __m512i a, __m512i b) {
    emu_i16x r = I(src);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) r[i] = I(a)[i] | I(b)[i];
    return (__m512i)r;
}
EMU __m256 emu256_mask_fmadd_ps(__m256 a, unsigned k, __m256 b, __m256 c) {
    emu_f8x r = (emu_f8x)a;
    for (int i = 0; i < 8; i++)
        if ((k >> i) & 1) r[i] = fmaf(((emu_f8x)a)[i], ((emu_f8x)b)[i], ((emu_f8x)c)[i]);
    return (__m256)r;
}
EMU __m256i emu256_mask_mov_epi16(__m256i src, unsigned k, __m256i a) {
    emu_h16x r = (emu_h16x)src;
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) r[i] = ((emu_h16x)a)[i];
    return (__m256i)r;
}

/* -- integers ---------------------------------------------------------------------------- */
EMU __m512i emu_add_epi32(__m512i a, __m512i b) { return (__m512i)(I(a) + I(b)); }
EMU __m512i emu_sub_epi32(__m512i a, __m512i b) { return (__m512i)(I(a) - I(b)); }
EMU __m512i emu_max_epi32(__m512i a, __m512i b) {
    emu_i16x r;
    for (int i = 0; i < 16; i++) r[i] = I(a)[i] > I(b)[i] ? I(a)[i] : I(b)[i];
    return (__m512i)r;
}
EMU __m512i emu_min_epi32(__m512i a, __m512i b) {
    emu_i16x r;
    for (int i = 0; i < 16; i++) r[i] = I(a)[i] < I(b)[i] ? I(a)[i] : I(b)[i];
    return (__m512i)r;
}
EMU __m512i emu_and_si512(__m512i a, __m512i b) { return (__m512i)(I(a) & I(b)); }
EMU __m512i emu_or_si512(__m512i a, __m512i b) { return (__m512i)(I(a) | I(b)); }
EMU __m512i emu_slli_epi32(__m512i a, unsigned n) {
    return n > 31 ? emu_setzero_si512() : (__m512i)((emu_i16x)((__v16su)I(a) << n));
}
EMU __m512i emu_srli_epi32(__m512i a, unsigned n) {
    return n > 31 ? emu_setzero_si512() : (__m512i)((emu_i16x)((__v16su)I(a) >> n));
}
EMU __m512i emu_unpacklo_epi16(__m512i a, __m512i b) { /* within each 128-bit lane: words 0-3 */
    emu_h32x r;
    for (int l = 0; l < 4; l++)
        for (int i = 0; i < 4; i++) {
            r[8 * l + 2 * i] = H(a)[8 * l + i];
            r[8 * l + 2 * i + 1] = H(b)[8 * l + i];
        }
    return (__m512i)r;
}
EMU __m512i emu_unpackhi_epi16(__m512i a, __m512i b) { /* within each 128-bit lane: words 4-7 */
    emu_h32x r;
    for (int l = 0; l < 4; l++)
        for (int i = 0; i < 4; i++) {
            r[8 * l + 2 * i] = H(a)[8 * l + 4 + i];
            r[8 * l + 2 * i + 1] = H(b)[8 * l + 4 + i];
        }
    return (__m512i)r;
}
EMU __m512i emu_dpwssd_epi32(__m512i acc, __m512i a, __m512i b) { /* vpdpwssd: wrapping sums */
    emu_i16x r;
    for (int i = 0; i < 16; i++) {
        const unsigned p0 = (unsigned)((int)H(a)[2 * i] * (int)H(b)[2 * i]);
        const unsigned p1 = (unsigned)((int)H(a)[2 * i + 1] * (int)H(b)[2 * i + 1]);
        r[i] = (int)((unsigned)I(acc)[i] + p0 + p1);
    }
    return (__m512i)r;
}

/* -- permutes ---------------------------------------------------------------------------- */
EMU __m512 emu_permutex2var_ps(__m512 a, __m512i idx, __m512 b) {
    emu_f16x r;
    for (int i = 0; i < 16; i++) {
        const int j = I(idx)[i] & 31;
        r[i] = j < 16 ? F(a)[j] : F(b)[j - 16];
    }
    return (__m512)r;
}
EMU __m512i emu_permutex2var_epi32(__m512i a, __m512i idx, __m512i b) {
    return (__m512i)emu_permutex2var_ps((__m512)a, idx, (__m512)b);
}
EMU __m512 emu_permutexvar_ps(__m512i idx, __m512 a) {
    emu_f16x r;
    for (int i = 0; i < 16; i++) r[i] = F(a)[I(idx)[i] & 15];
    return (__m512)r;
}
EMU __m512i emu_permutexvar_epi16(__m512i idx, __m512i a) {
    emu_h32x r;
    for (int i = 0; i < 32; i++) r[i] = H(a)[H(idx)[i] & 31];
    return (__m512i)r;
}

/* -- conversions ------------------------------------------------------------------------- */
EMU __m512 emu_cvtepi32_ps(__m512i a) {
    emu_f16x r;
    for (int i = 0; i < 16; i++) r[i] = (float)I(a)[i];
    return (__m512)r;
}
EMU __m512i emu_cvtps_epi32(__m512 a) { /* nearest even; out of range or NaN: INT_MIN (vcvtps2dq) */
    emu_i16x r;
    for (int i = 0; i < 16; i++) {
        const float x = nearbyintf(F(a)[i]);
        r[i] = x >= -2147483648.0f && x < 2147483648.0f ? (int)x : (int)0x80000000u;
    }
    return (__m512i)r;
}
EMU __m256i emu_cvtepi32_epi16(__m512i a) { /* vpmovdw: the low 16 bits */
    emu_h16x r;
    for (int i = 0; i < 16; i++) r[i] = (short)I(a)[i];
    return (__m256i)r;
}
EMU __m256i emu_cvtepi64_epi32(__m512i a) { /* vpmovqd: the low 32 bits */
    emu_i8x r;
    for (int i = 0; i < 8; i++) r[i] = (int)((emu_q8x)a)[i];
    return (__m256i)r;
}
EMU __m512i emu_cvtepi8_epi16(__m256i a) {
    emu_h32x r;
    for (int i = 0; i < 32; i++) r[i] = ((emu_b32x)a)[i];
    return (__m512i)r;
}
EMU __m512i emu_cvtepi8_epi32(__m128i a) {
    emu_i16x r;
    for (int i = 0; i < 16; i++) r[i] = ((emu_b16x)a)[i];
    return (__m512i)r;
}
EMU __m512i emu_cvtepu16_epi32(__m256i a) {
    emu_i16x r;
    for (int i = 0; i < 16; i++) r[i] = (unsigned short)((emu_h16x)a)[i];
    return (__m512i)r;
}
EMU __m512 emu_cvtph_ps(__m256i a) { /* F16C's own conversion, 8 lanes at a time */
    const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(a)), hi = _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1));
    __m512 r;
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
}
#define emu_cvtps_ph(a, imm)                                                                 \
    __extension__({                                                                          \
        __m512 a_ = (a);                                                                     \
        __m256 lo_, hi_;                                                                     \
        memcpy(&lo_, &a_, 32);                                                               \
        memcpy(&hi_, (char *)&a_ + 32, 32);                                                  \
        _mm256_setr_m128i(_mm256_cvtps_ph(lo_, (imm)), _mm256_cvtps_ph(hi_, (imm)));         \
    })
EMU __m256 emu256_maskz_cvtph_ps(unsigned k, __m128i a) {
    emu_f8x r = (emu_f8x)_mm256_cvtph_ps(a);
    for (int i = 0; i < 8; i++)
        if (!((k >> i) & 1)) r[i] = 0.0f;
    return (__m256)r;
}

/* bfloat16: vcvtneps2bf16 (nearest even, a NaN quieted, a subnormal to a signed zero) and
 * vdpbf16ps (two exact products a lane added in turn, subnormals as zero in and out). */
EMU unsigned short emu_to_bf16(float x) {
    unsigned u;
    memcpy(&u, &x, 4);
    if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) return (unsigned short)((u >> 16) | 0x40);
    if ((u & 0x7F800000u) == 0) return (unsigned short)((u >> 16) & 0x8000);
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}
EMU float emu_from_bf16(unsigned short h) {
    unsigned u = (unsigned)h << 16;
    if ((u & 0x7F800000u) == 0) u &= 0x80000000u;
    float x;
    memcpy(&x, &u, 4);
    return x;
}
EMU float emu_ftz(float x) {
    unsigned u;
    memcpy(&u, &x, 4);
    if ((u & 0x7F800000u) == 0) u &= 0x80000000u;
    memcpy(&x, &u, 4);
    return x;
}
EMU __m256bh emu_cvtneps_pbh(__m512 a) {
    emu_h16x r;
    for (int i = 0; i < 16; i++) r[i] = (short)emu_to_bf16(F(a)[i]);
    return (__m256bh)r;
}
EMU __m512 emu_dpbf16_ps(__m512 acc, __m512bh a, __m512bh b) {
    emu_f16x r;
    for (int i = 0; i < 16; i++) {
        float t = emu_ftz(F(acc)[i]);
        t = emu_ftz(t + emu_from_bf16((unsigned short)H(a)[2 * i + 1]) * emu_from_bf16((unsigned short)H(b)[2 * i + 1]));
        r[i] = emu_ftz(t + emu_from_bf16((unsigned short)H(a)[2 * i]) * emu_from_bf16((unsigned short)H(b)[2 * i]));
    }
    return (__m512)r;
}

#undef F
#undef I
#undef H

/* The intrinsics' names, from here on the functions above. */
#undef _mm512_set1_ps
#define _mm512_set1_ps emu_set1_ps
#undef _mm512_set1_epi32
#define _mm512_set1_epi32 emu_set1_epi32
#undef _mm512_setzero_ps
#define _mm512_setzero_ps emu_setzero_ps
#undef _mm512_setzero_si512
#define _mm512_setzero_si512 emu_setzero_si512
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 emu_setr_epi32
#undef _mm512_set_epi16
#define _mm512_set_epi16 emu_set_epi16
#undef _mm512_loadu_ps
#define _mm512_loadu_ps emu_loadu_ps
#undef _mm512_loadu_si512
#define _mm512_loadu_si512 emu_loadu_si512
#undef _mm512_storeu_ps
#define _mm512_storeu_ps emu_storeu_ps
#undef _mm512_castsi512_ps
#define _mm512_castsi512_ps emu_castsi512_ps
#undef _mm512_castps_si512
#define _mm512_castps_si512 emu_castps_si512
#undef _mm512_castsi512_si256
#define _mm512_castsi512_si256 emu_castsi512_si256
#undef _mm512_castsi256_si512
#define _mm512_castsi256_si512 emu_castsi256_si512
#undef _mm512_zextps256_ps512
#define _mm512_zextps256_ps512 emu_zextps256_ps512
#undef _mm512_inserti64x4
#define _mm512_inserti64x4 emu_inserti64x4
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps emu_maskz_loadu_ps
#undef _mm512_maskz_loadu_epi32
#define _mm512_maskz_loadu_epi32 emu_maskz_loadu_epi32
#undef _mm256_maskz_loadu_ps
#define _mm256_maskz_loadu_ps emu256_maskz_loadu_ps
#undef _mm256_maskz_loadu_epi32
#define _mm256_maskz_loadu_epi32 emu256_maskz_loadu_epi32
#undef _mm256_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16 emu256_maskz_loadu_epi16
#undef _mm256_maskz_loadu_epi8
#define _mm256_maskz_loadu_epi8 emu256_maskz_loadu_epi8
#undef _mm_maskz_loadu_epi16
#define _mm_maskz_loadu_epi16 emu128_maskz_loadu_epi16
#undef _mm_maskz_loadu_epi8
#define _mm_maskz_loadu_epi8 emu128_maskz_loadu_epi8
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps emu_mask_storeu_ps
#undef _mm256_mask_storeu_epi16
#define _mm256_mask_storeu_epi16 emu256_mask_storeu_epi16
#undef _mm512_add_ps
#define _mm512_add_ps emu_add_ps
#undef _mm512_sub_ps
#define _mm512_sub_ps emu_sub_ps
#undef _mm512_mul_ps
#define _mm512_mul_ps emu_mul_ps
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps emu_fmadd_ps
#undef _mm512_max_ps
#define _mm512_max_ps emu_max_ps
#undef _mm512_abs_ps
#define _mm512_abs_ps emu_abs_ps
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps emu_roundscale_ps
#undef _mm512_scalef_ps
#define _mm512_scalef_ps emu_scalef_ps
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps emu_reduce_add_ps
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps emu_reduce_max_ps
#undef _mm512_cmp_ps_mask
#define _mm512_cmp_ps_mask emu_cmp_ps_mask
#undef _mm512_mask_cmp_ps_mask
#define _mm512_mask_cmp_ps_mask emu_mask_cmp_ps_mask
#undef _mm512_cmpeq_epi32_mask
#define _mm512_cmpeq_epi32_mask emu_cmpeq_epi32_mask
#undef _mm512_mask_mov_ps
#define _mm512_mask_mov_ps emu_mask_mov_ps
#undef _mm512_maskz_mov_ps
#define _mm512_maskz_mov_ps emu_maskz_mov_ps
#undef _mm512_mask_mul_ps
#define _mm512_mask_mul_ps emu_mask_mul_ps
#undef _mm512_mask_or_epi32
#define _mm512_mask_or_epi32 emu_mask_or_epi32
#undef _mm256_mask_fmadd_ps
#define _mm256_mask_fmadd_ps emu256_mask_fmadd_ps
#undef _mm256_mask_mov_epi16
#define _mm256_mask_mov_epi16 emu256_mask_mov_epi16
#undef _mm512_add_epi32
#define _mm512_add_epi32 emu_add_epi32
#undef _mm512_sub_epi32
#define _mm512_sub_epi32 emu_sub_epi32
#undef _mm512_max_epi32
#define _mm512_max_epi32 emu_max_epi32
#undef _mm512_min_epi32
#define _mm512_min_epi32 emu_min_epi32
#undef _mm512_and_si512
#define _mm512_and_si512 emu_and_si512
#undef _mm512_or_si512
#define _mm512_or_si512 emu_or_si512
#undef _mm512_slli_epi32
#define _mm512_slli_epi32 emu_slli_epi32
#undef _mm512_srli_epi32
#define _mm512_srli_epi32 emu_srli_epi32
#undef _mm512_unpacklo_epi16
#define _mm512_unpacklo_epi16 emu_unpacklo_epi16
#undef _mm512_unpackhi_epi16
#define _mm512_unpackhi_epi16 emu_unpackhi_epi16
#undef _mm512_dpwssd_epi32
#define _mm512_dpwssd_epi32 emu_dpwssd_epi32
#undef _mm512_permutex2var_ps
#define _mm512_permutex2var_ps emu_permutex2var_ps
#undef _mm512_permutex2var_epi32
#define _mm512_permutex2var_epi32 emu_permutex2var_epi32
#undef _mm512_permutexvar_ps
#define _mm512_permutexvar_ps emu_permutexvar_ps
#undef _mm512_permutexvar_epi16
#define _mm512_permutexvar_epi16 emu_permutexvar_epi16
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps emu_cvtepi32_ps
#undef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32 emu_cvtps_epi32
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 emu_cvtepi32_epi16
#undef _mm512_cvtepi64_epi32
#define _mm512_cvtepi64_epi32 emu_cvtepi64_epi32
#undef _mm512_cvtepi8_epi16
#define _mm512_cvtepi8_epi16 emu_cvtepi8_epi16
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32 emu_cvtepi8_epi32
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 emu_cvtepu16_epi32
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps emu_cvtph_ps
#undef _mm512_cvtps_ph
#define _mm512_cvtps_ph emu_cvtps_ph
#undef _mm256_maskz_cvtph_ps
#define _mm256_maskz_cvtph_ps emu256_maskz_cvtph_ps
#undef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh emu_cvtneps_pbh
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps emu_dpbf16_ps

#undef EMU
#endif /* GQA_EMU512_H */
