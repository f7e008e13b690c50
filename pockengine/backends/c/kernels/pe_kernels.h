/* PockEngine C kernels: the declarations every generated step and every kernel file share.
 *
 * Kernels take raw pointers and sizes; they never allocate. Each family (linalg.c, conv.c,
 * norm.c, pool.c, softmax.c, index.c, update.c, attention.c, loss.c) is written once over
 * PE_T and instantiated for float (suffix _f32) and double (suffix _f64) by including
 * itself twice. Elementwise
 * math lives in elementwise.h as inline scalar functions that the generated loops call. */
#ifndef PE_KERNELS_H
#define PE_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "pe_isa.h" /* the GEMM's instruction set; PE_FAST_GEMM picks the rule's kernels */

#ifdef _OPENMP
#include <omp.h>
#define PE_PRAGMA(x) _Pragma(#x)
/* Loops of less work (about a quarter million multiply-adds) stay on one thread. */
#define PE_PARALLEL_FOR(work) \
    PE_PRAGMA(omp parallel for schedule(static) if ((work) > (1L << 18)))
#else
#define PE_PARALLEL_FOR(work)
#endif

/* Element types and roles of the step's inputs, as the metadata tables name them. */
enum pe_dtype { PE_F32 = 0, PE_F64 = 1, PE_I32 = 2, PE_I64 = 3, PE_BOOL = 4, PE_U8 = 5,
                PE_I8 = 6, PE_F16 = 7 };
enum pe_role { PE_INPUT = 0, PE_PARAM = 1, PE_BUFFER = 2, PE_CONST = 3, PE_STATE = 4 };

/* One graph input: its IR name, the name in the state file, type, role and, for a batch
 * input, its planned offset in the arena. */
typedef struct {
    const char *name;
    const char *file_name;
    int dtype;
    int role;
    int rank;
    long shape[8];
    long arena_offset;
} pe_input_info;

/* One graph output: where it lives (an arena offset, or a graph input when >= 0). */
typedef struct {
    const char *name;
    int dtype;
    long numel;
    long arena_offset;
    int input_index;
} pe_output_info;

/* A GEMM operand's layout (linalg.c): element (r, c) is at r*rs + c*cs, except that the
 * axis named by split (1 rows, 2 columns; 0 none) runs in spans of ``span`` indices placed
 * ``jump`` elements apart: index x is at (x / span) * jump + (x % span) * its stride. A
 * batch of images' per-image matrices read as one matrix so (a pointwise convolution's
 * [C, HW] planes side by side as [C, N*HW]). */
typedef struct {
    long rs, cs, span, jump;
    int split;
} pe_layout;

int pe_set_threads(int threads);
size_t pe_dtype_size(int dtype);
long pe_winograd4_work(int op, const long *geom); /* winograd.c: its working memory */
/* linalg.c: the micro-kernel shape the GEMMs run, 0 (the default) to 2 (gemm_micro.h); the
 * step sets it around a node the tuner chose a shape for. */
extern int pe_gemm_shape;

#define PE_DECLARE(S, T)                                                                       \
    void pe_gemm_##S(long M, long N, long K, const T *A, long lda, int ta, const T *B,         \
                     long ldb, int tb, T *C, long ldc, int accumulate);                        \
    void pe_gemm_strided_##S(long M, long N, long K, const T *A, pe_layout la, const T *B,     \
                             pe_layout lb, T *C, pe_layout lc, int accumulate);                \
    void pe_gemm_least_padded_##S(long M, long N, long K, const T *A, pe_layout la, const T *B, \
                                  pe_layout lb, T *C, pe_layout lc, int accumulate);           \
    void pe_gemm_implicit_##S(long M, long N, long K, const T *A, pe_layout la,                \
                              void (*pack)(const void *, T *, long, long, long, long, long),   \
                              const void *ctx, T *C, pe_layout lc, int accumulate);            \
    void pe_gemm_images_##S(long count, long M, long N, long K, const T *A, long lda, int ta,  \
                            const T *B, long bstride, T *C, long cstride);                     \
    int pe_gemm_shape_list_##S(int *rows, int *cols, int max);                                 \
    void pe_conv2d_##S(const T *x, const T *w, const T *bias, T *y, const long *geom);         \
    void pe_conv2d_input_grad_##S(const T *gy, const T *w, T *gx, const long *geom);           \
    void pe_conv2d_weight_grad_##S(const T *x, const T *gy, T *gw, const long *geom);          \
    void pe_conv2d_im2col_##S(const T *x, const T *w, const T *bias, T *y, const long *geom);  \
    void pe_conv2d_direct_##S(const T *x, const T *w, const T *bias, T *y, const long *geom);  \
    void pe_conv2d_input_grad_direct_##S(const T *gy, const T *w, T *gx, const long *geom);    \
    void pe_conv2d_weight_grad_direct_##S(const T *x, const T *gy, T *gw, const long *geom);   \
    void pe_conv2d_pointwise_##S(const T *x, const T *w, const T *bias, T *y, const long *geom); \
    void pe_conv2d_input_grad_pointwise_##S(const T *gy, const T *w, T *gx, const long *geom); \
    void pe_conv2d_weight_grad_pointwise_##S(const T *x, const T *gy, T *gw, const long *geom); \
    void pe_conv2d_depthwise_##S(const T *x, const T *w, const T *bias, T *y, const long *geom); \
    void pe_conv2d_input_grad_depthwise_##S(const T *gy, const T *w, T *gx, const long *geom); \
    void pe_conv2d_weight_grad_depthwise_##S(const T *x, const T *gy, T *gw, const long *geom); \
    void pe_conv2d_input_grad_im2col_##S(const T *gy, const T *w, T *gx, const long *geom);    \
    void pe_conv2d_winograd_##S(const T *x, const T *w, const T *bias, T *y, const long *geom); \
    void pe_conv2d_input_grad_winograd_##S(const T *gy, const T *w, T *gx, const long *geom);  \
    void pe_conv2d_winograd4_##S(const T *x, const T *w, const T *bias, T *y, const long *geom, \
                                 T *work);                                                     \
    void pe_conv2d_input_grad_winograd4_##S(const T *gy, const T *w, T *gx, const long *geom,  \
                                            T *work);                                          \
    void pe_conv2d_weight_grad_winograd4_##S(const T *x, const T *gy, T *gw, const long *geom, \
                                             T *work);                                         \
    void pe_conv2d_weight_grad_im2col_##S(const T *x, const T *gy, T *gw, const long *geom);   \
    void pe_depthwise_##S(const T *x, const T *w, const T *bias, T *y, const long *geom);      \
    void pe_depthwise_input_grad_##S(const T *gy, const T *w, T *gx, const long *geom);        \
    void pe_depthwise_weight_grad_##S(const T *x, const T *gy, T *gw, const long *geom);       \
    int pe_dw_flat_forward_##S(const T *x, const T *w, const T *bias, T *y, const long *geom); \
    int pe_dw_flat_input_grad_##S(const T *gy, const T *w, T *gx, const long *geom);           \
    int pe_dw_flat_weight_grad_##S(const T *x, const T *gy, T *gw, const long *geom);          \
    void pe_batch_norm_##S(const T *x, const T *w, const T *b, T *y, T *mean, T *var,          \
                           long N, long C, long S_, double eps);                               \
    void pe_batch_norm_grad_##S(const T *gy, const T *x, const T *w, const T *mean,            \
                                const T *var, T *gx, T *gw, T *gb, long N, long C, long S_,    \
                                double eps);                                                   \
    void pe_batch_norm_hardtanh_##S(const T *x, const T *w, const T *b, T *z, T *mean,        \
                                    T *var, long N, long C, long S_, double eps, double lo,   \
                                    double hi);                                              \
    void pe_batch_norm_hardtanh_grad_##S(const T *gz, const T *x, const T *w, const T *b,     \
                                         const T *mean, const T *var, T *gx, T *gw, T *gb,    \
                                         long N, long C, long S_, double eps, double lo,      \
                                         double hi);                                         \
    T pe_bn_channel_stats_##S(const T *x, long N, long C, long S_, long c, T *var);           \
    void pe_conv2d_bn_hardtanh_##S(const T *x, const T *bw, const T *bb, T *mean, T *var,      \
                                   const T *w, const T *bias, T *y, const long *geom,          \
                                   double eps, double lo, double hi);                          \
    void pe_conv2d_bn_hardtanh_weight_grad_##S(const T *x, const T *bw, const T *bb,           \
                                               const T *mean, const T *var, const T *gy,       \
                                               T *gw, const long *geom, double eps, double lo, \
                                               double hi);                                     \
    void pe_conv2d_pointwise_bn_hardtanh_##S(const T *x, const T *bw, const T *bb, T *mean,    \
                                             T *var, const T *w, T *y, const long *geom,       \
                                             double eps, double lo, double hi);                \
    void pe_batch_norm_apply_##S(const T *x, const T *w, const T *b, const T *mean,           \
                                 const T *var, T *z, long N, long C, long S_, double eps,     \
                                 int clip, double lo, double hi);                             \
    void pe_layer_norm_##S(const T *x, const T *w, const T *b, T *y, T *mean, T *rstd,         \
                           long rows, long cols, double eps);                                  \
    void pe_layer_norm_grad_##S(const T *gy, const T *x, const T *w, const T *mean,            \
                                const T *rstd, T *gx, T *gw, T *gb, long rows, long cols);     \
    void pe_max_pool2d_##S(const T *x, T *y, const long *geom);                                \
    void pe_max_pool2d_grad_##S(const T *gy, const T *x, T *gx, const long *geom);             \
    void pe_avg_pool2d_##S(const T *x, T *y, const long *geom);                                \
    void pe_avg_pool2d_grad_##S(const T *gy, T *gx, const long *geom);                         \
    void pe_softmax_##S(const T *x, T *y, long outer, long n, long inner, int log, int safe); \
    void pe_softmax_grad_##S(const T *gz, const T *z, T *gx, long outer, long n, long inner,   \
                             int log);                                                         \
    void pe_gather_grad_##S(const T *gz, const int64_t *index, const long *ishape,             \
                            const long *zshape, int rank, int axis, T *z);                     \
    void pe_embedding_##S(const T *table, const int64_t *ids, long n, long dim, long rows,     \
                          T *z);                                                               \
    void pe_embedding_grad_##S(const T *gz, const int64_t *ids, long n, long dim, long rows,   \
                               long padding_row, T *gt);                                       \
    void pe_sgd_##S(T *w, const T *g, double lr, long n, double wd);                            \
    void pe_sgd_momentum_##S(T *w, const T *g, T *buf, double lr, long n, double momentum,       \
                             double wd, int nesterov);                                         \
    void pe_adamw_##S(T *w, const T *g, T *m, T *v, double t, double lr, long n,                \
                      double beta1, double beta2, double eps, double wd);                      \
    void pe_adamw8bit_##S(T *w, const T *g, uint8_t *mq, T *ma, uint8_t *vq, T *va, double t,    \
                          double lr, long n, long block, double beta1, double beta2,           \
                          double eps, double wd);                                              \
    void pe_attention_##S(const T *q, const T *k, const T *v, const T *mask, T *out, T *lse,  \
                          const long *geom, double scale, int causal);                         \
    void pe_attention_grad_##S(const T *go, const T *q, const T *k, const T *v, const T *mask, \
                               const T *out, const T *lse, T *gq, T *gk, T *gv,                \
                               const long *geom, double scale, int causal);              \
    int pe_loss_once_##S(const T *gp, const T *scale, const T *x, const T *w,                  \
                         const void *index, int wide, const T *b, T *picked, T *lse, T *gx,    \
                         T *gw, T *gb, long rows, long K, long V, int major);                  \
    void pe_linear_log_softmax_gather_##S(const T *x, const T *w, const void *index, int wide, \
                                          const T *b, T *picked, T *lse, long rows, long K,    \
                                          long V, int major);                                 \
    void pe_linear_log_softmax_gather_grad_##S(const T *gp, const T *scale, const T *x,        \
                                               const T *w, const void *index, int wide,       \
                                               const T *lse, const T *b, T *gx, T *gw, T *gb, \
                                               long rows, long K, long V, int major);  \
    void pe_linear_log_softmax_gather_with_grad_##S(                                           \
        const T *gp, const T *scale, const T *x, const T *w, const void *index, int wide,      \
        const T *b, T *picked, T *lse, T *gx, T *gw, T *gb, long rows, long K, long V,         \
        int major);

PE_DECLARE(f32, float)
PE_DECLARE(f64, double)

/* select.c: the k best entries of each row along an axis, and their positions. */
void pe_topk_f32(const float *x, float *values, int64_t *indices, long outer, long n,
                 long inner, long k, int largest);
void pe_topk_f64(const double *x, double *values, int64_t *indices, long outer, long n,
                 long inner, long k, int largest);

/* The exported trainer's kernel choice of each tunable conv node (its convs.c; -1: the
 * rule's kernel). In-process steps never read it. */
extern int pe_conv_choice[];
extern int pe_gemm_choice[]; /* the exported trainer's shape of each GEMM slot (pe_tune.h) */

/* Geometry of a 2-D window op, as the emitter writes it (one static array per node). */
enum {
    PE_G_N, PE_G_C, PE_G_H, PE_G_W, PE_G_O, PE_G_KH, PE_G_KW, PE_G_OH, PE_G_OW,
    PE_G_SH, PE_G_SW, PE_G_PH, PE_G_PW, PE_G_DH, PE_G_DW, PE_G_GROUPS,
    PE_G_MODE, /* pooling: ceil_mode/count_include_pad flags (bit 0: include pad) */
    PE_G_DIVISOR, /* pooling: divisor_override, 0 when none */
    PE_G_LEN
};

/* batch_norm's scale of channel c: w / sqrt(var + eps), the same expression everywhere the
 * normalised value is formed (norm.c's fused gradient and dw_bn.c recompute it bit for
 * bit); PE_T is the including kernel's element type. */
#define PE_BN_SCALE(w, v, eps) ((w) / (PE_T)sqrt((double)(v) + (eps)))

/* The most stack dw_bn.c's fused depthwise weight gradient takes a thread: one channel's
 * planes of every image and their gradient planes (backends/c/fuse_dw_bn.py checks it). */
#define PE_DW_BN_BYTES (256L * 1024)

/* The dropout mask's counter-based hash (the random_mask op's docstring): a bijection of
 * [0, 2**32); every product stays below 2**63, so this equals the int64 reference. */
static inline uint64_t pe_mix32(uint64_t h) {
    h ^= h >> 16;
    h = (h * 0x7FEB352DULL) & 0xFFFFFFFFULL;
    h ^= h >> 15;
    h = (h * 0x6A09E667ULL) & 0xFFFFFFFFULL;
    return h ^ (h >> 16);
}

/* The hash key of a (seed, salt) pair; >> on int64 is arithmetic, as in the reference. */
static inline uint64_t pe_mask_key(int64_t seed, int64_t salt) {
    uint64_t key = pe_mix32((uint64_t)(salt & 0xFFFFFFFFLL));
    key = pe_mix32(key ^ (uint64_t)(seed & 0xFFFFFFFFLL));
    return pe_mix32(key ^ (uint64_t)((seed >> 32) & 0xFFFFFFFFLL));
}

#include "pe_quant.h" /* low-bit frozen weights */
#include "pe_layout.h" /* channels-last kernels and layout conversions */

#endif
