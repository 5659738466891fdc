#include <metal_stdlib>
using namespace metal;

bool is_odd(uint x);

bool is_even(uint x) { // expect: recursion
    return x == 0 ? true : is_odd(x - 1);
}

bool is_odd(uint x) { // expect: recursion
    return x == 0 ? false : is_even(x - 1);
}

kernel void k(device uint* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    out[i] = is_even(i) ? 1 : 0;
}
