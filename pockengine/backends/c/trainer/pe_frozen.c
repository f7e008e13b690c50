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
