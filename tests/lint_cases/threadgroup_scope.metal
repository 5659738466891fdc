#include <metal_stdlib>
using namespace metal;

threadgroup float shared_sum; // expect: threadgroup-scope

inline float reduce(threadgroup float* partial, uint n) {
    threadgroup float scratch[32]; // expect: threadgroup-scope
    float s = 0.0f;
    for (uint j = 0; j < n; ++j) {
        s += partial[j] + scratch[j];
    }
    return s;
}

kernel void k(device float* out [[buffer(0)]], uint tid [[thread_position_in_threadgroup]]) {
    threadgroup float partial[32];
    threadgroup float total = 0.0f; // expect: threadgroup-init
    threadgroup uint counts[4] = {0, 0, 0, 0}; // expect: threadgroup-init
    partial[tid] = out[tid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = reduce(partial, 32u) + total + float(counts[0]);
}
