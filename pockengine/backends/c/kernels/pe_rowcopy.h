/* Copies and zero fills of short runs (the rows of a depthwise kernel's planes) without a
 * call into libc: a run of up to 128 bytes as two moves of the largest power of two that
 * fits, overlapping in the middle. Each move has a constant size, so the compiler makes it
 * one or two register loads and stores; at these sizes memcpy and memset cost more in the
 * call than in the copy. Longer runs call them. dst and src must not overlap. */
#ifndef PE_ROWCOPY_H
#define PE_ROWCOPY_H

#include <stddef.h>
#include <string.h>

#define PE_MOVE_(d, s, k) __builtin_memcpy((d), (s), (k))

static inline void pe_copy_run(void *dst_, const void *src_, size_t bytes) {
    char *d = (char *)dst_;
    const char *s = (const char *)src_;
    if (bytes > 128) {
        memcpy(d, s, bytes);
    } else if (bytes >= 64) {
        PE_MOVE_(d, s, 64);
        PE_MOVE_(d + bytes - 64, s + bytes - 64, 64);
    } else if (bytes >= 32) {
        PE_MOVE_(d, s, 32);
        PE_MOVE_(d + bytes - 32, s + bytes - 32, 32);
    } else if (bytes >= 16) {
        PE_MOVE_(d, s, 16);
        PE_MOVE_(d + bytes - 16, s + bytes - 16, 16);
    } else if (bytes >= 8) {
        PE_MOVE_(d, s, 8);
        PE_MOVE_(d + bytes - 8, s + bytes - 8, 8);
    } else if (bytes >= 4) {
        PE_MOVE_(d, s, 4);
        PE_MOVE_(d + bytes - 4, s + bytes - 4, 4);
    } else {
        for (size_t i = 0; i < bytes; i++) d[i] = s[i];
    }
}

static inline void pe_zero_run(void *dst, size_t bytes) {
    static const char zeros[128] = {0};
    if (bytes > 128)
        memset(dst, 0, bytes);
    else
        pe_copy_run(dst, zeros, bytes);
}

#undef PE_MOVE_
#endif
