#include <metal_stdlib>
using namespace metal;

kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    float v[2] = {1.0f, 2.0f};
    float* p = v; // expect: address-space
    float& r = v[1]; // expect: address-space
    const uint* q = nullptr; // expect: address-space
    for (float* it = v; it != p; ++it) { // expect: address-space
    }
    out[i] = *p + r + float(q != nullptr);
}
