/* The trainer's --save: one safetensors file written to NAME.tmp in the target's folder,
 * synced and renamed over NAME, so the previous file stays whole until the new one is. */
#define _FILE_OFFSET_BITS 64
#include "pe_io.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int pe_save_begin(const char *path, pe_save *save, char *err, size_t errlen) {
    save->fd = -1;
    save->path = save->tmp = NULL;
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode))
        return pe_fail(err, errlen, "%s: is a folder; --save takes a file name", path);
    size_t n = strlen(path);
    save->path = malloc(n + 1);
    save->tmp = malloc(n + 5);
    if (!save->path || !save->tmp) return pe_fail(err, errlen, "out of memory");
    memcpy(save->path, path, n + 1);
    memcpy(save->tmp, path, n);
    memcpy(save->tmp + n, ".tmp", 5);
    if (lstat(save->tmp, &st) == 0 && !S_ISREG(st.st_mode))
        return pe_fail(err, errlen, "%s: exists and is not a regular file", save->tmp);
    save->fd = open(save->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (save->fd < 0)
        return pe_fail(err, errlen, "%s: cannot write the state there (%s)", save->tmp,
                    strerror(errno));
    return 0;
}

/* Print to ``out`` or, when it is NULL, only count; the characters either way. */
static long emit(FILE *out, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    int n = out ? vfprintf(out, fmt, args) : vsnprintf(NULL, 0, fmt, args);
    va_end(args);
    return n < 0 ? 0 : n;
}

/* ``s`` as a JSON string: quotes, backslashes and control characters escaped. */
static long emit_json_string(FILE *out, const char *s) {
    long n = emit(out, "\"");
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') n += emit(out, "\\%c", ch);
        else if (ch < 0x20) n += emit(out, "\\u%04x", ch);
        else n += emit(out, "%c", ch);
    }
    return n + emit(out, "\"");
}

/* The JSON header (``out`` NULL: only its length), padded with spaces to ``length``. */
static long safetensors_header(FILE *out, long length, int count, const char *const *names,
                               const int *dtypes, const int *ranks, const long (*shapes)[8]) {
    long written = emit(out, "{");
    size_t offset = 0;
    for (int t = 0; t < count; t++) {
        size_t n = (size_t)pe_array_bytes(dtypes[t], ranks[t], shapes[t], INT64_MAX / 2);
        written += emit(out, "%s", t ? "," : "") + emit_json_string(out, names[t]);
        written += emit(out, ":{\"dtype\":\"%s\",\"shape\":[", PE_ST_DTYPE[dtypes[t]]);
        for (int d = 0; d < ranks[t]; d++) written += emit(out, "%s%ld", d ? "," : "", shapes[t][d]);
        written += emit(out, "],\"data_offsets\":[%zu,%zu]}", offset, offset + n);
        offset += n;
    }
    written += emit(out, "}");
    for (; out && written < length; written++) fputc(' ', out);
    return written;
}

static int save_fail(pe_save *save, FILE *f, char *err, size_t errlen, const char *what) {
    int code = errno;
    if (f) fclose(f);
    else if (save->fd >= 0) close(save->fd);
    save->fd = -1;
    unlink(save->tmp);
    return pe_fail(err, errlen, "%s: %s (%s); %s is unchanged", save->tmp, what, strerror(code),
                save->path);
}

/* Make the rename itself durable: sync the folder that holds ``path``. */
static void sync_folder(const char *path) {
    const char *slash = strrchr(path, '/');
    char folder[4096] = ".";
    if (slash && (size_t)(slash - path) < sizeof(folder) - 1) {
        memcpy(folder, path, (size_t)(slash - path) + (slash == path));
        folder[(slash - path) + (slash == path)] = '\0';
    }
    int fd = open(folder, O_RDONLY);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

int pe_save_safetensors(pe_save *save, int count, const char *const *names,
                        const int *dtypes, const int *ranks, const long (*shapes)[8],
                        const void *const *data, char *err, size_t errlen) {
    FILE *f = fdopen(save->fd, "wb");
    if (!f) return save_fail(save, NULL, err, errlen, "cannot write");
    long length = (safetensors_header(NULL, 0, count, names, dtypes, ranks, shapes) + 7) / 8 * 8;
    unsigned char raw[8];
    for (int i = 0; i < 8; i++) raw[i] = (unsigned char)((uint64_t)length >> (8 * i));
    if (fwrite(raw, 1, 8, f) != 8) return save_fail(save, f, err, errlen, "write failed");
    safetensors_header(f, length, count, names, dtypes, ranks, shapes);
    for (int t = 0; t < count; t++) {
        size_t n = (size_t)pe_array_bytes(dtypes[t], ranks[t], shapes[t], INT64_MAX / 2);
        if (fwrite(data[t], 1, n, f) != n) return save_fail(save, f, err, errlen, "write failed");
    }
    if (fflush(f) != 0 || ferror(f)) return save_fail(save, f, err, errlen, "write failed");
    if (fsync(save->fd) != 0) return save_fail(save, f, err, errlen, "sync failed");
    save->fd = -1;
    if (fclose(f) != 0) return save_fail(save, NULL, err, errlen, "write failed");
    if (rename(save->tmp, save->path) != 0)
        return save_fail(save, NULL, err, errlen, "cannot rename it over the target");
    sync_folder(save->path);
    pe_save_abort(save);
    return 0;
}

void pe_save_abort(pe_save *save) {
    if (save->fd >= 0) {
        close(save->fd);
        save->fd = -1;
        unlink(save->tmp);
    }
    free(save->path);
    free(save->tmp);
    save->path = save->tmp = NULL;
}
