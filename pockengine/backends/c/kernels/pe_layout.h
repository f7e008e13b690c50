/* Channels-last and channel-blocked kernels (conv_nhwc.c): layout conversions and the
 * depthwise convolution on NHWC and NCHW{c}c maps. A layout is 0 (NCHW), -1 (NHWC) or
 * c > 1 (NCHW{c}c). */
#ifndef PE_LAYOUT_H
#define PE_LAYOUT_H

#define PE_DECLARE_LAYOUT(S, T)                                                                \
    void pe_layout_convert_##S(const T *x, T *y, long N, long C, long H, long W, int src,      \
                               int dst);                                                       \
    void pe_conv2d_nhwc_depthwise_##S(const T *x, const T *w, const T *bias, T *y,             \
                                      const long *geom);                                       \
    void pe_conv2d_nhwc_input_grad_depthwise_##S(const T *gy, const T *w, T *gx,               \
                                                 const long *geom);                            \
    void pe_conv2d_nhwc_weight_grad_depthwise_##S(const T *x, const T *gy, T *gw,              \
                                                  const long *geom);                           \
    void pe_conv2d_nchwc_depthwise_##S(const T *x, const T *w, const T *bias, T *y,            \
                                       const long *geom, int block);                           \
    void pe_conv2d_nchwc_input_grad_depthwise_##S(const T *gy, const T *w, T *gx,              \
                                                  const long *geom, int block);                \
    void pe_conv2d_nchwc_weight_grad_depthwise_##S(const T *x, const T *gy, T *gw,             \
                                                   const long *geom, int block);               \
    int pe_blocked_fits_##S(int op, const long *geom);                                         \
    void pe_conv2d_blocked_##S(const T *x, const T *w, const T *bias, T *y, const long *geom);  \
    void pe_conv2d_input_grad_blocked_##S(const T *gy, const T *w, T *gx, const long *geom);   \
    void pe_conv2d_weight_grad_blocked_##S(const T *x, const T *gy, T *gw, const long *geom);

PE_DECLARE_LAYOUT(f32, float)
PE_DECLARE_LAYOUT(f64, double)

#endif
