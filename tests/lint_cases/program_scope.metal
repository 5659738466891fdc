#include <metal_stdlib>
using namespace metal;

constant float kTable[4] = {0.0f, 0.25f, 0.5f, 1.0f};
constant constexpr uint kLanes = 32;
float scale = 2.0f; // expect: program-scope
constexpr float kHalf = 0.5f; // expect: program-scope
static const uint kMask[2] = {1u, 2u}; // expect: program-scope
device float* global_out; // expect: program-scope

namespace detail {
constant float kOne = 1.0f;
float kTwo = 2.0f; // expect: program-scope
}  // namespace detail

struct Acc {
    float v;
    float get() const thread { return v; }
};

bool helper(uint x);

kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    float local = kTable[i & 3u] * scale + kHalf + float(kMask[0]) + detail::kOne + detail::kTwo;
    out[i] = local + float(kLanes);
}
