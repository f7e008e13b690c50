/* File formats of the stand-alone trainer: .npy arrays (the batches) and safetensors
 * (the state). Plain C, no library beyond libc.
 *
 * Every file is data: sizes, offsets and shapes read from a file are checked against the
 * file's real size and the types the step expects before anything is read into memory,
 * and each failure is one message naming the file. */
#ifndef PE_IO_H
#define PE_IO_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* The longest .npy header read (NumPy writes under 100 bytes for any array the step
 * takes; its own reader refuses more than 10000 by default). */
#define PE_NPY_MAX_HEADER 65536
#define PE_NPY_MAX_RANK 9 /* a step input has at most 8 axes, plus a stack's leading one */

/* An open .npy file: its type and shape, and where its data starts. The data stays on
 * disk: each step reads its batch straight into the arena (pe_npy_read_item), so a
 * dataset costs no resident memory. */
typedef struct {
    int dtype; /* a pe_dtype */
    int rank;
    long shape[PE_NPY_MAX_RANK];
    FILE *file;
    int64_t data_offset;
} pe_npy;

/* Open ``path`` and validate it: the magic, version 1-3, a header at most
 * PE_NPY_MAX_HEADER bytes long that is a dict of exactly 'descr' (one of the trainer's
 * little-endian dtypes), 'fortran_order' (False) and 'shape' (non-negative integers),
 * and a file size of exactly header + data. On failure write a message naming the file
 * to ``err`` and return non-zero (nothing stays open). */
int pe_npy_open(const char *path, pe_npy *out, char *err, size_t errlen);

/* Read item ``index`` (``nbytes`` each, from the start of the data) into ``dst``. */
int pe_npy_read_item(pe_npy *npy, long index, size_t nbytes, void *dst);

void pe_npy_close(pe_npy *npy);

/* An open safetensors file: its JSON header (read once) and where the data starts. */
typedef struct {
    const char *path;
    FILE *file;
    char *header;
    uint64_t header_len;
    int64_t data_bytes; /* the file's size after the header */
} pe_safetensors;

/* Open ``path`` and read its header (at most 256 MiB, inside the file). */
int pe_safetensors_open(const char *path, pe_safetensors *st, char *err, size_t errlen);

/* The same on a file already open as ``file`` (taken over: closed by the close). */
int pe_safetensors_attach(const char *path, FILE *file, pe_safetensors *st, char *err,
                          size_t errlen);

/* Where tensor ``name``'s data starts in the file (bytes from its start) into ``offset``,
 * after the checks of pe_safetensors_read. */
int pe_safetensors_locate(const pe_safetensors *st, const char *name, int dtype, int rank,
                          const long *shape, size_t nbytes, int64_t *offset, char *err,
                          size_t errlen);

/* Read tensor ``name`` into ``dst``: it must have ``dtype`` and ``shape`` (``rank``
 * axes; ``nbytes`` in all) and data offsets inside the file. */
int pe_safetensors_read(pe_safetensors *st, const char *name, int dtype, int rank,
                        const long *shape, size_t nbytes, void *dst, char *err, size_t errlen);

void pe_safetensors_close(pe_safetensors *st);

/* Shared by the readers and the writer: safetensors dtype names by pe_dtype; the bytes of
 * an array (-1 past ``limit``); a printf-style message into ``err`` (returns 1). */
extern const char *const PE_ST_DTYPE[];
int64_t pe_array_bytes(int dtype, int rank, const long *shape, int64_t limit);
#ifdef __GNUC__
__attribute__((format(printf, 3, 4)))
#endif
int pe_fail(char *err, size_t errlen, const char *fmt, ...);

/* A file being saved: written to ``tmp`` (``path`` + ".tmp", same folder), renamed over
 * ``path`` only once every byte is written and synced. */
typedef struct {
    char *path, *tmp;
    int fd;
} pe_save;

/* Create ``path``.tmp now (a folder that cannot be written fails here, before any work):
 * refuses a ``path`` that is a folder and a ``.tmp`` that is a symbolic link. */
int pe_save_begin(const char *path, pe_save *save, char *err, size_t errlen);

/* Write ``count`` tensors (names, dtypes, ranks, shapes, data) as one safetensors file
 * into the save's temporary file, sync it and rename it over the target. On any error
 * the temporary file is removed and the target is as it was. Ends the save. */
int pe_save_safetensors(pe_save *save, int count, const char *const *names,
                        const int *dtypes, const int *ranks, const long (*shapes)[8],
                        const void *const *data, char *err, size_t errlen);

/* Give up a save: remove its temporary file. Safe to call on an ended save. */
void pe_save_abort(pe_save *save);

#endif
