#include <metal_stdlib>
using namespace metal;

constant bool use_fast [[function_constant(0)]]; // expect: function-constant

kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    out[i] = use_fast ? 1.0f : 0.0f;
}
