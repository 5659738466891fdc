// Shared pieces of the bnb-mps kernels: the instantiation macro and float helpers that do not
// depend on the compiler's fast-math setting.
#pragma once

// First, before the standard library: the pinned floating-point mode (safe math, no contraction),
// which then covers the standard library's inline functions too.
#include "bnb_math_mode.h"
#include <metal_stdlib>
// Again right after it: a `#pragma ... fp` of the standard library's own (Apple's header is not
// ours to read) would hold from there to the end of the unit. Repeated here, the kernels' own code
// is pinned whatever the header set. (The same lines as bnb_math_mode.h's, which is included once.)
#pragma clang fp contract(off)
#if defined(__METAL_VERSION__) && __METAL_VERSION__ >= 320
#pragma METAL fp math_mode(safe)
#pragma METAL fp contract(off)
#endif
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

// |x| as its bit pattern, NaN and float32 subnormals as 0. For non-negative floats the bit
// patterns order like the values, so an integer max of these is the float absmax with NaNs
// ignored (like fmaxf). Subnormals count as 0 because Apple GPUs flush float32 subnormal inputs to
// zero (docs/semantics.md, "Apple GPUs"): a block of zeros and subnormals has absmax 0, like an
// all-zero block, instead of a subnormal absmax whose reciprocal the GPU cannot form.
inline uint bnb_abs_bits(float x) {
    uint b = as_type<uint>(x) & 0x7fffffffu;
    return (b > 0x7f800000u || b < 0x00800000u) ? 0u : b;
}

// The reciprocal of a block's absmax, for the scaled values s = fl32(x * fl32(1 / absmax)) of the
// blockwise quantizers (docs/semantics.md section 2). For absmax > 2^126, fl32(1 / absmax) is a
// float32 subnormal, which an Apple GPU flushes to 0 (every s would be 0). It is then held as
// r * 2^64, exactly: its IEEE rounding m * 2^-149 is found with integer arithmetic
// (m = round-half-even(2^149 / absmax)) and kept as m * 2^-85, a normal float; bnb_scaled
// multiplies and scales back by 2^-64, which gives the IEEE s whenever s is a normal float.
struct bnb_recip {
    float r;      // fl32(1 / absmax), times 2^64 when `scaled`
    bool scaled;  // absmax > 2^126 (and finite)
};

// `amax_bits`: the bit pattern of the block's absmax (bnb_abs_bits of it). absmax 0 gives
// r = inf and absmax inf gives r = 0, as IEEE division does.
inline bnb_recip bnb_block_recip(uint amax_bits) {
    bnb_recip rc;
    if (amax_bits <= 0x7e800000u || amax_bits >= 0x7f800000u) {  // absmax <= 2^126, inf or NaN
        rc.r = metal::precise::divide(1.0f, as_type<float>(amax_bits));
        rc.scaled = false;
        return rc;
    }
    // absmax = M * 2^(e - 150) with e = 253 or 254; 1 / absmax = 2^(299 - e) / M units of 2^-149.
    const uint e = amax_bits >> 23;
    const ulong M = ulong((amax_bits & 0x7fffffu) | 0x800000u);
    const ulong N = ulong(1) << (299u - e);
    ulong q = N / M;
    const ulong rem2 = 2u * (N - q * M);
    if (rem2 > M || (rem2 == M && (q & 1u) != 0u)) {
        q += 1u;  // round half to even: q <= 2^23, exact in a float
    }
    rc.r = float(uint(q)) * as_type<float>(0x15000000u);  // * 2^-85
    rc.scaled = true;
    return rc;
}

// s = fl32(x * fl32(1 / absmax)) for the block reciprocal `rc` (a subnormal s may be flushed).
// The scaled case divides by 2^64 on the exponent bits: exact for a normal s, a signed zero for a
// subnormal one, and out of reach of fast math (which could re-associate a float multiply by
// 2^-64 into the subnormal r itself).
inline float bnb_scaled(float x, bnb_recip rc) {
    const float t = x * rc.r;
    if (!rc.scaled) {
        return t;
    }
    const uint b = as_type<uint>(t);
    const uint e = (b >> 23) & 0xffu;
    if (e == 0xffu) {
        return t;  // NaN (t is never infinite here: |x| <= absmax < 2^128, r < 2^-61)
    }
    return as_type<float>(e > 64u ? b - (64u << 23) : b & 0x80000000u);
}

// Whether the IEEE product fl32(x * fl32(1 / absmax)) is non-zero, for a normal x: true exactly
// when x * r > 2^-150 (2^-150 itself rounds to even, 0). Decided on exponents and an exact fused
// multiply-add of the significands, so that it holds where the GPU flushes that product (a
// subnormal s) to zero. A subnormal x counts as 0 (false), as on the GPU.
inline bool bnb_scaled_is_nonzero(float x, bnb_recip rc) {
    const uint bx = as_type<uint>(x) & 0x7fffffffu;
    const uint br = as_type<uint>(rc.r);
    if ((bx >> 23) == 0u || (br >> 23) == 0u || bx >= 0x7f800000u || br >= 0x7f800000u) {
        return false;  // x or r zero, subnormal, infinite or NaN: not this case
    }
    // x * r = mx * mr * 2^e with significands mx, mr in [1, 2).
    const int e = int(bx >> 23) + int(br >> 23) - 254 - (rc.scaled ? 64 : 0);
    if (e >= -149) {
        return true;
    }
    if (e < -151) {
        return false;
    }
    const float mx = as_type<float>((bx & 0x7fffffu) | 0x3f800000u);
    const float mr = as_type<float>((br & 0x7fffffu) | 0x3f800000u);
    // mx * mr - 1 (or - 2) is 0 or at least 2^-46 in magnitude: exact, and never subnormal.
    return fma(mx, mr, e == -150 ? -1.0f : -2.0f) > 0.0f;
}

// s < 0 for a non-NaN s, false for -0.0.
inline bool bnb_is_negative(float s) {
    uint b = as_type<uint>(s);
    return (b >> 31) != 0u && (b & 0x7fffffffu) != 0u;
}
