/* Depthwise convolution (groups = C = O: one KH x KW filter a channel; any size, stride,
 * padding and dilation) and its two gradients, vectorised along output columns.
 *
 * An input row is copied once into its padded form split into its `stride` column phases
 * (ph[q][t] = padded[t * s + q]), so that tap j of every output column ow reads
 * ph[(j*d) % s][ow + (j*d) / s]: one contiguous run whatever the stride, no branch and
 * no bounds test (the padding is zeros). The forward keeps a block of PE_DW_CH output
 * columns in registers across every tap; rows are kept in a small ring (one row per
 * input row the window spans), so each is built once per plane. The input gradient at
 * stride 1 is the forward kernel on gy with the flipped filters; at other strides it
 * accumulates into one padded row in the same phases and copies it out (at stride 2 a
 * pair of columns a step, the two phases woven back with vector shuffles); the weight
 * gradient keeps a vector of partial sums a tap (conv.c keeps its direct loops for maps
 * narrower than a vector, where they are faster). The geometry array is indexed by the
 * PE_G_* names of pe_kernels.h. Smaller planes run dw_flat.c's whole-plane kernels
 * instead (the forward and input gradient up to about 40 x 40 at stride 1, the weight
 * gradient up to about 140 x 140), which measured faster there; these row kernels take
 * the larger planes. */
#ifndef PE_T
#include "pe_kernels.h"
#include "pe_rowcopy.h"
#define PE_SELF "depthwise.c"
#include "pe_instantiate.h"
#else

#include "pe_weave.h"

#define PE_DW_CH (128 / PE_TSIZE) /* output columns in one register block: 128 bytes */

/* The shape of a plane's phase rows: pl elements a phase, s phases. */
typedef struct {
    long s, pl, pw, W, R, KW, d;
} PE_S(pe_dw_rows);

static PE_S(pe_dw_rows) PE_S(pe_dw_shape)(const long *g, long width) {
    PE_S(pe_dw_rows) r;
    r.s = g[PE_G_SW];
    r.d = g[PE_G_DW];
    r.pw = g[PE_G_PW];
    r.W = g[PE_G_W];
    r.KW = g[PE_G_KW];
    long blocks = (width + PE_DW_CH - 1) / PE_DW_CH * PE_DW_CH;
    r.pl = blocks + (r.KW - 1) * r.d / r.s + 1;
    r.R = (g[PE_G_KH] - 1) * g[PE_G_DH] + 1;
    return r;
}

/* Row `row` (W elements) padded by pw zeros on the left and split into phases. */
static void PE_S(pe_dw_phases)(const PE_T *row, const PE_S(pe_dw_rows) *r, PE_T *restrict ph) {
    if (r->s == 1 && r->pw >= 0 && r->pw + r->W <= r->pl) {
        long right = r->pl - r->pw - r->W;
        pe_zero_run(ph, (size_t)r->pw * sizeof(PE_T));
        pe_copy_run(ph + r->pw, row, (size_t)r->W * sizeof(PE_T));
        if (right > 0) pe_zero_run(ph + r->pw + r->W, (size_t)right * sizeof(PE_T));
        return;
    }
    for (long q = 0; q < r->s; q++) {
        /* phase q's columns t whose input column t*s + q - pw is inside the row: [lo, hi) */
        long off = q - r->pw, lo = off >= 0 ? 0 : (-off + r->s - 1) / r->s;
        long hi = r->W - 1 - off < 0 ? 0 : (r->W - 1 - off) / r->s + 1;
        hi = hi < r->pl ? hi : r->pl;
        lo = lo < hi ? lo : hi;
        PE_T *restrict dst = ph + q * r->pl;
        const PE_T *src = row + off; /* column t at src[t * s], read for t in [lo, hi) */
        pe_zero_run(dst, (size_t)lo * sizeof(PE_T));
        if (r->s == 2) /* a constant stride: the compiler's shuffles */
            for (long t = lo; t < hi; t++) dst[t] = src[2 * t];
        else
            for (long t = lo; t < hi; t++) dst[t] = src[t * r->s];
        pe_zero_run(dst + hi, (size_t)(r->pl - hi) * sizeof(PE_T));
    }
}

/* Where tap column j reads in a row's phases: phase (j*d) % s, shifted by (j*d) / s. */
static void PE_S(pe_dw_taps)(const PE_S(pe_dw_rows) *r, long *toff) {
    for (long j = 0; j < r->KW; j++) toff[j] = j * r->d % r->s * r->pl + j * r->d / r->s;
}

/* Output row oh of one plane: out[ow] = bias + sum of taps over the rows in the ring, two
 * vectors of PE_DW_CH / 2 columns at a time (GCC/Clang vector types, any target: one
 * 64-byte vector is a zmm register, two ymm or four NEON registers). */
typedef PE_T PE_S(pe_dw_vec) __attribute__((vector_size(64), aligned(PE_TSIZE)));
static void PE_S(pe_dw_forward_row)(const PE_T *const *rows, const PE_T *w, long KH, PE_T bias,
                                    const PE_S(pe_dw_rows) *r, const long *toff, long OW,
                                    PE_T *out) {
    enum { V = 64 / PE_TSIZE };
    long KW = r->KW;
    for (long ow0 = 0; ow0 < OW; ow0 += PE_DW_CH) {
        PE_S(pe_dw_vec) a0 = {0}, a1 = {0};
        a0 += bias;
        a1 += bias;
        if (OW - ow0 > V) {
            for (long i = 0; i < KH; i++) {
                if (!rows[i]) continue;
                for (long j = 0; j < KW; j++) {
                    PE_T wv = w[i * KW + j];
                    const PE_T *src = rows[i] + toff[j] + ow0;
                    a0 += wv * *(const PE_S(pe_dw_vec) *)src;
                    a1 += wv * *(const PE_S(pe_dw_vec) *)(src + V);
                }
            }
        } else { /* a narrow map: one vector */
            for (long i = 0; i < KH; i++) {
                if (!rows[i]) continue;
                for (long j = 0; j < KW; j++)
                    a0 += w[i * KW + j] * *(const PE_S(pe_dw_vec) *)(rows[i] + toff[j] + ow0);
            }
        }
        long n = OW - ow0 < PE_DW_CH ? OW - ow0 : PE_DW_CH;
        PE_T acc[PE_DW_CH];
        memcpy(acc, &a0, sizeof(a0));
        memcpy(acc + V, &a1, sizeof(a1));
        pe_copy_run(out + ow0, acc, (size_t)n * sizeof(PE_T));
    }
}

/* The KH tap rows of output row oh (NULL where the row is padding), built into the ring
 * (slot ih % R, tagged with its row) from the plane x. */
static void PE_S(pe_dw_window)(const PE_T *x, const long *g, const PE_S(pe_dw_rows) *r,
                               long oh, PE_T *ring, long *tags, const PE_T **rows) {
    for (long i = 0; i < g[PE_G_KH]; i++) {
        long ih = oh * g[PE_G_SH] - g[PE_G_PH] + i * g[PE_G_DH];
        if (ih < 0 || ih >= g[PE_G_H]) {
            rows[i] = NULL;
            continue;
        }
        long slot = ih % r->R;
        PE_T *ph = ring + slot * r->s * r->pl;
        if (tags[slot] != ih) {
            PE_S(pe_dw_phases)(x + ih * r->W, r, ph);
            tags[slot] = ih;
        }
        rows[i] = ph;
    }
}

/* The forward over every plane; with `flip`, each filter turned by 180 degrees (the input
 * gradient at stride 1 is that convolution of gy). */
static void PE_S(pe_dw_planes)(const PE_T *x, const PE_T *w, const PE_T *bias, PE_T *y,
                               const long *g, int flip) {
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W];
    long KH = g[PE_G_KH], KW = g[PE_G_KW], OH = g[PE_G_OH], OW = g[PE_G_OW];
    PE_S(pe_dw_rows) r = PE_S(pe_dw_shape)(g, OW);
    PE_PARALLEL_FOR(N * C * OH * OW * KH * KW)
    for (long nc = 0; nc < N * C; nc++) {
        PE_T ring[r.R * r.s * r.pl];
        long tags[r.R];
        const PE_T *rows[KH];
        long toff[KW];
        PE_S(pe_dw_taps)(&r, toff);
        for (long t = 0; t < r.R; t++) tags[t] = -1;
        long c = nc % C;
        PE_T taps[KH * KW];
        for (long k = 0; k < KH * KW; k++) taps[k] = w[c * KH * KW + (flip ? KH * KW - 1 - k : k)];
        for (long oh = 0; oh < OH; oh++) {
            PE_S(pe_dw_window)(x + nc * H * W, g, &r, oh, ring, tags, rows);
            PE_S(pe_dw_forward_row)(rows, taps, KH, bias ? bias[c] : (PE_T)0, &r, toff, OW,
                                    y + (nc * OH + oh) * OW);
        }
    }
}

void PE_S(pe_depthwise)(const PE_T *x, const PE_T *w, const PE_T *bias, PE_T *y, const long *g) {
    if (PE_S(pe_dw_flat_forward)(x, w, bias, y, g)) return;
    PE_S(pe_dw_planes)(x, w, bias, y, g, 0);
}

void PE_S(pe_depthwise_input_grad)(const PE_T *gy, const PE_T *w, PE_T *gx, const long *g) {
    if (PE_S(pe_dw_flat_input_grad)(gy, w, gx, g)) return;
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W];
    long KH = g[PE_G_KH], KW = g[PE_G_KW], OH = g[PE_G_OH], OW = g[PE_G_OW];
    long sh = g[PE_G_SH], ph = g[PE_G_PH], dh = g[PE_G_DH];
    if (sh == 1 && g[PE_G_SW] == 1) {
        /* gx = gy convolved with the flipped filters, padded by (K-1)*d - p */
        long t[PE_G_LEN];
        memcpy(t, g, sizeof(t));
        t[PE_G_H] = OH, t[PE_G_W] = OW, t[PE_G_OH] = H, t[PE_G_OW] = W;
        t[PE_G_PH] = (KH - 1) * dh - ph, t[PE_G_PW] = (KW - 1) * g[PE_G_DW] - g[PE_G_PW];
        PE_S(pe_dw_planes)(gy, w, NULL, gx, t, 1);
        return;
    }
    PE_S(pe_dw_rows) r = PE_S(pe_dw_shape)(g, OW);
    /* the padded input row must hold every column the taps reach */
    long need = (W + r.pw + r.s - 1) / r.s + 1;
    if (r.pl < need) r.pl = need;
    PE_PARALLEL_FOR(N * C * OH * OW * KH * KW)
    for (long nc = 0; nc < N * C; nc++) {
        PE_T acc[r.s * r.pl];
        long toff[KW];
        PE_S(pe_dw_taps)(&r, toff);
        const PE_T *wc = w + nc % C * KH * KW;
        for (long h = 0; h < H; h++) {
            pe_zero_run(acc, sizeof(acc));
            for (long i = 0; i < KH; i++) {
                long t = h + ph - i * dh;
                if (t < 0 || t % sh != 0 || t / sh >= OH) continue;
                const PE_T *restrict grow = gy + (nc * OH + t / sh) * OW;
                for (long j = 0; j < KW; j++) {
                    PE_T wv = wc[i * KW + j];
                    PE_T *restrict dst = acc + toff[j];
                    for (long ow = 0; ow < OW; ow++) dst[ow] += wv * grow[ow];
                }
            }
            PE_T *restrict out = gx + (nc * H + h) * W;
            if (r.s == 2) {
                PE_S(pe_weave2)(acc, acc + r.pl, r.pw, W, out);
                continue;
            }
            /* out[x] = padded[x + pw], padded[t * s + q] = phase q at t */
            for (long q = 0; q < r.s; q++) {
                long t0 = (r.pw - q + r.s - 1) / r.s; /* first t with t * s + q >= pw */
                for (long t = t0, x = t0 * r.s + q - r.pw; x < W; t++, x += r.s)
                    out[x] = acc[q * r.pl + t];
            }
        }
    }
}

/* gw[c][i][j] = sum over images and positions of gy * the tap's input: per output row,
 * one vector accumulator a tap (V columns at a time, the gradient row zero-padded to a
 * whole vector), summed into double after every 1024 positions or so. */
void PE_S(pe_depthwise_weight_grad)(const PE_T *x, const PE_T *gy, PE_T *gw, const long *g) {
    if (PE_S(pe_dw_flat_weight_grad)(x, gy, gw, g)) return;
    enum { V = 64 / PE_TSIZE };
    long N = g[PE_G_N], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W];
    long KH = g[PE_G_KH], KW = g[PE_G_KW], OH = g[PE_G_OH], OW = g[PE_G_OW];
    PE_S(pe_dw_rows) r = PE_S(pe_dw_shape)(g, OW);
    PE_PARALLEL_FOR(N * C * OH * OW * KH * KW)
    for (long c = 0; c < C; c++) {
        PE_T ring[r.R * r.s * r.pl];
        long tags[r.R], toff[KW];
        const PE_T *rows[KH];
        double acc[KH * KW];
        PE_S(pe_dw_vec) lanes[KH * KW];
        PE_S(pe_dw_taps)(&r, toff);
        memset(acc, 0, sizeof(acc));
        /* lanes go into double after at least 1024 positions (one plane or several) */
        long flush = OH * OW >= 1024 ? 1 : 1024 / (OH * OW);
        for (long k = 0; k < KH * KW; k++) lanes[k] = (PE_S(pe_dw_vec)){0};
        for (long n = 0; n < N; n++) {
            for (long t = 0; t < r.R; t++) tags[t] = -1;
            for (long oh = 0; oh < OH; oh++) {
                PE_S(pe_dw_window)(x + (n * C + c) * H * W, g, &r, oh, ring, tags, rows);
                const PE_T *grow = gy + ((n * C + c) * OH + oh) * OW;
                for (long ow0 = 0; ow0 < OW; ow0 += V) {
                    PE_S(pe_dw_vec) gv = {0};
                    long m = OW - ow0 < V ? OW - ow0 : V;
                    pe_copy_run(&gv, grow + ow0, (size_t)m * sizeof(PE_T));
                    for (long i = 0; i < KH; i++) {
                        if (!rows[i]) continue;
                        for (long j = 0; j < KW; j++)
                            lanes[i * KW + j] +=
                                gv * *(const PE_S(pe_dw_vec) *)(rows[i] + toff[j] + ow0);
                    }
                }
            }
            if ((n + 1) % flush && n + 1 < N) continue;
            for (long k = 0; k < KH * KW; k++) {
                for (int t = 0; t < V; t++) acc[k] += lanes[k][t];
                lanes[k] = (PE_S(pe_dw_vec)){0};
            }
        }
        for (long k = 0; k < KH * KW; k++) gw[c * KH * KW + k] = (PE_T)acc[k];
    }
}

#undef PE_DW_CH
#endif
