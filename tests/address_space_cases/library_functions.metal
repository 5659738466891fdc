// Metal library functions whose signatures name address spaces.
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
using namespace metal;

kernel void k(device float* out [[buffer(0)]],
              device int* exps [[buffer(1)]],
              constant atomic_uint* frozen [[buffer(2)]],
              device atomic_uint* counter [[buffer(3)]],
              uint tid [[thread_position_in_threadgroup]]) {
    float local_tile[64];
    simdgroup_float8x8 m;
    simdgroup_load(m, local_tile, 8); // expect: address-space
    simdgroup_store(m, out, 8);
    int e;
    out[tid] = frexp(out[tid], e);
    out[tid] += frexp(out[tid], exps[tid]); // expect: address-space
    atomic_fetch_add_explicit(frozen, 1u, memory_order_relaxed); // expect: address-space
    atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
}
