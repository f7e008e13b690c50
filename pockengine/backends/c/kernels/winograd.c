/* Winograd F(2x2, 3x3) convolution: dense 3x3 filters at stride 1, dilation 1, one group,
 * any padding. The forward and the input gradient (the convolution of gy with the filters
 * turned by 180 degrees and transposed, padded by 2 - p) share one core.
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
#define PE_SELF "winograd.c"
#include "pe_instantiate.h"
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

/* M[xi][o][:] (+)= sum_c U[xi][o][c] V[xi][c][:], four output channels at a time. */
static void PE_S(pe_wg_multiply)(const PE_T *U, const PE_T *V, long on, long cn, int first,
                                 PE_T *restrict M) {
    typedef PE_S(pe_wg_vec) vec;
    for (int xi = 0; xi < 16; xi++) {
        const PE_T *u = U + xi * PE_WG_US, *v = V + xi * PE_WG_VS;
        PE_T *m = M + xi * PE_WG_MS;
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
                    PE_T s = u[(o + r) * PE_WG_CB + c];
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
                PE_T s = u[o * PE_WG_CB + c];
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
                PE_S(pe_wg_multiply)(U, V, on, cn, c0 == 0, M);
            }
            PE_S(pe_wg_output)(q, M, o0, on, t0, tn);
        }
    }
}

static PE_S(pe_wg) PE_S(pe_wg_of)(const PE_T *in, const PE_T *w, PE_T *out, long N, long Cin,
                                  long H, long W, long Cout, long OH, long OW, long ph, long pw) {
    PE_S(pe_wg) q = {in, w, out, N, Cin, H, W, Cout, OH, OW, ph, pw, 0, 0, 0, 0, 0};
    q.tw = (OW + 1) / 2;
    q.tiles = (OH + 1) / 2 * q.tw;
    return q;
}

/* 3x3, stride 1, dilation 1, one group (conv_kernels.py checks before emitting). */
void PE_S(pe_conv2d_winograd)(const PE_T *x, const PE_T *w, const PE_T *bias, PE_T *y,
                              const long *g) {
    long C = g[PE_G_C], O = g[PE_G_O], ohw = g[PE_G_OH] * g[PE_G_OW];
    PE_S(pe_wg) q = PE_S(pe_wg_of)(x, w, y, g[PE_G_N], C, g[PE_G_H], g[PE_G_W], O, g[PE_G_OH],
                                   g[PE_G_OW], g[PE_G_PH], g[PE_G_PW]);
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
                                   g[PE_G_H], g[PE_G_W], 2 - g[PE_G_PH], 2 - g[PE_G_PW]);
    q.wo = 9, q.wc = C * 9, q.flip = 1;
    PE_S(pe_wg_run)(&q);
}

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
