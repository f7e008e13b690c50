/* Products with a low-bit frozen matrix (pe_quant.h's pe_qmat): a GEMM whose op(B) is
 * packed from the codes. Each sliver of op(B) (a k block x PE_NR, k-major) is dequantised
 * as it is packed, in quant.c's order of operations (the code as a float, minus 8 for
 * Q4_0, times the scale, plus the offset; no fused multiply-add), so every packed value
 * equals the ``dequantize`` op's bit for bit; the micro-kernel is linalg.c's
 * (gemm_micro.h) and every element sums its products in k order, so the product equals
 * dequantize + pe_gemm on the same matrix exactly. No float copy of the matrix exists:
 * the scratch is the packed rows of x, one sliver and one row segment, on the stack.
 *
 * Blocking: the rows of x are packed for up to PE_QMC rows at once (a training step's 512
 * tokens are one block), so each sliver is dequantised once per call and k block and
 * serves every row; the k blocks split K evenly (576 = 3 x 192, not 256 + 256 + 64). With
 * threads, the slivers are split across them (each packs the rows of x for itself), so no
 * sliver is dequantised twice.
 *
 * Forward (x W^T, transpose): sliver column j is W's row j0 + j over the k block, a run of
 * whole groups, dequantised into a row buffer and written down the column. Input
 * gradient (dY W): sliver row k is W's row k0 + k over the sliver's columns, dequantised
 * in place (a GGUF group of 32 is two slivers of 16: its bytes' low nibbles, then their
 * high nibbles). The group loops have constant trip counts for groups of 32, which the
 * compiler vectorises (AVX2, AVX-512, NEON or the portable build alike). */
#ifndef PE_T
#include "pe_kernels.h"
#define PE_SELF "lowbit_gemm.c"
#include "pe_instantiate.h"
#else

#include "gemm_micro.h"

#ifndef PE_LOWBIT_HELPERS
#define PE_LOWBIT_HELPERS
/* A product's packing context: the matrix, its first row, the orientation. */
typedef struct {
    const pe_qmat *w;
    long row0;
} pe_qpack;

static inline long pe_qmin(long a, long b) { return a < b ? a : b; }
#endif

static inline PE_T PE_S(pe_qscale)(const void *p, int half, long g) {
    if (half) return (PE_T)pe_half_to_float(((const uint16_t *)p)[g]);
    return ((const PE_T *)p)[g];
}

/* Elements [e, e + n) of 4-bit group g (within one group): byte i's low nibble is
 * element i, its high nibble element i + group/2. */
static void PE_S(pe_q4_part)(const uint8_t *restrict bytes, long half, long e, long n, PE_T s,
                             PE_T m, int asym, PE_T *restrict out) {
    long lo_end = pe_qmin(half, e + n), t = 0;
#if PE_TSIZE == 4
    if (half == 16 && n == 16 && (e == 0 || e == 16)) { /* a sliver of 16: one nibble half */
        pe_dequant_q4_16_f32(bytes, s, m, asym, e == 16, out);
        return;
    }
#endif
    if (asym) {
        for (long i = e; i < lo_end; i++, t++) out[t] = (PE_T)(bytes[i] & 0x0F) * s + m;
        for (long i = (e > half ? e : half); i < e + n; i++, t++)
            out[t] = (PE_T)(bytes[i - half] >> 4) * s + m;
    } else {
        for (long i = e; i < lo_end; i++, t++)
            out[t] = ((PE_T)(bytes[i] & 0x0F) - (PE_T)8) * s;
        for (long i = (e > half ? e : half); i < e + n; i++, t++)
            out[t] = ((PE_T)(bytes[i - half] >> 4) - (PE_T)8) * s;
    }
}

/* A whole 4-bit group of 32, constant trip counts. */
static inline void PE_S(pe_q4_32)(const uint8_t *restrict c, PE_T s, PE_T m, int asym,
                                  PE_T *restrict o) {
#if PE_TSIZE == 4
    pe_dequant_q4_16_f32(c, s, m, asym, 0, o);
    pe_dequant_q4_16_f32(c, s, m, asym, 1, o + 16);
    return;
#endif
    if (asym) {
        for (int j = 0; j < 16; j++) o[j] = (PE_T)(c[j] & 0x0F) * s + m;
        for (int j = 0; j < 16; j++) o[16 + j] = (PE_T)(c[j] >> 4) * s + m;
    } else {
        for (int j = 0; j < 16; j++) o[j] = ((PE_T)(c[j] & 0x0F) - (PE_T)8) * s;
        for (int j = 0; j < 16; j++) o[16 + j] = ((PE_T)(c[j] >> 4) - (PE_T)8) * s;
    }
}

/* out[t] = W[row][c0 + t] for t < n, group by group. */
static void PE_S(pe_qrange)(const pe_qmat *w, long row, long c0, long n, PE_T *restrict out) {
    long group = w->group, per_row = w->cols / group;
    int asym = w->scheme == PE_Q_INT4;
    while (n > 0) {
        long g = row * per_row + c0 / group, e = c0 % group, take = pe_qmin(group - e, n);
        PE_T s = PE_S(pe_qscale)(w->scales, w->half_scales, g);
        if (w->scheme == PE_Q_INT8) {
            const int8_t *restrict c = (const int8_t *)w->codes + row * w->cols + c0;
#if PE_TSIZE == 4
            pe_dequant_i8_f32(c, s, take, out);
#else
            for (long t = 0; t < take; t++) out[t] = (PE_T)c[t] * s;
#endif
        } else {
            PE_T m = asym ? PE_S(pe_qscale)(w->offsets, w->half_scales, g) : (PE_T)0;
            const uint8_t *bytes = (const uint8_t *)w->codes + g * (group / 2);
            if (group == 32 && take == 32)
                PE_S(pe_q4_32)(bytes, s, m, asym, out);
            else
                PE_S(pe_q4_part)(bytes, group / 2, e, take, s, m, asym, out);
        }
        out += take;
        c0 += take;
        n -= take;
    }
}

/* op(B) = W^T: sliver[k][j] = W[row0 + j0 + j][k0 + k]. */
static void PE_S(pe_qpack_t)(const void *ctx, PE_T *sliver, long ld, long k0, long kc, long j0,
                             long width) {
    const pe_qpack *p = (const pe_qpack *)ctx;
#if PE_TSIZE == 4 && defined(PE_GEMM_TRANSPOSE_PACK)
    /* eight rows of W dequantised side by side, then transposed in register tiles */
    _Alignas(64) float rows[8 * 256];
    for (long j = 0; j < width; j += 8) {
        long nj = pe_qmin(8, width - j);
        for (long k = 0; k < kc; k += 256) {
            long n = pe_qmin(256, kc - k);
            for (long i = 0; i < nj; i++)
                PE_S(pe_qrange)(p->w, p->row0 + j0 + j + i, k0 + k, n, rows + i * 256);
            pe_pack_transposed_f32(sliver + k * ld + j, ld, rows, 256, nj, n);
        }
    }
    return;
#endif
    _Alignas(64) PE_T line[256];
    for (long j = 0; j < width; j++) {
        for (long k = 0; k < kc; k += 256) {
            long n = pe_qmin(256, kc - k);
            PE_S(pe_qrange)(p->w, p->row0 + j0 + j, k0 + k, n, line);
            for (long t = 0; t < n; t++) sliver[(k + t) * ld + j] = line[t];
        }
    }
}

/* op(B) = W: sliver[k][j] = W[row0 + k0 + k][j0 + j]. */
static void PE_S(pe_qpack_n)(const void *ctx, PE_T *sliver, long ld, long k0, long kc, long j0,
                             long width) {
    const pe_qpack *p = (const pe_qpack *)ctx;
    for (long k = 0; k < kc; k++) PE_S(pe_qrange)(p->w, p->row0 + k0 + k, j0, width, sliver + k * ld);
}

void PE_S(pe_qrow)(const pe_qmat *w, long row, long c0, long n, PE_T *out) {
    PE_S(pe_qrange)(w, row, c0, n, out);
}

/* The k block (a multiple of 16, K split evenly in blocks of at most PE_KC) and the row
 * block: PE_QMC x kc packed rows of x (528 KiB in float) stay in L2 beside the sliver. */
#define PE_QKC (PE_TSIZE == 4 ? 256 : 128)
#define PE_QMC (PE_MR * (528 / PE_MR))

/* panel[k * PE_MR + r] = x[(i0 + r) * ldx + k0 + k], rows < PE_MR zero-filled. */
static void PE_S(pe_qpack_rows)(PE_T *restrict panel, const PE_T *x, long ldx, long i0,
                                long rows, long k0, long kc) {
    if (rows < PE_MR) memset(panel, 0, (size_t)(kc * PE_MR) * sizeof(PE_T));
    const PE_T *src = x + i0 * ldx + k0;
#if PE_TSIZE == 4 && defined(PE_GEMM_TRANSPOSE_PACK)
    pe_pack_transposed_f32(panel, PE_MR, src, ldx, rows, kc);
#else
    for (long r = 0; r < rows; r++)
        for (long k = 0; k < kc; k++) panel[k * PE_MR + r] = src[r * ldx + k];
#endif
}

/* z rows [r0, r1) x columns [c0, c1): for each k block, the rows of x packed once, then
 * each sliver dequantised once and run over every packed row panel. */
static void PE_S(pe_qgemm_block)(long r0, long r1, long c0, long c1, long K, const PE_T *x,
                                 long ldx, const pe_qpack *p, int transpose, PE_T *z,
                                 long ldz, int accumulate, PE_T *restrict panels,
                                 PE_T *restrict sliver) {
    _Alignas(64) PE_T tile[PE_MR * PE_NR];
    long kblocks = (K + PE_QKC - 1) / PE_QKC;
    long step = ((K + kblocks - 1) / kblocks + 15) / 16 * 16;
    for (long k0 = 0; k0 < K; k0 += step) {
        long kc = pe_qmin(step, K - k0);
        int load = accumulate || k0 > 0;
        for (long i0 = r0; i0 < r1; i0 += PE_MR)
            PE_S(pe_qpack_rows)(panels + (i0 - r0) * kc, x, ldx, i0, pe_qmin(PE_MR, r1 - i0),
                                k0, kc);
        for (long j0 = c0; j0 < c1; j0 += PE_NR) {
            long width = pe_qmin(PE_NR, c1 - j0);
            if (width < PE_NR) memset(sliver, 0, (size_t)(kc * PE_NR) * sizeof(PE_T));
            (transpose ? PE_S(pe_qpack_t) : PE_S(pe_qpack_n))(p, sliver, PE_NR, k0, kc, j0,
                                                              width);
            for (long i0 = r0; i0 < r1; i0 += PE_MR) {
                long rows = pe_qmin(PE_MR, r1 - i0);
                const PE_T *panel = panels + (i0 - r0) * kc;
                PE_T *c = z + i0 * ldz + j0;
                if (rows == PE_MR && width == PE_NR) {
                    PE_MICRO(kc, panel, sliver, c, ldz, load);
                    continue;
                }
                memset(tile, 0, sizeof(tile));
                for (long r = 0; r < rows && load; r++)
                    memcpy(tile + r * PE_NR, c + r * ldz, (size_t)width * sizeof(PE_T));
                PE_MICRO(kc, panel, sliver, tile, PE_NR, 1);
                for (long r = 0; r < rows; r++)
                    memcpy(c + r * ldz, tile + r * PE_NR, (size_t)width * sizeof(PE_T));
            }
        }
    }
}

void PE_S(pe_qgemm)(long M, long N, long K, const PE_T *x, long ldx, const pe_qmat *w,
                    long row0, int transpose, PE_T *z, long ldz, int accumulate) {
    pe_qpack p = {w, row0};
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        for (long r = 0; r < M && !accumulate; r++)
            memset(z + r * ldz, 0, (size_t)N * sizeof(PE_T));
        return;
    }
    int threads = 1;
#ifdef _OPENMP
    if (M * N * K > (1L << 18) && !omp_in_parallel()) threads = omp_get_max_threads();
#endif
    long slivers = (N + PE_NR - 1) / PE_NR;
    long groups = pe_qmin(threads, slivers), nc = (slivers + groups - 1) / groups * PE_NR;
    groups = (N + nc - 1) / nc;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (groups > 1)
#endif
    for (long g = 0; g < groups; g++) {
        _Alignas(64) PE_T panels[PE_QMC * PE_QKC];
        _Alignas(64) PE_T sliver[PE_QKC * PE_NR];
        long c0 = g * nc, c1 = pe_qmin(c0 + nc, N);
        for (long r0 = 0; r0 < M; r0 += PE_QMC)
            PE_S(pe_qgemm_block)(r0, pe_qmin(r0 + PE_QMC, M), c0, c1, K, x, ldx, &p, transpose,
                                 z, ldz, accumulate, panels, sliver);
    }
}

#undef PE_QKC
#undef PE_QMC
#undef PE_MR
#undef PE_NR
#undef PE_MICRO
#endif
