/* What the kernel checks of loss_once_check.c and layer_norm_check.c share: reproducible
 * inputs and a tolerance test against a double-precision reference. */
#ifndef CHECK_DRAW_H
#define CHECK_DRAW_H
#include <math.h>

/* A reproducible draw in [-1, 1] for element i of input `seed`. */
static double draw(unsigned long i, unsigned long seed) {
    unsigned long h = (i + 1) * 0x9E3779B97F4A7C15UL ^ seed * 0xBF58476D1CE4E5B9UL;
    h ^= h >> 31;
    h *= 0x94D049BB133111EBUL;
    h ^= h >> 29;
    return (double)(h % 20001) / 10000.0 - 1.0;
}

/* The first of n elements of got (float when f32, else double) farther than tol times the
 * largest |want| from want (NaN where want is NaN), or -1; its value into *value. */
static long first_off(const double *want, const void *got, int f32, long n, double tol,
                      double *value) {
    double top = 0;
    for (long i = 0; i < n; i++) top = fabs(want[i]) > top ? fabs(want[i]) : top;
    for (long i = 0; i < n; i++) {
        double g = f32 ? (double)((const float *)got)[i] : ((const double *)got)[i];
        int ok = isnan(want[i]) ? isnan(g) : fabs(g - want[i]) <= tol * (top + 1e-30);
        if (!ok) {
            *value = g;
            return i;
        }
    }
    return -1;
}
#endif
