/* The range each index batch input of the step must lie in, and the check the trainer runs
 * on every index batch file before the first step.
 *
 * The exporter writes the table (``bounds.c``) from the compiler's analysis
 * (``pockengine.plan.index_bounds``): a class target indexes the loss's classes
 * (a value equal to the loss's ignore_index is allowed too), a token id an embedding's
 * rows, an advanced index (``x[i]``, ``index_put`` with accumulation) an axis of size n
 * from -n to n - 1. A value outside would make the step read or write outside a tensor. */
#ifndef PE_CHECK_H
#define PE_CHECK_H

#include <stddef.h>
#include <stdint.h>

#include "pe_io.h"

typedef struct {
    int input;               /* its position in pe_inputs */
    const char *name;        /* its IR name (the same as pe_inputs[input].name) */
    int64_t low;             /* values must lie in [low, high): low is 0, or -high for an */
    int64_t high;            /* advanced index x[i], which counts negatives from the end */
    int num_ignored;         /* ... or be one of these (a loss's ignore_index) */
    const int64_t *ignored;
    const char *what;        /* "class target", "token id", "index" */
} pe_index_bound;

extern const int pe_num_index_bounds;
extern const pe_index_bound pe_index_bounds[];

/* How many of the ``n`` values of ``dtype`` at ``data`` break ``bound``; the first one's
 * position and value into ``first`` and ``value``. Values of a float or bool dtype index
 * nothing and are not checked. */
long pe_index_violations(const pe_index_bound *bound, int dtype, const void *data, long n,
                         long *first, int64_t *value);

/* Check every item of batch file ``path`` (open as ``npy``, ``count`` items of ``nbytes``)
 * against ``bound``, reading each item into ``scratch``. On a value out of range write one
 * message to ``err`` naming the file, the value, its flat position in the file (and its
 * index there), the allowed range and how many values are out of range, and return 1;
 * on a read failure return -1. */
int pe_check_index_file(const pe_index_bound *bound, const char *path, pe_npy *npy, long count,
                        size_t nbytes, void *scratch, char *err, size_t errlen);

#endif
