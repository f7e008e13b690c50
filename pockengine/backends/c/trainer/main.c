/* The stand-alone trainer: runs the exported training step on .npy batches.
 *
 *   ./train [--steps N] [--save out.safetensors] [--state in.safetensors] [--threads T]
 *           X.npy Y.npy ...
 *
 * The .npy files are the step's batch inputs in call order, each either one batch or a
 * stack of batches (a leading axis) used in turn. Memory: one state block (params,
 * buffers, optimizer state, read from the state file), one arena of the planned size,
 * and the .npy files; the step itself allocates nothing. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pe_io.h"
#include "pe_kernels.h"

extern const size_t pe_arena_bytes;
extern const int pe_num_inputs;
extern const pe_input_info pe_inputs[];
extern const pe_output_info pe_outputs[];
void pe_step(unsigned char *restrict A, void *const *in);

static const char *const DTYPE_NAME[] = {"float32", "float64", "int32", "int64", "bool", "uint8"};

typedef struct {
    long steps;
    const char *save, *state;
    int threads;
    const char *files[64];
    int nfiles;
} options;

static int usage(const char *argv0) {
    fprintf(stderr, "usage: %s [--steps N] [--save out.safetensors] [--state in.safetensors] "
            "[--threads T] BATCH.npy ...\n", argv0);
    return 2;
}

static size_t input_bytes(const pe_input_info *v) {
    size_t n = pe_dtype_size(v->dtype);
    for (int d = 0; d < v->rank; d++) n *= (size_t)v->shape[d];
    return n;
}

static void describe(char *out, size_t len, int dtype, int rank, const long *shape) {
    int k = snprintf(out, len, "%s[", DTYPE_NAME[dtype]);
    for (int d = 0; d < rank; d++) k += snprintf(out + k, len - (size_t)k, "%s%ld", d ? "," : "", shape[d]);
    snprintf(out + k, len - (size_t)k, "]");
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

static int parse(int argc, char **argv, options *o) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int more = i + 1 < argc;
        if (!strcmp(a, "--steps") && more) o->steps = atol(argv[++i]);
        else if (!strcmp(a, "--save") && more) o->save = argv[++i];
        else if (!strcmp(a, "--state") && more) o->state = argv[++i];
        else if (!strcmp(a, "--threads") && more) o->threads = atoi(argv[++i]);
        else if (a[0] == '-' && a[1] == '-') return 1;
        else if (o->nfiles < 64) o->files[o->nfiles++] = a;
        else return 1;
    }
    return 0;
}

static int save_state(const char *path, void *const *args) {
    const char *names[1024];
    int dtypes[1024], ranks[1024], count = 0;
    long shapes[1024][8];
    const void *data[1024];
    for (int k = 0; k < pe_num_inputs && count < 1024; k++) {
        const pe_input_info *v = &pe_inputs[k];
        if (v->role == PE_INPUT) continue;
        names[count] = v->file_name;
        dtypes[count] = v->dtype;
        ranks[count] = v->rank;
        memcpy(shapes[count], v->shape, sizeof(v->shape));
        data[count++] = args[k];
    }
    char err[512];
    if (pe_safetensors_write(path, count, names, dtypes, ranks, (const long (*)[8])shapes, data,
                             err, sizeof(err))) {
        fprintf(stderr, "error: %s\n", err);
        return 1;
    }
    return 0;
}

/* Everything one run holds: the arena, the state block, the inputs' addresses, the open
 * batch files and how many batches each holds. */
typedef struct {
    unsigned char *arena, *state;
    void **args;
    pe_npy *npys;
    long *counts, batches;
} trainer;

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
        fprintf(stderr, "error: %s: batch input %d (%s) must be %s or a stack [B, ...] of it, "
                "got %s\n", o->files[b], b, v->name, want, got);
        return 1;
    }
    t->batches = t->counts[b] > t->batches ? t->counts[b] : t->batches;
    return 0;
}

/* Allocate the arena and the state block (once), read the state, open the batches. */
static int setup(const options *o, trainer *t, int nbatch, size_t state_bytes) {
    t->arena = aligned_alloc(64, (pe_arena_bytes + 63) / 64 * 64);
    t->state = aligned_alloc(64, state_bytes ? state_bytes : 64);
    t->args = calloc((size_t)(pe_num_inputs > 0 ? pe_num_inputs : 1), sizeof(void *));
    t->npys = calloc((size_t)(nbatch ? nbatch : 1), sizeof(pe_npy));
    t->counts = calloc((size_t)(nbatch ? nbatch : 1), sizeof(long));
    t->batches = 1;
    if (!t->arena || !t->state || !t->args || !t->npys || !t->counts) {
        fprintf(stderr, "error: out of memory\n");
        return 1;
    }
    size_t at = 0;
    char err[1024];
    for (int k = 0, b = 0; k < pe_num_inputs; k++) {
        const pe_input_info *v = &pe_inputs[k];
        size_t n = input_bytes(v);
        if (v->role == PE_INPUT) {
            if (open_batch(o, t, k, b++)) return 1;
            continue;
        }
        t->args[k] = t->state + at;
        at += (n + 63) / 64 * 64;
        if (pe_safetensors_read(o->state, v->file_name, v->dtype, n, t->args[k], err, sizeof(err))) {
            fprintf(stderr, "error: %s\n", err);
            return 1;
        }
    }
    return 0;
}

/* Step ``s``: read its batches into the arena, run, print the loss; the seconds it took. */
static double run_step(const options *o, trainer *t, long s) {
    for (int k = 0, b = 0; k < pe_num_inputs; k++) {
        if (pe_inputs[k].role != PE_INPUT) continue;
        if (pe_npy_read_item(&t->npys[b], s % t->counts[b], input_bytes(&pe_inputs[k]), t->args[k])) {
            fprintf(stderr, "error: %s: read failed\n", o->files[b]);
            return -1;
        }
        b++;
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    pe_step(t->arena, t->args);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const pe_output_info *loss = &pe_outputs[0];
    const void *at = loss->input_index >= 0 ? t->args[loss->input_index] : t->arena + loss->arena_offset;
    printf("step %ld loss %.9g\n", s, loss->dtype == PE_F64 ? *(const double *)at : *(const float *)at);
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}

int main(int argc, char **argv) {
    options o = {-1, NULL, "state.safetensors", 0, {0}, 0};
    if (parse(argc, argv, &o)) return usage(argv[0]);
    if (o.threads > 0 && pe_set_threads(o.threads) != o.threads)
        fprintf(stderr, "warning: built without OpenMP, running on 1 thread\n");
    int nbatch = 0;
    size_t state_bytes = 0;
    for (int k = 0; k < pe_num_inputs; k++) {
        if (pe_inputs[k].role == PE_INPUT) nbatch++;
        else state_bytes += (input_bytes(&pe_inputs[k]) + 63) / 64 * 64;
    }
    if (o.nfiles != nbatch) {
        fprintf(stderr, "error: the step takes %d batch inputs (.npy files), got %d\n", nbatch, o.nfiles);
        return usage(argv[0]);
    }
    trainer t;
    if (setup(&o, &t, nbatch, state_bytes)) return 1;
    long steps = o.steps >= 0 ? o.steps : t.batches;
    double timed = 0; /* seconds in pe_step after the first (warm-up) step */
    for (long s = 0; s < steps; s++) {
        double seconds = run_step(&o, &t, s);
        if (seconds < 0) return 1;
        if (s > 0) timed += seconds;
    }
    fflush(stdout);
    if (steps > 1)
        fprintf(stderr, "mean step time %.3f ms (steps 1..%ld)\n", 1e3 * timed / (double)(steps - 1),
                steps - 1);
    return o.save && save_state(o.save, t.args) ? 1 : 0;
}
