// Float math-library calls must go through metal::precise:: (fast math switches the others).
#include <metal_stdlib>
using namespace metal;

inline float norm(float x, float y) {
    return sqrt(x * x + y * y);  // expect: float-math
}

kernel void k(device float* o [[buffer(0)]], constant uint& n [[buffer(1)]], uint i [[thread_position_in_grid]]) {
    float v = o[i];
    v = metal::rsqrt(v);  // expect: float-math
    v = fast::exp(v);  // expect: float-math
    v = metal::sqrt(v) + fast::sqrt(v);  // expect: float-math expect: float-math
    v += clamp(v, -1.0f, 1.0f);  // expect: float-math
    v += metal::precise::sqrt(v) + precise::pow(v, 2.0f) + fma(v, v, v);
    uint m = min(n, 4u) + max(i, 1u);
    o[i] = norm(v, float(m)) + float(clamp(m, 0u, 3u)) + abs(float(m));  // expect: float-math
}
