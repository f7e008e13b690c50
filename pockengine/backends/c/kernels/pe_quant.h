/* Low-bit frozen weights (quant.c): the ``dequantize`` op's kernels and the f16 scales.
 *
 * Codes are int8 (scheme PE_Q_INT8: w = s * c) or 4-bit two a byte (PE_Q_INT4: w = s * c + m;
 * PE_Q_INT4_SYM: w = s * (c - 8)), one scale (and offset) per group of ``group`` elements;
 * within a group byte j holds element j in its low nibble and j + group/2 in its high one
 * (GGUF's Q8_0, Q4_1 and Q4_0 blocks are these codes as they are). */
#ifndef PE_QUANT_H
#define PE_QUANT_H

#include <stdint.h>
#include <string.h>

enum pe_quant_scheme { PE_Q_INT8 = 0, PE_Q_INT4 = 1, PE_Q_INT4_SYM = 2 };

/* An IEEE binary16 value (its bits) as float: exact, subnormals, infinities and NaN too. */
static inline float pe_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    uint32_t bits;
    float f;
    if (exp == 0x1Fu) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp == 0) {
        f = (float)mant * 0x1p-24f; /* zero or a subnormal: exact in float */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    } else {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* A low-bit [rows, cols] matrix (groups along each row) as the GEMM reads it: the
 * ``dequantize`` op's operands and attributes. */
typedef struct {
    const void *codes, *scales, *offsets; /* offsets: NULL unless PE_Q_INT4 */
    int scheme, half_scales;
    long group, rows, cols;
} pe_qmat;

/* z = x op(W) with W = rows [row0, ...) of w, dequantised panel by panel as the GEMM
 * packs them (lowbit_gemm.c): transpose: op(W) = W^T ([K = w->cols, N rows of w]); else
 * op(W) = W ([K rows of w, N = w->cols]). x is M x K (row stride ldx), z M x N (ldz);
 * accumulate adds to z. */
void pe_qgemm_f32(long M, long N, long K, const float *x, long ldx, const pe_qmat *w,
                  long row0, int transpose, float *z, long ldz, int accumulate);
void pe_qgemm_f64(long M, long N, long K, const double *x, long ldx, const pe_qmat *w,
                  long row0, int transpose, double *z, long ldz, int accumulate);

/* out[t] = W[row][c0 + t] for t < n (lowbit_gemm.c). */
void pe_qrow_f32(const pe_qmat *w, long row, long c0, long n, float *out);
void pe_qrow_f64(const pe_qmat *w, long row, long c0, long n, double *out);

/* The fused loss head on a low-bit [V, K] table (loss.c; ops/quant_loss.py). */
#define PE_QLOSS_DECLARE(S, T)                                                                 \
    void pe_qlinear_log_softmax_gather_##S(const T *x, const pe_qmat *w, const void *index,    \
                                           int wide, T *picked, T *lse, long rows, long K,      \
                                           long V);                                             \
    void pe_qlinear_log_softmax_gather_grad_##S(const T *gp, const T *scale, const T *x,       \
                                                const pe_qmat *w, const void *index, int wide,  \
                                                const T *lse, T *gx, long rows, long K, long V); \
    void pe_qlinear_log_softmax_gather_with_grad_##S(const T *gp, const T *scale, const T *x,  \
                                                     const pe_qmat *w, const void *index,       \
                                                     int wide, T *picked, T *lse, T *gx,        \
                                                     long rows, long K, long V);
PE_QLOSS_DECLARE(f32, float)
PE_QLOSS_DECLARE(f64, double)

/* ``groups`` groups of ``group`` elements into ``out``. ``half_scales``: scales and
 * offsets are f16 bits (float output only); else they have the output's type. */
void pe_dequantize_f32(const void *codes, const void *scales, const void *offsets, int scheme,
                       int half_scales, long groups, long group, float *out);
void pe_dequantize_f64(const void *codes, const void *scales, const void *offsets, int scheme,
                       int half_scales, long groups, long group, double *out);

#endif
