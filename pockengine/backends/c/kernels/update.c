/* Optimizer updates, in place on the state block: SGD, SGD with momentum (torch's, with
 * dampening 0), AdamW and AdamW with 8-bit block-wise moments. ``n`` counts the trained
 * elements: a partial-channel update (rows=k) trains the first k rows, which are the first
 * n elements of the row-major parameter, so the same kernels serve it. */
#ifndef PE_T
#include "pe_kernels.h"
#include "code8.h"
#include <tgmath.h>
/* No fused multiply-adds: the 8-bit update must round as the NumPy reference does, to the
 * byte (GCC in -std=c11 mode contracts nothing anyway; clang would, within expressions). */
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif
#define PE_SELF "update.c"
#include "pe_instantiate.h"
#else

void PE_S(pe_sgd)(PE_T *w, const PE_T *g, double lr, long n, double wd) {
    PE_T rate = (PE_T)lr, decay = (PE_T)wd;
    for (long k = 0; k < n; k++) w[k] = w[k] - rate * (g[k] + decay * w[k]);
}

void PE_S(pe_sgd_momentum)(PE_T *w, const PE_T *g, PE_T *buf, double lr, long n,
                           double momentum, double wd, int nesterov) {
    PE_T rate = (PE_T)lr, mu = (PE_T)momentum, decay = (PE_T)wd;
    for (long k = 0; k < n; k++) {
        PE_T d = g[k] + decay * w[k];
        PE_T b = mu * buf[k] + d;
        buf[k] = b;
        w[k] = w[k] - rate * (nesterov ? d + mu * b : b);
    }
}

void PE_S(pe_adamw)(PE_T *w, const PE_T *g, PE_T *m, PE_T *v, double t, double lr, long n,
                    double beta1, double beta2, double eps, double wd) {
    double steps = t;
    PE_T rate = (PE_T)lr, b1 = (PE_T)beta1, b2 = (PE_T)beta2, keep = (PE_T)1 - rate * (PE_T)wd;
    PE_T step_size = rate / (PE_T)(1.0 - pow(beta1, steps));
    PE_T root_bc2 = (PE_T)sqrt(1.0 - pow(beta2, steps)), e = (PE_T)eps;
    for (long k = 0; k < n; k++) {
        PE_T mk = b1 * m[k] + ((PE_T)1 - b1) * g[k];
        PE_T vk = b2 * v[k] + ((PE_T)1 - b2) * g[k] * g[k];
        m[k] = mk;
        v[k] = vk;
        w[k] = w[k] * keep - step_size * mk / (sqrt(vk) / root_bc2 + e);
    }
}

/* A code's values and the 255 midpoints between them (float32 arithmetic, as
 * ``update_8bit.code_midpoints``), in PE_T. */
static void PE_S(pe_code8_tables)(const float *code, PE_T *values, PE_T *mids,
                                  pe_code8_bins *bins) {
    float mids32[255];
    for (int i = 0; i < 256; i++) values[i] = (PE_T)code[i];
    for (int i = 0; i < 255; i++) mids[i] = (PE_T)(mids32[i] = (code[i] + code[i + 1]) / 2.0f);
    if (sizeof(PE_T) == sizeof(float)) pe_code8_bins_init(bins, mids32);
}

/* Round to the nearest code: the number of midpoints below ``x`` (``searchsorted(mids, x)``,
 * a NaN counting as above all), by an 8-step branchless binary search over the 255. */
static inline uint8_t PE_S(pe_code8_nearest)(const PE_T *mids, PE_T x) {
    unsigned i = 0;
    for (unsigned s = 128; s; s >>= 1) i += !(x <= mids[i + s - 1]) ? s : 0;
    return (uint8_t)i;
}

/* The bits of |x|: for floats of one sign their integer order is the value order, NaN
 * above infinity (so a max over them propagates NaN as NumPy's does, and vectorises). */
static inline PE_U PE_S(pe_abs_bits)(PE_T x) {
    PE_U bits;
    memcpy(&bits, &x, sizeof bits);
    return bits & ~((PE_U)1 << (8 * sizeof(PE_U) - 1));
}

static inline PE_T PE_S(pe_from_bits)(PE_U bits) {
    PE_T x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Everything one 8-bit AdamW update needs besides the arrays. */
typedef struct {
    PE_T scode[256], smid[255], ucode[256], umid[255];
    pe_code8_bins sbins, ubins;
    int binned; /* float32, and the bins are exact for both codes */
    PE_T b1, c1, b2, c2, keep, e, step_size, root_bc2;
} PE_S(pe_adamw8bit_consts);

/* The new m and sqrt(v) of element k, in the reference's order of operations. */
static inline void PE_S(pe_moments8)(const PE_S(pe_adamw8bit_consts) *c, PE_T mk, PE_T rk,
                                     PE_T g, PE_T *m, PE_T *r) {
    *m = c->b1 * mk + c->c1 * g;
    *r = sqrt(c->b2 * (rk * rk) + c->c2 * g * g);
}

#define PE_CODE8_CHUNK 64

/* Encode elements [lo, hi) of a block whose new absmax are known: the moments again (bit
 * for bit as the first pass had them), normalised a chunk at a time, then rounded. */
static void PE_S(pe_encode8)(const PE_S(pe_adamw8bit_consts) *restrict c,
                             const PE_T *restrict g, uint8_t *restrict mq, PE_T m_scale,
                             uint8_t *restrict vq, PE_T r_scale, long lo, long hi, PE_T m_div,
                             PE_T r_div) {
    PE_T mn[PE_CODE8_CHUNK], rn[PE_CODE8_CHUNK];
    for (long start = lo; start < hi; start += PE_CODE8_CHUNK) {
        long len = hi - start < PE_CODE8_CHUNK ? hi - start : PE_CODE8_CHUNK;
        for (long k = 0; k < len; k++) {
            PE_T m, r;
            PE_S(pe_moments8)(c, c->scode[mq[start + k]] * m_scale,
                              c->ucode[vq[start + k]] * r_scale, g[start + k], &m, &r);
            mn[k] = m / m_div;
            rn[k] = r / r_div;
        }
        if (c->binned) { /* float32: by the codes' bins (code8.h) */
            for (long k = 0; k < len; k++) {
                mq[start + k] = (uint8_t)pe_code8_binned(&c->sbins, (float)mn[k]);
                vq[start + k] = (uint8_t)pe_code8_binned(&c->ubins, (float)rn[k]);
            }
            continue;
        }
        for (long k = 0; k < len; k++) {
            mq[start + k] = PE_S(pe_code8_nearest)(c->smid, mn[k]);
            vq[start + k] = PE_S(pe_code8_nearest)(c->umid, rn[k]);
        }
    }
}

/* One block of ``len`` elements (pointers at its first): the first pass decodes m and
 * sqrt(v), applies AdamW in PE_T as the reference does, writes w and finds the new absmax;
 * ``pe_encode8`` encodes the block with them. ``restrict`` and the local copies of the
 * constants let both passes vectorise inside the OpenMP region too. */
static void PE_S(pe_adamw8bit_block)(const PE_S(pe_adamw8bit_consts) *restrict c,
                                     PE_T *restrict w, const PE_T *restrict g,
                                     uint8_t *restrict mq, PE_T *restrict ma,
                                     uint8_t *restrict vq, PE_T *restrict va, long len) {
    const PE_T m_scale = *ma, r_scale = *va, keep = c->keep, step_size = c->step_size;
    const PE_T root_bc2 = c->root_bc2, e = c->e;
    PE_U m_bits = 0, r_bits = 0;
    for (long k = 0; k < len; k++) {
        PE_T m, r;
        PE_S(pe_moments8)(c, c->scode[mq[k]] * m_scale, c->ucode[vq[k]] * r_scale, g[k], &m, &r);
        w[k] = w[k] * keep - step_size * m / (r / root_bc2 + e);
        PE_U am = PE_S(pe_abs_bits)(m), ar = PE_S(pe_abs_bits)(r);
        m_bits = am > m_bits ? am : m_bits;
        r_bits = ar > r_bits ? ar : r_bits;
    }
    const PE_T m_max = PE_S(pe_from_bits)(m_bits), r_max = PE_S(pe_from_bits)(r_bits);
    PE_S(pe_encode8)(c, g, mq, m_scale, vq, r_scale, 0, len, m_max > 0 ? m_max : (PE_T)1,
                     r_max > 0 ? r_max : (PE_T)1);
    *ma = m_max;
    *va = r_max;
}

/* ``adamw8bit_update`` (ops/update_8bit.py) on the first ``n`` elements, per block of
 * ``block`` (``pe_adamw8bit_block``); blocks run in parallel under OpenMP. */
void PE_S(pe_adamw8bit)(PE_T *w, const PE_T *g, uint8_t *mq, PE_T *ma, uint8_t *vq, PE_T *va,
                        double t, double lr, long n, long block, double beta1, double beta2,
                        double eps, double wd) {
    PE_S(pe_adamw8bit_consts) c = {
        .b1 = (PE_T)beta1, .c1 = (PE_T)(1.0 - beta1), .b2 = (PE_T)beta2,
        .c2 = (PE_T)(1.0 - beta2), .keep = (PE_T)(1.0 - lr * wd), .e = (PE_T)eps,
        .step_size = (PE_T)(lr / (1.0 - pow(beta1, t))),
        .root_bc2 = (PE_T)sqrt(1.0 - pow(beta2, t)),
    };
    PE_S(pe_code8_tables)(PE_SIGNED_CODE, c.scode, c.smid, &c.sbins);
    PE_S(pe_code8_tables)(PE_UNSIGNED_CODE, c.ucode, c.umid, &c.ubins);
    c.binned = sizeof(PE_T) == sizeof(float) && pe_code8_bins_exact(&c.sbins) &&
               pe_code8_bins_exact(&c.ubins);
    const long blocks = (n + block - 1) / block;
    PE_PARALLEL_FOR(n * 32)
    for (long b = 0; b < blocks; b++) {
        const long lo = b * block, len = lo + block < n ? block : n - lo;
        PE_S(pe_adamw8bit_block)(&c, w + lo, g + lo, mq + lo, ma + b, vq + lo, va + b, len);
    }
}

#endif
