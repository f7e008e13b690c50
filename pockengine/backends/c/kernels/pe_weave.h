/* A stride-2 row's two phases woven back together (depthwise.c, dw_flat.c). Included after
 * a kernel file's #else, once per element type: no include guard; the function is written
 * over PE_T and PE_S(name). */

/* out[x] = padded[x + p] for x in [0, W), where padded column 2t is even[t] and 2t + 1 is
 * odd[t]: a pair of columns a step (constant-stride loads and stores the compiler turns
 * into vector shuffles), where a loop a phase would store one element every other
 * column. */
static inline void PE_S(pe_weave2)(const PE_T *even, const PE_T *odd, long p, long W,
                                   PE_T *restrict out) {
    long x = 0;
    if (p & 1) { /* padded column p is odd: one column before the pairs */
        if (W > 0) out[0] = odd[p / 2];
        x = 1;
    }
    long t0 = (p + x) / 2, pairs = (W - x) / 2;
    const PE_T *e = even + t0, *o = odd + t0;
    PE_T *restrict d = out + x;
    for (long t = 0; t < pairs; t++) {
        d[2 * t] = e[t];
        d[2 * t + 1] = o[t];
    }
    if (x + 2 * pairs < W) out[W - 1] = e[pairs];
}
