// Address-space mismatches through template arguments.
#include <metal_stdlib>
using namespace metal;

template <typename T>
inline T get(const device T* p, uint i) {
    return p[i];
}

template <typename P>
inline void put(P dst, uint i, float x) {
    dst[i] = x;
}

template <typename T, uint N>
struct Window {
    device T* base;
    T at(uint i) const thread { return base[i % N]; }
};

kernel void k(device float* out [[buffer(0)]], uint tid [[thread_position_in_threadgroup]]) {
    threadgroup float tile[32];
    tile[tid] = 1.0f;
    float x = get<float>(tile, tid); // expect: address-space
    put<device float*>(tile, tid, x); // expect: address-space
    Window<float, 32> w = {tile}; // expect: address-space
    Window<float, 32> ok = {out};
    out[tid] = w.at(tid) + ok.at(tid);
}
