/* A row's maximum and sum in PE_ROW_LANES independent lanes, so the loops vectorise
 * (attention.c, loss.c, loss_once.c). Included after a kernel file's #else, once per
 * element type: no include guard; the functions are written over PE_T and PE_S(name). */
#define PE_ROW_LANES 16
/* The largest of m and row[0..n) (NaN entries skipped: a comparison with NaN is false;
 * the maximum does not depend on the order it is taken in). */
static inline PE_T PE_S(pe_row_max)(const PE_T *restrict row, long n, PE_T m) {
    /* a vector of the lanes (GCC's and Clang's vector extension), so the comparison and
     * select are whole vectors: written as scalars, GCC keeps the lanes in scalar code */
    typedef PE_T lanes __attribute__((vector_size(PE_ROW_LANES * sizeof(PE_T))));
    lanes lane;
    for (int l = 0; l < PE_ROW_LANES; l++) lane[l] = m;
    long j = 0;
    for (; j + PE_ROW_LANES <= n; j += PE_ROW_LANES) {
        lanes x;
        memcpy(&x, row + j, sizeof x);
        __typeof__(x > lane) gt = x > lane; /* all ones where x is greater */
        lane = (lanes)(((__typeof__(gt))x & gt) | ((__typeof__(gt))lane & ~gt));
    }
    for (int l = 0; l < PE_ROW_LANES; l++) m = lane[l] > m ? lane[l] : m;
    for (; j < n; j++) m = row[j] > m ? row[j] : m;
    return m;
}

/* The sum of row[0..n): PE_ROW_LANES partial sums, added in order at the end; the
 * rounding is fixed by n alone. */
static inline PE_T PE_S(pe_row_sum)(const PE_T *restrict row, long n) {
    PE_T lane[PE_ROW_LANES] = {0};
    long j = 0;
    for (; j + PE_ROW_LANES <= n; j += PE_ROW_LANES)
        for (int l = 0; l < PE_ROW_LANES; l++) lane[l] += row[j + l];
    PE_T total = 0;
    for (int l = 0; l < PE_ROW_LANES; l++) total += lane[l];
    for (; j < n; j++) total += row[j];
    return total;
}
#undef PE_ROW_LANES
