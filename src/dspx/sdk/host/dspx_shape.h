/* The byte count of a tensor shape, one guard for every caller in libdspx:
 * c7x_client.c (create_input, the device's output descriptors) and
 * c7x_runtime.cc (c7x::Module::Run's DLTensor inputs).  C and C++. */
#ifndef DSPX_SHAPE_H
#define DSPX_SHAPE_H

#include <stdint.h>

/* bytes of ndim extents of bits-wide elements (whole bytes: 8..64 bits), or
 * -1 for a negative extent or an element count n with n * 8 bytes at or past
 * 2^63.  The byte count is n * (bits / 8), never n * bits, which could wrap. */
static inline int64_t dspx_shape_bytes(int32_t ndim, const int64_t *shape, int32_t bits) {
    uint64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return -1;
        if (shape[i] && n > (UINT64_MAX >> 4) / (uint64_t)shape[i]) return -1;
        n *= (uint64_t)shape[i];
    }
    return (int64_t)(n * (uint64_t)(bits / 8));
}

#endif
