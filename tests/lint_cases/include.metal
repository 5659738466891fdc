#include <metal_stdlib>
#include <cmath> // expect: include
#include "local.h"
#include <stdio.h> // expect: include
using namespace metal;

kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    out[i] = 0.0f;
}
