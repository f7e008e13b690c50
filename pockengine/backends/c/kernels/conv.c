/* 2-D convolution (NCHW, OIHW weights, groups, stride, padding, dilation) and its input
 * and weight gradients.
 *
 * A pointwise convolution (1x1, stride 1, no padding, one group) is one GEMM over the
 * images side by side: y[n] = w[O, C] x[n][C, HW] (pe_gemm_images); its weight gradient
 * is one GEMM whose k axis runs over every image's positions. Depthwise convolutions run
 * depthwise.c's kernels; dense and grouped ones with a few channels a group implicit GEMMs
 * (im2col.c; a strided input gradient as col2im of a product). What remains (a group of
 * fewer than PE_DENSE_MIN channels) runs direct loops whose innermost loop
 * walks one output row over the range of positions whose tap lands inside the input, so
 * it has no branch. The geometry array is indexed by the PE_G_*
 * names of pe_kernels.h. */
#ifndef PE_T
#include "pe_kernels.h"
#define PE_SELF "conv.c"
#include "pe_instantiate.h"
#else

#ifndef PE_CONV_HELPERS
#define PE_CONV_HELPERS
/* The output positions [lo, hi) along one axis whose input index o*s - p + t*d is in
 * [0, size). */
static void pe_tap_range(long out, long size, long s, long p, long t, long d, long *lo,
                         long *hi) {
    long off = t * d - p; /* input index = o*s + off */
    long first = off >= 0 ? 0 : (-off + s - 1) / s;
    long last = (size - 1 - off) < 0 ? -1 : (size - 1 - off) / s; /* largest o in bounds */
    *lo = first;
    *hi = last + 1 < out ? last + 1 : out;
    if (*hi < *lo) *hi = *lo;
}

static int pe_is_pointwise(const long *g) {
    return g[PE_G_KH] == 1 && g[PE_G_KW] == 1 && g[PE_G_SH] == 1 && g[PE_G_SW] == 1 &&
           g[PE_G_PH] == 0 && g[PE_G_PW] == 0 && g[PE_G_GROUPS] == 1;
}

/* One filter a channel: depthwise.c's kernels (vectorised along output columns). */
static int pe_is_depthwise(const long *g) {
    return g[PE_G_GROUPS] == g[PE_G_C] && g[PE_G_O] == g[PE_G_C] && g[PE_G_C] > 1;
}

/* Where the depthwise kernels measured faster than direct loops (conv_kernels.py's
 * _depthwise_wins): op 0 forward, 1 input gradient, 2 weight gradient; `wide` the output
 * row in bytes. */
static int pe_depthwise_wins(int op, const long *g, long wide) {
    if (g[PE_G_SH] == 1 && g[PE_G_SW] == 1) return op != 2 || wide >= 32;
    return wide >= (op == 2 ? 64 : 128);
}

/* Where the blocked kernels (conv_nhwc.c) run a depthwise op (0 forward, 1 input gradient,
 * 2 weight gradient) by the rule (conv_kernels.py's rule_kernel): wherever its blocks fit
 * (a block position is one cache line in either type, so the float test holds for both),
 * and with the wide FMA vectors (PE_FAST_GEMM) on output maps of at most 64 positions
 * (BLOCKED_MAX_MAP). */
static int pe_blocked_wins(int op, const long *g) {
#if PE_FAST_GEMM
    if (g[PE_G_OH] * g[PE_G_OW] > 64) return 0;
#endif
    return pe_is_depthwise(g) && pe_blocked_fits_f32(op, g);
}

/* Winograd F(2x2, 3x3) (winograd.c): 3x3, stride 1, dilation 1, one group, with at least
 * PE_WINOGRAD_MIN channels in and out (conv_kernels.WINOGRAD_MIN) and, with the wide FMA
 * GEMM (PE_FAST_GEMM), at most PE_WINOGRAD_FAST_GEMM_MAX channels written (`made`: the
 * forward's output channels, the input gradient's input channels). */
#define PE_WINOGRAD_MIN 32
#define PE_WINOGRAD_FAST_GEMM_MAX 64
static int pe_winograd_wins(const long *g, long made) {
    return g[PE_G_KH] == 3 && g[PE_G_KW] == 3 && g[PE_G_SH] == 1 && g[PE_G_SW] == 1 &&
           g[PE_G_DH] == 1 && g[PE_G_DW] == 1 && g[PE_G_GROUPS] == 1 &&
           g[PE_G_C] >= PE_WINOGRAD_MIN && g[PE_G_O] >= PE_WINOGRAD_MIN &&
           !(PE_FAST_GEMM && made > PE_WINOGRAD_FAST_GEMM_MAX);
}

/* The heuristic for the rest: an implicit GEMM (im2col.c) when each group's product has
 * enough rows and depth to fill the micro-kernel (PE_DENSE_MIN channels in and out a
 * group), else direct loops. */
#define PE_DENSE_MIN 4
static int pe_is_dense(const long *g) {
    long groups = g[PE_G_GROUPS];
    return !pe_is_depthwise(g) && g[PE_G_O] / groups >= PE_DENSE_MIN &&
           g[PE_G_C] / groups * g[PE_G_KH] * g[PE_G_KW] >= PE_DENSE_MIN;
}
#endif

/* The candidates by name (the emitter calls the one chosen for each node; conv_kernels.py
 * states where each is valid): pointwise (one GEMM; 1x1, stride 1, no padding, one group),
 * depthwise (depthwise.c), im2col (im2col.c's implicit GEMM, or col2im for a strided input
 * gradient) and direct (any geometry); winograd.c holds winograd and winograd4. */
void PE_S(pe_conv2d_pointwise)(const PE_T *x, const PE_T *w, const PE_T *bias, PE_T *y,
                               const long *g) {
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], O = g[PE_G_O];
    long OHW = g[PE_G_OH] * g[PE_G_OW];
    PE_S(pe_gemm_images)(N, O, H * W, C, w, C, 0, x, C * H * W, y, O * H * W);
    if (bias)
        for (long n = 0; n < N; n++)
            for (long o = 0; o < O; o++)
                for (long p = 0; p < OHW; p++) y[(n * O + o) * OHW + p] += bias[o];
}

void PE_S(pe_conv2d_depthwise)(const PE_T *x, const PE_T *w, const PE_T *bias, PE_T *y,
                               const long *g) {
    PE_S(pe_depthwise)(x, w, bias, y, g);
}

/* The rule (conv_kernels.rule_kernel) less F(4x4, 3x3), which needs working memory, for
 * callers that do not choose (the emitter always names a kernel). */
void PE_S(pe_conv2d)(const PE_T *x, const PE_T *w, const PE_T *bias, PE_T *y, const long *g) {
    if (pe_is_pointwise(g))
        PE_S(pe_conv2d_pointwise)(x, w, bias, y, g);
    else if (pe_blocked_wins(0, g))
        PE_S(pe_conv2d_blocked)(x, w, bias, y, g);
    else if (pe_is_depthwise(g) && pe_depthwise_wins(0, g, g[PE_G_OW] * (long)sizeof(PE_T)))
        PE_S(pe_conv2d_depthwise)(x, w, bias, y, g);
    else if (pe_winograd_wins(g, g[PE_G_O]))
        PE_S(pe_conv2d_winograd)(x, w, bias, y, g);
    else if (pe_is_dense(g))
        PE_S(pe_conv2d_im2col)(x, w, bias, y, g);
    else
        PE_S(pe_conv2d_direct)(x, w, bias, y, g);
}

void PE_S(pe_conv2d_direct)(const PE_T *x, const PE_T *w, const PE_T *bias, PE_T *y,
                            const long *g) {
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], O = g[PE_G_O];
    long KH = g[PE_G_KH], KW = g[PE_G_KW], OH = g[PE_G_OH], OW = g[PE_G_OW];
    long cg = C / g[PE_G_GROUPS], og = O / g[PE_G_GROUPS];
    PE_PARALLEL_FOR(N * O * OH * OW * cg * KH * KW)
    for (long no = 0; no < N * O; no++) {
        long n = no / O, o = no % O, c0 = o / og * cg;
        PE_T *restrict out = y + no * OH * OW;
        PE_T b = bias ? bias[o] : (PE_T)0;
        for (long p = 0; p < OH * OW; p++) out[p] = b;
        for (long c = 0; c < cg; c++) {
            const PE_T *plane = x + (n * C + c0 + c) * H * W;
            for (long i = 0; i < KH; i++) {
                long oh0, oh1;
                pe_tap_range(OH, H, g[PE_G_SH], g[PE_G_PH], i, g[PE_G_DH], &oh0, &oh1);
                for (long j = 0; j < KW; j++) {
                    long ow0, ow1;
                    pe_tap_range(OW, W, g[PE_G_SW], g[PE_G_PW], j, g[PE_G_DW], &ow0, &ow1);
                    PE_T wv = w[((o * cg + c) * KH + i) * KW + j];
                    long dw = j * g[PE_G_DW] - g[PE_G_PW], sw = g[PE_G_SW];
                    for (long oh = oh0; oh < oh1; oh++) {
                        const PE_T *row = plane + (oh * g[PE_G_SH] - g[PE_G_PH] + i * g[PE_G_DH]) * W;
                        PE_T *restrict orow = out + oh * OW;
                        for (long ow = ow0; ow < ow1; ow++) orow[ow] += wv * row[ow * sw + dw];
                    }
                }
            }
        }
    }
}

void PE_S(pe_conv2d_input_grad_pointwise)(const PE_T *gy, const PE_T *w, PE_T *gx,
                                          const long *g) {
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], O = g[PE_G_O];
    PE_S(pe_gemm_images)(N, C, H * W, O, w, C, 1, gy, O * H * W, gx, C * H * W);
}

void PE_S(pe_conv2d_input_grad_depthwise)(const PE_T *gy, const PE_T *w, PE_T *gx,
                                          const long *g) {
    PE_S(pe_depthwise_input_grad)(gy, w, gx, g);
}

void PE_S(pe_conv2d_input_grad)(const PE_T *gy, const PE_T *w, PE_T *gx, const long *g) {
    if (pe_is_pointwise(g))
        PE_S(pe_conv2d_input_grad_pointwise)(gy, w, gx, g);
    else if (pe_blocked_wins(1, g))
        PE_S(pe_conv2d_input_grad_blocked)(gy, w, gx, g);
    else if (pe_is_depthwise(g) && pe_depthwise_wins(1, g, g[PE_G_OW] * (long)sizeof(PE_T)))
        PE_S(pe_conv2d_input_grad_depthwise)(gy, w, gx, g);
    else if (pe_winograd_wins(g, g[PE_G_C]))
        PE_S(pe_conv2d_input_grad_winograd)(gy, w, gx, g);
    else if (pe_is_dense(g))
        PE_S(pe_conv2d_input_grad_im2col)(gy, w, gx, g);
    else
        PE_S(pe_conv2d_input_grad_direct)(gy, w, gx, g);
}

void PE_S(pe_conv2d_input_grad_direct)(const PE_T *gy, const PE_T *w, PE_T *gx, const long *g) {
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], O = g[PE_G_O];
    long KH = g[PE_G_KH], KW = g[PE_G_KW], OH = g[PE_G_OH], OW = g[PE_G_OW];
    long groups = g[PE_G_GROUPS], cg = C / groups, og = O / groups;
    /* Each (image, input channel) plane gathers from the output channels of its group. */
    PE_PARALLEL_FOR(N * C * H * W * og * KH * KW)
    for (long nc = 0; nc < N * C; nc++) {
        long n = nc / C, c = nc % C, grp = c / cg, cl = c % cg;
        PE_T *restrict plane = gx + nc * H * W;
        for (long p = 0; p < H * W; p++) plane[p] = 0;
        for (long oo = 0; oo < og; oo++) {
            long o = grp * og + oo;
            const PE_T *gplane = gy + (n * O + o) * OH * OW;
            for (long i = 0; i < KH; i++) {
                long oh0, oh1;
                pe_tap_range(OH, H, g[PE_G_SH], g[PE_G_PH], i, g[PE_G_DH], &oh0, &oh1);
                for (long j = 0; j < KW; j++) {
                    long ow0, ow1;
                    pe_tap_range(OW, W, g[PE_G_SW], g[PE_G_PW], j, g[PE_G_DW], &ow0, &ow1);
                    PE_T wv = w[((o * cg + cl) * KH + i) * KW + j];
                    long dw = j * g[PE_G_DW] - g[PE_G_PW], sw = g[PE_G_SW];
                    for (long oh = oh0; oh < oh1; oh++) {
                        PE_T *row = plane + (oh * g[PE_G_SH] - g[PE_G_PH] + i * g[PE_G_DH]) * W;
                        const PE_T *grow = gplane + oh * OW;
                        for (long ow = ow0; ow < ow1; ow++) row[ow * sw + dw] += wv * grow[ow];
                    }
                }
            }
        }
    }
}

void PE_S(pe_conv2d_weight_grad_pointwise)(const PE_T *x, const PE_T *gy, PE_T *gw,
                                           const long *g) {
    /* gw[O, C] = sum_n gy[n] x[n]^T: one product whose k axis runs over every image's
     * positions (split at each image). */
    long N = g[PE_G_N], C = g[PE_G_C], O = g[PE_G_O], HW = g[PE_G_H] * g[PE_G_W];
    pe_layout la = {HW, 1, HW, O * HW, 2}, lb = {1, HW, HW, C * HW, 1}, lc = {C, 1, 0, 0, 0};
    PE_S(pe_gemm_least_padded)(O, C, N * HW, gy, la, x, lb, gw, lc, 0);
}

void PE_S(pe_conv2d_weight_grad_depthwise)(const PE_T *x, const PE_T *gy, PE_T *gw,
                                           const long *g) {
    PE_S(pe_depthwise_weight_grad)(x, gy, gw, g);
}

void PE_S(pe_conv2d_weight_grad)(const PE_T *x, const PE_T *gy, PE_T *gw, const long *g) {
    if (pe_is_pointwise(g))
        PE_S(pe_conv2d_weight_grad_pointwise)(x, gy, gw, g);
    else if (pe_blocked_wins(2, g))
        PE_S(pe_conv2d_weight_grad_blocked)(x, gy, gw, g);
    else if (pe_is_depthwise(g) && pe_depthwise_wins(2, g, g[PE_G_OW] * (long)sizeof(PE_T)))
        PE_S(pe_conv2d_weight_grad_depthwise)(x, gy, gw, g);
    else if (pe_is_dense(g))
        PE_S(pe_conv2d_weight_grad_im2col)(x, gy, gw, g);
    else
        PE_S(pe_conv2d_weight_grad_direct)(x, gy, gw, g);
}

void PE_S(pe_conv2d_weight_grad_direct)(const PE_T *x, const PE_T *gy, PE_T *gw, const long *g) {
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], O = g[PE_G_O];
    long KH = g[PE_G_KH], KW = g[PE_G_KW], OH = g[PE_G_OH], OW = g[PE_G_OW];
    long cg = C / g[PE_G_GROUPS], og = O / g[PE_G_GROUPS];
    PE_PARALLEL_FOR(O * cg * KH * KW * N * OH * OW)
    for (long oc = 0; oc < O * cg; oc++) {
        long o = oc / cg, c = o / og * cg + oc % cg;
        for (long i = 0; i < KH; i++) {
            long oh0, oh1;
            pe_tap_range(OH, H, g[PE_G_SH], g[PE_G_PH], i, g[PE_G_DH], &oh0, &oh1);
            for (long j = 0; j < KW; j++) {
                long ow0, ow1;
                pe_tap_range(OW, W, g[PE_G_SW], g[PE_G_PW], j, g[PE_G_DW], &ow0, &ow1);
                long dw = j * g[PE_G_DW] - g[PE_G_PW], sw = g[PE_G_SW];
                double acc = 0;
                for (long n = 0; n < N; n++) {
                    const PE_T *plane = x + (n * C + c) * H * W;
                    const PE_T *gplane = gy + (n * O + o) * OH * OW;
                    for (long oh = oh0; oh < oh1; oh++) {
                        const PE_T *row = plane + (oh * g[PE_G_SH] - g[PE_G_PH] + i * g[PE_G_DH]) * W;
                        const PE_T *grow = gplane + oh * OW;
                        PE_T part = 0;
                        for (long ow = ow0; ow < ow1; ow++) part += grow[ow] * row[ow * sw + dw];
                        acc += part;
                    }
                }
                gw[(oc * KH + i) * KW + j] = (PE_T)acc;
            }
        }
    }
}

#endif
