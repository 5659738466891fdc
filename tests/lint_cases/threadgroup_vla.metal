#include <metal_stdlib>
using namespace metal;

kernel void k(device float* out [[buffer(0)]],
              constant uint& n [[buffer(1)]],
              uint i [[thread_position_in_grid]]) {
    threadgroup float fixed[128];
    threadgroup float scratch[n]; // expect: threadgroup-array
    threadgroup float rows[4][n * 2]; // expect: threadgroup-array
    scratch[0] = fixed[0] + rows[0][0];
    out[i] = scratch[0];
}
