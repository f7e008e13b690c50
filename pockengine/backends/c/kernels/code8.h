/* The 256-entry codes of 8-bit optimizer state, sorted: bitsandbytes' dynamic (tree) codes,
 * signed for the first moment and unsigned for the second's square root. They are
 * ``SIGNED_CODE`` and ``UNSIGNED_CODE`` of pockengine/ops/update_8bit.py, written out as exact
 * float32 literals (tests/test_c_backend_8bit.py checks they are equal), and below them a
 * table-driven float32 round-to-nearest. */
#ifndef PE_CODE8_H
#define PE_CODE8_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static const float PE_SIGNED_CODE[256] = {
    -0x1.fc6666p-1f, -0x1.f53334p-1f, -0x1.eep-1f, -0x1.e6ccccp-1f, -0x1.df999ap-1f,
    -0x1.d86666p-1f, -0x1.d13334p-1f, -0x1.cap-1f, -0x1.c2ccccp-1f, -0x1.bb999ap-1f,
    -0x1.b46666p-1f, -0x1.ad3334p-1f, -0x1.a6p-1f, -0x1.9eccccp-1f, -0x1.97999ap-1f,
    -0x1.906666p-1f, -0x1.893334p-1f, -0x1.82p-1f, -0x1.7accccp-1f, -0x1.73999ap-1f,
    -0x1.6c6666p-1f, -0x1.653334p-1f, -0x1.5ep-1f, -0x1.56ccccp-1f, -0x1.4f999ap-1f,
    -0x1.486666p-1f, -0x1.413334p-1f, -0x1.3ap-1f, -0x1.32ccccp-1f, -0x1.2b999ap-1f,
    -0x1.246666p-1f, -0x1.1d3334p-1f, -0x1.16p-1f, -0x1.0eccccp-1f, -0x1.07999ap-1f,
    -0x1.006666p-1f, -0x1.f26666p-2f, -0x1.e4p-2f, -0x1.d5999ap-2f, -0x1.c73334p-2f,
    -0x1.b8ccccp-2f, -0x1.aa6666p-2f, -0x1.9cp-2f, -0x1.8d999ap-2f, -0x1.7f3334p-2f,
    -0x1.70ccccp-2f, -0x1.626666p-2f, -0x1.54p-2f, -0x1.45999ap-2f, -0x1.373334p-2f,
    -0x1.28ccccp-2f, -0x1.1a6666p-2f, -0x1.0cp-2f, -0x1.fb3334p-3f, -0x1.de6666p-3f,
    -0x1.c1999ap-3f, -0x1.a4ccccp-3f, -0x1.88p-3f, -0x1.6b3334p-3f, -0x1.4e6666p-3f,
    -0x1.31999ap-3f, -0x1.14ccccp-3f, -0x1.fp-4f, -0x1.b66666p-4f, -0x1.93d70ap-4f,
    -0x1.8851ecp-4f, -0x1.7cccccp-4f, -0x1.7147aep-4f, -0x1.65c29p-4f, -0x1.5a3d7p-4f,
    -0x1.4eb852p-4f, -0x1.433334p-4f, -0x1.37ae14p-4f, -0x1.2c28f6p-4f, -0x1.20a3d8p-4f,
    -0x1.151eb8p-4f, -0x1.09999ap-4f, -0x1.fc28f6p-5f, -0x1.e51eb8p-5f, -0x1.ce147ap-5f,
    -0x1.b70a3ep-5f, -0x1.ap-5f, -0x1.88f5c2p-5f, -0x1.71eb86p-5f, -0x1.5ae148p-5f,
    -0x1.43d70ap-5f, -0x1.2cccccp-5f, -0x1.15c29p-5f, -0x1.fd70a4p-6f, -0x1.cf5c28p-6f,
    -0x1.a147aep-6f, -0x1.733334p-6f, -0x1.451eb8p-6f, -0x1.170a3ep-6f, -0x1.d1eb86p-7f,
    -0x1.75c29p-7f, -0x1.3e76c8p-7f, -0x1.2c0832p-7f, -0x1.19999ap-7f, -0x1.072b02p-7f,
    -0x1.e978d4p-8f, -0x1.c49ba6p-8f, -0x1.9fbe76p-8f, -0x1.7ae148p-8f, -0x1.560418p-8f,
    -0x1.3126eap-8f, -0x1.0c49bap-8f, -0x1.ced916p-9f, -0x1.851eb8p-9f, -0x1.3b645ap-9f,
    -0x1.e353f8p-10f, -0x1.4fdf3cp-10f, -0x1.eecbfcp-11f, -0x1.b3d07cp-11f, -0x1.78d4fep-11f,
    -0x1.3dd98p-11f, -0x1.02dep-11f, -0x1.8fc504p-12f, -0x1.19ce08p-12f, -0x1.47ae14p-13f,
    -0x1.743e96p-14f, -0x1.15df66p-14f, -0x1.6f0068p-15f, -0x1.64840ep-16f, -0x1.040bfep-17f,
    -0x1.b43526p-19f, -0x1.27476cp-21f, 0.0f, 0x1.27476cp-21f, 0x1.b43526p-19f,
    0x1.040bfep-17f, 0x1.64840ep-16f, 0x1.6f0068p-15f, 0x1.15df66p-14f, 0x1.743e96p-14f,
    0x1.47ae14p-13f, 0x1.19ce08p-12f, 0x1.8fc504p-12f, 0x1.02dep-11f, 0x1.3dd98p-11f,
    0x1.78d4fep-11f, 0x1.b3d07cp-11f, 0x1.eecbfcp-11f, 0x1.4fdf3cp-10f, 0x1.e353f8p-10f,
    0x1.3b645ap-9f, 0x1.851eb8p-9f, 0x1.ced916p-9f, 0x1.0c49bap-8f, 0x1.3126eap-8f,
    0x1.560418p-8f, 0x1.7ae148p-8f, 0x1.9fbe76p-8f, 0x1.c49ba6p-8f, 0x1.e978d4p-8f,
    0x1.072b02p-7f, 0x1.19999ap-7f, 0x1.2c0832p-7f, 0x1.3e76c8p-7f, 0x1.75c29p-7f,
    0x1.d1eb86p-7f, 0x1.170a3ep-6f, 0x1.451eb8p-6f, 0x1.733334p-6f, 0x1.a147aep-6f,
    0x1.cf5c28p-6f, 0x1.fd70a4p-6f, 0x1.15c29p-5f, 0x1.2cccccp-5f, 0x1.43d70ap-5f,
    0x1.5ae148p-5f, 0x1.71eb86p-5f, 0x1.88f5c2p-5f, 0x1.ap-5f, 0x1.b70a3ep-5f,
    0x1.ce147ap-5f, 0x1.e51eb8p-5f, 0x1.fc28f6p-5f, 0x1.09999ap-4f, 0x1.151eb8p-4f,
    0x1.20a3d8p-4f, 0x1.2c28f6p-4f, 0x1.37ae14p-4f, 0x1.433334p-4f, 0x1.4eb852p-4f,
    0x1.5a3d7p-4f, 0x1.65c29p-4f, 0x1.7147aep-4f, 0x1.7cccccp-4f, 0x1.8851ecp-4f,
    0x1.93d70ap-4f, 0x1.b66666p-4f, 0x1.fp-4f, 0x1.14ccccp-3f, 0x1.31999ap-3f,
    0x1.4e6666p-3f, 0x1.6b3334p-3f, 0x1.88p-3f, 0x1.a4ccccp-3f, 0x1.c1999ap-3f,
    0x1.de6666p-3f, 0x1.fb3334p-3f, 0x1.0cp-2f, 0x1.1a6666p-2f, 0x1.28ccccp-2f,
    0x1.373334p-2f, 0x1.45999ap-2f, 0x1.54p-2f, 0x1.626666p-2f, 0x1.70ccccp-2f,
    0x1.7f3334p-2f, 0x1.8d999ap-2f, 0x1.9cp-2f, 0x1.aa6666p-2f, 0x1.b8ccccp-2f,
    0x1.c73334p-2f, 0x1.d5999ap-2f, 0x1.e4p-2f, 0x1.f26666p-2f, 0x1.006666p-1f,
    0x1.07999ap-1f, 0x1.0eccccp-1f, 0x1.16p-1f, 0x1.1d3334p-1f, 0x1.246666p-1f,
    0x1.2b999ap-1f, 0x1.32ccccp-1f, 0x1.3ap-1f, 0x1.413334p-1f, 0x1.486666p-1f,
    0x1.4f999ap-1f, 0x1.56ccccp-1f, 0x1.5ep-1f, 0x1.653334p-1f, 0x1.6c6666p-1f,
    0x1.73999ap-1f, 0x1.7accccp-1f, 0x1.82p-1f, 0x1.893334p-1f, 0x1.906666p-1f,
    0x1.97999ap-1f, 0x1.9eccccp-1f, 0x1.a6p-1f, 0x1.ad3334p-1f, 0x1.b46666p-1f,
    0x1.bb999ap-1f, 0x1.c2ccccp-1f, 0x1.cap-1f, 0x1.d13334p-1f, 0x1.d86666p-1f,
    0x1.df999ap-1f, 0x1.e6ccccp-1f, 0x1.eep-1f, 0x1.f53334p-1f, 0x1.fc6666p-1f,
    0x1p+0f,
};

static const float PE_UNSIGNED_CODE[256] = {
    0.0f, 0x1.5cf752p-22f, 0x1.a0133p-21f, 0x1.1d3672p-19f, 0x1.2599eep-18f,
    0x1.bc98a2p-18f, 0x1.29cbacp-17f, 0x1.0624dep-16f, 0x1.c2e33ep-16f, 0x1.3fd0dp-15f,
    0x1.9e3002p-15f, 0x1.fc8f32p-15f, 0x1.2d7732p-14f, 0x1.5ca6cap-14f, 0x1.8bd662p-14f,
    0x1.0cb296p-13f, 0x1.82a994p-13f, 0x1.f8a09p-13f, 0x1.374bc6p-12f, 0x1.724746p-12f,
    0x1.ad42c4p-12f, 0x1.e83e42p-12f, 0x1.119cep-11f, 0x1.2f1aap-11f, 0x1.4c986p-11f,
    0x1.6a161ep-11f, 0x1.8793dep-11f, 0x1.a5119cp-11f, 0x1.c28f5cp-11f, 0x1.e00d1cp-11f,
    0x1.fd8adap-11f, 0x1.2b020cp-10f, 0x1.74bc6ap-10f, 0x1.be76c8p-10f, 0x1.041894p-9f,
    0x1.28f5c2p-9f, 0x1.4dd2f2p-9f, 0x1.72b02p-9f, 0x1.978d5p-9f, 0x1.bc6a7ep-9f,
    0x1.e147aep-9f, 0x1.03126ep-8f, 0x1.158106p-8f, 0x1.27ef9ep-8f, 0x1.3a5e36p-8f,
    0x1.4cccccp-8f, 0x1.5f3b64p-8f, 0x1.71a9fcp-8f, 0x1.841894p-8f, 0x1.96872cp-8f,
    0x1.a8f5c2p-8f, 0x1.bb645ap-8f, 0x1.cdd2f2p-8f, 0x1.e0418ap-8f, 0x1.f2b02p-8f,
    0x1.028f5cp-7f, 0x1.0bc6a8p-7f, 0x1.14fdf4p-7f, 0x1.1e354p-7f, 0x1.276c8cp-7f,
    0x1.30a3d8p-7f, 0x1.39db22p-7f, 0x1.43126ep-7f, 0x1.5eb852p-7f, 0x1.8cccccp-7f,
    0x1.bae148p-7f, 0x1.e8f5c2p-7f, 0x1.0b851ep-6f, 0x1.228f5cp-6f, 0x1.39999ap-6f,
    0x1.50a3d8p-6f, 0x1.67ae14p-6f, 0x1.7eb852p-6f, 0x1.95c29p-6f, 0x1.acccccp-6f,
    0x1.c3d70ap-6f, 0x1.dae148p-6f, 0x1.f1eb86p-6f, 0x1.047ae2p-5f, 0x1.1p-5f,
    0x1.1b851ep-5f, 0x1.270a3ep-5f, 0x1.328f5cp-5f, 0x1.3e147ap-5f, 0x1.49999ap-5f,
    0x1.551eb8p-5f, 0x1.60a3d8p-5f, 0x1.6c28f6p-5f, 0x1.77ae14p-5f, 0x1.833334p-5f,
    0x1.8eb852p-5f, 0x1.9a3d7p-5f, 0x1.a5c29p-5f, 0x1.b147aep-5f, 0x1.bcccccp-5f,
    0x1.c851ecp-5f, 0x1.d3d70ap-5f, 0x1.df5c28p-5f, 0x1.eae148p-5f, 0x1.f66666p-5f,
    0x1.00f5c2p-4f, 0x1.06b852p-4f, 0x1.0c7ae2p-4f, 0x1.123d7p-4f, 0x1.18p-4f,
    0x1.1dc29p-4f, 0x1.23851ep-4f, 0x1.2947aep-4f, 0x1.2f0a3ep-4f, 0x1.34ccccp-4f,
    0x1.3a8f5cp-4f, 0x1.4051ecp-4f, 0x1.46147ap-4f, 0x1.4bd70ap-4f, 0x1.51999ap-4f,
    0x1.575c28p-4f, 0x1.5d1eb8p-4f, 0x1.62e148p-4f, 0x1.68a3d8p-4f, 0x1.6e6666p-4f,
    0x1.7428f6p-4f, 0x1.79eb86p-4f, 0x1.7fae14p-4f, 0x1.8570a4p-4f, 0x1.8b3334p-4f,
    0x1.90f5c2p-4f, 0x1.96b852p-4f, 0x1.a8p-4f, 0x1.c4ccccp-4f, 0x1.e1999ap-4f,
    0x1.fe6666p-4f, 0x1.0d999ap-3f, 0x1.1cp-3f, 0x1.2a6666p-3f, 0x1.38ccccp-3f,
    0x1.473334p-3f, 0x1.55999ap-3f, 0x1.64p-3f, 0x1.726666p-3f, 0x1.80ccccp-3f,
    0x1.8f3334p-3f, 0x1.9d999ap-3f, 0x1.acp-3f, 0x1.ba6666p-3f, 0x1.c8ccccp-3f,
    0x1.d73334p-3f, 0x1.e5999ap-3f, 0x1.f4p-3f, 0x1.013334p-2f, 0x1.086666p-2f,
    0x1.0f999ap-2f, 0x1.16ccccp-2f, 0x1.1ep-2f, 0x1.253334p-2f, 0x1.2c6666p-2f,
    0x1.33999ap-2f, 0x1.3accccp-2f, 0x1.42p-2f, 0x1.493334p-2f, 0x1.506666p-2f,
    0x1.57999ap-2f, 0x1.5eccccp-2f, 0x1.66p-2f, 0x1.6d3334p-2f, 0x1.746666p-2f,
    0x1.7b999ap-2f, 0x1.82ccccp-2f, 0x1.8ap-2f, 0x1.913334p-2f, 0x1.986666p-2f,
    0x1.9f999ap-2f, 0x1.a6ccccp-2f, 0x1.aep-2f, 0x1.b53334p-2f, 0x1.bc6666p-2f,
    0x1.c3999ap-2f, 0x1.caccccp-2f, 0x1.d2p-2f, 0x1.d93334p-2f, 0x1.e06666p-2f,
    0x1.e7999ap-2f, 0x1.eeccccp-2f, 0x1.f6p-2f, 0x1.fd3334p-2f, 0x1.023334p-1f,
    0x1.05ccccp-1f, 0x1.096666p-1f, 0x1.0dp-1f, 0x1.10999ap-1f, 0x1.143334p-1f,
    0x1.17ccccp-1f, 0x1.1b6666p-1f, 0x1.1fp-1f, 0x1.22999ap-1f, 0x1.263334p-1f,
    0x1.29ccccp-1f, 0x1.2d6666p-1f, 0x1.31p-1f, 0x1.34999ap-1f, 0x1.383334p-1f,
    0x1.3bccccp-1f, 0x1.3f6666p-1f, 0x1.43p-1f, 0x1.46999ap-1f, 0x1.4a3334p-1f,
    0x1.4dccccp-1f, 0x1.516666p-1f, 0x1.55p-1f, 0x1.58999ap-1f, 0x1.5c3334p-1f,
    0x1.5fccccp-1f, 0x1.636666p-1f, 0x1.67p-1f, 0x1.6a999ap-1f, 0x1.6e3334p-1f,
    0x1.71ccccp-1f, 0x1.756666p-1f, 0x1.79p-1f, 0x1.7c999ap-1f, 0x1.803334p-1f,
    0x1.83ccccp-1f, 0x1.876666p-1f, 0x1.8bp-1f, 0x1.8e999ap-1f, 0x1.923334p-1f,
    0x1.95ccccp-1f, 0x1.996666p-1f, 0x1.9dp-1f, 0x1.a0999ap-1f, 0x1.a43334p-1f,
    0x1.a7ccccp-1f, 0x1.ab6666p-1f, 0x1.afp-1f, 0x1.b2999ap-1f, 0x1.b63334p-1f,
    0x1.b9ccccp-1f, 0x1.bd6666p-1f, 0x1.c1p-1f, 0x1.c4999ap-1f, 0x1.c83334p-1f,
    0x1.cbccccp-1f, 0x1.cf6666p-1f, 0x1.d3p-1f, 0x1.d6999ap-1f, 0x1.da3334p-1f,
    0x1.ddccccp-1f, 0x1.e16666p-1f, 0x1.e5p-1f, 0x1.e8999ap-1f, 0x1.ec3334p-1f,
    0x1.efccccp-1f, 0x1.f36666p-1f, 0x1.f7p-1f, 0x1.fa999ap-1f, 0x1.fe3334p-1f,
    0x1p+0f,
};

/* Float32 round-to-nearest by bins (the torch kernel's method, ``update_8bit.code_bins``,
 * over the range that matters): a float of magnitude in [2^-23, 2) falls in one of
 * 128 bins an octave by its exponent and top 7 mantissa bits, for each sign; the bin holds
 * how many midpoints lie below its values, and branch-free compares (as many as the most
 * midpoints any bin holds: one for these codes) count the bin's own midpoints below x. */
#define PE_CODE8_LO 104 /* biased exponent of 2^-23 */
#define PE_CODE8_BINS ((128 - PE_CODE8_LO) << 7)
#define PE_CODE8_PER_BIN 1 /* the most midpoints a bin holds, for these codes */

typedef struct {
    float mids[2 * 255]; /* the midpoints, then +inf: a compare past them is false */
    int per_bin;
    /* bin j: [start(j), start(j + 1)); then bin j of the negatives: (-start(j + 1), -start(j)] */
    int32_t below[2 * PE_CODE8_BINS];
} pe_code8_bins;

static inline float pe_code8_bin_start(long bin) {
    uint32_t bits = (uint32_t)((PE_CODE8_LO << 7) + bin) << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* How many of the sorted ``mids`` are below ``x`` (or equal to it, with ``or_equal``),
 * counting on from ``p``. */
static inline int pe_code8_count(const float *mids, int p, float x, int or_equal) {
    while (p < 255 && (mids[p] < x || (or_equal && mids[p] == x))) p++;
    return p;
}

/* Fill ``t`` from the code's 255 midpoints (merges of sorted sequences). */
static inline void pe_code8_bins_init(pe_code8_bins *t, const float *mids) {
    for (int i = 0; i < 2 * 255; i++) t->mids[i] = i < 255 ? mids[i] : INFINITY;
    int p = 0, q = 0, most = 0;
    for (long j = 0; j < PE_CODE8_BINS; j++) {
        t->below[j] = (p = pe_code8_count(mids, p, pe_code8_bin_start(j), 0));
        q = pe_code8_count(mids, p, pe_code8_bin_start(j + 1), 0);
        most = q - p > most ? q - p : most;
    }
    p = 0;
    for (long j = PE_CODE8_BINS - 1; j >= 0; j--) {
        t->below[PE_CODE8_BINS + j] = (p = pe_code8_count(mids, p, -pe_code8_bin_start(j + 1), 1));
        q = pe_code8_count(mids, p, -pe_code8_bin_start(j), 1);
        most = q - p > most ? q - p : most;
    }
    t->per_bin = most;
}

/* searchsorted(mids, x) for a float32 ``x``, exact when no midpoint's magnitude is below
 * 2^-23 and no bin holds more than PE_CODE8_PER_BIN of them (``pe_code8_bins_exact``):
 * magnitudes outside [2^-23, 2) are clamped into the first or last bin of their sign,
 * which changes no count then. Branch-free, so a loop of it vectorises (gathers). */
static inline int pe_code8_binned(const pe_code8_bins *t, float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint32_t lo = (uint32_t)PE_CODE8_LO << 23, hi = (128u << 23) - 1;
    uint32_t mag = bits & 0x7FFFFFFFu;
    mag = mag < lo ? lo : mag > hi ? hi : mag;
    uint32_t bin = (mag >> 16) - ((uint32_t)PE_CODE8_LO << 7) + (bits >> 31) * PE_CODE8_BINS;
    int p = t->below[bin];
    for (int k = 0; k < PE_CODE8_PER_BIN; k++) p += t->mids[p] < x;
    return p | (x != x) * 255; /* NaN: above every midpoint, as NumPy sorts it */
}

/* Whether ``pe_code8_binned`` is exact for the code of ``t``. */
static inline int pe_code8_bins_exact(const pe_code8_bins *t) {
    const float smallest = 0x1p-23f;
    int covers = 1;
    for (int i = 0; i < 255; i++) covers &= fabsf(t->mids[i]) >= smallest;
    return covers && t->per_bin <= PE_CODE8_PER_BIN;
}

#endif
