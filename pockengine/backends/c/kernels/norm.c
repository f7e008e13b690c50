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

/* sum g and sum g * (x - mu) * rstd over a row. */
static void PE_S(pe_row_grad_sums)(const PE_T *restrict g, const PE_T *restrict x, long n,
                                   PE_T mu, PE_T rstd, double *sb, double *sw) {
    double tb, tw;
#define PE_G(i) g[i]
#define PE_GX(i) (g[i] * ((x[i] - mu) * rstd))
    PE_LANE_SUM(PE_G, tb);
    PE_LANE_SUM(PE_GX, tw);
#undef PE_G
#undef PE_GX
    *sb += tb;
    *sw += tw;
}

void PE_S(pe_batch_norm)(const PE_T *x, const PE_T *w, const PE_T *b, PE_T *y, PE_T *mean,
                         PE_T *var, long N, long C, long S, double eps) {
    PE_PARALLEL_FOR(N * C * S)
    for (long c = 0; c < C; c++) {
        double sum = 0, sq = 0, count = (double)(N * S);
        for (long n = 0; n < N; n++) sum += PE_S(pe_row_sum)(x + (n * C + c) * S, S);
        PE_T mu = (PE_T)(sum / count);
        for (long n = 0; n < N; n++) sq += PE_S(pe_row_sqdev)(x + (n * C + c) * S, S, mu);
        PE_T v = (PE_T)(sq / count);
        PE_T scale = w[c] / (PE_T)sqrt((double)v + eps), shift = b[c];
        for (long n = 0; n < N; n++) {
            const PE_T *row = x + (n * C + c) * S;
            PE_T *restrict out = y + (n * C + c) * S;
            for (long s = 0; s < S; s++) out[s] = (row[s] - mu) * scale + shift;
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
#endif
