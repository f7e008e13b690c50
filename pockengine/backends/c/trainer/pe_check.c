/* The trainer's check of index batch files against the exported bounds (pe_check.h). */
#include "pe_check.h"

#include <stdio.h>
#include <string.h>

#include "pe_kernels.h"

static int allowed(const pe_index_bound *b, int64_t v) {
    if (v >= b->low && v < b->high) return 1;
    for (int i = 0; i < b->num_ignored; i++)
        if (v == b->ignored[i]) return 1;
    return 0;
}

static int64_t element(int dtype, const void *data, long k) {
    switch (dtype) {
    case PE_I64: return ((const int64_t *)data)[k];
    case PE_I32: return ((const int32_t *)data)[k];
    default: return ((const uint8_t *)data)[k];
    }
}

/* ``flat`` as an index into ``shape`` ("[i, j, ...]"), into ``out``. */
static void unravel(long flat, const long *shape, int rank, char *out, size_t len) {
    long coord[PE_NPY_MAX_RANK];
    for (int d = rank - 1; d >= 0; d--) {
        coord[d] = shape[d] ? flat % shape[d] : 0;
        flat = shape[d] ? flat / shape[d] : 0;
    }
    size_t k = (size_t)snprintf(out, len, "[");
    for (int d = 0; d < rank && k < len; d++)
        k += (size_t)snprintf(out + k, len - k, "%s%ld", d ? ", " : "", coord[d]);
    if (k < len) snprintf(out + k, len - k, "]");
}

static void describe_ignored(const pe_index_bound *b, char *out, size_t len) {
    out[0] = '\0';
    size_t k = 0;
    for (int i = 0; i < b->num_ignored && k < len; i++)
        k += (size_t)snprintf(out + k, len - k, "%s%lld", i ? ", " : " and is not the ignore_index ",
                              (long long)b->ignored[i]);
}

long pe_index_violations(const pe_index_bound *bound, int dtype, const void *data, long n,
                         long *first, int64_t *value) {
    if (dtype != PE_I64 && dtype != PE_I32 && dtype != PE_U8) return 0;
    long bad = 0;
    for (long k = 0; k < n; k++) {
        int64_t v = element(dtype, data, k);
        if (allowed(bound, v)) continue;
        if (bad++ == 0) *first = k, *value = v;
    }
    return bad;
}

int pe_check_index_file(const pe_index_bound *bound, const char *path, pe_npy *npy, long count,
                        size_t nbytes, void *scratch, char *err, size_t errlen) {
    long n = (long)(nbytes / pe_dtype_size(npy->dtype)), bad = 0, first = -1;
    int64_t value = 0;
    for (long item = 0; item < count; item++) {
        if (pe_npy_read_item(npy, item, nbytes, scratch)) {
            snprintf(err, errlen, "%s: read failed", path);
            return -1;
        }
        long at = -1;
        int64_t v = 0;
        long found = pe_index_violations(bound, npy->dtype, scratch, n, &at, &v);
        if (found && !bad) first = item * n + at, value = v;
        bad += found;
    }
    if (!bad) return 0;
    char index[256] = "", ignored[256];
    if (npy->rank > 1) {
        char at[240];
        unravel(first, npy->shape, npy->rank, at, sizeof(at));
        snprintf(index, sizeof(index), " (index %s)", at);
    }
    describe_ignored(bound, ignored, sizeof(ignored));
    snprintf(err, errlen, "%s: %s %lld at flat position %ld%s is outside [%lld, %lld)%s; %ld "
             "value(s) out of range in the file; nothing was trained", path, bound->what,
             (long long)value, first, index, (long long)bound->low, (long long)bound->high,
             ignored, bad);
    return 1;
}
