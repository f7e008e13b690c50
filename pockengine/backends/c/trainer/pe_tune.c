/* The trainer's convolution kernel table (pe_tune.h). */
#include "pe_tune.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PE_TUNE_FORMAT "pockengine-conv-kernels"
#define PE_TUNE_VERSION 1
#define PE_TUNE_LINE 512

static int kernel_index(const char *name) {
    for (int k = 0; k < pe_num_conv_kernels; k++)
        if (!strcmp(name, pe_conv_kernel_names[k])) return k;
    return -1;
}

/* One "<slot> <kernel> <seconds> <name>" line into choice[]; 0, or 1 with err set. */
static int read_entry(const char *line, const char *path, long lineno, int *choice, char *err,
                      size_t errlen) {
    char kernel[64], *end;
    int used = 0;
    errno = 0;
    long slot = line[0] >= '0' && line[0] <= '9' ? strtol(line, &end, 10) : -1;
    if (slot < 0 || errno == ERANGE || *end != ' ') {
        snprintf(err, errlen, "%s:%ld: expected '<slot> <kernel> <seconds> <node>'", path, lineno);
        return 1;
    }
    if (slot >= pe_num_convs) {
        snprintf(err, errlen, "%s:%ld: slot %ld is outside this step's %d tunable convolutions",
                 path, lineno, slot, pe_num_convs);
        return 1;
    }
    double seconds;
    if (sscanf(end, " %63s %lf %n", kernel, &seconds, &used) != 2 || !(seconds >= 0) ||
        !isfinite(seconds)) {
        snprintf(err, errlen, "%s:%ld: expected a kernel name and a time in seconds", path,
                 lineno);
        return 1;
    }
    const pe_conv_node *node = &pe_conv_nodes[slot];
    int k = kernel_index(kernel);
    if (k < 0 || !(node->candidates >> k & 1)) {
        snprintf(err, errlen, "%s:%ld: kernel '%s' cannot compute slot %ld (%s)", path, lineno,
                 kernel, slot, node->name);
        return 1;
    }
    if (choice[slot] >= 0) {
        snprintf(err, errlen, "%s:%ld: slot %ld appears twice", path, lineno, slot);
        return 1;
    }
    choice[slot] = k;
    return 0;
}

static int read_lines(FILE *f, const char *path, int *choice, char *err, size_t errlen) {
    char line[PE_TUNE_LINE], header[PE_TUNE_LINE];
    snprintf(header, sizeof(header), "%s %d %s", PE_TUNE_FORMAT, PE_TUNE_VERSION,
             pe_conv_fingerprint);
    long lineno = 0;
    while (fgets(line, sizeof(line), f)) {
        lineno++;
        size_t n = strlen(line);
        if (n && line[n - 1] == '\n') line[--n] = '\0';
        else if (!feof(f)) {
            snprintf(err, errlen, "%s:%ld: line longer than %d bytes", path, lineno,
                     PE_TUNE_LINE - 1);
            return 1;
        }
        if (lineno == 1) {
            if (strcmp(line, header) != 0) {
                snprintf(err, errlen, "%s:1: not a kernel table of this step (expected '%s'); "
                         "run ./train --tune again or remove it", path, header);
                return 1;
            }
        } else if (read_entry(line, path, lineno, choice, err, errlen)) {
            return 1;
        }
    }
    if (lineno == 0) {
        snprintf(err, errlen, "%s: empty (expected the line '%s')", path, header);
        return 1;
    }
    return 0;
}

int pe_conv_table_read(const char *path, int *found, char *err, size_t errlen) {
    *found = 0;
    FILE *f = fopen(path, "r");
    if (!f) {
        if (errno == ENOENT) return 0;
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return 1;
    }
    *found = 1;
    int n = pe_num_convs > 0 ? pe_num_convs : 1;
    int *choice = malloc((size_t)n * sizeof(int));
    if (!choice) {
        fclose(f);
        snprintf(err, errlen, "out of memory");
        return 1;
    }
    for (int k = 0; k < n; k++) choice[k] = -1;
    int bad = read_lines(f, path, choice, err, errlen);
    if (!bad && ferror(f)) {
        snprintf(err, errlen, "%s: read failed", path);
        bad = 1;
    }
    fclose(f);
    if (!bad)
        for (int k = 0; k < pe_num_convs; k++) pe_conv_choice[k] = choice[k];
    free(choice);
    return bad;
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
