// Shared pieces of the bnb-mps kernels: the instantiation macro and float helpers that do not
// depend on the compiler's fast-math setting.
#pragma once

#include <metal_stdlib>
// Before any kernel code: the pinned floating-point mode (safe math, no contraction).
#include "bnb_math_mode.h"
using namespace metal;

// Instantiates a templated kernel under a host name (the name executors look up).
// On Metal this is an explicit instantiation carrying [[host_name]]; the Metal-on-CPU emulator
// defines the same macro in its <metal_stdlib> to register the instantiation by name instead,
// so its definition (seen first) wins.
#ifndef BNB_KERNEL_INSTANTIATE
#define BNB_KERNEL_INSTANTIATE(host, fn, ...) template [[host_name(host)]] [[kernel]] decltype(fn<__VA_ARGS__>) fn<__VA_ARGS__>;
#endif

// Index arithmetic is 32-bit: every kernel takes the element count as `constant uint&`, and the
// op layer only launches tensors with fewer than 2^32 - 8192 elements (so that a block start plus
// a block never wraps around).

// NaN and sign tests on the bit pattern: fast-math lets the compiler assume there are no NaNs,
// so isnan() and comparisons with NaN are not reliable there; integer tests are.
inline bool bnb_is_nan(float x) {
    return (as_type<uint>(x) & 0x7fffffffu) > 0x7f800000u;
}

// |x| as its bit pattern, NaN as 0. For non-negative floats the bit patterns order like the
// values, so an integer max of these is the float absmax with NaNs ignored (like fmaxf).
inline uint bnb_abs_bits(float x) {
    uint b = as_type<uint>(x) & 0x7fffffffu;
    return b > 0x7f800000u ? 0u : b;
}

// s < 0 for a non-NaN s, false for -0.0.
inline bool bnb_is_negative(float s) {
    uint b = as_type<uint>(s);
    return (b >> 31) != 0u && (b & 0x7fffffffu) != 0u;
}
