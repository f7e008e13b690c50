/* The scatter-add of gather along an axis (the gather itself is a generated loop),
 * embedding lookup and its scatter-add into the table's rows. Index tensors are int64;
 * shapes are row-major with at most 8 axes.
 *
 * An index outside its axis never reads or writes outside a tensor: a lookup gives a row
 * of zeros and a scatter-add skips it. Steps refuse such batches before they run (a
 * BatchError in process, exit 2 in ./train); this keeps a kernel called directly safe. */
#ifndef PE_T
#include "pe_kernels.h"
#define PE_SELF "index.c"
#include "pe_instantiate.h"
#else

#ifndef PE_INDEX_HELPERS
#define PE_INDEX_HELPERS
/* The offset in a tensor of shape ``shape`` of the element at index position ``flat`` of
 * a tensor of shape ``ishape``, with the ``axis`` coordinate replaced by ``at``. */
static long pe_along_axis(long flat, const long *ishape, const long *shape, int rank, int axis,
                          long at) {
    long offset = 0, stride = 1;
    for (int d = rank - 1; d >= 0; d--) {
        long coord = flat % ishape[d];
        flat /= ishape[d];
        offset += (d == axis ? at : coord) * stride;
        stride *= shape[d];
    }
    return offset;
}

static long pe_numel(const long *shape, int rank) {
    long n = 1;
    for (int d = 0; d < rank; d++) n *= shape[d];
    return n;
}
#endif

void PE_S(pe_gather_grad)(const PE_T *gz, const int64_t *index, const long *ishape,
                          const long *zshape, int rank, int axis, PE_T *z) {
    long n = pe_numel(ishape, rank);
    memset(z, 0, sizeof(PE_T) * (size_t)pe_numel(zshape, rank));
    for (long k = 0; k < n; k++)
        if (index[k] >= 0 && index[k] < zshape[axis])
            z[pe_along_axis(k, ishape, zshape, rank, axis, index[k])] += gz[k];
}

void PE_S(pe_embedding)(const PE_T *table, const int64_t *ids, long n, long dim, long rows,
                        PE_T *z) {
    for (long k = 0; k < n; k++) {
        if (ids[k] >= 0 && ids[k] < rows)
            memcpy(z + k * dim, table + ids[k] * dim, sizeof(PE_T) * (size_t)dim);
        else
            memset(z + k * dim, 0, sizeof(PE_T) * (size_t)dim);
    }
}

void PE_S(pe_embedding_grad)(const PE_T *gz, const int64_t *ids, long n, long dim, long rows,
                             long padding_row, PE_T *gt) {
    memset(gt, 0, sizeof(PE_T) * (size_t)(rows * dim));
    for (long k = 0; k < n; k++) {
        if (ids[k] < 0 || ids[k] >= rows) continue;
        PE_T *restrict row = gt + ids[k] * dim;
        const PE_T *g = gz + k * dim;
        for (long j = 0; j < dim; j++) row[j] += g[j];
    }
    if (padding_row >= 0) memset(gt + padding_row * dim, 0, sizeof(PE_T) * (size_t)dim);
}

#endif
