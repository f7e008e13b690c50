/* Dense and grouped convolutions as implicit GEMMs (linalg.c's pe_gemm_implicit): the
 * im2col matrix (rows k = (channel, tap row, tap column), columns = every image's output
 * positions) is never stored; the GEMM's B slivers are packed from the input directly,
 * an output row's run of positions at a time (a contiguous copy at stride 1, zeros where
 * a tap falls in the padding).
 *
 *   forward        y[grp] = w[grp] [og, cg*KH*KW]  x  col(x[grp])
 *   weight grad    gw[grp] = gy[grp] [og, N*OH*OW]  x  col(x[grp])^T
 *   input grad     (stride 1) gx[grp] = flip(w[grp])^T [cg, og*KH*KW]  x  col(gy[grp]),
 *                  the convolution of gy padded by (K-1)*d - p with the flipped filters,
 *                  read in place through a layout of negative stride.
 *
 * The geometry array is indexed by the PE_G_* names of pe_kernels.h. */
#ifndef PE_T
#include "pe_kernels.h"
#define PE_SELF "im2col.c"
#include "pe_instantiate.h"
#else

/* The im2col matrix of one group: col(k, p) with k = (c, i, j), p = (n, oh, ow). */
typedef struct {
    const PE_T *x; /* the group's first channel in image 0 */
    long img;      /* elements between images */
    long H, W, KH, KW, OH, OW, sh, sw, ph, pw, dh, dw;
} PE_S(pe_im2col);

/* dst[(k - k0) * dk + (p - p0) * dp] = col(k, p) over [k0, k0+nk) x [p0, p0+np). */
static void PE_S(pe_im2col_block)(const PE_S(pe_im2col) *m, PE_T *restrict dst, long dk, long dp,
                                  long k0, long nk, long p0, long np) {
    long ohw = m->OH * m->OW;
    for (long k = k0; k < k0 + nk; k++) {
        long c = k / (m->KH * m->KW), i = k / m->KW % m->KH, j = k % m->KW;
        long n = p0 / ohw, oh = p0 % ohw / m->OW, ow = p0 % m->OW;
        long off = j * m->dw - m->pw; /* input column = ow * sw + off */
        PE_T *d = dst + (k - k0) * dk;
        for (long done = 0; done < np;) {
            long run = m->OW - ow < np - done ? m->OW - ow : np - done;
            long ih = oh * m->sh - m->ph + i * m->dh;
            PE_T *restrict out = d + done * dp;
            if (ih < 0 || ih >= m->H) {
                for (long t = 0; t < run; t++) out[t * dp] = 0;
            } else {
                const PE_T *row = m->x + n * m->img + (c * m->H + ih) * m->W;
                /* positions ow + t whose column lies in [0, W) */
                long lo = 0, hi = run;
                while (lo < run && (ow + lo) * m->sw + off < 0) lo++;
                while (hi > lo && (ow + hi - 1) * m->sw + off >= m->W) hi--;
                for (long t = 0; t < lo; t++) out[t * dp] = 0;
                const PE_T *src = row + ow * m->sw + off;
                if (m->sw == 1 && dp == 1)
                    memcpy(out + lo, src + lo, (size_t)(hi - lo) * sizeof(PE_T));
                else
                    for (long t = lo; t < hi; t++) out[t * dp] = src[t * m->sw];
                for (long t = hi; t < run; t++) out[t * dp] = 0;
            }
            done += run;
            ow += run;
            if (ow == m->OW) {
                ow = 0;
                if (++oh == m->OH) oh = 0, n++;
            }
        }
    }
}

/* op(B) = col: the sliver's rows are k, its columns positions. */
static void PE_S(pe_im2col_pack)(const void *ctx, PE_T *sliver, long ld, long k0, long kc,
                                 long j0, long width) {
    PE_S(pe_im2col_block)(ctx, sliver, ld, 1, k0, kc, j0, width);
}

/* op(B) = col^T: the sliver's rows are positions, its columns k. */
static void PE_S(pe_im2col_pack_t)(const void *ctx, PE_T *sliver, long ld, long k0, long kc,
                                   long j0, long width) {
    PE_S(pe_im2col_block)(ctx, sliver, 1, ld, j0, width, k0, kc);
}

static PE_S(pe_im2col) PE_S(pe_im2col_of)(const PE_T *x, const long *g, long channels) {
    PE_S(pe_im2col) m = {x, channels * g[PE_G_H] * g[PE_G_W], g[PE_G_H], g[PE_G_W], g[PE_G_KH],
                         g[PE_G_KW], g[PE_G_OH], g[PE_G_OW], g[PE_G_SH], g[PE_G_SW],
                         g[PE_G_PH], g[PE_G_PW], g[PE_G_DH], g[PE_G_DW]};
    return m;
}

void PE_S(pe_conv2d_im2col)(const PE_T *x, const PE_T *w, const PE_T *bias, PE_T *y,
                            const long *g) {
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], O = g[PE_G_O];
    long groups = g[PE_G_GROUPS], cg = C / groups, og = O / groups;
    long kk = cg * g[PE_G_KH] * g[PE_G_KW], ohw = g[PE_G_OH] * g[PE_G_OW];
    pe_layout la = {kk, 1, 0, 0, 0}, lc = {ohw, 1, ohw, O * ohw, 2};
    for (long grp = 0; grp < groups; grp++) {
        PE_S(pe_im2col) m = PE_S(pe_im2col_of)(x + grp * cg * H * W, g, C);
        PE_S(pe_gemm_implicit)(og, N * ohw, kk, w + grp * og * kk, la, PE_S(pe_im2col_pack), &m,
                               y + grp * og * ohw, lc, 0);
    }
    if (bias)
        for (long no = 0; no < N * O; no++)
            for (long p = 0; p < ohw; p++) y[no * ohw + p] += bias[no % O];
}

void PE_S(pe_conv2d_weight_grad_im2col)(const PE_T *x, const PE_T *gy, PE_T *gw,
                                        const long *g) {
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], O = g[PE_G_O];
    long groups = g[PE_G_GROUPS], cg = C / groups, og = O / groups;
    long kk = cg * g[PE_G_KH] * g[PE_G_KW], ohw = g[PE_G_OH] * g[PE_G_OW];
    pe_layout la = {ohw, 1, ohw, O * ohw, 2}, lc = {kk, 1, 0, 0, 0};
    for (long grp = 0; grp < groups; grp++) {
        PE_S(pe_im2col) m = PE_S(pe_im2col_of)(x + grp * cg * H * W, g, C);
        PE_S(pe_gemm_implicit)(og, kk, N * ohw, gy + grp * og * ohw, la, PE_S(pe_im2col_pack_t),
                               &m, gw + grp * og * kk, lc, 0);
    }
}

/* Stride 1 only (the caller checks): a convolution of gy with the flipped filters. */
void PE_S(pe_conv2d_input_grad_im2col)(const PE_T *gy, const PE_T *w, PE_T *gx, const long *g) {
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], O = g[PE_G_O];
    long KH = g[PE_G_KH], KW = g[PE_G_KW], OH = g[PE_G_OH], OW = g[PE_G_OW];
    long groups = g[PE_G_GROUPS], cg = C / groups, og = O / groups, taps = KH * KW;
    pe_layout la = {taps, -1, taps, cg * taps, 2}, lc = {H * W, 1, H * W, C * H * W, 2};
    for (long grp = 0; grp < groups; grp++) {
        PE_S(pe_im2col) m = {gy + grp * og * OH * OW, O * OH * OW, OH, OW, KH, KW, H, W, 1, 1,
                             (KH - 1) * g[PE_G_DH] - g[PE_G_PH], (KW - 1) * g[PE_G_DW] - g[PE_G_PW],
                             g[PE_G_DH], g[PE_G_DW]};
        PE_S(pe_gemm_implicit)(cg, N * H * W, og * taps, w + grp * og * cg * taps + taps - 1, la,
                               PE_S(pe_im2col_pack), &m, gx + grp * cg * H * W, lc, 0);
    }
}

#endif
