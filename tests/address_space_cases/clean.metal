#pragma clang fp contract(off)
#ifndef BNB_KERNEL_INSTANTIATE
#define BNB_KERNEL_INSTANTIATE(host, fn, ...) template [[host_name(host)]] [[kernel]] decltype(fn<__VA_ARGS__>) fn<__VA_ARGS__>;
#endif
#include "clean_helpers.h"
#include <metal_atomic>
#pragma clang fp contract(off)  // (again after the system headers, as bnb_common.h does)

template <typename T>
[[kernel]] void everything(
    device const T* A [[buffer(0)]],
    device float* out [[buffer(1)]],
    device atomic_uint* counter [[buffer(2)]],
    device half* mats [[buffer(3)]],
    constant uint& n [[buffer(4)]],
    constant float* scales [[buffer(5)]],
    uint3 gid [[thread_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
    threadgroup float tile[64];
    threadgroup uint partial[4], flags[2];
    threadgroup half mtile[8][8];
    threadgroup atomic_uint local_count;

    float v[4];
    load_run<4>(A, gid.x * 4u, v);
    float acc = first_of(v);
    accumulate(acc, load_as_float(A, gid.x));
    accumulate(acc, deref_sum(A, 2u) + deref_sum(tile, 2u) + deref_sum(v, 2u) + deref_sum(scales, 2u));
    accumulate(acc, table_value(scales, tid) + table_value(kTable, tid) + kTable[tid & 3u]);
    thread float& r = v[1];
    r += 1.0h;
    device float* p = offset_ptr(out, gid.x);
    threadgroup float* t = tile;
    const threadgroup float& tr = tg_ref(tile, tid);
    tile[tid & 63u] = acc + tr + t[0];
    partial[sg & 3u] = as_type<uint>(acc);
    flags[0] = 0u;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    acc += as_type<float>(tg_max(partial, 4u));

    // vectors: constructors, swizzles, conversions
    float4 f4 = float4(acc, v[0], 1.0f, 2u);
    half4 h4 = half4(f4);
    float2 f2 = f4.xy + float2(h4.zw);
    uchar4 bytes = uchar4(0);
    bytes[1] = uchar(n);
    uint2 u2 = as_type<uint2>(f2);
    vec<float, 4> w = vec<float, 4>(f2, f2.yx);
    acc += dot(f4, w) + float(u2.x & 1u) + float(bytes.y) + length(f2);

    // SIMD-group functions, maths
    acc = simd_sum(acc) + simd_max(acc) + simd_shuffle_down(acc, 1) + simd_broadcast(acc, lane);
    acc = metal::precise::divide(1.0f, acc) + metal::precise::exp(acc) + precise::sqrt(precise::fabs(acc));
    acc = metal::precise::clamp(acc, 0.0f, 1.0f) + select(0.0f, 1.0f, isnan(acc)) + fma(acc, acc, acc);
    acc += float(popcount(n)) + numeric_limits<float>::epsilon() + INFINITY * 0.0f;
    Pair pr = {acc, 1.0f};
    acc += pr.sum();

    // simdgroup matrices from device and threadgroup memory
    simdgroup_half8x8 ma;
    simdgroup_load(ma, mats, 8);
    simdgroup_store(ma, &mtile[0][0], 8);
    simdgroup_float8x8 mc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_half8x8 mb;
    simdgroup_load(mb, &mtile[0][0], 8, ulong2(0, 0), true);
    simdgroup_multiply_accumulate(mc, ma, mb, mc);
    simdgroup_store(mc, out, 8);
    acc += mc.thread_elements()[0];

    // atomics in device and threadgroup memory
    if (tid == 0u) {
        atomic_store_explicit(&local_count, 0u, memory_order_relaxed);
    }
    atomic_fetch_add_explicit(&local_count, 1u, memory_order_relaxed);
    uint seen = atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);

    if (gid.x < n) {
        *p = acc + float(seen) + scales[0];
    }
}

BNB_KERNEL_INSTANTIATE("everything_f32", everything, float)
BNB_KERNEL_INSTANTIATE("everything_f16", everything, half)
#if defined(__HAVE_BFLOAT__)
BNB_KERNEL_INSTANTIATE("everything_bf16", everything, bfloat)
#endif
template [[host_name("everything_spelled")]] [[kernel]] decltype(everything<uint>) everything<uint>;

kernel void plain(device float* out [[buffer(0)]], constant float& scale [[buffer(1)]],
                  uint i [[thread_position_in_grid]]) {
    out[i] *= scale;
}
