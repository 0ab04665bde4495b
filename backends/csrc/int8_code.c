/*
 * int8 coding: rows quantized to codes and scales (as quant.quantize_int8 does), and the
 * Hadamard rotation of the values (quant.hadamard_rotation's, as a fast transform).
 */
#include "gqa_avx512.h"

/* Each row's absmax to scale[r]: the largest |x| (a NaN skipped: a > amax is false), one at a time. */
static inline __attribute__((always_inline)) void absmax_rows(const float *x, int64_t rows, int64_t len, float *scale) {
    for (int64_t r = 0; r < rows; r++) {
        float amax = 0.0f;
        for (int64_t j = 0; j < len; j++) { /* fmaxf's result for finite rows, without its libm call */
            const float a = fabsf(x[r * len + j]);
            amax = a > amax ? a : amax;
        }
        scale[r] = amax;
    }
}

/* The codes and scales of rows whose absmax scale[r] holds. */
static inline __attribute__((always_inline)) int quantize_rows_codes(const float *x, int64_t rows, int64_t len,
                                                                       int flags, int8_t *codes, float *scale) {
    const int half = flags & FLAG_HALF_SCALES;
    int reciprocal = !half && (flags & FLAG_RECIPROCAL);
    const float tiny = (float)(127.0 / 3.4028234663852886e38);
    for (int64_t r = 0; r < rows; r++)
        if (scale[r] < tiny && scale[r] > 0.0f) reciprocal = 0;
    for (int64_t r = 0; r < rows; r++) {
        const float amax = scale[r], s32 = amax / 127.0f;
        const float *xr = x + r * len;
        int8_t *cr = codes + r * len;
        if (reciprocal) {
            const float inv = amax == 0.0f ? 0.0f : (1.0f / amax) * 127.0f; /* torch's 127 / t: reciprocal, then product */
            for (int64_t j = 0; j < len; j++) cr[j] = amax == 0.0f ? 0 : (int8_t)rintf(xr[j] * inv);
            scale[r] = s32;
            continue;
        }
        float stored = s32;
        if (half) {
            if (s32 > 65504.0f) return -ERANGE;
            stored = half_to_float(float_to_half(s32));
        }
        scale[r] = stored;
        const float div = stored == 0.0f ? 1.0f : stored;
        for (int64_t j = 0; j < len; j++) {
            float c = rintf(xr[j] / div);
            c = c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c;
            cr[j] = (int8_t)c;
        }
    }
    return 0;
}

/* int8: quantizes rows (rows, len) float32 per row, absmax / 127, as quant.quantize_int8 does:
 * float16 scales: codes = round(x / stored scale) (a stored 0 divides by 1), clamped to 127;
 * float32 scales with FLAG_RECIPROCAL (bitsandbytes' rounding, which quant uses when it loads):
 * codes = round(x * (127 / absmax)) unless some row's absmax is tiny but not 0 (then all rows
 * the plain way, as quant does). Codes to codes[r * len + j], scales as float32 to scale[r];
 * -ERANGE when a float16 scale would overflow. */
static inline __attribute__((always_inline)) int quantize_rows_body(const float *x, int64_t rows, int64_t len, int flags,
                                                                      int8_t *codes, float *scale) {
    absmax_rows(x, rows, len, scale);
    return quantize_rows_codes(x, rows, len, flags, codes, scale);
}

#if GQA_X86_64
/* The same loops compiled for AVX-512 (their rounding and division vectorize; at the baseline
 * ISA rintf is a call per element): the same operations on each element, the same codes. */
AVX512 static int quantize_rows_avx512(const float *x, int64_t rows, int64_t len, int flags, int8_t *codes,
                                       float *scale) {
    /* the absmax 16 lanes at a time: vmaxps(a, m) returns m where a is NaN, as a > m ? a : m
     * does, and a maximum of numbers is the same in any order: absmax_rows' result, where its
     * loop was one dependent scalar max an element (~40% of the function) */
    for (int64_t r = 0; r < rows; r++) {
        __m512 m = _mm512_setzero_ps();
        for (int64_t j = 0; j < len; j += 16)
            m = _mm512_max_ps(_mm512_abs_ps(_mm512_maskz_loadu_ps(lanes16(len - j, 0), x + r * len + j)), m);
        scale[r] = _mm512_reduce_max_ps(m);
    }
    return quantize_rows_codes(x, rows, len, flags, codes, scale);
}

/* And for AVX2 (8 lanes; rintf becomes vroundps): the AVX2-only CPUs' int8 step quantized each
 * row's elements one libm call at a time. */
AVX2 static int quantize_rows_avx2(const float *x, int64_t rows, int64_t len, int flags, int8_t *codes, float *scale) {
    return quantize_rows_body(x, rows, len, flags, codes, scale);
}
#endif

GQA_INTERNAL int quantize_rows(const float *x, int64_t rows, int64_t len, int flags, int8_t *codes, float *scale) {
#if GQA_X86_64
    if (gqa_avx512_usable()) return quantize_rows_avx512(x, rows, len, flags, codes, scale);
    if (gqa_avx2_usable()) return quantize_rows_avx2(x, rows, len, flags, codes, scale);
#endif
    return quantize_rows_body(x, rows, len, flags, codes, scale);
}


/* x (rows, d) float32 times the normalized block-diagonal Sylvester Hadamard matrix with blocks
 * of `block` (a power of two dividing d), in place: quant.hadamard_rotation's H, which is
 * symmetric, so this is also H x. A fast Walsh-Hadamard transform, d log(block) adds, and no
 * threads: torch's matrix product here would start its thread pool, whose idle spinning then
 * competes with the attention kernel for the cores. */
#if GQA_X86_64
/* The same transform 16 lanes at a time (block a multiple of 16), the same additions and
 * subtractions in the same order, so bit for bit the scalar loop's result. Stages of span
 * len < 16 are within a register: lane j takes its partner p (lane j ^ len) by a permutation
 * and becomes x * sign + p, one rounding, with sign +1 in the lower lane of a pair (a + b) and
 * -1 in the upper (a - b, the partner less itself). A block of at most 128 (8 registers) stays
 * in registers through every stage; a longer one takes its wider spans through memory. */
AVX512 static inline __attribute__((always_inline)) __m512 hadamard16(__m512 v, const __m512i *perm,
                                                                     const __m512 *sign) {
#pragma GCC unroll 4
    for (int s = 0; s < 4; s++) v = _mm512_fmadd_ps(v, sign[s], _mm512_permutexvar_ps(perm[s], v));
    return v;
}

/* One block of nv (a constant: 1, 2, 4 or 8) registers, in registers. */
AVX512 static inline __attribute__((always_inline)) void hadamard_block_regs(float *y, const int nv, const __m512i *perm,
                                                                            const __m512 *sign, __m512 vn) {
    __m512 v[8];
#pragma GCC unroll 8
    for (int i = 0; i < nv; i++) v[i] = hadamard16(_mm512_loadu_ps(y + 16 * i), perm, sign);
#pragma GCC unroll 4
    for (int len = 1; len < nv; len <<= 1)
#pragma GCC unroll 8
        for (int i = 0; i < nv; i += 2 * len)
#pragma GCC unroll 8
            for (int j = i; j < i + len; j++) {
                const __m512 a = v[j], b = v[j + len];
                v[j] = _mm512_add_ps(a, b);
                v[j + len] = _mm512_sub_ps(a, b);
            }
#pragma GCC unroll 8
    for (int i = 0; i < nv; i++) _mm512_storeu_ps(y + 16 * i, _mm512_mul_ps(v[i], vn));
}

AVX512 static void hadamard_rows_avx512(float *x, int64_t rows, int64_t d, int64_t block, float norm) {
    __m512i perm[4];
    __m512 sign[4];
    for (int s = 0; s < 4; s++) {
        int idx[16];
        float sg[16];
        for (int j = 0; j < 16; j++) {
            idx[j] = j ^ (1 << s);
            sg[j] = j & (1 << s) ? -1.0f : 1.0f;
        }
        perm[s] = _mm512_loadu_si512(idx);
        sign[s] = _mm512_loadu_ps(sg);
    }
    const __m512 vn = _mm512_set1_ps(norm);
    for (int64_t r = 0; r < rows; r++) {
        float *row = x + r * d;
        for (int64_t b0 = 0; b0 < d; b0 += block) {
            float *y = row + b0;
            switch (block) {
                case 128: hadamard_block_regs(y, 8, perm, sign, vn); continue;
                case 64: hadamard_block_regs(y, 4, perm, sign, vn); continue;
                case 32: hadamard_block_regs(y, 2, perm, sign, vn); continue;
                case 16: hadamard_block_regs(y, 1, perm, sign, vn); continue;
                default: break;
            }
            for (int64_t j = 0; j < block; j += 16) _mm512_storeu_ps(y + j, hadamard16(_mm512_loadu_ps(y + j), perm, sign));
            for (int64_t len = 16; len < block; len <<= 1)
                for (int64_t i = 0; i < block; i += 2 * len)
                    for (int64_t j = i; j < i + len; j += 16) {
                        const __m512 a = _mm512_loadu_ps(y + j), b = _mm512_loadu_ps(y + j + len);
                        _mm512_storeu_ps(y + j, _mm512_add_ps(a, b));
                        _mm512_storeu_ps(y + j + len, _mm512_sub_ps(a, b));
                    }
            for (int64_t j = 0; j < block; j += 16) _mm512_storeu_ps(y + j, _mm512_mul_ps(_mm512_loadu_ps(y + j), vn));
        }
    }
}

/* The same at 8 lanes (block a multiple of 8): the spans 1, 2 and 4 within a register (the
 * partner lane by a permute, the upper lane of each pair keeping partner - self, as
 * y[j + len] = a - b), the wider spans across registers. */
AVX2 static void hadamard_rows_avx2(float *x, int64_t rows, int64_t d, int64_t block, float norm) {
    const __m256 vn = _mm256_set1_ps(norm);
    for (int64_t r = 0; r < rows; r++) {
        float *row = x + r * d;
        for (int64_t b0 = 0; b0 < d; b0 += block) {
            float *y = row + b0;
            for (int64_t j = 0; j < block; j += 8) {
                __m256 v = _mm256_loadu_ps(y + j), p;
                p = _mm256_permute_ps(v, 0xB1); /* span 1: lanes 0<->1, 2<->3, ... */
                v = _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xAA);
                p = _mm256_permute_ps(v, 0x4E); /* span 2: lanes 0<->2, 1<->3, ... */
                v = _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xCC);
                p = _mm256_permute2f128_ps(v, v, 0x01); /* span 4: the two halves */
                v = _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xF0);
                _mm256_storeu_ps(y + j, v);
            }
            for (int64_t len = 8; len < block; len <<= 1)
                for (int64_t i = 0; i < block; i += 2 * len)
                    for (int64_t j = i; j < i + len; j += 8) {
                        const __m256 a = _mm256_loadu_ps(y + j), b = _mm256_loadu_ps(y + j + len);
                        _mm256_storeu_ps(y + j, _mm256_add_ps(a, b));
                        _mm256_storeu_ps(y + j + len, _mm256_sub_ps(a, b));
                    }
            for (int64_t j = 0; j < block; j += 8) _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_loadu_ps(y + j), vn));
        }
    }
}
#endif

int gqa_hadamard_rows(float *x, int64_t rows, int64_t d, int64_t block) {
    if (rows < 0 || d < 1 || block < 1 || (block & (block - 1)) || d % block) return -EINVAL;
    const float norm = 1.0f / sqrtf((float)block);
#if GQA_X86_64
    if (block % 16 == 0 && gqa_avx512_usable()) {
        hadamard_rows_avx512(x, rows, d, block, norm);
        return 0;
    }
    if (block % 8 == 0 && gqa_avx2_usable()) {
        hadamard_rows_avx2(x, rows, d, block, norm);
        return 0;
    }
#endif
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
