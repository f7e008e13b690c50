/* Mapping the frozen file (pe_frozen.h). */
#define _FILE_OFFSET_BITS 64
#include "pe_frozen.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pe_io.h"
#include "pe_kernels.h"

extern const int pe_num_inputs;
extern const pe_input_info pe_inputs[];

int pe_is_frozen(int k) {
    for (int i = 0; i < pe_num_frozen; i++)
        if (pe_frozen[i].input == k) return 1;
    return 0;
}

/* Open ``path`` for reading: a regular file, not a link; its descriptor and size. */
static int open_regular(const char *path, int *fd, int64_t *size, char *err, size_t errlen) {
    struct stat st;
    if (lstat(path, &st) == 0 && S_ISLNK(st.st_mode))
        return pe_fail(err, errlen, "%s: is a symbolic link; the trainer maps only the frozen "
                    "file its export wrote", path);
    *fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (*fd < 0) return pe_fail(err, errlen, "%s: cannot open (%s)", path, strerror(errno));
    if (fstat(*fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(*fd);
        return pe_fail(err, errlen, "%s: not a regular file", path);
    }
    *size = (int64_t)st.st_size;
    return 0;
}

/* Every frozen tensor's entry in the header against the compiled layout. */
static int check_layout(pe_safetensors *st, char *err, size_t errlen) {
    for (int i = 0; i < pe_num_frozen; i++) {
        int k = pe_frozen[i].input;
        if (k < 0 || k >= pe_num_inputs)
            return pe_fail(err, errlen, "frozen.c does not match step.c; export again");
        const pe_input_info *v = &pe_inputs[k];
        int64_t n = pe_array_bytes(v->dtype, v->rank, v->shape, INT64_MAX / 2), at;
        if (pe_safetensors_locate(st, v->file_name, v->dtype, v->rank, v->shape, (size_t)n, &at,
                                  err, errlen))
            return 1;
        if (at % 64 != 0)
            return pe_fail(err, errlen, "%s: tensor \"%s\" starts at byte %lld, not a multiple of "
                        "64 (a misaligned frozen file)", st->path, v->file_name, (long long)at);
        if (at != pe_frozen[i].offset)
            return pe_fail(err, errlen, "%s: tensor \"%s\" starts at byte %lld where this step "
                        "was exported with byte %lld (another export's frozen file?)", st->path,
                        v->file_name, (long long)at, (long long)pe_frozen[i].offset);
    }
    return 0;
}

static uint64_t mix_word(uint64_t w, uint64_t j) {
    uint64_t x = w + j * UINT64_C(0x9E3779B97F4A7C15);
    x ^= x >> 32;
    x *= UINT64_C(0xBF58476D1CE4E5B9);
    return x ^ (x >> 29);
}

/* Little-endian word ``i`` of ``n`` bytes at ``p`` (the last one zero-padded). */
static uint64_t word_at(const unsigned char *p, int64_t n, int64_t i) {
    uint64_t w = 0;
    int64_t take = n - 8 * i < 8 ? n - 8 * i : 8;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(&w, p + 8 * i, (size_t)take);
#else
    for (int64_t b = 0; b < take; b++) w |= (uint64_t)p[8 * i + b] << (8 * b);
#endif
    return w;
}

/* frozen_file.frozen_digest over ``n`` bytes at ``p``, its words numbered on from ``*j``. */
static uint64_t digest_bytes(const unsigned char *p, int64_t n, uint64_t *j) {
    int64_t full = n / 8, words = (n + 7) / 8;
    uint64_t sum = 0, first = *j + 1;
    for (int64_t i = 0; i < full; i++) sum += mix_word(word_at(p, 8 * full, i), first + (uint64_t)i);
    if (words > full) sum += mix_word(word_at(p, n, full), first + (uint64_t)full);
    *j += (uint64_t)words;
    return sum;
}

static int check_digest(const char *path, const unsigned char *base, char *err, size_t errlen) {
    uint64_t sum = 0, j = 0;
    for (int i = 0; i < pe_num_frozen; i++) {
        const pe_input_info *v = &pe_inputs[pe_frozen[i].input];
        int64_t n = pe_array_bytes(v->dtype, v->rank, v->shape, INT64_MAX / 2);
        sum += digest_bytes(base + pe_frozen[i].offset, n, &j);
    }
    if (sum != pe_frozen_digest)
        return pe_fail(err, errlen, "%s: its tensors' bytes differ from the exported ones "
                    "(digest %016llx, exported %016llx): changed since the export, or another "
                    "export's frozen file; export again", path, (unsigned long long)sum,
                    (unsigned long long)pe_frozen_digest);
    return 0;
}

int pe_frozen_open(const char *path, pe_frozen_map *map, void **args, char *err, size_t errlen) {
    map->base = NULL;
    map->size = 0;
    if (pe_num_frozen == 0) return 0;
    int fd;
    int64_t size;
    if (open_regular(path, &fd, &size, err, errlen)) return 1;
    if (size != pe_frozen_file_bytes) {
        close(fd);
        return pe_fail(err, errlen, "%s: holds %lld bytes where this step was exported with "
                    "%lld (truncated, or another export's frozen file)", path, (long long)size,
                    (long long)pe_frozen_file_bytes);
    }
    int header_fd = dup(fd);
    FILE *f = header_fd >= 0 ? fdopen(header_fd, "rb") : NULL;
    if (!f) {
        if (header_fd >= 0) close(header_fd);
        close(fd);
        return pe_fail(err, errlen, "%s: cannot read (%s)", path, strerror(errno));
    }
    pe_safetensors st;
    int bad = pe_safetensors_attach(path, f, &st, err, errlen) || check_layout(&st, err, errlen);
    pe_safetensors_close(&st);
    void *base = bad ? MAP_FAILED : mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (!bad && base == MAP_FAILED)
        bad = pe_fail(err, errlen, "%s: cannot map (%s)", path, strerror(errno));
    close(fd);
    if (!bad && check_digest(path, base, err, errlen)) {
        munmap(base, (size_t)size);
        bad = 1;
    }
    if (bad) return 1;
    map->base = base;
    map->size = (size_t)size;
    for (int i = 0; i < pe_num_frozen; i++)
        args[pe_frozen[i].input] = (unsigned char *)base + pe_frozen[i].offset;
    return 0;
}

void pe_frozen_close(pe_frozen_map *map) {
    if (map->base) munmap(map->base, map->size);
    map->base = NULL;
    map->size = 0;
}
