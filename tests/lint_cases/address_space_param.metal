#include <metal_stdlib>
using namespace metal;

inline float first(const float* x) { // expect: address-space
    return x[0];
}

inline void bump(float& r) { // expect: address-space
    r += 1.0f;
}

kernel void k(device float* out [[buffer(0)]],
              float* other [[buffer(1)]], // expect: address-space
              uint i [[thread_position_in_grid]]) {
    float v = out[i];
    bump(v);
    out[i] = v + other[i];
}
