/* Channels-last kernels: the layout conversions of one activation (NCHW, NHWC, NCHW{c}c)
 * and the depthwise convolution on NHWC maps, forward and both gradients, each vectorised
 * over channels (the innermost loop walks a contiguous run of up to PE_NHWC_CB channels,
 * whose filter taps are first gathered tap-major into a block on the stack). The layout
 * pass (backends/c/layout.py) brackets them with conversions; pointwise convolutions on
 * NHWC maps are plain GEMM calls that the emitter writes (lower_layout.py).
 *
 * Geometry: the conv.c array (PE_G_*), N, C, H, W of the input, the output's OH and OW;
 * depthwise means groups = C = O. A layout is coded 0 for NCHW, -1 for NHWC, c > 1 for
 * NCHW{c}c ([N, ceil(C/c), H, W, c], the last block padded with zeros). */
#ifndef PE_T
#include "pe_kernels.h"
#define PE_SELF "conv_nhwc.c"
#include "pe_instantiate.h"
#else

#ifndef PE_NHWC_ONCE
#define PE_NHWC_ONCE
#define PE_NHWC_CB 64   /* channels per block: a block of taps x channels on the stack */
#define PE_NHWC_TAPS 49 /* filters up to 7x7 have their taps gathered; larger read strided */
#define PE_NHWC_TILE 32 /* transposes go in tiles of this edge */

/* Element (n, c, h, w) of an activation laid out as `layout`. */
static inline long pe_layout_at(int layout, long n, long c, long h, long w, long C, long H,
                                long W) {
    if (layout == 0) return ((n * C + c) * H + h) * W + w;
    if (layout < 0) return ((n * H + h) * W + w) * C + c;
    long blocks = (C + layout - 1) / layout;
    return (((n * blocks + c / layout) * H + h) * W + w) * layout + c % layout;
}
#endif

/* One image's [R, S] matrix into [S, R], in tiles. */
static void PE_S(pe_nhwc_transpose)(const PE_T *restrict x, PE_T *restrict y, long R, long S) {
    for (long r0 = 0; r0 < R; r0 += PE_NHWC_TILE)
        for (long s0 = 0; s0 < S; s0 += PE_NHWC_TILE) {
            long r1 = r0 + PE_NHWC_TILE < R ? r0 + PE_NHWC_TILE : R;
            long s1 = s0 + PE_NHWC_TILE < S ? s0 + PE_NHWC_TILE : S;
            for (long s = s0; s < s1; s++)
                for (long r = r0; r < r1; r++) y[s * R + r] = x[r * S + s];
        }
}

void PE_S(pe_layout_convert)(const PE_T *x, PE_T *y, long N, long C, long H, long W, int src,
                             int dst) {
    long HW = H * W;
    if ((src == 0 && dst < 0) || (src < 0 && dst == 0)) {
        long R = src == 0 ? C : HW, S = src == 0 ? HW : C;
        PE_PARALLEL_FOR(N * C * HW)
        for (long n = 0; n < N; n++) PE_S(pe_nhwc_transpose)(x + n * C * HW, y + n * C * HW, R, S);
        return;
    }
    if (dst > 0) { /* the padded channels of the last block are zeros */
        long blocks = (C + dst - 1) / dst;
        for (long i = 0; i < N * blocks * HW * dst; i++) y[i] = 0;
    }
    PE_PARALLEL_FOR(N * C * HW)
    for (long n = 0; n < N; n++)
        for (long c = 0; c < C; c++)
            for (long h = 0; h < H; h++)
                for (long w = 0; w < W; w++)
                    y[pe_layout_at(dst, n, c, h, w, C, H, W)] =
                        x[pe_layout_at(src, n, c, h, w, C, H, W)];
}

/* Channels [c0, c0 + nc) of a depthwise filter [C, taps] into wt[tap * PE_NHWC_CB + k]. */
static void PE_S(pe_nhwc_gather_taps)(const PE_T *w, PE_T *wt, long c0, long nc, long taps) {
    for (long k = 0; k < nc; k++)
        for (long t = 0; t < taps; t++) wt[t * PE_NHWC_CB + k] = w[(c0 + k) * taps + t];
}

/* Filter tap t of channels [c0, c0 + nc): gathered (stride 1) or read in place (taps). */
#define PE_NHWC_TAP(t) (gathered ? wt + (t) * PE_NHWC_CB : w + c0 * taps + (t))

void PE_S(pe_conv2d_nhwc_depthwise)(const PE_T *x, const PE_T *w, const PE_T *bias, PE_T *y,
                                    const long *g) {
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], OH = g[PE_G_OH],
         OW = g[PE_G_OW], KH = g[PE_G_KH], KW = g[PE_G_KW], taps = KH * KW;
    int gathered = taps <= PE_NHWC_TAPS;
    long ws = gathered ? 1 : taps;
    PE_T wt[PE_NHWC_TAPS * PE_NHWC_CB];
    for (long c0 = 0; c0 < C; c0 += PE_NHWC_CB) {
        long nc = C - c0 < PE_NHWC_CB ? C - c0 : PE_NHWC_CB;
        if (gathered) PE_S(pe_nhwc_gather_taps)(w, wt, c0, nc, taps);
        PE_PARALLEL_FOR(N * OH * OW * taps * nc)
        for (long r = 0; r < N * OH; r++) {
            long n = r / OH, oh = r % OH;
            for (long ow = 0; ow < OW; ow++) {
                PE_T acc[PE_NHWC_CB];
                for (long k = 0; k < nc; k++) acc[k] = bias ? bias[c0 + k] : 0;
                for (long i = 0; i < KH; i++) {
                    long ih = oh * g[PE_G_SH] - g[PE_G_PH] + i * g[PE_G_DH];
                    if (ih < 0 || ih >= H) continue;
                    for (long j = 0; j < KW; j++) {
                        long iw = ow * g[PE_G_SW] - g[PE_G_PW] + j * g[PE_G_DW];
                        if (iw < 0 || iw >= W) continue;
                        const PE_T *restrict xp = x + ((n * H + ih) * W + iw) * C + c0;
                        const PE_T *restrict wp = PE_NHWC_TAP(i * KW + j);
                        for (long k = 0; k < nc; k++) acc[k] += xp[k] * wp[k * ws];
                    }
                }
                PE_T *restrict yp = y + ((n * OH + oh) * OW + ow) * C + c0;
                for (long k = 0; k < nc; k++) yp[k] = acc[k];
            }
        }
    }
}

/* gx[n, h, w, c] = sum of gy[n, oh, ow, c] w[c, i, j] over the windows (oh, ow) whose tap
 * (i, j) reads (h, w): gathered per input position, so every gx element is written once. */
void PE_S(pe_conv2d_nhwc_input_grad_depthwise)(const PE_T *gy, const PE_T *w, PE_T *gx,
                                               const long *g) {
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], OH = g[PE_G_OH],
         OW = g[PE_G_OW], KH = g[PE_G_KH], KW = g[PE_G_KW], taps = KH * KW;
    long SH = g[PE_G_SH], SW = g[PE_G_SW];
    int gathered = taps <= PE_NHWC_TAPS;
    long ws = gathered ? 1 : taps;
    PE_T wt[PE_NHWC_TAPS * PE_NHWC_CB];
    for (long c0 = 0; c0 < C; c0 += PE_NHWC_CB) {
        long nc = C - c0 < PE_NHWC_CB ? C - c0 : PE_NHWC_CB;
        if (gathered) PE_S(pe_nhwc_gather_taps)(w, wt, c0, nc, taps);
        PE_PARALLEL_FOR(N * H * W * taps * nc)
        for (long r = 0; r < N * H; r++) {
            long n = r / H, h = r % H;
            for (long iw = 0; iw < W; iw++) {
                PE_T acc[PE_NHWC_CB];
                for (long k = 0; k < nc; k++) acc[k] = 0;
                for (long i = 0; i < KH; i++) {
                    long th = h + g[PE_G_PH] - i * g[PE_G_DH];
                    if (th < 0 || th % SH || th / SH >= OH) continue;
                    for (long j = 0; j < KW; j++) {
                        long tw = iw + g[PE_G_PW] - j * g[PE_G_DW];
                        if (tw < 0 || tw % SW || tw / SW >= OW) continue;
                        const PE_T *restrict gp = gy + ((n * OH + th / SH) * OW + tw / SW) * C + c0;
                        const PE_T *restrict wp = PE_NHWC_TAP(i * KW + j);
                        for (long k = 0; k < nc; k++) acc[k] += gp[k] * wp[k * ws];
                    }
                }
                PE_T *restrict out = gx + ((n * H + h) * W + iw) * C + c0;
                for (long k = 0; k < nc; k++) out[k] = acc[k];
            }
        }
    }
}

/* gw[c, i, j] = sum over n, oh, ow of gy[n, oh, ow, c] x[n, ih, iw, c]: a block of channels
 * at a time, every tap's partial sums on the stack (blocks in parallel). */
void PE_S(pe_conv2d_nhwc_weight_grad_depthwise)(const PE_T *x, const PE_T *gy, PE_T *gw,
                                                const long *g) {
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], OH = g[PE_G_OH],
         OW = g[PE_G_OW], KH = g[PE_G_KH], KW = g[PE_G_KW], taps = KH * KW;
    long blocks = (C + PE_NHWC_CB - 1) / PE_NHWC_CB;
    PE_PARALLEL_FOR(N * OH * OW * taps * C)
    for (long b = 0; b < blocks; b++) {
        long c0 = b * PE_NHWC_CB, nc = C - c0 < PE_NHWC_CB ? C - c0 : PE_NHWC_CB;
        PE_T acc[PE_NHWC_CB];
        for (long t = 0; t < taps; t++) {
            long i = t / KW, j = t % KW;
            for (long k = 0; k < nc; k++) acc[k] = 0;
            for (long r = 0; r < N * OH; r++) {
                long n = r / OH, oh = r % OH;
                long ih = oh * g[PE_G_SH] - g[PE_G_PH] + i * g[PE_G_DH];
                if (ih < 0 || ih >= H) continue;
                for (long ow = 0; ow < OW; ow++) {
                    long iw = ow * g[PE_G_SW] - g[PE_G_PW] + j * g[PE_G_DW];
                    if (iw < 0 || iw >= W) continue;
                    const PE_T *restrict xp = x + ((n * H + ih) * W + iw) * C + c0;
                    const PE_T *restrict gp = gy + ((n * OH + oh) * OW + ow) * C + c0;
                    for (long k = 0; k < nc; k++) acc[k] += gp[k] * xp[k];
                }
            }
            for (long k = 0; k < nc; k++) gw[(c0 + k) * taps + t] = acc[k];
        }
    }
}

#undef PE_NHWC_TAP
#endif
