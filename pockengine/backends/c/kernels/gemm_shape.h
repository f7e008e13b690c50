/* The GEMM's blocked driver for one micro-kernel shape: included by linalg.c once per
 * shape, inside its PE_T instantiation, with PE_SHAPE (kernel, MR, NR: gemm_micro.h's
 * PE_SHAPE_<i>) and PE_B(name) (the shape's function names) defined. Defines
 * PE_B(pe_gemm_blocked): the product over the k, row and column blocks sized for the
 * shape. No include guard: each inclusion is another shape. */
#define PE_BMICRO PE_ARGS0(PE_SHAPE)
#define PE_BMR PE_ARGS1(PE_SHAPE)
#define PE_BNR PE_ARGS2(PE_SHAPE)
/* The k block: a panel (PE_BMR x PE_BKC) stays in L1 while it crosses a run of slivers. */
#define PE_BKC (PE_TSIZE == 4 ? 256 : 128)
/* The run of packed slivers of op(B) that each panel crosses, in L2 meanwhile: 512 KiB with
 * AVX-512 (whose cores have at least 1 MiB of L2: a run of 16 slivers of 256 x 32, so the
 * slivers of a 512-column product are packed once per k block whatever its rows), 128 KiB
 * elsewhere; never less than one whole sliver. */
#if defined(PE_GEMM_ISA_AVX512)
#define PE_BNRUN_ELEMS (512L * 1024 / PE_TSIZE)
#else
#define PE_BNRUN_ELEMS (128L * 1024 / PE_TSIZE)
#endif
#define PE_BNRUN (PE_BNRUN_ELEMS > PE_BKC * PE_BNR ? PE_BNRUN_ELEMS : PE_BKC * PE_BNR)

/* Packing of whole panels and slivers whose runs are contiguous in memory and unsplit
 * (the panels of a transposed A, the slivers of a row-major B): one copy of a constant
 * size per k, which the compiler makes a few vector moves, where the general copy spends
 * more on each short run's offsets and size than on moving it. */
static inline void PE_B(pe_gemm_pack_panel)(PE_T *restrict panel, const PE_T *A,
                                            const pe_layout *la, long i0, long rows, long k0,
                                            long kc) {
    if (rows == PE_BMR && la->rs == 1 && la->split == 0) {
        const PE_T *s = A + i0 + k0 * la->cs;
        for (long k = 0; k < kc; k++)
            memcpy(panel + k * PE_BMR, s + k * la->cs, PE_BMR * sizeof(PE_T));
        return;
    }
    if (rows < PE_BMR) memset(panel, 0, (size_t)(kc * PE_BMR) * sizeof(PE_T));
    PE_S(pe_gemm_copy_in)(panel, 1, PE_BMR, A, la, i0, rows, k0, kc);
}

static inline void PE_B(pe_gemm_pack_sliver)(const PE_S(pe_gemm_b) *b, PE_T *restrict sliver,
                                             long k0, long kc, long j0, long width) {
    if (!b->pack && width == PE_BNR && b->lb.cs == 1 && b->lb.split == 0) {
        const PE_T *s = b->B + j0 + k0 * b->lb.rs;
        for (long k = 0; k < kc; k++) {
            /* the next sliver's run of this row (a long row of a weight) meanwhile */
            PE_PREFETCH(s + k * b->lb.rs + PE_BNR);
            memcpy(sliver + k * PE_BNR, s + k * b->lb.rs, PE_BNR * sizeof(PE_T));
        }
        return;
    }
    PE_S(pe_gemm_pack_sliver)(b, sliver, PE_BNR, k0, kc, j0, width);
}

/* C rows [r0, r1) x columns [c0, c1), every k block; the panel and the slivers are scratch.
 * Per k block a run of slivers is packed (as many as PE_BNRUN elements hold), then each
 * PE_BMR-row panel of op(A) in turn is packed and runs across the whole run: every sliver
 * is packed once per k block, a panel once per run. The loop order does not touch any
 * element's k order, so the bits are those of one sliver at a time. */
static void PE_B(pe_gemm_tile)(long r0, long r1, long c0, long c1, long K, const PE_T *A,
                               const pe_layout *la, const PE_S(pe_gemm_b) *b,
                               PE_T *C, const pe_layout *lc, int accumulate,
                               PE_T *restrict panel, PE_T *restrict slivers) {
    /* an edge tile; never under 256 bytes, where GCC's overflow check would take
     * pe_copy_run's long-run branch (more than 128 bytes) for a possible write */
    _Alignas(64) PE_T tile[PE_BMR * PE_BNR * PE_TSIZE < 256 ? 256 / PE_TSIZE : PE_BMR * PE_BNR];
    for (long k0 = 0; k0 < K; k0 += PE_BKC) {
        long kc = pe_min(PE_BKC, K - k0);
        int load = accumulate || k0 > 0;
        /* at least 1 (PE_BNRUN >= PE_BKC * PE_BNR) and at most 512 columns: a short k block
         * gains nothing from more, and would touch more of the stack (a trainer's peak) */
        long per_run = pe_min(PE_BNRUN / (kc * PE_BNR), (512 + PE_BNR - 1) / PE_BNR);
        for (long run0 = c0; run0 < c1; run0 += per_run * PE_BNR) {
            long run1 = pe_min(run0 + per_run * PE_BNR, c1);
            for (long j0 = run0; j0 < run1; j0 += PE_BNR)
                PE_B(pe_gemm_pack_sliver)(b, slivers + (j0 - run0) / PE_BNR * kc * PE_BNR, k0, kc,
                                          j0, pe_min(PE_BNR, c1 - j0));
            for (long i0 = r0; i0 < r1; i0 += PE_BMR) {
                long rows = pe_min(PE_BMR, r1 - i0);
                PE_B(pe_gemm_pack_panel)(panel, A, la, i0, rows, k0, kc);
                for (long j0 = run0; j0 < run1; j0 += PE_BNR) {
                    long width = pe_min(PE_BNR, c1 - j0);
                    const PE_T *sliver = slivers + (j0 - run0) / PE_BNR * kc * PE_BNR;
                    int direct = rows == PE_BMR && width == PE_BNR && lc->cs == 1 &&
                                 lc->split != 1 && pe_axis_run(lc, 2, j0, j0 + PE_BNR) == PE_BNR;
                    if (direct) {
                        PE_T *cij = C + pe_axis_offset(lc, 2, j0) + i0 * lc->rs;
                        if (load && lc->split == 0 && j0 + PE_BNR < run1) {
                            /* the next tile of C meanwhile, as far as it reaches */
                            long next = pe_min(PE_BNR, run1 - j0 - PE_BNR) * PE_TSIZE;
                            for (int r = 0; r < PE_BMR; r++)
                                for (long l = 0; l < next; l += 64)
                                    PE_PREFETCH((const char *)(cij + PE_BNR + r * lc->rs) + l);
                        }
                        PE_BMICRO(kc, panel, sliver, cij, lc->rs, load);
                        continue;
                    }
                    memset(tile, 0, sizeof(tile));
                    if (load) PE_S(pe_gemm_copy_in)(tile, PE_BNR, 1, C, lc, i0, rows, j0, width);
                    PE_BMICRO(kc, panel, sliver, tile, PE_BNR, 1);
                    PE_S(pe_gemm_copy_out)(C, lc, tile, PE_BNR, i0, rows, j0, width);
                }
            }
        }
    }
}

/* The product on `threads` threads, K > 0. A thread that takes a block of rows packs every
 * sliver of op(B) itself, so the rows are split only where there are more than
 * PE_BSPLIT of them, one block a thread, as even as the panel height allows; otherwise, and
 * where there are fewer row blocks than threads, the columns are split (a thread packs
 * only its own slivers: a pointwise convolution's few output channels by many positions). */
#if defined(PE_GEMM_ISA_AVX512)
#define PE_BSPLIT 264
#else
#define PE_BSPLIT 192
#endif
static void PE_B(pe_gemm_blocked)(long M, long N, long K, const PE_T *A, pe_layout la,
                                  const PE_S(pe_gemm_b) *b, PE_T *C, pe_layout lc,
                                  int accumulate, int threads) {
    long panels = (M + PE_BMR - 1) / PE_BMR;
    long blocks = threads > 1 && M > PE_BSPLIT ? pe_min(threads, panels) : 1;
    long mc = (panels + blocks - 1) / blocks * PE_BMR;
    blocks = (M + mc - 1) / mc;
    long slivers = (N + PE_BNR - 1) / PE_BNR, groups = 1;
    if (threads > blocks) groups = pe_min((threads + blocks - 1) / blocks, slivers);
    long nc = (slivers + groups - 1) / groups * PE_BNR;
    groups = (N + nc - 1) / nc;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#else
    (void)threads;
#endif
    for (long t = 0; t < blocks * groups; t++) {
        long r0 = t / groups * mc, c0 = t % groups * nc;
        _Alignas(64) PE_T panel[PE_BMR * PE_BKC];
        _Alignas(64) PE_T slivers[PE_BNRUN];
        PE_B(pe_gemm_tile)(r0, pe_min(r0 + mc, M), c0, pe_min(c0 + nc, N), K, A, &la, b, C,
                           &lc, accumulate, panel, slivers);
    }
}

#undef PE_BMICRO
#undef PE_BMR
#undef PE_BNR
#undef PE_BKC
#undef PE_BNRUN_ELEMS
#undef PE_BSPLIT
#undef PE_BNRUN
