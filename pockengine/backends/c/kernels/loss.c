/* The large-vocabulary loss head (ops/fused_loss.py): the final linear layer, log-softmax
 * and target gather as one op, and its backward kernel, so the [rows, vocab] logits and
 * their gradient never exist. Logits are made one tile at a time (PE_LOSS_ROWS rows x
 * PE_LOSS_COLS vocabulary entries, on the stack) by the GEMM; the forward keeps a running
 * max and sum per row (online log-sum-exp), the backward recomputes each tile's
 * probabilities from the saved log-sum-exp. Square tiles: each packed slice of w serves
 * 128 rows (16 x 1024 tiles re-packed all of w for every 16 rows: 1.9x slower). The
 * exponentials are pe_exp32 in float (pe_exp.h: branch-free, so a tile's loop vectorises).
 *
 * w is [K, V], or [V, K] when `major` (an nn.Linear weight or a tied embedding); b is
 * [V] or NULL. The pe_qlinear_* entry points take a low-bit [V, K] table (pe_quant.h's
 * pe_qmat: a tied, quantized LM head) whose tiles of logits and input-gradient products
 * read the codes through the low-bit GEMM (lowbit_gemm.c), with no weight or bias, in
 * chunks of PE_QLOSS_ROWS rows (64 Ki elements of logits on the stack) so that each tile
 * of codes is dequantised once per product for a step's tokens; index holds int64
 * (`wide`) or int32 targets in [0, V).
 *
 * Threads never share an output, so results do not depend on the thread count: the
 * forward and the input gradient split the rows, the weight and bias gradients split the
 * vocabulary. With both gradients the tiles' logits are recomputed once for each (one
 * GEMM more than a single pass, which would have to sum the threads' input gradients).
 * The merged op (forward and gradients together) makes each row chunk's logits once for
 * the forward and the input gradient (pe_linear_log_softmax_gather_with_grad); with the
 * weight gradient too, where the rows' logits fit in gw's buffer (rows <= K), loss_once.c
 * makes each logit once for all three. */
#ifndef PE_T
#include "pe_kernels.h"
#include "pe_exp.h"
#include <tgmath.h>
#define PE_SELF "loss.c"
#include "pe_instantiate.h"
#else

#include "pe_rowred.h"

#ifndef PE_LOSS_HELPERS
#define PE_LOSS_HELPERS
/* Rows a chunk: 128 for a float w; 512 for a low-bit table, whose tiles of codes are
 * dequantised once per chunk and product (a training step's 512 tokens: once each). */
enum { PE_LOSS_ROWS = 128, PE_LOSS_COLS = 128, PE_QLOSS_ROWS = 512 };

/* Rows a chunk: at most `cap`, and few enough that every thread gets a chunk. */
static long pe_loss_chunk(long rows, long cap) {
    long threads = 1;
#ifdef _OPENMP
    if (!omp_in_parallel()) threads = omp_get_max_threads();
#endif
    long even = (rows + threads - 1) / threads;
    return even < cap ? (even > 0 ? even : 1) : cap;
}

static long pe_loss_target(const void *index, int wide, long r) {
    return wide ? (long)((const int64_t *)index)[r] : (long)((const int32_t *)index)[r];
}

static long pe_loss_min(long a, long b) { return a < b ? a : b; }
#endif

/* e^x: pe_exp32 in float (pe_exp.h: the loops over a tile vectorise), libm's in double. */
static inline PE_T PE_S(pe_loss_exp)(PE_T x) {
#if PE_TSIZE == 4
    return pe_exp32(x);
#else
    return exp(x);
#endif
}

/* row[c] = s * e^(row[c] - m) for c < n: blocks of 16 independent lanes (a constant trip
 * count, which -O2 vectorises too). */
static void PE_S(pe_loss_exp_row)(PE_T *restrict row, long n, PE_T m, PE_T s) {
    long c = 0;
    for (; c + 16 <= n; c += 16) {
        PE_T *restrict p = row + c;
        for (int l = 0; l < 16; l++) p[l] = s * PE_S(pe_loss_exp)(p[l] - m);
    }
    for (; c < n; c++) row[c] = s * PE_S(pe_loss_exp)(row[c] - m);
}

/* z[r][c] = x[r0 + r] . w[:, j0 + c] (+ b[j0 + c]): one tile of logits, `cols` a row. */
static void PE_S(pe_loss_tile)(const PE_T *x, const PE_T *w, const pe_qmat *qw, const PE_T *b,
                               long K, long V, int major, long r0, long rows, long j0, long cols,
                               PE_T *z) {
    if (qw) /* a low-bit [V, K] table: its rows dequantised as the GEMM packs them */
        PE_S(pe_qgemm)(rows, cols, K, x + r0 * K, K, qw, j0, 1, z, cols, 0);
    else if (major)
        PE_S(pe_gemm)(rows, cols, K, x + r0 * K, K, 0, w + j0 * K, K, 1, z, cols, 0);
    else
        PE_S(pe_gemm)(rows, cols, K, x + r0 * K, K, 0, w + j0, V, 0, z, cols, 0);
    if (b)
        for (long r = 0; r < rows; r++)
            for (long c = 0; c < cols; c++) z[r * cols + c] += b[j0 + c];
}

/* dz = scale * exp(z - lse) + gp * onehot(target) over one tile, in place. */
static void PE_S(pe_loss_dz)(PE_T *z, const PE_T *gp, const PE_T *scale, const PE_T *lse,
                             const void *index, int wide, long r0, long rows, long j0,
                             long cols) {
    for (long r = 0; r < rows; r++) {
        PE_T *row = z + r * cols;
        PE_S(pe_loss_exp_row)(row, cols, lse[r0 + r], scale[r0 + r]);
        long t = pe_loss_target(index, wide, r0 + r) - j0;
        if (t >= 0 && t < cols) row[t] += gp[r0 + r];
    }
}

/* acc += g * W[t] for a low-bit table's row t, dequantised a segment at a time. */
static void PE_S(pe_loss_add_row)(PE_T *acc, PE_T g, const pe_qmat *w, long t, long K) {
    PE_T line[256];
    for (long k0 = 0; k0 < K; k0 += 256) {
        long n = pe_loss_min(256, K - k0);
        PE_S(pe_qrow)(w, t, k0, n, line);
        for (long k = 0; k < n; k++) acc[k0 + k] += g * line[k];
    }
}

/* gx = dz w^T, rows split across threads. */
static void PE_S(pe_loss_grad_x)(const PE_T *gp, const PE_T *scale, const PE_T *x,
                                 const PE_T *w, const pe_qmat *qw, const void *index, int wide, const PE_T *lse,
                                 const PE_T *b, PE_T *gx, long rows, long K, long V,
                                 int major) {
    long step = pe_loss_chunk(rows, qw ? PE_QLOSS_ROWS : PE_LOSS_ROWS);
    long chunks = (rows + step - 1) / step;
    PE_PARALLEL_FOR(2 * rows * V * K)
    for (long ch = 0; ch < chunks; ch++) {
        PE_T z[PE_QLOSS_ROWS * PE_LOSS_COLS];
        long r0 = ch * step, n = pe_loss_min(step, rows - r0);
        memset(gx + r0 * K, 0, (size_t)(n * K) * sizeof(PE_T));
        for (long j0 = 0; j0 < V; j0 += PE_LOSS_COLS) {
            long cols = pe_loss_min(PE_LOSS_COLS, V - j0);
            PE_S(pe_loss_tile)(x, w, qw, b, K, V, major, r0, n, j0, cols, z);
            PE_S(pe_loss_dz)(z, gp, scale, lse, index, wide, r0, n, j0, cols);
            if (qw)
                PE_S(pe_qgemm)(n, K, cols, z, cols, qw, j0, 0, gx + r0 * K, K, 1);
            else if (major)
                PE_S(pe_gemm)(n, K, cols, z, cols, 0, w + j0 * K, K, 0, gx + r0 * K, K, 1);
            else
                PE_S(pe_gemm)(n, K, cols, z, cols, 0, w + j0, V, 1, gx + r0 * K, K, 1);
        }
    }
}

/* gw = x^T dz (dz^T x when major) and gb = sum(dz, 0), the vocabulary split across threads;
 * either may be NULL. */
static void PE_S(pe_loss_grad_w)(const PE_T *gp, const PE_T *scale, const PE_T *x,
                                 const PE_T *w, const pe_qmat *qw, const void *index, int wide, const PE_T *lse,
                                 const PE_T *b, PE_T *gw, PE_T *gb, long rows, long K, long V,
                                 int major) {
    long tiles = (V + PE_LOSS_COLS - 1) / PE_LOSS_COLS;
    PE_PARALLEL_FOR(2 * rows * V * K)
    for (long tile = 0; tile < tiles; tile++) {
        PE_T z[PE_LOSS_ROWS * PE_LOSS_COLS];
        long j0 = tile * PE_LOSS_COLS, cols = pe_loss_min(PE_LOSS_COLS, V - j0);
        if (gw && major)
            memset(gw + j0 * K, 0, (size_t)(cols * K) * sizeof(PE_T));
        else if (gw)
            for (long k = 0; k < K; k++) memset(gw + k * V + j0, 0, (size_t)cols * sizeof(PE_T));
        if (gb)
            memset(gb + j0, 0, (size_t)cols * sizeof(PE_T));
        for (long r0 = 0; r0 < rows; r0 += PE_LOSS_ROWS) {
            long n = pe_loss_min(PE_LOSS_ROWS, rows - r0);
            PE_S(pe_loss_tile)(x, w, qw, b, K, V, major, r0, n, j0, cols, z);
            PE_S(pe_loss_dz)(z, gp, scale, lse, index, wide, r0, n, j0, cols);
            if (gw && major)
                PE_S(pe_gemm)(cols, K, n, z, cols, 1, x + r0 * K, K, 0, gw + j0 * K, K, 1);
            else if (gw)
                PE_S(pe_gemm)(K, cols, n, x + r0 * K, K, 1, z, cols, 0, gw + j0, V, 1);
            if (gb)
                for (long r = 0; r < n; r++)
                    for (long c = 0; c < cols; c++) gb[j0 + c] += z[r * cols + c];
        }
    }
}

static void PE_S(pe_loss_grad)(const PE_T *gp, const PE_T *scale, const PE_T *x, const PE_T *w,
                               const pe_qmat *qw, const void *index, int wide, const PE_T *lse,
                               const PE_T *b, PE_T *gx, PE_T *gw, PE_T *gb, long rows, long K,
                               long V, int major) {
    if (gx)
        PE_S(pe_loss_grad_x)(gp, scale, x, w, qw, index, wide, lse, b, gx, rows, K, V, major);
    if (gw || gb)
        PE_S(pe_loss_grad_w)(gp, scale, x, w, qw, index, wide, lse, b, gw, gb, rows, K, V,
                             major);
}

void PE_S(pe_linear_log_softmax_gather_grad)(const PE_T *gp, const PE_T *scale, const PE_T *x,
                                             const PE_T *w, const void *index, int wide,
                                             const PE_T *lse, const PE_T *b, PE_T *gx,
                                             PE_T *gw, PE_T *gb, long rows, long K, long V,
                                             int major) {
    PE_S(pe_loss_grad)(gp, scale, x, w, NULL, index, wide, lse, b, gx, gw, gb, rows, K, V,
                       major);
}

void PE_S(pe_qlinear_log_softmax_gather_grad)(const PE_T *gp, const PE_T *scale, const PE_T *x,
                                              const pe_qmat *w, const void *index, int wide,
                                              const PE_T *lse, PE_T *gx, long rows, long K,
                                              long V) {
    PE_S(pe_loss_grad)(gp, scale, x, NULL, w, index, wide, lse, NULL, gx, NULL, NULL, rows, K,
                       V, 1);
}

/* The forward and the gradients in one op (``linear_log_softmax_gather_with_grad``: the
 * cotangents gp and scale are known before the loss), and the forward alone (no gx, gw,
 * gb; gp and scale unread). Each row chunk's logits are made once, its row maxima and
 * sums kept as the tiles go (online log-sum-exp); the input gradient
 * gx = scale * softmax(z) w + gp * w[target] is accumulated as the tiles go too, as
 * FlashAttention accumulates its output, with the running max m and sum s:
 * acc = sum_j exp(z_j - m) w_j, rescaled by exp(m_old - m) when a tile raises m, and
 * gx = scale / s * acc at the end. One GEMM for the logits and one for gx, where the pair
 * of kernels takes three. The weight and bias gradients need each row's final log-sum-exp
 * first, so they take a second pass over the vocabulary (pe_loss_grad_w). Rows split
 * across threads; gx is the accumulator, so no scratch. */
static void PE_S(pe_loss_with_grad)(const PE_T *gp, const PE_T *scale, const PE_T *x,
                                    const PE_T *w, const pe_qmat *qw, const void *index,
                                    int wide, const PE_T *b, PE_T *picked, PE_T *lse, PE_T *gx,
                                    PE_T *gw, PE_T *gb, long rows, long K, long V, int major) {
    if (!qw && PE_S(pe_loss_once)(gp, scale, x, w, index, wide, b, picked, lse, gx, gw, gb, rows,
                                  K, V, major))
        return; /* loss_once.c: each logit made once, kept in gw's buffer */
    long step = pe_loss_chunk(rows, qw ? PE_QLOSS_ROWS : PE_LOSS_ROWS);
    long chunks = (rows + step - 1) / step;
    PE_PARALLEL_FOR((gx ? 2 : 1) * rows * V * K)
    for (long ch = 0; ch < chunks; ch++) {
        PE_T z[PE_QLOSS_ROWS * PE_LOSS_COLS]; /* on the stack: one tile of logits */
        PE_T top[PE_QLOSS_ROWS], total[PE_QLOSS_ROWS], hit[PE_QLOSS_ROWS];
        long r0 = ch * step, n = pe_loss_min(step, rows - r0);
        PE_T *acc = gx ? gx + r0 * K : NULL;
        if (acc)
            memset(acc, 0, (size_t)(n * K) * sizeof(PE_T));
        for (long r = 0; r < n; r++) top[r] = -INFINITY, total[r] = 0, hit[r] = NAN;
        for (long j0 = 0; j0 < V; j0 += PE_LOSS_COLS) {
            long cols = pe_loss_min(PE_LOSS_COLS, V - j0);
            PE_S(pe_loss_tile)(x, w, qw, b, K, V, major, r0, n, j0, cols, z);
            for (long r = 0; r < n; r++) {
                PE_T *row = z + r * cols;
                long t = pe_loss_target(index, wide, r0 + r) - j0;
                if (t >= 0 && t < cols) hit[r] = row[t];
                PE_T m = PE_S(pe_row_max)(row, cols, top[r]);
                /* 0 on the first tile */
                PE_T alpha = top[r] == -INFINITY ? 0 : PE_S(pe_loss_exp)(top[r] - m);
                PE_T s = total[r] * alpha;
                PE_S(pe_loss_exp_row)(row, cols, m, 1);
                for (long c = 0; c < cols; c++) s += row[c];
                if (acc && alpha != 1)
                    for (long k = 0; k < K; k++) acc[r * K + k] *= alpha;
                top[r] = m, total[r] = s;
            }
            if (acc && qw)
                PE_S(pe_qgemm)(n, K, cols, z, cols, qw, j0, 0, acc, K, 1);
            else if (acc && major)
                PE_S(pe_gemm)(n, K, cols, z, cols, 0, w + j0 * K, K, 0, acc, K, 1);
            else if (acc)
                PE_S(pe_gemm)(n, K, cols, z, cols, 0, w + j0, V, 1, acc, K, 1);
        }
        for (long r = 0; r < n; r++) {
            lse[r0 + r] = top[r] + log(total[r]);
            picked[r0 + r] = hit[r] - lse[r0 + r]; /* NaN for a target outside [0, V) */
            if (!acc)
                continue;
            PE_T f = scale[r0 + r] / total[r], g = gp[r0 + r];
            long t = pe_loss_target(index, wide, r0 + r);
            for (long k = 0; k < K; k++) acc[r * K + k] *= f;
            if (t >= 0 && t < V && qw)
                PE_S(pe_loss_add_row)(acc + r * K, g, qw, t, K);
            else if (t >= 0 && t < V)
                for (long k = 0; k < K; k++) acc[r * K + k] += g * (major ? w[t * K + k] : w[k * V + t]);
        }
    }
    if (gw || gb)
        PE_S(pe_loss_grad_w)(gp, scale, x, w, qw, index, wide, lse, b, gw, gb, rows, K, V,
                             major);
}

void PE_S(pe_linear_log_softmax_gather_with_grad)(const PE_T *gp, const PE_T *scale,
                                                  const PE_T *x, const PE_T *w,
                                                  const void *index, int wide, const PE_T *b,
                                                  PE_T *picked, PE_T *lse, PE_T *gx, PE_T *gw,
                                                  PE_T *gb, long rows, long K, long V,
                                                  int major) {
    PE_S(pe_loss_with_grad)(gp, scale, x, w, NULL, index, wide, b, picked, lse, gx, gw, gb, rows,
                            K, V, major);
}

void PE_S(pe_qlinear_log_softmax_gather_with_grad)(const PE_T *gp, const PE_T *scale,
                                                   const PE_T *x, const pe_qmat *w,
                                                   const void *index, int wide, PE_T *picked,
                                                   PE_T *lse, PE_T *gx, long rows, long K,
                                                   long V) {
    PE_S(pe_loss_with_grad)(gp, scale, x, NULL, w, index, wide, NULL, picked, lse, gx, NULL, NULL,
                            rows, K, V, 1);
}

/* The forward alone: the merged kernel with no cotangents and no gradient. */
void PE_S(pe_linear_log_softmax_gather)(const PE_T *x, const PE_T *w, const void *index,
                                        int wide, const PE_T *b, PE_T *picked, PE_T *lse,
                                        long rows, long K, long V, int major) {
    PE_S(pe_loss_with_grad)(NULL, NULL, x, w, NULL, index, wide, b, picked, lse, NULL, NULL, NULL,
                            rows, K, V, major);
}

void PE_S(pe_qlinear_log_softmax_gather)(const PE_T *x, const pe_qmat *w, const void *index,
                                         int wide, PE_T *picked, PE_T *lse, long rows, long K,
                                         long V) {
    PE_S(pe_loss_with_grad)(NULL, NULL, x, NULL, w, index, wide, NULL, picked, lse, NULL, NULL,
                            NULL, rows, K, V, 1);
}

#endif
