/* Normalisation: training-mode batch norm over (N, C, S) and layer norm over the last
 * ``cols`` elements of each row, with their backward kernels. Statistics accumulate in
 * double (two passes: mean, then the centred sum of squares), as the NumPy oracle's
 * pairwise sums are more accurate than a float running sum. */
#ifndef PE_T
#include "pe_kernels.h"
#define PE_SELF "norm.c"
#include "pe_instantiate.h"
#else

/* Sums of a row, of its squared deviations from mu, and of the products of two rows, in
 * PE_LANES independent lanes (the compiler vectorises them into several registers, so
 * the additions do not wait on each other; a single double accumulator would serialise
 * the loop; rows of at least 8 * PE_LANES), 8 lanes for what is left, then added in
 * double. Blocks of PE_BLOCK elements go into double one by one, so float lanes never sum
 * many terms. */
#define PE_LANES 32
#define PE_BLOCK 1024
#define PE_LANE_SUM(EXPR, OUT)                                                \
    do {                                                                      \
        double total_ = 0;                                                    \
        long s = 0;                                                           \
        for (long b0 = 0; n >= 8 * PE_LANES && b0 + PE_LANES <= n; b0 += PE_BLOCK) { \
            long b1 = b0 + PE_BLOCK < n ? b0 + PE_BLOCK : n;                  \
            PE_T lane[PE_LANES] = {0};                                        \
            for (s = b0; s + PE_LANES <= b1; s += PE_LANES)                   \
                for (int l = 0; l < PE_LANES; l++) lane[l] += EXPR(s + l);    \
            for (int l = 0; l < 8; l++)                                       \
                total_ += lane[l] + lane[l + 8] + (lane[l + 16] + lane[l + 24]); \
            if (b1 < n) s = b1;                                               \
        }                                                                     \
        PE_T lane8[8] = {0};                                                  \
        for (; s + 8 <= n; s += 8)                                            \
            for (int l = 0; l < 8; l++) lane8[l] += EXPR(s + l);              \
        for (int l = 0; l < 8; l++) total_ += lane8[l];                       \
        for (; s < n; s++) total_ += (double)(EXPR(s));                       \
        OUT = total_;                                                         \
    } while (0)

/* Two sums over one row in the same loop, lane by lane as PE_LANE_SUM takes each of them
 * (each result equals PE_LANE_SUM's bit for bit): one read of the row for both. EXPR(i)
 * sets the two terms of element i, `ta` and `tb` (PE_T), for the two sums. */
#define PE_LANE_SUM2(EXPR, OUT_A, OUT_B)                                      \
    do {                                                                      \
        double ta_ = 0, tb_ = 0;                                              \
        long s = 0;                                                           \
        for (long b0 = 0; n >= 8 * PE_LANES && b0 + PE_LANES <= n; b0 += PE_BLOCK) { \
            long b1 = b0 + PE_BLOCK < n ? b0 + PE_BLOCK : n;                  \
            PE_T la[PE_LANES] = {0}, lb[PE_LANES] = {0};                      \
            for (s = b0; s + PE_LANES <= b1; s += PE_LANES)                   \
                for (int l = 0; l < PE_LANES; l++) {                          \
                    PE_T ta, tb;                                              \
                    EXPR(s + l);                                              \
                    la[l] += ta;                                              \
                    lb[l] += tb;                                              \
                }                                                             \
            for (int l = 0; l < 8; l++) {                                     \
                ta_ += la[l] + la[l + 8] + (la[l + 16] + la[l + 24]);         \
                tb_ += lb[l] + lb[l + 8] + (lb[l + 16] + lb[l + 24]);         \
            }                                                                 \
            if (b1 < n) s = b1;                                               \
        }                                                                     \
        PE_T la8[8] = {0}, lb8[8] = {0};                                      \
        for (; s + 8 <= n; s += 8)                                            \
            for (int l = 0; l < 8; l++) {                                     \
                PE_T ta, tb;                                                  \
                EXPR(s + l);                                                  \
                la8[l] += ta;                                                 \
                lb8[l] += tb;                                                 \
            }                                                                 \
        for (int l = 0; l < 8; l++) ta_ += la8[l], tb_ += lb8[l];             \
        for (; s < n; s++) {                                                  \
            PE_T ta, tb;                                                      \
            EXPR(s);                                                          \
            ta_ += (double)ta, tb_ += (double)tb;                             \
        }                                                                     \
        OUT_A = ta_, OUT_B = tb_;                                             \
    } while (0)

static double PE_S(pe_row_sum)(const PE_T *restrict x, long n) {
    double out;
#define PE_X(i) x[i]
    PE_LANE_SUM(PE_X, out);
#undef PE_X
    return out;
}

static double PE_S(pe_row_sqdev)(const PE_T *restrict x, long n, PE_T mu) {
    double out;
#define PE_SQ(i) ((x[i] - mu) * (x[i] - mu))
    PE_LANE_SUM(PE_SQ, out);
#undef PE_SQ
    return out;
}

/* sum g and sum g * (x - mu) * rstd over a row, in one pass. */
static void PE_S(pe_row_grad_sums)(const PE_T *restrict g, const PE_T *restrict x, long n,
                                   PE_T mu, PE_T rstd, double *sb, double *sw) {
    double tb, tw;
#define PE_GX(i) (ta = g[i], tb = g[i] * ((x[i] - mu) * rstd))
    PE_LANE_SUM2(PE_GX, tb, tw);
#undef PE_GX
    *sb += tb;
    *sw += tw;
}

/* The same two sums of gy = gz where lo < y < hi (else 0), y = (x - mu) * scale + shift
 * formed as pe_batch_norm forms it: gy is never stored. */
static void PE_S(pe_row_masked_grad_sums)(const PE_T *restrict gz, const PE_T *restrict x,
                                          long n, PE_T mu, PE_T rstd, PE_T scale, PE_T shift,
                                          PE_T lo, PE_T hi, double *sb, double *sw) {
    double tb, tw;
#define PE_MGX(i)                                                  \
    do {                                                           \
        PE_T y_ = (x[i] - mu) * scale + shift;                     \
        ta = (y_ > lo) & (y_ < hi) ? gz[i] : (PE_T)0;              \
        tb = ta * ((x[i] - mu) * rstd);                            \
    } while (0)
    PE_LANE_SUM2(PE_MGX, tb, tw);
#undef PE_MGX
    *sb += tb;
    *sw += tw;
}

/* Channel c's statistics over its N rows of S (two passes in double: the mean, then the
 * centred sum of squares); returns the mean, the biased variance into *var. */
static PE_T PE_S(pe_bn_stats)(const PE_T *x, long N, long C, long S, long c, PE_T *var) {
    double sum = 0, sq = 0, count = (double)(N * S);
    for (long n = 0; n < N; n++) sum += PE_S(pe_row_sum)(x + (n * C + c) * S, S);
    PE_T mu = (PE_T)(sum / count);
    for (long n = 0; n < N; n++) sq += PE_S(pe_row_sqdev)(x + (n * C + c) * S, S, mu);
    *var = (PE_T)(sq / count);
    return mu;
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

#undef PE_LANES
#undef PE_BLOCK
#undef PE_LANE_SUM
#undef PE_LANE_SUM2
#undef PE_BN_SCALE
#endif
