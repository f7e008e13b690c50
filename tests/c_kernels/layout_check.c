/* The depthwise convolutions on NHWC and NCHW{c}c maps (conv_nhwc.c: forward, input and
 * weight gradients, and the layout conversions around them), and the blocked kernels on
 * NCHW maps (the conversions folded in; the depthwise kernels where the blocks do not
 * fit), against naive NCHW loops, on random geometries: 1-2 images, 1-70 channels, maps
 * 1-40 a side (some too large for the blocked kernels' bordered copies), filters 1-9 a
 * side (some past the 49 taps the blocked kernels gather), strides 1-3, padding up to the
 * filter's extent, dilation 1-2; blocks of 16 (one cache line of floats: the blocked
 * kernels' fast paths) and 5 (the general ones). Values are small integers, so every sum is
 * exact and the results must be equal. Prints "ok <cases>" and exits 0, or names each case
 * that differs and exits 1. tests/test_c_layout_check.py builds it with the backend's
 * flags, portably, with the address and undefined-behaviour sanitizers and for aarch64. */
#include <stdio.h>
#include <stdlib.h>
#include "pe_kernels.h"

static unsigned s_ = 11;
static long rnd(long n) {
    s_ = s_ * 1103515245u + 12345u;
    return (long)((s_ >> 8) % (unsigned)n);
}

/* y, gx and gw of the depthwise convolution on NCHW maps, naively. */
static void ref(const float *x, const float *w, const float *gy, float *y, float *gx, float *gw,
                const long *g) {
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], OH = g[PE_G_OH],
         OW = g[PE_G_OW], KH = g[PE_G_KH], KW = g[PE_G_KW];
    for (long i = 0; i < N * C * H * W; i++) gx[i] = 0;
    for (long i = 0; i < C * KH * KW; i++) gw[i] = 0;
    for (long n = 0; n < N; n++)
        for (long c = 0; c < C; c++)
            for (long a = 0; a < OH; a++)
                for (long b = 0; b < OW; b++) {
                    long o = ((n * C + c) * OH + a) * OW + b;
                    float acc = 0;
                    for (long i = 0; i < KH; i++)
                        for (long j = 0; j < KW; j++) {
                            long r = a * g[PE_G_SH] - g[PE_G_PH] + i * g[PE_G_DH];
                            long q = b * g[PE_G_SW] - g[PE_G_PW] + j * g[PE_G_DW];
                            if (r < 0 || r >= H || q < 0 || q >= W) continue;
                            long xi = ((n * C + c) * H + r) * W + q, wi = (c * KH + i) * KW + j;
                            acc += x[xi] * w[wi];
                            gx[xi] += gy[o] * w[wi];
                            gw[wi] += gy[o] * x[xi];
                        }
                    y[o] = acc;
                }
}

static int same(const float *a, const float *b, long n) {
    for (long i = 0; i < n; i++)
        if (a[i] != b[i]) return 0;
    return 1;
}

/* The three blocked kernels on NCHW maps. */
static int check_blocked(const float *x, const float *w, const float *gy, const float *y,
                         const float *gx, const float *gw, const long *g) {
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], OH = g[PE_G_OH],
         OW = g[PE_G_OW], taps = g[PE_G_KH] * g[PE_G_KW];
    float *y2 = malloc(sizeof(float) * N * C * OH * OW), *gx2 = malloc(sizeof(float) * N * C * H * W);
    float *gw2 = malloc(sizeof(float) * C * taps);
    pe_conv2d_blocked_f32(x, w, NULL, y2, g);
    pe_conv2d_input_grad_blocked_f32(gy, w, gx2, g);
    pe_conv2d_weight_grad_blocked_f32(x, gy, gw2, g);
    int ok = same(y, y2, N * C * OH * OW) && same(gx, gx2, N * C * H * W) && same(gw, gw2, C * taps);
    free(y2), free(gx2), free(gw2);
    return ok;
}

/* The three kernels in `layout` (-1 NHWC, else a block), converted from and back to NCHW. */
static int check(int layout, const float *x, const float *w, const float *gy, const float *y,
                 const float *gx, const float *gw, const long *g) {
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], OH = g[PE_G_OH],
         OW = g[PE_G_OW], taps = g[PE_G_KH] * g[PE_G_KW];
    long cp = layout > 0 ? (C + layout - 1) / layout * layout : C;
    float *xl = malloc(sizeof(float) * N * cp * H * W), *gxl = malloc(sizeof(float) * N * cp * H * W);
    float *yl = malloc(sizeof(float) * N * cp * OH * OW), *gyl = malloc(sizeof(float) * N * cp * OH * OW);
    float *y2 = malloc(sizeof(float) * N * C * OH * OW), *gx2 = malloc(sizeof(float) * N * C * H * W);
    float *gw2 = malloc(sizeof(float) * C * taps);
    pe_layout_convert_f32(x, xl, N, C, H, W, 0, layout);
    pe_layout_convert_f32(gy, gyl, N, C, OH, OW, 0, layout);
    if (layout < 0) {
        pe_conv2d_nhwc_depthwise_f32(xl, w, NULL, yl, g);
        pe_conv2d_nhwc_input_grad_depthwise_f32(gyl, w, gxl, g);
        pe_conv2d_nhwc_weight_grad_depthwise_f32(xl, gyl, gw2, g);
    } else {
        pe_conv2d_nchwc_depthwise_f32(xl, w, NULL, yl, g, layout);
        pe_conv2d_nchwc_input_grad_depthwise_f32(gyl, w, gxl, g, layout);
        pe_conv2d_nchwc_weight_grad_depthwise_f32(xl, gyl, gw2, g, layout);
    }
    int ok = 1;
    if (layout > 0) { /* a blocked result's padded lanes are zeros */
        long B = cp / layout;
        for (long i = 0; i < N * cp * OH * OW; i++)
            if (i / (layout * OH * OW) % B * layout + i % layout >= C && yl[i] != 0) ok = 0;
        for (long i = 0; i < N * cp * H * W; i++)
            if (i / (layout * H * W) % B * layout + i % layout >= C && gxl[i] != 0) ok = 0;
    }
    pe_layout_convert_f32(yl, y2, N, C, OH, OW, layout, 0);
    pe_layout_convert_f32(gxl, gx2, N, C, H, W, layout, 0);
    ok = ok && same(y, y2, N * C * OH * OW) && same(gx, gx2, N * C * H * W) && same(gw, gw2, C * taps);
    free(xl), free(gxl), free(yl), free(gyl), free(y2), free(gx2), free(gw2);
    return ok;
}

int main(void) {
    int cases = 0, bad = 0;
    for (int it = 0; it < 300; it++) {
        long N = 1 + rnd(2), C = 1 + rnd(70), H = 1 + rnd(it % 10 == 0 ? 40 : 12);
        long W = 1 + rnd(it % 10 == 0 ? 40 : 12), KH = 1 + rnd(it % 7 == 0 ? 9 : 7), KW = 1 + rnd(it % 7 == 0 ? 9 : 7);
        long sh = 1 + rnd(3), sw = 1 + rnd(3), dh = 1 + rnd(2) * (it % 3 == 0);
        long dw = 1 + rnd(2) * (it % 3 == 0), ph = rnd(dh * (KH - 1) + 1), pw = rnd(dw * (KW - 1) + 1);
        long eh = dh * (KH - 1) + 1, ew = dw * (KW - 1) + 1;
        if (H + 2 * ph < eh || W + 2 * pw < ew) continue;
        long OH = (H + 2 * ph - eh) / sh + 1, OW = (W + 2 * pw - ew) / sw + 1;
        long g[PE_G_LEN] = {N, C, H, W, C, KH, KW, OH, OW, sh, sw, ph, pw, dh, dw, C, 0, 0};
        long nx = N * C * H * W, ny = N * C * OH * OW, nw = C * KH * KW;
        float *x = malloc(sizeof(float) * nx), *gy = malloc(sizeof(float) * ny);
        float *w = malloc(sizeof(float) * nw), *y = malloc(sizeof(float) * ny);
        float *gx = malloc(sizeof(float) * nx), *gw = malloc(sizeof(float) * nw);
        for (long i = 0; i < nx; i++) x[i] = (float)(rnd(7) - 3);
        for (long i = 0; i < ny; i++) gy[i] = (float)(rnd(7) - 3);
        for (long i = 0; i < nw; i++) w[i] = (float)(rnd(5) - 2);
        ref(x, w, gy, y, gx, gw, g);
        int layouts[4] = {-1, 16, 5, 0}; /* 0: the blocked kernels on NCHW maps */
        for (int k = 0; k < 4; k++) {
            int ok = layouts[k] ? check(layouts[k], x, w, gy, y, gx, gw, g)
                                : check_blocked(x, w, gy, y, gx, gw, g);
            if (!ok) {
                bad = 1;
                printf("off layout %d N%ld C%ld %ldx%ld K%ldx%ld s%ld,%ld p%ld,%ld d%ld,%ld\n",
                       layouts[k], N, C, H, W, KH, KW, sh, sw, ph, pw, dh, dw);
            }
            cases++;
        }
        free(x), free(gy), free(w), free(y), free(gx), free(gw);
    }
    if (bad) return 1;
    printf("ok %d\n", cases);
    return 0;
}
