#include <metal_stdlib>
using namespace metal;

kernel float not_void(device float* out [[buffer(0)]]) { // expect: kernel-return
    return out[0];
}

kernel void indices(device float* a [[buffer(0)]],
                    device float* b [[buffer(0)]], // expect: buffer-index
                    device float* c [[buffer(31)]], // expect: buffer-index
                    uint i [[thread_position_in_grid]]) {
    a[i] = b[i] + c[i];
}

kernel void gap(device float* a [[buffer(0)]], device float* b [[buffer(2)]]) { // expect: buffer-index
    a[0] = b[0];
}

kernel void params(device float* out [[buffer(0)]],
                   constant uint& n, // expect: kernel-param
                   float factor [[buffer(1)]], // expect: kernel-param
                   constant size_t& count [[buffer(2)]], // expect: kernel-param
                   constant bfloat& x [[buffer(3)]], // expect: kernel-param
                   int gid [[thread_position_in_grid]], // expect: kernel-param
                   uint2 lane [[thread_index_in_simdgroup]], // expect: kernel-param
                   uint sg [[simdgroup_index_in_grid]]) { // expect: kernel-param
    out[gid] = factor * float(n) + float(count) + float(x) + float(lane.x + sg);
}

template <typename T>
[[kernel]] void fine(device const T* a [[buffer(0)]], device T* out [[buffer(1)]], constant uint& n [[buffer(2)]],
                     constant float& f [[buffer(3)]], constant bool& flag [[buffer(4)]],
                     uint3 gid [[thread_position_in_grid]], ushort lane [[thread_index_in_simdgroup]]) {
    out[gid.x] = a[gid.x] * T(f) + T(n + lane + (flag ? 1u : 0u));
}
