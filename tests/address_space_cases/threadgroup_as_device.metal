// A threadgroup array passed as a device pointer; a device pointer passed as threadgroup.
#include <metal_stdlib>
using namespace metal;

inline void store4(device float* dst, uint i, float x) {
    dst[i] = x;
}

inline float tg_max(threadgroup const float* partial, uint n) {
    float m = 0.0f;
    for (uint j = 0; j < n; ++j) {
        m = max(m, partial[j]);
    }
    return m;
}

kernel void k(device float* out [[buffer(0)]], uint tid [[thread_position_in_threadgroup]]) {
    threadgroup float tile[64];
    tile[tid] = float(tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    store4(tile, tid, 1.0f); // expect: address-space
    out[tid] = tg_max(out, 4u); // expect: address-space
    store4(out, tid, tg_max(tile, 4u));
}
