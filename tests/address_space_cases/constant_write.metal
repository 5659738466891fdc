// Writes through constant pointers and references.
#include <metal_stdlib>
using namespace metal;

inline void bump(constant float& x) {
    x += 1.0f; // expect: address-space
}

inline void reset(constant uint* counts, uint i) {
    counts[i] = 0u; // expect: address-space
}

kernel void k(device float* out [[buffer(0)]],
              constant float* scales [[buffer(1)]],
              constant uint& n [[buffer(2)]],
              uint i [[thread_position_in_grid]]) {
    scales[i] = out[i]; // expect: address-space
    n = 0u; // expect: address-space
    out[i] = scales[0] * float(n);
}
