// Kernels with known memory traffic, for the profiler tests (tests/emulator/test_profile.py).
#include <metal_stdlib>
using namespace metal;

// Coalesced copy: lane l of a simdgroup reads and writes float l of a 128-byte run.
kernel void copy_f32(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                     uint gid [[thread_position_in_grid]]) {
    y[gid] = x[gid];
}

// The same copy with a stride of 32 floats: consecutive lanes read floats 128 bytes apart.
// (A permutation of 0..n-1 for n a multiple of 1024.)
kernel void copy_f32_stride32(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                              constant uint& n [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
    y[gid] = x[(gid * 32u) % n + (gid * 32u) / n];
}

// Every thread reads the same float.
kernel void broadcast_f32(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                          constant uint& k [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
    y[gid] = x[k] + float(gid);
}

// Every threadgroup reads all m floats of x (coalesced), then writes one sum per thread.
kernel void reread_per_threadgroup(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                                   constant uint& m [[buffer(2)]], uint tid [[thread_index_in_threadgroup]],
                                   uint tpg [[threads_per_threadgroup]], uint gid [[thread_position_in_grid]]) {
    float s = 0.0f;
    for (uint i = tid; i < m; i += tpg) {
        s += x[i];
    }
    y[gid] = s;
}

// One byte per thread, four bytes per thread (uchar4), sixteen bytes per thread (uint4).
kernel void read_uchar(device const uchar* x [[buffer(0)]], device uint* y [[buffer(1)]],
                       uint gid [[thread_position_in_grid]]) {
    y[gid] = x[gid];
}
kernel void read_uchar4(device const uchar* x [[buffer(0)]], device uint* y [[buffer(1)]],
                        uint gid [[thread_position_in_grid]]) {
    const uchar4 v = *reinterpret_cast<const device uchar4*>(x + 4u * gid);
    y[gid] = uint(v.x) + uint(v.y) + uint(v.z) + uint(v.w);
}
kernel void read_uint4(device const uchar* x [[buffer(0)]], device uint* y [[buffer(1)]],
                       uint gid [[thread_position_in_grid]]) {
    const uint4 v = *reinterpret_cast<const device uint4*>(x + 16u * gid);
    y[gid] = v.x ^ v.y ^ v.z ^ v.w;
}
// Four separate byte loads per thread: four accesses (not merged into one).
kernel void read_4_uchars(device const uchar* x [[buffer(0)]], device uint* y [[buffer(1)]],
                          uint gid [[thread_position_in_grid]]) {
    const device uchar* p = x + 4u * gid;
    y[gid] = uint(p[0]) * 1000000u + uint(p[1]) * 10000u + uint(p[2]) * 100u + uint(p[3]);
}

// Vector loads and stores of other widths, and a vector operand used straight from device memory.
kernel void half4_scale(device const half4* x [[buffer(0)]], device half4* y [[buffer(1)]],
                        uint gid [[thread_position_in_grid]]) {
    y[gid] = x[gid] * half(2);
}
kernel void float4_dot(device const float4* x [[buffer(0)]], device float* y [[buffer(1)]],
                       uint gid [[thread_position_in_grid]]) {
    y[gid] = dot(x[gid], x[gid]);
}
kernel void write_uchar4(device uchar* y [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
    *reinterpret_cast<device uchar4*>(y + 4u * gid) = uchar4(uchar(gid), uchar(gid + 1u), uchar(gid + 2u), uchar(gid + 3u));
}

// Threadgroup memory, barriers and SIMD collectives: per threadgroup of 128 threads, 512 + 16
// bytes of threadgroup memory, 2 barriers; per simdgroup, 2 collectives.
kernel void tg_reduce(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                      uint tid [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                      uint sg [[simdgroup_index_in_threadgroup]], uint gid [[thread_position_in_grid]],
                      uint tg [[threadgroup_position_in_grid]]) {
    threadgroup float stage[128];
    threadgroup float partial[4];
    stage[tid] = x[gid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float v = stage[127u - tid];
    v = simd_sum(v);
    if (lane == 0u) {
        partial[sg] = v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float m = simd_max(partial[lane % 4u]);
    if (tid == 0u) {
        y[tg] = m;
    }
}

// Divergence before a collective: odd lanes make an extra load; after the simd_sum every lane
// makes the same coalesced load again.
kernel void diverge_then_sync(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                              uint gid [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
    float v = 0.0f;
    if ((lane & 1u) != 0u) {
        v = x[gid];
    }
    v = simd_sum(v);
    y[gid] = v + x[gid];
}

// An 8x8 tile of a row-major matrix with rows of `cols` floats, loaded with simdgroup_load.
kernel void matrix_load(device const float* a [[buffer(0)]], device float* y [[buffer(1)]],
                        constant uint& cols [[buffer(2)]], uint lane [[thread_index_in_simdgroup]],
                        uint sgid [[threadgroup_position_in_grid]]) {
    simdgroup_float8x8 m;
    simdgroup_load(m, a + 8u * sgid, ulong(cols));
    threadgroup float t[64];
    simdgroup_store(m, t, 8ul);
    simdgroup_barrier(mem_flags::mem_threadgroup);
    y[sgid * 32u + lane] = t[2u * lane] + t[2u * lane + 1u];
}

// Every thread adds 1 to one counter.
kernel void atomic_count(device atomic_uint* counter [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
    atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
}

// Lane 0 of each simdgroup writes one value (divergent), then every lane writes its own.
kernel void lane0_then_all(device float* head [[buffer(0)]], device float* y [[buffer(1)]],
                           uint gid [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
    if (lane == 0u) {
        head[gid / 32u] = float(gid);
    }
    y[gid] = float(lane);
}

// Eight scalar stores per thread in a loop: eight accesses (not one memset the CPU compiler
// would otherwise make of it, which the instrumentation cannot see).
kernel void zero8(device float* y [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
    for (uint k = 0; k < 8u; ++k) {
        y[8u * gid + k] = 0.0f;
    }
}
