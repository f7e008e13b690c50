/* Softmax and log-softmax along one axis of a tensor seen as [outer, n, inner], and their
 * backward kernels (ATen's _softmax_backward_data and _log_softmax_backward_data). The
 * "safe" softmax gives zeros for a slice that is all -inf (a fully masked query). */
#ifndef PE_T
#include "pe_kernels.h"
#include <tgmath.h>
#define PE_SELF "softmax.c"
#include "pe_instantiate.h"
#else

void PE_S(pe_softmax)(const PE_T *x, PE_T *y, long outer, long n, long inner, int log_,
                      int safe) {
    PE_PARALLEL_FOR(outer * n * inner)
    for (long oi = 0; oi < outer * inner; oi++) {
        long o = oi / inner, i = oi % inner;
        const PE_T *in = x + o * n * inner + i;
        PE_T *out = y + o * n * inner + i;
        PE_T top = -INFINITY;
        for (long k = 0; k < n; k++) top = in[k * inner] > top ? in[k * inner] : top;
        if (safe && top == -INFINITY) {
            for (long k = 0; k < n; k++) out[k * inner] = 0;
            continue;
        }
        PE_T total = 0;
        for (long k = 0; k < n; k++) total += exp(in[k * inner] - top);
        if (log_) {
            PE_T lse = log(total);
            for (long k = 0; k < n; k++) out[k * inner] = (in[k * inner] - top) - lse;
        } else {
            for (long k = 0; k < n; k++) out[k * inner] = exp(in[k * inner] - top) / total;
        }
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
            gx[at] = log_ ? gz[at] - exp(z[at]) * total : z[at] * (gz[at] - total);
        }
    }
}

#endif
