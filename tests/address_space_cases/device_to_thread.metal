// A device pointer passed where a thread pointer is expected (directly and through a template).
#include <metal_stdlib>
using namespace metal;

inline float sum2(thread const float* v) {
    return v[0] + v[1];
}

template <uint W>
inline void load_run(const device float* src, uint idx, thread float* v) {
    for (uint k = 0; k < W; ++k) {
        v[k] = src[idx + k];
    }
}

template <typename T>
[[kernel]] void k(device T* out [[buffer(0)]], device float* scratch [[buffer(1)]], uint i [[thread_position_in_grid]]) {
    float v[2];
    load_run<2>(scratch, i, v);
    load_run<2>(scratch, i, scratch + 4); // expect: address-space
    out[i] = T(sum2(v) + sum2(scratch + i)); // expect: address-space
}

template [[host_name("k_f32")]] [[kernel]] decltype(k<float>) k<float>;
