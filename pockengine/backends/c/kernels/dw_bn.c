/* A depthwise convolution (depthwise.c) whose input is hardtanh(batch_norm(x)), and its
 * weight gradient, and a pointwise one over such an input, without the normalised tensor
 * ever being stored.
 *
 *   forward        per block of channels: their batch-norm statistics (norm.c's one pass
 *                  over x), then each image's planes normalised and clipped into scratch
 *                  and convolved from there; the rows are still in L2 from the statistics'
 *                  pass, so x is read from memory once, where batch_norm_hardtanh read it,
 *                  wrote z and the convolution read z again
 *   weight grad    per block of channels: every image's planes normalised and clipped from
 *                  x and the saved statistics (a rematerialised batch_norm_apply) into
 *                  scratch beside their gradient planes, then depthwise.c's weight gradient
 *   pointwise      every channel's statistics, then conv.c's one GEMM over the images
 *                  (y[n] = w x[n]) with x normalised and clipped as linalg.c packs it
 *                  (pe_gemm_implicit's packing hook), so z is neither written nor read
 *
 * Each step is the unfused kernels' own arithmetic on the same numbers in the same order
 * (the statistics, the normalisation of pe_batch_norm_apply, the depthwise kernels, whose
 * planes do not depend on one another), so the results equal the unfused path's bit for
 * bit. The scratch is on the stack, a block a thread: the forward's at most
 * PE_DW_BN_PLANES (one channel's plane at least); the weight gradient's every image's
 * planes of the block and their gradient planes, within PE_DW_BN_BYTES, which the rewrite
 * (backends/c/fuse_dw_bn.py) checks one channel fits. The geometry array is indexed by the
 * PE_G_* names of pe_kernels.h; groups = C = O for the depthwise kernels, 1 (and a 1 x 1
 * filter, stride 1, no padding, no bias) for the pointwise one. */
#ifndef PE_T
#include "pe_kernels.h"
#if defined(__GNUC__)
#define PE_PREFETCH(p) __builtin_prefetch(p)
#else
#define PE_PREFETCH(p) ((void)0)
#endif
#define PE_SELF "dw_bn.c"
#include "pe_instantiate.h"
#else

/* The most scratch one block of channels takes for one image's planes in the forward
 * (in L2 beside the statistics' rows). */
#define PE_DW_BN_PLANES (64L * 1024)

/* A block of `channels` channels' geometry over `images` images, one filter a channel. */
static void PE_S(pe_dw_bn_block)(const long *g, long images, long channels, long *block) {
    memcpy(block, g, sizeof(long) * PE_G_LEN);
    block[PE_G_N] = images;
    block[PE_G_C] = block[PE_G_O] = block[PE_G_GROUPS] = channels;
}

/* Channels a block: as many as `limit` bytes of `per_channel` elements hold, at least 1. */
static long PE_S(pe_dw_bn_width)(long C, long per_channel, long limit) {
    long k = limit / (per_channel * (long)sizeof(PE_T));
    return k < 1 ? 1 : k < C ? k : C;
}

/* out[s] = clip((x[s] - mu) * scale + shift) for s < S: pe_batch_norm_apply's operations. */
static void PE_S(pe_dw_bn_plane)(const PE_T *x, long S, PE_T mu, PE_T scale, PE_T shift,
                                 PE_T lo, PE_T hi, PE_T *restrict out) {
    for (long s = 0; s < S; s++) {
        PE_T t = (x[s] - mu) * scale + shift;
        t = t < lo ? lo : t;
        out[s] = t > hi ? hi : t;
    }
}

/* Blocks of channels run in parallel; the depthwise kernels they call see a parallel
 * region and run on one thread, once a block and image (not once a plane: entering a
 * nested region costs about a microsecond). */
void PE_S(pe_conv2d_bn_hardtanh)(const PE_T *x, const PE_T *bw, const PE_T *bb, PE_T *mean,
                                 PE_T *var, const PE_T *w, const PE_T *bias, PE_T *y,
                                 const long *g, double eps, double lo_, double hi_) {
    long N = g[PE_G_N], C = g[PE_G_C], S = g[PE_G_H] * g[PE_G_W];
    long OHW = g[PE_G_OH] * g[PE_G_OW], taps = g[PE_G_KH] * g[PE_G_KW];
    long width = PE_S(pe_dw_bn_width)(C, S, PE_DW_BN_PLANES);
    const PE_T lo = (PE_T)lo_, hi = (PE_T)hi_;
    PE_PARALLEL_FOR(N * C * S * taps)
    for (long c0 = 0; c0 < C; c0 += width) {
        long cb = C - c0 < width ? C - c0 : width, block[PE_G_LEN];
        PE_S(pe_dw_bn_block)(g, 1, cb, block);
        PE_T planes[cb * S], mu[cb], scale[cb], shift[cb];
        for (long c = c0; c < c0 + cb; c++) {
            PE_T v;
            mu[c - c0] = mean[c] = PE_S(pe_bn_channel_stats)(x, N, C, S, c, &v);
            var[c] = v;
            scale[c - c0] = PE_BN_SCALE(bw[c], v, eps), shift[c - c0] = bb[c];
        }
        for (long n = 0; n < N; n++) {
            for (long k = 0; k < cb; k++)
                PE_S(pe_dw_bn_plane)(x + (n * C + c0 + k) * S, S, mu[k], scale[k], shift[k], lo,
                                     hi, planes + k * S);
            PE_S(pe_depthwise)(planes, w + c0 * taps, bias ? bias + c0 : NULL,
                               y + (n * C + c0) * OHW, block);
        }
    }
}

void PE_S(pe_conv2d_bn_hardtanh_weight_grad)(const PE_T *x, const PE_T *bw, const PE_T *bb,
                                             const PE_T *mean, const PE_T *var, const PE_T *gy,
                                             PE_T *gw, const long *g, double eps, double lo_,
                                             double hi_) {
    long N = g[PE_G_N], C = g[PE_G_C], S = g[PE_G_H] * g[PE_G_W];
    long OHW = g[PE_G_OH] * g[PE_G_OW], taps = g[PE_G_KH] * g[PE_G_KW];
    long width = PE_S(pe_dw_bn_width)(C, N * (S + OHW), PE_DW_BN_BYTES);
    const PE_T lo = (PE_T)lo_, hi = (PE_T)hi_;
    PE_PARALLEL_FOR(N * C * OHW * taps)
    for (long c0 = 0; c0 < C; c0 += width) {
        long cb = C - c0 < width ? C - c0 : width, block[PE_G_LEN];
        PE_S(pe_dw_bn_block)(g, N, cb, block);
        PE_T planes[N * cb * (S + OHW)];
        PE_T *grads = planes + N * cb * S;
        for (long n = 0; n < N; n++)
            for (long k = 0; k < cb; k++) {
                long c = c0 + k;
                PE_T scale = PE_BN_SCALE(bw[c], var[c], eps);
                PE_S(pe_dw_bn_plane)(x + (n * C + c) * S, S, mean[c], scale, bb[c], lo, hi,
                                     planes + (n * cb + k) * S);
            }
        for (long n = 0; n < N; n++)
            memcpy(grads + n * cb * OHW, gy + (n * C + c0) * OHW, (size_t)(cb * OHW) * sizeof(PE_T));
        PE_S(pe_depthwise_weight_grad)(planes, grads, gw + c0 * taps, block);
    }
}

/* The pointwise convolution's operand op(B)[k][j] = clip((x[n][k][s] - mean[k]) * scale[k]
 * + shift[k]), j = n * S + s: the images side by side, as pe_gemm_images reads them. */
typedef struct {
    const PE_T *x, *mean, *scale, *shift;
    long C, S;
    PE_T lo, hi;
} PE_S(pe_pw_bn_operand);

/* linalg.c's packing hook: rows k0 .. k0 + kc of op(B), columns j0 .. j0 + width, into the
 * sliver (rows ld apart), each run inside one image normalised as pe_batch_norm_apply does. */
static void PE_S(pe_pw_bn_pack)(const void *ctx, PE_T *sliver, long ld, long k0, long kc,
                                long j0, long width) {
    const PE_S(pe_pw_bn_operand) *b = ctx;
    for (long j = j0; j < j0 + width;) {
        long n = j / b->S, s = j % b->S;
        long run = b->S - s < j0 + width - j ? b->S - s : j0 + width - j;
        for (long k = k0; k < k0 + kc; k++) {
            const PE_T *row = b->x + (n * b->C + k) * b->S + s;
            PE_PREFETCH(row + run); /* the next sliver's run of this row, as linalg.c does */
            PE_PREFETCH(row + run + 64 / sizeof(PE_T));
            PE_S(pe_dw_bn_plane)(row, run, b->mean[k], b->scale[k], b->shift[k], b->lo, b->hi,
                                 sliver + (k - k0) * ld + (j - j0));
        }
        j += run;
    }
}

/* The statistics (channels in parallel, as pe_batch_norm_hardtanh takes them), then the
 * product of pe_conv2d_pointwise (same blocking, same k order) on the packed operand. */
void PE_S(pe_conv2d_pointwise_bn_hardtanh)(const PE_T *x, const PE_T *bw, const PE_T *bb,
                                           PE_T *mean, PE_T *var, const PE_T *w, PE_T *y,
                                           const long *g, double eps, double lo, double hi) {
    long N = g[PE_G_N], C = g[PE_G_C], S = g[PE_G_H] * g[PE_G_W], O = g[PE_G_O];
    PE_T scale[C], shift[C];
    PE_PARALLEL_FOR(N * C * S)
    for (long c = 0; c < C; c++) {
        PE_T v;
        mean[c] = PE_S(pe_bn_channel_stats)(x, N, C, S, c, &v);
        var[c] = v;
        scale[c] = PE_BN_SCALE(bw[c], v, eps), shift[c] = bb[c];
    }
    PE_S(pe_pw_bn_operand) b = {x, mean, scale, shift, C, S, (PE_T)lo, (PE_T)hi};
    pe_layout la = {C, 1, 0, 0, 0}, lc = {S, 1, S, O * S, 2};
    PE_S(pe_gemm_implicit)(O, N * S, C, w, la, PE_S(pe_pw_bn_pack), &b, y, lc, 0);
}

#endif
