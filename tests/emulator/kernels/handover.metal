// Hand-overs between the threadgroups of one dispatch, for the coherence check (docs/emulator.md,
// "Memory model"). Every threadgroup writes its slot of `work`, counts itself in `counter`, and the
// last to count reads every slot. What orders the writes before the reads is chosen by macros:
//   COHERENT   the workspace's qualifier (default coherent(device))
//   RELEASE    0: no release fence; 1: every writing thread; 2: thread 0 only, after the barrier
//   ACQUIRE    0: no acquire fence; 1: every reading thread; 2: thread 0 only, before the barrier
//   BARRIER    0: no barrier between the writes and thread 0's count
#include <metal_stdlib>
using namespace metal;

#ifndef COHERENT
#define COHERENT coherent(device)
#endif
#ifndef RELEASE
#define RELEASE 1
#endif
#ifndef ACQUIRE
#define ACQUIRE 1
#endif
#ifndef BARRIER
#define BARRIER 1
#endif

kernel void handover(COHERENT device float* work [[buffer(0)]],
                     device atomic_uint* counter [[buffer(1)]],
                     device float* out [[buffer(2)]],
                     uint tg [[threadgroup_position_in_grid]],
                     uint tid [[thread_index_in_threadgroup]],
                     uint threads [[threads_per_threadgroup]],
                     uint groups [[threadgroups_per_grid]]) {
    threadgroup uint last[1];
    work[tg * threads + tid] = float(tg * threads + tid);
#if RELEASE == 1
    atomic_thread_fence(mem_flags::mem_device, memory_order_release, thread_scope_device);
#endif
#if BARRIER
    threadgroup_barrier(mem_flags::mem_device);
#endif
    if (tid == 0u) {
#if RELEASE == 2
        atomic_thread_fence(mem_flags::mem_device, memory_order_release, thread_scope_device);
#endif
        const uint seen = atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
#if ACQUIRE == 2
        atomic_thread_fence(mem_flags::mem_device, memory_order_acquire, thread_scope_device);
#endif
        last[0] = seen + 1u == groups ? 1u : 0u;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (last[0] == 0u) {
        return;
    }
#if ACQUIRE == 1
    atomic_thread_fence(mem_flags::mem_device, memory_order_acquire, thread_scope_device);
#endif
    float s = 0.0f;
    for (uint g = 0; g < groups; ++g) {
        s += work[g * threads + tid];
    }
    out[tid] = s;
}

// Each threadgroup reads back only its own slot after writing it: nothing crosses threadgroups.
kernel void own_slot(device float* work [[buffer(0)]],
                     device float* out [[buffer(1)]],
                     uint gid [[thread_position_in_grid]],
                     uint tid [[thread_index_in_threadgroup]],
                     uint tg [[threadgroup_position_in_grid]],
                     uint threads [[threads_per_threadgroup]]) {
    work[gid] = float(gid);
    threadgroup_barrier(mem_flags::mem_device);
    out[gid] = work[tg * threads + (threads - 1u - tid)];
}

// Reads what a previous dispatch wrote (the second of two launches over the same buffers).
kernel void sum_slots(device const float* work [[buffer(0)]],
                      device float* out [[buffer(1)]],
                      constant uint& groups [[buffer(2)]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint threads [[threads_per_threadgroup]]) {
    float s = 0.0f;
    for (uint g = 0; g < groups; ++g) {
        s += work[g * threads + tid];
    }
    out[tid] = s;
}

// The language version the library was compiled at.
kernel void metal_version(device uint* out [[buffer(0)]]) {
    out[0] = __METAL_VERSION__;
}
