/* The loss head's forward and its weight gradient with each logit made once
 * (loss.c's merged op, ``linear_log_softmax_gather_with_grad``, when gw is asked for).
 *
 * The weight gradient needs each row's final log-sum-exp before any of its products, so
 * loss.c's tile-by-tile kernel makes every logit twice: once for the forward and the input
 * gradient, once more for gw. Here the [rows, V] logits are made once and kept in gw's own
 * buffer, which is free until gw is written and holds them when rows <= K (gw has V * K
 * elements): vocabulary tile j's logits (PE_ONCE_COLS entries) lie inside the part of gw
 * that tile j's gradient will fill, so the tiles' gradients can be written in any order,
 * by any thread, each after copying its own logits out. In [K, V] (w not `major`) the
 * logits are the first rows of gw, row-major with row stride V; in [V, K] (`major`) tile j
 * is a [rows, cols] block at gw + j0 * K.
 *
 * Three products where loss.c's pair of passes takes four: the logits (one GEMM over the
 * whole vocabulary), gx = dz w (one GEMM) and, tile by tile, gw = dz^T x; between them, per
 * row, the maximum, the log-sum-exp and dz = scale * softmax(z) + gp * onehot(target) in
 * place. Threads split the GEMMs, the rows, then the tiles: no two share an output, so
 * results do not depend on the thread count. Returns 0, touching nothing, where it does
 * not apply (rows > K, or more rows than a tile copy on the stack holds). */
#ifndef PE_T
#include "pe_kernels.h"
#include "pe_exp.h"
#include <tgmath.h>
#define PE_SELF "loss_once.c"
#include "pe_instantiate.h"
#else

#ifndef PE_ONCE_HELPERS
#define PE_ONCE_HELPERS
/* Vocabulary entries a tile; rows at most (a tile's copy on the stack: 256 KiB in float). */
enum { PE_ONCE_COLS = 128, PE_ONCE_ROWS = 512 };

/* Where tile j0's logits lie: their first element's offset in gw, and their row stride. */
static long pe_once_tile(long j0, long cols, long K, long V, int major, long *ld) {
    *ld = major ? cols : V;
    return major ? j0 * K : j0;
}
#endif

#if PE_TSIZE == 4
#define PE_ONCE_EXP pe_exp32 /* pe_exp.h: the row loops vectorise */
#else
#define PE_ONCE_EXP exp
#endif

/* z = x w^T (+ b) into the tiles (the full tiles of a `major` w as one product whose
 * columns jump tile to tile, the short last tile as another). */
static void PE_S(pe_once_logits)(const PE_T *x, const PE_T *w, const PE_T *b, PE_T *z, long n,
                                 long K, long V, int major) {
    if (!major) {
        PE_S(pe_gemm)(n, V, K, x, K, 0, w, V, 0, z, V, 0);
    } else {
        long full = V / PE_ONCE_COLS * PE_ONCE_COLS;
        pe_layout lc = {PE_ONCE_COLS, 1, PE_ONCE_COLS, PE_ONCE_COLS * K, 2};
        pe_layout lx = {K, 1, 0, 0, 0}, lw = {1, K, 0, 0, 0};
        PE_S(pe_gemm_strided)(n, full, K, x, lx, w, lw, z, lc, 0);
        if (full < V)
            PE_S(pe_gemm)(n, V - full, K, x, K, 0, w + full * K, K, 1, z + full * K, V - full,
                          0);
    }
    if (!b)
        return;
    for (long j0 = 0; j0 < V; j0 += PE_ONCE_COLS) {
        long cols = V - j0 < PE_ONCE_COLS ? V - j0 : PE_ONCE_COLS, ld;
        PE_T *t = z + pe_once_tile(j0, cols, K, V, major, &ld);
        for (long r = 0; r < n; r++)
            for (long c = 0; c < cols; c++) t[r * ld + c] += b[j0 + c];
    }
}

#include "pe_rowred.h"

/* row[c] = e^(row[c] - m) for c < cols; returns their sum, in 16 lanes added in order (the
 * loop vectorises). */
static PE_T PE_S(pe_once_exp_sum)(PE_T *restrict row, long cols, PE_T m) {
    PE_T lane[16] = {0}, total = 0;
    long c = 0;
    for (; c + 16 <= cols; c += 16)
        for (int l = 0; l < 16; l++) {
            row[c + l] = PE_ONCE_EXP(row[c + l] - m);
            lane[l] += row[c + l];
        }
    for (int l = 0; l < 16; l++) total += lane[l];
    for (; c < cols; c++) {
        row[c] = PE_ONCE_EXP(row[c] - m);
        total += row[c];
    }
    return total;
}

/* Row r's logits in tile j0 (cols of them). */
static PE_T *PE_S(pe_once_row_at)(PE_T *z, long r, long j0, long cols, long K, long V,
                                  int major) {
    long ld, at = pe_once_tile(j0, cols, K, V, major, &ld);
    return z + at + r * ld;
}

/* Row r of the logits: picked[r] and lse[r], then the row becomes
 * dz = scale * e^(z - top) / sum + gp * onehot(target) in place (softmax from the sum's own
 * terms: one exponential a logit). */
static void PE_S(pe_once_row)(PE_T *z, long r, const PE_T *gp, const PE_T *scale,
                              const void *index, int wide, PE_T *picked, PE_T *lse, long K,
                              long V, int major) {
    long t = wide ? (long)((const int64_t *)index)[r] : (long)((const int32_t *)index)[r];
    PE_T top = -INFINITY, hit = NAN; /* NaN: a target outside [0, V) */
    double total = 0;
    for (long j0 = 0; j0 < V; j0 += PE_ONCE_COLS) {
        long cols = V - j0 < PE_ONCE_COLS ? V - j0 : PE_ONCE_COLS;
        top = PE_S(pe_row_max)(PE_S(pe_once_row_at)(z, r, j0, cols, K, V, major), cols, top);
    }
    for (long j0 = 0; j0 < V; j0 += PE_ONCE_COLS) {
        long cols = V - j0 < PE_ONCE_COLS ? V - j0 : PE_ONCE_COLS;
        PE_T *row = PE_S(pe_once_row_at)(z, r, j0, cols, K, V, major);
        if (t >= j0 && t < j0 + cols)
            hit = row[t - j0];
        total += (double)PE_S(pe_once_exp_sum)(row, cols, top);
    }
    PE_T m = top + (PE_T)log(total), f = scale[r] / (PE_T)total;
    lse[r] = m, picked[r] = hit - m;
    for (long j0 = 0; j0 < V; j0 += PE_ONCE_COLS) {
        long cols = V - j0 < PE_ONCE_COLS ? V - j0 : PE_ONCE_COLS;
        PE_T *row = PE_S(pe_once_row_at)(z, r, j0, cols, K, V, major);
        for (long c = 0; c < cols; c++) row[c] *= f;
        if (t >= j0 && t < j0 + cols)
            row[t - j0] += gp[r];
    }
}

/* gx = dz w: one product over the tiles (as pe_once_logits reads them). */
static void PE_S(pe_once_grad_x)(const PE_T *z, const PE_T *w, PE_T *gx, long n, long K, long V,
                                 int major) {
    if (!major) {
        PE_S(pe_gemm)(n, K, V, z, V, 0, w, V, 1, gx, K, 0);
        return;
    }
    long full = V / PE_ONCE_COLS * PE_ONCE_COLS;
    pe_layout lz = {PE_ONCE_COLS, 1, PE_ONCE_COLS, PE_ONCE_COLS * K, 2};
    pe_layout lw = {K, 1, 0, 0, 0}, lg = {K, 1, 0, 0, 0};
    PE_S(pe_gemm_strided)(n, K, full, z, lz, w, lw, gx, lg, 0);
    if (full < V)
        PE_S(pe_gemm)(n, K, V - full, z + full * K, V - full, 0, w + full * K, K, 0, gx, K,
                      full > 0);
}

/* Tile by tile: its dz copied out, gb's entries (its column sums), then gw's part. */
static void PE_S(pe_once_grad_w)(const PE_T *x, PE_T *gw, PE_T *gb, long n, long K, long V,
                                 int major) {
    long tiles = (V + PE_ONCE_COLS - 1) / PE_ONCE_COLS;
    PE_PARALLEL_FOR(2 * n * V * K)
    for (long tile = 0; tile < tiles; tile++) {
        PE_T dz[PE_ONCE_ROWS * PE_ONCE_COLS]; /* on the stack: this tile's dz */
        long j0 = tile * PE_ONCE_COLS, cols = V - j0 < PE_ONCE_COLS ? V - j0 : PE_ONCE_COLS, ld;
        PE_T *at = gw + pe_once_tile(j0, cols, K, V, major, &ld);
        for (long r = 0; r < n; r++)
            memcpy(dz + r * cols, at + r * ld, (size_t)cols * sizeof(PE_T));
        if (gb)
            for (long c = 0; c < cols; c++) {
                PE_T sum = 0;
                for (long r = 0; r < n; r++) sum += dz[r * cols + c];
                gb[j0 + c] = sum;
            }
        if (major) /* gw[j0 + c][k] = sum_r dz[r][c] x[r][k] */
            PE_S(pe_gemm)(cols, K, n, dz, cols, 1, x, K, 0, at, K, 0);
        else /* gw[k][j0 + c] = sum_r x[r][k] dz[r][c] */
            PE_S(pe_gemm)(K, cols, n, x, K, 1, dz, cols, 0, at, V, 0);
    }
}

int PE_S(pe_loss_once)(const PE_T *gp, const PE_T *scale, const PE_T *x, const PE_T *w,
                       const void *index, int wide, const PE_T *b, PE_T *picked, PE_T *lse,
                       PE_T *gx, PE_T *gw, PE_T *gb, long rows, long K, long V, int major) {
    if (!gw || rows > K || rows > PE_ONCE_ROWS || rows < 1 || V < 1)
        return 0;
    PE_S(pe_once_logits)(x, w, b, gw, rows, K, V, major);
    PE_PARALLEL_FOR(rows * V * 8)
    for (long r = 0; r < rows; r++)
        PE_S(pe_once_row)(gw, r, gp, scale, index, wide, picked, lse, K, V, major);
    if (gx)
        PE_S(pe_once_grad_x)(gw, w, gx, rows, K, V, major);
    PE_S(pe_once_grad_w)(x, gw, gb, rows, K, V, major);
    return 1;
}

#undef PE_ONCE_EXP
#endif
