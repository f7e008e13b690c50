/* File formats of the stand-alone trainer: .npy arrays (the batches) and safetensors
 * (the state). Plain C, no library beyond libc. */
#ifndef PE_IO_H
#define PE_IO_H

#include <stddef.h>
#include <stdio.h>

/* An open .npy file: its type and shape, and where its data starts. The data stays on
 * disk: each step reads its batch straight into the arena (pe_npy_read_item), so a
 * dataset costs no resident memory. */
typedef struct {
    int dtype; /* a pe_dtype */
    int rank;
    long shape[9];
    FILE *file;
    long data_offset;
} pe_npy;

/* Open ``path`` and parse its header; on failure write a message to ``err`` and return
 * non-zero. */
int pe_npy_open(const char *path, pe_npy *out, char *err, size_t errlen);

/* Read item ``index`` (``nbytes`` each, from the start of the data) into ``dst``. */
int pe_npy_read_item(pe_npy *npy, long index, size_t nbytes, void *dst);

/* Read the tensor ``name`` of a safetensors file into ``dst`` (``nbytes``, ``dtype``). */
int pe_safetensors_read(const char *path, const char *name, int dtype, size_t nbytes,
                        void *dst, char *err, size_t errlen);

/* Write ``count`` tensors (names, dtypes, ranks, shapes, data) as one safetensors file. */
int pe_safetensors_write(const char *path, int count, const char *const *names,
                         const int *dtypes, const int *ranks, const long (*shapes)[8],
                         const void *const *data, char *err, size_t errlen);

#endif
