#include <metal_stdlib>
using namespace metal;

// Metal 3.2 spellings outside a guard, in the #else of one, and under an || are rejected; under
// `#if __METAL_VERSION__ >= 320` (or a later version) they are not.
kernel void k(coherent(device) device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) { // expect: metal-version
    out[i] = 1.0f;
    atomic_thread_fence(mem_flags::mem_device, memory_order_release, thread_scope_device); // expect: metal-version
}

#if __METAL_VERSION__ >= 320
kernel void guarded(coherent(device) device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    out[i] = 2.0f;
    atomic_thread_fence(mem_flags::mem_device, memory_order_release, thread_scope_device);
}
#else
kernel void fallback(coherent(device) device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) { // expect: metal-version
    out[i] = 3.0f;
}
#endif

#if defined(__METAL_VERSION__) && __METAL_VERSION__ >= 400
kernel void later(coherent(device) device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    out[i] = 4.0f;
}
#endif

#if __METAL_VERSION__ >= 320 || defined(EVERYWHERE)
kernel void either(coherent(device) device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) { // expect: metal-version
    out[i] = 5.0f;
}
#endif
