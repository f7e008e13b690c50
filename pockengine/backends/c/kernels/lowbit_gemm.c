/* Products with a low-bit frozen matrix (pe_quant.h's pe_qmat): the GEMM of linalg.c with
 * op(B) packed from the codes. Each sliver of op(B) (PE_KC x PE_NR, k-major) is
 * dequantised as it is packed, in quant.c's order of operations (the code as a float,
 * minus 8 for Q4_0, times the scale, plus the offset; no fused multiply-add), so every
 * packed value equals the ``dequantize`` op's bit for bit and the product equals
 * dequantize + matmul on the same GEMM exactly. No float copy of the matrix exists: the
 * scratch is the GEMM's sliver and one row segment on the stack.
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

#include "pe_simd.h"

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

void PE_S(pe_qgemm)(long M, long N, long K, const PE_T *x, long ldx, const pe_qmat *w,
                    long row0, int transpose, PE_T *z, long ldz, int accumulate) {
    pe_qpack p = {w, row0};
    pe_layout lx = {ldx, 1, 0, 0, 0}, lz = {ldz, 1, 0, 0, 0};
    PE_S(pe_gemm_implicit)(M, N, K, x, lx, transpose ? PE_S(pe_qpack_t) : PE_S(pe_qpack_n), &p,
                           z, lz, accumulate);
}

#endif
