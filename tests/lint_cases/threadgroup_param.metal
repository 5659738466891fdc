#include <metal_stdlib>
using namespace metal;

kernel void k(device float* out [[buffer(0)]],
              threadgroup float* scratch [[threadgroup(0)]], // expect: threadgroup-param
              uint i [[thread_position_in_grid]]) {
    scratch[0] = 1.0f;
    out[i] = scratch[0];
}
