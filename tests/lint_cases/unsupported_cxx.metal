#include <metal_stdlib>
using namespace metal;

struct Base {
    virtual float f() const; // expect: unsupported-cxx
};

kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    thread float* p = new float[4]; // expect: unsupported-cxx
    if (i > 4u) {
        goto done; // expect: unsupported-cxx
    }
    try { // expect: unsupported-cxx
        out[i] = p[0];
    } catch (...) { // expect: unsupported-cxx
        throw; // expect: unsupported-cxx
    }
done:
    out[i] = 0.0f;
}
