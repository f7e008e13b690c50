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
#define PE_LN_COLS 64 /* layer norm gradient: columns a block of gw and gb */
/* Two sums over a channel's `rows` rows of n elements (row r at r * pitch) in one loop:
 * each in two 64-byte vector accumulators (GCC/Clang vector types, any target: a zmm
 * register, two ymm or four NEON registers), so the additions do not wait on each other (a
 * single double accumulator would serialise the loop) and the accumulators stay in
 * registers across rows (short rows too fill whole vectors); every PE_BLOCK elements the
 * lanes go into double, so float lanes never sum many terms; a row's last elements (fewer
 * than a vector) go one by one into double. VEXPR(p) sets the vectors `ta` and `tb` of the
 * terms of elements p .. p + PE_NV - 1 (p = r * pitch + s), SEXPR(p) the scalars `ta` and
 * `tb` of element p, with the same operations. */
typedef PE_T PE_S(pe_nv) __attribute__((vector_size(64), aligned(PE_TSIZE)));
#define PE_NV (64 / PE_TSIZE)
#define PE_NLOAD(p) (*(const PE_S(pe_nv) *)(p))
#define PE_SPLAT(v) ((PE_S(pe_nv)){0} + (v))
#define PE_LANES_OUT()                                                           \
    do {                                                                         \
        for (int l = 0; l < PE_NV; l++) {                                        \
            ta_ += (double)(a0_[l] + a1_[l]);                                    \
            tb_ += (double)(c0_[l] + c1_[l]);                                    \
        }                                                                        \
        a0_ = a1_ = c0_ = c1_ = (PE_S(pe_nv)){0};                                \
        since_ = 0;                                                              \
    } while (0)
#define PE_LANE_SUM2(VEXPR, SEXPR, rows, pitch, OUT_A, OUT_B)                    \
    do {                                                                         \
        double ta_ = 0, tb_ = 0;                                                 \
        PE_S(pe_nv) a0_ = {0}, a1_ = {0}, c0_ = {0}, c1_ = {0}, ta, tb;          \
        long since_ = 0; /* elements in the lanes */                             \
        for (long r_ = 0; r_ < (rows); r_++) {                                   \
            long at_ = r_ * (pitch), s = 0;                                      \
            while (s + PE_NV <= n) {                                             \
                long room_ = PE_BLOCK - since_, s0_ = s;                         \
                long b1_ = s + room_ < n ? s + room_ : n;                        \
                for (; s + 2 * PE_NV <= b1_; s += 2 * PE_NV) {                   \
                    VEXPR(at_ + s);                                              \
                    a0_ += ta, c0_ += tb;                                        \
                    VEXPR(at_ + s + PE_NV);                                      \
                    a1_ += ta, c1_ += tb;                                        \
                }                                                                \
                if (s + PE_NV <= b1_) {                                          \
                    VEXPR(at_ + s);                                              \
                    a0_ += ta, c0_ += tb;                                        \
                    s += PE_NV;                                                  \
                }                                                                \
                since_ += s - s0_;                                               \
                if (since_ >= PE_BLOCK) PE_LANES_OUT();                          \
            }                                                                    \
            for (; s < n; s++) {                                                 \
                PE_T ua, ub;                                                     \
                SEXPR(at_ + s, ua, ub);                                          \
                ta_ += (double)ua, tb_ += (double)ub;                            \
            }                                                                    \
        }                                                                        \
        PE_LANES_OUT();                                                          \
        OUT_A = ta_, OUT_B = tb_;                                                \
    } while (0)

/* Over channel c's rows (g and x at the channel's first row, rows at `pitch`): sum g and
 * sum g * (x - mu) * rstd, in one pass. */
static void PE_S(pe_grad_sums)(const PE_T *restrict g, const PE_T *restrict x, long rows,
                               long pitch, long n, PE_T mu, PE_T rstd, double *sb, double *sw) {
    const PE_S(pe_nv) muv = PE_SPLAT(mu), rv = PE_SPLAT(rstd);
#define PE_GXV(p) (ta = PE_NLOAD(g + (p)), tb = ta * ((PE_NLOAD(x + (p)) - muv) * rv))
#define PE_GX(p, ua, ub) (ua = g[p], ub = ua * ((x[p] - mu) * rstd))
    PE_LANE_SUM2(PE_GXV, PE_GX, rows, pitch, *sb, *sw);
#undef PE_GXV
#undef PE_GX
}

/* The same two sums of gy = gz where lo < y < hi (else 0), y = (x - mu) * scale + shift
 * formed as pe_batch_norm forms it; gy is written into `out` as well unless it is NULL (the
 * vector select is a bitwise and with the comparisons' mask: a NaN y compares false, 0, as
 * the scalar select). */
static void PE_S(pe_masked_grad_sums)(const PE_T *restrict gz, const PE_T *restrict x,
                                      PE_T *restrict out, long rows, long pitch, long n, PE_T mu,
                                      PE_T rstd, PE_T scale, PE_T shift, PE_T lo, PE_T hi,
                                      double *sb, double *sw) {
    const PE_S(pe_nv) muv = PE_SPLAT(mu), rv = PE_SPLAT(rstd), sv = PE_SPLAT(scale);
    const PE_S(pe_nv) bv = PE_SPLAT(shift), lov = PE_SPLAT(lo), hiv = PE_SPLAT(hi);
    typedef __typeof__(muv < rv) mask_t;
#define PE_MGXV(p)                                                         \
    do {                                                                   \
        PE_S(pe_nv) d_ = PE_NLOAD(x + (p)) - muv, y_ = d_ * sv + bv;       \
        mask_t m_ = (y_ > lov) & (y_ < hiv);                               \
        ta = (PE_S(pe_nv))((mask_t)PE_NLOAD(gz + (p)) & m_);               \
        if (out) memcpy(out + (p), &ta, sizeof(ta));                       \
        tb = ta * (d_ * rv);                                               \
    } while (0)
#define PE_MGX(p, ua, ub)                                                  \
    do {                                                                   \
        PE_T y_ = (x[p] - mu) * scale + shift;                             \
        ua = (y_ > lo) & (y_ < hi) ? gz[p] : (PE_T)0;                      \
        if (out) out[p] = ua;                                              \
        ub = ua * ((x[p] - mu) * rstd);                                    \
    } while (0)
    PE_LANE_SUM2(PE_MGXV, PE_MGX, rows, pitch, *sb, *sw);
#undef PE_MGXV
#undef PE_MGX
}

/* Channel c's statistics over its N rows of S in one pass: the sums of d = x - k and of
 * d * d, k the channel's first element (a shift that keeps the two sums small where the
 * mean is far from zero: the variance's cancellation is of the order of (mean - k)^2 /
 * var ulps, a few, where the raw sum of squares would lose mean^2 / var of them), in
 * PE_LANE_SUM2's lanes, into double. Returns the mean, the biased variance into *var. */
static PE_T PE_S(pe_bn_stats)(const PE_T *x, long N, long C, long S, long c, PE_T *var) {
    double s1, s2, count = (double)(N * S);
    const PE_T *restrict row = x + c * S, k = row[0];
    const PE_S(pe_nv) kv = PE_SPLAT(k);
    long n = S;
#define PE_DV(p) (ta = PE_NLOAD(row + (p)) - kv, tb = ta * ta)
#define PE_D(p, ua, ub) (ua = row[p] - k, ub = ua * ua)
    PE_LANE_SUM2(PE_DV, PE_D, N, C * S, s1, s2);
#undef PE_DV
#undef PE_D
    double m = s1 / count, v = s2 / count - m * m;
    *var = (PE_T)(v > 0 ? v : v == v ? 0 : v); /* NaN stays NaN */
    return (PE_T)((double)k + m);
}

/* Channel c's mean, and its biased variance into *var, as pe_batch_norm takes them
 * (dw_bn.c's fused depthwise convolution). */
PE_T PE_S(pe_bn_channel_stats)(const PE_T *x, long N, long C, long S, long c, PE_T *var) {
    return PE_S(pe_bn_stats)(x, N, C, S, c, var);
}

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

/* batch_norm's gradients: gx, and gw and gb (a channel's two sums in one pass); gx NULL
 * (nothing reads it): the sums only. */
void PE_S(pe_batch_norm_grad)(const PE_T *gy, const PE_T *x, const PE_T *w, const PE_T *mean,
                              const PE_T *var, PE_T *gx, PE_T *gw, PE_T *gb, long N, long C,
                              long S, double eps) {
    PE_PARALLEL_FOR(N * C * S)
    for (long c = 0; c < C; c++) {
        PE_T rstd = (PE_T)(1.0 / sqrt((double)var[c] + eps)), mu = mean[c];
        double sb, sw, n = (double)(N * S);
        PE_S(pe_grad_sums)(gy + c * S, x + c * S, N, C * S, S, mu, rstd, &sb, &sw);
        PE_T mb = (PE_T)(sb / n), mw = (PE_T)(sw / n), k = w[c] * rstd;
        for (long i = 0; gx && i < N; i++) {
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
 * batch_norm_grad of gy; neither y nor gy is a buffer of the graph. Two passes a channel:
 * both per-channel sums in one (the mask formed on the fly), then gx. Rows of PE_BN_KEEP
 * elements or more write gy into gx in the first pass and finish it in place from gx and
 * x (measured faster on 32 x 32 maps and up); shorter rows form the mask again in the
 * second pass, with the same operations (faster on 16 x 16 maps and below). With gx NULL
 * (nothing reads it) only the sums are taken: gw and gb. */
#define PE_BN_KEEP 1024
void PE_S(pe_batch_norm_hardtanh_grad)(const PE_T *gz, const PE_T *x, const PE_T *w,
                                       const PE_T *b, const PE_T *mean, const PE_T *var,
                                       PE_T *gx, PE_T *gw, PE_T *gb, long N, long C, long S,
                                       double eps, double lo_, double hi_) {
    const PE_T lo = (PE_T)lo_, hi = (PE_T)hi_;
    PE_PARALLEL_FOR(N * C * S)
    for (long c = 0; c < C; c++) {
        PE_T rstd = (PE_T)(1.0 / sqrt((double)var[c] + eps)), mu = mean[c];
        PE_T scale = PE_BN_SCALE(w[c], var[c], eps), shift = b[c];
        double sb, sw, count = (double)(N * S);
        int keep = gx && S >= PE_BN_KEEP; /* long rows: gy kept in gx for the second pass */
        PE_S(pe_masked_grad_sums)(gz + c * S, x + c * S, keep ? gx + c * S : NULL, N, C * S, S,
                                  mu, rstd, scale, shift, lo, hi, &sb, &sw);
        PE_T mb = (PE_T)(sb / count), mw = (PE_T)(sw / count), k = w[c] * rstd;
        for (long i = 0; gx && i < N; i++) {
            const PE_T *restrict g = gz + (i * C + c) * S, *restrict row = x + (i * C + c) * S;
            PE_T *restrict out = gx + (i * C + c) * S;
            if (keep) {
                for (long s = 0; s < S; s++) out[s] = (out[s] - mb - (row[s] - mu) * rstd * mw) * k;
                continue;
            }
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

/* Layer norm: each row's statistics as pe_bn_stats takes a channel's (one pass in vector
 * lanes, shifted by the row's first element, into double). */
void PE_S(pe_layer_norm)(const PE_T *x, const PE_T *w, const PE_T *b, PE_T *y, PE_T *mean,
                         PE_T *rstd, long rows, long cols, double eps) {
    PE_PARALLEL_FOR(rows * cols)
    for (long r = 0; r < rows; r++) {
        const PE_T *row = x + r * cols;
        PE_T *restrict out = y + r * cols, var;
        PE_T mu = PE_S(pe_bn_stats)(row, 1, 1, cols, 0, &var);
        PE_T rs = (PE_T)(1.0 / sqrt((double)var + eps));
        for (long j = 0; j < cols; j++) {
            PE_T v = (row[j] - mu) * rs;
            out[j] = w ? v * w[j] + (b ? b[j] : (PE_T)0) : v;
        }
        mean[r] = mu;
        rstd[r] = rs;
    }
}

/* Over one row: sum gh and sum gh * xhat, gh = g * w (g where w is NULL), in one pass. */
static void PE_S(pe_ln_grad_sums)(const PE_T *restrict g, const PE_T *restrict x,
                                  const PE_T *restrict w, long n, PE_T mu, PE_T rstd,
                                  double *s1, double *s2) {
    const PE_S(pe_nv) muv = PE_SPLAT(mu), rv = PE_SPLAT(rstd);
#define PE_LNV(p) (ta = PE_NLOAD(g + (p)) * PE_NLOAD(w + (p)), tb = ta * ((PE_NLOAD(x + (p)) - muv) * rv))
#define PE_LN(p, ua, ub) (ua = g[p] * w[p], ub = ua * ((x[p] - mu) * rstd))
    if (w)
        PE_LANE_SUM2(PE_LNV, PE_LN, 1, n, *s1, *s2);
    else
        PE_S(pe_grad_sums)(g, x, 1, n, n, mu, rstd, s1, s2);
#undef PE_LNV
#undef PE_LN
}

/* gx row by row (rows split across threads), then gw and gb column by column (the columns
 * split), each summed over the rows in order, so no result depends on the thread count. */
void PE_S(pe_layer_norm_grad)(const PE_T *gy, const PE_T *x, const PE_T *w, const PE_T *mean,
                              const PE_T *rstd, PE_T *gx, PE_T *gw, PE_T *gb, long rows,
                              long cols) {
    PE_PARALLEL_FOR(rows * cols)
    for (long r = 0; r < rows; r++) {
        const PE_T *g = gy + r * cols, *row = x + r * cols;
        PE_T *restrict out = gx + r * cols;
        PE_T mu = mean[r], rs = rstd[r];
        double s1, s2; /* sum of gxhat, sum of gxhat * xhat */
        PE_S(pe_ln_grad_sums)(g, row, w, cols, mu, rs, &s1, &s2);
        PE_T m1 = (PE_T)(s1 / (double)cols), m2 = (PE_T)(s2 / (double)cols);
        for (long j = 0; j < cols; j++) {
            PE_T xh = (row[j] - mu) * rs, gh = w ? g[j] * w[j] : g[j];
            out[j] = rs * (gh - m1 - xh * m2);
        }
    }
    if (!gw && !gb)
        return;
    long blocks = (cols + PE_LN_COLS - 1) / PE_LN_COLS;
    PE_PARALLEL_FOR(rows * cols)
    for (long blk = 0; blk < blocks; blk++) {
        long j0 = blk * PE_LN_COLS, n = cols - j0 < PE_LN_COLS ? cols - j0 : PE_LN_COLS;
        PE_T sw[PE_LN_COLS] = {0}, sb[PE_LN_COLS] = {0};
        for (long r = 0; r < rows; r++) {
            const PE_T *restrict g = gy + r * cols + j0, *restrict row = x + r * cols + j0;
            PE_T mu = mean[r], rs = rstd[r];
            for (long j = 0; j < n; j++) {
                sw[j] += g[j] * ((row[j] - mu) * rs);
                sb[j] += g[j];
            }
        }
        if (gw) memcpy(gw + j0, sw, sizeof(PE_T) * (size_t)n);
        if (gb) memcpy(gb + j0, sb, sizeof(PE_T) * (size_t)n);
    }
}

#undef PE_BLOCK
#undef PE_LN_COLS
#undef PE_LANE_SUM2
#undef PE_LANES_OUT
#undef PE_NV
#undef PE_NLOAD
#undef PE_SPLAT
#undef PE_BN_KEEP
#endif
