// Legitimate MSL that the lint must accept. Mentions in comments do not count: double, std::,
// printf("x"), [](){}, float* p; #include <cmath>
#pragma clang fp contract(off)  // the project's kernels include bnb_math_mode.h for this
#include <metal_stdlib>
#include <metal_simdgroup>
#pragma clang fp contract(off)  // again after the system headers (bnb_common.h does the same)
#include "clean_helper.h"
using namespace metal;

constant constexpr uint kLanes = 32;
#define TILE 64
enum { kRows = 4 };

struct Pair {
    float a;
    float b;
    float sum() const thread { return a + b; }
};

inline float scale(device const float* x, thread float& r, uint i) {
    r = x[i] * 2.0f;
    return metal::precise::divide(r, 3.0f);
}

template <typename T, int BLOCK>
[[kernel]] void load_one(const device T* src [[buffer(0)]], device T* dst [[buffer(1)]], uint i [[thread_position_in_grid]]) {
    threadgroup float buf[BLOCK];
    threadgroup float tile[TILE * 2][kRows];
    threadgroup float lanes[kLanes + 1];
    threadgroup float sized[sizeof(float) * 8];
    (void)buf; (void)tile; (void)lanes; (void)sized;
    dst[i] = src[i];
}

template <typename T>
[[kernel]] void scale_kernel(
    device const float* x [[buffer(0)]],
    device T* out [[buffer(1)]],
    constant uint& n [[buffer(2)]],
    constant float& factor [[buffer(3)]],
    uint gid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float buf[256];
    threadgroup float htile[HELPER_TILE];  // size from an included header
    float v[4] = {x[0] * factor, x[1] * factor, 0.0f, 0.0f};
    float w[2]{v[0] * v[1], 1.0f};
    thread float& r = v[2];
    device const float* p = x + 1;
    const device float* q = p;
    threadgroup float* t = buf;
    float prod = factor * r;
    float m = simd_max(metal::abs(prod));
    auto s = static_cast<uint>(m);
    auto ptr = reinterpret_cast<device const uchar*>(x);
    bool flag = n & 1u;
    for (uint k = 0; k < 4; ++k) { prod = prod * v[k & 3]; }
    if (gid < n) {
        out[gid] = T(scale(x, r, gid) + w[0] + *p * *q + t[lane] + float(s) + float(ptr[0]) + (flag ? 1.0f : 0.0f));
    }
    buf[lane] = prod + htile[0];
}

template [[host_name("scale_float")]] [[kernel]] decltype(scale_kernel<float>) scale_kernel<float>;
