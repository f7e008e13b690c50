/* Matrix products: a cache-blocked GEMM, C = op(A) op(B) (+ C when accumulating), and a
 * batch of them over images (pe_gemm_images: a pointwise convolution's per-image products).
 *
 * op(A)[i, k] is A[i*lda + k], or A[k*lda + i] when ta; op(B)[k, j] is B[k*ldb + j], or
 * B[j*ldb + k] when tb. The kernel updates PE_MR rows of C at a time from a KC x NR
 * sliver of op(B) copied to the stack (transposed on the way when tb): rows of B 4 KiB
 * apart would alias in L1, and the copy makes every case one micro-kernel. A product of
 * at least PE_PACK_MIN multiply-adds (a transformer's projections and loss tiles, not a
 * small CNN's convolutions) also copies op(A)'s block to the stack in PE_MR-row panels
 * (transposed on the way when ta), once per k block for every sliver (pe_gemm_packed:
 * 1.13x the rate on a [512, 576] x [576, 1536] product; the benchmark BERT's and LLaMA's
 * sparse C steps 9% and 5% faster; 128 KiB more stack in float32, and only there).
 * Nothing is allocated on the heap. */
#ifndef PE_T
#include "pe_kernels.h"
#define PE_SELF "linalg.c"
#include "pe_instantiate.h"
#else

#define PE_KC 256
#define PE_MC 256
#define PE_PKC 128        /* pe_gemm_packed's k block: 128 KiB of float32 panels */
#define PE_PACK_MIN (1L << 22) /* multiply-adds from which op(A) is packed */
/* The micro-kernel's block: PE_MR x PE_NR accumulators, two vector registers a row, as many
 * rows as the register file holds with room for B (32 registers with AVX-512, else 16). */
#ifdef __AVX512F__
#define PE_VEC 64
#define PE_MR 8
#elif defined(__AVX__)
#define PE_VEC 32
#define PE_MR 4
#else
#define PE_VEC 16
#define PE_MR 4
#endif
#define PE_NR (PE_VEC / (int)sizeof(PE_T) * 2)

/* C[i0..i0+PE_MR) [j0..j0+PE_NR) += op(A)[.., k0..k0+len) B: the micro-kernel, B a packed
 * sliver. op(A)[i0 + r, k0 + k] is a[r * rs + k * ks]: A in place (rs, ks = lda, 1, or 1,
 * lda when ta), or a packed panel (1, PE_MR: one short run a k, where rows in place cost
 * PE_MR scalar loads a row apart). The PE_MR x PE_NR accumulators are a fixed-size local
 * block that the compiler keeps in vector registers; each k loads one row sliver of B and
 * PE_MR scalars of A. */
static void PE_S(pe_gemm_micro)(long i0, long j0, long len, const PE_T *a, long rs, long ks,
                                const PE_T *B, PE_T *C, long ldc) {
    PE_T acc[PE_MR][PE_NR];
    memset(acc, 0, sizeof(acc));
    for (long k = 0; k < len; k++) {
        const PE_T *restrict b = B + k * PE_NR;
        for (int r = 0; r < PE_MR; r++)
            for (int j = 0; j < PE_NR; j++) acc[r][j] += a[r * rs + k * ks] * b[j];
    }
    for (int r = 0; r < PE_MR; r++)
        for (int j = 0; j < PE_NR; j++) C[(i0 + r) * ldc + j0 + j] += acc[r][j];
}

/* Copy op(A)[i0..i0+PE_MR, k0..k1) into a panel, k-major. */
static void PE_S(pe_gemm_pack_a)(PE_T *restrict panel, const PE_T *A, long lda, int ta,
                                 long i0, long k0, long k1) {
    for (long k = k0; k < k1; k++)
        for (int r = 0; r < PE_MR; r++)
            panel[(k - k0) * PE_MR + r] = ta ? A[k * lda + i0 + r] : A[(i0 + r) * lda + k];
}

/* The micro-kernel for a sliver half as wide (PE_NR / 2 columns: a pointwise convolution
 * over a 4x4 feature map with AVX-512), over twice the rows so that it keeps as many
 * accumulators in registers. They start from C, so each element sums its products in the
 * order pe_gemm_edge does (bit for bit the same result). */
#define PE_MH (2 * PE_MR)
static void PE_S(pe_gemm_micro_half)(long i0, long j0, long k0, long k1, const PE_T *A,
                                     long lda, int ta, const PE_T *B, PE_T *C, long ldc) {
    PE_T acc[PE_MH][PE_NR / 2];
    for (int r = 0; r < PE_MH; r++)
        for (int j = 0; j < PE_NR / 2; j++) acc[r][j] = C[(i0 + r) * ldc + j0 + j];
    for (long k = k0; k < k1; k++) {
        PE_T a[PE_MH];
        for (int r = 0; r < PE_MH; r++) a[r] = ta ? A[k * lda + i0 + r] : A[(i0 + r) * lda + k];
        const PE_T *restrict b = B + (k - k0) * PE_NR;
        for (int r = 0; r < PE_MH; r++)
            for (int j = 0; j < PE_NR / 2; j++) acc[r][j] += a[r] * b[j];
    }
    for (int r = 0; r < PE_MH; r++)
        for (int j = 0; j < PE_NR / 2; j++) C[(i0 + r) * ldc + j0 + j] = acc[r][j];
}

/* The micro-kernel over a sliver that holds two images' half-width products side by side
 * (columns [0, PE_NR/2) of C0, then of C1). Like the half-width kernel, its accumulators
 * start from C, so each element sums in the edge loop's order. */
static void PE_S(pe_gemm_micro_pair)(long i0, long k0, long k1, const PE_T *A, long lda,
                                     int ta, const PE_T *B, PE_T *C0, PE_T *C1) {
    enum { H = PE_NR / 2 };
    PE_T acc[PE_MR][PE_NR];
    for (int r = 0; r < PE_MR; r++)
        for (int j = 0; j < H; j++) {
            acc[r][j] = C0[(i0 + r) * H + j];
            acc[r][H + j] = C1[(i0 + r) * H + j];
        }
    for (long k = k0; k < k1; k++) {
        PE_T a[PE_MR];
        for (int r = 0; r < PE_MR; r++) a[r] = ta ? A[k * lda + i0 + r] : A[(i0 + r) * lda + k];
        const PE_T *restrict b = B + (k - k0) * PE_NR;
        for (int r = 0; r < PE_MR; r++)
            for (int j = 0; j < PE_NR; j++) acc[r][j] += a[r] * b[j];
    }
    for (int r = 0; r < PE_MR; r++)
        for (int j = 0; j < H; j++) {
            C0[(i0 + r) * H + j] = acc[r][j];
            C1[(i0 + r) * H + j] = acc[r][H + j];
        }
}

/* The same product for rows [i0, i1) and the first ``width`` columns of a sliver. */
static void PE_S(pe_gemm_edge)(long i0, long i1, long j0, long width, long k0, long k1,
                               const PE_T *A, long lda, int ta, const PE_T *B, PE_T *C,
                               long ldc) {
    for (long i = i0; i < i1; i++) {
        PE_T *restrict c = C + i * ldc + j0;
        for (long k = k0; k < k1; k++) {
            PE_T a = ta ? A[k * lda + i] : A[i * lda + k];
            const PE_T *restrict b = B + (k - k0) * PE_NR;
            for (long j = 0; j < width; j++) c[j] += a * b[j];
        }
    }
}

/* Copy op(B)[k0..k1, j0..j0+width) into the sliver, rows PE_NR apart. */
static void PE_S(pe_gemm_pack)(PE_T *restrict sliver, const PE_T *B, long ldb, int tb, long k0,
                               long k1, long j0, long width) {
    for (long k = k0; k < k1; k++) {
        PE_T *restrict row = sliver + (k - k0) * PE_NR;
        if (!tb) {
            memcpy(row, B + k * ldb + j0, sizeof(PE_T) * (size_t)width);
        } else {
            for (long j = 0; j < width; j++) row[j] = B[(j0 + j) * ldb + k];
        }
    }
}

/* Rows [r0, r1) of C += op(A) op(B), k blocks of kc rows of op(B): each B sliver of
 * kc x PE_NR (in L1) serves every PE_MR rows. With ``panels`` (PE_MC x kc), op(A)'s block
 * is packed first, once per k block (pe_gemm_packed); without, A is read in place. */
static inline void PE_S(pe_gemm_rows)(long r0, long r1, long N, long K, long kc,
                                      const PE_T *A, long lda, int ta, const PE_T *B, long ldb,
                                      int tb, PE_T *C, long ldc, PE_T *sliver, PE_T *panels) {
    long r4 = r0 + (r1 - r0) / PE_MR * PE_MR;
    long rs = ta ? 1 : lda, ks = ta ? lda : 1;
    for (long k0 = 0; k0 < K; k0 += kc) {
        long k1 = k0 + kc < K ? k0 + kc : K;
        if (panels)
            for (long i0 = r0; i0 < r4; i0 += PE_MR)
                PE_S(pe_gemm_pack_a)(panels + (i0 - r0) * kc, A, lda, ta, i0, k0, k1);
        for (long j0 = 0; j0 < N; j0 += PE_NR) {
            long width = N - j0 < PE_NR ? N - j0 : PE_NR;
            long full = width == PE_NR ? r4 : r0;
            PE_S(pe_gemm_pack)(sliver, B, ldb, tb, k0, k1, j0, width);
            for (long i0 = r0; i0 < full; i0 += PE_MR) {
                if (panels)
                    PE_S(pe_gemm_micro)(i0, j0, k1 - k0, panels + (i0 - r0) * kc, 1, PE_MR,
                                        sliver, C, ldc);
                else
                    PE_S(pe_gemm_micro)(i0, j0, k1 - k0, A + i0 * rs + k0 * ks, rs, ks, sliver,
                                        C, ldc);
            }
            if (width == PE_NR / 2)
                for (; full + PE_MH <= r1; full += PE_MH)
                    PE_S(pe_gemm_micro_half)(full, j0, k0, k1, A, lda, ta, sliver, C, ldc);
            PE_S(pe_gemm_edge)(full, r1, j0, width, k0, k1, A, lda, ta, sliver, C, ldc);
        }
    }
}

/* pe_gemm for large products: op(A)'s PE_MC x PE_PKC block packed once per k block (its
 * own frame, so that small products never reserve the panels' stack). */
static __attribute__((noinline)) void PE_S(pe_gemm_packed)(long M, long N, long K,
                                                           const PE_T *A, long lda, int ta,
                                                           const PE_T *B, long ldb, int tb,
                                                           PE_T *C, long ldc) {
    long row_blocks = (M + PE_MC - 1) / PE_MC;
    PE_PARALLEL_FOR(M * N * K)
    for (long rb = 0; rb < row_blocks; rb++) {
        long r0 = rb * PE_MC, r1 = r0 + PE_MC < M ? r0 + PE_MC : M;
        PE_T sliver[PE_PKC * PE_NR], panels[PE_MC * PE_PKC];
        PE_S(pe_gemm_rows)(r0, r1, N, K, PE_PKC, A, lda, ta, B, ldb, tb, C, ldc, sliver, panels);
    }
}

void PE_S(pe_gemm)(long M, long N, long K, const PE_T *A, long lda, int ta, const PE_T *B,
                   long ldb, int tb, PE_T *C, long ldc, int accumulate) {
    if (!accumulate)
        for (long i = 0; i < M; i++) memset(C + i * ldc, 0, (size_t)N * sizeof(PE_T));
    if (M * N * K >= PE_PACK_MIN && M >= PE_MR) {
        PE_S(pe_gemm_packed)(M, N, K, A, lda, ta, B, ldb, tb, C, ldc);
        return;
    }
    /* Row blocks of PE_MC (an A block of PE_MC x PE_KC stays in L2) split across threads. */
    long row_blocks = (M + PE_MC - 1) / PE_MC;
    PE_PARALLEL_FOR(M * N * K)
    for (long rb = 0; rb < row_blocks; rb++) {
        long r0 = rb * PE_MC, r1 = r0 + PE_MC < M ? r0 + PE_MC : M;
        PE_T sliver[PE_KC * PE_NR]; /* on the stack: B rows 4 KiB apart would alias in L1 */
        PE_S(pe_gemm_rows)(r0, r1, N, K, PE_KC, A, lda, ta, B, ldb, tb, C, ldc, sliver, NULL);
    }
}

/* C0 = op(A) B0 and C1 = op(A) B1 for two products of PE_NR/2 columns (B and C row-major,
 * that many columns a row): both images' rows share one packed sliver, so the full-width
 * micro-kernel serves them. */
static void PE_S(pe_gemm_pair)(long M, long K, const PE_T *A, long lda, int ta,
                               const PE_T *B0, const PE_T *B1, PE_T *C0, PE_T *C1) {
    const long H = PE_NR / 2;
    memset(C0, 0, (size_t)(M * H) * sizeof(PE_T));
    memset(C1, 0, (size_t)(M * H) * sizeof(PE_T));
    long row_blocks = (M + PE_MC - 1) / PE_MC;
    PE_PARALLEL_FOR(M * 2 * H * K)
    for (long rb = 0; rb < row_blocks; rb++) {
        long r0 = rb * PE_MC, r1 = r0 + PE_MC < M ? r0 + PE_MC : M;
        long r4 = r0 + (r1 - r0) / PE_MR * PE_MR;
        PE_T sliver[PE_KC * PE_NR];
        for (long k0 = 0; k0 < K; k0 += PE_KC) {
            long k1 = k0 + PE_KC < K ? k0 + PE_KC : K;
            for (long k = k0; k < k1; k++) {
                memcpy(sliver + (k - k0) * PE_NR, B0 + k * H, sizeof(PE_T) * (size_t)H);
                memcpy(sliver + (k - k0) * PE_NR + H, B1 + k * H, sizeof(PE_T) * (size_t)H);
            }
            for (long i0 = r0; i0 < r4; i0 += PE_MR)
                PE_S(pe_gemm_micro_pair)(i0, k0, k1, A, lda, ta, sliver, C0, C1);
            PE_S(pe_gemm_edge)(r4, r1, 0, H, k0, k1, A, lda, ta, sliver, C0, H);
            PE_S(pe_gemm_edge)(r4, r1, 0, H, k0, k1, A, lda, ta, sliver + H, C1, H);
        }
    }
}

void PE_S(pe_gemm_images)(long count, long M, long N, long K, const PE_T *A, long lda, int ta,
                          const PE_T *B, long bstride, PE_T *C, long cstride) {
    long n = 0;
    if (N == PE_NR / 2)
        for (; n + 2 <= count; n += 2)
            PE_S(pe_gemm_pair)(M, K, A, lda, ta, B + n * bstride, B + (n + 1) * bstride,
                               C + n * cstride, C + (n + 1) * cstride);
    for (; n < count; n++)
        PE_S(pe_gemm)(M, N, K, A, lda, ta, B + n * bstride, N, 0, C + n * cstride, N, 0);
}

#undef PE_KC
#undef PE_PKC
#undef PE_PACK_MIN
#undef PE_MC
#undef PE_MH
#undef PE_MR
#undef PE_VEC
#undef PE_NR
#endif
