/* Channels-last and channel-blocked kernels: the layout conversions of one activation
 * (NCHW, NHWC, NCHW{c}c) and the depthwise convolution on NHWC or NCHW{c}c maps, forward
 * and both gradients, each vectorised over channels (the innermost loop walks a contiguous
 * run of up to PE_NHWC_CB channels, or one block of c, whose filter taps are first gathered
 * tap-major into a block on the stack). The layout pass (backends/c/layout.py) brackets
 * them with conversions; pointwise convolutions on NHWC maps are plain GEMM calls that the
 * emitter writes (lower_layout.py).
 *
 * Geometry: the conv.c array (PE_G_*), N, C, H, W of the input, the output's OH and OW;
 * depthwise means groups = C = O. A layout is coded 0 for NCHW, -1 for NHWC, c > 1 for
 * NCHW{c}c ([N, ceil(C/c), H, W, c], the last block padded with zeros, which the blocked
 * kernels write as zeros). */
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

/* Where the channel blocks of an NHWC or NCHW{c}c map of HW positions lie: channel
 * b * cb + k of position p of image n is element n * img + b * blk + p * pos + k. */
typedef struct {
    long img, blk, pos, cb;
} pe_chan_view;

/* The sizes the blocked kernels work on: the map read (IH x IW, with borders ph, pw) and
 * the map written (YH x YW); flip: a stride-1 input gradient as the forward over gy with
 * the taps flipped. */
typedef struct {
    long IH, IW, YH, YW, ph, pw;
    int flip;
} pe_blocked_maps;

static inline pe_chan_view pe_chan_view_of(int layout, long C, long HW) {
    if (layout < 0) return (pe_chan_view){HW * C, PE_NHWC_CB, C, PE_NHWC_CB};
    long blocks = (C + layout - 1) / layout;
    return (pe_chan_view){blocks * HW * layout, HW * layout, layout, layout};
}
#endif

/* R rows of S elements (row stride ldx) into S rows of R (row stride ldy), in tiles. */
static void PE_S(pe_layout_transpose)(const PE_T *restrict x, PE_T *restrict y, long R, long S,
                                      long ldx, long ldy) {
    for (long r0 = 0; r0 < R; r0 += PE_NHWC_TILE)
        for (long s0 = 0; s0 < S; s0 += PE_NHWC_TILE) {
            long r1 = r0 + PE_NHWC_TILE < R ? r0 + PE_NHWC_TILE : R;
            long s1 = s0 + PE_NHWC_TILE < S ? s0 + PE_NHWC_TILE : S;
            for (long s = s0; s < s1; s++)
                for (long r = r0; r < r1; r++) y[s * ldy + r] = x[r * ldx + s];
        }
}

/* Between NCHW and NCHW{c}c: each (image, block) is a transpose of up to c planes. */
static void PE_S(pe_layout_blocks)(const PE_T *x, PE_T *y, long N, long C, long HW, int block,
                                   int to_blocked) {
    long blocks = (C + block - 1) / block;
    PE_PARALLEL_FOR(N * C * HW)
    for (long nb = 0; nb < N * blocks; nb++) {
        long n = nb / blocks, c0 = nb % blocks * block, nc = C - c0 < block ? C - c0 : block;
        long planes = (n * C + c0) * HW, lanes = nb * HW * block;
        if (!to_blocked) {
            PE_S(pe_layout_transpose)(x + lanes, y + planes, HW, nc, block, HW);
            continue;
        }
        if (nc < block)
            for (long p = 0; p < HW; p++)
                for (long k = nc; k < block; k++) y[lanes + p * block + k] = 0;
        PE_S(pe_layout_transpose)(x + planes, y + lanes, nc, HW, HW, block);
    }
}

void PE_S(pe_layout_convert)(const PE_T *x, PE_T *y, long N, long C, long H, long W, int src,
                             int dst) {
    long HW = H * W;
    if ((src == 0 && dst < 0) || (src < 0 && dst == 0)) {
        long R = src == 0 ? C : HW, S = src == 0 ? HW : C;
        PE_PARALLEL_FOR(N * C * HW)
        for (long n = 0; n < N; n++)
            PE_S(pe_layout_transpose)(x + n * C * HW, y + n * C * HW, R, S, S, R);
        return;
    }
    if ((src == 0 && dst > 0) || (src > 0 && dst == 0)) {
        PE_S(pe_layout_blocks)(x, y, N, C, HW, src == 0 ? dst : src, src == 0);
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

/* The depthwise forward on maps laid out as `layout` (NHWC or NCHW{c}c, c <= PE_NHWC_CB). */
static void PE_S(pe_depthwise_chan)(const PE_T *x, const PE_T *w, const PE_T *bias, PE_T *y,
                                    const long *g, int layout) {
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], OH = g[PE_G_OH],
         OW = g[PE_G_OW], KH = g[PE_G_KH], KW = g[PE_G_KW], taps = KH * KW;
    pe_chan_view xv = pe_chan_view_of(layout, C, H * W), yv = pe_chan_view_of(layout, C, OH * OW);
    long cb = xv.cb, pad = layout > 0 ? cb : 0; /* a blocked result's padded lanes: zeros */
    int gathered = taps <= PE_NHWC_TAPS;
    long ws = gathered ? 1 : taps;
    PE_T wt[PE_NHWC_TAPS * PE_NHWC_CB];
    for (long b = 0, c0 = 0; c0 < C; b++, c0 += cb) {
        long nc = C - c0 < cb ? C - c0 : cb;
        if (gathered) PE_S(pe_nhwc_gather_taps)(w, wt, c0, nc, taps);
        PE_PARALLEL_FOR(N * OH * OW * taps * nc)
        for (long r = 0; r < N * OH; r++) {
            long n = r / OH, oh = r % OH;
            const PE_T *xb = x + n * xv.img + b * xv.blk;
            for (long ow = 0; ow < OW; ow++) {
                PE_T acc[PE_NHWC_CB];
                for (long k = 0; k < nc; k++) acc[k] = bias ? bias[c0 + k] : 0;
                for (long i = 0; i < KH; i++) {
                    long ih = oh * g[PE_G_SH] - g[PE_G_PH] + i * g[PE_G_DH];
                    if (ih < 0 || ih >= H) continue;
                    for (long j = 0; j < KW; j++) {
                        long iw = ow * g[PE_G_SW] - g[PE_G_PW] + j * g[PE_G_DW];
                        if (iw < 0 || iw >= W) continue;
                        const PE_T *restrict xp = xb + (ih * W + iw) * xv.pos;
                        const PE_T *restrict wp = PE_NHWC_TAP(i * KW + j);
                        for (long k = 0; k < nc; k++) acc[k] += xp[k] * wp[k * ws];
                    }
                }
                PE_T *restrict yp = y + n * yv.img + b * yv.blk + (oh * OW + ow) * yv.pos;
                for (long k = 0; k < nc; k++) yp[k] = acc[k];
                for (long k = nc; k < pad; k++) yp[k] = 0;
            }
        }
    }
}

/* gx[n, h, w, c] = sum of gy[n, oh, ow, c] w[c, i, j] over the windows (oh, ow) whose tap
 * (i, j) reads (h, w): gathered per input position, so every gx element is written once. */
static void PE_S(pe_depthwise_input_grad_chan)(const PE_T *gy, const PE_T *w, PE_T *gx,
                                               const long *g, int layout) {
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], OH = g[PE_G_OH],
         OW = g[PE_G_OW], KH = g[PE_G_KH], KW = g[PE_G_KW], taps = KH * KW;
    long SH = g[PE_G_SH], SW = g[PE_G_SW];
    pe_chan_view xv = pe_chan_view_of(layout, C, H * W), yv = pe_chan_view_of(layout, C, OH * OW);
    long cb = xv.cb, pad = layout > 0 ? cb : 0;
    int gathered = taps <= PE_NHWC_TAPS;
    long ws = gathered ? 1 : taps;
    PE_T wt[PE_NHWC_TAPS * PE_NHWC_CB];
    for (long b = 0, c0 = 0; c0 < C; b++, c0 += cb) {
        long nc = C - c0 < cb ? C - c0 : cb;
        if (gathered) PE_S(pe_nhwc_gather_taps)(w, wt, c0, nc, taps);
        PE_PARALLEL_FOR(N * H * W * taps * nc)
        for (long r = 0; r < N * H; r++) {
            long n = r / H, h = r % H;
            const PE_T *gb = gy + n * yv.img + b * yv.blk;
            for (long iw = 0; iw < W; iw++) {
                PE_T acc[PE_NHWC_CB];
                for (long k = 0; k < nc; k++) acc[k] = 0;
                for (long i = 0; i < KH; i++) {
                    long th = h + g[PE_G_PH] - i * g[PE_G_DH];
                    if (th < 0 || th % SH || th / SH >= OH) continue;
                    for (long j = 0; j < KW; j++) {
                        long tw = iw + g[PE_G_PW] - j * g[PE_G_DW];
                        if (tw < 0 || tw % SW || tw / SW >= OW) continue;
                        const PE_T *restrict gp = gb + (th / SH * OW + tw / SW) * yv.pos;
                        const PE_T *restrict wp = PE_NHWC_TAP(i * KW + j);
                        for (long k = 0; k < nc; k++) acc[k] += gp[k] * wp[k * ws];
                    }
                }
                PE_T *restrict out = gx + n * xv.img + b * xv.blk + (h * W + iw) * xv.pos;
                for (long k = 0; k < nc; k++) out[k] = acc[k];
                for (long k = nc; k < pad; k++) out[k] = 0;
            }
        }
    }
}

/* gw[c, i, j] = sum over n, oh, ow of gy[n, oh, ow, c] x[n, ih, iw, c]: a block of channels
 * at a time, every tap's partial sums on the stack (blocks in parallel). */
static void PE_S(pe_depthwise_weight_grad_chan)(const PE_T *x, const PE_T *gy, PE_T *gw,
                                                const long *g, int layout) {
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], OH = g[PE_G_OH],
         OW = g[PE_G_OW], KH = g[PE_G_KH], KW = g[PE_G_KW], taps = KH * KW;
    pe_chan_view xv = pe_chan_view_of(layout, C, H * W), yv = pe_chan_view_of(layout, C, OH * OW);
    long cb = xv.cb, blocks = (C + cb - 1) / cb;
    PE_PARALLEL_FOR(N * OH * OW * taps * C)
    for (long b = 0; b < blocks; b++) {
        long c0 = b * cb, nc = C - c0 < cb ? C - c0 : cb;
        PE_T acc[PE_NHWC_CB];
        for (long t = 0; t < taps; t++) {
            long i = t / KW, j = t % KW;
            for (long k = 0; k < nc; k++) acc[k] = 0;
            for (long r = 0; r < N * OH; r++) {
                long n = r / OH, oh = r % OH;
                long ih = oh * g[PE_G_SH] - g[PE_G_PH] + i * g[PE_G_DH];
                if (ih < 0 || ih >= H) continue;
                const PE_T *xb = x + n * xv.img + b * xv.blk + ih * W * xv.pos;
                const PE_T *gb = gy + n * yv.img + b * yv.blk + oh * OW * yv.pos;
                for (long ow = 0; ow < OW; ow++) {
                    long iw = ow * g[PE_G_SW] - g[PE_G_PW] + j * g[PE_G_DW];
                    if (iw < 0 || iw >= W) continue;
                    const PE_T *restrict xp = xb + iw * xv.pos;
                    const PE_T *restrict gp = gb + ow * yv.pos;
                    for (long k = 0; k < nc; k++) acc[k] += gp[k] * xp[k];
                }
            }
            for (long k = 0; k < nc; k++) gw[(c0 + k) * taps + t] = acc[k];
        }
    }
}

/* The blocked kernels at one cache line of channels a block (PE_NHWC_LINE lanes, the
 * block layout.py takes): every loop over lanes has that constant trip count, so each
 * runs as whole vectors; filter taps and bias are gathered zero-padded, so the padded
 * lanes compute zeros. The forward takes PE_NHWC_RUN output positions of a row at once
 * where their windows lie inside the map, the rest one at a time with the bounds checks.
 * A stride-1 input gradient is this forward over gy with the taps flipped. */
#define PE_NHWC_LINE ((long)(64 / sizeof(PE_T)))
#ifndef PE_NHWC_RUN
#define PE_NHWC_RUN 4
#endif

/* Output position (oh, ow) of a block: every tap checked against the map's bounds. */
static void PE_S(pe_blocked_point)(const PE_T *x, const PE_T *wt, const PE_T *bl, PE_T *y,
                                   long H, long W, long oh, long ow, long KH, long KW,
                                   const long *st, const long *pd, const long *dl) {
    enum { L = 64 / sizeof(PE_T) };
    PE_T acc[L];
    for (int k = 0; k < L; k++) acc[k] = bl[k];
    for (long i = 0; i < KH; i++) {
        long ih = oh * st[0] - pd[0] + i * dl[0];
        if (ih < 0 || ih >= H) continue;
        for (long j = 0; j < KW; j++) {
            long iw = ow * st[1] - pd[1] + j * dl[1];
            if (iw < 0 || iw >= W) continue;
            const PE_T *restrict wp = wt + (i * KW + j) * L;
            const PE_T *restrict xp = x + (ih * W + iw) * L;
            for (int k = 0; k < L; k++) acc[k] += xp[k] * wp[k];
        }
    }
    for (int k = 0; k < L; k++) y[k] = acc[k];
}

/* y = the depthwise correlation of x's block with taps wt[t * PE_NHWC_LINE + k] (tap t =
 * i * KW + j read at (oh * SH - PH + i * DH, ow * SW - PW + j * DW)), plus bias lanes. */
static void PE_S(pe_blocked_line)(const PE_T *x, const PE_T *wt, const PE_T *bl, PE_T *y,
                                  long H, long W, long OH, long OW, long KH, long KW,
                                  const long *st, const long *pd, const long *dl) {
    enum { L = 64 / sizeof(PE_T), RUN = PE_NHWC_RUN };
    long ow_lo = (pd[1] + st[1] - 1) / st[1]; /* the first ow whose window starts inside */
    long ow_hi = OW;                         /* and the end of those whose window ends inside */
    while (ow_hi > ow_lo && (ow_hi - 1) * st[1] - pd[1] + (KW - 1) * dl[1] >= W) ow_hi--;
    if (ow_lo > OW) ow_lo = OW;
    for (long oh = 0; oh < OH; oh++) {
        PE_T *yrow = y + oh * OW * L;
        long ow = 0;
        for (; ow < ow_lo; ow++)
            PE_S(pe_blocked_point)(x, wt, bl, yrow + ow * L, H, W, oh, ow, KH, KW, st, pd, dl);
        for (; ow + RUN <= ow_hi; ow += RUN) {
            PE_T acc[RUN * L];
            for (int q = 0; q < RUN * L; q++) acc[q] = bl[q % L];
            for (long i = 0; i < KH; i++) {
                long ih = oh * st[0] - pd[0] + i * dl[0];
                if (ih < 0 || ih >= H) continue;
                const PE_T *xrow = x + ih * W * L;
                for (long j = 0; j < KW; j++) {
                    const PE_T *restrict wp = wt + (i * KW + j) * L;
                    const PE_T *restrict xp = xrow + (ow * st[1] - pd[1] + j * dl[1]) * L;
                    for (int p = 0; p < RUN; p++)
                        for (int k = 0; k < L; k++) acc[p * L + k] += xp[p * st[1] * L + k] * wp[k];
                }
            }
            for (int q = 0; q < RUN * L; q++) yrow[ow * L + q] = acc[q];
        }
        for (; ow < OW; ow++)
            PE_S(pe_blocked_point)(x, wt, bl, yrow + ow * L, H, W, oh, ow, KH, KW, st, pd, dl);
    }
}

/* Small maps are copied into a zero-bordered block on the stack (at most this many
 * bytes), so that every window lies inside and no tap is checked against the bounds. */
#ifndef PE_NHWC_HALO_BYTES
#define PE_NHWC_HALO_BYTES 32768
#endif

/* Whether an H x W map with ph, pw rows and columns of zeros each side fits a bordered
 * block. */
static int PE_S(pe_halo_fits)(long H, long W, long ph, long pw) {
    long bytes = (H + 2 * ph) * (W + 2 * pw) * PE_NHWC_LINE * (long)sizeof(PE_T);
    return ph >= 0 && pw >= 0 && bytes <= PE_NHWC_HALO_BYTES;
}

/* Block b of image n of an H x W map (C channels) into buf with ph rows and pw columns of
 * zeros each side: read from NCHW{L}c (planes 0: the block's lanes) or from NCHW (planes
 * 1: its up to L planes, transposed into lanes; the lanes past C are zeros). */
static void PE_S(pe_halo_load)(const PE_T *x, PE_T *buf, long n, long b, long C, long H,
                               long W, long ph, long pw, int planes) {
    long L = PE_NHWC_LINE, WP = W + 2 * pw, c0 = b * L, nc = C - c0 < L ? C - c0 : L;
    for (long q = 0; q < (H + 2 * ph) * WP * L; q++) buf[q] = 0;
    if (!planes) {
        const PE_T *xb = x + (n * ((C + L - 1) / L) + b) * H * W * L;
        for (long h = 0; h < H; h++)
            for (long q = 0; q < W * L; q++) buf[((h + ph) * WP + pw) * L + q] = xb[h * W * L + q];
        return;
    }
    const PE_T *xp = x + (n * C + c0) * H * W;
    for (long h = 0; h < H; h++)
        for (long w = 0; w < W; w++) { /* a position's lanes written in a row */
            PE_T *restrict lanes = buf + ((h + ph) * WP + w + pw) * L;
            const PE_T *restrict at = xp + h * W + w;
            for (long k = 0; k < nc; k++) lanes[k] = at[k * H * W];
        }
}

/* An H x W block at buf (row stride WP positions, from (ph, pw)) into block b of image n
 * of y: NCHW{L}c (planes 0: every lane) or NCHW (planes 1: the lanes of real channels). */
static void PE_S(pe_halo_store)(const PE_T *buf, PE_T *y, long n, long b, long C, long H,
                                long W, long WP, long ph, long pw, int planes) {
    long L = PE_NHWC_LINE, c0 = b * L, nc = C - c0 < L ? C - c0 : L;
    if (!planes) {
        PE_T *yb = y + (n * ((C + L - 1) / L) + b) * H * W * L;
        for (long h = 0; h < H; h++)
            for (long q = 0; q < W * L; q++) yb[h * W * L + q] = buf[((h + ph) * WP + pw) * L + q];
        return;
    }
    PE_T *yp = y + (n * C + c0) * H * W;
    for (long h = 0; h < H; h++)
        for (long w = 0; w < W; w++) { /* a position's lanes read in a row */
            const PE_T *restrict lanes = buf + ((h + ph) * WP + w + pw) * L;
            PE_T *restrict at = yp + h * W + w;
            for (long k = 0; k < nc; k++) at[k * H * W] = lanes[k];
        }
}

/* Block b's taps (flipped for the input gradient) and bias, zero-padded to L lanes. */
static void PE_S(pe_blocked_taps)(const PE_T *w, const PE_T *bias, long C, long b, long taps,
                                  int flip, PE_T *wt, PE_T *bl) {
    long L = PE_NHWC_LINE, c0 = b * L;
    for (long t = 0; t < taps; t++)
        for (long k = 0; k < L; k++)
            wt[t * L + k] = c0 + k < C ? w[(c0 + k) * taps + (flip ? taps - 1 - t : t)] : 0;
    for (long k = 0; k < L; k++) bl[k] = bias && c0 + k < C ? bias[c0 + k] : 0;
}

static pe_blocked_maps PE_S(pe_blocked_maps_of)(const long *g, int input_grad) {
    pe_blocked_maps m = {g[PE_G_H], g[PE_G_W], g[PE_G_OH], g[PE_G_OW], g[PE_G_PH], g[PE_G_PW], 0};
    if (input_grad) {
        m = (pe_blocked_maps){g[PE_G_OH], g[PE_G_OW], g[PE_G_H], g[PE_G_W],
                              g[PE_G_DH] * (g[PE_G_KH] - 1) - g[PE_G_PH],
                              g[PE_G_DW] * (g[PE_G_KW] - 1) - g[PE_G_PW], 1};
    }
    return m;
}

/* The forward (input_grad 0) or stride-1 input gradient (1) on blocks of L channels, read
 * and written as NCHW{L}c (planes 0) or NCHW (planes 1). A block's taps are gathered once
 * for every image; a map that fits is read through its bordered copy, a larger one (only
 * with planes 0) with the bounds checks. */
static void PE_S(pe_blocked_fast)(const PE_T *x, const PE_T *w, const PE_T *bias, PE_T *y,
                                  const long *g, int input_grad, int planes) {
    long N = g[PE_G_N], C = g[PE_G_C], KH = g[PE_G_KH], KW = g[PE_G_KW], taps = KH * KW;
    long L = PE_NHWC_LINE, blocks = (C + L - 1) / L;
    long st[2] = {g[PE_G_SH], g[PE_G_SW]}, dl[2] = {g[PE_G_DH], g[PE_G_DW]};
    pe_blocked_maps m = PE_S(pe_blocked_maps_of)(g, input_grad);
    long pd[2] = {m.ph, m.pw}, none[2] = {0, 0};
    int haloed = PE_S(pe_halo_fits)(m.IH, m.IW, m.ph, m.pw);
    PE_PARALLEL_FOR(N * C * m.YH * m.YW * taps)
    for (long b = 0; b < blocks; b++) {
        PE_T wt[PE_NHWC_TAPS * 64 / sizeof(PE_T)], bl[64 / sizeof(PE_T)];
        PE_T halo[PE_NHWC_HALO_BYTES / sizeof(PE_T)], out[PE_NHWC_HALO_BYTES / sizeof(PE_T)];
        PE_S(pe_blocked_taps)(w, input_grad ? NULL : bias, C, b, taps, m.flip, wt, bl);
        for (long n = 0; n < N; n++) {
            PE_T *yb = planes ? out : y + (n * blocks + b) * m.YH * m.YW * L;
            if (haloed) {
                PE_S(pe_halo_load)(x, halo, n, b, C, m.IH, m.IW, m.ph, m.pw, planes);
                PE_S(pe_blocked_line)(halo, wt, bl, yb, m.IH + 2 * m.ph, m.IW + 2 * m.pw, m.YH,
                                      m.YW, KH, KW, st, none, dl);
            } else {
                const PE_T *xb = x + (n * blocks + b) * m.IH * m.IW * L;
                PE_S(pe_blocked_line)(xb, wt, bl, yb, m.IH, m.IW, m.YH, m.YW, KH, KW, st, pd, dl);
            }
            if (planes) PE_S(pe_halo_store)(out, y, n, b, C, m.YH, m.YW, m.YW, 0, 0, 1);
        }
    }
}

/* The bordered block a strided input gradient scatters into: rows up to (OH - 1) SH +
 * (KH - 1) DH and at least H + PH (columns likewise); its byte size, or -1 past the
 * stack's block. */
static long PE_S(pe_scatter_rows)(long OH, long SH, long KH, long DH, long H, long PH) {
    long rows = (OH - 1) * SH + (KH - 1) * DH + 1;
    return rows > H + PH ? rows : H + PH;
}

/* A strided input gradient on blocks of L channels (read and written as NCHW{L}c, planes
 * 0, or NCHW, planes 1) whose bordered gx block fits on the stack: each gy position's
 * lanes scattered through every tap into the bordered block, whose inside is then gx. 0
 * when a block does not fit, else 1. */
static int PE_S(pe_blocked_input_grad_scatter)(const PE_T *gy, const PE_T *w, PE_T *gx,
                                               const long *g, int planes) {
    enum { L = 64 / sizeof(PE_T) };
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], OH = g[PE_G_OH],
         OW = g[PE_G_OW], KH = g[PE_G_KH], KW = g[PE_G_KW], taps = KH * KW;
    long SH = g[PE_G_SH], SW = g[PE_G_SW], DH = g[PE_G_DH], DW = g[PE_G_DW];
    long PH = g[PE_G_PH], PW = g[PE_G_PW];
    long HP = PE_S(pe_scatter_rows)(OH, SH, KH, DH, H, PH);
    long WP = PE_S(pe_scatter_rows)(OW, SW, KW, DW, W, PW);
    if (taps > PE_NHWC_TAPS || HP * WP * L * (long)sizeof(PE_T) > PE_NHWC_HALO_BYTES) return 0;
    if (!PE_S(pe_halo_fits)(OH, OW, 0, 0)) return 0;
    long blocks = (C + L - 1) / L;
    PE_PARALLEL_FOR(N * C * OH * OW * taps)
    for (long b = 0; b < blocks; b++) {
        PE_T wt[PE_NHWC_TAPS * L], none[L];
        PE_T halo[PE_NHWC_HALO_BYTES / sizeof(PE_T)], gyb[PE_NHWC_HALO_BYTES / sizeof(PE_T)];
        PE_S(pe_blocked_taps)(w, NULL, C, b, taps, 0, wt, none);
        for (long n = 0; n < N; n++) {
            PE_S(pe_halo_load)(gy, gyb, n, b, C, OH, OW, 0, 0, planes);
            for (long q = 0; q < HP * WP * L; q++) halo[q] = 0;
            for (long oh = 0; oh < OH; oh++)
                for (long ow = 0; ow < OW; ow++) {
                    const PE_T *restrict gp = gyb + (oh * OW + ow) * L;
                    PE_T *hp = halo + (oh * SH * WP + ow * SW) * L;
                    for (long i = 0; i < KH; i++)
                        for (long j = 0; j < KW; j++) {
                            PE_T *restrict out = hp + (i * DH * WP + j * DW) * L;
                            const PE_T *restrict wp = wt + (i * KW + j) * L;
                            for (int k = 0; k < L; k++) out[k] += gp[k] * wp[k];
                        }
                }
            PE_S(pe_halo_store)(halo, gx, n, b, C, H, W, WP, PH, PW, planes);
        }
    }
    return 1;
}

/* gw on blocks of L channels (read as NCHW{L}c, planes 0, or NCHW, planes 1): each block's
 * lanes of every tap summed over the positions. A map that fits is read through its
 * bordered copy, every tap of a position at once; a larger one (only with planes 0) tap
 * by tap with the bounds checks. */
static void PE_S(pe_blocked_weight_grad_fast)(const PE_T *x, const PE_T *gy, PE_T *gw,
                                              const long *g, int planes) {
    enum { L = 64 / sizeof(PE_T) };
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], OH = g[PE_G_OH],
         OW = g[PE_G_OW], KH = g[PE_G_KH], KW = g[PE_G_KW], taps = KH * KW;
    long SH = g[PE_G_SH], SW = g[PE_G_SW], DH = g[PE_G_DH], DW = g[PE_G_DW];
    long PH = g[PE_G_PH], PW = g[PE_G_PW], WP = W + 2 * PW;
    long blocks = (C + L - 1) / L;
    int haloed = PE_S(pe_halo_fits)(H, W, PH, PW) && PE_S(pe_halo_fits)(OH, OW, 0, 0);
    PE_PARALLEL_FOR(N * OH * OW * taps * C)
    for (long b = 0; b < blocks; b++) {
        long c0 = b * L, nc = C - c0 < L ? C - c0 : L;
        PE_T acc[PE_NHWC_TAPS * L];
        PE_T halo[PE_NHWC_HALO_BYTES / sizeof(PE_T)], gyb[PE_NHWC_HALO_BYTES / sizeof(PE_T)];
        for (long q = 0; q < taps * L; q++) acc[q] = 0;
        for (long n = 0; n < N && haloed; n++) {
            PE_S(pe_halo_load)(x, halo, n, b, C, H, W, PH, PW, planes);
            PE_S(pe_halo_load)(gy, gyb, n, b, C, OH, OW, 0, 0, planes);
            for (long oh = 0; oh < OH; oh++)
                for (long ow = 0; ow < OW; ow++) {
                    const PE_T *restrict gp = gyb + (oh * OW + ow) * L;
                    const PE_T *xp = halo + (oh * SH * WP + ow * SW) * L;
                    for (long i = 0; i < KH; i++)
                        for (long j = 0; j < KW; j++) {
                            PE_T *restrict ap = acc + (i * KW + j) * L;
                            const PE_T *restrict hp = xp + (i * DH * WP + j * DW) * L;
                            for (int k = 0; k < L; k++) ap[k] += gp[k] * hp[k];
                        }
                }
        }
        for (long t = 0; t < taps && !haloed; t++) { /* a large NCHW{L}c map */
            long i = t / KW, j = t % KW;
            PE_T *restrict ap = acc + t * L;
            for (long n = 0; n < N; n++) {
                const PE_T *xb = x + (n * blocks + b) * H * W * L;
                const PE_T *gb = gy + (n * blocks + b) * OH * OW * L;
                for (long oh = 0; oh < OH; oh++) {
                    long ih = oh * SH - PH + i * DH;
                    if (ih < 0 || ih >= H) continue;
                    for (long ow = 0; ow < OW; ow++) {
                        long iw = ow * SW - PW + j * DW;
                        if (iw < 0 || iw >= W) continue;
                        const PE_T *restrict xp = xb + (ih * W + iw) * L;
                        const PE_T *restrict gp = gb + (oh * OW + ow) * L;
                        for (int k = 0; k < L; k++) ap[k] += gp[k] * xp[k];
                    }
                }
            }
        }
        for (long t = 0; t < taps; t++)
            for (long k = 0; k < nc; k++) gw[(c0 + k) * taps + t] = acc[t * L + k];
    }
}

/* Whether the blocked kernels run op (0 forward, 1 input gradient, 2 weight gradient) on
 * NCHW maps through bordered blocks on the stack (conv_kernels.py's blocked_fits): one
 * filter a channel, taps gathered, every block it reads and writes within
 * PE_NHWC_HALO_BYTES. */
int PE_S(pe_blocked_fits)(int op, const long *g) {
    if (g[PE_G_GROUPS] != g[PE_G_C] || g[PE_G_O] != g[PE_G_C]) return 0;
    if (g[PE_G_KH] * g[PE_G_KW] > PE_NHWC_TAPS) return 0;
    if (op == 0) return PE_S(pe_halo_fits)(g[PE_G_H], g[PE_G_W], g[PE_G_PH], g[PE_G_PW]) &&
                        PE_S(pe_halo_fits)(g[PE_G_OH], g[PE_G_OW], 0, 0);
    if (op == 2) return PE_S(pe_halo_fits)(g[PE_G_H], g[PE_G_W], g[PE_G_PH], g[PE_G_PW]) &&
                        PE_S(pe_halo_fits)(g[PE_G_OH], g[PE_G_OW], 0, 0);
    if (g[PE_G_SH] == 1 && g[PE_G_SW] == 1) {
        pe_blocked_maps m = PE_S(pe_blocked_maps_of)(g, 1);
        return PE_S(pe_halo_fits)(m.IH, m.IW, m.ph, m.pw) && PE_S(pe_halo_fits)(m.YH, m.YW, 0, 0);
    }
    long HP = PE_S(pe_scatter_rows)(g[PE_G_OH], g[PE_G_SH], g[PE_G_KH], g[PE_G_DH], g[PE_G_H],
                                    g[PE_G_PH]);
    long WP = PE_S(pe_scatter_rows)(g[PE_G_OW], g[PE_G_SW], g[PE_G_KW], g[PE_G_DW], g[PE_G_W],
                                    g[PE_G_PW]);
    return HP * WP * PE_NHWC_LINE * (long)sizeof(PE_T) <= PE_NHWC_HALO_BYTES &&
           PE_S(pe_halo_fits)(g[PE_G_OH], g[PE_G_OW], 0, 0);
}

/* The depthwise convolution on NCHW maps through the blocked kernels: each block of L
 * channels of an image is read into a bordered block on the stack (the conversion to
 * NCHW{L}c folded into the copy) and written back as planes. Where the blocks do not fit
 * (pe_blocked_fits), the NCHW depthwise kernels run instead. */
void PE_S(pe_conv2d_blocked)(const PE_T *x, const PE_T *w, const PE_T *bias, PE_T *y,
                             const long *g) {
    if (PE_S(pe_blocked_fits)(0, g))
        PE_S(pe_blocked_fast)(x, w, bias, y, g, 0, 1);
    else
        PE_S(pe_depthwise)(x, w, bias, y, g);
}

void PE_S(pe_conv2d_input_grad_blocked)(const PE_T *gy, const PE_T *w, PE_T *gx, const long *g) {
    if (!PE_S(pe_blocked_fits)(1, g))
        PE_S(pe_depthwise_input_grad)(gy, w, gx, g);
    else if (g[PE_G_SH] == 1 && g[PE_G_SW] == 1)
        PE_S(pe_blocked_fast)(gy, w, NULL, gx, g, 1, 1);
    else
        PE_S(pe_blocked_input_grad_scatter)(gy, w, gx, g, 1);
}

void PE_S(pe_conv2d_weight_grad_blocked)(const PE_T *x, const PE_T *gy, PE_T *gw, const long *g) {
    if (PE_S(pe_blocked_fits)(2, g))
        PE_S(pe_blocked_weight_grad_fast)(x, gy, gw, g, 1);
    else
        PE_S(pe_depthwise_weight_grad)(x, gy, gw, g);
}

void PE_S(pe_conv2d_nhwc_depthwise)(const PE_T *x, const PE_T *w, const PE_T *bias, PE_T *y,
                                    const long *g) {
    PE_S(pe_depthwise_chan)(x, w, bias, y, g, -1);
}

void PE_S(pe_conv2d_nhwc_input_grad_depthwise)(const PE_T *gy, const PE_T *w, PE_T *gx,
                                               const long *g) {
    PE_S(pe_depthwise_input_grad_chan)(gy, w, gx, g, -1);
}

void PE_S(pe_conv2d_nhwc_weight_grad_depthwise)(const PE_T *x, const PE_T *gy, PE_T *gw,
                                                const long *g) {
    PE_S(pe_depthwise_weight_grad_chan)(x, gy, gw, g, -1);
}

/* Whether a block of NCHW{block}c maps takes the kernels above: one cache line of
 * channels and filter taps they gather (their stack blocks hold PE_NHWC_TAPS taps). */
static int PE_S(pe_blocked_line_kernels)(int block, const long *g) {
    return block == PE_NHWC_LINE && g[PE_G_KH] * g[PE_G_KW] <= PE_NHWC_TAPS;
}

/* The same on NCHW{block}c maps (2 <= block <= PE_NHWC_CB; other blocks do nothing): a
 * block of one cache line with at most PE_NHWC_TAPS taps takes the kernels above, any
 * other the general ones. */
void PE_S(pe_conv2d_nchwc_depthwise)(const PE_T *x, const PE_T *w, const PE_T *bias, PE_T *y,
                                     const long *g, int block) {
    if (PE_S(pe_blocked_line_kernels)(block, g))
        PE_S(pe_blocked_fast)(x, w, bias, y, g, 0, 0);
    else if (block >= 2 && block <= PE_NHWC_CB)
        PE_S(pe_depthwise_chan)(x, w, bias, y, g, block);
}

void PE_S(pe_conv2d_nchwc_input_grad_depthwise)(const PE_T *gy, const PE_T *w, PE_T *gx,
                                                const long *g, int block) {
    int line = PE_S(pe_blocked_line_kernels)(block, g);
    if (line && g[PE_G_SH] == 1 && g[PE_G_SW] == 1)
        PE_S(pe_blocked_fast)(gy, w, NULL, gx, g, 1, 0);
    else if (line && PE_S(pe_blocked_input_grad_scatter)(gy, w, gx, g, 0))
        return;
    else if (block >= 2 && block <= PE_NHWC_CB)
        PE_S(pe_depthwise_input_grad_chan)(gy, w, gx, g, block);
}

void PE_S(pe_conv2d_nchwc_weight_grad_depthwise)(const PE_T *x, const PE_T *gy, PE_T *gw,
                                                 const long *g, int block) {
    if (PE_S(pe_blocked_line_kernels)(block, g))
        PE_S(pe_blocked_weight_grad_fast)(x, gy, gw, g, 0);
    else if (block >= 2 && block <= PE_NHWC_CB)
        PE_S(pe_depthwise_weight_grad_chan)(x, gy, gw, g, block);
}

#undef PE_NHWC_TAP
#undef PE_NHWC_LINE
#endif
