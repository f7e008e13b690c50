/* Normalisation: training-mode batch norm over (N, C, S) and layer norm over the last
 * ``cols`` elements of each row, with their backward kernels. Batch norm's statistics
 * and its gradient's two sums are taken in one pass over each row, in lanes added into
 * double, as the NumPy oracle's pairwise sums are more accurate than a float running sum. */
#ifndef PE_T
#include "pe_kernels.h"
#define PE_SELF "norm.c"
#include "pe_instantiate.h"
#else

#define PE_BLOCK 1024
/* Two sums over a row of n elements in one loop: each in two 64-byte vector accumulators
 * (GCC/Clang vector types, any target: a zmm register, two ymm or four NEON registers), so
 * the additions do not wait on each other (a single double accumulator would serialise
 * the loop) and the accumulators stay in registers; blocks of PE_BLOCK elements go into
 * double one by one, so float lanes never sum many terms; the last elements (fewer than
 * a vector) one by one in double. VEXPR(p) sets the vectors `ta` and `tb` of the terms
 * of elements p .. p + PE_NV - 1, SEXPR(i) the scalars `ta` and `tb` of element i, with the
 * same operations. */
typedef PE_T PE_S(pe_nv) __attribute__((vector_size(64), aligned(PE_TSIZE)));
#define PE_NV (64 / PE_TSIZE)
#define PE_NLOAD(p) (*(const PE_S(pe_nv) *)(p))
#define PE_SPLAT(v) ((PE_S(pe_nv)){0} + (v))
#define PE_LANE_SUM2(VEXPR, SEXPR, OUT_A, OUT_B)                                 \
    do {                                                                         \
        double ta_ = 0, tb_ = 0;                                                 \
        long s = 0;                                                              \
        while (s + PE_NV <= n) {                                                 \
            long b1_ = s + PE_BLOCK < n ? s + PE_BLOCK : n;                      \
            PE_S(pe_nv) a0_ = {0}, a1_ = {0}, c0_ = {0}, c1_ = {0}, ta, tb;      \
            for (; s + 2 * PE_NV <= b1_; s += 2 * PE_NV) {                       \
                VEXPR(s);                                                        \
                a0_ += ta, c0_ += tb;                                            \
                VEXPR(s + PE_NV);                                                \
                a1_ += ta, c1_ += tb;                                            \
            }                                                                    \
            if (s + PE_NV <= b1_) {                                              \
                VEXPR(s);                                                        \
                a0_ += ta, c0_ += tb;                                            \
                s += PE_NV;                                                      \
            }                                                                    \
            for (int l = 0; l < PE_NV; l++) {                                    \
                ta_ += (double)(a0_[l] + a1_[l]);                                \
                tb_ += (double)(c0_[l] + c1_[l]);                                \
            }                                                                    \
        }                                                                        \
        for (; s < n; s++) {                                                     \
            PE_T ta, tb;                                                         \
            SEXPR(s);                                                            \
            ta_ += (double)ta, tb_ += (double)tb;                                \
        }                                                                        \
        OUT_A = ta_, OUT_B = tb_;                                                \
    } while (0)

/* sum g and sum g * (x - mu) * rstd over a row, in one pass. */
static void PE_S(pe_row_grad_sums)(const PE_T *restrict g, const PE_T *restrict x, long n,
                                   PE_T mu, PE_T rstd, double *sb, double *sw) {
    const PE_S(pe_nv) muv = PE_SPLAT(mu), rv = PE_SPLAT(rstd);
    double tb, tw;
#define PE_GXV(p) (ta = PE_NLOAD(g + (p)), tb = ta * ((PE_NLOAD(x + (p)) - muv) * rv))
#define PE_GX(i) (ta = g[i], tb = ta * ((x[i] - mu) * rstd))
    PE_LANE_SUM2(PE_GXV, PE_GX, tb, tw);
#undef PE_GXV
#undef PE_GX
    *sb += tb;
    *sw += tw;
}

/* The same two sums of gy = gz where lo < y < hi (else 0), y = (x - mu) * scale + shift
 * formed as pe_batch_norm forms it: gy is never stored. The vector select is a bitwise and
 * with the comparisons' mask (a NaN y compares false: 0, as the scalar select). */
static void PE_S(pe_row_masked_grad_sums)(const PE_T *restrict gz, const PE_T *restrict x,
                                          long n, PE_T mu, PE_T rstd, PE_T scale, PE_T shift,
                                          PE_T lo, PE_T hi, double *sb, double *sw) {
    const PE_S(pe_nv) muv = PE_SPLAT(mu), rv = PE_SPLAT(rstd), sv = PE_SPLAT(scale);
    const PE_S(pe_nv) bv = PE_SPLAT(shift), lov = PE_SPLAT(lo), hiv = PE_SPLAT(hi);
    typedef __typeof__(muv < rv) mask_t;
    double tb, tw;
#define PE_MGXV(p)                                                         \
    do {                                                                   \
        PE_S(pe_nv) d_ = PE_NLOAD(x + (p)) - muv, y_ = d_ * sv + bv;       \
        mask_t m_ = (y_ > lov) & (y_ < hiv);                               \
        ta = (PE_S(pe_nv))((mask_t)PE_NLOAD(gz + (p)) & m_);               \
        tb = ta * (d_ * rv);                                               \
    } while (0)
#define PE_MGX(i)                                                          \
    do {                                                                   \
        PE_T y_ = (x[i] - mu) * scale + shift;                             \
        ta = (y_ > lo) & (y_ < hi) ? gz[i] : (PE_T)0;                      \
        tb = ta * ((x[i] - mu) * rstd);                                    \
    } while (0)
    PE_LANE_SUM2(PE_MGXV, PE_MGX, tb, tw);
#undef PE_MGXV
#undef PE_MGX
    *sb += tb;
    *sw += tw;
}

/* Channel c's statistics over its N rows of S in one pass: the sums of d = x - k and of
 * d * d, k the channel's first element (a shift that keeps the two sums small where the
 * mean is far from zero: the variance's cancellation is of the order of (mean - k)^2 /
 * var ulps, a few, where the raw sum of squares would lose mean^2 / var of them), in
 * PE_LANE_SUM2's lanes, into double. Returns the mean, the biased variance into *var. */
static PE_T PE_S(pe_bn_stats)(const PE_T *x, long N, long C, long S, long c, PE_T *var) {
    double s1 = 0, s2 = 0, count = (double)(N * S);
    const PE_T k = x[c * S];
    const PE_S(pe_nv) kv = PE_SPLAT(k);
    for (long i = 0; i < N; i++) {
        const PE_T *restrict row = x + (i * C + c) * S;
        double a, b;
        long n = S;
#define PE_DV(p) (ta = PE_NLOAD(row + (p)) - kv, tb = ta * ta)
#define PE_D(i) (ta = row[i] - k, tb = ta * ta)
        PE_LANE_SUM2(PE_DV, PE_D, a, b);
#undef PE_DV
#undef PE_D
        s1 += a;
        s2 += b;
    }
    double m = s1 / count, v = s2 / count - m * m;
    *var = (PE_T)(v > 0 ? v : v == v ? 0 : v); /* NaN stays NaN */
    return (PE_T)((double)k + m);
}

/* batch_norm's scale of channel c: w / sqrt(var + eps), the same expression everywhere the
 * normalised value is formed (the fused gradient recomputes it bit for bit). */
#define PE_BN_SCALE(w, v, eps) ((w) / (PE_T)sqrt((double)(v) + (eps)))

void PE_S(pe_batch_norm)(const PE_T *x, const PE_T *w, const PE_T *b, PE_T *y, PE_T *mean,
                         PE_T *var, long N, long C, long S, double eps) {
    PE_PARALLEL_FOR(N * C * S)
    for (long c = 0; c < C; c++) {
        PE_T v, mu = PE_S(pe_bn_stats)(x, N, C, S, c, &v);
        PE_T scale = PE_BN_SCALE(w[c], v, eps), shift = b[c];
        for (long n = 0; n < N; n++) {
            const PE_T *row = x + (n * C + c) * S;
            PE_T *restrict out = y + (n * C + c) * S;
            for (long s = 0; s < S; s++) out[s] = (row[s] - mu) * scale + shift;
        }
        mean[c] = mu;
        var[c] = v;
    }
}

/* batch_norm then hardtanh(lo, hi) in the output pass: the normalised tensor is never
 * stored. NaN passes through the clip, as in pe_clip. */
void PE_S(pe_batch_norm_hardtanh)(const PE_T *x, const PE_T *w, const PE_T *b, PE_T *z,
                                  PE_T *mean, PE_T *var, long N, long C, long S, double eps,
                                  double lo_, double hi_) {
    const PE_T lo = (PE_T)lo_, hi = (PE_T)hi_;
    PE_PARALLEL_FOR(N * C * S)
    for (long c = 0; c < C; c++) {
        PE_T v, mu = PE_S(pe_bn_stats)(x, N, C, S, c, &v);
        PE_T scale = PE_BN_SCALE(w[c], v, eps), shift = b[c];
        for (long n = 0; n < N; n++) {
            const PE_T *row = x + (n * C + c) * S;
            PE_T *restrict out = z + (n * C + c) * S;
            for (long s = 0; s < S; s++) {
                PE_T t = (row[s] - mu) * scale + shift;
                t = t < lo ? lo : t;
                out[s] = t > hi ? hi : t;
            }
        }
        mean[c] = mu;
        var[c] = v;
    }
}

void PE_S(pe_batch_norm_grad)(const PE_T *gy, const PE_T *x, const PE_T *w, const PE_T *mean,
                              const PE_T *var, PE_T *gx, PE_T *gw, PE_T *gb, long N, long C,
                              long S, double eps) {
    PE_PARALLEL_FOR(N * C * S)
    for (long c = 0; c < C; c++) {
        PE_T rstd = (PE_T)(1.0 / sqrt((double)var[c] + eps)), mu = mean[c];
        double sb = 0, sw = 0, n = (double)(N * S);
        for (long i = 0; i < N; i++)
            PE_S(pe_row_grad_sums)(gy + (i * C + c) * S, x + (i * C + c) * S, S, mu, rstd, &sb,
                                   &sw);
        PE_T mb = (PE_T)(sb / n), mw = (PE_T)(sw / n), k = w[c] * rstd;
        for (long i = 0; i < N; i++) {
            const PE_T *g = gy + (i * C + c) * S, *row = x + (i * C + c) * S;
            PE_T *restrict out = gx + (i * C + c) * S;
            for (long s = 0; s < S; s++) out[s] = (g[s] - mb - (row[s] - mu) * rstd * mw) * k;
        }
        gw[c] = (PE_T)sw;
        gb[c] = (PE_T)sb;
    }
}

/* batch_norm's output from given statistics (a rematerialised batch norm reading what the
 * forward pass saved), clipped to [lo, hi] when `clip`: one read of x, one write. */
void PE_S(pe_batch_norm_apply)(const PE_T *x, const PE_T *w, const PE_T *b, const PE_T *mean,
                               const PE_T *var, PE_T *z, long N, long C, long S, double eps,
                               int clip, double lo_, double hi_) {
    const PE_T lo = (PE_T)lo_, hi = (PE_T)hi_;
    PE_PARALLEL_FOR(N * C * S)
    for (long nc = 0; nc < N * C; nc++) {
        long c = nc % C;
        PE_T mu = mean[c], scale = PE_BN_SCALE(w[c], var[c], eps), shift = b[c];
        const PE_T *row = x + nc * S;
        PE_T *restrict out = z + nc * S;
        if (!clip) {
            for (long s = 0; s < S; s++) out[s] = (row[s] - mu) * scale + shift;
            continue;
        }
        for (long s = 0; s < S; s++) {
            PE_T t = (row[s] - mu) * scale + shift;
            t = t < lo ? lo : t;
            out[s] = t > hi ? hi : t;
        }
    }
}

/* The gradient through hardtanh(lo, hi) of batch_norm: gy = gz where lo < y < hi (y
 * recomputed from x, w, b and the saved statistics as pe_batch_norm forms it), then
 * batch_norm_grad of gy; neither y nor gy is stored anywhere. Two passes over gz and x: the
 * two per-channel sums together (the mask formed on the fly), then gx with the mask formed
 * again (the same operations, so the same mask). */
void PE_S(pe_batch_norm_hardtanh_grad)(const PE_T *gz, const PE_T *x, const PE_T *w,
                                       const PE_T *b, const PE_T *mean, const PE_T *var,
                                       PE_T *gx, PE_T *gw, PE_T *gb, long N, long C, long S,
                                       double eps, double lo_, double hi_) {
    const PE_T lo = (PE_T)lo_, hi = (PE_T)hi_;
    PE_PARALLEL_FOR(N * C * S)
    for (long c = 0; c < C; c++) {
        PE_T rstd = (PE_T)(1.0 / sqrt((double)var[c] + eps)), mu = mean[c];
        PE_T scale = PE_BN_SCALE(w[c], var[c], eps), shift = b[c];
        double sb = 0, sw = 0, count = (double)(N * S);
        for (long i = 0; i < N; i++)
            PE_S(pe_row_masked_grad_sums)(gz + (i * C + c) * S, x + (i * C + c) * S, S, mu, rstd,
                                          scale, shift, lo, hi, &sb, &sw);
        PE_T mb = (PE_T)(sb / count), mw = (PE_T)(sw / count), k = w[c] * rstd;
        for (long i = 0; i < N; i++) {
            const PE_T *restrict g = gz + (i * C + c) * S, *restrict row = x + (i * C + c) * S;
            PE_T *restrict out = gx + (i * C + c) * S;
            for (long s = 0; s < S; s++) {
                PE_T y = (row[s] - mu) * scale + shift;
                PE_T gy = (y > lo) & (y < hi) ? g[s] : (PE_T)0;
                out[s] = (gy - mb - (row[s] - mu) * rstd * mw) * k;
            }
        }
        gw[c] = (PE_T)sw;
        gb[c] = (PE_T)sb;
    }
}

void PE_S(pe_layer_norm)(const PE_T *x, const PE_T *w, const PE_T *b, PE_T *y, PE_T *mean,
                         PE_T *rstd, long rows, long cols, double eps) {
    PE_PARALLEL_FOR(rows * cols)
    for (long r = 0; r < rows; r++) {
        const PE_T *row = x + r * cols;
        PE_T *restrict out = y + r * cols;
        double sum = 0, sq = 0;
        for (long j = 0; j < cols; j++) sum += row[j];
        PE_T mu = (PE_T)(sum / (double)cols);
        for (long j = 0; j < cols; j++) {
            PE_T d = row[j] - mu;
            sq += (double)(d * d);
        }
        PE_T rs = (PE_T)(1.0 / sqrt(sq / (double)cols + eps));
        for (long j = 0; j < cols; j++) {
            PE_T v = (row[j] - mu) * rs;
            out[j] = w ? v * w[j] + (b ? b[j] : (PE_T)0) : v;
        }
        mean[r] = mu;
        rstd[r] = rs;
    }
}

void PE_S(pe_layer_norm_grad)(const PE_T *gy, const PE_T *x, const PE_T *w, const PE_T *mean,
                              const PE_T *rstd, PE_T *gx, PE_T *gw, PE_T *gb, long rows,
                              long cols) {
    if (gw) memset(gw, 0, sizeof(PE_T) * (size_t)cols);
    if (gb) memset(gb, 0, sizeof(PE_T) * (size_t)cols);
    for (long r = 0; r < rows; r++) {
        const PE_T *g = gy + r * cols, *row = x + r * cols;
        PE_T *restrict out = gx + r * cols;
        PE_T mu = mean[r], rs = rstd[r];
        double s1 = 0, s2 = 0; /* sum of gxhat, sum of gxhat * xhat */
        for (long j = 0; j < cols; j++) {
            PE_T xh = (row[j] - mu) * rs, gh = w ? g[j] * w[j] : g[j];
            s1 += gh;
            s2 += (double)(gh * xh);
            if (gw) gw[j] += g[j] * xh;
            if (gb) gb[j] += g[j];
        }
        PE_T m1 = (PE_T)(s1 / (double)cols), m2 = (PE_T)(s2 / (double)cols);
        for (long j = 0; j < cols; j++) {
            PE_T xh = (row[j] - mu) * rs, gh = w ? g[j] * w[j] : g[j];
            out[j] = rs * (gh - m1 - xh * m2);
        }
    }
}

#undef PE_BLOCK
#undef PE_LANE_SUM2
#undef PE_NV
#undef PE_NLOAD
#undef PE_SPLAT
#undef PE_BN_SCALE
#endif
