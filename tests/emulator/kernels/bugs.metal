// Planted bugs: one kernel per detector. Each must be caught (tests/emulator/test_detectors.py).
#include <metal_stdlib>
using namespace metal;

// Each thread publishes a value, then reads its neighbour's without a barrier in between.
kernel void missing_barrier(device const float* in [[buffer(0)]],
                            device float* out [[buffer(1)]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint n [[threads_per_threadgroup]]) {
  threadgroup float shared[256];
  shared[tid] = in[tid];
  out[tid] = shared[(tid + 1) % n];
}

// Several threads write the same threadgroup slot between two barriers.
kernel void threadgroup_race(device float* out [[buffer(0)]],
                             uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float slot[8];
  slot[tid % 8] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = slot[tid % 8];
}

// Sums all 64 slots of a threadgroup array of which only 63 are ever written.
kernel void uninitialised_read(device float* out [[buffer(0)]],
                               uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float acc[64];
  if (tid < 63) acc[tid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    float s = 0.0f;
    for (uint i = 0; i < 64; ++i) s += acc[i];
    out[0] = s;
  }
}

// Reads one element past the end of its input.
kernel void oob_read(device const float* in [[buffer(0)]],
                     device float* out [[buffer(1)]],
                     constant uint& n [[buffer(2)]],
                     uint gid [[thread_position_in_grid]]) {
  if (gid < n) out[gid] = in[gid] + in[gid + 1];
}

// Writes one element past the end of its output (the bounds check uses <=).
kernel void oob_write(device float* out [[buffer(0)]],
                      constant uint& n [[buffer(1)]],
                      uint gid [[thread_position_in_grid]]) {
  if (gid <= n) out[gid] = 1.0f;
}

// Threads past the end return early, the others wait at a barrier.
kernel void barrier_divergence(device float* out [[buffer(0)]],
                               constant uint& n [[buffer(1)]],
                               uint gid [[thread_position_in_grid]],
                               uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float t[64];
  if (gid >= n) return;
  t[tid] = float(gid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = t[63 - tid];
}

// A simd_sum reached by only half of a simdgroup, the other half at a different one.
kernel void divergent_simd(device const float* in [[buffer(0)]],
                           device float* out [[buffer(1)]],
                           uint gid [[thread_position_in_grid]],
                           uint lane [[thread_index_in_simdgroup]]) {
  float x = in[gid];
  if (lane < 16) {
    x = simd_sum(x);
  } else {
    x = simd_max(x);
  }
  out[gid] = x;
}

// Half the lanes wait at a threadgroup barrier while the others do a SIMD shuffle.
kernel void simd_vs_barrier(device float* out [[buffer(0)]],
                            uint lane [[thread_index_in_simdgroup]]) {
  float x = float(lane);
  if (lane & 1) {
    x = simd_shuffle_xor(x, ushort(1));
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[lane] = x;
}

// Two barriers at different places in the two branches of an if.
kernel void different_barriers(device float* out [[buffer(0)]],
                               uint tid [[thread_index_in_threadgroup]]) {
  if (tid < 16) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = 1.0f;
  } else {
    out[tid] = 2.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// More threadgroup memory than Metal allows (32 KB).
kernel void too_much_threadgroup_memory(device float* out [[buffer(0)]],
                                        uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float big[6000];
  threadgroup float more[3000];
  big[tid] = 1.0f;
  more[tid] = 2.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = big[tid] + more[tid];
}

// Uses three buffers; launched with two.
kernel void three_buffers(device const float* a [[buffer(0)]],
                          device const float* b [[buffer(1)]],
                          device float* c [[buffer(2)]],
                          uint gid [[thread_position_in_grid]]) {
  c[gid] = a[gid] + b[gid];
}

// Correct: vector loads over a buffer whose size is not a multiple of 16 bytes (scalar tail).
kernel void vector_tail(device const float* in [[buffer(0)]],
                        device float* out [[buffer(1)]],
                        constant uint& n [[buffer(2)]]) {
  float s = 0.0f;
  uint i = 0;
  for (; i + 4 <= n; i += 4) {
    float4 v = *(device const float4*)(in + i);
    s += v.x + v.y + v.z + v.w;
  }
  for (; i < n; ++i) s += in[i];
  out[0] = s;
}

// Writes through a wild pointer far from any buffer.
kernel void wild_pointer(device float* out [[buffer(0)]],
                         uint gid [[thread_position_in_grid]]) {
  device float* p = (device float*)(ulong(16));
  p[gid] = 1.0f;
  out[gid] = 0.0f;
}

// Indexes a 32-element threadgroup array with the thread index of a 64-thread group.
kernel void threadgroup_subscript(device float* out [[buffer(0)]],
                                  uint tid [[thread_position_in_threadgroup]]) {
  threadgroup float s[32];
  s[tid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = s[tid];
}

// Half of each simdgroup takes a SIMD sum; the other half skips it and returns.
kernel void simd_in_a_branch(device float* out [[buffer(0)]],
                             uint tid [[thread_position_in_threadgroup]]) {
  float v = float(tid);
  if (tid % 2 == 0) {
    v = simd_sum(v);
  }
  out[tid] = v;
}

// simdgroup_matrix operations in lane-dependent control flow: half the lanes load, all store.
kernel void matrix_in_a_branch(device const float* in [[buffer(0)]],
                               device float* out [[buffer(1)]],
                               uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  if (lane < 16) {
    simdgroup_load(m, in, 8);
  }
  simdgroup_store(m, out, 8);
}

// A simdgroup_load whose address depends on the lane.
kernel void matrix_lane_address(device const float* in [[buffer(0)]],
                                device float* out [[buffer(1)]],
                                uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m;
  simdgroup_load(m, in + (lane & 1u), 8);
  simdgroup_store(m, out, 8);
}

// Half the lanes load twice, then the simdgroup meets at a simd_sum.
kernel void matrix_count_mismatch(device const float* in [[buffer(0)]],
                                  device float* out [[buffer(1)]],
                                  uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m;
  simdgroup_load(m, in, 8);
  if (lane < 16) {
    simdgroup_load(m, in + 64, 8);
  }
  const float s = simd_sum(1.0f);
  simdgroup_store(m, out, 8);
  out[64 + lane] = s;
}

// Lanes past the first 16 return before a multiply-accumulate the others run.
kernel void matrix_after_return(device const float* in [[buffer(0)]],
                                device float* out [[buffer(1)]],
                                uint lane [[thread_index_in_simdgroup]]) {
  if (lane >= 16) {
    return;
  }
  simdgroup_float8x8 a;
  simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_load(a, in, 8);
  simdgroup_multiply_accumulate(acc, a, a, acc);
  simdgroup_store(acc, out, 8);
}

// Each lane writes two elements of a tile (those that another lane then stores), and the
// simdgroup loads the tile with no barrier in between: other lanes' elements may not be written.
kernel void matrix_missing_barrier(device const float* in [[buffer(0)]],
                                   device float* out [[buffer(1)]],
                                   uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float tile[64];
  tile[63u - 2u * lane] = in[63u - 2u * lane];
  tile[62u - 2u * lane] = in[62u - 2u * lane];
  simdgroup_float8x8 m;
  simdgroup_load(m, tile, 8);
  simdgroup_store(m, out, 8);
}
