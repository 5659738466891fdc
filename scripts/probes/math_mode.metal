// Probes of what a Metal compiler does with float arithmetic, for scripts/probe_math_mode.py (the
// acceptance run on a Mac). Not a bnb-mps kernel: the probe compiles this text as it is ("bare")
// and behind csrc/kernels/bnb_math_mode.h ("pinned"), at each Metal language version a tier offers.
// One thread per element; the grid is exactly the element count.
#include <metal_stdlib>
using namespace metal;

// a * b + c as the kernels write it: contracted into one fused multiply-add, or rounded twice?
kernel void probe_mad(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                      device const float* c [[buffer(2)]], device float* o [[buffer(3)]],
                      uint i [[thread_position_in_grid]]) {
    o[i] = a[i] * b[i] + c[i];
}

// The control: an explicit fused multiply-add (what a contracted a * b + c gives).
kernel void probe_fma(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                      device const float* c [[buffer(2)]], device float* o [[buffer(3)]],
                      uint i [[thread_position_in_grid]]) {
    o[i] = fma(a[i], b[i], c[i]);
}

// x != x: 1 for a NaN under IEEE rules; fast math may assume there are no NaNs and give 0.
kernel void probe_nan(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                      device const float* c [[buffer(2)]], device float* o [[buffer(3)]],
                      uint i [[thread_position_in_grid]]) {
    const float x = a[i];
    o[i] = (x != x) ? 1.0f : 0.0f;
}

// An unqualified sqrt (the variant the fast-math setting selects) next to metal::precise::sqrt.
kernel void probe_sqrt(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                       device float* o [[buffer(2)]], device float* p [[buffer(3)]],
                       uint i [[thread_position_in_grid]]) {
    o[i] = sqrt(a[i]);
    p[i] = metal::precise::sqrt(a[i]);
}
