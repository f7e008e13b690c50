/* dw_bn.c's fused kernels against the unfused ones they replace, bit for bit, on random
 * geometries: pe_conv2d_bn_hardtanh against pe_batch_norm_hardtanh then pe_depthwise (the
 * output and both statistics), pe_conv2d_bn_hardtanh_weight_grad against
 * pe_batch_norm_apply (clipped) then pe_depthwise_weight_grad. Filters 1-5 a side,
 * strides 1-3, dilations 1-2, padding up to the filter's size, 1-9 channels, 1-3 images,
 * maps 1-72 a side (both depthwise.c's whole-plane and row kernels), with and without a
 * bias; pe_conv2d_pointwise_bn_hardtanh against pe_batch_norm_hardtanh then the pointwise
 * GEMM on 1-300 channels. Prints "ok <cases>" and exits 0, or names each case that differs
 * and exits 1.
 * tests/test_c_fuse_dw_bn.py builds it with the backend's flags, portably, with the
 * address and undefined-behaviour sanitizers, and for aarch64 (run under qemu). */
#include <stdio.h>
#include <stdlib.h>
#include "pe_kernels.h"
static unsigned s_ = 7;
static int rnd(int n) { s_ = s_ * 1103515245u + 12345u; return (int)((s_ >> 8) % (unsigned)n); }
static float *alloc(size_t n, float scale, float offset) {
    float *p = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) p[i] = ((float)rnd(2000) / 1000.f - 1.f) * scale + offset;
    return p;
}
static int same(const float *a, const float *b, long n) { return memcmp(a, b, (size_t)n * sizeof(float)) == 0; }

static int check(long N, long C, long H, long W, long K, long KW, long s, long sw, long d,
                 long dw, long p, long pw, int bias) {
    long OH = (H + 2 * p - d * (K - 1) - 1) / s + 1, OW = (W + 2 * pw - dw * (KW - 1) - 1) / sw + 1;
    long g[PE_G_LEN] = {N, C, H, W, C, K, KW, OH, OW, s, sw, p, pw, d, dw, C, 0, 0};
    long X = N * C * H * W, Y = N * C * OH * OW;
    float *x = alloc((size_t)X, 2.f, 0.5f), *bw = alloc((size_t)C, 1.f, 0.f);
    float *bb = alloc((size_t)C, 1.f, 0.f), *w = alloc((size_t)(C * K * KW), 1.f, 0.f);
    float *b = bias ? alloc((size_t)C, 1.f, 0.f) : NULL, *gy = alloc((size_t)Y, 1.f, 0.f);
    float *z = malloc((size_t)X * sizeof(float)), *y0 = malloc((size_t)Y * sizeof(float));
    float *y1 = malloc((size_t)Y * sizeof(float)), *m[2], *v[2], *gw[2];
    for (int k = 0; k < 2; k++) {
        m[k] = malloc((size_t)C * sizeof(float)), v[k] = malloc((size_t)C * sizeof(float));
        gw[k] = malloc((size_t)(C * K * KW) * sizeof(float));
    }
    pe_batch_norm_hardtanh_f32(x, bw, bb, z, m[0], v[0], N, C, H * W, 1e-5, 0.0, 1.0);
    pe_depthwise_f32(z, w, b, y0, g);
    pe_conv2d_bn_hardtanh_f32(x, bw, bb, m[1], v[1], w, b, y1, g, 1e-5, 0.0, 1.0);
    int ok = same(y0, y1, Y) && same(m[0], m[1], C) && same(v[0], v[1], C);
    pe_batch_norm_apply_f32(x, bw, bb, m[0], v[0], z, N, C, H * W, 1e-5, 1, 0.0, 1.0);
    pe_depthwise_weight_grad_f32(z, gy, gw[0], g);
    pe_conv2d_bn_hardtanh_weight_grad_f32(x, bw, bb, m[0], v[0], gy, gw[1], g, 1e-5, 0.0, 1.0);
    ok = ok && same(gw[0], gw[1], C * K * KW);
    if (!ok)
        printf("differs: N=%ld C=%ld H=%ld W=%ld K=%ldx%ld s=%ld,%ld d=%ld,%ld p=%ld,%ld bias=%d\n",
               N, C, H, W, K, KW, s, sw, d, dw, p, pw, bias);
    free(x), free(bw), free(bb), free(w), free(b), free(gy), free(z), free(y0), free(y1);
    for (int k = 0; k < 2; k++) free(m[k]), free(v[k]), free(gw[k]);
    return ok;
}

/* pe_conv2d_pointwise_bn_hardtanh against pe_batch_norm_hardtanh then the pointwise
 * convolution's GEMM (pe_gemm_images, as conv.c's pe_conv2d_pointwise calls it). */
static int check_pointwise(long N, long C, long O, long H, long W) {
    long S = H * W, X = N * C * S, Y = N * O * S;
    long g[PE_G_LEN] = {N, C, H, W, O, 1, 1, H, W, 1, 1, 0, 0, 1, 1, 1, 0, 0};
    float *x = alloc((size_t)X, 2.f, 0.5f), *bw = alloc((size_t)C, 1.f, 0.f);
    float *bb = alloc((size_t)C, 1.f, 0.f), *w = alloc((size_t)(O * C), 1.f, 0.f);
    float *z = malloc((size_t)X * sizeof(float)), *y[2], *m[2], *v[2];
    for (int k = 0; k < 2; k++) {
        y[k] = malloc((size_t)Y * sizeof(float));
        m[k] = malloc((size_t)C * sizeof(float)), v[k] = malloc((size_t)C * sizeof(float));
    }
    pe_batch_norm_hardtanh_f32(x, bw, bb, z, m[0], v[0], N, C, S, 1e-5, 0.0, 6.0);
    pe_gemm_images_f32(N, O, S, C, w, C, 0, z, C * S, y[0], O * S);
    pe_conv2d_pointwise_bn_hardtanh_f32(x, bw, bb, m[1], v[1], w, y[1], g, 1e-5, 0.0, 6.0);
    int ok = same(y[0], y[1], Y) && same(m[0], m[1], C) && same(v[0], v[1], C);
    if (!ok) printf("pointwise differs: N=%ld C=%ld O=%ld H=%ld W=%ld\n", N, C, O, H, W);
    free(x), free(bw), free(bb), free(w), free(z);
    for (int k = 0; k < 2; k++) free(y[k]), free(m[k]), free(v[k]);
    return ok;
}

int main(void) {
    int cases = 0, bad = 0;
    for (int it = 0; it < 200; it++) {
        long N = 1 + rnd(3), H = 1 + rnd(72), W = 1 + rnd(72), K = 1 + rnd(5), KW = 1 + rnd(5);
        long s = 1 + rnd(3), sw = 1 + rnd(3), d = 1 + rnd(2), dw = 1 + rnd(2);
        long p = rnd(K + 1), pw = rnd(KW + 1), C = 1 + rnd(9);
        if (H + 2 * p < d * (K - 1) + 1 || W + 2 * pw < dw * (KW - 1) + 1) continue;
        cases++;
        bad += !check(N, C, H, W, K, KW, s, sw, d, dw, p, pw, it % 2);
    }
    cases++; /* MobileNetV2's largest expansion: 64 x 64, stride 2, one channel a block */
    bad += !check(2, 3, 64, 64, 3, 3, 2, 2, 1, 1, 1, 1, 0);
    for (int it = 0; it < 24; it++) { /* products across image boundaries and k blocks */
        long N = 1 + rnd(3), C = 1 + rnd(it < 20 ? 40 : 300), O = 1 + rnd(40);
        cases++;
        bad += !check_pointwise(N, C, O, 1 + rnd(20), 1 + rnd(20));
    }
    cases++; /* a projection on 32 x 32 maps: 144 -> 24 channels */
    bad += !check_pointwise(2, 144, 24, 32, 32);
    if (bad) return 1;
    printf("ok %d\n", cases);
    return 0;
}
