/* The stand-alone trainer: runs the exported training step on .npy batches.
 *
 *   ./train [--steps N] [--save out.safetensors] [--state in.safetensors] [--threads T]
 *           [--kernels conv-kernels.txt] [--shapes gemm-shapes.txt] [--memory-report]
 *           X.npy Y.npy ...
 *   ./train --tune [--threads T] [--kernels conv-kernels.txt] [--shapes gemm-shapes.txt]
 *           [--layouts conv-layouts.txt]
 *
 * --tune times each convolution's candidate kernels on this device and writes the
 * choices to the kernel table (default conv-kernels.txt), then each GEMM node under the
 * GEMM's micro-kernel shapes and writes those to the shape table (default
 * gemm-shapes.txt); later runs read both (pe_tune.h). Without the files every
 * convolution takes the exporter's rule and every GEMM the default shape. Where
 * convolutions have an NHWC kernel it also times each against NHWC and writes the
 * layouts to the layout file (default conv-layouts.txt), which a later export reads
 * (pockengine export --layouts): layouts are fixed when the step is exported.
 *
 * The .npy files are the step's batch inputs in call order, each either one batch or a
 * stack of batches (a leading axis) used in turn. Memory: one state block (trained
 * params, buffers, optimizer state, read from the state file), the frozen tensors mapped
 * read-only from frozen.bin (pe_frozen.h), one arena of the planned size, and the .npy
 * files; the step itself allocates nothing.
 *
 * --help prints the usage. Everything the trainer is given is checked before the first
 * step: the options, each file's format, type and shape, every index batch file's values
 * against the range the step indexes (pe_check.h), and that the --save target can be
 * written. Exit status:
 * 0 done; 2 refused (bad options or input: nothing ran, nothing was written); 1 failed
 * while running or saving (the previous --save file, if any, is unchanged). */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pe_check.h"
#include "pe_frozen.h"
#include "pe_io.h"
#include "pe_kernels.h"
#include "pe_memory.h"
#include "pe_tune.h"

extern const size_t pe_arena_bytes;
extern const int pe_num_inputs;
extern const pe_input_info pe_inputs[];
extern const pe_output_info pe_outputs[];
void pe_step(unsigned char *restrict A, void *const *in);

#define PE_MAX_FILES 64
#define PE_REFUSED 2
#define PE_FAILED 1

static const char *const DTYPE_NAME[] = {"float32", "float64", "int32", "int64", "bool", "uint8", "int8", "float16"};

typedef struct {
    long steps; /* -1: one pass over the batches */
    const char *save, *state;
    long threads;
    int tune;            /* --tune: time the conv kernels, write the table, train nothing */
    const char *kernels; /* the kernel table */
    const char *shapes;  /* the GEMM shape table */
    const char *layouts; /* --tune: where the measured layouts go (NULL: conv-layouts.txt) */
    const char *files[PE_MAX_FILES];
    int nfiles;
    int memory_report; /* --memory-report: the peak and its split after the last step */
} options;

static int usage(FILE *out, const char *argv0) {
    fprintf(out, "usage: %s [--steps N] [--save out.safetensors] [--state in.safetensors] "
            "[--threads T] [--kernels TABLE] [--shapes TABLE] [--memory-report] BATCH.npy ... | "
            "--tune [--threads T] [--kernels TABLE] [--shapes TABLE] [--layouts FILE]\n", argv0);
    return PE_REFUSED;
}

/* A non-negative decimal integer of at most ``max`` (digits only: no sign, no spaces). */
static int parse_count(const char *flag, const char *text, long max, long *out) {
    char *end;
    errno = 0;
    long v = text[0] >= '0' && text[0] <= '9' ? strtol(text, &end, 10) : -1;
    if (v < 0 || *end != '\0' || errno == ERANGE || v > max) {
        char most[48] = "";
        if (max < LONG_MAX) snprintf(most, sizeof(most), " (at most %ld)", max);
        fprintf(stderr, "error: %s takes a non-negative integer%s, got '%s'\n", flag, most, text);
        return 1;
    }
    *out = v;
    return 0;
}

/* One option with its value at argv[*i]; 0, or 1 after printing the error. */
static int parse_option(int argc, char **argv, int *i, options *o) {
    const char *flag = argv[*i];
    int known = !strcmp(flag, "--steps") || !strcmp(flag, "--save") ||
                !strcmp(flag, "--state") || !strcmp(flag, "--threads") ||
                !strcmp(flag, "--kernels") || !strcmp(flag, "--shapes") ||
                !strcmp(flag, "--layouts");
    if (!known) {
        fprintf(stderr, "error: unknown option '%s'\n", flag);
        return 1;
    }
    if (*i + 1 >= argc || argv[*i + 1][0] == '\0' || !strncmp(argv[*i + 1], "--", 2)) {
        fprintf(stderr, "error: %s needs a value\n", flag);
        return 1;
    }
    const char *value = argv[++*i];
    if (!strcmp(flag, "--steps")) return parse_count(flag, value, LONG_MAX, &o->steps);
    if (!strcmp(flag, "--threads")) return parse_count(flag, value, 4096, &o->threads);
    if (!strcmp(flag, "--save")) o->save = value;
    else if (!strcmp(flag, "--kernels")) o->kernels = value;
    else if (!strcmp(flag, "--shapes")) o->shapes = value;
    else if (!strcmp(flag, "--layouts")) o->layouts = value;
    else o->state = value;
    return 0;
}

/* 0; 1 after printing the error (the caller prints the usage); -1 for --help. */
static int parse(int argc, char **argv, options *o) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return -1;
        if (!strcmp(argv[i], "--tune")) {
            o->tune = 1;
            continue;
        }
        if (!strcmp(argv[i], "--memory-report")) {
            o->memory_report = 1;
            continue;
        }
        if (argv[i][0] == '-' && argv[i][1] != '\0') {
            if (parse_option(argc, argv, &i, o)) return 1;
        } else if (o->nfiles < PE_MAX_FILES) {
            o->files[o->nfiles++] = argv[i];
        } else {
            fprintf(stderr, "error: more than %d batch files\n", PE_MAX_FILES);
            return 1;
        }
    }
    return 0;
}

static size_t input_bytes(const pe_input_info *v) {
    size_t n = pe_dtype_size(v->dtype);
    for (int d = 0; d < v->rank; d++) n *= (size_t)v->shape[d];
    return n;
}

static void describe(char *out, size_t len, int dtype, int rank, const long *shape) {
    size_t k = (size_t)snprintf(out, len, "%s[", DTYPE_NAME[dtype]);
    for (int d = 0; d < rank && k < len; d++)
        k += (size_t)snprintf(out + k, len - k, "%s%ld", d ? "," : "", shape[d]);
    if (k < len) snprintf(out + k, len - k, "]");
}

/* How many batches ``a`` holds for input ``v`` (1, or its leading axis), or -1. */
static long batches_in(const pe_npy *a, const pe_input_info *v) {
    if (a->dtype != v->dtype) return -1;
    int lead = a->rank - v->rank;
    if (lead != 0 && lead != 1) return -1;
    for (int d = 0; d < v->rank; d++)
        if (a->shape[lead + d] != v->shape[d]) return -1;
    return lead ? a->shape[0] : 1;
}

/* Everything one run holds: the arena, the state block, the inputs' addresses, the open
 * batch files, how many batches each holds, and the file being saved. */
typedef struct {
    unsigned char *arena, *state;
    void **args;
    pe_npy *npys;
    long *counts, batches;
    int nbatch;
    pe_save save;
    pe_frozen_map frozen;
} trainer;

static void trainer_free(trainer *t) {
    pe_save_abort(&t->save);
    for (int b = 0; t->npys && b < t->nbatch; b++) pe_npy_close(&t->npys[b]);
    pe_frozen_close(&t->frozen);
    free(t->arena);
    free(t->state);
    free(t->args);
    free(t->npys);
    free(t->counts);
}

static int open_batch(const options *o, trainer *t, int k, int b) {
    const pe_input_info *v = &pe_inputs[k];
    char err[1024];
    t->args[k] = t->arena + v->arena_offset;
    if (pe_npy_open(o->files[b], &t->npys[b], err, sizeof(err))) {
        fprintf(stderr, "error: %s\n", err);
        return 1;
    }
    t->counts[b] = batches_in(&t->npys[b], v);
    if (t->counts[b] < 1) {
        char want[256], got[256];
        describe(want, sizeof(want), v->dtype, v->rank, v->shape);
        describe(got, sizeof(got), t->npys[b].dtype, t->npys[b].rank, t->npys[b].shape);
        fprintf(stderr, "error: %s: batch input %d (%s) must be %s or a stack [B, ...] of it "
                "(B >= 1), got %s\n", o->files[b], b, v->name, want, got);
        return 1;
    }
    t->batches = t->counts[b] > t->batches ? t->counts[b] : t->batches;
    return 0;
}

/* Read the trained params, buffers and optimizer state from the state file into the state
 * block, and map the frozen tensors. */
static int read_state(const options *o, trainer *t) {
    pe_safetensors st;
    char err[1024];
    if (pe_frozen_open("frozen.bin", &t->frozen, t->args, err, sizeof(err))) {
        fprintf(stderr, "error: %s\n", err);
        return 1;
    }
    if (pe_safetensors_open(o->state, &st, err, sizeof(err))) {
        fprintf(stderr, "error: %s\n", err);
        return 1;
    }
    size_t at = 0;
    int bad = 0;
    for (int k = 0; k < pe_num_inputs && !bad; k++) {
        const pe_input_info *v = &pe_inputs[k];
        if (v->role == PE_INPUT || pe_is_frozen(k)) continue;
        size_t n = input_bytes(v);
        t->args[k] = t->state + at;
        at += (n + 63) / 64 * 64;
        bad = pe_safetensors_read(&st, v->file_name, v->dtype, v->rank, v->shape, n, t->args[k],
                                  err, sizeof(err));
    }
    pe_safetensors_close(&st);
    if (bad) fprintf(stderr, "error: %s\n", err);
    return bad;
}

/* The batch file position of input ``k`` (its place among the batch inputs), or -1. */
static int batch_of(int k) {
    if (k < 0 || k >= pe_num_inputs || pe_inputs[k].role != PE_INPUT) return -1;
    int b = 0;
    for (int j = 0; j < k; j++) b += pe_inputs[j].role == PE_INPUT;
    return b;
}

/* Every index batch file against its bound, read through its arena slot. */
static int check_indices(const options *o, trainer *t) {
    for (int i = 0; i < pe_num_index_bounds; i++) {
        const pe_index_bound *bound = &pe_index_bounds[i];
        int k = bound->input, b = batch_of(k);
        if (b < 0 || strcmp(pe_inputs[k].name, bound->name) != 0) {
            fprintf(stderr, "error: bounds.c does not match step.c (input %s); export again\n",
                    bound->name);
            return 1;
        }
        char err[1024];
        if (pe_check_index_file(bound, o->files[b], &t->npys[b], t->counts[b],
                                input_bytes(&pe_inputs[k]), t->args[k], err, sizeof(err))) {
            fprintf(stderr, "error: %s\n", err);
            return 1;
        }
    }
    return 0;
}

/* Allocate the arena and the state block, open and check the batches, read the state,
 * create the --save file's temporary: everything that can refuse the run. */
static int setup(const options *o, trainer *t, size_t state_bytes) {
    t->arena = aligned_alloc(64, (pe_arena_bytes + 63) / 64 * 64);
    t->state = aligned_alloc(64, state_bytes ? (state_bytes + 63) / 64 * 64 : 64);
    t->args = calloc((size_t)(pe_num_inputs > 0 ? pe_num_inputs : 1), sizeof(void *));
    t->npys = calloc((size_t)(t->nbatch ? t->nbatch : 1), sizeof(pe_npy));
    t->counts = calloc((size_t)(t->nbatch ? t->nbatch : 1), sizeof(long));
    t->batches = 1;
    if (!t->arena || !t->state || !t->args || !t->npys || !t->counts) {
        fprintf(stderr, "error: out of memory\n");
        return PE_FAILED;
    }
    for (int k = 0, b = 0; k < pe_num_inputs; k++)
        if (pe_inputs[k].role == PE_INPUT && open_batch(o, t, k, b++)) return PE_REFUSED;
    if (read_state(o, t) || check_indices(o, t)) return PE_REFUSED;
    char err[1024];
    if (o->save && pe_save_begin(o->save, &t->save, err, sizeof(err))) {
        fprintf(stderr, "error: %s\n", err);
        return PE_REFUSED;
    }
    return 0;
}

/* The index values just read for input ``k`` are still in range: the file was checked
 * before the first step, but it is read again each step, and may have changed since. */
static int still_in_range(const options *o, const trainer *t, int k, int b, long item) {
    for (int i = 0; i < pe_num_index_bounds; i++) {
        const pe_index_bound *bound = &pe_index_bounds[i];
        if (bound->input != k) continue;
        long n = (long)(input_bytes(&pe_inputs[k]) / pe_dtype_size(pe_inputs[k].dtype)), at = 0;
        int64_t value = 0;
        if (pe_index_violations(bound, pe_inputs[k].dtype, t->args[k], n, &at, &value)) {
            fprintf(stderr, "error: %s changed during the run: item %ld now holds %s %lld, "
                    "outside [%lld, %lld); stopped before the step\n", o->files[b], item,
                    bound->what, (long long)value, (long long)bound->low, (long long)bound->high);
            return 0;
        }
    }
    return 1;
}

static double seconds_on(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Step ``s``: read its batches into the arena, run, print the loss (stdout) and the step's
 * wall-clock and process CPU seconds (stderr); the wall-clock seconds it took. */
static double run_step(const options *o, trainer *t, long s) {
    for (int k = 0, b = 0; k < pe_num_inputs; k++) {
        if (pe_inputs[k].role != PE_INPUT) continue;
        long item = s % t->counts[b];
        if (pe_npy_read_item(&t->npys[b], item, input_bytes(&pe_inputs[k]), t->args[k])) {
            fprintf(stderr, "error: %s: read failed\n", o->files[b]);
            return -1;
        }
        if (!still_in_range(o, t, k, b, item)) return -1;
        b++;
    }
    double wall = seconds_on(CLOCK_MONOTONIC), cpu = seconds_on(CLOCK_PROCESS_CPUTIME_ID);
    pe_step(t->arena, t->args);
    wall = seconds_on(CLOCK_MONOTONIC) - wall;
    cpu = seconds_on(CLOCK_PROCESS_CPUTIME_ID) - cpu;
    const pe_output_info *loss = &pe_outputs[0];
    const void *at = loss->input_index >= 0 ? t->args[loss->input_index] : t->arena + loss->arena_offset;
    printf("step %ld loss %.9g\n", s, loss->dtype == PE_F64 ? *(const double *)at : *(const float *)at);
    fprintf(stderr, "step %ld time %.6f s cpu %.6f s\n", s, wall, cpu);
    return wall;
}

/* Trained params, buffers (under the model's names) and optimizer state into the --save
 * file (the frozen tensors stay in frozen.bin). */
static int save_state(trainer *t) {
    size_t most = (size_t)(pe_num_inputs > 0 ? pe_num_inputs : 1);
    const char **names = calloc(most, sizeof(*names));
    int *dtypes = calloc(most, sizeof(int)), *ranks = calloc(most, sizeof(int));
    long(*shapes)[8] = calloc(most, sizeof(*shapes));
    const void **data = calloc(most, sizeof(*data));
    char err[1024] = "out of memory";
    int count = 0, failed = !names || !dtypes || !ranks || !shapes || !data;
    for (int k = 0; k < pe_num_inputs && !failed; k++) {
        const pe_input_info *v = &pe_inputs[k];
        if (v->role == PE_INPUT || pe_is_frozen(k)) continue;
        names[count] = v->file_name;
        dtypes[count] = v->dtype;
        ranks[count] = v->rank;
        memcpy(shapes[count], v->shape, sizeof(v->shape));
        data[count++] = t->args[k];
    }
    if (!failed)
        failed = pe_save_safetensors(&t->save, count, names, dtypes, ranks,
                                     (const long(*)[8])shapes, data, err, sizeof(err));
    if (failed) fprintf(stderr, "error: %s\n", err);
    free(names);
    free(dtypes);
    free(ranks);
    free(shapes);
    free(data);
    return failed;
}

static int train(const options *o, trainer *t, size_t state_bytes) {
    int refused = setup(o, t, state_bytes);
    if (refused) return refused;
    if (o->threads > 0 && pe_set_threads((int)o->threads) != o->threads)
        fprintf(stderr, "warning: built without OpenMP, running on 1 thread\n");
    long steps = o->steps >= 0 ? o->steps : t->batches;
    double timed = 0; /* seconds in pe_step after the first (warm-up) step */
    for (long s = 0; s < steps; s++) {
        double seconds = run_step(o, t, s);
        if (seconds < 0) return PE_FAILED;
        if (s > 0) timed += seconds;
    }
    fflush(stdout);
    if (steps > 1)
        fprintf(stderr, "mean step time %.3f ms (steps 1..%ld)\n", 1e3 * timed / (double)(steps - 1),
                steps - 1);
    if (o->memory_report) pe_memory_report(stderr, pe_arena_bytes, state_bytes, t->frozen.size);
    return o->save && save_state(t) ? PE_FAILED : 0;
}

/* --tune: no batch, state or save file; the table is all it writes. */
static int tune(const options *o) {
    if (o->nfiles || o->save || o->steps >= 0) {
        fprintf(stderr, "error: --tune takes only --threads, --kernels, --shapes and --layouts\n");
        return PE_REFUSED;
    }
    if (o->threads > 0 && pe_set_threads((int)o->threads) != o->threads)
        fprintf(stderr, "warning: built without OpenMP, running on 1 thread\n");
    char err[1024];
    if (pe_conv_tune(o->kernels, stdout, err, sizeof(err))) {
        fprintf(stderr, "error: %s\n", err);
        return PE_FAILED;
    }
    fflush(stdout);
    fprintf(stderr, "wrote %s (%d convolutions)\n", o->kernels, pe_num_convs);
    if (pe_gemm_tune(o->shapes, stdout, err, sizeof(err))) {
        fprintf(stderr, "error: %s\n", err);
        return PE_FAILED;
    }
    fflush(stdout);
    fprintf(stderr, "wrote %s (%d GEMM nodes)\n", o->shapes, pe_num_gemm_slots);
    const char *layouts = o->layouts ? o->layouts : "conv-layouts.txt";
    if (pe_num_layout_nodes > 0) {
        if (pe_layout_tune(layouts, stdout, err, sizeof(err))) {
            fprintf(stderr, "error: %s\n", err);
            return PE_FAILED;
        }
        fflush(stdout);
        fprintf(stderr, "wrote %s (%d convolutions with other layouts; pockengine export "
                "--layouts %s exports them so)\n", layouts, pe_num_layout_nodes, layouts);
    }
    return 0;
}

int main(int argc, char **argv) {
    /* Past a file size limit a write fails with EFBIG (and the save is undone) instead of
     * the signal ending the process. */
    signal(SIGXFSZ, SIG_IGN);
    options o = {-1,   NULL, "state.safetensors", 0, 0, "conv-kernels.txt", "gemm-shapes.txt",
                 NULL, {0},  0,    0};
    int parsed = parse(argc, argv, &o);
    if (parsed < 0) {
        usage(stdout, argv[0]);
        return 0;
    }
    if (parsed) return usage(stderr, argv[0]);
    if (o.tune) return tune(&o);
    if (o.layouts) {
        fprintf(stderr, "error: --layouts goes with --tune (a run cannot change its layouts)\n");
        return PE_REFUSED;
    }
    trainer t = {0};
    size_t state_bytes = 0;
    for (int k = 0; k < pe_num_inputs; k++) {
        if (pe_inputs[k].role == PE_INPUT) t.nbatch++;
        else if (!pe_is_frozen(k)) state_bytes += (input_bytes(&pe_inputs[k]) + 63) / 64 * 64;
    }
    if (o.nfiles != t.nbatch) {
        fprintf(stderr, "error: the step takes %d batch inputs (.npy files), got %d\n", t.nbatch,
                o.nfiles);
        return usage(stderr, argv[0]);
    }
    char err[1024];
    int found = 0;
    if (pe_conv_table_read(o.kernels, &found, err, sizeof(err))) {
        fprintf(stderr, "error: %s\n", err);
        return PE_REFUSED;
    }
    if (found) fprintf(stderr, "conv kernels: %s\n", o.kernels);
    if (pe_gemm_table_read(o.shapes, &found, err, sizeof(err))) {
        fprintf(stderr, "error: %s\n", err);
        return PE_REFUSED;
    }
    if (found) fprintf(stderr, "GEMM shapes: %s\n", o.shapes);
    t.save.fd = -1;
    int status = train(&o, &t, state_bytes);
    trainer_free(&t);
    return status;
}
