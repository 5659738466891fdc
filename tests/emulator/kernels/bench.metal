// Kernels timed by scripts/bench_emulator.py.
#include <metal_stdlib>
using namespace metal;

// A 4-bit GEMV in the shape of the project's decode kernel: one simdgroup per output row, each
// thread dequantizes 16 weights per step through 32-bit loads, fp32 accumulation, one simd_sum.
// w: [rows][k/2] bytes (two 4-bit codes per byte, low nibble first), absmax: one per 64 weights,
// code: 16-entry codebook, x: [k] activations, y: [rows].
kernel void gemv_4bit(device const uint* w [[buffer(0)]],
                      device const float* absmax [[buffer(1)]],
                      constant float* code [[buffer(2)]],
                      device const float* x [[buffer(3)]],
                      device float* y [[buffer(4)]],
                      constant uint& k [[buffer(5)]],
                      uint row [[threadgroup_position_in_grid]],
                      uint sg [[simdgroup_index_in_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]],
                      uint sgs [[simdgroups_per_threadgroup]]) {
  uint r = row * sgs + sg;
  float lut[16];
  for (int i = 0; i < 16; ++i) lut[i] = code[i];
  float acc = 0.0f;
  device const uint* wr = w + r * (k / 8);
  for (uint base = lane * 16; base < k; base += 32 * 16) {
    float scale = absmax[(r * k + base) / 64];
    uint4 q = uint4(wr[base / 8], wr[base / 8 + 1], 0, 0);
    float4 x0 = *(device const float4*)(x + base);
    float4 x1 = *(device const float4*)(x + base + 4);
    float4 x2 = *(device const float4*)(x + base + 8);
    float4 x3 = *(device const float4*)(x + base + 12);
    float s = 0.0f;
    s += lut[q.x & 15] * x0.x + lut[(q.x >> 4) & 15] * x0.y + lut[(q.x >> 8) & 15] * x0.z + lut[(q.x >> 12) & 15] * x0.w;
    s += lut[(q.x >> 16) & 15] * x1.x + lut[(q.x >> 20) & 15] * x1.y + lut[(q.x >> 24) & 15] * x1.z + lut[q.x >> 28] * x1.w;
    s += lut[q.y & 15] * x2.x + lut[(q.y >> 4) & 15] * x2.y + lut[(q.y >> 8) & 15] * x2.z + lut[(q.y >> 12) & 15] * x2.w;
    s += lut[(q.y >> 16) & 15] * x3.x + lut[(q.y >> 20) & 15] * x3.y + lut[(q.y >> 24) & 15] * x3.z + lut[q.y >> 28] * x3.w;
    acc += s * scale;
  }
  acc = simd_sum(acc);
  if (lane == 0) y[r] = acc;
}

// `n` threadgroup barriers in a row.
kernel void barriers(device float* out [[buffer(0)]],
                     constant uint& n [[buffer(1)]],
                     uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float t[256];
  t[tid] = float(tid);
  for (uint i = 0; i < n; ++i) threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = t[tid];
}
