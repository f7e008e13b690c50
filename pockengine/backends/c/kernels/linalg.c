/* Matrix products: a packed, cache-blocked GEMM, C = op(A) op(B) (+ C when accumulating).
 *
 * BLIS-style: for each k block of PE_KC, a run of PE_NR-column slivers of op(B) is packed
 * (k-major; 512 KiB with AVX-512, 128 KiB elsewhere: kept in L2), then each PE_MR-row panel
 * of op(A) in turn is packed (k-major) and the register-blocked micro-kernel (gemm_micro.h:
 * AVX-512, AVX2+FMA, NEON or portable C, chosen at build time) runs it (in L1 meanwhile)
 * across every sliver of the run. Each instruction set has three
 * micro-kernel shapes, each with its own blocked driver (gemm_shape.h); a product runs the
 * shape pe_gemm_shape names, which the step sets around a node the tuner chose one for
 * (the default, shape 0, elsewhere). Packing
 * reads through a layout (pe_layout: strides, and one axis split into spans), so every
 * transposition case, and a batch of images' planes read as one matrix, packs into the
 * same panels: no transpose is ever materialised. Edge tiles (fewer than PE_MR rows or
 * PE_NR columns, or a sliver that straddles two images) run the same micro-kernel on
 * zero-padded panels into a tile on the stack, copied to C afterwards.
 *
 * Every element of C sums its products in k order from its starting value (0, or C when
 * accumulating), whatever the blocking, the shape, the tile it falls in or the thread
 * count. With
 * OpenMP each thread takes one block of rows where there are many (more than PE_BSPLIT),
 * else a group of columns; inside another parallel region it runs on one. Nothing is
 * allocated on the heap: the panel and the run of slivers are on the stack (at most
 * 540 KiB in float with AVX-512, 144 KiB elsewhere). */
#ifndef PE_T
#include "pe_kernels.h"
#include "pe_rowcopy.h"
/* The micro-kernel shape the GEMMs run (gemm_micro.h), set by the step around a node. */
int pe_gemm_shape = 0;
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

/* C(r, c) = tile[(r - r0) * ldt + (c - c0)] over the block [r0, r0+nr) x [c0, c0+nc). */
static void PE_S(pe_gemm_copy_out)(PE_T *C, const pe_layout *l, const PE_T *restrict tile,
                                   long ldt, long r0, long nr, long c0, long nc) {
    for (long r = r0; r < r0 + nr; r++) {
        PE_T *line = C + pe_axis_offset(l, 1, r);
        for (long c = c0; c < c0 + nc;) {
            long run = pe_axis_run(l, 2, c, c0 + nc);
            PE_T *restrict d = line + pe_axis_offset(l, 2, c);
            const PE_T *s = tile + (r - r0) * ldt + (c - c0);
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

/* One packed sliver of op(B) of nr columns: [j0, j0 + width) of the k block [k0, k0 + kc),
 * zero-padded to nr. */
static void PE_S(pe_gemm_pack_sliver)(const PE_S(pe_gemm_b) *b, PE_T *restrict sliver, long nr,
                                      long k0, long kc, long j0, long width) {
    if (width < nr) memset(sliver, 0, (size_t)(kc * nr) * sizeof(PE_T));
    if (b->pack)
        b->pack(b->ctx, sliver, nr, k0, kc, j0, width);
    else
        PE_S(pe_gemm_copy_in)(sliver, nr, 1, b->B, &b->lb, k0, kc, j0, width);
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

/* One blocked driver per micro-kernel shape (gemm_shape.h): PE_S(pe_gemm_blocked_s<i>). */
#define PE_SHAPE PE_SHAPE_0
#define PE_B(name) PE_S(name##_s0)
#include "gemm_shape.h"
#undef PE_SHAPE
#undef PE_B
#define PE_SHAPE PE_SHAPE_1
#define PE_B(name) PE_S(name##_s1)
#include "gemm_shape.h"
#undef PE_SHAPE
#undef PE_B
#define PE_SHAPE PE_SHAPE_2
#define PE_B(name) PE_S(name##_s2)
#include "gemm_shape.h"
#undef PE_SHAPE
#undef PE_B

/* The micro-kernel shapes of this type's GEMM, rows and columns; shape pe_gemm_shape runs
 * (0, the default, when it names none). */
static const int PE_S(pe_gemm_blocks)[PE_GEMM_SHAPES][2] = PE_SHAPE_LIST;

static int PE_S(pe_gemm_current)(void) {
    return pe_gemm_shape > 0 && pe_gemm_shape < PE_GEMM_SHAPES ? pe_gemm_shape : 0;
}

/* Writes the shapes (up to max) to rows[i] x cols[i]; returns how many there are. */
int PE_S(pe_gemm_shape_list)(int *rows, int *cols, int max) {
    for (int i = 0; i < PE_GEMM_SHAPES && i < max; i++) {
        rows[i] = PE_S(pe_gemm_blocks)[i][0];
        cols[i] = PE_S(pe_gemm_blocks)[i][1];
    }
    return PE_GEMM_SHAPES;
}

static void PE_S(pe_gemm_run)(long M, long N, long K, const PE_T *A, pe_layout la,
                              const PE_S(pe_gemm_b) *b, PE_T *C, pe_layout lc, int accumulate) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        if (!accumulate) {
            PE_T zeros[8 * 8] = {0};
            for (long i = 0; i < M; i += 8)
                for (long j = 0; j < N; j += 8)
                    PE_S(pe_gemm_copy_out)(C, &lc, zeros, 8, i, pe_min(8, M - i), j,
                                           pe_min(8, N - j));
        }
        return;
    }
    int threads = PE_S(pe_gemm_threads)(M * N * K);
    switch (PE_S(pe_gemm_current)()) {
    case 1: PE_S(pe_gemm_blocked_s1)(M, N, K, A, la, b, C, lc, accumulate, threads); break;
    case 2: PE_S(pe_gemm_blocked_s2)(M, N, K, A, la, b, C, lc, accumulate, threads); break;
    default: PE_S(pe_gemm_blocked_s0)(M, N, K, A, la, b, C, lc, accumulate, threads); break;
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
    long mr = PE_S(pe_gemm_blocks)[PE_S(pe_gemm_current)()][0];
    long nr = PE_S(pe_gemm_blocks)[PE_S(pe_gemm_current)()][1];
    long padded = (M + mr - 1) / mr * mr * ((N + nr - 1) / nr * nr);
    long swapped = (N + mr - 1) / mr * mr * ((M + nr - 1) / nr * nr);
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

#undef PE_MR
#undef PE_NR
#undef PE_MICRO
#endif
