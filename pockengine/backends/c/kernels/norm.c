/* Normalisation: training-mode batch norm over (N, C, S) and layer norm over the last
 * ``cols`` elements of each row, with their backward kernels. Statistics accumulate in
 * double (two passes: mean, then the centred sum of squares), as the NumPy oracle's
 * pairwise sums are more accurate than a float running sum. */
#ifndef PE_T
#include "pe_kernels.h"
#define PE_SELF "norm.c"
#include "pe_instantiate.h"
#else

/* Sums of a row, and of its squared deviations from mu, in eight independent lanes (the
 * compiler vectorises them; a single double accumulator would serialise the loop), then
 * added in double by the caller. */
static double PE_S(pe_row_sum)(const PE_T *restrict x, long n) {
    PE_T lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    long s = 0;
    for (; s + 8 <= n; s += 8)
        for (int l = 0; l < 8; l++) lane[l] += x[s + l];
    double total = 0;
    for (int l = 0; l < 8; l++) total += lane[l];
    for (; s < n; s++) total += x[s];
    return total;
}

static double PE_S(pe_row_sqdev)(const PE_T *restrict x, long n, PE_T mu) {
    PE_T lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    long s = 0;
    for (; s + 8 <= n; s += 8)
        for (int l = 0; l < 8; l++) lane[l] += (x[s + l] - mu) * (x[s + l] - mu);
    double total = 0;
    for (int l = 0; l < 8; l++) total += lane[l];
    for (; s < n; s++) total += (double)((x[s] - mu) * (x[s] - mu));
    return total;
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
        for (long i = 0; i < N; i++) {
            const PE_T *g = gy + (i * C + c) * S, *row = x + (i * C + c) * S;
            for (long s = 0; s < S; s++) {
                sb += g[s];
                sw += (double)(g[s] * ((row[s] - mu) * rstd));
            }
        }
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

#endif
