/* Softmax and log-softmax along one axis of a tensor seen as [outer, n, inner], and their
 * backward kernels (ATen's _softmax_backward_data and _log_softmax_backward_data). The
 * "safe" softmax gives zeros for a slice that is all -inf (a fully masked query).
 *
 * Each slice: its max, then exp(x - max) (float: pe_exp32, which vectorises; the softmax
 * writes it to the output, which is read again for the sum, in order, and the division),
 * then the log-sum-exp or the quotient. A slice along the last axis (inner 1) runs a loop
 * of unit stride that the compiler vectorises. */
#ifndef PE_T
#include "pe_kernels.h"
#include "pe_exp.h"
#include <tgmath.h>
#define PE_SELF "softmax.c"
#include "pe_instantiate.h"
#else

#if PE_TSIZE == 4
#define PE_EXP pe_exp32
#else
#define PE_EXP exp
#endif

/* One slice of n elements, `step` apart (1 for the last axis). */
static inline void PE_S(pe_softmax_slice)(const PE_T *restrict in, PE_T *restrict out, long n,
                                          long step, int log_, int safe) {
    PE_T top = -INFINITY;
    for (long k = 0; k < n; k++) top = in[k * step] > top ? in[k * step] : top;
    if (safe && top == -INFINITY) {
        for (long k = 0; k < n; k++) out[k * step] = 0;
        return;
    }
    PE_T total = 0;
    if (log_) {
        for (long k = 0; k < n; k++) total += PE_EXP(in[k * step] - top);
        PE_T lse = log(total);
        for (long k = 0; k < n; k++) out[k * step] = (in[k * step] - top) - lse;
        return;
    }
    for (long k = 0; k < n; k++) out[k * step] = PE_EXP(in[k * step] - top);
    for (long k = 0; k < n; k++) total += out[k * step];
    for (long k = 0; k < n; k++) out[k * step] = out[k * step] / total;
}

void PE_S(pe_softmax)(const PE_T *x, PE_T *y, long outer, long n, long inner, int log_,
                      int safe) {
    PE_PARALLEL_FOR(outer * n * inner)
    for (long oi = 0; oi < outer * inner; oi++) {
        long o = oi / inner, i = oi % inner;
        const PE_T *in = x + o * n * inner + i;
        PE_T *out = y + o * n * inner + i;
        if (inner == 1)
            PE_S(pe_softmax_slice)(in, out, n, 1, log_, safe);
        else
            PE_S(pe_softmax_slice)(in, out, n, inner, log_, safe);
    }
}

void PE_S(pe_softmax_grad)(const PE_T *gz, const PE_T *z, PE_T *gx, long outer, long n,
                           long inner, int log_) {
    PE_PARALLEL_FOR(outer * n * inner)
    for (long oi = 0; oi < outer * inner; oi++) {
        long o = oi / inner, i = oi % inner, base = o * n * inner + i;
        PE_T total = 0;
        for (long k = 0; k < n; k++)
            total += log_ ? gz[base + k * inner] : gz[base + k * inner] * z[base + k * inner];
        for (long k = 0; k < n; k++) {
            long at = base + k * inner;
            gx[at] = log_ ? gz[at] - PE_EXP(z[at]) * total : z[at] * (gz[at] - total);
        }
    }
}

#undef PE_EXP
#endif
