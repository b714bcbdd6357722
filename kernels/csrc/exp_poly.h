/* e^x for x <= 0 as our own polynomial, shared by the attention's softmax and SiLU (paged_attention_cpu.c,
 * layer_ops_cpu.c): plain arithmetic, so every build (scalar, AVX2, AVX-512, however vectorised) gives the
 * same bits, where libm's expf may differ between its scalar and vector versions. */
#ifndef SPECDEC_EXP_POLY_H
#define SPECDEC_EXP_POLY_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* e^x for x <= 0 (the softmax's arguments): 2^i * p(r) with x = i*ln2 + r, |r| <= ln2/2, a degree-6 Taylor
 * polynomial (relative error < 2e-7). Plain arithmetic, so it vectorises with the same bits as the scalar code. */
static inline float exp_nonpositive(float x) {
    const float round_magic = 12582912.0f;  /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    float xc = x < -87.0f ? -87.0f : x;     /* below, e^x is 0; clamped so every lane computes a number */
    float i = (xc * 1.44269504f + round_magic) - round_magic;
    float r = fmaf(i, -0.693145752f, xc);
    r = fmaf(i, -1.42860677e-6f, r);
    float p = 1.0f / 720.0f;
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    uint32_t bits = (uint32_t)((int32_t)i + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return x < -87.0f ? 0.0f : p * scale;
}

#endif
