/* .npy reading and safetensors reading/writing for the stand-alone trainer.
 *
 * The .npy reader takes format versions 1-3, little-endian float32/float64/int32/int64/
 * bool in C order. The safetensors reader finds a tensor's entry in the JSON header by
 * its quoted name and reads its dtype and data_offsets; it is enough for the files the
 * exporter and this trainer write (and for any writer's, as the header is flat JSON). */
#include "pe_io.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pe_kernels.h"

/* Indexed by pe_dtype (pe_kernels.h). */
static const char *const NPY_DESCR[] = {"<f4", "<f8", "<i4", "<i8", "|b1", "|u1"};
static const char *const ST_DTYPE[] = {"F32", "F64", "I32", "I64", "BOOL", "U8"};
#define PE_DTYPES ((int)(sizeof(NPY_DESCR) / sizeof(NPY_DESCR[0])))

static int fail(char *err, size_t errlen, const char *fmt, const char *a, const char *b) {
    snprintf(err, errlen, fmt, a, b);
    return 1;
}

static int npy_shape(const char *header, pe_npy *out) {
    const char *p = strstr(header, "'shape':");
    if (!p || !(p = strchr(p, '('))) return 1;
    out->rank = 0;
    for (p++; *p && *p != ')';) {
        while (*p == ' ' || *p == ',') p++;
        if (*p == ')') break;
        if (out->rank == 9) return 1;
        char *end;
        out->shape[out->rank++] = strtol(p, &end, 10);
        if (end == p) return 1;
        p = end;
    }
    return 0;
}

int pe_npy_open(const char *path, pe_npy *out, char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f) return fail(err, errlen, "%s: cannot open%s", path, "");
    unsigned char magic[10];
    if (fread(magic, 1, 10, f) != 10 || memcmp(magic, "\x93NUMPY", 6) != 0) {
        fclose(f);
        return fail(err, errlen, "%s: not a .npy file%s", path, "");
    }
    size_t hlen = magic[8] | (size_t)magic[9] << 8, start = 10;
    if (magic[6] >= 2) { /* versions 2 and 3: a 4-byte header length */
        unsigned char more[2];
        if (fread(more, 1, 2, f) != 2) hlen = 0;
        hlen |= (size_t)more[0] << 16 | (size_t)more[1] << 24;
        start = 12;
    }
    char *header = calloc(hlen + 1, 1);
    int bad = !header || fread(header, 1, hlen, f) != hlen;
    out->dtype = -1;
    for (int d = 0; !bad && d < PE_DTYPES; d++)
        if (strstr(header, NPY_DESCR[d])) out->dtype = d;
    bad = bad || out->dtype < 0 || strstr(header, "'fortran_order': True") || npy_shape(header, out);
    free(header);
    if (bad) {
        fclose(f);
        return fail(err, errlen, "%s: unsupported .npy header (want a C-order little-endian "
                    "float32, float64, int32, int64 or bool array)%s", path, "");
    }
    size_t n = pe_dtype_size(out->dtype);
    for (int d = 0; d < out->rank; d++) n *= (size_t)out->shape[d];
    out->file = f;
    out->data_offset = (long)(start + hlen);
    if (fseek(f, 0, SEEK_END) != 0 || ftell(f) < out->data_offset + (long)n) {
        fclose(f);
        return fail(err, errlen, "%s: truncated data%s", path, "");
    }
    setvbuf(f, NULL, _IONBF, 0); /* whole items are read at once: no stdio buffer */
    return 0;
}

int pe_npy_read_item(pe_npy *npy, long index, size_t nbytes, void *dst) {
    if (fseek(npy->file, npy->data_offset + index * (long)nbytes, SEEK_SET) != 0) return 1;
    return fread(dst, 1, nbytes, npy->file) != nbytes;
}

static char *read_header(FILE *f, uint64_t *len) {
    unsigned char raw[8];
    if (fread(raw, 1, 8, f) != 8) return NULL;
    *len = 0;
    for (int i = 7; i >= 0; i--) *len = *len << 8 | raw[i];
    if (*len > (1u << 28)) return NULL;
    char *header = calloc(*len + 1, 1);
    if (header && fread(header, 1, *len, f) != *len) {
        free(header);
        return NULL;
    }
    return header;
}

int pe_safetensors_read(const char *path, const char *name, int dtype, size_t nbytes, void *dst,
                        char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f) return fail(err, errlen, "%s: cannot open%s", path, "");
    uint64_t hlen;
    char *header = read_header(f, &hlen);
    if (!header) {
        fclose(f);
        return fail(err, errlen, "%s: not a safetensors file%s", path, "");
    }
    char key[512];
    snprintf(key, sizeof(key), "\"%s\":", name);
    char *entry = strstr(header, key);
    char *dt = entry ? strstr(entry, "\"dtype\":") : NULL;
    char *offs = entry ? strstr(entry, "\"data_offsets\":") : NULL;
    long begin = -1, end = -1;
    if (offs) sscanf(strchr(offs, '[') + 1, "%ld , %ld", &begin, &end);
    char want[32];
    snprintf(want, sizeof(want), "\"%s\"", ST_DTYPE[dtype]);
    int bad = !dt || strncmp(strchr(dt + 7, '"'), want, strlen(want)) != 0 ||
              end - begin != (long)nbytes;
    free(header);
    if (!entry || bad) {
        fclose(f);
        return fail(err, errlen, "%s: no tensor %s of the expected dtype and size", path, name);
    }
    if (fseek(f, (long)(8 + hlen) + begin, SEEK_SET) != 0 || fread(dst, 1, nbytes, f) != nbytes) {
        fclose(f);
        return fail(err, errlen, "%s: truncated data of %s", path, name);
    }
    fclose(f);
    return 0;
}

int pe_safetensors_write(const char *path, int count, const char *const *names, const int *dtypes,
                         const int *ranks, const long (*shapes)[8], const void *const *data,
                         char *err, size_t errlen) {
    FILE *f = fopen(path, "wb");
    if (!f) return fail(err, errlen, "%s: cannot write%s", path, "");
    /* Pass 1 measures the header, pass 2 writes it, padded with spaces to 8 bytes. */
    long length = 0;
    for (int pass = 0; pass < 2; pass++) {
        long written = 0;
        size_t offset = 0;
        FILE *out = pass ? f : NULL;
        char buf[1024];
        written += snprintf(buf, sizeof(buf), "{");
        if (out) fputs(buf, out);
        for (int t = 0; t < count; t++) {
            size_t n = pe_dtype_size(dtypes[t]);
            for (int d = 0; d < ranks[t]; d++) n *= (size_t)shapes[t][d];
            int k = snprintf(buf, sizeof(buf), "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[", t ? "," : "",
                             names[t], ST_DTYPE[dtypes[t]]);
            for (int d = 0; d < ranks[t]; d++)
                k += snprintf(buf + k, sizeof(buf) - (size_t)k, "%s%ld", d ? "," : "", shapes[t][d]);
            k += snprintf(buf + k, sizeof(buf) - (size_t)k, "],\"data_offsets\":[%zu,%zu]}", offset,
                          offset + n);
            offset += n;
            written += k;
            if (out) fputs(buf, out);
        }
        written += 1;
        if (out) {
            fputc('}', out);
            for (long pad = written; pad < length; pad++) fputc(' ', out);
        } else {
            length = (written + 7) / 8 * 8;
            unsigned char raw[8];
            for (int i = 0; i < 8; i++) raw[i] = (unsigned char)((uint64_t)length >> (8 * i));
            fwrite(raw, 1, 8, f);
        }
    }
    for (int t = 0; t < count; t++) {
        size_t n = pe_dtype_size(dtypes[t]);
        for (int d = 0; d < ranks[t]; d++) n *= (size_t)shapes[t][d];
        if (fwrite(data[t], 1, n, f) != n) {
            fclose(f);
            return fail(err, errlen, "%s: write failed%s", path, "");
        }
    }
    return fclose(f) != 0 ? fail(err, errlen, "%s: write failed%s", path, "") : 0;
}
