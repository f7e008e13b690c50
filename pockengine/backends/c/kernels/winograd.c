/* Winograd convolution, F(2x2, 3x3) (`winograd`) and F(4x4, 3x3) (`winograd4`, below):
 * dense 3x3 filters at stride 1, dilation 1, one group, any padding. The forward and the
 * input gradient (the convolution of gy with the filters turned by 180 degrees and
 * transposed, padded by 2 - p) share one core of each size; F(4x4, 3x3) also has a weight
 * gradient.
 *
 * Each 2x2 output tile comes from a 4x4 input tile d: V = B^T d B per input channel,
 * U = G g G^T per filter, then 16 products summed over the input channels,
 * M[xi][o][t] = sum_c U[xi][o][c] V[xi][c][t], and Y = A^T M A. That is 16 multiplies a
 * tile and channel pair where direct convolution takes 36 (2.25x fewer). Nothing is stored
 * beyond a block on the stack (192 KiB in float32, 160 KiB in float64): for each block of PE_WG_TB tiles and PE_WG_OB output
 * channels, the input channels go by in blocks of PE_WG_CB; each block's V and U are
 * transformed into the frame and multiplied into M with a register-blocked loop (PE_WG_R output
 * channels x PE_WG_TB tiles in vectors). V is transformed again for every output block
 * and U for every tile block: about 1/PE_WG_OB and 1.5/PE_WG_TB of the products' work.
 * Rounding differs from direct convolution (the transforms add and halve before the
 * products): float32 results agree with NumPy to about 1e-6 of the sum of magnitudes.
 *
 *   B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]   G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1]
 *   A^T = [1 1 1 0; 0 1 -1 -1]
 *
 * The geometry array is indexed by the PE_G_* names of pe_kernels.h. */
#ifndef PE_T
#include "pe_kernels.h"
#define PE_W4_PAD 16 /* elements between the working memory's planes (a cache line or two) */
#define PE_SELF "winograd.c"
#include "pe_instantiate.h"

/* The elements of working memory F(4x4, 3x3) takes for op (0 forward, 1 input gradient, 2
 * weight gradient) on geometry g: the transformed filters, 36 planes of Cout x Cin; for
 * the weight gradient the sums M, 36 planes of O x C with the input channels rounded up
 * to a multiple of 32. conv_kernels.winograd4_work agrees. */
long pe_winograd4_work(int op, const long *g) {
    long C = g[PE_G_C], O = g[PE_G_O], wide = (C + 31) / 32 * 32;
    return 36 * ((op == 2 ? O * wide : C * O) + PE_W4_PAD);
}
#else

#define PE_WG_TB 32 /* tiles a block: the vectors of a row of M */
#define PE_WG_OB (PE_TSIZE == 4 ? 32 : 16) /* output channels a block */
#define PE_WG_CB (PE_TSIZE == 4 ? 32 : 16) /* input channels a block */

/* The vector: the target's widest register (a wider generic vector is split, and its
 * broadcasts built element by element, on a narrower target). */
#if defined(__AVX512F__)
#define PE_WG_BYTES 64
#elif defined(__AVX__)
#define PE_WG_BYTES 32
#else
#define PE_WG_BYTES 16
#endif
typedef PE_T PE_S(pe_wg_vec) __attribute__((vector_size(PE_WG_BYTES), aligned(PE_TSIZE)));
#define PE_WG_V (PE_WG_BYTES / PE_TSIZE)
#define PE_WG_NV (PE_WG_TB / PE_WG_V)
/* Output channels a register block: 16 accumulators where there are 32 vector registers
 * (AVX-512, NEON), 8 where there are 16 (AVX2, SSE). */
#if defined(__AVX512F__) || defined(__ARM_NEON) || defined(__aarch64__)
#define PE_WG_ACC 16
#else
#define PE_WG_ACC 8
#endif
#define PE_WG_R (PE_WG_ACC / PE_WG_NV > 0 ? PE_WG_ACC / PE_WG_NV : 1)
/* The 16 planes of V, U and M lie this many elements apart: one cache line more than
 * their size, so the 16 elements of one tile's transform do not alias in the cache. */
#define PE_WG_VS (PE_WG_CB * PE_WG_TB + PE_WG_V)
#define PE_WG_US (PE_WG_OB * PE_WG_CB + PE_WG_V)
#define PE_WG_MS (PE_WG_OB * PE_WG_TB + PE_WG_V)

/* One convolution for the core: `in` [N, Cin, H, W] into `out` [N, Cout, OH, OW] with
 * padding p; filter (o, c) tap (i, j) at w[o * wo + c * wc + (flip ? 8 - 3i - j : 3i + j)]. */
typedef struct {
    const PE_T *in, *w;
    PE_T *out;
    long N, Cin, H, W, Cout, OH, OW, ph, pw, wo, wc;
    int flip;
    long tw, tiles; /* tiles a row and an image */
} PE_S(pe_wg);

/* V[xi][c][t] for channels [c0, c0+cn) and tiles [t0, t0+tn) (tn <= TB; zeros after). */
static void PE_S(pe_wg_input)(const PE_S(pe_wg) *q, long c0, long cn, long t0, long tn,
                              PE_T *restrict V) {
    for (long c = 0; c < cn; c++) {
        for (long t = 0; t < PE_WG_TB; t++) {
            PE_T d[4][4];
            if (t >= tn) {
                for (int k = 0; k < 16; k++) V[k * PE_WG_VS + c * PE_WG_TB + t] = 0;
                continue;
            }
            long n = (t0 + t) / q->tiles, r = (t0 + t) % q->tiles;
            long y0 = r / q->tw * 2 - q->ph, x0 = r % q->tw * 2 - q->pw;
            const PE_T *plane = q->in + (n * q->Cin + c0 + c) * q->H * q->W;
            if (y0 >= 0 && x0 >= 0 && y0 + 4 <= q->H && x0 + 4 <= q->W) {
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++) d[i][j] = plane[(y0 + i) * q->W + x0 + j];
            } else {
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++) {
                        long yy = y0 + i, xx = x0 + j;
                        int in = yy >= 0 && yy < q->H && xx >= 0 && xx < q->W;
                        d[i][j] = in ? plane[yy * q->W + xx] : (PE_T)0;
                    }
            }
            PE_T e[4][4]; /* B^T d */
            for (int j = 0; j < 4; j++) {
                e[0][j] = d[0][j] - d[2][j];
                e[1][j] = d[1][j] + d[2][j];
                e[2][j] = d[2][j] - d[1][j];
                e[3][j] = d[1][j] - d[3][j];
            }
            for (int i = 0; i < 4; i++) { /* (B^T d) B */
                PE_T *v = V + i * 4 * PE_WG_VS + c * PE_WG_TB + t;
                long step = PE_WG_VS;
                v[0] = e[i][0] - e[i][2];
                v[step] = e[i][1] + e[i][2];
                v[2 * step] = e[i][2] - e[i][1];
                v[3 * step] = e[i][1] - e[i][3];
            }
        }
    }
}

/* U[xi][o][c] for output channels [o0, o0+on) and input channels [c0, c0+cn). */
static void PE_S(pe_wg_filter)(const PE_S(pe_wg) *q, long o0, long on, long c0, long cn,
                               PE_T *restrict U) {
    for (long o = 0; o < on; o++)
        for (long c = 0; c < cn; c++) {
            const PE_T *f = q->w + (o0 + o) * q->wo + (c0 + c) * q->wc;
            PE_T g[3][3], e[4][3];
            for (int k = 0; k < 9; k++) g[k / 3][k % 3] = f[q->flip ? 8 - k : k];
            for (int j = 0; j < 3; j++) { /* G g */
                e[0][j] = g[0][j];
                e[1][j] = (PE_T)0.5 * (g[0][j] + g[1][j] + g[2][j]);
                e[2][j] = (PE_T)0.5 * (g[0][j] - g[1][j] + g[2][j]);
                e[3][j] = g[2][j];
            }
            for (int i = 0; i < 4; i++) { /* (G g) G^T */
                PE_T *u = U + i * 4 * PE_WG_US + o * PE_WG_CB + c;
                long step = PE_WG_US;
                u[0] = e[i][0];
                u[step] = (PE_T)0.5 * (e[i][0] + e[i][1] + e[i][2]);
                u[2 * step] = (PE_T)0.5 * (e[i][0] - e[i][1] + e[i][2]);
                u[3 * step] = e[i][2];
            }
        }
}

/* M[xi][o][:] (+)= sum_c U[xi][o][c] V[xi][c][:] for the `planes` planes xi (16 for
 * F(2x2, 3x3), 36 for F(4x4, 3x3)), PE_WG_R output channels at a time: U's planes lie `us`
 * elements apart and its rows `uld`, V's planes `vs` apart, M's `ms`. */
static void PE_S(pe_wg_multiply)(const PE_T *U, long us, long uld, const PE_T *V, long vs,
                                 int planes, long on, long cn, int first, PE_T *restrict M,
                                 long ms) {
    typedef PE_S(pe_wg_vec) vec;
    for (int xi = 0; xi < planes; xi++) {
        const PE_T *u = U + xi * us, *v = V + xi * vs;
        PE_T *m = M + xi * ms;
        long o = 0;
        for (; o + PE_WG_R <= on; o += PE_WG_R) {
            vec acc[PE_WG_R][PE_WG_NV];
            for (int r = 0; r < PE_WG_R; r++)
                for (int k = 0; k < PE_WG_NV; k++)
                    acc[r][k] = first ? (vec){0} : *(const vec *)(m + (o + r) * PE_WG_TB + k * PE_WG_V);
            for (long c = 0; c < cn; c++) {
                vec row[PE_WG_NV];
                memcpy(row, v + c * PE_WG_TB, sizeof(row));
                for (int r = 0; r < PE_WG_R; r++) {
                    PE_T s = u[(o + r) * uld + c];
                    for (int k = 0; k < PE_WG_NV; k++) acc[r][k] += s * row[k];
                }
            }
            for (int r = 0; r < PE_WG_R; r++)
                memcpy(m + (o + r) * PE_WG_TB, acc[r], sizeof(acc[r]));
        }
        for (; o < on; o++) {
            vec acc[PE_WG_NV];
            for (int k = 0; k < PE_WG_NV; k++)
                acc[k] = first ? (vec){0} : *(const vec *)(m + o * PE_WG_TB + k * PE_WG_V);
            for (long c = 0; c < cn; c++) {
                PE_T s = u[o * uld + c];
                for (int k = 0; k < PE_WG_NV; k++)
                    acc[k] += s * *(const vec *)(v + c * PE_WG_TB + k * PE_WG_V);
            }
            memcpy(m + o * PE_WG_TB, acc, sizeof(acc));
        }
    }
}

/* Y = A^T M A of each tile into the output (cut at its bottom and right edges). */
static void PE_S(pe_wg_output)(const PE_S(pe_wg) *q, const PE_T *M, long o0, long on, long t0,
                               long tn) {
    for (long o = 0; o < on; o++)
        for (long t = 0; t < tn; t++) {
            PE_T m[4][4], e[2][4];
            for (int k = 0; k < 16; k++) m[k / 4][k % 4] = M[k * PE_WG_MS + o * PE_WG_TB + t];
            for (int j = 0; j < 4; j++) {
                e[0][j] = m[0][j] + m[1][j] + m[2][j];
                e[1][j] = m[1][j] - m[2][j] - m[3][j];
            }
            long n = (t0 + t) / q->tiles, r = (t0 + t) % q->tiles;
            long y0 = r / q->tw * 2, x0 = r % q->tw * 2;
            PE_T *plane = q->out + (n * q->Cout + o0 + o) * q->OH * q->OW;
            for (int i = 0; i < 2 && y0 + i < q->OH; i++) {
                PE_T *row = plane + (y0 + i) * q->OW + x0;
                row[0] = e[i][0] + e[i][1] + e[i][2];
                if (x0 + 1 < q->OW) row[1] = e[i][1] - e[i][2] - e[i][3];
            }
        }
}

static void PE_S(pe_wg_run)(const PE_S(pe_wg) *q) {
    long total = q->N * q->tiles, blocks = (total + PE_WG_TB - 1) / PE_WG_TB;
    PE_PARALLEL_FOR(total * 16 * q->Cin * q->Cout)
    for (long b = 0; b < blocks; b++) {
        PE_T V[16 * PE_WG_VS], U[16 * PE_WG_US], M[16 * PE_WG_MS];
        long t0 = b * PE_WG_TB, tn = total - t0 < PE_WG_TB ? total - t0 : PE_WG_TB;
        for (long o0 = 0; o0 < q->Cout; o0 += PE_WG_OB) {
            long on = q->Cout - o0 < PE_WG_OB ? q->Cout - o0 : PE_WG_OB;
            for (long c0 = 0; c0 < q->Cin; c0 += PE_WG_CB) {
                long cn = q->Cin - c0 < PE_WG_CB ? q->Cin - c0 : PE_WG_CB;
                PE_S(pe_wg_input)(q, c0, cn, t0, tn, V);
                PE_S(pe_wg_filter)(q, o0, on, c0, cn, U);
                PE_S(pe_wg_multiply)(U, PE_WG_US, PE_WG_CB, V, PE_WG_VS, 16, on, cn, c0 == 0, M,
                                     PE_WG_MS);
            }
            PE_S(pe_wg_output)(q, M, o0, on, t0, tn);
        }
    }
}

/* The core's arguments for output tiles of m x m (2 or 4). */
static PE_S(pe_wg) PE_S(pe_wg_of)(const PE_T *in, const PE_T *w, PE_T *out, long N, long Cin,
                                  long H, long W, long Cout, long OH, long OW, long ph, long pw,
                                  long m) {
    PE_S(pe_wg) q = {in, w, out, N, Cin, H, W, Cout, OH, OW, ph, pw, 0, 0, 0, 0, 0};
    q.tw = (OW + m - 1) / m;
    q.tiles = (OH + m - 1) / m * q.tw;
    return q;
}

/* 3x3, stride 1, dilation 1, one group (conv_kernels.py checks before emitting). */
void PE_S(pe_conv2d_winograd)(const PE_T *x, const PE_T *w, const PE_T *bias, PE_T *y,
                              const long *g) {
    long C = g[PE_G_C], O = g[PE_G_O], ohw = g[PE_G_OH] * g[PE_G_OW];
    PE_S(pe_wg) q = PE_S(pe_wg_of)(x, w, y, g[PE_G_N], C, g[PE_G_H], g[PE_G_W], O, g[PE_G_OH],
                                   g[PE_G_OW], g[PE_G_PH], g[PE_G_PW], 2);
    q.wo = C * 9, q.wc = 9;
    PE_S(pe_wg_run)(&q);
    if (bias)
        for (long no = 0; no < g[PE_G_N] * O; no++)
            for (long p = 0; p < ohw; p++) y[no * ohw + p] += bias[no % O];
}

/* gx = gy convolved with w[o][c] turned by 180 degrees, as filters (c, o), padded 2 - p. */
void PE_S(pe_conv2d_input_grad_winograd)(const PE_T *gy, const PE_T *w, PE_T *gx,
                                         const long *g) {
    long C = g[PE_G_C], O = g[PE_G_O];
    PE_S(pe_wg) q = PE_S(pe_wg_of)(gy, w, gx, g[PE_G_N], O, g[PE_G_OH], g[PE_G_OW], C,
                                   g[PE_G_H], g[PE_G_W], 2 - g[PE_G_PH], 2 - g[PE_G_PW], 2);
    q.wo = 9, q.wc = C * 9, q.flip = 1;
    PE_S(pe_wg_run)(&q);
}

/* Winograd F(4x4, 3x3): each 4x4 output tile from a 6x6 input tile, 36 products a tile and
 * channel pair where direct convolution takes 144 (4x fewer; F(2x2, 3x3) 2.25x). The
 * transforms are vectorised across a block's tiles: each tile's 6x6 patch is gathered into
 * a column of P (one column a tile), then B^T and B are applied down the columns, every
 * tile of the block at once. The forward's (and input gradient's) transformed filters
 * U = G g G^T of the whole convolution (36 x Cout x Cin, 4x the filters) are made once a
 * call into the caller's working memory (`work`: pe_winograd4_work elements, a slot of
 * the step's memory plan), and V is transformed again for every block of PE_W4_OB output
 * channels. The weight gradient sums (A gy A^T) (.) (B^T d B) over the tiles into M in
 * the working memory and folds each filter's 6x6 to 3x3 with G^T . G. The transforms
 * multiply by up to 8 and 1/24, so rounding is larger than F(2x2, 3x3)'s: float32 results
 * agree with NumPy to about 1e-5 of the largest output.
 *
 *   B^T = [4 0 -5 0 1 0; 0 -4 -4 1 1 0; 0 4 -4 -1 1 0; 0 -2 -1 2 1 0; 0 2 -1 -2 1 0;
 *          0 4 0 -5 0 1]
 *   G = [1/4 0 0; -1/6 -1/6 -1/6; -1/6 1/6 -1/6; 1/24 1/12 1/6; 1/24 -1/12 1/6; 0 0 1]
 *   A^T = [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 0; 0 1 -1 8 -8 1] */
#define PE_W4_OB (PE_TSIZE == 4 ? 32 : 16)  /* output channels a block */
#define PE_W4_CB (PE_TSIZE == 4 ? 16 : 8)   /* input channels a block */
#define PE_W4_GOB (PE_TSIZE == 4 ? 32 : 8)  /* the weight gradient's output channels a block */
#define PE_W4_VS (PE_W4_CB * PE_WG_TB + PE_WG_V)
#define PE_W4_MS (PE_W4_OB * PE_WG_TB + PE_WG_V)
#define PE_W4_GS (PE_W4_GOB * PE_WG_TB + PE_WG_V)
#define PE_W4_WVS (PE_WG_TB * PE_WG_TB + PE_WG_V) /* the weight gradient's V: 32 channels */

/* b = B^T d of six values, into b[0], b[st], ..., b[5 st]. */
static inline void PE_S(pe_w4_bt)(PE_T d0, PE_T d1, PE_T d2, PE_T d3, PE_T d4, PE_T d5,
                                  PE_T *b, long st) {
    PE_T t1 = d4 - 4 * d2, t2 = d3 - 4 * d1, t3 = d4 - d2, t4 = 2 * (d3 - d1);
    b[0] = 4 * d0 - 5 * d2 + d4;
    b[st] = t1 + t2;
    b[2 * st] = t1 - t2;
    b[3 * st] = t3 + t4;
    b[4 * st] = t3 - t4;
    b[5 * st] = 4 * d1 - 5 * d3 + d5;
}

/* e = G g of three values, into e[0], e[st], ..., e[5 st]. */
static inline void PE_S(pe_w4_g)(PE_T g0, PE_T g1, PE_T g2, PE_T *e, long st) {
    PE_T a = g0 + g2, b = g0 * (PE_T)(1.0 / 24) + g2 * (PE_T)(1.0 / 6), c = g1 * (PE_T)(1.0 / 12);
    e[0] = g0 * (PE_T)0.25;
    e[st] = (a + g1) * (PE_T)(-1.0 / 6);
    e[2 * st] = (a - g1) * (PE_T)(-1.0 / 6);
    e[3 * st] = b + c;
    e[4 * st] = b - c;
    e[5 * st] = g2;
}

/* a = A^T m of six values, into a[0], a[st], a[2 st], a[3 st]. */
static inline void PE_S(pe_w4_at)(PE_T m0, PE_T m1, PE_T m2, PE_T m3, PE_T m4, PE_T m5,
                                  PE_T *a, long st) {
    PE_T s12 = m1 + m2, d12 = m1 - m2, s34 = m3 + m4, d34 = m3 - m4;
    a[0] = m0 + s12 + s34;
    a[st] = d12 + 2 * d34;
    a[2 * st] = s12 + 4 * s34;
    a[3 * st] = d12 + 8 * d34 + m5;
}

/* Where tile t of an output-shaped map (q's Cout channels of OH x OW) starts, channel 0,
 * and how many of its 4 rows and columns lie inside the map. */
static long PE_S(pe_w4_tile)(const PE_S(pe_wg) *q, long t, long *rows, long *cols) {
    long n = t / q->tiles, r = t % q->tiles, ya = r / q->tw * 4, xa = r % q->tw * 4;
    *rows = q->OH - ya < 4 ? q->OH - ya : 4;
    *cols = q->OW - xa < 4 ? q->OW - xa : 4;
    return n * q->Cout * q->OH * q->OW + ya * q->OW + xa;
}

/* U[xi][o][c] of every filter, planes `plane` elements apart (pe_winograd4_work's layout). */
static void PE_S(pe_w4_filters)(const PE_S(pe_wg) *q, PE_T *restrict U, long plane) {
    long wc = q->wc;
    int tap[9];
    for (int k = 0; k < 9; k++) tap[k] = q->flip ? 8 - k : k;
    PE_PARALLEL_FOR(q->Cout * q->Cin * 400)
    for (long o = 0; o < q->Cout; o++) {
        const PE_T *f = q->w + o * q->wo;
        PE_T *u = U + o * q->Cin;
        for (long c = 0; c < q->Cin; c++) {
            PE_T g[9], e[18], r[36];
            for (int k = 0; k < 9; k++) g[k] = f[c * wc + tap[k]];
            for (int j = 0; j < 3; j++) PE_S(pe_w4_g)(g[j], g[3 + j], g[6 + j], e + j, 3);
            for (int i = 0; i < 6; i++)
                PE_S(pe_w4_g)(e[3 * i], e[3 * i + 1], e[3 * i + 2], r + 6 * i, 1);
            for (int k = 0; k < 36; k++) u[k * plane + c] = r[k];
        }
    }
}

/* V[xi][c][t] for channels [c0, c0+cn) and tiles [t0, t0+tn) (tn <= TB; zeros after);
 * V's planes lie `vs` elements apart. */
static void PE_S(pe_w4_input)(const PE_S(pe_wg) *q, long c0, long cn, long t0, long tn,
                              PE_T *restrict V, long vs) {
    PE_T P[36][PE_WG_TB], E[36][PE_WG_TB];
    long y0[PE_WG_TB], x0[PE_WG_TB], base[PE_WG_TB];
    int inside[PE_WG_TB];
    long HW = q->H * q->W;
    for (long t = 0; t < tn; t++) {
        long n = (t0 + t) / q->tiles, r = (t0 + t) % q->tiles;
        y0[t] = r / q->tw * 4 - q->ph, x0[t] = r % q->tw * 4 - q->pw;
        base[t] = (n * q->Cin + c0) * HW;
        inside[t] = y0[t] >= 0 && x0[t] >= 0 && y0[t] + 6 <= q->H && x0[t] + 6 <= q->W;
    }
    for (long c = 0; c < cn; c++) {
        for (long t = 0; t < PE_WG_TB; t++) {
            if (t >= tn) {
                for (int k = 0; k < 36; k++) P[k][t] = 0;
                continue;
            }
            const PE_T *plane = q->in + base[t] + c * HW;
            if (inside[t]) {
                const PE_T *d = plane + y0[t] * q->W + x0[t];
                for (int i = 0; i < 6; i++)
                    for (int j = 0; j < 6; j++) P[6 * i + j][t] = d[i * q->W + j];
            } else {
                for (int i = 0; i < 6; i++)
                    for (int j = 0; j < 6; j++) {
                        long yy = y0[t] + i, xx = x0[t] + j;
                        int in = yy >= 0 && yy < q->H && xx >= 0 && xx < q->W;
                        P[6 * i + j][t] = in ? plane[yy * q->W + xx] : (PE_T)0;
                    }
            }
        }
        for (int j = 0; j < 6; j++) /* B^T d, a column at a time, every tile at once */
            for (long t = 0; t < PE_WG_TB; t++)
                PE_S(pe_w4_bt)(P[j][t], P[6 + j][t], P[12 + j][t], P[18 + j][t], P[24 + j][t],
                               P[30 + j][t], &E[j][t], 6 * PE_WG_TB);
        for (int i = 0; i < 6; i++) { /* (B^T d) B, a row at a time */
            const PE_T *e = E[6 * i];
            PE_T *v = V + 6 * i * vs + c * PE_WG_TB;
            for (long t = 0; t < PE_WG_TB; t++)
                PE_S(pe_w4_bt)(e[t], e[PE_WG_TB + t], e[2 * PE_WG_TB + t], e[3 * PE_WG_TB + t],
                               e[4 * PE_WG_TB + t], e[5 * PE_WG_TB + t], v + t, vs);
        }
    }
}

/* Y = A^T M A of each tile into the output (cut at its bottom and right edges). */
static void PE_S(pe_w4_output)(const PE_S(pe_wg) *q, const PE_T *M, long o0, long on, long t0,
                               long tn) {
    PE_T E[24][PE_WG_TB], Y[16][PE_WG_TB];
    for (long o = 0; o < on; o++) {
        const PE_T *m = M + o * PE_WG_TB;
        for (int j = 0; j < 6; j++) /* A^T M, a column at a time */
            for (long t = 0; t < PE_WG_TB; t++)
                PE_S(pe_w4_at)(m[j * PE_W4_MS + t], m[(6 + j) * PE_W4_MS + t],
                               m[(12 + j) * PE_W4_MS + t], m[(18 + j) * PE_W4_MS + t],
                               m[(24 + j) * PE_W4_MS + t], m[(30 + j) * PE_W4_MS + t], &E[j][t],
                               6 * PE_WG_TB);
        for (int i = 0; i < 4; i++) /* (A^T M) A, a row at a time */
            for (long t = 0; t < PE_WG_TB; t++)
                PE_S(pe_w4_at)(E[6 * i][t], E[6 * i + 1][t], E[6 * i + 2][t], E[6 * i + 3][t],
                               E[6 * i + 4][t], E[6 * i + 5][t], &Y[4 * i][t], PE_WG_TB);
        for (long t = 0; t < tn; t++) {
            long rows, cols, at = PE_S(pe_w4_tile)(q, t0 + t, &rows, &cols);
            PE_T *plane = q->out + at + (o0 + o) * q->OH * q->OW;
            for (long i = 0; i < rows; i++)
                for (long j = 0; j < cols; j++) plane[i * q->OW + j] = Y[4 * i + j][t];
        }
    }
}

/* The forward core: U into `work`, then each block of tiles. */
static void PE_S(pe_w4_run)(const PE_S(pe_wg) *q, PE_T *U) {
    long plane = q->Cout * q->Cin + PE_W4_PAD;
    PE_S(pe_w4_filters)(q, U, plane);
    long total = q->N * q->tiles, blocks = (total + PE_WG_TB - 1) / PE_WG_TB;
    PE_PARALLEL_FOR(total * 36 * q->Cout * q->Cin)
    for (long b = 0; b < blocks; b++) {
        PE_T V[36 * PE_W4_VS], M[36 * PE_W4_MS];
        long t0 = b * PE_WG_TB, tn = total - t0 < PE_WG_TB ? total - t0 : PE_WG_TB;
        for (long o0 = 0; o0 < q->Cout; o0 += PE_W4_OB) {
            long on = q->Cout - o0 < PE_W4_OB ? q->Cout - o0 : PE_W4_OB;
            for (long c0 = 0; c0 < q->Cin; c0 += PE_W4_CB) {
                long cn = q->Cin - c0 < PE_W4_CB ? q->Cin - c0 : PE_W4_CB;
                PE_S(pe_w4_input)(q, c0, cn, t0, tn, V, PE_W4_VS);
                PE_S(pe_wg_multiply)(U + o0 * q->Cin + c0, plane, q->Cin, V, PE_W4_VS, 36, on,
                                     cn, c0 == 0, M, PE_W4_MS);
            }
            PE_S(pe_w4_output)(q, M, o0, on, t0, tn);
        }
    }
}

/* 3x3, stride 1, dilation 1, one group (conv_kernels.py checks before emitting); `work`
 * holds pe_winograd4_work(0, g) elements. */
void PE_S(pe_conv2d_winograd4)(const PE_T *x, const PE_T *w, const PE_T *bias, PE_T *y,
                               const long *g, PE_T *work) {
    long C = g[PE_G_C], O = g[PE_G_O], ohw = g[PE_G_OH] * g[PE_G_OW];
    PE_S(pe_wg) q = PE_S(pe_wg_of)(x, w, y, g[PE_G_N], C, g[PE_G_H], g[PE_G_W], O, g[PE_G_OH],
                                   g[PE_G_OW], g[PE_G_PH], g[PE_G_PW], 4);
    q.wo = C * 9, q.wc = 9;
    PE_S(pe_w4_run)(&q, work);
    if (bias)
        for (long no = 0; no < g[PE_G_N] * O; no++)
            for (long p = 0; p < ohw; p++) y[no * ohw + p] += bias[no % O];
}

/* `work` holds pe_winograd4_work(1, g) elements. */
void PE_S(pe_conv2d_input_grad_winograd4)(const PE_T *gy, const PE_T *w, PE_T *gx,
                                          const long *g, PE_T *work) {
    long C = g[PE_G_C], O = g[PE_G_O];
    PE_S(pe_wg) q = PE_S(pe_wg_of)(gy, w, gx, g[PE_G_N], O, g[PE_G_OH], g[PE_G_OW], C,
                                   g[PE_G_H], g[PE_G_W], 2 - g[PE_G_PH], 2 - g[PE_G_PW], 4);
    q.wo = 9, q.wc = C * 9, q.flip = 1;
    PE_S(pe_w4_run)(&q, work);
}

/* The weight gradient by F(4x4, 3x3): gw[o][c] = G^T (sum over tiles of
 * (A gy A^T) (.) (B^T d B)) G, each 4x4 tile of the output gradient against the 6x6 input
 * tile under it. For each block of PE_WG_TB input channels and PE_W4_GOB output channels
 * (the blocks in parallel) the tiles go by PE_WG_TB at a time: V as for the forward, each
 * plane turned so the channels lie along the vector, the output gradient's tiles GY, and
 * M[xi][o][c] += sum_t GY[xi][o][t] V[xi][t][c] by the forward's multiply (V and GY on
 * the stack: about 300 KiB in float32, 380 KiB in float64). M lies in `work`, each block of
 * input channels PE_WG_TB wide; at the end each (o, c) pair's 6x6 M is folded to 3x3. */

/* a = A y of four values (A = (A^T)^T, 6 x 4), into a[0], a[st], ..., a[5 st]. */
static inline void PE_S(pe_w4_a)(PE_T y0, PE_T y1, PE_T y2, PE_T y3, PE_T *a, long st) {
    PE_T s02 = y0 + y2, s13 = y1 + y3, f02 = y0 + 4 * y2, f13 = 2 * y1 + 8 * y3;
    a[0] = y0;
    a[st] = s02 + s13;
    a[2 * st] = s02 - s13;
    a[3 * st] = f02 + f13;
    a[4 * st] = f02 - f13;
    a[5 * st] = y3;
}

/* GY[xi][o][t] = A gy A^T of each 4x4 tile of the output gradient (zeros outside its map)
 * for output channels [o0, o0+on) and tiles [t0, t0+tn); planes `gs` elements apart. */
static void PE_S(pe_w4_grad_tiles)(const PE_S(pe_wg) *q, const PE_T *gy, long o0, long on,
                                   long t0, long tn, PE_T *restrict GY, long gs) {
    PE_T P[16][PE_WG_TB], E[24][PE_WG_TB];
    for (long o = 0; o < on; o++) {
        for (long t = 0; t < PE_WG_TB; t++) {
            for (int k = 0; k < 16; k++) P[k][t] = 0;
            if (t >= tn) continue;
            long rows, cols, at = PE_S(pe_w4_tile)(q, t0 + t, &rows, &cols);
            const PE_T *plane = gy + at + (o0 + o) * q->OH * q->OW;
            for (long i = 0; i < rows; i++)
                for (long j = 0; j < cols; j++) P[4 * i + j][t] = plane[i * q->OW + j];
        }
        for (int j = 0; j < 4; j++) /* A gy, a column at a time */
            for (long t = 0; t < PE_WG_TB; t++)
                PE_S(pe_w4_a)(P[j][t], P[4 + j][t], P[8 + j][t], P[12 + j][t], &E[j][t],
                              4 * PE_WG_TB);
        for (int i = 0; i < 6; i++) { /* (A gy) A^T, a row at a time */
            PE_T *g = GY + 6 * i * gs + o * PE_WG_TB;
            for (long t = 0; t < PE_WG_TB; t++)
                PE_S(pe_w4_a)(E[4 * i][t], E[4 * i + 1][t], E[4 * i + 2][t], E[4 * i + 3][t],
                              g + t, gs);
        }
    }
}

/* g = G^T m of six values (the filter transform's transpose), into g[0], g[st], g[2 st]. */
static inline void PE_S(pe_w4_gt)(PE_T m0, PE_T m1, PE_T m2, PE_T m3, PE_T m4, PE_T m5,
                                  PE_T *g, long st) {
    PE_T s12 = m1 + m2, d12 = m1 - m2, s34 = m3 + m4, d34 = m3 - m4;
    g[0] = m0 * (PE_T)0.25 - s12 * (PE_T)(1.0 / 6) + s34 * (PE_T)(1.0 / 24);
    g[st] = -d12 * (PE_T)(1.0 / 6) + d34 * (PE_T)(1.0 / 12);
    g[2 * st] = -s12 * (PE_T)(1.0 / 6) + s34 * (PE_T)(1.0 / 6) + m5;
}

/* The sums M[xi][o][c] of one block of input and output channels over every tile. */
static void PE_S(pe_w4_weight_block)(const PE_S(pe_wg) *q, const PE_T *gy, long c0, long cn,
                                     long o0, long on, PE_T *M, long ms) {
    PE_T V[36 * PE_W4_WVS], GY[36 * PE_W4_GS];
    long total = q->N * q->tiles;
    for (long t0 = 0; t0 < total; t0 += PE_WG_TB) {
        long tn = total - t0 < PE_WG_TB ? total - t0 : PE_WG_TB;
        PE_S(pe_w4_input)(q, c0, cn, t0, tn, V, PE_W4_WVS);
        for (int xi = 0; xi < 36; xi++) { /* V[xi][c][t] -> V[xi][t][c], zeros past cn */
            PE_T *plane = V + xi * PE_W4_WVS;
            for (long c = cn; c < PE_WG_TB; c++)
                memset(plane + c * PE_WG_TB, 0, PE_WG_TB * sizeof(PE_T));
            for (long c = 0; c < PE_WG_TB; c++)
                for (long t = 0; t < c; t++) {
                    PE_T a = plane[c * PE_WG_TB + t];
                    plane[c * PE_WG_TB + t] = plane[t * PE_WG_TB + c];
                    plane[t * PE_WG_TB + c] = a;
                }
        }
        PE_S(pe_w4_grad_tiles)(q, gy, o0, on, t0, tn, GY, PE_W4_GS);
        PE_S(pe_wg_multiply)(GY, PE_W4_GS, PE_WG_TB, V, PE_W4_WVS, 36, on, tn, t0 == 0, M, ms);
    }
}

/* `work` holds pe_winograd4_work(2, g) elements: M, each block of 32 input channels apart. */
void PE_S(pe_conv2d_weight_grad_winograd4)(const PE_T *x, const PE_T *gy, PE_T *gw,
                                           const long *g, PE_T *work) {
    long C = g[PE_G_C], O = g[PE_G_O];
    PE_S(pe_wg) q = PE_S(pe_wg_of)(x, NULL, NULL, g[PE_G_N], C, g[PE_G_H], g[PE_G_W], O,
                                   g[PE_G_OH], g[PE_G_OW], g[PE_G_PH], g[PE_G_PW], 4);
    long cb = (C + PE_WG_TB - 1) / PE_WG_TB, ob = (O + PE_W4_GOB - 1) / PE_W4_GOB;
    long ms = O * cb * PE_WG_TB + PE_W4_PAD;
    PE_T *M = work;
    PE_PARALLEL_FOR(q.N * q.tiles * 36 * C * O)
    for (long b = 0; b < cb * ob; b++) {
        long c0 = b % cb * PE_WG_TB, o0 = b / cb * PE_W4_GOB;
        long cn = C - c0 < PE_WG_TB ? C - c0 : PE_WG_TB, on = O - o0 < PE_W4_GOB ? O - o0 : PE_W4_GOB;
        PE_S(pe_w4_weight_block)(&q, gy, c0, cn, o0, on, M + c0 * O + o0 * PE_WG_TB, ms);
    }
    PE_PARALLEL_FOR(O * C * 200)
    for (long o = 0; o < O; o++)
        for (long c = 0; c < C; c++) {
            PE_T e[18], *out = gw + (o * C + c) * 9;
            const PE_T *m = M + c / PE_WG_TB * PE_WG_TB * O + o * PE_WG_TB + c % PE_WG_TB;
            for (int j = 0; j < 6; j++) /* G^T M, a column at a time */
                PE_S(pe_w4_gt)(m[j * ms], m[(6 + j) * ms], m[(12 + j) * ms], m[(18 + j) * ms],
                               m[(24 + j) * ms], m[(30 + j) * ms], e + j, 6);
            for (int i = 0; i < 3; i++) /* (G^T M) G */
                PE_S(pe_w4_gt)(e[6 * i], e[6 * i + 1], e[6 * i + 2], e[6 * i + 3], e[6 * i + 4],
                               e[6 * i + 5], out + 3 * i, 1);
        }
}

#undef PE_W4_OB
#undef PE_W4_CB
#undef PE_W4_GOB
#undef PE_W4_VS
#undef PE_W4_MS
#undef PE_W4_GS
#undef PE_W4_WVS

#undef PE_WG_TB
#undef PE_WG_OB
#undef PE_WG_CB
#undef PE_WG_V
#undef PE_WG_NV
#undef PE_WG_R
#undef PE_WG_ACC
#undef PE_WG_BYTES
#undef PE_WG_VS
#undef PE_WG_US
#undef PE_WG_MS
#endif
