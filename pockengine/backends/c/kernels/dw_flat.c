/* Depthwise convolution on whole planes split into phases (depthwise.c calls these first;
 * they return 0 when a plane's scratch would pass PE_DW_FLAT_BYTES, and depthwise.c's
 * row kernels run instead).
 *
 * One channel's input plane, padded as far as the windows reach, is copied once into
 * sh x sw phase planes, P[qh][qw][a][b] = padded[a*sh + qh][b*sw + qw], each Ah rows at a
 * pitch of Bw. Tap (i, j) of output (oh, ow) then reads phase ((i*dh) % sh, (j*dw) % sw)
 * at flat index oh*Bw + ow + (i*dh / sh)*Bw + j*dw / sw: every tap is one contiguous run
 * over the flat index k = oh*Bw + ow, whatever the stride, and the whole plane (every
 * output row, the few columns between rows included) is one loop of vectors with no
 * bounds test. The columns ow >= OW of each row are computed and dropped; on the narrow
 * maps of a network's last blocks (4x4 to 8x8) that wastes a third at most, where a
 * row at a time left most of each vector empty.
 *
 *   forward        flat[k] = bias + sum_t w[t] P[t's phase][k + off_t], then each row's OW
 *   input grad     gy laid out at pitch Bw (zeros between rows); each phase plane gathers
 *                  its own taps, Pq[m] = sum_{t in q} w[t] gy[m - off_t], then gx is read
 *                  back out of the phases (any stride; no scatter, no read-modify-write)
 *   weight grad    gw[t] = sum over images and k of gy[k] P[t's phase][k + off_t]: one
 *                  vector accumulator a tap, summed into double after each image
 *
 * The geometry array is indexed by the PE_G_* names of pe_kernels.h. */
#ifndef PE_T
#include "pe_kernels.h"
#include "pe_rowcopy.h"
#define PE_SELF "dw_flat.c"
#include "pe_instantiate.h"
#else

#include "pe_weave.h"

#ifndef PE_DW_FLAT_HELPERS
#define PE_DW_FLAT_HELPERS
/* The most scratch one plane may take on the stack (phases, laid-out gradient, output):
 * the weight gradient up to 160 KiB; the forward and the input gradient while it stays in
 * half of L1 (16 KiB), beyond which depthwise.c's ring of rows measured faster (64 x 64 maps:
 * 0.8x the time of these kernels; 32 x 32 and below: 1.1-2x slower). */
#define PE_DW_FLAT_BYTES (160L * 1024)
#define PE_DW_FLAT_L1 (16L * 1024)

/* A plane's phase layout: sh x sw phases of Ah x Bw, each tap's phase base + offset. */
typedef struct {
    long sh, sw, Ah, Bw, phase, taps;
} pe_dw_flat;

static long pe_ceil_div(long a, long b) { return (a + b - 1) / b; }

static pe_dw_flat pe_dw_flat_of(const long *g) {
    pe_dw_flat f;
    f.sh = g[PE_G_SH], f.sw = g[PE_G_SW];
    long hp = (g[PE_G_OH] - 1) * f.sh + (g[PE_G_KH] - 1) * g[PE_G_DH] + 1;
    long wp = (g[PE_G_OW] - 1) * f.sw + (g[PE_G_KW] - 1) * g[PE_G_DW] + 1;
    f.Ah = pe_ceil_div(hp, f.sh);
    f.Bw = pe_ceil_div(wp, f.sw);
    f.phase = f.Ah * f.Bw;
    f.taps = g[PE_G_KH] * g[PE_G_KW];
    return f;
}

/* Tap t's offset inside its phase (ah*Bw + bw) and its phase's index. */
static void pe_dw_flat_taps(const pe_dw_flat *f, const long *g, long *off, long *phase) {
    for (long i = 0; i < g[PE_G_KH]; i++)
        for (long j = 0; j < g[PE_G_KW]; j++) {
            long t = i * g[PE_G_KW] + j, r = i * g[PE_G_DH], c = j * g[PE_G_DW];
            off[t] = r / f->sh * f->Bw + c / f->sw;
            phase[t] = r % f->sh * f->sw + c % f->sw;
        }
}

/* The first b of phase column q whose input column b*s + q - p lies in [0, W), and the
 * end of that run (clamped to [0, B]). */
static void pe_dw_flat_run(long B, long s, long q, long p, long W, long *lo, long *hi) {
    long first = p - q > 0 ? pe_ceil_div(p - q, s) : 0;
    long last = W - 1 + p - q < 0 ? -1 : (W - 1 + p - q) / s; /* largest b in range */
    *lo = first < B ? first : B;
    *hi = last + 1 < B ? last + 1 : B;
    if (*hi < *lo) *hi = *lo;
}
#endif

typedef PE_T PE_S(pe_dwf_vec) __attribute__((vector_size(64), aligned(PE_TSIZE)));
#define PE_DWF_V (64 / PE_TSIZE)
#define PE_DWF_LOAD(p) (*(const PE_S(pe_dwf_vec) *)(p))

/* The plane x (H x W) into its phases at P (sh*sw*Ah*Bw elements, then `tail` zeros). */
static void PE_S(pe_dw_flat_phases)(const PE_T *x, const long *g, const pe_dw_flat *f,
                                    PE_T *restrict P, long tail) {
    long H = g[PE_G_H], W = g[PE_G_W], ph = g[PE_G_PH], pw = g[PE_G_PW];
    for (long qh = 0; qh < f->sh; qh++)
        for (long qw = 0; qw < f->sw; qw++) {
            PE_T *base = P + (qh * f->sw + qw) * f->phase;
            long lo, hi;
            pe_dw_flat_run(f->Bw, f->sw, qw, pw, W, &lo, &hi);
            for (long a = 0; a < f->Ah; a++) {
                PE_T *restrict dst = base + a * f->Bw;
                long r = a * f->sh + qh - ph;
                if (r < 0 || r >= H || lo == hi) {
                    pe_zero_run(dst, (size_t)f->Bw * sizeof(PE_T));
                    continue;
                }
                const PE_T *src = x + r * W + qw - pw; /* column b at src[b * sw] */
                pe_zero_run(dst, (size_t)lo * sizeof(PE_T));
                if (f->sw == 1)
                    pe_copy_run(dst + lo, src + lo, (size_t)(hi - lo) * sizeof(PE_T));
                else if (f->sw == 2) /* a constant stride: the compiler's shuffles */
                    for (long b = lo; b < hi; b++) dst[b] = src[2 * b];
                else
                    for (long b = lo; b < hi; b++) dst[b] = src[b * f->sw];
                pe_zero_run(dst + hi, (size_t)(f->Bw - hi) * sizeof(PE_T));
            }
        }
    pe_zero_run(P + f->sh * f->sw * f->phase, (size_t)tail * sizeof(PE_T));
}

/* gy (OH x OW) at pitch Bw into dst, zeros between rows and for `tail` elements after. */
static void PE_S(pe_dw_flat_pitch)(const PE_T *gy, long OH, long OW, long Bw, PE_T *restrict dst,
                                   long tail) {
    for (long oh = 0; oh < OH; oh++) {
        pe_copy_run(dst + oh * Bw, gy + oh * OW, (size_t)OW * sizeof(PE_T));
        pe_zero_run(dst + oh * Bw + OW, (size_t)(Bw - OW) * sizeof(PE_T));
    }
    pe_zero_run(dst + OH * Bw, (size_t)tail * sizeof(PE_T));
}

/* out[k] = bias + sum_t w[t] src[k + off[t]] for k in [0, n) (n a multiple of 2V): four
 * vectors at a time (each tap's weight loaded once for four), then two. Every element
 * sums its taps in t order either way. */
static void PE_S(pe_dw_flat_sum)(const PE_T *src, const long *off, const PE_T *w, long taps,
                                 PE_T bias, long n, PE_T *restrict out) {
    enum { V = PE_DWF_V };
    /* the taps as vectors once: a scalar times a vector wider than the target's registers
     * is built element by element at every use (GCC, portable builds) */
    PE_S(pe_dwf_vec) wv[taps], b = {0};
    b += bias;
    for (long t = 0; t < taps; t++) wv[t] = (PE_S(pe_dwf_vec)){0} + w[t];
    long k = 0;
    for (; k + 4 * V <= n; k += 4 * V) {
        PE_S(pe_dwf_vec) a0 = b, a1 = b, a2 = b, a3 = b;
        for (long t = 0; t < taps; t++) {
            const PE_T *s = src + off[t] + k;
            a0 += wv[t] * PE_DWF_LOAD(s);
            a1 += wv[t] * PE_DWF_LOAD(s + V);
            a2 += wv[t] * PE_DWF_LOAD(s + 2 * V);
            a3 += wv[t] * PE_DWF_LOAD(s + 3 * V);
        }
        memcpy(out + k, &a0, sizeof(a0));
        memcpy(out + k + V, &a1, sizeof(a1));
        memcpy(out + k + 2 * V, &a2, sizeof(a2));
        memcpy(out + k + 3 * V, &a3, sizeof(a3));
    }
    for (; k < n; k += 2 * V) {
        PE_S(pe_dwf_vec) a0 = b, a1 = b;
        for (long t = 0; t < taps; t++) {
            const PE_T *s = src + off[t] + k;
            a0 += wv[t] * PE_DWF_LOAD(s);
            a1 += wv[t] * PE_DWF_LOAD(s + V);
        }
        memcpy(out + k, &a0, sizeof(a0));
        memcpy(out + k + V, &a1, sizeof(a1));
    }
}

static int PE_S(pe_dw_flat_fits)(const pe_dw_flat *f, long extra, long limit) {
    long elements = f->sh * f->sw * f->phase + f->Bw + 4 * PE_DWF_V + extra;
    return elements * (long)sizeof(PE_T) <= limit;
}

int PE_S(pe_dw_flat_forward)(const PE_T *x, const PE_T *w, const PE_T *bias, PE_T *y,
                             const long *g) {
    enum { V = PE_DWF_V };
    pe_dw_flat f = pe_dw_flat_of(g);
    long OH = g[PE_G_OH], OW = g[PE_G_OW], C = g[PE_G_C], HW = g[PE_G_H] * g[PE_G_W];
    long n = pe_ceil_div(OH * f.Bw, 2 * V) * 2 * V, tail = f.Bw + 2 * V;
    if (!PE_S(pe_dw_flat_fits)(&f, n, PE_DW_FLAT_L1)) return 0;
    long off[f.taps], phase[f.taps]; /* the geometry's, once: shared by every plane */
    pe_dw_flat_taps(&f, g, off, phase);
    for (long t = 0; t < f.taps; t++) off[t] += phase[t] * f.phase;
    PE_PARALLEL_FOR(g[PE_G_N] * C * OH * OW * f.taps)
    for (long nc = 0; nc < g[PE_G_N] * C; nc++) {
        PE_T P[f.sh * f.sw * f.phase + tail], flat[n];
        long c = nc % C;
        const PE_T *taps = w + c * f.taps;
        PE_S(pe_dw_flat_phases)(x + nc * HW, g, &f, P, tail);
        PE_S(pe_dw_flat_sum)(P, off, taps, f.taps, bias ? bias[c] : (PE_T)0, n, flat);
        for (long oh = 0; oh < OH; oh++)
            pe_copy_run(y + (nc * OH + oh) * OW, flat + oh * f.Bw, (size_t)OW * sizeof(PE_T));
    }
    return 1;
}

int PE_S(pe_dw_flat_input_grad)(const PE_T *gy, const PE_T *w, PE_T *gx, const long *g) {
    enum { V = PE_DWF_V };
    pe_dw_flat f = pe_dw_flat_of(g);
    long OH = g[PE_G_OH], OW = g[PE_G_OW], C = g[PE_G_C], H = g[PE_G_H], W = g[PE_G_W];
    long pw = g[PE_G_PW], nq = f.sh * f.sw, n = pe_ceil_div(f.phase, 2 * V) * 2 * V;
    long off[f.taps], phase[f.taps]; /* the geometry's, once: shared by every plane */
    pe_dw_flat_taps(&f, g, off, phase);
    long front = 0; /* the margin before gy that the taps read: the largest offset */
    for (long t = 0; t < f.taps; t++) front = off[t] > front ? off[t] : front;
    long lead = front + n; /* the laid-out gradient with its margin */
    /* which planes take these kernels is measured with a whole phase of margin, as
     * many elements as the row kernels' choice was tuned against */
    if (!PE_S(pe_dw_flat_fits)(&f, f.phase + n + 4 * V, PE_DW_FLAT_L1)) return 0;
    /* gx columns [0, cols) lie in the phases (padded column x + pw < sw * Bw); the rest
     * are past the windows' reach and get no gradient */
    long cols = f.sw * f.Bw - pw < W ? f.sw * f.Bw - pw : W;
    if (cols < 0) cols = 0;
    PE_PARALLEL_FOR(g[PE_G_N] * C * OH * OW * f.taps)
    for (long nc = 0; nc < g[PE_G_N] * C; nc++) {
        PE_T P[nq * f.phase + 2 * V], G[lead], taps[f.taps];
        long neg[f.taps];
        long c = nc % C;
        pe_zero_run(G, (size_t)front * sizeof(PE_T));
        PE_S(pe_dw_flat_pitch)(gy + nc * OH * OW, OH, OW, f.Bw, G + front, n - OH * f.Bw);
        for (long q = 0; q < nq; q++) {
            long k = 0; /* phase q's taps: Pq[m] = sum w[t] G[front + m - off[t]] */
            for (long t = 0; t < f.taps; t++)
                if (phase[t] == q) {
                    taps[k] = w[c * f.taps + t];
                    neg[k++] = front - off[t];
                }
            if (k == 0)
                pe_zero_run(P + q * f.phase, (size_t)f.phase * sizeof(PE_T));
            else
                PE_S(pe_dw_flat_sum)(G, neg, taps, k, (PE_T)0, n, P + q * f.phase);
        }
        /* gx[h][x] = padded[h + ph][x + pw]: phase ((h+ph) % sh, (x+pw) % sw) */
        for (long h = 0; h < H; h++) {
            long r = h + g[PE_G_PH], qh = r % f.sh;
            PE_T *restrict out = gx + (nc * H + h) * W;
            if (r / f.sh >= f.Ah) { /* rows no window reaches */
                pe_zero_run(out, (size_t)W * sizeof(PE_T));
                continue;
            }
            const PE_T *src = P + qh * f.sw * f.phase + r / f.sh * f.Bw;
            if (f.sw == 1)
                pe_copy_run(out, src + pw, (size_t)cols * sizeof(PE_T));
            else if (f.sw == 2)
                PE_S(pe_weave2)(src, src + f.phase, pw, cols, out);
            else
                for (long x = 0; x < cols; x++)
                    out[x] = src[(x + pw) % f.sw * f.phase + (x + pw) / f.sw];
            if (cols < W) pe_zero_run(out + cols, (size_t)(W - cols) * sizeof(PE_T));
        }
    }
    return 1;
}

int PE_S(pe_dw_flat_weight_grad)(const PE_T *x, const PE_T *gy, PE_T *gw, const long *g) {
    enum { V = PE_DWF_V };
    pe_dw_flat f = pe_dw_flat_of(g);
    long N = g[PE_G_N], C = g[PE_G_C], OH = g[PE_G_OH], OW = g[PE_G_OW];
    long HW = g[PE_G_H] * g[PE_G_W], n = pe_ceil_div(OH * f.Bw, V) * V, tail = f.Bw + 2 * V;
    if (!PE_S(pe_dw_flat_fits)(&f, n, PE_DW_FLAT_BYTES)) return 0;
    PE_PARALLEL_FOR(N * C * OH * OW * f.taps)
    for (long c = 0; c < C; c++) {
        PE_T P[f.sh * f.sw * f.phase + tail], G[n];
        long off[f.taps], phase[f.taps];
        double acc[f.taps];
        PE_S(pe_dwf_vec) lanes[f.taps];
        pe_dw_flat_taps(&f, g, off, phase);
        for (long t = 0; t < f.taps; t++) {
            off[t] += phase[t] * f.phase;
            acc[t] = 0;
        }
        for (long i = 0; i < N; i++) {
            PE_S(pe_dw_flat_phases)(x + (i * C + c) * HW, g, &f, P, tail);
            PE_S(pe_dw_flat_pitch)(gy + (i * C + c) * OH * OW, OH, OW, f.Bw, G, n - OH * f.Bw);
            for (long k0 = 0; k0 < n; k0 += 1024) { /* lanes into double every 1024 */
                long k1 = k0 + 1024 < n ? k0 + 1024 : n;
                for (long t = 0; t < f.taps; t++) lanes[t] = (PE_S(pe_dwf_vec)){0};
                for (long k = k0; k < k1; k += V) {
                    PE_S(pe_dwf_vec) gv = PE_DWF_LOAD(G + k);
                    for (long t = 0; t < f.taps; t++)
                        lanes[t] += gv * PE_DWF_LOAD(P + off[t] + k);
                }
                for (long t = 0; t < f.taps; t++)
                    for (int l = 0; l < V; l++) acc[t] += lanes[t][l];
            }
        }
        for (long t = 0; t < f.taps; t++) gw[c * f.taps + t] = (PE_T)acc[t];
    }
    return 1;
}

#undef PE_DWF_V
#undef PE_DWF_LOAD
#endif
