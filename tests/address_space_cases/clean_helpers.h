// Legitimate MSL the address-space check must accept (with clean.metal).
#pragma once
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
#pragma clang fp contract(off)  // (again after the system headers, as bnb_common.h does)
using namespace metal;

constant float kTable[4] = {0.0f, 0.25f, 0.5f, 1.0f};
constant constexpr uint kLanes = 32;

struct Pair {
    float a;
    float b;
    float sum() const thread { return a + b; }
};

template <typename T>
inline float load_as_float(const device T* src, uint i) {
    return float(src[i]);
}

template <typename T>
inline T first_of(thread const T* v) {
    return v[0];
}

// Templates over the pointee keep the caller's address space.
template <typename P>
inline float deref_sum(P p, uint n) {
    float s = 0.0f;
    for (uint i = 0; i < n; ++i) {
        s += float(p[i]);
    }
    return s;
}

inline void accumulate(thread float& acc, float x) {
    acc += x;
}

inline float table_value(constant float* table, uint i) {
    return table[i & 3u];
}

inline uint tg_max(threadgroup const uint* partial, uint n) {
    uint m = 0u;
    for (uint j = 0; j < n; ++j) {
        m = max(m, partial[j]);
    }
    return m;
}

template <uint W, typename T>
inline void load_run(const device T* src, uint idx, thread float* v) {
    const vec<T, 4> x = *reinterpret_cast<const device vec<T, 4>*>(src + idx);
    for (uint k = 0; k < 4u && k < W; ++k) {
        v[k] = float(x[k]);
    }
}

inline device float* offset_ptr(device float* base, uint k) {
    return base + k;
}

inline const threadgroup float& tg_ref(const threadgroup float* t, uint k) {
    return t[k];
}
