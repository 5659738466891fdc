// Exact int8 matrix products (docs/semantics.md section 6): acc[m][n] = sum_k A[m][k] * B[n][k] as int32,
// A [M, K] and B [N, K] int8, row-major (B as nn.Linear stores its weight). The same products
// feed three outputs: the int32 matrix (int8_linear_matmul), and, fused so that no int32 matrix
// ever reaches memory, its dequantization (int8_scaled_mm) plus the fp outlier columns
// (int8_mixed_scaled_mm). Launch geometry and buffers: int8.metal.
//
// Exactness. Apple GPUs expose no int8 dot product in MSL, so the products are formed in float
// (int8 values are exact in half and float; a product has magnitude <= 128 * 128 = 2^14, exact
// in float). A float32 holds every integer of magnitude <= 2^24 exactly, so a float sum of at
// most 2^10 = 1024 such products is exact in ANY order of addition and with or without fused
// multiply-adds: every partial sum is an integer of magnitude <= 1024 * 2^14 = 2^24. Both
// kernels therefore give each float accumulator at most BNB_INT8_EXACT_CHUNK = 1024 products,
// then convert it (an exact integer) to int and add it to an int32 total, which is exact for
// every K (int32 wraps only past 2^31, i.e. never for K <= 2^17).
//   - gemv (M <= 8): each lane sums products of its own K slice in float, flushed to int every
//     1024 products, and the lanes' int totals meet in simd_sum (integer, exact).
//   - tiled (M > 8): simdgroup_matrix 8x8 multiply-accumulate of half tiles into float
//     accumulators; after every 32 k-tiles of 32 (1024 products per accumulator element) the
//     accumulators are moved to int32 registers through threadgroup memory and reset.
#pragma once

#include "int8.h"

#define BNB_INT8_EXACT_CHUNK 1024u

// --- gemv: small M ----------------------------------------------------------------------------
// A threadgroup has 4 simdgroups; a simdgroup computes NR = 4 outputs (rows of B) for MR rows of
// A (1 or 4). Lane l reads the 16-byte chunks l, l + 32, ... of each row (a simdgroup reads 512
// contiguous bytes per row per step) when K % 16 == 0 (VEC), else single bytes l, l + 32, ...
#define BNB_INT8_GEMV_NR 4u
#define BNB_INT8_GEMV_THREADS 128u
#define BNB_INT8_GEMV_TG_N 16u  // outputs per threadgroup along N

template <uint MR, bool VEC>
inline void bnb_int8_gemv_dot(device const char* A, device const char* B, uint M, uint N, uint K, uint m0, uint n0,
                              uint lane, thread int* total) {
    constexpr uint NR = BNB_INT8_GEMV_NR;
    float f[MR * NR];
    int acc[MR * NR];
    for (uint i = 0; i < MR * NR; ++i) {
        f[i] = 0.0f;
        acc[i] = 0;
    }
    uint pending = 0u;  // products in each float accumulator since the last flush
    if (VEC) {
        const uint chunks = K / 16u;
        for (uint c = lane; c < chunks; c += 32u) {
            float4 a[MR][4];
            for (uint m = 0; m < MR; ++m) {
                uint4 w = uint4(0u);
                if (m0 + m < M) {
                    w = *reinterpret_cast<device const uint4*>(A + (m0 + m) * K + 16u * c);
                }
                for (uint q = 0; q < 4u; ++q) {
                    a[m][q] = float4(as_type<char4>(w[q]));
                }
            }
            for (uint n = 0; n < NR; ++n) {
                if (n0 + n >= N) {
                    continue;
                }
                const uint4 w = *reinterpret_cast<device const uint4*>(B + (n0 + n) * K + 16u * c);
                float4 b[4];
                for (uint q = 0; q < 4u; ++q) {
                    b[q] = float4(as_type<char4>(w[q]));
                }
                for (uint m = 0; m < MR; ++m) {
                    f[m * NR + n] += dot(a[m][0], b[0]) + dot(a[m][1], b[1]) + dot(a[m][2], b[2]) + dot(a[m][3], b[3]);
                }
            }
            pending += 16u;
            if (pending == BNB_INT8_EXACT_CHUNK) {
                for (uint i = 0; i < MR * NR; ++i) {
                    acc[i] += int(f[i]);
                    f[i] = 0.0f;
                }
                pending = 0u;
            }
        }
    } else {
        for (uint k = lane; k < K; k += 32u) {
            float a[MR];
            for (uint m = 0; m < MR; ++m) {
                a[m] = m0 + m < M ? float(A[(m0 + m) * K + k]) : 0.0f;
            }
            for (uint n = 0; n < NR; ++n) {
                if (n0 + n < N) {
                    const float b = float(B[(n0 + n) * K + k]);
                    for (uint m = 0; m < MR; ++m) {
                        f[m * NR + n] += a[m] * b;
                    }
                }
            }
            pending += 1u;
            if (pending == BNB_INT8_EXACT_CHUNK) {
                for (uint i = 0; i < MR * NR; ++i) {
                    acc[i] += int(f[i]);
                    f[i] = 0.0f;
                }
                pending = 0u;
            }
        }
    }
    for (uint i = 0; i < MR * NR; ++i) {
        total[i] = simd_sum(acc[i] + int(f[i]));
    }
}

// --- tiled: larger M --------------------------------------------------------------------------
// A threadgroup (128 threads, 4 simdgroups) computes a BM x 64 tile of the output (BM = 32 or 64)
// over k-tiles of 32: each k-tile of A and B is staged in threadgroup memory as half (int8 values
// are exact in half), then each simdgroup multiplies its 32 x (64 / SGN) sub-tile with 8x8
// simdgroup_matrix operations into float accumulators (SGN = 2 simdgroups along N for BM = 64,
// 4 for BM = 32). Each thread loads one 16-byte segment of A and of B per k-tile into registers
// a k-tile ahead, so that device loads overlap the products. Threadgroup memory: 11 KB.
#define BNB_INT8_TILE_N 64u
#define BNB_INT8_TILE_K 32u
#define BNB_INT8_TILE_LD 40u  // halves per staged row: 32 + 8 of padding against bank conflicts
#define BNB_INT8_TILED_THREADS 128u
// Threadgroup arrays: a 64-row A tile, a 64-row B tile, an 8x8 float scratch per simdgroup.
#define BNB_INT8_TILE_HALVES 2560   // 64 * BNB_INT8_TILE_LD
#define BNB_INT8_SCRATCH_FLOATS 256 // 4 * 64

// Staging a k-tile: rows r0 .. r0 + ROWS - 1, columns k0 .. k0 + 31 of X [rows, K] (zeros outside
// X), as half in threadgroup memory. Thread tid stages the 16-byte segment tid of the tile (two per
// row) when tid < 2 ROWS (ROWS = 32 or 64: at most one segment per thread of 128). The load into
// registers and the store into threadgroup memory are separate, so that the next k-tile's loads
// are in flight while the current one is multiplied.
template <uint ROWS, bool VEC>
inline uint4 bnb_int8_load_segment(device const char* X, uint rows, uint K, uint r0, uint k0, uint tid) {
    uint4 w = uint4(0u);
    const uint row = r0 + (tid >> 1);
    const uint k = k0 + (tid & 1u) * 16u;
    if (tid < 2u * ROWS && row < rows) {
        if (VEC) {
            if (k < K) {  // K % 16 == 0: the whole segment is in range
                w = *reinterpret_cast<device const uint4*>(X + row * K + k);
            }
        } else {
            for (uint i = 0; i < 16u; ++i) {
                const uint byte = k + i < K ? uint(as_type<uchar>(X[row * K + k + i])) : 0u;
                w[i / 4u] |= byte << (8u * (i % 4u));
            }
        }
    }
    return w;
}

template <uint ROWS>
inline void bnb_int8_store_segment(uint4 w, uint tid, threadgroup half* tile) {
    if (tid < 2u * ROWS) {
        threadgroup half4* dst = reinterpret_cast<threadgroup half4*>(tile + (tid >> 1) * BNB_INT8_TILE_LD + (tid & 1u) * 16u);
        for (uint q = 0; q < 4u; ++q) {
            dst[q] = half4(as_type<char4>(w[q]));
        }
    }
}

// Moves one float accumulator (exact integers) into this lane's two int32 totals: lane l owns
// elements 2l and 2l + 1 of the 8x8 matrix in row-major order (row l / 4, columns 2 (l % 4) and
// 2 (l % 4) + 1). `scratch` is this simdgroup's 64 floats of threadgroup memory.
inline void bnb_int8_flush(thread simdgroup_float8x8& acc, thread int* total, threadgroup float* scratch, uint lane) {
    simdgroup_store(acc, scratch, 8);
    simdgroup_barrier(mem_flags::mem_threadgroup);
    total[0] += int(scratch[2u * lane]);
    total[1] += int(scratch[2u * lane + 1u]);
    simdgroup_barrier(mem_flags::mem_threadgroup);
    acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}

// Simdgroups along N for a BM-row tile, and 8x8 fragments per simdgroup along N.
#define BNB_INT8_SGN(BM) ((BM) == 64u ? 2u : 4u)
#define BNB_INT8_FN(BM) (BNB_INT8_TILE_N / BNB_INT8_SGN(BM) / 8u)

// This simdgroup's int32 products: total[2 (i * FN + j) + e] is the element of fragment (i, j)
// that this lane owns (see bnb_int8_flush); fragment (i, j) covers rows 32 sm + 8 i .. + 7 and
// columns (64 / SGN) sn + 8 j .. + 7 of the tile, sm = sg / SGN, sn = sg % SGN.
template <uint BM, bool VEC>
inline void bnb_int8_tiled_dot(device const char* A, device const char* B, uint M, uint N, uint K, uint m0, uint n0,
                               uint tid, uint lane, uint sg, threadgroup half* As, threadgroup half* Bs,
                               threadgroup float* scratch, thread int* total) {
    constexpr uint SGN = BNB_INT8_SGN(BM);
    constexpr uint FN = BNB_INT8_FN(BM);
    constexpr uint TILES_PER_CHUNK = BNB_INT8_EXACT_CHUNK / BNB_INT8_TILE_K;
    const uint sm = sg / SGN;
    const uint sn = sg % SGN;
    simdgroup_float8x8 acc[4u * FN];
    for (uint f = 0; f < 4u * FN; ++f) {
        acc[f] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        total[2u * f] = 0;
        total[2u * f + 1u] = 0;
    }
    const uint tiles = (K + BNB_INT8_TILE_K - 1u) / BNB_INT8_TILE_K;
    uint4 wa = bnb_int8_load_segment<BM, VEC>(A, M, K, m0, 0u, tid);
    uint4 wb = bnb_int8_load_segment<BNB_INT8_TILE_N, VEC>(B, N, K, n0, 0u, tid);
    for (uint t = 0; t < tiles; ++t) {
        bnb_int8_store_segment<BM>(wa, tid, As);
        bnb_int8_store_segment<BNB_INT8_TILE_N>(wb, tid, Bs);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (t + 1u < tiles) {  // the next k-tile's loads overlap this one's products
            wa = bnb_int8_load_segment<BM, VEC>(A, M, K, m0, (t + 1u) * BNB_INT8_TILE_K, tid);
            wb = bnb_int8_load_segment<BNB_INT8_TILE_N, VEC>(B, N, K, n0, (t + 1u) * BNB_INT8_TILE_K, tid);
        }
        for (uint kk = 0; kk < BNB_INT8_TILE_K; kk += 8u) {
            simdgroup_half8x8 a[4];
            simdgroup_half8x8 b[FN];
            for (uint i = 0; i < 4u; ++i) {
                simdgroup_load(a[i], As, BNB_INT8_TILE_LD, ulong2(kk, 32u * sm + 8u * i));
            }
            for (uint j = 0; j < FN; ++j) {
                // B is staged as [n][k]; the transposed load gives the [k][n] fragment.
                simdgroup_load(b[j], Bs, BNB_INT8_TILE_LD, ulong2(kk, 8u * FN * sn + 8u * j), true);
            }
            for (uint i = 0; i < 4u; ++i) {
                for (uint j = 0; j < FN; ++j) {
                    simdgroup_multiply_accumulate(acc[i * FN + j], a[i], b[j], acc[i * FN + j]);
                }
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if ((t + 1u) % TILES_PER_CHUNK == 0u || t + 1u == tiles) {
            for (uint f = 0; f < 4u * FN; ++f) {
                bnb_int8_flush(acc[f], total + 2u * f, scratch + 64u * sg, lane);
            }
        }
    }
}

// --- outputs ----------------------------------------------------------------------------------

// An outlier column index as given (int64, negative counts from the end as in torch indexing);
// K when out of range (such a column contributes nothing: an index the op layer cannot check
// without reading the device).
inline uint bnb_int8_outlier_col(long c, uint K) {
    const long k = c < 0 ? c + long(K) : c;
    return k >= 0 && k < long(K) ? uint(k) : K;
}

// What int8_scaled_mm writes for output (m, n): T(dequant(acc) + bias). With n_out outlier
// columns (int8_mixed_scaled_mm) that value is then added, in float32, to
// sum_j A[m][c_j] * T(CB[n][c_j] * SCB[n] * fl32(1/127)) and rounded to T again (docs/semantics.md: the int8
// part rounded to A's dtype, plus subA @ dequantized weight columns in A's dtype).
template <typename T, typename BiasT>
inline void bnb_int8_store_scaled(int acc, uint m, uint n, uint N, uint K, device const char* B,
                                  device const float* row_stats, device const float* col_stats,
                                  device const BiasT* bias, uint has_bias, device T* out, device const T* Afp,
                                  device const long* outlier_cols, uint n_out) {
    float v = bnb_int8_dequant_acc(acc, row_stats[m], col_stats[n]);
    if (has_bias != 0u) {
        v = v + float(bias[n]);
    }
    T r = T(v);
    if (n_out > 0u) {
        float s = float(r);
        for (uint j = 0; j < n_out; ++j) {
            const uint c = bnb_int8_outlier_col(outlier_cols[j], K);
            if (c < K) {
                const T w = T(float(B[n * K + c]) * col_stats[n] * BNB_INT8_INV127);
                s = s + float(Afp[m * K + c]) * float(w);
            }
        }
        r = T(s);
    }
    out[m * N + n] = r;
}

// subA[m][j] = A[m][c_j] for the rows m0 .. m0 + rows - 1 (0 for an out-of-range index).
template <typename T>
inline void bnb_int8_store_sub_a(device const T* Afp, device const long* outlier_cols, device T* subA, uint n_out,
                                 uint M, uint K, uint m0, uint rows, uint tid, uint threads) {
    for (uint e = tid; e < rows * n_out; e += threads) {
        const uint r = e / n_out;
        const uint j = e - r * n_out;
        const uint m = m0 + r;
        if (m < M) {
            const uint c = bnb_int8_outlier_col(outlier_cols[j], K);
            subA[m * n_out + j] = c < K ? Afp[m * K + c] : T(0);
        }
    }
}

// --- kernels ----------------------------------------------------------------------------------

template <uint MR, bool VEC>
[[kernel]] void bnb_int8_gemv_i32(
    device const char* A [[buffer(0)]],
    device const char* B [[buffer(1)]],
    device int* out [[buffer(2)]],
    constant uint& M [[buffer(3)]],
    constant uint& N [[buffer(4)]],
    constant uint& K [[buffer(5)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
    const uint m0 = tg.y * MR;
    const uint n0 = tg.x * BNB_INT8_GEMV_TG_N + sg * BNB_INT8_GEMV_NR;
    int total[MR * BNB_INT8_GEMV_NR];
    bnb_int8_gemv_dot<MR, VEC>(A, B, M, N, K, m0, n0, lane, total);
    if (lane < MR * BNB_INT8_GEMV_NR) {
        const uint m = m0 + lane / BNB_INT8_GEMV_NR;
        const uint n = n0 + lane % BNB_INT8_GEMV_NR;
        if (m < M && n < N) {
            out[m * N + n] = total[lane];
        }
    }
}

template <typename T, typename BiasT, uint MR, bool VEC>
[[kernel]] void bnb_int8_gemv_scaled(
    device const char* A [[buffer(0)]],
    device const char* B [[buffer(1)]],
    device const float* row_stats [[buffer(2)]],
    device const float* col_stats [[buffer(3)]],
    device const BiasT* bias [[buffer(4)]],
    device T* out [[buffer(5)]],
    constant uint& M [[buffer(6)]],
    constant uint& N [[buffer(7)]],
    constant uint& K [[buffer(8)]],
    constant uint& has_bias [[buffer(9)]],
    device const T* Afp [[buffer(10)]],
    device const long* outlier_cols [[buffer(11)]],
    device T* subA [[buffer(12)]],
    constant uint& n_out [[buffer(13)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
    const uint m0 = tg.y * MR;
    const uint n0 = tg.x * BNB_INT8_GEMV_TG_N + sg * BNB_INT8_GEMV_NR;
    int total[MR * BNB_INT8_GEMV_NR];
    bnb_int8_gemv_dot<MR, VEC>(A, B, M, N, K, m0, n0, lane, total);
    if (lane < MR * BNB_INT8_GEMV_NR) {
        const uint m = m0 + lane / BNB_INT8_GEMV_NR;
        const uint n = n0 + lane % BNB_INT8_GEMV_NR;
        if (m < M && n < N) {
            bnb_int8_store_scaled<T, BiasT>(total[lane], m, n, N, K, B, row_stats, col_stats, bias, has_bias, out, Afp,
                                            outlier_cols, n_out);
        }
    }
    if (tg.x == 0u && n_out > 0u) {
        bnb_int8_store_sub_a<T>(Afp, outlier_cols, subA, n_out, M, K, m0, MR, tid, BNB_INT8_GEMV_THREADS);
    }
}

template <uint BM, bool VEC>
[[kernel]] void bnb_int8_tiled_i32(
    device const char* A [[buffer(0)]],
    device const char* B [[buffer(1)]],
    device int* out [[buffer(2)]],
    constant uint& M [[buffer(3)]],
    constant uint& N [[buffer(4)]],
    constant uint& K [[buffer(5)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
    threadgroup half As[BNB_INT8_TILE_HALVES];
    threadgroup half Bs[BNB_INT8_TILE_HALVES];
    threadgroup float scratch[BNB_INT8_SCRATCH_FLOATS];
    constexpr uint SGN = BNB_INT8_SGN(BM);
    constexpr uint FN = BNB_INT8_FN(BM);
    const uint m0 = tg.y * BM;
    const uint n0 = tg.x * BNB_INT8_TILE_N;
    int total[8u * FN];
    bnb_int8_tiled_dot<BM, VEC>(A, B, M, N, K, m0, n0, tid, lane, sg, As, Bs, scratch, total);
    for (uint i = 0; i < 4u; ++i) {
        for (uint j = 0; j < FN; ++j) {
            for (uint e = 0; e < 2u; ++e) {
                const uint m = m0 + 32u * (sg / SGN) + 8u * i + lane / 4u;
                const uint n = n0 + 8u * FN * (sg % SGN) + 8u * j + 2u * (lane % 4u) + e;
                if (m < M && n < N) {
                    out[m * N + n] = total[2u * (i * FN + j) + e];
                }
            }
        }
    }
}

template <typename T, typename BiasT, uint BM, bool VEC>
[[kernel]] void bnb_int8_tiled_scaled(
    device const char* A [[buffer(0)]],
    device const char* B [[buffer(1)]],
    device const float* row_stats [[buffer(2)]],
    device const float* col_stats [[buffer(3)]],
    device const BiasT* bias [[buffer(4)]],
    device T* out [[buffer(5)]],
    constant uint& M [[buffer(6)]],
    constant uint& N [[buffer(7)]],
    constant uint& K [[buffer(8)]],
    constant uint& has_bias [[buffer(9)]],
    device const T* Afp [[buffer(10)]],
    device const long* outlier_cols [[buffer(11)]],
    device T* subA [[buffer(12)]],
    constant uint& n_out [[buffer(13)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
    threadgroup half As[BNB_INT8_TILE_HALVES];
    threadgroup half Bs[BNB_INT8_TILE_HALVES];
    threadgroup float scratch[BNB_INT8_SCRATCH_FLOATS];
    constexpr uint SGN = BNB_INT8_SGN(BM);
    constexpr uint FN = BNB_INT8_FN(BM);
    const uint m0 = tg.y * BM;
    const uint n0 = tg.x * BNB_INT8_TILE_N;
    int total[8u * FN];
    bnb_int8_tiled_dot<BM, VEC>(A, B, M, N, K, m0, n0, tid, lane, sg, As, Bs, scratch, total);
    for (uint i = 0; i < 4u; ++i) {
        for (uint j = 0; j < FN; ++j) {
            for (uint e = 0; e < 2u; ++e) {
                const uint m = m0 + 32u * (sg / SGN) + 8u * i + lane / 4u;
                const uint n = n0 + 8u * FN * (sg % SGN) + 8u * j + 2u * (lane % 4u) + e;
                if (m < M && n < N) {
                    bnb_int8_store_scaled<T, BiasT>(total[2u * (i * FN + j) + e], m, n, N, K, B, row_stats, col_stats,
                                                    bias, has_bias, out, Afp, outlier_cols, n_out);
                }
            }
        }
    }
    if (tg.x == 0u && n_out > 0u) {
        bnb_int8_store_sub_a<T>(Afp, outlier_cols, subA, n_out, M, K, m0, BM, tid, BNB_INT8_TILED_THREADS);
    }
}
