/* 2-D max and average pooling over the last two axes (planes = product of the leading
 * axes) and their backward kernels, as ATen computes them: padded taps never win a max
 * (the first maximum in row-major tap order does), and the average divides by the
 * window clipped to the padded input (count_include_pad), or to the input, or by the
 * override. The geometry array is indexed by the PE_G_* names; PE_G_N holds the number
 * of planes. */
#ifndef PE_T
#include "pe_kernels.h"
#define PE_SELF "pool.c"
#include "pe_instantiate.h"
#else

/* The input index of the first maximum of window (oh, ow) in one plane, or -1. */
static long PE_S(pe_window_argmax)(const PE_T *plane, const long *g, long oh, long ow) {
    long H = g[PE_G_H], W = g[PE_G_W], best = -1;
    PE_T top = 0;
    for (long i = 0; i < g[PE_G_KH]; i++) {
        long ih = oh * g[PE_G_SH] - g[PE_G_PH] + i * g[PE_G_DH];
        if (ih < 0 || ih >= H) continue;
        for (long j = 0; j < g[PE_G_KW]; j++) {
            long iw = ow * g[PE_G_SW] - g[PE_G_PW] + j * g[PE_G_DW];
            if (iw < 0 || iw >= W) continue;
            PE_T v = plane[ih * W + iw];
            if (best < 0 || v > top || (v != v && top == top)) {
                best = ih * W + iw;
                top = v;
            }
        }
    }
    return best;
}

#ifndef PE_POOL_HELPERS
#define PE_POOL_HELPERS
/* Output row oh's windows that lie inside the input with their taps adjacent, so a row
 * of them needs no bounds: columns [*a, *b) (none with dilation or where the row reaches
 * the padding or past the edge), and where in the plane the first one's first tap is. */
static long pe_pool_inside(const long *g, long oh, long *a, long *b) {
    long W = g[PE_G_W], KW = g[PE_G_KW], SW = g[PE_G_SW], PW = g[PE_G_PW];
    long ih = oh * g[PE_G_SH] - g[PE_G_PH];
    long lo = (PW + SW - 1) / SW;                            /* the first starting inside */
    long hi = W - KW + PW < 0 ? 0 : (W - KW + PW) / SW + 1; /* past the last ending inside */
    if (hi > g[PE_G_OW]) hi = g[PE_G_OW];
    *a = *b = 0;
    if (g[PE_G_DH] != 1 || g[PE_G_DW] != 1 || ih < 0 || ih + g[PE_G_KH] > g[PE_G_H] || lo >= hi)
        return 0;
    *a = lo;
    *b = hi;
    return ih * W + lo * SW - PW;
}
#endif

/* Whether v takes a window's maximum from top (pe_window_argmax's rule: greater, or the
 * first NaN). */
#define PE_POOL_TAKES(v, top) ((v) > (top) || ((v) != (v) && (top) == (top)))

/* One output row of windows inside the input: the maximum of each window into out[ow],
 * the taps in row-major order, a tap at a time across the row (the loop vectorises at
 * stride 1; GCC leaves a runtime stride's loads scalar). */
static void PE_S(pe_max_row)(const PE_T *row, long W, long KH, long KW, long SW, long OW,
                             PE_T *restrict out) {
    for (long ow = 0; ow < OW; ow++) out[ow] = row[ow * SW];
    for (long i = 0; i < KH; i++)
        for (long j = i ? 0 : 1; j < KW; j++) {
            const PE_T *r = row + i * W + j;
            for (long ow = 0; ow < OW; ow++) {
                PE_T v = r[ow * SW], t = out[ow];
                out[ow] = PE_POOL_TAKES(v, t) ? v : t;
            }
        }
}

/* Windows [from, to) of output row oh by the general loop (plane: one input plane). */
static void PE_S(pe_max_windows)(const PE_T *plane, const long *g, long oh, long from, long to,
                                 PE_T *out) {
    for (long ow = from; ow < to; ow++) {
        long at = PE_S(pe_window_argmax)(plane, g, oh, ow);
        out[ow] = at < 0 ? (PE_T)-INFINITY : plane[at];
    }
}

/* Each row's windows inside the input by pe_max_row, those that reach into the padding
 * (or past the edge with ceil_mode) by the general loop. */
void PE_S(pe_max_pool2d)(const PE_T *x, PE_T *y, const long *g) {
    long planes = g[PE_G_N], HW = g[PE_G_H] * g[PE_G_W], OH = g[PE_G_OH], OW = g[PE_G_OW];
    PE_PARALLEL_FOR(planes * OH * OW * g[PE_G_KH] * g[PE_G_KW])
    for (long p = 0; p < planes; p++)
        for (long oh = 0; oh < OH; oh++) {
            const PE_T *plane = x + p * HW;
            PE_T *out = y + (p * OH + oh) * OW;
            long a, b, at0 = pe_pool_inside(g, oh, &a, &b);
            PE_S(pe_max_windows)(plane, g, oh, 0, a, out);
            if (b > a)
                PE_S(pe_max_row)(plane + at0, g[PE_G_W], g[PE_G_KH], g[PE_G_KW], g[PE_G_SW],
                                 b - a, out + a);
            PE_S(pe_max_windows)(plane, g, oh, b, OW, out);
        }
}

/* The gradient of one output row of windows inside the input: each window's first
 * maximum found as pe_max_row finds it, a run of PE_POOL_RUN windows at a time, then
 * gy added there in window order (the order of the general loop, so the sums are the
 * same bits). */
#define PE_POOL_RUN 64
static void PE_S(pe_max_row_grad)(const PE_T *row, long at0, long W, long KH, long KW, long SW,
                                  long OW, const PE_T *gy, PE_T *out) {
    for (long w0 = 0; w0 < OW; w0 += PE_POOL_RUN) {
        long n = OW - w0 < PE_POOL_RUN ? OW - w0 : PE_POOL_RUN;
        PE_T top[PE_POOL_RUN];
        long at[PE_POOL_RUN];
        for (long k = 0; k < n; k++) {
            top[k] = row[(w0 + k) * SW];
            at[k] = at0 + (w0 + k) * SW;
        }
        for (long i = 0; i < KH; i++)
            for (long j = i ? 0 : 1; j < KW; j++) {
                const PE_T *r = row + i * W + j + w0 * SW;
                long off = at0 + i * W + j + w0 * SW;
                for (long k = 0; k < n; k++) {
                    PE_T v = r[k * SW];
                    int take = PE_POOL_TAKES(v, top[k]);
                    top[k] = take ? v : top[k];
                    at[k] = take ? off + k * SW : at[k];
                }
            }
        for (long k = 0; k < n; k++) out[at[k]] += gy[w0 + k];
    }
}

/* The gradient of windows [from, to) of output row oh by the general loop, in order. */
static void PE_S(pe_max_windows_grad)(const PE_T *plane, const long *g, long oh, long from,
                                      long to, const PE_T *grow, PE_T *out) {
    for (long ow = from; ow < to; ow++) {
        long at = PE_S(pe_window_argmax)(plane, g, oh, ow);
        if (at >= 0) out[at] += grow[ow];
    }
}

/* As pe_max_pool2d, each row's windows in order (the general loop's sums): those before
 * the ones inside the input, those (pe_max_row_grad), then those after. */
void PE_S(pe_max_pool2d_grad)(const PE_T *gy, const PE_T *x, PE_T *gx, const long *g) {
    long planes = g[PE_G_N], HW = g[PE_G_H] * g[PE_G_W], OH = g[PE_G_OH], OW = g[PE_G_OW];
    PE_PARALLEL_FOR(planes * OH * OW * g[PE_G_KH] * g[PE_G_KW])
    for (long p = 0; p < planes; p++) {
        const PE_T *plane = x + p * HW;
        PE_T *restrict out = gx + p * HW;
        for (long k = 0; k < HW; k++) out[k] = 0;
        for (long oh = 0; oh < OH; oh++) {
            const PE_T *grow = gy + (p * OH + oh) * OW;
            long a, b, at0 = pe_pool_inside(g, oh, &a, &b);
            PE_S(pe_max_windows_grad)(plane, g, oh, 0, a, grow, out);
            if (b > a)
                PE_S(pe_max_row_grad)(plane + at0, at0, g[PE_G_W], g[PE_G_KH], g[PE_G_KW],
                                      g[PE_G_SW], b - a, grow + a, out);
            PE_S(pe_max_windows_grad)(plane, g, oh, b, OW, grow, out);
        }
    }
}

/* The clipped window [h0, h1) x [w0, w1) of output (oh, ow) and its divisor. */
static PE_T PE_S(pe_avg_window)(const long *g, long oh, long ow, long *h0, long *h1, long *w0,
                                long *w1) {
    long H = g[PE_G_H], W = g[PE_G_W];
    long hs = oh * g[PE_G_SH] - g[PE_G_PH], ws = ow * g[PE_G_SW] - g[PE_G_PW];
    long he = hs + g[PE_G_KH] < H + g[PE_G_PH] ? hs + g[PE_G_KH] : H + g[PE_G_PH];
    long we = ws + g[PE_G_KW] < W + g[PE_G_PW] ? ws + g[PE_G_KW] : W + g[PE_G_PW];
    long padded = (he - hs) * (we - ws);
    *h0 = hs > 0 ? hs : 0;
    *w0 = ws > 0 ? ws : 0;
    *h1 = he < H ? he : H;
    *w1 = we < W ? we : W;
    if (g[PE_G_DIVISOR]) return (PE_T)g[PE_G_DIVISOR];
    if (g[PE_G_MODE] & 1) return (PE_T)padded;
    return (PE_T)((*h1 - *h0) * (*w1 - *w0));
}

void PE_S(pe_avg_pool2d)(const PE_T *x, PE_T *y, const long *g) {
    long planes = g[PE_G_N], W = g[PE_G_W], HW = g[PE_G_H] * W, OH = g[PE_G_OH], OW = g[PE_G_OW];
    PE_PARALLEL_FOR(planes * OH * OW * g[PE_G_KH] * g[PE_G_KW])
    for (long p = 0; p < planes; p++)
        for (long oh = 0; oh < OH; oh++)
            for (long ow = 0; ow < OW; ow++) {
                long h0, h1, w0, w1;
                PE_T div = PE_S(pe_avg_window)(g, oh, ow, &h0, &h1, &w0, &w1), total = 0;
                for (long h = h0; h < h1; h++)
                    for (long w = w0; w < w1; w++) total += x[p * HW + h * W + w];
                y[(p * OH + oh) * OW + ow] = total / div;
            }
}

void PE_S(pe_avg_pool2d_grad)(const PE_T *gy, PE_T *gx, const long *g) {
    long planes = g[PE_G_N], W = g[PE_G_W], HW = g[PE_G_H] * W, OH = g[PE_G_OH], OW = g[PE_G_OW];
    PE_PARALLEL_FOR(planes * OH * OW * g[PE_G_KH] * g[PE_G_KW])
    for (long p = 0; p < planes; p++) {
        PE_T *restrict out = gx + p * HW;
        for (long k = 0; k < HW; k++) out[k] = 0;
        for (long oh = 0; oh < OH; oh++)
            for (long ow = 0; ow < OW; ow++) {
                long h0, h1, w0, w1;
                PE_T div = PE_S(pe_avg_window)(g, oh, ow, &h0, &h1, &w0, &w1);
                PE_T share = gy[(p * OH + oh) * OW + ow] / div;
                for (long h = h0; h < h1; h++)
                    for (long w = w0; w < w1; w++) out[h * W + w] += share;
            }
    }
}

#undef PE_POOL_TAKES
#undef PE_POOL_RUN
#endif
