// Feature kernels: one construct family each, checked against plain references in
// tests/emulator/test_features.py under every lane order.
#include <metal_stdlib>
using namespace metal;

#ifndef BNB_KERNEL_INSTANTIATE
#define BNB_KERNEL_INSTANTIATE(host, fn, ...) \
  template [[host_name(host)]] [[kernel]] decltype(fn<__VA_ARGS__>) fn<__VA_ARGS__>;
#endif

struct Params {
  uint n;
  float scale;
};

constant float LUT[4] = {0.5f, -1.0f, 2.0f, 0.25f};

// Sizes and alignments of MSL types, as the host sees them in buffers.
kernel void type_sizes(device uint* out [[buffer(0)]]) {
  out[0] = sizeof(float3);
  out[1] = alignof(float3);
  out[2] = sizeof(half3);
  out[3] = sizeof(float2);
  out[4] = sizeof(uchar4);
  out[5] = sizeof(packed_float3);
  out[6] = sizeof(bool3);
  out[7] = sizeof(half);
  out[8] = sizeof(bfloat4);
  out[9] = alignof(float4);
}

// Vector construction, swizzles (read and write), arithmetic, comparisons, select.
kernel void vectors(device const float4* in [[buffer(0)]],
                    device float4* out [[buffer(1)]],
                    uint gid [[thread_position_in_grid]]) {
  float4 v = in[gid];
  float4 r = v.wzyx;                         // 0: reversed
  float4 s = float4(v.xy + v.zw, v.x, 1.0f); // 1: mixed constructor
  float4 t = v;
  t.xz = float2(7.0f, 8.0f);                 // 2: swizzle assignment
  t.y += 1.0f;
  float3 u = v.xyz * 2.0f - 1.0f;            // 3: vector-scalar
  float4 w = select(float4(0.0f), v, v > 0.0f);  // 4: select with a bool4 mask
  float4 c = clamp(v, -0.5f, 0.5f);          // 5
  float4 m = mix(v, r, 0.25f);               // 6
  float4 mm = float4(min(v, r).xy, max(v, r).zw);  // 7
  float d = dot(v, r);
  float4 e = float4(d, length(v.xy), float(all(v > -100.0f)), float(any(v > 100.0f)));  // 8
  uint4 iv = uint4(abs(v) * 10.0f);          // 9: float -> uint conversion, explicit
  float4 back = float4(iv >> 1u);
  out[gid * 10 + 0] = r;
  out[gid * 10 + 1] = s;
  out[gid * 10 + 2] = t;
  out[gid * 10 + 3] = float4(u, 0.0f);
  out[gid * 10 + 4] = w;
  out[gid * 10 + 5] = c;
  out[gid * 10 + 6] = m;
  out[gid * 10 + 7] = mm;
  out[gid * 10 + 8] = e;
  out[gid * 10 + 9] = back;
}

// half and bfloat: conversion (round to nearest even), half arithmetic rounding, h literals.
kernel void half_bfloat(device const float* in [[buffer(0)]],
                        device half* out_h [[buffer(1)]],
                        device bfloat* out_b [[buffer(2)]],
                        device float* out_f [[buffer(3)]],
                        uint gid [[thread_position_in_grid]]) {
  float x = in[gid];
  half h = half(x);
  bfloat b = bfloat(x);
  out_h[gid] = h;
  out_b[gid] = b;
  half p = h * h + 1.5h;                // rounded to half after each operation
  half4 hv = half4(h) * 0.5h;
  out_f[gid * 4 + 0] = float(p);
  out_f[gid * 4 + 1] = float(hv.z);
  out_f[gid * 4 + 2] = float(b) * 2.0f;
  out_f[gid * 4 + 3] = float(bfloat(float(b) + 1.0f));
}

// Float math (precise:: and fast:: spellings too).
kernel void math_fns(device const float* in [[buffer(0)]],
                     device float* out [[buffer(1)]],
                     uint gid [[thread_position_in_grid]]) {
  float x = in[gid];
  float a = fabs(x) + 0.5f;
  device float* o = out + gid * 12;
  o[0] = exp(x);
  o[1] = log(a);
  o[2] = sqrt(a);
  o[3] = precise::divide(1.0f, a);
  o[4] = fract(x);
  o[5] = rint(x * 3.0f);
  o[6] = round(x * 3.0f);
  o[7] = floor(x);
  o[8] = fast::exp2(x);
  o[9] = fma(x, 2.0f, 1.0f);
  o[10] = pow(a, 1.5f);
  o[11] = metal::precise::sqrt(a) * LUT[gid % 4];
}

// Integer functions and as_type.
kernel void int_fns(device const uint* in [[buffer(0)]],
                    device uint* out [[buffer(1)]],
                    uint gid [[thread_position_in_grid]]) {
  uint x = in[gid];
  device uint* o = out + gid * 12;
  o[0] = popcount(x);
  o[1] = clz(x);
  o[2] = ctz(x);
  o[3] = extract_bits(x, 4u, 8u);
  o[4] = insert_bits(x, 0x5u, 8u, 4u);
  o[5] = reverse_bits(x);
  o[6] = rotate(x, 7u);
  o[7] = mulhi(x, 0x9E3779B9u);
  o[8] = absdiff(x, 0x80000000u);
  o[9] = addsat(x, 0x80000000u);
  uchar4 bytes = as_type<uchar4>(x);
  o[10] = uint(bytes.x) + (uint(bytes.w) << 8);
  o[11] = as_type<uint>(float(x & 0xFFFFu));
}

// SIMD-group functions over a threadgroup of 48 threads: one full and one partial simdgroup.
kernel void simd_fns(device const float* in [[buffer(0)]],
                     device const uint* bits [[buffer(1)]],
                     device float* out [[buffer(2)]],
                     device uint* uout [[buffer(3)]],
                     uint gid [[thread_position_in_grid]],
                     uint lane [[thread_index_in_simdgroup]]) {
  float x = in[gid];
  uint b = bits[gid];
  device float* o = out + gid * 12;
  o[0] = simd_sum(x);
  o[1] = simd_min(x);
  o[2] = simd_max(x);
  o[3] = simd_prefix_inclusive_sum(x);
  o[4] = simd_prefix_exclusive_sum(x);
  o[5] = simd_shuffle(x, ushort((lane + 5) % 32));
  o[6] = simd_shuffle_down(x, ushort(3));
  o[7] = simd_shuffle_up(x, ushort(2));
  o[8] = simd_shuffle_xor(x, ushort(1));
  o[9] = simd_broadcast(x, ushort(7));
  o[10] = simd_broadcast_first(x);
  o[11] = simd_product(x > 0.0f ? 1.0f : -1.0f);
  device uint* u = uout + gid * 8;
  u[0] = simd_and(b);
  u[1] = simd_or(b);
  u[2] = simd_xor(b);
  u[3] = uint(ulong(simd_ballot(x > 0.0f)));
  u[4] = uint(simd_any(x > 2.0f));
  u[5] = uint(simd_all(x > -100.0f));
  u[6] = uint(simd_is_first());
  float4 v = float4(x, 1.0f, 2.0f * x, float(lane));
  float4 vs = simd_sum(v);  // vector operands
  u[7] = uint(vs.y);
}

// Threadgroup memory: a tree reduction with barriers and a 2D tile transpose.
kernel void tg_reduce(device const float* in [[buffer(0)]],
                      device float* sums [[buffer(1)]],
                      device float* transposed [[buffer(2)]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint2 tpos [[thread_position_in_threadgroup]],
                      uint group [[threadgroup_position_in_grid]]) {
  threadgroup float partial[256];
  threadgroup float tile[16][17];
  float x = in[group * 256 + tid];
  partial[tid] = x;
  tile[tpos.y][tpos.x] = x;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = 128; stride > 0; stride /= 2) {
    if (tid < stride) partial[tid] += partial[tid + stride];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (tid == 0) sums[group] = partial[0];
  transposed[group * 256 + tpos.x * 16 + tpos.y] = tile[tpos.y][tpos.x];
}

// simdgroup_matrix: C (8x8) = A (8x16) * B (16x8) through threadgroup memory, one simdgroup.
kernel void sg_matmul(device const float* a [[buffer(0)]],
                      device const float* b [[buffer(1)]],
                      device float* c [[buffer(2)]],
                      uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float ta[8 * 16];
  threadgroup float tb[16 * 8];
  threadgroup float tc[8 * 8];
  for (uint i = tid; i < 128; i += 32) {
    ta[i] = a[i];
    tb[i] = b[i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (uint k = 0; k < 16; k += 8) {
    simdgroup_float8x8 ma, mb;
    simdgroup_load(ma, ta, 16, ulong2(k, 0));
    simdgroup_load(mb, tb, 8, ulong2(0, k));
    simdgroup_multiply_accumulate(acc, ma, mb, acc);
  }
  simdgroup_store(acc, tc, 8);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = tid; i < 64; i += 32) c[i] = tc[i];
}

// Atomics: a histogram in threadgroup memory, merged into device memory.
kernel void histogram(device const uint* values [[buffer(0)]],
                      device atomic_uint* hist [[buffer(1)]],
                      constant uint& n [[buffer(2)]],
                      uint gid [[thread_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint tgsize [[threads_per_threadgroup]]) {
  threadgroup atomic_uint local[16];
  for (uint i = tid; i < 16; i += tgsize) atomic_store_explicit(&local[i], 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (gid < n) atomic_fetch_add_explicit(&local[values[gid] % 16], 1u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = tid; i < 16; i += tgsize)
    atomic_fetch_add_explicit(&hist[i], atomic_load_explicit(&local[i], memory_order_relaxed), memory_order_relaxed);
}

// Weak compare-exchange: one try per lane on a cell of its own (no other lane touches it, so only a
// spurious failure fails it), then a retry loop on a shared counter.
kernel void cas_weak(device atomic_uint* cells [[buffer(0)]],
                     device uint* tries [[buffer(1)]],
                     device atomic_uint* counter [[buffer(2)]],
                     uint gid [[thread_position_in_grid]]) {
  uint expected = 0u;
  const bool ok = atomic_compare_exchange_weak_explicit(&cells[gid], &expected, gid + 1u, memory_order_relaxed,
                                                        memory_order_relaxed);
  tries[2u * gid] = ok ? 1u : 0u;
  tries[2u * gid + 1u] = expected;
  uint seen = atomic_load_explicit(counter, memory_order_relaxed);
  while (!atomic_compare_exchange_weak_explicit(counter, &seen, seen + 1u, memory_order_relaxed,
                                                memory_order_relaxed)) {
  }
}

// A hand-over between threadgroups through device memory: each threadgroup's 64 threads write their
// element of `data`, thread 0 counts the threadgroup in, and the threadgroup that counts last copies
// all of `data` to `seen`. `ordered`: a device-memory barrier orders the threadgroup's writes before
// its count (as the split-K kernel does); without it thread 0 may count before the others wrote.
kernel void hand_over(device uint* data [[buffer(0)]],
                      device atomic_uint* count [[buffer(1)]],
                      device uint* seen [[buffer(2)]],
                      constant uint& ordered [[buffer(3)]],
                      uint tg [[threadgroup_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint groups [[threadgroups_per_grid]]) {
  threadgroup uint last[1];
  data[tg * 64u + tid] = tg * 64u + tid + 1u;
  if (ordered != 0u) {
    threadgroup_barrier(mem_flags::mem_device);
  }
  if (tid == 0u) {
    last[0] = atomic_fetch_add_explicit(count, 1u, memory_order_relaxed) + 1u == groups ? 1u : 0u;
  }
  threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
  if (last[0] != 0u) {
    for (uint i = tid; i < groups * 64u; i += 64u) {
      seen[i] = data[i];
    }
  }
}

// Position attributes in 3D, for dispatches by threadgroups and by threads (edge groups).
kernel void positions(device uint* out [[buffer(0)]],
                      uint3 gpos [[thread_position_in_grid]],
                      uint3 tpos [[thread_position_in_threadgroup]],
                      uint3 group [[threadgroup_position_in_grid]],
                      uint3 tsize [[threads_per_threadgroup]],
                      uint3 grid_threads [[threads_per_grid]],
                      ushort tindex [[thread_index_in_threadgroup]]) {
  uint linear = gpos.x + grid_threads.x * (gpos.y + grid_threads.y * gpos.z);
  device uint* o = out + linear * 8;
  o[0] = gpos.x + 1;
  o[1] = gpos.y;
  o[2] = gpos.z;
  o[3] = group.x + 100 * group.y + 10000 * group.z;
  o[4] = tpos.x + 100 * tpos.y + 10000 * tpos.z;
  o[5] = tsize.x + 100 * tsize.y + 10000 * tsize.z;
  o[6] = tindex;
  o[7] = grid_threads.x + 100 * grid_threads.y + 10000 * grid_threads.z;
}

// A constant struct argument.
kernel void with_params(device float* x [[buffer(0)]],
                        constant Params& p [[buffer(1)]],
                        uint gid [[thread_position_in_grid]]) {
  if (gid < p.n) x[gid] = x[gid] * p.scale;
}

// Template kernels, registered through the project macro and through Metal's own syntax.
template <typename T>
kernel void scale_by(device T* x [[buffer(0)]],
                     constant float& s [[buffer(1)]],
                     uint gid [[thread_position_in_grid]]) {
  x[gid] = T(float(x[gid]) * s);
}
BNB_KERNEL_INSTANTIATE("scale_by_f32", scale_by, float)
template [[host_name("scale_by_f16")]] [[kernel]] void scale_by<half>(device half* x [[buffer(0)]],
                                                                      constant float& s [[buffer(1)]],
                                                                      uint gid [[thread_position_in_grid]]);

// simdgroup_matrix in each form the emulator keeps a matrix in (csrc/emu/include/bnb_emu/sync.h):
// loaded plain and transposed (half), a product's result (each lane holds its share) used as the
// left operand of another product (completed from the lanes' shares), a default-constructed
// accumulator (zero), stores plain and transposed to device memory. One simdgroup of 32 threads,
// or fewer (a partial simdgroup, whose lanes also own the missing lanes' shares).
//   d = A * B^T, e = (A * B^T) * C stored transposed, z = a default-constructed matrix.
kernel void sg_matrix_forms(device const half* a [[buffer(0)]],
                            device const half* b [[buffer(1)]],
                            device const float* c [[buffer(2)]],
                            device float* d_out [[buffer(3)]],
                            device float* e_out [[buffer(4)]],
                            device float* z_out [[buffer(5)]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint threads [[threads_per_threadgroup]]) {
  threadgroup half ta[64];
  threadgroup half tb[64];
  threadgroup float tc[64];
  for (uint i = tid; i < 64; i += threads) {
    ta[i] = a[i];
    tb[i] = b[i];
    tc[i] = c[i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_half8x8 ma;
  simdgroup_half8x8 mb;
  simdgroup_float8x8 mc;
  simdgroup_float8x8 d;
  simdgroup_float8x8 e;
  simdgroup_float8x8 z;
  simdgroup_load(ma, ta, 8);
  simdgroup_load(mb, tb, 8, ulong2(0, 0), true);
  simdgroup_load(mc, tc, 8);
  simdgroup_multiply(d, ma, mb);
  simdgroup_multiply_accumulate(e, d, mc, z);
  simdgroup_store(d, d_out, 8);
  simdgroup_store(e, e_out, 8, ulong2(0, 0), true);
  simdgroup_store(z, z_out, 8);
}

// simdgroup_matrix arithmetic as Apple GPUs do it: products accumulate with fused multiply-adds
// (d = a * b + c rounds once per k), and thread_elements() gives each thread two elements of a
// matrix, the same two of every matrix, for elementwise arithmetic. One simdgroup of 32 threads.
//   fused = A * B + C; sums = A * B + 2 C (elementwise through thread_elements);
//   prod = (C^T + 1) * B (a matrix loaded transposed, changed elementwise, then a product's operand).
kernel void sg_fma_elements(device const float* a [[buffer(0)]],
                            device const float* b [[buffer(1)]],
                            device const float* c [[buffer(2)]],
                            device float* fused [[buffer(3)]],
                            device float* sums [[buffer(4)]],
                            device float* prod [[buffer(5)]]) {
  simdgroup_float8x8 ma;
  simdgroup_float8x8 mb;
  simdgroup_float8x8 mc;
  simdgroup_float8x8 mt;
  simdgroup_float8x8 d;
  simdgroup_load(ma, a, 8);
  simdgroup_load(mb, b, 8);
  simdgroup_load(mc, c, 8);
  simdgroup_load(mt, c, 8, ulong2(0, 0), true);
  simdgroup_multiply_accumulate(d, ma, mb, mc);
  simdgroup_store(d, fused, 8);
  simdgroup_multiply(d, ma, mb);
  thread float2& e = d.thread_elements();
  e = e + mc.thread_elements() * 2.0f;
  simdgroup_store(d, sums, 8);
  thread float2& t = mt.thread_elements();
  t = t + float2(1.0f);
  simdgroup_multiply(d, mt, mb);
  simdgroup_store(d, prod, 8);
}
