/* The instruction set the GEMM is built for (-march=native, or the target's flags):
 * pe_simd.h's micro-kernels and helpers follow it, and the convolution rule's range for
 * Winograd F(2x2, 3x3) depends on it (PE_FAST_GEMM: the wide FMA micro-kernels, AVX-512 or
 * AVX2 with FMA; conv_kernels.rule_kernel's fast_gemm, driver.has_fast_gemm). Defining
 * PE_GEMM_PORTABLE forces the portable code. */
#ifndef PE_ISA_H
#define PE_ISA_H

#if defined(PE_GEMM_PORTABLE)
#define PE_GEMM_ISA_C 1
#elif defined(__AVX512F__)
#define PE_GEMM_ISA_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define PE_GEMM_ISA_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define PE_GEMM_ISA_NEON 1
#else
#define PE_GEMM_ISA_C 1
#endif

#if defined(PE_GEMM_ISA_AVX512) || defined(PE_GEMM_ISA_AVX2)
#define PE_FAST_GEMM 1
#else
#define PE_FAST_GEMM 0
#endif

#endif
