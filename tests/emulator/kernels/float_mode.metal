// Planted kernels for the emulator's float modes (tests/emulator/test_float_mode.py): float32
// subnormal inputs and results, fp16 and bfloat subnormals, a SIMD-group reduction and a
// comparison, each computed by the kernel at run time from buffer data (nothing the compiler can
// fold).
#include <metal_stdlib>
using namespace metal;

// out[i] = a[i] * b[i] and out[n + i] = a[i] + b[i] in float32.
kernel void f32_mul_add(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                        device float* out [[buffer(2)]], constant uint& n [[buffer(3)]],
                        uint i [[thread_position_in_grid]]) {
    if (i < n) {
        out[i] = a[i] * b[i];
        out[n + i] = a[i] + b[i];
    }
}

// flags[i] = (a[i] > 0) | (a[i] == 0) << 1: how the comparison unit sees a value.
kernel void f32_compare(device const float* a [[buffer(0)]], device uint* flags [[buffer(1)]],
                        constant uint& n [[buffer(2)]], uint i [[thread_position_in_grid]]) {
    if (i < n) {
        flags[i] = (a[i] > 0.0f ? 1u : 0u) | (a[i] == 0.0f ? 2u : 0u);
    }
}

// out[i] = a[i] * b[i] in half (fp16 subnormals are kept on Apple GPUs).
kernel void f16_mul(device const half* a [[buffer(0)]], device const half* b [[buffer(1)]],
                    device half* out [[buffer(2)]], constant uint& n [[buffer(3)]],
                    uint i [[thread_position_in_grid]]) {
    if (i < n) {
        out[i] = a[i] * b[i];
    }
}

// out[i] = bfloat(float(a[i]) * scale): a bfloat subnormal is a float32 subnormal.
kernel void bf16_scale(device const bfloat* a [[buffer(0)]], device bfloat* out [[buffer(1)]],
                       constant float& scale [[buffer(2)]], constant uint& n [[buffer(3)]],
                       uint i [[thread_position_in_grid]]) {
    if (i < n) {
        out[i] = bfloat(float(a[i]) * scale);
    }
}

// sums[simdgroup] = simd_sum(a[i]) over each simdgroup of 32 lanes.
kernel void f32_simd_sum(device const float* a [[buffer(0)]], device float* sums [[buffer(1)]],
                         uint i [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
    const float s = simd_sum(a[i]);
    if (lane == 0u) {
        sums[i / 32u] = s;
    }
}

// The conversions between half and float: h_to_f[i] = float(half bits h[i]), f_to_h[i] =
// half(float bits f[i]), as bit patterns.
kernel void half_float_conversions(device const ushort* h [[buffer(0)]], device uint* h_to_f [[buffer(1)]],
                                   device const uint* f [[buffer(2)]], device ushort* f_to_h [[buffer(3)]],
                                   uint i [[thread_position_in_grid]]) {
    h_to_f[i] = as_type<uint>(float(as_type<half>(h[i])));
    f_to_h[i] = as_type<ushort>(half(as_type<float>(f[i])));
}

// Fused multiply-adds: out[i] = fma(a[i], b[i], c[i]) (i < 8), and prod = A * B + C by one
// simdgroup_multiply_accumulate of 8x8 matrices with a, b and c on their diagonals (one simdgroup).
kernel void f32_fma(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                    device const float* c [[buffer(2)]], device float* out [[buffer(3)]],
                    device float* prod [[buffer(4)]], uint tid [[thread_index_in_threadgroup]]) {
    threadgroup float ta[64];
    threadgroup float tb[64];
    threadgroup float tc[64];
    for (uint i = tid; i < 64u; i += 32u) {
        const bool diagonal = i / 8u == i % 8u;
        ta[i] = diagonal ? a[i / 8u] : 0.0f;
        tb[i] = diagonal ? b[i / 8u] : 0.0f;
        tc[i] = diagonal ? c[i / 8u] : 0.0f;
    }
    if (tid < 8u) {
        out[tid] = fma(a[tid], b[tid], c[tid]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_float8x8 ma;
    simdgroup_float8x8 mb;
    simdgroup_float8x8 mc;
    simdgroup_load(ma, ta, 8);
    simdgroup_load(mb, tb, 8);
    simdgroup_load(mc, tc, 8);
    simdgroup_multiply_accumulate(mc, ma, mb, mc);
    simdgroup_store(mc, prod, 8);
}
