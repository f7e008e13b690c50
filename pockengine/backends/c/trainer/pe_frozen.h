/* The frozen tensors, mapped read-only from frozen.bin instead of copied.
 *
 * Frozen params (float matrices, or the codes and scales of low-bit blocks) and lifted
 * constants are never written by the step. The exporter writes them into frozen.bin
 * (a safetensors layout, every tensor's data at a multiple of 64 bytes) and their layout
 * into frozen.c; ./train maps the file PROT_READ, MAP_PRIVATE and points each frozen
 * input into the mapping. The step cannot write them (a write would be a SIGSEGV), and the
 * pages are the page cache's: not copied, shared with other readers, dropped and read
 * again under memory pressure. */
#ifndef PE_FROZEN_H
#define PE_FROZEN_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    int input;      /* its position in pe_inputs */
    int64_t offset; /* where its data starts in frozen.bin (a multiple of 64) */
} pe_frozen_info;

extern const int pe_num_frozen;
extern const int64_t pe_frozen_file_bytes;
extern const uint64_t pe_frozen_digest; /* frozen_file.frozen_digest of the tensors' bytes */
extern const pe_frozen_info pe_frozen[];

/* The mapping of the frozen file (NULL and 0 when the step has no frozen tensor). */
typedef struct {
    void *base;
    size_t size;
} pe_frozen_map;

/* Whether input ``k`` is read from the frozen file. */
int pe_is_frozen(int k);

/* Map ``path`` and point ``args[k]`` of each frozen input into it. The file must be a
 * regular file (not a symbolic link) of exactly the exported size, its header must
 * give each frozen tensor the dtype, shape and offset this step was compiled for, and the
 * tensors' bytes must have the exported digest (a changed or exchanged file). On
 * failure write one message naming the file (and the tensor) to ``err``, map nothing and
 * return non-zero. Nothing is opened when the step has no frozen tensor. */
int pe_frozen_open(const char *path, pe_frozen_map *map, void **args, char *err, size_t errlen);

void pe_frozen_close(pe_frozen_map *map);

#endif
