/* Optimizer updates, in place on the state block: SGD, SGD with momentum (torch's, with
 * dampening 0) and AdamW. ``n`` counts the trained elements: a partial-channel update
 * (rows=k) trains the first k rows, which are the first n elements of the row-major
 * parameter, so the same kernels serve it. */
#ifndef PE_T
#include "pe_kernels.h"
#include <tgmath.h>
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

#endif
