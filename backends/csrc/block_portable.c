/*
 * The portable block of every encoding: plain loops the compiler vectorizes at the baseline
 * ISA. The specification the AVX-512 blocks are tested against, and what runs where they
 * cannot (no AVX-512, or a head width not a multiple of 16).
 */
#include "gqa_internal.h"

/* ---------------------------------------------------------------------------------------------
 * The shared online-softmax update, portable: sc[t] holds a block's scores and becomes the
 * weights exp(score - m) (times vs[t] when vs is given: int8's value scales).
 */
static void softmax_portable(float *sc, int64_t nt, const float *vs, int64_t d, float *m, float *l, float *acc) {
    float bmax = -INFINITY;
    for (int64_t t = 0; t < nt; t++)
        if (sc[t] > bmax) bmax = sc[t];
    if (bmax > *m) {
        const float alpha = expf(*m - bmax); /* 0 on the first block (m = -inf) */
        *l *= alpha;
        for (int64_t j = 0; j < d; j++) acc[j] *= alpha;
        *m = bmax;
    }
    float sum = 0.0f;
    for (int64_t t = 0; t < nt; t++) {
        const float e = expf(sc[t] - *m);
        sum += e;
        sc[t] = vs ? e * vs[t] : e;
    }
    *l += sum;
}

/* int8: the block's scales as float32, in place for float32 scales, else converted. */
static void block_scales(const gqa_cache_t *cc, int64_t h, int64_t phys, int64_t nt, state_t *st, const float **ks,
                         const float **vs) {
    const int64_t at = h * cc->scale_stride + phys;
    if (!(cc->flags & FLAG_HALF_SCALES)) {
        *ks = (const float *)cc->ks + at;
        *vs = (const float *)cc->vs + at;
        return;
    }
    const uint16_t *kh = (const uint16_t *)cc->ks + at, *vh = (const uint16_t *)cc->vs + at;
    for (int64_t t = 0; t < nt; t++) {
        st->ksb[t] = half_to_float(kh[t]);
        st->vsb[t] = half_to_float(vh[t]);
    }
    *ks = st->ksb;
    *vs = st->vsb;
}

/* Portable block of any encoding: plain loops (the compiler vectorizes what it can at the
 * baseline ISA). qf is head h's (G, dk + no) float32 query, already scaled. */
static inline __attribute__((always_inline)) void block_portable_enc(
    const int enc, const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt, state_t *st) {
    const int64_t d = cc->d, c = cc->c, G = cc->g, dk = cc->dk, no = cc->no, dq = dk + no, el = enc_size(enc);
    int64_t line;
    const char *kb = (const char *)cc->k + key_block(cc, h, phys, &line) * el;
    const char *vb = (const char *)cc->v + (h * c + phys) * d * el;
    const float *ks = NULL, *vs = NULL;
    if (enc == ENC_INT8) block_scales(cc, h, phys, nt, st, &ks, &vs);
    float sc[TILE_T];
    for (int64_t g = 0; g < G; g++) {
        const float *q = qf + g * dq;
        for (int64_t t = 0; t < nt; t++) sc[t] = 0.0f;
        for (int64_t j = 0; j < dk; j++) {
            const float qj = q[j];
            const int64_t p = kpack(enc);
            const char *row = kb + ((j / p) * line + j % p) * el;
            for (int64_t t = 0; t < nt; t++) sc[t] += qj * load_elem(enc, row, t * p);
        }
        if (enc == ENC_INT8) {
            for (int64_t t = 0; t < nt; t++) sc[t] *= ks[t];
            const uint16_t *kob = cc->ko + h * no * c + phys;
            for (int64_t o = 0; o < no; o++) {
                const float qo = q[dk + o];
                for (int64_t t = 0; t < nt; t++) sc[t] += qo * half_to_float(kob[o * c + t]);
            }
        }
        float *acc = st->acc + g * d;
        softmax_portable(sc, nt, vs, d, st->m + g, st->l + g, acc);
        for (int64_t t = 0; t < nt; t++) {
            const float w = sc[t];
            const char *row = vb + t * d * el;
            for (int64_t j = 0; j < d; j++) acc[j] += w * load_elem(enc, row, j);
        }
    }
}

GQA_INTERNAL void block_portable(const gqa_cache_t *cc, const float *qf, int64_t h, int64_t phys, int64_t nt,
                                 state_t *st) {
    switch (cc->enc) {
        case ENC_F32: block_portable_enc(ENC_F32, cc, qf, h, phys, nt, st); break;
        case ENC_BF16: block_portable_enc(ENC_BF16, cc, qf, h, phys, nt, st); break;
        case ENC_F16: block_portable_enc(ENC_F16, cc, qf, h, phys, nt, st); break;
        default: block_portable_enc(ENC_INT8, cc, qf, h, phys, nt, st); break;
    }
}
