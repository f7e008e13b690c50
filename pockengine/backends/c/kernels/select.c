/* topk: the k largest (or smallest) entries of each row along an axis, sorted best first,
 * with their positions. A row is read with stride ``inner`` (the axes after the selected
 * one), as softmax.c reads its rows. Equal entries keep their order: the lower position
 * comes first, as the NumPy reference and ONNX's TopK. One insertion pass per row:
 * O(n k), for the small k of routers and samplers. */
#ifndef PE_T
#include "pe_kernels.h"
#define PE_SELF "select.c"
#include "pe_instantiate.h"
#else

void PE_S(pe_topk)(const PE_T *x, PE_T *values, int64_t *indices, long outer, long n,
                   long inner, long k, int largest) {
    if (k <= 0) return;
    for (long o = 0; o < outer; o++) {
        for (long i = 0; i < inner; i++) {
            const PE_T *row = x + o * n * inner + i;
            PE_T *v = values + o * k * inner + i;
            int64_t *at_index = indices + o * k * inner + i;
            long filled = 0;
            for (long j = 0; j < n; j++) {
                PE_T a = row[j * inner];
                long at = filled; /* after every kept entry at least as good as a */
                while (at > 0 && (largest ? a > v[(at - 1) * inner] : a < v[(at - 1) * inner]))
                    at--;
                if (at >= k) continue;
                for (long m = (filled < k ? filled : k - 1); m > at; m--) {
                    v[m * inner] = v[(m - 1) * inner];
                    at_index[m * inner] = at_index[(m - 1) * inner];
                }
                v[at * inner] = a;
                at_index[at * inner] = j;
                if (filled < k) filled++;
            }
        }
    }
}

#endif
