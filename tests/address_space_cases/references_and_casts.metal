// References bound across address spaces, casts between them, assignments and returns.
#include <metal_stdlib>
using namespace metal;

inline void add_to(threadgroup float& acc, float x) {
    acc += x;
}

inline device float* tile_ptr(threadgroup float* t) {
    return t; // expect: address-space
}

kernel void k(device float* out [[buffer(0)]], uint tid [[thread_position_in_threadgroup]]) {
    threadgroup float tile[32];
    float v[2] = {0.0f, 1.0f};
    thread float& r = out[tid]; // expect: address-space
    add_to(out[tid], 1.0f); // expect: address-space
    device float* p = tile; // expect: address-space
    threadgroup float* t = tile;
    t = out; // expect: address-space
    device uint* bits = reinterpret_cast<device uint*>(tile); // expect: address-space
    thread float* q = (thread float*)out; // expect: address-space
    const device float& d = v[0]; // expect: address-space
    out[tid] = r + t[0] + float(bits[0]) + q[0] + d + *p;
}
