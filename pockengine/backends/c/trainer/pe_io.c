/* .npy and safetensors reading for the trainer.
 *
 * The .npy reader takes format versions 1-3 of one little-endian float32/float64/int32/
 * int64/bool/uint8/int8/float16 array in C order; its header is parsed as the Python dict
 * literal it is (exactly the keys 'descr', 'fortran_order', 'shape'), and the file must
 * hold exactly the bytes the header promises. The safetensors reader finds a tensor's
 * entry in the flat JSON header by its quoted key and checks its dtype, shape and data
 * offsets against the step and the file's size. Nothing read from a file sizes an
 * allocation or a read without such a check. The atomic save is pe_save.c. */
#define _FILE_OFFSET_BITS 64
#include "pe_io.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pe_kernels.h"

/* Indexed by pe_dtype (pe_kernels.h). */
static const char *const NPY_DESCR[] = {"<f4", "<f8", "<i4", "<i8", "|b1", "|u1", "|i1", "<f2"};
const char *const PE_ST_DTYPE[] = {"F32", "F64", "I32", "I64", "BOOL", "U8", "I8", "F16"};
#define PE_DTYPES ((int)(sizeof(NPY_DESCR) / sizeof(NPY_DESCR[0])))
#define PE_ST_MAX_HEADER ((uint64_t)1 << 28)

int pe_fail(char *err, size_t errlen, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(err, errlen, fmt, args);
    va_end(args);
    return 1;
}

/* The size of the regular file open as ``f``, or -1. */
static int64_t file_size(FILE *f) {
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) return -1;
    return (int64_t)st.st_size;
}

/* -- a cursor over text that is not NUL-terminated ----------------------------------- */
typedef struct {
    const char *p, *end;
} cursor;

static void skip_space(cursor *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r'))
        c->p++;
}

static int take(cursor *c, char ch) {
    skip_space(c);
    if (c->p >= c->end || *c->p != ch) return 0;
    c->p++;
    return 1;
}

static int take_word(cursor *c, const char *word) {
    size_t n = strlen(word);
    skip_space(c);
    if ((size_t)(c->end - c->p) < n || memcmp(c->p, word, n) != 0) return 0;
    c->p += n;
    return 1;
}

/* A quoted string without escapes (no key, dtype or name the trainer needs has any). */
static int take_string(cursor *c, char *out, size_t len) {
    skip_space(c);
    if (c->p >= c->end || (*c->p != '\'' && *c->p != '"')) return 0;
    char quote = *c->p++;
    size_t n = 0;
    for (; c->p < c->end && *c->p != quote; c->p++) {
        if (*c->p == '\\' || *c->p == '\0' || n + 1 >= len) return 0;
        out[n++] = *c->p;
    }
    if (c->p >= c->end) return 0;
    c->p++;
    out[n] = '\0';
    return 1;
}

/* A non-negative decimal integer of at most ``max``. */
static int take_count(cursor *c, int64_t max, int64_t *out) {
    skip_space(c);
    if (c->p >= c->end || *c->p < '0' || *c->p > '9') return 0;
    int64_t v = 0;
    for (; c->p < c->end && *c->p >= '0' && *c->p <= '9'; c->p++) {
        int digit = *c->p - '0';
        if (v > (max - digit) / 10) return 0;
        v = v * 10 + digit;
    }
    *out = v;
    return 1;
}

/* ``(d0, d1, ...)`` (Python tuple) or ``[d0, d1, ...]`` (JSON list) into shape/rank. */
static int take_shape(cursor *c, char open, char close, int max_rank, long *shape, int *rank) {
    if (!take(c, open)) return 0;
    *rank = 0;
    while (!take(c, close)) {
        int64_t d;
        if (*rank == max_rank || !take_count(c, (int64_t)1 << 48, &d)) return 0;
        shape[(*rank)++] = (long)d;
        if (!take(c, ',')) return take(c, close);
    }
    return 1;
}

int64_t pe_array_bytes(int dtype, int rank, const long *shape, int64_t limit) {
    int64_t n = (int64_t)pe_dtype_size(dtype);
    for (int d = 0; d < rank; d++) {
        if (shape[d] == 0) return 0;
        if (n > limit / shape[d]) return -1;
        n *= shape[d];
    }
    return n;
}

/* -- .npy -------------------------------------------------------------------------------- */
/* One key of the header dict and its value into ``out``; ``seen`` marks the keys read. */
static const char *npy_entry(cursor *c, pe_npy *out, int *seen) {
    char key[32], descr[32];
    if (!take_string(c, key, sizeof(key)) || !take(c, ':')) return "a dict of quoted keys";
    if (!strcmp(key, "descr") && !(*seen & 1)) {
        if (!take_string(c, descr, sizeof(descr))) return "'descr' as a quoted dtype";
        for (int d = 0; d < PE_DTYPES; d++)
            if (!strcmp(descr, NPY_DESCR[d])) out->dtype = d;
        if (out->dtype < 0) return "dtype";
        *seen |= 1;
    } else if (!strcmp(key, "fortran_order") && !(*seen & 2)) {
        if (take_word(c, "True")) return "fortran";
        if (!take_word(c, "False")) return "'fortran_order' False";
        *seen |= 2;
    } else if (!strcmp(key, "shape") && !(*seen & 4)) {
        if (!take_shape(c, '(', ')', PE_NPY_MAX_RANK, out->shape, &out->rank))
            return "'shape' as a tuple of at most 9 non-negative integers";
        *seen |= 4;
    } else {
        return "the keys 'descr', 'fortran_order' and 'shape', once each";
    }
    return NULL;
}

/* Parse the header dict; NULL, or what was expected where it failed. */
static const char *npy_header(const char *text, size_t len, pe_npy *out) {
    cursor c = {text, text + len};
    int seen = 0;
    out->dtype = -1;
    if (!take(&c, '{')) return "a dict";
    while (!take(&c, '}')) {
        const char *problem = npy_entry(&c, out, &seen);
        if (problem) return problem;
        if (!take(&c, ',') && !take(&c, '}')) return "',' or '}' after a value";
        if (c.p[-1] == '}') break;
    }
    skip_space(&c);
    if (c.p != c.end) return "nothing after the dict but spaces and a newline";
    return seen == 7 ? NULL : "the keys 'descr', 'fortran_order' and 'shape'";
}

static int npy_fail(FILE *f, char *err, size_t errlen, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(err, errlen, fmt, args);
    va_end(args);
    fclose(f);
    return 1;
}

/* The header's length and where it starts (10 or 12), after the magic and version. */
static int npy_preamble(FILE *f, const char *path, int64_t size, uint32_t *hlen, int *start,
                        char *err, size_t errlen) {
    unsigned char head[12];
    if (size < 10 || fread(head, 1, 10, f) != 10 || memcmp(head, "\x93NUMPY", 6) != 0)
        return pe_fail(err, errlen, "%s: not a .npy file (it does not start with \\x93NUMPY)", path);
    if (head[6] < 1 || head[6] > 3 || head[7] != 0)
        return pe_fail(err, errlen, "%s: .npy format version %d.%d is not one the trainer reads "
                    "(1.0, 2.0 or 3.0)", path, head[6], head[7]);
    *hlen = (uint32_t)head[8] | (uint32_t)head[9] << 8;
    *start = 10;
    if (head[6] >= 2) { /* versions 2 and 3: a 4-byte header length */
        if (size < 12 || fread(head + 10, 1, 2, f) != 2)
            return pe_fail(err, errlen, "%s: the file ends inside its .npy preamble", path);
        *hlen |= (uint32_t)head[10] << 16 | (uint32_t)head[11] << 24;
        *start = 12;
    }
    if (*hlen > PE_NPY_MAX_HEADER)
        return pe_fail(err, errlen, "%s: the .npy header length %lu is over the limit of %d bytes",
                    path, (unsigned long)*hlen, PE_NPY_MAX_HEADER);
    if ((int64_t)*start + *hlen > size)
        return pe_fail(err, errlen, "%s: the file (%lld bytes) ends inside its .npy header "
                    "(%lu bytes)", path, (long long)size, (unsigned long)*hlen);
    return 0;
}

int pe_npy_open(const char *path, pe_npy *out, char *err, size_t errlen) {
    memset(out, 0, sizeof(*out));
    FILE *f = fopen(path, "rb");
    if (!f) return pe_fail(err, errlen, "%s: cannot open (%s)", path, strerror(errno));
    int64_t size = file_size(f);
    if (size < 0) return npy_fail(f, err, errlen, "%s: not a regular file", path);
    uint32_t hlen;
    int start;
    if (npy_preamble(f, path, size, &hlen, &start, err, errlen)) return fclose(f), 1;
    char *header = malloc(hlen ? hlen : 1);
    if (!header || fread(header, 1, hlen, f) != hlen) {
        free(header);
        return npy_fail(f, err, errlen, "%s: read failed in the .npy header", path);
    }
    const char *problem = memchr(header, '\0', hlen) ? "no NUL bytes" : npy_header(header, hlen, out);
    free(header);
    if (problem && !strcmp(problem, "dtype"))
        return npy_fail(f, err, errlen, "%s: its dtype is not one the trainer reads (little-endian "
                        "float32 <f4, float64 <f8, int32 <i4, int64 <i8, bool |b1, uint8 |u1)", path);
    if (problem && !strcmp(problem, "fortran"))
        return npy_fail(f, err, errlen, "%s: the array is in Fortran order; save it in C order "
                        "(numpy.ascontiguousarray)", path);
    if (problem)
        return npy_fail(f, err, errlen, "%s: not a valid .npy header (expected %s)", path, problem);
    int64_t data = size - start - hlen;
    int64_t want = pe_array_bytes(out->dtype, out->rank, out->shape, INT64_MAX / 2);
    if (want < 0)
        return npy_fail(f, err, errlen, "%s: its header's shape is too large", path);
    if (want != data)
        return npy_fail(f, err, errlen, "%s: holds %lld bytes of data where its header's dtype "
                        "and shape need %lld (truncated, or not one array)", path,
                        (long long)data, (long long)want);
    out->file = f;
    out->data_offset = (int64_t)start + (int64_t)hlen;
    setvbuf(f, NULL, _IONBF, 0); /* whole items are read at once: no stdio buffer */
    return 0;
}

int pe_npy_read_item(pe_npy *npy, long index, size_t nbytes, void *dst) {
    off_t at = (off_t)npy->data_offset + (off_t)index * (off_t)nbytes;
    if (fseeko(npy->file, at, SEEK_SET) != 0) return 1;
    return fread(dst, 1, nbytes, npy->file) != nbytes;
}

void pe_npy_close(pe_npy *npy) {
    if (npy->file) fclose(npy->file);
    npy->file = NULL;
}

/* -- safetensors, reading ------------------------------------------------------------------ */
int pe_safetensors_open(const char *path, pe_safetensors *st, char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        memset(st, 0, sizeof(*st));
        return pe_fail(err, errlen, "%s: cannot open (%s)", path, strerror(errno));
    }
    return pe_safetensors_attach(path, f, st, err, errlen);
}

int pe_safetensors_attach(const char *path, FILE *file, pe_safetensors *st, char *err,
                          size_t errlen) {
    memset(st, 0, sizeof(*st));
    st->path = path;
    st->file = file;
    int64_t size = file_size(st->file);
    unsigned char raw[8];
    if (size < 8 || fread(raw, 1, 8, st->file) != 8) {
        pe_safetensors_close(st);
        return pe_fail(err, errlen, "%s: not a safetensors file (no 8-byte header length)", path);
    }
    for (int i = 7; i >= 0; i--) st->header_len = st->header_len << 8 | raw[i];
    if (st->header_len > PE_ST_MAX_HEADER || (int64_t)st->header_len > size - 8) {
        pe_safetensors_close(st);
        return pe_fail(err, errlen, "%s: not a safetensors file (header length %llu, file %lld "
                    "bytes)", path, (unsigned long long)st->header_len, (long long)size);
    }
    st->data_bytes = size - 8 - (int64_t)st->header_len;
    st->header = malloc(st->header_len + 1);
    if (!st->header || fread(st->header, 1, st->header_len, st->file) != st->header_len ||
        memchr(st->header, '\0', st->header_len)) {
        pe_safetensors_close(st);
        return pe_fail(err, errlen, "%s: unreadable safetensors header", path);
    }
    st->header[st->header_len] = '\0';
    return 0;
}

/* The object of key ``name`` in the flat header: [*begin, *end) between its braces. */
static int find_entry(const pe_safetensors *st, const char *name, cursor *entry) {
    size_t n = strlen(name);
    const char *h = st->header, *end = h + st->header_len;
    for (const char *q = h; (q = memchr(q, '"', (size_t)(end - q))) != NULL; q++) {
        if ((size_t)(end - q) < n + 2 || memcmp(q + 1, name, n) != 0 || q[n + 1] != '"') continue;
        const char *before = q;
        while (before > h && strchr(" \t\r\n", before[-1])) before--;
        if (before == h || (before[-1] != '{' && before[-1] != ',')) continue;
        cursor c = {q + n + 2, end};
        if (!take(&c, ':') || !take(&c, '{')) continue;
        const char *close = memchr(c.p, '}', (size_t)(end - c.p));
        if (!close) return 0;
        entry->p = c.p;
        entry->end = close;
        return 1;
    }
    return 0;
}

/* A cursor just after ``"key":`` inside ``entry``. */
static int find_key(const cursor *entry, const char *key, cursor *at) {
    size_t n = strlen(key);
    for (const char *q = entry->p; q + n + 2 <= entry->end; q++) {
        if (*q != '"' || memcmp(q + 1, key, n) != 0 || q[n + 1] != '"') continue;
        *at = (cursor){q + n + 2, entry->end};
        return take(at, ':');
    }
    return 0;
}

int pe_safetensors_locate(const pe_safetensors *st, const char *name, int dtype, int rank,
                          const long *shape, size_t nbytes, int64_t *offset, char *err,
                          size_t errlen) {
    cursor entry, c;
    if (!find_entry(st, name, &entry))
        return pe_fail(err, errlen, "%s: no tensor \"%s\"", st->path, name);
    char got[16] = "";
    long dims[8];
    int got_rank = -1;
    int64_t lo = -1, hi = -1;
    if (find_key(&entry, "dtype", &c) && !take_string(&c, got, sizeof(got))) got[0] = '\0';
    if (find_key(&entry, "shape", &c) && !take_shape(&c, '[', ']', 8, dims, &got_rank))
        got_rank = -1;
    if (find_key(&entry, "data_offsets", &c) &&
        !(take(&c, '[') && take_count(&c, INT64_MAX / 2, &lo) && take(&c, ',') &&
          take_count(&c, INT64_MAX / 2, &hi) && take(&c, ']')))
        lo = hi = -1;
    int same = strcmp(got, PE_ST_DTYPE[dtype]) == 0 && got_rank == rank;
    for (int d = 0; same && d < rank; d++) same = dims[d] == shape[d];
    if (!same)
        return pe_fail(err, errlen, "%s: tensor \"%s\" is not %s of the step's shape (rank %d, "
                    "%zu bytes)", st->path, name, PE_ST_DTYPE[dtype], rank, nbytes);
    if (lo < 0 || hi < lo || hi - lo != (int64_t)nbytes || hi > st->data_bytes)
        return pe_fail(err, errlen, "%s: tensor \"%s\" has data offsets [%lld, %lld]: not its %zu "
                    "bytes inside the file's %lld bytes of data", st->path, name, (long long)lo,
                    (long long)hi, nbytes, (long long)st->data_bytes);
    *offset = (int64_t)(8 + st->header_len) + lo;
    return 0;
}

int pe_safetensors_read(pe_safetensors *st, const char *name, int dtype, int rank,
                        const long *shape, size_t nbytes, void *dst, char *err, size_t errlen) {
    int64_t at;
    if (pe_safetensors_locate(st, name, dtype, rank, shape, nbytes, &at, err, errlen)) return 1;
    if (fseeko(st->file, (off_t)at, SEEK_SET) != 0 || fread(dst, 1, nbytes, st->file) != nbytes)
        return pe_fail(err, errlen, "%s: read failed in the data of \"%s\"", st->path, name);
    return 0;
}

void pe_safetensors_close(pe_safetensors *st) {
    if (st->file) fclose(st->file);
    free(st->header);
    st->file = NULL;
    st->header = NULL;
}
