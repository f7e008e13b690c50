/* The trainer's convolution kernel table: ``./train --tune`` times every candidate kernel
 * of each tunable conv node on this device and writes the choices to a text file; a run
 * reads that file back and sets ``pe_conv_choice`` (declared in pe_kernels.h), which the
 * step's conv calls switch on. Without a file every node takes the rule's kernel.
 *
 * The exporter writes the table (``convs.c``, pockengine/backends/c/conv_table.py): per
 * node its name, op, dtype, geometry, candidate kernels (a bit mask over
 * ``pe_conv_kernel_names``) and the rule's kernel, a fingerprint of them all, and the
 * timing harness ``pe_tune_time``.
 *
 * The file is data, checked line by line before it sets anything:
 *
 *   pockengine-conv-kernels 1 <fingerprint>
 *   <slot> <kernel> <seconds> <node name>
 *
 * a slot outside [0, pe_num_convs), a kernel that is not one of that slot's candidates,
 * a repeated slot, a time that is not a non-negative number, a fingerprint of another
 * step or any other line is refused with the file, line and what is wrong. */
#ifndef PE_TUNE_H
#define PE_TUNE_H

#include <stddef.h>
#include <stdio.h>

#include "pe_kernels.h"

typedef struct {
    const char *name; /* the node's first output (IR name) */
    int op;           /* 0 conv2d, 1 conv2d_input_grad, 2 conv2d_weight_grad */
    int dtype;        /* 0 float32, 1 float64 */
    const long *geometry;
    int candidates; /* bit k: pe_conv_kernel_names[k] computes this node */
    int rule;       /* the kernel taken without a table */
} pe_conv_node;

/* A convolution that has an NHWC kernel (layout.py's nhwc_candidate), in its NCHW form:
 * ``./train --tune`` times its NCHW candidates against converting to NHWC, the NHWC kernel
 * and converting back (harness kernel index pe_num_conv_kernels), and, where it has one,
 * the same around its NCHW{c}c kernel (index pe_num_conv_kernels + 1), and writes the
 * layout each should take to the layout file, which ``pockengine export --layouts``
 * reads. */
typedef struct {
    const char *name; /* the node's first output (IR name) */
    int op, dtype;
    const long *geometry;
    int candidates; /* its NCHW kernels, as pe_conv_node's */
    int block;      /* c of its NCHW{c}c kernel, 0 for none */
    int layout;     /* the layout this export gave it: 0 NCHW, -1 NHWC, c NCHW{c}c */
} pe_layout_node;

extern const int pe_num_layout_nodes;
extern const pe_layout_node pe_layout_nodes[];
extern const char pe_layout_fingerprint[];

/* A GEMM slot (gemm_table.py): a node whose work is the GEMM's, timed by ./train --tune
 * under each of the build's micro-kernel shapes (gemm_micro.h). Its statement in step.c
 * sets pe_gemm_shape to pe_gemm_choice[slot] (declared in pe_kernels.h; 0, the default
 * shape, without a table). The shape file is data, checked as the kernel table is:
 *
 *   pockengine-gemm-shapes 1 <fingerprint>
 *   <slot> <shape> <seconds> <node name>
 *
 * where <shape> is one of this build's shapes for the slot's dtype ("6x64"). */
#define PE_GEMM_PRODUCT 3 /* a product's op (the harness's PE_TUNE_GEMM) */
typedef struct {
    const char *name; /* the node's first output (IR name) */
    int op;           /* 0-2 a convolution (as pe_conv_node's), or PE_GEMM_PRODUCT */
    int dtype;        /* 0 float32, 1 float64 */
    const long *geometry; /* a convolution's geometry, or a product's {M, N, K, ta, tb} */
    int conv_slot;    /* a convolution's slot in pe_conv_nodes (its kernel choice), or -1 */
    int kernel;       /* a convolution's kernel without a choice (the rule's) */
} pe_gemm_node;

extern const int pe_num_gemm_slots;
extern const pe_gemm_node pe_gemm_nodes[];
extern const char pe_gemm_fingerprint[];

/* The build's micro-kernel shapes for a dtype code of this step (rows[i] x cols[i], at
 * most max); how many, 0 for a dtype the step does not have (convs.c). */
int pe_tune_shape_list(int dtype, int *rows, int *cols, int max);

extern const int pe_num_convs;
extern const int pe_num_conv_kernels;
extern const char *const pe_conv_kernel_names[];
extern const char pe_conv_fingerprint[];
extern const pe_conv_node pe_conv_nodes[];

/* The median seconds of ``reps`` runs of one kernel on random operands (after one
 * warm-up run); -1 when the operands could not be allocated. */
double pe_tune_time(int op, int kernel, int dtype, const long *geometry, int reps);

/* Read the table at ``path`` into pe_conv_choice. 0 when it was read or does not exist
 * (``*found`` says which); 1 with the problem in ``err`` (nothing set). */
int pe_conv_table_read(const char *path, int *found, char *err, size_t errlen);

/* Time every candidate of every slot, print one line a slot to ``report`` and write the
 * table to ``path`` (a temporary file renamed over it). 0, or 1 with ``err`` set. */
int pe_conv_tune(const char *path, FILE *report, char *err, size_t errlen);

/* Read the shape file at ``path`` into pe_gemm_choice, as pe_conv_table_read. */
int pe_gemm_table_read(const char *path, int *found, char *err, size_t errlen);

/* Time every GEMM slot under each shape (a convolution with the kernel pe_conv_choice
 * names, else the rule's; one whose kernel is not a GEMM's keeps the default untimed),
 * print one line a slot to ``report`` and write the shape file to ``path``. A shape other
 * than the default is taken where it takes at most 0.97 of the default's time
 * (shape_tune._MARGIN). 0, or 1 with ``err`` set. */
int pe_gemm_tune(const char *path, FILE *report, char *err, size_t errlen);

/* Time each layout node's best NCHW kernel against NHWC and (where it has one) NCHW{c}c,
 * print one line a node to ``report`` and write the layout file to ``path`` (a temporary
 * file renamed over it):
 *
 *   pockengine-conv-layouts 2 <fingerprint>
 *   <node name> <nchw|nhwc|nchwc> <NCHW seconds> <NHWC seconds> <NCHWc seconds>
 *
 * The faster of NHWC and NCHW{c}c where it took less than 0.9 of the NCHW kernel's time
 * (layout_tune.MARGIN); 0 seconds for a layout not timed. 0, or 1 with ``err`` set. */
int pe_layout_tune(const char *path, FILE *report, char *err, size_t errlen);

#endif
