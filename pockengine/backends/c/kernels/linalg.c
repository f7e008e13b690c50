/* Matrix products: a packed, cache-blocked GEMM, C = op(A) op(B) (+ C when accumulating).
 *
 * BLIS-style: for each k block of PE_KC, a block of PE_MC rows of op(A) is packed into
 * PE_MR-row panels (k-major; kept in L2), then a run of PE_NR-column slivers of op(B)
 * (packed k-major, 64 KiB: kept in L2), and the register-blocked micro-kernel
 * (gemm_micro.h: AVX-512, AVX2+FMA, NEON or portable C, chosen at build time) runs each
 * panel (in L1 meanwhile) across every sliver of the run. Packing
 * reads through a layout (pe_layout: strides, and one axis split into spans), so every
 * transposition case, and a batch of images' planes read as one matrix, packs into the
 * same panels: no transpose is ever materialised. Edge tiles (fewer than PE_MR rows or
 * PE_NR columns, or a sliver that straddles two images) run the same micro-kernel on
 * zero-padded panels into a tile on the stack, copied to C afterwards.
 *
 * Every element of C sums its products in k order from its starting value (0, or C when
 * accumulating), whatever the blocking, the tile it falls in or the thread count. With
 * OpenMP the tiles (row blocks, and column groups when there are fewer row blocks than
 * threads) are split across threads; inside another parallel region it runs on one.
 * Nothing is allocated on the heap: the panels and the run of slivers are on the stack
 * (PE_MC x PE_KC elements and 64 KiB: 328 KiB in float with AVX-512). */
#ifndef PE_T
#include "pe_kernels.h"
#include "pe_rowcopy.h"
#define PE_SELF "linalg.c"
#include "pe_instantiate.h"
#else

#include "gemm_micro.h"

#ifndef PE_LINALG_HELPERS
#define PE_LINALG_HELPERS
/* Where index x lies along an axis (1 rows, 2 columns) of layout l, in elements. */
static inline long pe_axis_offset(const pe_layout *l, int axis, long x) {
    long stride = axis == 1 ? l->rs : l->cs;
    if (l->split != axis) return x * stride;
    return (x / l->span) * l->jump + (x % l->span) * stride;
}

/* How many indices from x (up to end) lie in x's span along the axis. */
static inline long pe_axis_run(const pe_layout *l, int axis, long x, long end) {
    if (l->split != axis) return end - x;
    long left = l->span - x % l->span;
    return left < end - x ? left : end - x;
}

static inline pe_layout pe_plain(long ld, int trans) {
    pe_layout l = {trans ? 1 : ld, trans ? ld : 1, 0, 0, 0};
    return l;
}

/* The layout of the transposed matrix: rows and columns (and the split axis) exchanged. */
static inline pe_layout pe_transposed(pe_layout l) {
    pe_layout t = {l.cs, l.rs, l.span, l.jump, l.split == 0 ? 0 : 3 - l.split};
    return t;
}

static inline long pe_min(long a, long b) { return a < b ? a : b; }

#if defined(__GNUC__)
#define PE_PREFETCH(p) __builtin_prefetch(p)
#else
#define PE_PREFETCH(p) ((void)0)
#endif

#endif

/* The k block: the sliver (PE_KC x PE_NR) stays in L1 beside a panel's stream. */
#define PE_KC (PE_TSIZE == 4 ? 256 : 128)
/* The row block: PE_MC x PE_KC of packed A stays in L2 (about 192 rows; 264 with AVX-512,
 * whose cores have at least 1 MiB of L2, so a 256-row product is one block and each sliver
 * of op(B) is packed once per k block). */
#if defined(PE_GEMM_ISA_AVX512)
#define PE_MC (PE_MR * (264 / PE_MR))
#else
#define PE_MC (PE_MR * (192 / PE_MR))
#endif
/* The run of packed slivers of op(B) that each panel crosses: 64 KiB (in L2), and never
 * less than one whole sliver. */
#define PE_NRUN_BYTES (64L * 1024)
#define PE_NRUN (PE_NRUN_BYTES / PE_TSIZE > PE_KC * PE_NR ? PE_NRUN_BYTES / PE_TSIZE : PE_KC * PE_NR)

/* dst[(r - r0) * drs + (c - c0) * dcs] = M(r, c) for the block [r0, r0+nr) x [c0, c0+nc)
 * of the matrix at src with layout l; runs along the axis of smaller stride. */
static void PE_S(pe_gemm_copy_in)(PE_T *restrict dst, long drs, long dcs, const PE_T *src,
                                  const pe_layout *l, long r0, long nr, long c0, long nc) {
    int cols_inner = l->cs <= l->rs;
    int outer = cols_inner ? 1 : 2, inner = cols_inner ? 2 : 1;
    long o0 = cols_inner ? r0 : c0, no = cols_inner ? nr : nc;
    long i0 = cols_inner ? c0 : r0, ni = cols_inner ? nc : nr;
    long dout = cols_inner ? drs : dcs, din = cols_inner ? dcs : drs;
    long sin = cols_inner ? l->cs : l->rs;
#if PE_TSIZE == 4 && defined(PE_GEMM_TRANSPOSE_PACK)
    if (sin == 1 && dout == 1 && din > 1 && l->split != outer) {
        /* register-tile transposes, one per run of the inner axis inside a span (a
         * weight gradient's k axis runs over every image's plane) */
        const PE_T *lines = src + pe_axis_offset(l, outer, o0);
        for (long i = i0; i < i0 + ni;) {
            long run = pe_axis_run(l, inner, i, i0 + ni);
            pe_pack_transposed_f32(dst + (i - i0) * din, din, lines + pe_axis_offset(l, inner, i),
                                   cols_inner ? l->rs : l->cs, no, run);
            i += run;
        }
        return;
    }
#endif
    for (long o = o0; o < o0 + no; o++) {
        const PE_T *line = src + pe_axis_offset(l, outer, o);
        PE_T *dline = dst + (o - o0) * dout;
        for (long i = i0; i < i0 + ni;) {
            long run = pe_axis_run(l, inner, i, i0 + ni);
            const PE_T *s = line + pe_axis_offset(l, inner, i);
            PE_T *restrict d = dline + (i - i0) * din;
            if (sin == 1 && din == 1) {
                /* A short run of a long line: fetch the next block's run of it meanwhile.
                 * A sliver's row (PE_NR elements, at most 128 bytes) is a few vector moves
                 * inline (pe_copy_run), where a call of memcpy per row cost more than the
                 * copy (attention's products; GCC turns a plain copy loop into that call). */
                PE_PREFETCH(s + run);
                PE_PREFETCH(s + run + 64 / sizeof(PE_T));
                pe_copy_run(d, s, (size_t)run * sizeof(PE_T));
            }
            else if (sin == 1)
                for (long t = 0; t < run; t++) d[t * din] = s[t];
            else
                for (long t = 0; t < run; t++) d[t * din] = s[t * sin];
            i += run;
        }
    }
}

/* C(r, c) = tile[(r - r0) * PE_NR + (c - c0)] over the block [r0, r0+nr) x [c0, c0+nc). */
static void PE_S(pe_gemm_copy_out)(PE_T *C, const pe_layout *l, const PE_T *restrict tile,
                                   long r0, long nr, long c0, long nc) {
    for (long r = r0; r < r0 + nr; r++) {
        PE_T *line = C + pe_axis_offset(l, 1, r);
        for (long c = c0; c < c0 + nc;) {
            long run = pe_axis_run(l, 2, c, c0 + nc);
            PE_T *restrict d = line + pe_axis_offset(l, 2, c);
            const PE_T *s = tile + (r - r0) * PE_NR + (c - c0);
            for (long t = 0; t < run; t++) d[t * l->cs] = s[t];
            c += run;
        }
    }
}

/* Where op(B) comes from: a matrix with a layout, or a packing function (an implicit
 * operand: convolution.c's im2col) that writes op(B)[k0..k0+kc, j0..j0+width) into the
 * sliver, rows PE_NR apart. */
typedef struct {
    const PE_T *B;
    pe_layout lb;
    void (*pack)(const void *ctx, PE_T *sliver, long ld, long k0, long kc, long j0, long width);
    const void *ctx;
} PE_S(pe_gemm_b);

/* One packed sliver of op(B): columns [j0, j0 + PE_NR) of the k block [k0, k0 + kc). */
static void PE_S(pe_gemm_pack_sliver)(const PE_S(pe_gemm_b) *b, PE_T *restrict sliver,
                                      long k0, long kc, long j0, long width) {
    if (width < PE_NR) memset(sliver, 0, (size_t)(kc * PE_NR) * sizeof(PE_T));
    if (b->pack)
        b->pack(b->ctx, sliver, PE_NR, k0, kc, j0, width);
    else
        PE_S(pe_gemm_copy_in)(sliver, PE_NR, 1, b->B, &b->lb, k0, kc, j0, width);
}

/* C rows [r0, r1) x columns [c0, c1), every k block; panels and slivers are scratch.
 * Per k block the row block's panels are packed, then a run of slivers (as many as
 * PE_NRUN elements hold: two at AVX-512's 256 x 32, more on a short k block), and each
 * panel runs across the whole run while it is in L1, the run in L2. The loop order does
 * not touch any element's k order, so the bits are those of one sliver at a time. */
static void PE_S(pe_gemm_tile)(long r0, long r1, long c0, long c1, long K, const PE_T *A,
                               const pe_layout *la, const PE_S(pe_gemm_b) *b,
                               PE_T *C, const pe_layout *lc, int accumulate,
                               PE_T *restrict panels, PE_T *restrict slivers) {
    _Alignas(64) PE_T tile[PE_MR * PE_NR];
    for (long k0 = 0; k0 < K; k0 += PE_KC) {
        long kc = pe_min(PE_KC, K - k0);
        int load = accumulate || k0 > 0;
        long per_run = PE_NRUN / (kc * PE_NR); /* at least 1: PE_NRUN >= PE_KC * PE_NR */
        for (long i0 = r0; i0 < r1; i0 += PE_MR) {
            long rows = pe_min(PE_MR, r1 - i0);
            PE_T *panel = panels + (i0 - r0) * kc;
            if (rows < PE_MR) memset(panel, 0, (size_t)(kc * PE_MR) * sizeof(PE_T));
            PE_S(pe_gemm_copy_in)(panel, 1, PE_MR, A, la, i0, rows, k0, kc);
        }
        for (long run0 = c0; run0 < c1; run0 += per_run * PE_NR) {
            long run1 = pe_min(run0 + per_run * PE_NR, c1);
            for (long j0 = run0; j0 < run1; j0 += PE_NR)
                PE_S(pe_gemm_pack_sliver)(b, slivers + (j0 - run0) / PE_NR * kc * PE_NR, k0, kc,
                                          j0, pe_min(PE_NR, c1 - j0));
            for (long i0 = r0; i0 < r1; i0 += PE_MR) {
                long rows = pe_min(PE_MR, r1 - i0);
                const PE_T *panel = panels + (i0 - r0) * kc;
                for (long j0 = run0; j0 < run1; j0 += PE_NR) {
                    long width = pe_min(PE_NR, c1 - j0);
                    const PE_T *sliver = slivers + (j0 - run0) / PE_NR * kc * PE_NR;
                    int direct = rows == PE_MR && width == PE_NR && lc->cs == 1 &&
                                 lc->split != 1 && pe_axis_run(lc, 2, j0, j0 + PE_NR) == PE_NR;
                    if (direct) {
                        PE_T *cij = C + pe_axis_offset(lc, 2, j0) + i0 * lc->rs;
                        PE_MICRO(kc, panel, sliver, cij, lc->rs, load);
                        continue;
                    }
                    memset(tile, 0, sizeof(tile));
                    if (load) PE_S(pe_gemm_copy_in)(tile, PE_NR, 1, C, lc, i0, rows, j0, width);
                    PE_MICRO(kc, panel, sliver, tile, PE_NR, 1);
                    PE_S(pe_gemm_copy_out)(C, lc, tile, i0, rows, j0, width);
                }
            }
        }
    }
}

/* The threads to use for a product of `work` multiply-adds. */
static int PE_S(pe_gemm_threads)(long work) {
#ifdef _OPENMP
    if (work > (1L << 18) && !omp_in_parallel()) return omp_get_max_threads();
#else
    (void)work;
#endif
    return 1;
}

static void PE_S(pe_gemm_run)(long M, long N, long K, const PE_T *A, pe_layout la,
                              const PE_S(pe_gemm_b) *b, PE_T *C, pe_layout lc, int accumulate) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        if (!accumulate) {
            PE_T zeros[PE_MR * PE_NR] = {0};
            for (long i = 0; i < M; i += PE_MR)
                for (long j = 0; j < N; j += PE_NR)
                    PE_S(pe_gemm_copy_out)(C, &lc, zeros, i, pe_min(PE_MR, M - i), j,
                                           pe_min(PE_NR, N - j));
        }
        return;
    }
    int threads = PE_S(pe_gemm_threads)(M * N * K);
    /* Row blocks: a multiple of the thread count where there are several, as even as the
     * panel height allows; fewer row blocks than threads split the columns too. */
    long blocks = (M + PE_MC - 1) / PE_MC;
    if (threads > 1 && blocks > 1) blocks = (blocks + threads - 1) / threads * threads;
    long mc = ((M + blocks - 1) / blocks + PE_MR - 1) / PE_MR * PE_MR;
    blocks = (M + mc - 1) / mc;
    long slivers = (N + PE_NR - 1) / PE_NR, groups = 1;
    if (threads > blocks) groups = pe_min((threads + blocks - 1) / blocks, slivers);
    long nc = (slivers + groups - 1) / groups * PE_NR;
    groups = (N + nc - 1) / nc;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
    for (long t = 0; t < blocks * groups; t++) {
        long r0 = t / groups * mc, c0 = t % groups * nc;
        _Alignas(64) PE_T panels[PE_MC * PE_KC];
        _Alignas(64) PE_T slivers[PE_NRUN];
        PE_S(pe_gemm_tile)(r0, pe_min(r0 + mc, M), c0, pe_min(c0 + nc, N), K, A, &la, b, C,
                           &lc, accumulate, panels, slivers);
    }
}

void PE_S(pe_gemm_strided)(long M, long N, long K, const PE_T *A, pe_layout la, const PE_T *B,
                           pe_layout lb, PE_T *C, pe_layout lc, int accumulate) {
    PE_S(pe_gemm_b) b = {B, lb, NULL, NULL};
    PE_S(pe_gemm_run)(M, N, K, A, la, &b, C, lc, accumulate);
}

/* pe_gemm_strided, or the same product transposed, C^T = op(B)^T op(A)^T, when its tiles
 * pad less (a weight gradient [96, 16] fills half of each 32-column sliver; [16, 96] two
 * 12-row panels of 16 rows). Each element sums the same products in the same k order,
 * so the bits are the same either way. */
void PE_S(pe_gemm_least_padded)(long M, long N, long K, const PE_T *A, pe_layout la,
                                const PE_T *B, pe_layout lb, PE_T *C, pe_layout lc,
                                int accumulate) {
    long padded = (M + PE_MR - 1) / PE_MR * PE_MR * ((N + PE_NR - 1) / PE_NR * PE_NR);
    long swapped = (N + PE_MR - 1) / PE_MR * PE_MR * ((M + PE_NR - 1) / PE_NR * PE_NR);
    if (10 * swapped < 9 * padded)
        PE_S(pe_gemm_strided)(N, M, K, B, pe_transposed(lb), A, pe_transposed(la),
                              C, pe_transposed(lc), accumulate);
    else
        PE_S(pe_gemm_strided)(M, N, K, A, la, B, lb, C, lc, accumulate);
}

void PE_S(pe_gemm_implicit)(long M, long N, long K, const PE_T *A, pe_layout la,
                            void (*pack)(const void *, PE_T *, long, long, long, long, long),
                            const void *ctx, PE_T *C, pe_layout lc, int accumulate) {
    PE_S(pe_gemm_b) b = {NULL, {0, 0, 0, 0, 0}, pack, ctx};
    PE_S(pe_gemm_run)(M, N, K, A, la, &b, C, lc, accumulate);
}

void PE_S(pe_gemm)(long M, long N, long K, const PE_T *A, long lda, int ta, const PE_T *B,
                   long ldb, int tb, PE_T *C, long ldc, int accumulate) {
    PE_S(pe_gemm_strided)(M, N, K, A, pe_plain(lda, ta), B, pe_plain(ldb, tb), C,
                          pe_plain(ldc, 0), accumulate);
}

/* C[n] = op(A) B[n] for `count` images (B[n] of K x N and C[n] of M x N, row-major,
 * bstride and cstride elements apart): one product over the images side by side, so a
 * narrow map (a pointwise convolution over 4x4 or 7x7 positions) still fills the
 * micro-kernel's columns. */
void PE_S(pe_gemm_images)(long count, long M, long N, long K, const PE_T *A, long lda, int ta,
                          const PE_T *B, long bstride, PE_T *C, long cstride) {
    pe_layout lb = {N, 1, N, bstride, 2}, lc = {N, 1, N, cstride, 2};
    PE_S(pe_gemm_strided)(M, count * N, K, A, pe_plain(lda, ta), B, lb, C, lc, 0);
}

#undef PE_KC
#undef PE_MC
#undef PE_NRUN
#undef PE_NRUN_BYTES
#undef PE_MR
#undef PE_NR
#undef PE_MICRO
#endif
