/* Process-wide helpers of the kernels: the thread count and element sizes. */
#include "pe_kernels.h"

int pe_set_threads(int threads) {
#ifdef _OPENMP
    if (threads > 0) omp_set_num_threads(threads);
    return omp_get_max_threads();
#else
    (void)threads;
    return 1;
#endif
}

size_t pe_dtype_size(int dtype) {
    switch (dtype) {
    case PE_F64: case PE_I64: return 8;
    case PE_F32: case PE_I32: return 4;
    case PE_F16: return 2;
    default: return 1;
    }
}
