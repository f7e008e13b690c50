/* exp for float32 without a libm call, so the loops that call it (sigmoid and SiLU, softmax,
 * the attention kernels' probabilities, the losses, GELU's gradient) vectorise, in float
 * arithmetic only (sixteen lanes a vector with AVX-512, where double halves that):
 *
 *   x clamped to [-110, 110] on its bits (NaN passes through); k = round(x / ln 2) by the
 *   1.5 * 2^23 shift; r = x - k ln 2 in two steps (ln 2 split in a high part exact for
 *   every k and a low part), so |r| <= ln 2 / 2 to float rounding; e^r by a degree-7
 *   Taylor polynomial (truncation under 5e-9 relative); then scaled by 2^k as two factors
 *   2^(k/2) (both normal, so a subnormal result is rounded once, at the last multiply, and
 *   past the range the product is 0 or inf).
 *
 * Within 1 ulp of the exact value where the target fuses multiply-adds (0.94 ulp over every
 * float), 1.03 ulp where it does not; subnormal results within one subnormal step. Below
 * -104 the result is 0 (under float's least subnormal), above 88.73 inf.
 * pe_exp32_lo(x, lo) is e^(x + lo) for a small correction lo (|lo| under an ulp of x),
 * added after the reduction: GELU's gradient passes -x^2/2 as a rounded product and its
 * exact remainder. */
#ifndef PE_EXP_H
#define PE_EXP_H
#include <stdint.h>
#include <string.h>

/* a * b + c, fused where the target has the instruction (PE_HAS_FMA; a libm call elsewhere
 * would keep the loops scalar); the bounds above hold either way. */
#if defined(__FMA__) || defined(__aarch64__)
#define PE_HAS_FMA 1
#define PE_FMAF(a, b, c) __builtin_fmaf(a, b, c)
#else
#define PE_HAS_FMA 0
#define PE_FMAF(a, b, c) ((a) * (b) + (c))
#endif

/* x with its magnitude clamped to `limit` (a positive float's bits) on its bits: integer
 * masks, which the compiler keeps branch-free on every target (a float select is a branch
 * on SSE2, which keeps the loop scalar); infinities clamp, NaN passes through. */
static inline float pe_clamp_magnitude32(float x, uint32_t limit) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    uint32_t a = u & 0x7fffffffu;
    uint32_t big = (uint32_t)0 - ((uint32_t)(a > limit) & (uint32_t)(a <= 0x7f800000u));
    u = (u & ~big) | (((u & 0x80000000u) | limit) & big);
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline float pe_exp32_lo(float x, float lo) {
    x = pe_clamp_magnitude32(x, 0x42dc0000u); /* +-110 */
    float kf = x * 1.44269504f + 12582912.0f; /* 1.5 * 2^23: k in the low mantissa bits */
    uint32_t kb;
    memcpy(&kb, &kf, sizeof kb);
    kf -= 12582912.0f;
    float r = PE_FMAF(kf, -0.693145751953125f, x); /* ln 2's high part: 12 bits */
    r = PE_FMAF(kf, -1.428606765330187e-06f, r) + lo;
    float e = 1.0f / 5040;
    e = PE_FMAF(e, r, 1.0f / 720);
    e = PE_FMAF(e, r, 1.0f / 120);
    e = PE_FMAF(e, r, 1.0f / 24);
    e = PE_FMAF(e, r, 1.0f / 6);
    e = PE_FMAF(e, r, 0.5f);
#if PE_HAS_FMA
    e = PE_FMAF(PE_FMAF(e, r, 1.0f), r, 1.0f);
#else
    e = 1.0f + (r + r * r * e); /* unfused: the small part summed first, 1 added once */
#endif
    int32_t k = (int32_t)(kb - 0x4b400000u); /* |k| <= 159 */
    int32_t k1 = k / 2, k2 = k - k1;
    uint32_t b1 = (uint32_t)(k1 + 127) << 23, b2 = (uint32_t)(k2 + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, sizeof s1);
    memcpy(&s2, &b2, sizeof s2);
    return e * s1 * s2;
}

static inline float pe_exp32(float x) { return pe_exp32_lo(x, 0.0f); }
#endif
