#include <metal_stdlib>
using namespace metal;

uint fact(uint x) {
    return x <= 1 ? 1 : x * fact(x - 1); // expect: recursion
}

kernel void k(device uint* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    out[i] = fact(i);
}
