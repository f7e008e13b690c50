/* Scaled dot-product attention (one op: out and the log-sum-exp of each query's scores)
 * and its backward kernel, FlashAttention-style: the [L, S] matrix of scores is never
 * stored. Queries go in tiles of at most 16 Ki scores, kept on the stack (64 KiB in
 * float; the backward keeps two); the products are GEMMs, and the backward recomputes
 * the probabilities from q, k and lse.
 *
 * geom: B, H, L, S, E, Ev, then the additive mask's element strides over [B, H, L, S]
 * (0 on broadcast axes), then the batch, head and row strides of q, k, v and the output
 * gradient (a head's rows need not be contiguous: q as [B, L, H, E] reads at a row stride
 * of H * E, so the head split's transpose is never written). out, lse and the gradients
 * are contiguous [B, H, rows, E]. A query whose keys are all masked gets out 0 and lse 0. */
#ifndef PE_T
#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512F__)
/* whole 512-bit vectors for the probabilities' loops (GCC prefers 256 bits on AVX-512
 * machines): 0.87-0.92x the time of attention and its gradient on BERT's heads */
#pragma GCC target("prefer-vector-width=512")
#endif
#include "pe_kernels.h"
#include "pe_exp.h"
#include <tgmath.h>
#define PE_SELF "attention.c"
#include "pe_instantiate.h"
#else

#if PE_TSIZE == 4
#define PE_EXP pe_exp32 /* pe_exp.h: the probabilities' loops vectorise */
#else
#define PE_EXP exp
#endif

#ifndef PE_ATTN_HELPERS
#define PE_ATTN_HELPERS
/* Queries per tile: a tile of scores (queries x keys) stays within 16 Ki elements (128
 * queries of 128 keys: each head's k and v are packed once). */
static long pe_attention_tile(long S) {
    long t = 16384 / (S > 0 ? S : 1);
    return t < 1 ? 1 : (t > 128 ? 128 : t);
}
#endif

#include "pe_rowred.h"

/* Query i's row of the additive mask of head (b, h) (its keys g[9] elements apart). */
static const PE_T *PE_S(pe_attention_mask_row)(const PE_T *mask, const long *g, long b, long h,
                                               long i) {
    return mask + b * g[6] + h * g[7] + i * g[8];
}

/* How many keys queries [i0, i0+rows) of head (b, h) can see: all S, or the first i0 + rows
 * when causal (query i sees keys j <= i), and no further than the last key whose mask is
 * not -inf for some query of the tile (a causal mask built as a tensor, padding). Every
 * probability past it is exactly 0, so the tile's products and loops stop there; at least
 * one key, so that a tile whose every key is masked still runs. */
static long PE_S(pe_attention_seen)(const PE_T *mask, const long *g, long b, long h, long i0,
                                    long rows, int causal) {
    long S = g[3], n = causal && i0 + rows < S ? i0 + rows : S;
    if (!mask || n == 0) return n;
    long seen = 1;
    for (long r = 0; r < rows && seen < n; r++) {
        const PE_T *m = PE_S(pe_attention_mask_row)(mask, g, b, h, i0 + r);
        long j = n;
        while (j > seen && m[(j - 1) * g[9]] == -INFINITY) j--;
        seen = j > seen ? j : seen;
    }
    return seen;
}

/* Scores of queries [i0, i0+rows) of head (b, h) against keys [0, n), into tile[rows][S]
 * (row stride S): q k^T, then * scale + mask where there is a mask (else the caller
 * multiplies by the scale as it reads a score: the returned factor, 1 where it is
 * already applied), -inf above the diagonal when causal. A positive scale commutes with
 * the row maximum, so max(s * scale) = max(s) * scale bit for bit. */
static PE_T PE_S(pe_attention_scores)(const PE_T *qh, const PE_T *kh, const PE_T *mask,
                                      const long *g, long b, long h, long i0, long rows,
                                      long n, PE_T scale, int causal, PE_T *tile) {
    long S = g[3], E = g[4];
    PE_S(pe_gemm)(rows, n, E, qh + i0 * g[12], g[12], 0, kh, g[15], 1, tile, S, 0);
    int fold = !mask && scale > 0;
    for (long r = 0; r < rows; r++) {
        PE_T *row = tile + r * S;
        const PE_T *m = mask ? PE_S(pe_attention_mask_row)(mask, g, b, h, i0 + r) : NULL;
        if (fold)
            ;
        else if (!m) /* three loops, so that the common ones run at unit stride */
            for (long j = 0; j < n; j++) row[j] *= scale;
        else if (g[9] == 1)
            for (long j = 0; j < n; j++) row[j] = row[j] * scale + m[j];
        else
            for (long j = 0; j < n; j++) row[j] = row[j] * scale + m[j * g[9]];
        if (causal)
            for (long j = i0 + r + 1; j < n; j++) row[j] = -INFINITY;
    }
    return fold ? scale : 1;
}

void PE_S(pe_attention)(const PE_T *q, const PE_T *k, const PE_T *v, const PE_T *mask,
                        PE_T *out, PE_T *lse, const long *g, double scale_, int causal) {
    long B = g[0], H = g[1], L = g[2], S = g[3], E = g[4], Ev = g[5], T = pe_attention_tile(S);
    PE_T scale = (PE_T)scale_;
    PE_PARALLEL_FOR(B * H * L * S * (E + Ev))
    for (long bh = 0; bh < B * H; bh++) {
        PE_T tile[T * S]; /* on the stack: scores, then probabilities, of T queries */
        PE_T totals[T];   /* each query's sum of exponentials (1 where every key is masked) */
        long b = bh / H, h = bh % H;
        const PE_T *qh = q + b * g[10] + h * g[11], *kh = k + b * g[13] + h * g[14];
        const PE_T *vh = v + b * g[16] + h * g[17];
        for (long i0 = 0; i0 < L; i0 += T) {
            long rows = L - i0 < T ? L - i0 : T;
            long n = PE_S(pe_attention_seen)(mask, g, b, h, i0, rows, causal);
            PE_T mul = PE_S(pe_attention_scores)(qh, kh, mask, g, b, h, i0, rows, n, scale,
                                                 causal, tile);
            for (long r = 0; r < rows; r++) {
                PE_T *row = tile + r * S, top = PE_S(pe_row_max)(row, n, -INFINITY) * mul;
                if (top == -INFINITY) { /* every key masked: out 0, lse 0 */
                    for (long j = 0; j < n; j++) row[j] = 0;
                    lse[bh * L + i0 + r] = 0;
                    totals[r] = 1;
                    continue;
                }
                for (long j = 0; j < n; j++) row[j] = PE_EXP(row[j] * mul - top);
                totals[r] = PE_S(pe_row_sum)(row, n);
                lse[bh * L + i0 + r] = top + log(totals[r]);
            }
            /* out = (exp(s - max) v) / total: the normalisation on Ev values a query, not S */
            PE_T *o = out + (bh * L + i0) * Ev;
            PE_S(pe_gemm)(rows, Ev, n, tile, S, 0, vh, g[18], 0, o, Ev, 0);
            for (long r = 0; r < rows; r++)
                for (long e = 0; e < Ev; e++) o[r * Ev + e] /= totals[r];
        }
    }
}

void PE_S(pe_attention_grad)(const PE_T *go, const PE_T *q, const PE_T *k, const PE_T *v,
                             const PE_T *mask, const PE_T *out, const PE_T *lse, PE_T *gq,
                             PE_T *gk, PE_T *gv, const long *g, double scale_, int causal) {
    long B = g[0], H = g[1], L = g[2], S = g[3], E = g[4], Ev = g[5], T = pe_attention_tile(S);
    PE_T scale = (PE_T)scale_;
    PE_PARALLEL_FOR(B * H * L * S * (E + Ev))
    for (long bh = 0; bh < B * H; bh++) {
        PE_T p[T * S], ds[T * S]; /* on the stack: probabilities and their gradient */
        long b = bh / H, h = bh % H, gs = g[21];
        const PE_T *qh = q + b * g[10] + h * g[11], *kh = k + b * g[13] + h * g[14];
        const PE_T *vh = v + b * g[16] + h * g[17];
        PE_T *gkh = gk + bh * S * E, *gvh = gv + bh * S * Ev;
        int limited = causal || mask; /* tiles see fewer keys than S: gk and gv start at 0 */
        if (limited) {
            memset(gkh, 0, (size_t)(S * E) * sizeof(PE_T));
            memset(gvh, 0, (size_t)(S * Ev) * sizeof(PE_T));
        }
        for (long i0 = 0; i0 < L; i0 += T) {
            long rows = L - i0 < T ? L - i0 : T;
            long n = PE_S(pe_attention_seen)(mask, g, b, h, i0, rows, causal);
            int acc = limited || i0 > 0;
            const PE_T *gor = go + b * g[19] + h * g[20] + i0 * gs;
            PE_T mul = PE_S(pe_attention_scores)(qh, kh, mask, g, b, h, i0, rows, n, scale,
                                                 causal, p);
            PE_S(pe_gemm)(rows, n, Ev, gor, gs, 0, vh, g[18], 1, ds, S, 0); /* dp = go v^T */
            for (long r = 0; r < rows; r++) {
                const PE_T *o = out + (bh * L + i0 + r) * Ev, *gr = gor + r * gs;
                PE_T m = lse[bh * L + i0 + r], delta = 0;
                for (long e = 0; e < Ev; e++) delta += gr[e] * o[e];
                for (long j = 0; j < n; j++) {
                    PE_T pj = PE_EXP(p[r * S + j] * mul - m);
                    p[r * S + j] = pj;
                    ds[r * S + j] = pj * (ds[r * S + j] - delta) * scale;
                }
            }
            PE_S(pe_gemm)(rows, E, n, ds, S, 0, kh, g[15], 0, gq + (bh * L + i0) * E, E, 0);
            PE_S(pe_gemm)(n, E, rows, ds, S, 1, qh + i0 * g[12], g[12], 0, gkh, E, acc);
            PE_S(pe_gemm)(n, Ev, rows, p, S, 1, gor, gs, 0, gvh, Ev, acc);
        }
    }
}

#undef PE_EXP
#endif
