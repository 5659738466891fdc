// 8-bit blockwise quantization with a 256-entry code (docs/semantics.md section 2).
#pragma once

#include "bnb_common.h"
#include "quantize_layout.h"

// Index of the code nearest to s: the number of thresholds t_k = fl32(code[k] + code[k+1]) / 2
// strictly below s, an exact tie going to the even index of {k, k+1}; NaN gives 0.
// `thresholds` holds t_0..t_254 (ascending). Branch-free binary search: 8 steps.
inline uint bnb_code_index(float s, threadgroup const float* thresholds) {
    if (bnb_is_nan(s)) {
        return 0u;
    }
    uint pos = 0u;
    for (uint step = 128u; step > 0u; step >>= 1) {
        // pos + step - 1 <= 254 at every step (the steps sum to 255).
        pos += thresholds[pos + step - 1u] < s ? step : 0u;
    }
    if (pos < 255u && thresholds[pos] == s && (pos & 1u) != 0u) {
        pos += 1u;
    }
    return pos;
}

// Fills thresholds[0..254] from code; the caller adds the barrier.
inline void bnb_load_thresholds(const device float* code, threadgroup float* thresholds, uint tid, uint threads) {
    for (uint k = tid; k < 255u; k += threads) {
        thresholds[k] = (code[k] + code[k + 1u]) * 0.5f;
    }
}

// quantize_blockwise: out[i] = index of A[i] / absmax[block], absmax[block] = max |A| over the block.
// Launch: BNB_QUANT_THREADS(BLOCKSIZE) threads per threadgroup, min(ceil(n / E), G) threadgroups
// (1-D) with E = BNB_QUANT_TG_ELEMS(BLOCKSIZE) and any G >= 1: threadgroup t quantizes the
// E-element chunks t, t + G, t + 2G, ... The 255 thresholds are built once per threadgroup, so a
// bounded grid builds them a bounded number of times however large the tensor.
template <typename T, uint BLOCKSIZE>
[[kernel]] void bnb_quantize_blockwise(
    device const T* A [[buffer(0)]],
    device const float* code [[buffer(1)]],
    device uchar* out [[buffer(2)]],
    device float* absmax [[buffer(3)]],
    constant uint& n [[buffer(4)]],
    uint tg [[threadgroup_position_in_grid]],
    uint groups [[threadgroups_per_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
    constexpr uint PER_LANE = BNB_SG_ELEMS(BLOCKSIZE) / 32u;
    threadgroup float thresholds[256];
    threadgroup uint partial[BNB_MAX_SIMDS_PER_BLOCK];

    bnb_load_thresholds(code, thresholds, tid, BNB_QUANT_THREADS(BLOCKSIZE));
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const uint chunks = n / BNB_QUANT_TG_ELEMS(BLOCKSIZE) + (n % BNB_QUANT_TG_ELEMS(BLOCKSIZE) != 0u ? 1u : 0u);
    for (uint chunk = tg; chunk < chunks; chunk += groups) {  // uniform over the threadgroup
        const uint start = bnb_slice_start<BLOCKSIZE>(chunk, sg);
        const uint first = start + lane * PER_LANE;  // this lane's run of PER_LANE elements
        float v[PER_LANE];
        bnb_load_run<PER_LANE>(A, first, n, v);
        uint bits = 0u;
        for (uint i = 0; i < PER_LANE; ++i) {
            bits = max(bits, bnb_abs_bits(v[i]));
        }
        bits = bnb_block_max_bits<BLOCKSIZE>(bits, 0u, lane, sg, partial);

        const float amax = as_type<float>(bits);
        // Precise reciprocal, then a float32 product: the codes must not depend on fast-math.
        const bnb_recip rc = bnb_block_recip(bits);
        const uint block = start / BLOCKSIZE;
        if (lane == 0u && start % BLOCKSIZE == 0u && block < bnb_num_blocks<BLOCKSIZE>(n)) {
            absmax[block] = amax;
        }
        uint q[PER_LANE];
        for (uint i = 0; i < PER_LANE; ++i) {
            // An all-zero block gets index 0 explicitly (0 * inf = NaN would give it too, but
            // not under every math mode).
            q[i] = bits == 0u ? 0u : bnb_code_index(bnb_scaled(v[i], rc), thresholds);
        }
        bnb_store_bytes<PER_LANE>(out, first, n, q);
        if (BNB_SIMDS_PER_BLOCK(BLOCKSIZE) > 1u) {
            threadgroup_barrier(mem_flags::mem_threadgroup);  // `partial` is reused by the next chunk
        }
    }
}

// dequantize_blockwise: out[i] = T(code[A[i]] * absmax[i >> blocksize_log2]) (blocksizes are
// powers of two: a shift, not a division, per element).
// Launch: 256 threads per threadgroup, ceil(n / 2048) threadgroups (1-D); each thread handles a
// run of 8 consecutive elements (two 4-byte loads, two 4-element stores when all are in range).
#define BNB_DEQUANT8_THREADS 256u
#define BNB_DEQUANT8_PER_THREAD 8u

template <typename T>
[[kernel]] void bnb_dequantize_blockwise(
    device const uchar* A [[buffer(0)]],
    device const float* code [[buffer(1)]],
    device const float* absmax [[buffer(2)]],
    device T* out [[buffer(3)]],
    constant uint& n [[buffer(4)]],
    constant uint& blocksize_log2 [[buffer(5)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]]) {
    threadgroup float lut[256];
    for (uint k = tid; k < 256u; k += BNB_DEQUANT8_THREADS) {
        lut[k] = code[k];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const uint first = (tg * BNB_DEQUANT8_THREADS + tid) * BNB_DEQUANT8_PER_THREAD;
    if (first >= n) {
        return;
    }
    uint q[BNB_DEQUANT8_PER_THREAD];
    if (first + BNB_DEQUANT8_PER_THREAD <= n) {
        const uchar4 lo = *reinterpret_cast<const device uchar4*>(A + first);
        const uchar4 hi = *reinterpret_cast<const device uchar4*>(A + first + 4u);
        for (uint k = 0; k < 4u; ++k) {
            q[k] = lo[k];
            q[k + 4u] = hi[k];
        }
    } else {
        for (uint k = 0; k < BNB_DEQUANT8_PER_THREAD; ++k) {
            q[k] = first + k < n ? A[first + k] : 0u;
        }
    }
    float v[BNB_DEQUANT8_PER_THREAD];
    for (uint k = 0; k < BNB_DEQUANT8_PER_THREAD; ++k) {
        v[k] = lut[q[k]] * absmax[min(first + k, n - 1u) >> blocksize_log2];
    }
    bnb_store_run8(out, first, n, v);
}
