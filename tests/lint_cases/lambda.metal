#include <metal_stdlib>
using namespace metal;

kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    auto twice = [](float x) { return 2.0f * x; }; // expect: lambda
    out[i] = twice(out[i]);
}
