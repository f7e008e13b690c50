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
 *                  read in place through a layout of negative stride;
 *                  (strided) gx[grp] = col2im(w[grp]^T [cg*KH*KW, og]  x  gy[grp]), made
 *                  a block at a time and scattered into gx.
 *
 * The geometry array is indexed by the PE_G_* names of pe_kernels.h. */
#ifndef PE_T
#include "pe_kernels.h"
static inline long pe_min(long a, long b) { return a < b ? a : b; }
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

/* The strided input gradient: gx = col2im(w^T gy). A block of whole channels' rows
 * (channel, tap) by a run of output positions (every image's, side by side) is one product
 * on the stack, scattered into gx as it is made (PE_COL_ELEMS elements: 72 KiB in float);
 * blocks of different channels run on different threads, so no two threads add into one
 * plane. */
#define PE_COL_ROWS 144   /* rows (channel, tap) a block aims at: 16 channels of 3x3 */
#define PE_COL_ELEMS 18432 /* elements of a block */
static void PE_S(pe_col2im_input_grad)(const PE_T *gy, const PE_T *w, PE_T *gx, const long *g) {
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W], O = g[PE_G_O];
    long KH = g[PE_G_KH], KW = g[PE_G_KW], OH = g[PE_G_OH], OW = g[PE_G_OW];
    long sh = g[PE_G_SH], sw = g[PE_G_SW], ph = g[PE_G_PH], pw = g[PE_G_PW];
    long dh = g[PE_G_DH], dw = g[PE_G_DW];
    long groups = g[PE_G_GROUPS], cg = C / groups, og = O / groups, taps = KH * KW;
    long rows = cg * taps, ohw = OH * OW, positions = N * ohw;
    long cb = PE_COL_ROWS / taps > 0 ? PE_COL_ROWS / taps : 1; /* channels a block */
    /* positions a block: whole images, or a run inside one image (so the block's columns
     * start a span of B's split layout, or lie inside one) */
    long per = pe_min(PE_COL_ELEMS / (cb * taps), positions);
    if (per >= ohw) per = per / ohw * ohw;
    long cblocks = (cg + cb - 1) / cb;
    memset(gx, 0, (size_t)(N * C * H * W) * sizeof(PE_T));
    /* A(r, o) = w[grp * og + o][c0 * taps + r]: the filters' rows, transposed; B(o, p) =
     * gy at image p / ohw, channel grp * og + o, position p % ohw */
    pe_layout la = {1, rows, 0, 0, 0}, lb = {ohw, 1, ohw, O * ohw, 2};
    PE_PARALLEL_FOR(N * C * taps * ohw * og)
    for (long t = 0; t < groups * cblocks; t++) {
        long grp = t / cblocks, c0 = t % cblocks * cb, nr = pe_min(cb, cg - c0) * taps;
        _Alignas(64) PE_T block[PE_COL_ELEMS];
        const PE_T *a = w + grp * og * rows + c0 * taps;
        const PE_T *b = gy + grp * og * ohw;
        PE_T *x = gx + (grp * cg + c0) * H * W;
        for (long p0 = 0, np = 0; p0 < positions; p0 += np) {
            np = pe_min(per, positions - p0);
            if (per < ohw) np = pe_min(np, ohw - p0 % ohw);
            pe_layout lc = {np, 1, 0, 0, 0};
            PE_S(pe_gemm_strided)(nr, np, og, a, la, b + p0 / ohw * O * ohw + p0 % ohw, lb,
                                  block, lc, 0);
            for (long r = 0; r < nr; r++) {
                long c = r / taps, i = r / KW % KH, j = r % KW;
                const PE_T *src = block + r * np;
                long oh = p0 % ohw / OW, ow = p0 % OW;
                long plane = (p0 / ohw * C + c) * H * W; /* the image's channel c in x */
                for (long q = 0; q < np; q++) {
                    long ih = oh * sh - ph + i * dh, iw = ow * sw - pw + j * dw;
                    if (ih >= 0 && ih < H && iw >= 0 && iw < W) x[plane + ih * W + iw] += src[q];
                    if (++ow == OW) {
                        ow = 0;
                        if (++oh == OH) oh = 0, plane += C * H * W;
                    }
                }
            }
        }
    }
}

/* At stride 1 a convolution of gy with the flipped filters; strided, col2im (above), and
 * at stride 1 where few output positions leave the convolution's packing mostly padding:
 * maps of at most 16 positions, or fewer than 196 positions in all. Measured (AVX-512, one
 * thread, 3x3, 64-512 channels): col2im took 0.56-0.82x the time on 2 x 2 and 4 x 4 maps,
 * 0.70-0.85x on 7 x 7 maps of one or two images, 0.96-1.24x on 7 x 7 maps of 4-8 images. */
void PE_S(pe_conv2d_input_grad_im2col)(const PE_T *gy, const PE_T *w, PE_T *gx, const long *g) {
    long ohw = g[PE_G_OH] * g[PE_G_OW];
    int few = ohw <= 16 || g[PE_G_N] * ohw < 196;
    if (g[PE_G_SH] != 1 || g[PE_G_SW] != 1 || few) {
        PE_S(pe_col2im_input_grad)(gy, w, gx, g);
        return;
    }
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
