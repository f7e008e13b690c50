/* The trainer's convolution kernel table (pe_tune.h). */
#include "pe_tune.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define PE_TUNE_FORMAT "pockengine-conv-kernels"
#define PE_TUNE_VERSION 1
#define PE_TUNE_LINE 512

static int kernel_index(const char *name) {
    for (int k = 0; k < pe_num_conv_kernels; k++)
        if (!strcmp(name, pe_conv_kernel_names[k])) return k;
    return -1;
}

/* The next word of `s` (after blanks; up to the next blank or the end) into value, in 64
 * bytes; where the word ends, or NULL for no word or a longer one. Not sscanf: the trainer
 * links no scanf (its code would be resident in every run). */
static const char *read_word(const char *s, char value[64]) {
    while (*s == ' ' || *s == '\t') s++;
    size_t n = strcspn(s, " \t\r\n");
    if (n == 0 || n > 63) return NULL;
    memcpy(value, s, n);
    value[n] = '\0';
    return s + n;
}

/* The "<slot> <word> <seconds>" head of an entry line of a table of `slots` slots (each a
 * `what`, its word a `word`): the slot and the word (in 64 bytes); 0, or 1 with err set. */
static int read_head(const char *line, const char *path, long lineno, int slots,
                     const char *what, const char *word, long *slot, char value[64], char *err,
                     size_t errlen) {
    char *end;
    errno = 0;
    *slot = line[0] >= '0' && line[0] <= '9' ? strtol(line, &end, 10) : -1;
    if (*slot < 0 || errno == ERANGE || *end != ' ') {
        snprintf(err, errlen, "%s:%ld: expected '<slot> <%s> <seconds> <node>'", path, lineno,
                 word);
        return 1;
    }
    if (*slot >= slots) {
        snprintf(err, errlen, "%s:%ld: slot %ld is outside this step's %d %s", path, lineno,
                 *slot, slots, what);
        return 1;
    }
    const char *after = read_word(end, value);
    char *stop = NULL;
    double seconds = after ? strtod(after, &stop) : -1.0;
    /* the time ends at a blank or at the line's end (strchr finds the NUL too) */
    if (!after || stop == after || !strchr(" \t\r\n", *stop) || !(seconds >= 0) ||
        !isfinite(seconds)) {
        snprintf(err, errlen, "%s:%ld: expected a %s and a time in seconds", path, lineno, word);
        return 1;
    }
    return 0;
}

/* Sets choice[slot] = k unless the slot has one; 0, or 1 with err set. */
static int choose_once(int *choice, long slot, int k, const char *path, long lineno,
                       char *err, size_t errlen) {
    if (choice[slot] >= 0) {
        snprintf(err, errlen, "%s:%ld: slot %ld appears twice", path, lineno, slot);
        return 1;
    }
    choice[slot] = k;
    return 0;
}

/* One "<slot> <kernel> <seconds> <name>" line into choice[]; 0, or 1 with err set. */
static int read_entry(const char *line, const char *path, long lineno, int *choice, char *err,
                      size_t errlen) {
    char kernel[64];
    long slot;
    if (read_head(line, path, lineno, pe_num_convs, "tunable convolutions", "kernel", &slot,
                  kernel, err, errlen))
        return 1;
    const pe_conv_node *node = &pe_conv_nodes[slot];
    int k = kernel_index(kernel);
    if (k < 0 || !(node->candidates >> k & 1)) {
        snprintf(err, errlen, "%s:%ld: kernel '%s' cannot compute slot %ld (%s)", path, lineno,
                 kernel, slot, node->name);
        return 1;
    }
    return choose_once(choice, slot, k, path, lineno, err, errlen);
}

/* One entry line into choice[]: 0, or 1 with err set. */
typedef int (*entry_reader)(const char *line, const char *path, long lineno, int *choice,
                            char *err, size_t errlen);

/* The lines of a table (``what``, for errors) whose first line must be ``header``, each
 * later one an entry. */
static int read_lines(FILE *f, const char *path, const char *what, const char *header,
                      entry_reader entry, int *choice, char *err, size_t errlen) {
    char line[PE_TUNE_LINE];
    long lineno = 0;
    while (fgets(line, sizeof(line), f)) {
        lineno++;
        size_t n = strlen(line);
        if (n && line[n - 1] == '\n') line[--n] = '\0';
        else if (!feof(f)) {
            /* a line that stops short of a full buffer without its newline held a NUL */
            if (n + 1 < sizeof(line))
                snprintf(err, errlen, "%s:%ld: not text (a NUL byte)", path, lineno);
            else
                snprintf(err, errlen, "%s:%ld: line longer than %d bytes", path, lineno,
                         PE_TUNE_LINE - 1);
            return 1;
        }
        if (lineno == 1) {
            if (strcmp(line, header) != 0) {
                snprintf(err, errlen, "%s:1: not a %s of this step (expected '%s'); "
                         "run ./train --tune again or remove it", path, what, header);
                return 1;
            }
        } else if (entry(line, path, lineno, choice, err, errlen)) {
            return 1;
        }
    }
    if (lineno == 0) {
        snprintf(err, errlen, "%s: empty (expected the line '%s')", path, header);
        return 1;
    }
    return 0;
}

/* Reads the table at path (header, entries) into choices[0..n): 0 when it was read or does
 * not exist (*found says which), 1 with err set and nothing changed. */
static int read_table(const char *path, const char *what, const char *header,
                      entry_reader entry, int *choices, int n, int *found, char *err,
                      size_t errlen) {
    *found = 0;
    struct stat st; /* before opening: opening a pipe to read waits for a writer */
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) { /* a folder, a pipe, a device */
        *found = 1;
        snprintf(err, errlen, "%s: %s, not a file; expected the %s that ./train --tune writes",
                 path, S_ISDIR(st.st_mode) ? "is a folder" : "is not a regular file", what);
        return 1;
    }
    FILE *f = fopen(path, "r");
    if (!f) {
        if (errno == ENOENT) return 0;
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return 1;
    }
    *found = 1;
    int *choice = malloc((size_t)(n > 0 ? n : 1) * sizeof(int));
    if (!choice) {
        fclose(f);
        snprintf(err, errlen, "out of memory");
        return 1;
    }
    for (int k = 0; k < n; k++) choice[k] = -1;
    int bad = read_lines(f, path, what, header, entry, choice, err, errlen);
    if (!bad && ferror(f)) {
        snprintf(err, errlen, "%s: read failed", path);
        bad = 1;
    }
    fclose(f);
    if (!bad)
        for (int k = 0; k < n; k++) choices[k] = choice[k];
    free(choice);
    return bad;
}

int pe_conv_table_read(const char *path, int *found, char *err, size_t errlen) {
    char header[PE_TUNE_LINE];
    snprintf(header, sizeof(header), "%s %d %s", PE_TUNE_FORMAT, PE_TUNE_VERSION,
             pe_conv_fingerprint);
    return read_table(path, "kernel table", header, read_entry, pe_conv_choice, pe_num_convs,
                      found, err, errlen);
}

/* A file written aside: ``path``.<pid>.tmp opened for writing (NULL with err set), and
 * closed and renamed over ``path`` (0, or 1 with err set and the temporary removed). */
static FILE *open_aside(const char *path, char *tmp, size_t tmplen, char *err, size_t errlen) {
    if ((size_t)snprintf(tmp, tmplen, "%s.%ld.tmp", path, (long)getpid()) >= tmplen) {
        snprintf(err, errlen, "%s: path too long", path);
        return NULL;
    }
    FILE *f = fopen(tmp, "w");
    if (!f) snprintf(err, errlen, "%s: %s", tmp, strerror(errno));
    return f;
}

static int close_aside(FILE *f, const char *tmp, const char *path, char *err, size_t errlen) {
    int failed = ferror(f) != 0;
    failed |= fclose(f) != 0;
    if (failed || rename(tmp, path) != 0) {
        snprintf(err, errlen, "%s: %s", path, failed ? "write failed" : strerror(errno));
        remove(tmp);
        return 1;
    }
    return 0;
}

/* The median seconds of one harness kernel on a geometry, its repeats set by a warm-up run
 * (-1 when its operands could not be allocated). */
static double time_kernel(int op, int k, int dtype, const long *g) {
    double warm = pe_tune_time(op, k, dtype, g, 1);
    if (warm < 0) return -1;
    int reps = warm > 0.05 ? 3 : warm > 0.01 ? 5 : 9;
    return pe_tune_time(op, k, dtype, g, reps);
}

/* The fastest candidate of slot s (its time in *best), each one's time printed. */
static int tune_slot(int s, FILE *report, double *best) {
    const pe_conv_node *node = &pe_conv_nodes[s];
    int chosen = node->rule;
    *best = -1;
    fprintf(report, "%3d %-48s", s, node->name);
    for (int k = 0; k < pe_num_conv_kernels; k++) {
        if (!(node->candidates >> k & 1)) continue;
        double t = time_kernel(node->op, k, node->dtype, node->geometry);
        if (t < 0) continue;
        fprintf(report, " %s %.3f ms", pe_conv_kernel_names[k], 1e3 * t);
        if (t >= 0 && (*best < 0 || t < *best)) *best = t, chosen = k;
    }
    fprintf(report, " -> %s\n", pe_conv_kernel_names[chosen]);
    if (*best < 0) *best = 0;
    return chosen;
}

int pe_conv_tune(const char *path, FILE *report, char *err, size_t errlen) {
    char tmp[4096];
    FILE *f = open_aside(path, tmp, sizeof(tmp), err, errlen);
    if (!f) return 1;
    fprintf(f, "%s %d %s\n", PE_TUNE_FORMAT, PE_TUNE_VERSION, pe_conv_fingerprint);
    for (int s = 0; s < pe_num_convs; s++) {
        double seconds;
        int k = tune_slot(s, report, &seconds);
        fprintf(f, "%d %s %.9g %s\n", s, pe_conv_kernel_names[k], seconds, pe_conv_nodes[s].name);
        pe_conv_choice[s] = k;
    }
    return close_aside(f, tmp, path, err, errlen);
}

#define PE_SHAPE_FORMAT "pockengine-gemm-shapes"
#define PE_SHAPE_VERSION 1
#define PE_SHAPE_MARGIN 0.97 /* shape_tune._MARGIN */
#define PE_SHAPE_MAX 8

/* The build's micro-kernel shapes for a dtype (rows[i] x cols[i]); how many. */
static int shape_list(int dtype, int rows[PE_SHAPE_MAX], int cols[PE_SHAPE_MAX]) {
    int n = pe_tune_shape_list(dtype, rows, cols, PE_SHAPE_MAX);
    return n < PE_SHAPE_MAX ? n : PE_SHAPE_MAX;
}

/* One "<slot> <shape> <seconds> <name>" line into choice[]; 0, or 1 with err set. */
static int read_shape_entry(const char *line, const char *path, long lineno, int *choice,
                            char *err, size_t errlen) {
    char shape[64];
    long slot;
    if (read_head(line, path, lineno, pe_num_gemm_slots, "GEMM slots", "shape", &slot, shape,
                  err, errlen))
        return 1;
    const pe_gemm_node *node = &pe_gemm_nodes[slot];
    int rows[PE_SHAPE_MAX], cols[PE_SHAPE_MAX], n = shape_list(node->dtype, rows, cols), k = -1;
    for (int i = 0; i < n && k < 0; i++) {
        char label[32];
        snprintf(label, sizeof(label), "%dx%d", rows[i], cols[i]);
        if (!strcmp(label, shape)) k = i;
    }
    if (k < 0) {
        snprintf(err, errlen, "%s:%ld: shape '%s' is not one of this build's for slot %ld (%s)",
                 path, lineno, shape, slot, node->name);
        return 1;
    }
    return choose_once(choice, slot, k, path, lineno, err, errlen);
}

int pe_gemm_table_read(const char *path, int *found, char *err, size_t errlen) {
    char header[PE_TUNE_LINE];
    snprintf(header, sizeof(header), "%s %d %s", PE_SHAPE_FORMAT, PE_SHAPE_VERSION,
             pe_gemm_fingerprint);
    int bad = read_table(path, "shape table", header, read_shape_entry, pe_gemm_choice,
                         pe_num_gemm_slots, found, err, errlen);
    for (int k = 0; !bad && k < pe_num_gemm_slots; k++)
        if (pe_gemm_choice[k] < 0) pe_gemm_choice[k] = 0; /* a slot the file leaves out */
    return bad;
}

/* The conv kernel a slot's shapes are timed with (its table choice, else the rule's), or
 * -1 for one whose kernel does not run the GEMM. */
static int slot_kernel(const pe_gemm_node *node) {
    if (node->op == PE_GEMM_PRODUCT) return 0;
    int k = node->conv_slot >= 0 && pe_conv_choice[node->conv_slot] >= 0
                ? pe_conv_choice[node->conv_slot]
                : node->kernel;
    const char *name = pe_conv_kernel_names[k];
    return !strcmp(name, "pointwise") || !strcmp(name, "im2col") ? k : -1;
}

int pe_gemm_tune(const char *path, FILE *report, char *err, size_t errlen) {
    char tmp[4096];
    FILE *f = open_aside(path, tmp, sizeof(tmp), err, errlen);
    if (!f) return 1;
    fprintf(f, "%s %d %s\n", PE_SHAPE_FORMAT, PE_SHAPE_VERSION, pe_gemm_fingerprint);
    for (int s = 0; s < pe_num_gemm_slots; s++) {
        const pe_gemm_node *node = &pe_gemm_nodes[s];
        int rows[PE_SHAPE_MAX], cols[PE_SHAPE_MAX], n = shape_list(node->dtype, rows, cols);
        int kernel = slot_kernel(node), chosen = 0, best = -1;
        double times[PE_SHAPE_MAX];
        fprintf(report, "gemm %3d %-43s", s, node->name);
        for (int i = 0; i < n && kernel >= 0; i++) {
            pe_gemm_shape = i;
            times[i] = time_kernel(node->op, kernel, node->dtype, node->geometry);
            if (times[i] >= 0) fprintf(report, " %dx%d %.3f ms", rows[i], cols[i], 1e3 * times[i]);
            if (times[i] >= 0 && (best < 0 || times[i] < times[best])) best = i;
        }
        pe_gemm_shape = 0;
        if (kernel < 0) fprintf(report, " (its kernel runs no GEMM)");
        else if (best >= 0 && times[0] >= 0 && times[best] <= PE_SHAPE_MARGIN * times[0])
            chosen = best;
        double seconds = kernel >= 0 && times[chosen] >= 0 ? times[chosen] : 0;
        fprintf(report, " -> %dx%d\n", rows[chosen], cols[chosen]);
        fprintf(f, "%d %dx%d %.9g %s\n", s, rows[chosen], cols[chosen], seconds, node->name);
        pe_gemm_choice[s] = chosen;
    }
    return close_aside(f, tmp, path, err, errlen);
}

#define PE_LAYOUT_FORMAT "pockengine-conv-layouts"
#define PE_LAYOUT_VERSION 2 /* layout_table.py's _VERSION */
#define PE_LAYOUT_MARGIN 0.9

int pe_layout_tune(const char *path, FILE *report, char *err, size_t errlen) {
    char tmp[4096];
    FILE *f = open_aside(path, tmp, sizeof(tmp), err, errlen);
    if (!f) return 1;
    fprintf(f, "%s %d %s\n", PE_LAYOUT_FORMAT, PE_LAYOUT_VERSION, pe_layout_fingerprint);
    for (int s = 0; s < pe_num_layout_nodes; s++) {
        const pe_layout_node *node = &pe_layout_nodes[s];
        double nchw = -1;
        for (int k = 0; k < pe_num_conv_kernels; k++) {
            if (!(node->candidates >> k & 1)) continue;
            double t = time_kernel(node->op, k, node->dtype, node->geometry);
            if (t >= 0 && (nchw < 0 || t < nchw)) nchw = t;
        }
        double nhwc = time_kernel(node->op, pe_num_conv_kernels, node->dtype, node->geometry);
        double nchwc = node->block > 0 ? time_kernel(node->op, pe_num_conv_kernels + 1,
                                                     node->dtype, node->geometry)
                                       : -1;
        int blocked = nchwc >= 0 && (nhwc < 0 || nchwc < nhwc);
        double other = blocked ? nchwc : nhwc;
        int take = other >= 0 && (nchw < 0 || other < PE_LAYOUT_MARGIN * nchw);
        const char *chosen = !take ? "nchw" : blocked ? "nchwc" : "nhwc";
        fprintf(report, "layout %-44s NCHW %.3f ms NHWC %.3f ms NCHWc %.3f ms -> %s\n",
                node->name, 1e3 * nchw, 1e3 * nhwc, 1e3 * nchwc, chosen);
        fprintf(f, "%s %s %.9g %.9g %.9g\n", node->name, chosen, nchw < 0 ? 0 : nchw,
                nhwc < 0 ? 0 : nhwc, nchwc < 0 ? 0 : nchwc);
    }
    return close_aside(f, tmp, path, err, errlen);
}
