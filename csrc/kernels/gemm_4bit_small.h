// 4-bit (NF4 / FP4) products for small batches, 2 <= M <= 32 rows of A: y = A @ dequant(W).T (+ bias),
// docs/semantics.md section 4. Layout of W, A, y, the scales and the buffers: gemm_4bit.h and
// gemm_4bit.metal (the same bindings as the other three kernels).
//
//   bnb_gemm_4bit_small  Every weight byte and every block scale is read once per call, whatever M
//                        is: each threadgroup owns 4 x SIMDS weight rows (output columns) and
//                        computes them for all M rows of A. SIMDS = 4 (the path "small"): 16 rows,
//                        a grid of ceil(N / 16) threadgroups, half the gemv kernel's ceil(N / 8) at
//                        M = 1 and twice the mma kernel's at M <= 32. SIMDS = 2 (the variant
//                        "small/wide"): 8 rows, as many threadgroups as the gemv kernel, each of which
//                        reads all of A, so twice the A traffic (docs/tuning.md, "Small batches").
//
// Threadgroup: 32 x SIMDS threads, SIMDS simdgroups x 4 weight rows; in a simdgroup, lanes 8r .. 8r + 7
// share weight row r. K advances in steps of 128: per step,
//   1. the threadgroup stages A[0..M)[k0, k0 + 128) in threadgroup memory (as T; consecutive threads
//      load consecutive columns of a row, so each row of A is one 256..512-byte run),
//   2. each lane reads its 16 nibbles of its row (one 8-byte load, bytes [8q, 8q + 8) of the row's
//      64-byte run, q = lane % 8) and that chunk's block scale once, and dequantizes the 16 weights
//      into registers (w = T(fl32(table[q] * scale)), docs/semantics.md section 4),
//   3. and multiplies them with the 16 matching values of every row of A from threadgroup memory:
//      each A value staged once serves the 16 weight rows of the threadgroup, each dequantized
//      weight in registers serves the M rows of A.
// A chunk of 16 nibbles never spans two blocks when K % 16 == 0 (gemm_4bit.h, "Why a chunk ...").
//
// Accumulation (float32; docs/semantics.md section 4: error against float64 comparable to CUDA's):
// a lane keeps, per row of A, two accumulators that take alternate K steps; a step's 16 products
// are summed as four chains of 4, added pairwise ((c0 + c1) + (c2 + c3)). At the end the two
// accumulators are added, then the 8 lanes of a row combine pairwise (butterfly: lane ^ 4, ^ 2, ^ 1),
// so a K of 4096 is summed as 4-term chains, 16-step chains and depth-7 pairwise trees; the bias is
// added in float32 and the result rounded once to T.
//
// Registers per lane: 16 weights, 2 x 32 accumulators, the chunk; threadgroup memory: 32 x 128
// values of T (8 KB for half and bfloat, 16 KB for float). Two barriers per K step.
#pragma once

#include "gemm_4bit.h"

#define BNB_SMALL_M 32u       // rows of A a threadgroup holds (the path's largest M)
#define BNB_SMALL_ROWS 4u     // weight rows per simdgroup
#define BNB_SMALL_LANES 8u    // lanes per weight row
#define BNB_SMALL_CHUNK 16u   // nibbles per lane per step
#define BNB_SMALL_KS 128u     // K per step: BNB_SMALL_LANES * BNB_SMALL_CHUNK

// The sums of one group of 4 x SIMDS weight rows over K in [k_begin, k_end) for rows 0..mcount of A,
// as the steps above describe: this lane's weight row starts at `base` (row * K); on return v[i] holds
// row i's sum (the same in the 8 lanes of a weight row) for i < mcount. Every thread of the
// threadgroup calls it with the same k_begin, k_end and mcount (it has barriers); k_begin % 16 == 0
// (a lane's 16 nibbles: one 8-byte load, within one block).
template <typename T, bool NESTED, uint SIMDS>
inline void bnb_small_sums(device const T* A, device const uchar* B, device const float* absmax,
                           device const uchar* absmax_8bit, device const float* absmax_code, constant float* lut,
                           float offset, uint lda, uint block_shift, uint mcount, uint base, uint k_begin,
                           uint k_end, threadgroup T* a_tile, uint tid, uint q, thread float* v) {
    constexpr uint MT = BNB_SMALL_M;
    constexpr uint C = BNB_SMALL_CHUNK;
    constexpr uint KS = BNB_SMALL_KS;
    constexpr uint THREADS = 32u * SIMDS;
    static_assert(BNB_SMALL_LANES * BNB_SMALL_CHUNK == BNB_SMALL_KS, "a step is one chunk per lane of a row");
    static_assert(BNB_SMALL_ROWS * BNB_SMALL_LANES == 32u, "a simdgroup's lanes cover its rows");
    static_assert(KS % THREADS == 0u, "each thread stages the same number of columns per step");

    // Two accumulators per row of A, for even and odd K steps (two arrays, each indexed only by the
    // unrolled row loop, so that both stay in registers).
    float acc_even[MT];
    float acc_odd[MT];
    for (uint i = 0; i < MT; ++i) {
        acc_even[i] = 0.0f;
        acc_odd[i] = 0.0f;
    }
    bool odd = false;
    for (uint k0 = k_begin; k0 < k_end; k0 += KS) {
        // 1. Stage A[0..M)[k0, k0 + KS), zero past k_end.
        threadgroup_barrier(mem_flags::mem_threadgroup);  // (the previous step's reads are done)
        for (uint c = tid; c < KS; c += THREADS) {
            const uint kc = k0 + c;
            for (uint i = 0; i < MT; ++i) {
                if (i < mcount) {
                    a_tile[i * KS + c] = kc < k_end ? A[i * lda + kc] : T(0.0f);
                }
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        // 2. This lane's 16 weights of its row.
        const uint k = k0 + q * C;
        if (k < k_end) {
            const uint idx = base + k;
            uint wq[C / 8u];
            bnb_mm_chunk<C>(B, idx, wq);
            const float s = bnb_mm_scale<NESTED>(idx >> block_shift, absmax, absmax_8bit, absmax_code, offset);
            float w[C];
            bnb_mm_dequant_chunk<T, C>(wq, lut, s, w);
            // 3. ... times every row of A.
            for (uint i = 0; i < MT; ++i) {
                if (i < mcount) {
                    threadgroup const T* x = a_tile + i * KS + q * C;
                    float c[4];
                    for (uint h = 0; h < 4u; ++h) {
                        c[h] = float(x[4u * h]) * w[4u * h];
                        for (uint j = 1; j < 4u; ++j) {
                            c[h] = fma(float(x[4u * h + j]), w[4u * h + j], c[h]);
                        }
                    }
                    const float d = bnb_mm_sum4(c);
                    if (odd) {
                        acc_odd[i] += d;
                    } else {
                        acc_even[i] += d;
                    }
                }
            }
        }
        odd = !odd;
    }
    for (uint i = 0; i < MT; ++i) {
        if (i < mcount) {  // uniform over the threadgroup
            v[i] = bnb_mm_lane_sum<BNB_SMALL_LANES>(acc_even[i] + acc_odd[i]);
        }
    }
}

// Grid: (ceil(N / (4 * SIMDS)), 1, 1) threadgroups of 32 * SIMDS threads. Needs K % 16 == 0 and
// 1 <= M <= 32.
template <typename T, bool NESTED, uint SIMDS>
[[kernel]] void bnb_gemm_4bit_small(
    device const T* A [[buffer(0)]],
    device const uchar* B [[buffer(1)]],
    device const float* absmax [[buffer(2)]],
    device const uchar* absmax_8bit [[buffer(3)]],
    device const float* absmax_code [[buffer(4)]],
    device const uchar* absmax_offset [[buffer(5)]],
    constant float* code [[buffer(6)]],
    device const T* bias [[buffer(7)]],
    device T* out [[buffer(8)]],
    constant uint& M [[buffer(9)]],
    constant uint& N [[buffer(10)]],
    constant uint& K [[buffer(11)]],
    constant uint& lda [[buffer(12)]],
    constant uint& block_shift [[buffer(13)]],
    constant uint& table [[buffer(14)]],
    constant uint& offset_kind [[buffer(15)]],
    constant uint& flags [[buffer(16)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
    threadgroup T a_tile[BNB_SMALL_M * BNB_SMALL_KS];
    constant float* lut = bnb_mm_table(code, table);
    const float offset = NESTED ? bnb_mm_offset(absmax_offset, offset_kind) : 0.0f;
    const uint mcount = min(M, BNB_SMALL_M);  // (the op layer never launches more rows)
    const uint q = lane % BNB_SMALL_LANES;
    const uint row = tg.x * (SIMDS * BNB_SMALL_ROWS) + sg * BNB_SMALL_ROWS + lane / BNB_SMALL_LANES;
    // Rows past N read row N - 1 (never stored), so that every lane takes the same path.
    const uint base = min(row, N - 1u) * K;
    float v[BNB_SMALL_M];
    bnb_small_sums<T, NESTED, SIMDS>(A, B, absmax, absmax_8bit, absmax_code, lut, offset, lda, block_shift, mcount,
                                     base, 0u, K, a_tile, tid, q, v);
    for (uint i = 0; i < BNB_SMALL_M; ++i) {
        // The 8 lanes of a row hold the same sum: lane q stores rows i = q, q + 8, ...
        if (i < mcount && i % BNB_SMALL_LANES == q && row < N) {
            bnb_mm_store(out, bias, flags, i, row, N, v[i]);
        }
    }
}
