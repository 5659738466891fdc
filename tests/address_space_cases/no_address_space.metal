// Pointers and references written without an address space, wherever they are spelled.
#include <metal_stdlib>
using namespace metal;

inline float first(const float* x) { // expect: address-space
    return x[0];
}

struct View {
    float* data; // expect: address-space
    uint size;
};

typedef uint* index_ptr; // expect: address-space

template <typename P>
inline float at(P p, uint i) {
    return float(p[i]);
}

kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    float v[4] = {1.0f, 2.0f, 3.0f, 4.0f};
    float* p = v; // expect: address-space
    float& r = v[1]; // expect: address-space
    out[i] = at<float*>(v, 1u); // expect: address-space
    out[i] += *(float*)(&v[2]) + *p + r; // expect: address-space
}
