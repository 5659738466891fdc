// LLM.int8() quantization kernels (docs/semantics.md section 6): row-wise int8 quantization with outlier
// columns, the column statistics of int8_double_quant, and the element-wise dequantizations.
// The int8 matrix products are in int8_matmul.h. Launch geometry and buffers: int8.metal.
#pragma once

#include "bnb_common.h"

// fl32(1 / 127) and fl32(1 / 16129) (the float32 nearest to each quotient), as bit patterns so
// that no compiler setting can change them.
#define BNB_INT8_INV127 as_type<float>(0x3c010204u)
#define BNB_INT8_INV16129 as_type<float>(0x38820610u)

// Threads per threadgroup of the row kernels are a multiple of 32 up to this (the op layer picks
// 32, 64, 128 or 256 from the row length); one slot per simdgroup for the row maximum.
#define BNB_INT8_MAX_SIMDS 8

// Rows of A one threadgroup of the double-quant statistics kernel covers.
#define BNB_INT8_STATS_ROWS 32u

// round_half_even(v) clamped to [-127, 127]. NaN gives 0: v = x * 127 / max is NaN for a NaN x,
// for 0 * inf (a row whose max is 0) and for inf * 0 (an infinite x in a row whose max is inf).
inline int bnb_int8_round(float v) {
    if (bnb_is_nan(v)) {
        return 0;
    }
    return int(metal::precise::clamp(metal::precise::rint(v), -127.0f, 127.0f));
}

// A row's scale fl32(127 * fl32(1 / max)) (docs/semantics.md section 6: CUDA's row kernel scales by
// __fdividef(127, max), 127 times an approximate reciprocal; this is that product with the IEEE
// reciprocal), and fl32(127 / max) for max above 2^126, where 1 / max would be a float32 subnormal
// (flushed on Apple GPUs); max is a non-negative float given by its bit pattern (inf gives 0). A max
// of 0 (a row of zeros) gives 0 instead of inf: its codes are then 0 from 0 * 0, not from
// 0 * inf = NaN, which fast math need not keep.
inline float bnb_int8_scale(uint max_bits) {
    const float m = as_type<float>(max_bits);
    if (max_bits == 0u) {
        return 0.0f;
    }
    return max_bits > 0x7e800000u ? metal::precise::divide(127.0f, m) : 127.0f * metal::precise::divide(1.0f, m);
}

// A column's maximum as bit pattern: |x| with NaN kept (as the canonical quiet NaN, whose pattern is
// above every number's, so that an integer max propagates it as torch's amax does) and float32
// subnormals as 0.
inline uint bnb_int8_col_bits(float x) {
    return bnb_is_nan(x) ? 0x7fc00000u : bnb_abs_bits(x);
}

// A column code of int8_double_quant, as bitsandbytes' CUDA backend computes it with torch ops in
// A's dtype T: round_half_even(float(T(x * 127)) / col_max), IEEE division. NaN (a NaN x, a NaN
// column, 0 / 0) gives 0; an infinite quotient (x * 127 beyond T's range) is clamped to +-127. A zero,
// float32-subnormal (a zero on Apple GPUs, docs/semantics.md section 7) or NaN x gives 0 whatever the
// column's maximum, decided on the bit pattern.
template <typename T>
inline int bnb_int8_col_code(float x, float col_max) {
    if (bnb_abs_bits(x) == 0u) {
        return 0;
    }
    return bnb_int8_round(metal::precise::divide(float(T(x * 127.0f)), col_max));
}

// |x| >= threshold for outlier detection. `threshold_bits` is the bit pattern of the smallest
// float32 >= the caller's threshold (> 0), so that for every float32 x this is exactly the real
// comparison |x| >= threshold; comparing bit patterns of non-negative floats orders them like
// the values, and NaN (bnb_abs_bits gives 0) is never an outlier.
inline bool bnb_int8_is_outlier(float x, uint threshold_bits) {
    return bnb_abs_bits(x) >= threshold_bits;
}

// Elements c .. c + 3 of a row as float: a vector load when `aligned4` (the row length is a multiple
// of 4, so every row starts 4-element aligned), else scalar loads, 0 past `cols`.
template <typename T>
inline float4 bnb_int8_load4(device const T* row, uint c, uint cols, bool aligned4) {
    float4 v = float4(0.0f);
    if (aligned4) {
        const vec<T, 4> x = *reinterpret_cast<device const vec<T, 4>*>(row + c);
        for (uint k = 0; k < 4u; ++k) {
            v[k] = float(x[k]);
        }
    } else {
        for (uint k = 0; k < 4u; ++k) {
            v[k] = c + k < cols ? float(row[c + k]) : 0.0f;
        }
    }
    return v;
}

// row[c .. c + 3] = q (the elements below cols): one char4 store when `aligned4`.
inline void bnb_int8_store4(device char* row, uint c, uint cols, bool aligned4, int4 q) {
    if (aligned4) {
        *reinterpret_cast<device char4*>(row + c) = char4(q);
    } else {
        for (uint k = 0; k < 4u; ++k) {
            if (c + k < cols) {
                row[c + k] = char(q[k]);
            }
        }
    }
}

// Marks column c as holding an outlier: bit c % 32 of word c / 32 (rare; relaxed atomics).
inline void bnb_int8_flag_column(device atomic_uint* flags, uint c) {
    atomic_fetch_or_explicit(&flags[c >> 5], 1u << (c & 31u), memory_order_relaxed);
}

// The maximum of `bits` over the threadgroup (every thread gets it). Every thread must call it.
inline uint bnb_int8_threadgroup_max(uint bits, uint lane, uint sg, uint simds, threadgroup uint* partial) {
    const uint m = simd_max(bits);
    if (lane == 0u) {
        partial[sg] = m;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    uint result = 0u;
    for (uint s = 0; s < simds; ++s) {
        result = max(result, partial[s]);
    }
    return result;
}

// One row of int8_vectorwise_quant, by the whole threadgroup: row_stats[row] = max |A| over the
// row's non-outliers; CA = round_half_even(A * bnb_int8_scale(max)) clamped, outliers 0. With
// OUTLIERS, outlier columns are flagged in `flags` (zeroing the other rows of those columns is
// left to bnb_int8_outlier_finish, which runs once every row is done).
template <typename T, bool OUTLIERS>
inline void bnb_int8_quant_row(device const T* A, device char* CA, device float* row_stats, device atomic_uint* flags,
                               uint cols, uint threshold_bits, uint row, uint tid, uint threads, uint lane, uint sg,
                               threadgroup uint* partial) {
    const bool aligned4 = (cols & 3u) == 0u;
    const uint chunks = (cols + 3u) / 4u;
    device const T* a = A + row * cols;
    device char* ca = CA + row * cols;

    uint bits = 0u;
    for (uint j = tid; j < chunks; j += threads) {
        const float4 x = bnb_int8_load4(a, 4u * j, cols, aligned4);
        for (uint k = 0; k < 4u; ++k) {
            if (OUTLIERS && bnb_int8_is_outlier(x[k], threshold_bits)) {
                bnb_int8_flag_column(flags, 4u * j + k);  // past-the-end elements load as 0: never outliers
            } else {
                bits = max(bits, bnb_abs_bits(x[k]));
            }
        }
    }
    const uint amax = bnb_int8_threadgroup_max(bits, lane, sg, threads / 32u, partial);
    if (tid == 0u) {
        row_stats[row] = as_type<float>(amax);
    }
    const float scale = bnb_int8_scale(amax);
    for (uint j = tid; j < chunks; j += threads) {
        const float4 x = bnb_int8_load4(a, 4u * j, cols, aligned4);
        int4 q;
        for (uint k = 0; k < 4u; ++k) {
            const bool out = OUTLIERS && bnb_int8_is_outlier(x[k], threshold_bits);
            q[k] = out ? 0 : bnb_int8_round(x[k] * scale);
        }
        bnb_int8_store4(ca, 4u * j, cols, aligned4, q);
    }
}

// int8_vectorwise_quant without outliers: one threadgroup per row.
template <typename T>
[[kernel]] void bnb_int8_vectorwise_quant(
    device const T* A [[buffer(0)]],
    device char* CA [[buffer(1)]],
    device float* row_stats [[buffer(2)]],
    constant uint& cols [[buffer(3)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint threads [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
    threadgroup uint partial[BNB_INT8_MAX_SIMDS];
    bnb_int8_quant_row<T, false>(A, CA, row_stats, nullptr, cols, 0u, row, tid, threads, lane, sg, partial);
}

// int8_vectorwise_quant with a threshold: one threadgroup per row; outlier columns flagged.
template <typename T>
[[kernel]] void bnb_int8_vectorwise_quant_outliers(
    device const T* A [[buffer(0)]],
    device char* CA [[buffer(1)]],
    device float* row_stats [[buffer(2)]],
    constant uint& cols [[buffer(3)]],
    device atomic_uint* flags [[buffer(4)]],
    constant uint& threshold_bits [[buffer(5)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint threads [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
    threadgroup uint partial[BNB_INT8_MAX_SIMDS];
    bnb_int8_quant_row<T, true>(A, CA, row_stats, flags, cols, threshold_bits, row, tid, threads, lane, sg, partial);
}

// After the outlier flags are complete: threadgroup 0 turns the flag words into the ascending
// list of flagged columns (int64) and its length; threadgroups 1.. zero the flagged columns of
// CA in rows 0 .. zero_rows - 1 (one thread per row and flag word).
//
// The list has a data-dependent length. Its buffer has the capacity of every column and the
// count goes to `count`; the op layer reads that one number after everything is enqueued and
// returns a view of the first `count` entries (see bnb_mps/ops/int8.py).
#define BNB_INT8_FINISH_THREADS 256u

[[kernel]] void bnb_int8_outlier_finish(
    device const uint* flags [[buffer(0)]],
    device char* CA [[buffer(1)]],
    device long* outlier_cols [[buffer(2)]],
    device uint* count [[buffer(3)]],
    constant uint& cols [[buffer(4)]],
    constant uint& zero_rows [[buffer(5)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
    threadgroup uint sg_totals[BNB_INT8_FINISH_THREADS / 32u];
    const uint words = (cols + 31u) / 32u;
    if (tg > 0u) {
        const uint id = (tg - 1u) * BNB_INT8_FINISH_THREADS + tid;
        const uint row = id / max(words, 1u);
        const uint w = id - row * words;
        if (row < zero_rows) {
            uint bits = flags[w];
            while (bits != 0u) {
                CA[row * cols + w * 32u + ctz(bits)] = 0;
                bits &= bits - 1u;
            }
        }
        return;
    }
    // Threadgroup 0: each thread takes a contiguous run of words, so runs (and the indices within
    // them) come out in ascending order; an exclusive prefix sum of the runs' counts places them.
    const uint per = (words + BNB_INT8_FINISH_THREADS - 1u) / BNB_INT8_FINISH_THREADS;
    const uint w0 = min(tid * per, words);
    const uint w1 = min(w0 + per, words);
    uint mine = 0u;
    for (uint w = w0; w < w1; ++w) {
        mine += popcount(flags[w]);
    }
    const uint before_in_sg = simd_prefix_exclusive_sum(mine);
    if (lane == 31u) {
        sg_totals[sg] = before_in_sg + mine;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    uint offset = before_in_sg;
    uint total = 0u;
    for (uint s = 0; s < BNB_INT8_FINISH_THREADS / 32u; ++s) {
        offset += s < sg ? sg_totals[s] : 0u;
        total += sg_totals[s];
    }
    for (uint w = w0; w < w1; ++w) {
        uint bits = flags[w];
        while (bits != 0u) {
            outlier_cols[offset] = long(w * 32u + ctz(bits));
            offset += 1u;
            bits &= bits - 1u;
        }
    }
    if (tid == 0u) {
        count[0] = total;
    }
}

// int8_double_quant, pass 1 (statistics): threadgroup g covers rows 32g .. 32g + 31 and every
// column. Row maxima over non-outliers (NaN ignored) are complete within the threadgroup and written
// directly; column maxima (NaN propagated) are partial (32 rows) and meet in col_stats through atomic
// max on the float bit patterns (non-negative floats order like their bits), so col_stats must start
// at 0.
template <typename T, bool OUTLIERS>
inline void bnb_int8_stats_rows(device const T* A, device float* row_stats, device atomic_uint* col_bits,
                                device atomic_uint* flags, uint rows, uint cols, uint threshold_bits, uint tg,
                                uint tid, uint threads, uint lane, uint sg, threadgroup uint* partial) {
    const bool aligned4 = (cols & 3u) == 0u;
    const uint chunks = (cols + 3u) / 4u;
    const uint r0 = tg * BNB_INT8_STATS_ROWS;
    const uint nrows = min(BNB_INT8_STATS_ROWS, rows - r0);
    uint rmax[BNB_INT8_STATS_ROWS];
    for (uint r = 0; r < BNB_INT8_STATS_ROWS; ++r) {
        rmax[r] = 0u;
    }
    for (uint j = tid; j < chunks; j += threads) {
        uint4 cmax = uint4(0u);
        for (uint r = 0; r < nrows; ++r) {
            const float4 x = bnb_int8_load4(A + (r0 + r) * cols, 4u * j, cols, aligned4);
            for (uint k = 0; k < 4u; ++k) {
                if (OUTLIERS && bnb_int8_is_outlier(x[k], threshold_bits)) {
                    bnb_int8_flag_column(flags, 4u * j + k);
                } else {
                    rmax[r] = max(rmax[r], bnb_abs_bits(x[k]));
                    cmax[k] = max(cmax[k], bnb_int8_col_bits(x[k]));
                }
            }
        }
        for (uint k = 0; k < 4u; ++k) {
            if (cmax[k] != 0u) {  // col_stats starts at 0: a 0 changes nothing
                atomic_fetch_max_explicit(&col_bits[4u * j + k], cmax[k], memory_order_relaxed);
            }
        }
    }
    // partial[s * 32 + r]: simdgroup s's maximum of row r.
    for (uint r = 0; r < BNB_INT8_STATS_ROWS; ++r) {
        const uint m = simd_max(rmax[r]);
        if (lane == 0u) {
            partial[sg * BNB_INT8_STATS_ROWS + r] = m;
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid < nrows) {
        uint m = 0u;
        for (uint s = 0; s < threads / 32u; ++s) {
            m = max(m, partial[s * BNB_INT8_STATS_ROWS + tid]);
        }
        row_stats[r0 + tid] = as_type<float>(m);
    }
}

template <typename T>
[[kernel]] void bnb_int8_double_quant_stats(
    device const T* A [[buffer(0)]],
    device float* row_stats [[buffer(1)]],
    device atomic_uint* col_bits [[buffer(2)]],
    constant uint& rows [[buffer(3)]],
    constant uint& cols [[buffer(4)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint threads [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
    threadgroup uint partial[BNB_INT8_MAX_SIMDS * 32];
    bnb_int8_stats_rows<T, false>(A, row_stats, col_bits, nullptr, rows, cols, 0u, tg, tid, threads, lane, sg, partial);
}

template <typename T>
[[kernel]] void bnb_int8_double_quant_stats_outliers(
    device const T* A [[buffer(0)]],
    device float* row_stats [[buffer(1)]],
    device atomic_uint* col_bits [[buffer(2)]],
    constant uint& rows [[buffer(3)]],
    constant uint& cols [[buffer(4)]],
    device atomic_uint* flags [[buffer(5)]],
    constant uint& threshold_bits [[buffer(6)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint threads [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
    threadgroup uint partial[BNB_INT8_MAX_SIMDS * 32];
    bnb_int8_stats_rows<T, true>(A, row_stats, col_bits, flags, rows, cols, threshold_bits, tg, tid, threads, lane, sg,
                                 partial);
}

// int8_double_quant, pass 2 (apply), element-wise: thread (x, row) takes columns 4x .. 4x + 3.
//   CA  = round(A * bnb_int8_scale(row_stats[row])), 0 for outliers and (zero_cols != 0) for every
//         element of a flagged column;
//   CAt = bnb_int8_col_code<T>(A, col_stats[col]), 0 for outliers.
// Without OUTLIERS, flags / threshold_bits / zero_cols are not read.
template <typename T, bool OUTLIERS>
inline void bnb_int8_apply_chunk(device const T* A, device const float* row_stats, device const float* col_stats,
                                 device char* CA, device char* CAt, device const uint* flags, uint cols,
                                 uint threshold_bits, uint zero_cols, uint row, uint c) {
    const bool aligned4 = (cols & 3u) == 0u;
    const float4 x = bnb_int8_load4(A + row * cols, c, cols, aligned4);
    const float rscale = bnb_int8_scale(as_type<uint>(row_stats[row]));
    int4 q, qt;
    for (uint k = 0; k < 4u; ++k) {
        const uint col = min(c + k, cols - 1u);  // past-the-end lanes compute a value never stored
        const bool out = OUTLIERS && bnb_int8_is_outlier(x[k], threshold_bits);
        const bool flagged = OUTLIERS && zero_cols != 0u && ((flags[col >> 5] >> (col & 31u)) & 1u) != 0u;
        q[k] = out || flagged ? 0 : bnb_int8_round(x[k] * rscale);
        qt[k] = out ? 0 : bnb_int8_col_code<T>(x[k], col_stats[col]);
    }
    bnb_int8_store4(CA + row * cols, c, cols, aligned4, q);
    bnb_int8_store4(CAt + row * cols, c, cols, aligned4, qt);
}

template <typename T>
[[kernel]] void bnb_int8_double_quant_apply(
    device const T* A [[buffer(0)]],
    device const float* row_stats [[buffer(1)]],
    device const float* col_stats [[buffer(2)]],
    device char* CA [[buffer(3)]],
    device char* CAt [[buffer(4)]],
    constant uint& cols [[buffer(5)]],
    uint2 pos [[thread_position_in_grid]]) {
    const uint c = 4u * pos.x;
    if (c >= cols) {
        return;
    }
    bnb_int8_apply_chunk<T, false>(A, row_stats, col_stats, CA, CAt, nullptr, cols, 0u, 0u, pos.y, c);
}

template <typename T>
[[kernel]] void bnb_int8_double_quant_apply_outliers(
    device const T* A [[buffer(0)]],
    device const float* row_stats [[buffer(1)]],
    device const float* col_stats [[buffer(2)]],
    device char* CA [[buffer(3)]],
    device char* CAt [[buffer(4)]],
    constant uint& cols [[buffer(5)]],
    device const uint* flags [[buffer(6)]],
    constant uint& threshold_bits [[buffer(7)]],
    constant uint& zero_cols [[buffer(8)]],
    uint2 pos [[thread_position_in_grid]]) {
    const uint c = 4u * pos.x;
    if (c >= cols) {
        return;
    }
    bnb_int8_apply_chunk<T, true>(A, row_stats, col_stats, CA, CAt, flags, cols, threshold_bits, zero_cols, pos.y, c);
}

// int8_vectorwise_dequant: out[i] = fl32(fl32(float(A[i]) * stats[i / cols]) * fl32(1/127)).
// Each thread takes 4 consecutive elements of the flat tensor (a char4 load and a float4 store
// when all four are in range).
[[kernel]] void bnb_int8_vectorwise_dequant(
    device const char* A [[buffer(0)]],
    device const float* stats [[buffer(1)]],
    device float* out [[buffer(2)]],
    constant uint& n [[buffer(3)]],
    constant uint& cols [[buffer(4)]],
    uint gid [[thread_position_in_grid]]) {
    const uint i = 4u * gid;
    if (i >= n) {
        return;
    }
    if (i + 4u <= n) {
        const char4 a = *reinterpret_cast<device const char4*>(A + i);
        float4 v;
        for (uint k = 0; k < 4u; ++k) {
            v[k] = float(a[k]) * stats[(i + k) / cols] * BNB_INT8_INV127;
        }
        *reinterpret_cast<device float4*>(out + i) = v;
    } else {
        for (uint k = 0; i + k < n; ++k) {
            out[i + k] = float(A[i + k]) * stats[(i + k) / cols] * BNB_INT8_INV127;
        }
    }
}

// The dequantized value of an int32 product accumulator (int8_mm_dequant, int8_scaled_mm):
// fl32(fl32(fl32(float(acc) * row_stat) * col_stat) * fl32(1/16129)), then + bias in float32
// when there is one; the caller rounds once to the output type.
inline float bnb_int8_dequant_acc(int acc, float row_stat, float col_stat) {
    return float(acc) * row_stat * col_stat * BNB_INT8_INV16129;
}

// int8_mm_dequant: out[i] = T(bnb_int8_dequant_acc(A[i], row_stats[i / cols], col_stats[i % cols])
// + bias[i % cols]). Each thread takes 4 consecutive elements of the flat tensor.
template <typename T, typename BiasT>
[[kernel]] void bnb_int8_mm_dequant(
    device const int* A [[buffer(0)]],
    device const float* row_stats [[buffer(1)]],
    device const float* col_stats [[buffer(2)]],
    device const BiasT* bias [[buffer(3)]],
    device T* out [[buffer(4)]],
    constant uint& n [[buffer(5)]],
    constant uint& cols [[buffer(6)]],
    constant uint& has_bias [[buffer(7)]],
    uint gid [[thread_position_in_grid]]) {
    const uint i = 4u * gid;
    if (i >= n) {
        return;
    }
    const bool full = i + 4u <= n;
    int4 a = int4(0);
    if (full) {
        a = *reinterpret_cast<device const int4*>(A + i);
    } else {
        for (uint k = 0; i + k < n; ++k) {
            a[k] = A[i + k];
        }
    }
    float4 v;
    for (uint k = 0; k < 4u; ++k) {
        const uint e = min(i + k, n - 1u);
        const uint col = e % cols;
        v[k] = bnb_int8_dequant_acc(a[k], row_stats[e / cols], col_stats[col]);
        if (has_bias != 0u) {
            v[k] = v[k] + float(bias[col]);
        }
    }
    if (full) {
        *reinterpret_cast<device vec<T, 4>*>(out + i) = vec<T, 4>(T(v[0]), T(v[1]), T(v[2]), T(v[3]));
    } else {
        for (uint k = 0; i + k < n; ++k) {
            out[i + k] = T(v[k]);
        }
    }
}
