#include <metal_stdlib>
using namespace metal;

kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    printf("%f", out[i]); // expect: libc
    thread float tmp[4];
    memset(tmp, 0, sizeof(tmp)); // expect: libc
    memcpy(tmp, tmp, 4); // expect: libc
    assert(i < 4); // expect: libc
    out[i] = tmp[0] + metal::abs(out[i]);
}
