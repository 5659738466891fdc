// 4-bit (NF4 / FP4) matrix products: y = A @ dequant(W).T (+ bias), docs/semantics.md section 4.
//
// W has logical shape [N, K] and is quantized flat (docs/semantics.md section 3): element (n, k) is nibble
// n*K + k of the packed bytes (nibble 2j = high nibble of byte j) with block scale
// scale(b), b = (n*K + k) / blocksize. Blocks may straddle rows. A is [M, K] with a row stride
// `lda` (elements), y is [M, N] contiguous. Everything accumulates in float32 and is rounded once
// to T at the end (bias added before that rounding).
//
// These three kernels, gemm_4bit_small.h's and gemm_4bit_splitk.h's share one set of buffers and
// scalars (see gemm_4bit.metal; the split-K kernel has three more: S and its workspace); the op layer
// picks one by (M, N, K), never by data:
//
//   bnb_gemv_4bit        M = 1 (decode). The MLX qmv_fast design: 2 simdgroups x 4 output rows
//                        per threadgroup; each lane holds 32 activations in registers and reads,
//                        per row and per step, 16 bytes (32 nibbles) of packed weight with one
//                        128-bit load and that chunk's block scale once (a chunk never spans two
//                        blocks, so even at blocksize 32 no two lanes load the same scale), and
//                        dequantizes the 32 weights with it (see "Rounding" below); one
//                        sum over the lanes per row at the end; no threadgroup barrier (the
//                        threadgroup-table variant has one, before the loop). Needs K % 32 == 0.
//   bnb_gemm_4bit_batch  M = 1 when K % 32 != 0, and a tuning candidate up to M = 32 (the built-in
//                        path for 2 <= M <= 32 is bnb_gemm_4bit_small, gemm_4bit_small.h). The same weight
//                        walk with 8-byte (16-nibble) chunks, 4 simdgroups x 2 rows per
//                        threadgroup, up to 8 rows of A per threadgroup: each lane dequantizes
//                        its 16 weights per row once and uses them for every row of A.
//                        Needs K % 16 == 0.
//   bnb_gemm_4bit_mma    larger M, and every K that is not a multiple of 16. 32x64 output tiles
//                        (A rows x W rows) per threadgroup of 4 simdgroups, K in steps of 32:
//                        the A tile and the dequantized W tile are staged in threadgroup memory
//                        as float, each simdgroup multiplies a 16x32 part with simdgroup_matrix
//                        8x8 float tiles (float32 sums, see "Accumulation"), the result goes through
//                        threadgroup memory to add bias, round and store with bounds checks.
//
// Why a chunk of C nibbles (C = 32 gemv, 16 batch) can carry one scale: with K % C == 0 a chunk
// starts at a nibble index that is a multiple of C, and every blocksize (32..4096) is a multiple
// of C, so a chunk never crosses a block boundary, even where blocks straddle rows. The vector
// paths need that (and C/2-byte aligned chunks, which it also gives); the mma kernel handles any
// K (it falls back to per-nibble addressing and per-nibble scales when K % 16 != 0).
//
// Rounding: every kernel forms each term as a * w with the weight w = T(fl32(table[q] * scale)), the
// value dequantize_4bit gives in the activations' dtype T, so that the only difference from
// dequantize_4bit followed by linear (bitsandbytes' own gemv_4bit / gemm_4bit wherever it has no
// fused kernel; its CUDA gemv also multiplies weights in T) is the order of summation
// (docs/semantics.md section 4). For half and bfloat, a * w is exact in float. The gemv and batch
// kernels load a chunk's scale once and dequantize each of the chunk's weights with it (one multiply
// and one conversion per weight: a bandwidth-bound kernel does not notice them, and no dynamically
// indexed per-thread table is needed); factoring the scale out of a chunk's sum
// (scale * sum(a * table[q])) would round differently, and lose a * table[q] where it is a float32
// subnormal while a * w is not. The mma kernel stages the same w in threadgroup memory.
//
// Accumulation: every output element is a float32 sum of K terms, formed as short independent
// partial sums combined in a tree, never as one running sum over K (whose rounding error grows with
// every term; docs/semantics.md section 4 states the bound, measured against CUDA's):
//   gemv, batch  a lane's chunk of C weights per row is summed as four partial sums of C / 4 fused
//                multiply-adds (element j into sum j % 4), combined pairwise ((d0 + d1) + (d2 + d3));
//                the chunk sums of a lane's K steps are added to one running sum per row (K / 1024
//                of them in gemv, K / 512 in batch), and the 32 lanes' sums are combined by a
//                five-level butterfly of simd_shuffle_xor (bnb_mm_lane_sum), a fixed pairwise order
//                that every lane gets bit for bit (simd_sum's order is unspecified).
//   mma          each K step (BK = 32) multiplies into fresh tiles (simdgroup_multiply, then
//                simdgroup_multiply_accumulate: a chain of 32 fused multiply-adds per element, as
//                Apple GPUs compute these products); the step's tiles are added elementwise
//                (thread_elements) to group tiles, which sum BNB_MMA_GROUP = 8 steps (256 terms),
//                and each finished group is added to the running sums, which therefore take one
//                addition per 256 terms of K. Registers: three sets of 8 tiles (2 floats per thread
//                each).
// A term therefore goes through at most 14 + ceil(K / 1024) roundings in gemv, 10 + ceil(K / 512) in
// batch and 38 + ceil(K / 256) in mma, one more with a bias (one running sum over K: K roundings).
// Cost (Library.profile; traffic in tests/kernel_traffic.md): SIMD-group collectives, 5 shuffles per
// row (gemv, batch: 640 for 128 rows at M = 1). Arithmetic: gemv and batch one fused multiply-add
// per term and 3 additions per chunk; mma 2 additions per thread and tile per K step (+ 2 per group)
// next to 64 fused multiply-adds per thread and tile; registers for the mma tiles: 60 floats per
// thread (acc, group and part: 16 each; the operands 12).
//
// Memory access (coalescing): in the gemv kernel lane l of a simdgroup reads bytes
// [16l, 16l + 16) of a 512-byte run of one weight row per step, so the 32 lanes' loads of a row
// touch exactly four 128-byte lines (batch: [8l, 8l + 8) of 256 bytes, two lines); the scales of
// those chunks are 32..1 consecutive floats (one line, or the nested codes' 32..1 bytes); the
// activations are C consecutive values per lane, a contiguous run shared by every simdgroup (cache
// hits after the first). The mma kernel reads each weight row of its tile as 16-byte runs per K
// step (consecutive steps continue the same lines) and A rows as 64..128-byte runs.
//
// The 16-entry table: `table` selects the `code` buffer (gemv_4bit, whose code is data) or the
// NF4 / FP4 tables of quantize_4bit.h; all are read through a `constant float*` (the constant
// cache). The *_tglut variant of the gemv kernel copies the table into threadgroup memory first,
// so that both placements can be measured on a Mac (scripts/bench_kernels.py).
//
// Nested absmax (double quantization): scale(b) = fl32(absmax_code[absmax_8bit[b]] *
// absmax[b / 256]) + offset, decoded in the kernel; `offset` is a 0-dim tensor bound as bytes
// (float32, float16 or bfloat16, told by `offset_kind`).
#pragma once

#include "bnb_common.h"
#include "quantize_4bit.h"

// `table`: where the 16 nibble values come from.
#define BNB_TABLE_CODE 0u
#define BNB_TABLE_NF4 1u
#define BNB_TABLE_FP4 2u

// `offset_kind`: the dtype of the nested-absmax offset.
#define BNB_OFFSET_F32 0u
#define BNB_OFFSET_F16 1u
#define BNB_OFFSET_BF16 2u

// `flags` bits.
#define BNB_MM_BIAS 1u   // add bias[n]
#define BNB_MM_AVEC 2u   // A and every row start of A are 16-byte aligned: vector loads allowed

// gemv / batch geometry.
#define BNB_GEMV_CHUNK 32u                     // nibbles per lane per row per step (16 bytes)
#define BNB_BATCH_CHUNK 16u                    // the same in the batch kernel (8 bytes)
#define BNB_GEMV_SIMDS 2u
#define BNB_GEMV_ROWS 4u                       // weight rows per simdgroup
#define BNB_BATCH_SIMDS 4u
#define BNB_BATCH_ROWS 2u
#define BNB_BATCH_M 8u                         // rows of A per threadgroup
// Weight rows per threadgroup, both kernels: BNB_GEMV_SIMDS * BNB_GEMV_ROWS == BNB_BATCH_SIMDS * BNB_BATCH_ROWS.
#define BNB_MM_ROWS_PER_TG 8u

// mma geometry.
#define BNB_MMA_BM 32u   // rows of A per threadgroup
#define BNB_MMA_BN 64u   // rows of W (output columns) per threadgroup
#define BNB_MMA_BK 32u   // K per step
#define BNB_MMA_THREADS 128u
#define BNB_MMA_GROUP 8u  // K steps per group of the two-level running sums (256 terms)

inline constant float* bnb_mm_table(constant float* code, uint table) {
    return table == BNB_TABLE_NF4 ? bnb_nf4_table : (table == BNB_TABLE_FP4 ? bnb_fp4_table : code);
}

// The nested-absmax offset from its bytes (a 0-dim tensor of float32, float16 or bfloat16).
inline float bnb_mm_offset(device const uchar* p, uint kind) {
    if (kind == BNB_OFFSET_F32) {
        return as_type<float>(uint(p[0]) | (uint(p[1]) << 8) | (uint(p[2]) << 16) | (uint(p[3]) << 24));
    }
    const uint bits = uint(p[0]) | (uint(p[1]) << 8);
    if (kind == BNB_OFFSET_F16) {
        return float(as_type<half>(ushort(bits)));
    }
    return as_type<float>(bits << 16);
}

// The scale of block b: absmax[b], or the nested decode of docs/semantics.md section 3.
template <bool NESTED>
inline float bnb_mm_scale(uint b, device const float* absmax, device const uchar* absmax_8bit,
                          device const float* absmax_code, float offset) {
    if (NESTED) {
        const float s = absmax_code[absmax_8bit[b]] * absmax[b >> 8];
        return s + offset;
    }
    return absmax[b];
}

// A chunk of C nibbles (C = 16 or 32) as C / 8 uints, nibbles idx .. idx + C - 1 (idx a multiple
// of C): one 8- or 16-byte load.
template <uint C>
inline void bnb_mm_chunk(device const uchar* B, uint idx, thread uint* w) {
    if (C == 32u) {
        const uint4 v = *reinterpret_cast<device const uint4*>(B + idx / 2u);
        w[0] = v.x;
        w[1] = v.y;
        w[2] = v.z;
        w[3] = v.w;
    } else {
        const uint2 v = *reinterpret_cast<device const uint2*>(B + idx / 2u);
        w[0] = v.x;
        w[1] = v.y;
    }
}

// Byte j of a chunk (little-endian: byte 0 is w[0]'s low byte); its high nibble is element 2j.
inline uint bnb_mm_byte(thread const uint* w, uint j) {
    return (w[j >> 2] >> (8u * (j & 3u))) & 0xFFu;
}

// The dequantized weight in the activations' dtype T, as a float: T(fl32(table value * scale)), what
// dequantize_4bit gives for T (see "Rounding" above). Exact as a float; for T = float, fl32(t * s).
template <typename T>
inline float bnb_mm_weight(float t, float s) {
    return float(T(t * s));
}

// (d[0] + d[1]) + (d[2] + d[3]): four partial sums combined pairwise.
inline float bnb_mm_sum4(thread const float* d) {
    return (d[0] + d[1]) + (d[2] + d[3]);
}

// sum_j x[j] * w[j] over a chunk whose block scale is s, each weight w[j] = bnb_mm_weight<T>(table[nibble j], s):
// four partial sums (element j goes to sum j % 4, C / 4 fused multiply-adds each), combined pairwise
// (see "Accumulation" above); LUT is the table's pointer type (constant or threadgroup memory).
template <typename T, uint C, typename LUT>
inline float bnb_mm_dot(thread const uint* w, thread const float* x, LUT lut, float s) {
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (uint j = 0; j < C / 2u; ++j) {
        const uint b = bnb_mm_byte(w, j);
        const uint q = 2u * (j & 1u);
        d[q] = fma(x[2u * j], bnb_mm_weight<T>(lut[b >> 4], s), d[q]);
        d[q + 1u] = fma(x[2u * j + 1u], bnb_mm_weight<T>(lut[b & 15u], s), d[q + 1u]);
    }
    return bnb_mm_sum4(d);
}

// t[j] = bnb_mm_weight<T>(table[nibble j], s) of a chunk: its dequantized weights.
template <typename T, uint C>
inline void bnb_mm_dequant_chunk(thread const uint* w, constant float* lut, float s, thread float* t) {
    for (uint j = 0; j < C / 2u; ++j) {
        const uint b = bnb_mm_byte(w, j);
        t[2u * j] = bnb_mm_weight<T>(lut[b >> 4], s);
        t[2u * j + 1u] = bnb_mm_weight<T>(lut[b & 15u], s);
    }
}

// x[0..C) = a[0..C) as float: 4-element vector loads when allowed, else scalar loads.
template <uint C, typename T>
inline void bnb_mm_load(device const T* a, bool vec_ok, thread float* x) {
    if (vec_ok) {
        for (uint h = 0; h < C; h += 4u) {
            const vec<T, 4> v = *reinterpret_cast<device const vec<T, 4>*>(a + h);
            for (uint j = 0; j < 4u; ++j) {
                x[h + j] = float(v[j]);
            }
        }
    } else {
        for (uint j = 0; j < C; ++j) {
            x[j] = float(a[j]);
        }
    }
}

// The sum of v over each aligned group of LANES lanes of a simdgroup (32: the whole simdgroup), every
// lane of the group getting the same bits: log2(LANES) levels of a butterfly (lanes l and l ^ d add
// each other's partial sums; float addition commutes), i.e. pairwise summation in a fixed order.
// simd_sum's order is not specified by Metal.
template <ushort LANES = 32>
inline float bnb_mm_lane_sum(float v) {
    for (ushort d = LANES / 2; d > 0; d >>= 1) {
        v += simd_shuffle_xor(v, d);
    }
    return v;
}

// y[m, n] = T(v (+ bias[n])).
template <typename T>
inline void bnb_mm_store(device T* out, device const T* bias, uint flags, uint m, uint n, uint N, float v) {
    if ((flags & BNB_MM_BIAS) != 0u) {
        v += float(bias[n]);
    }
    out[m * N + n] = T(v);
}

// ---------------------------------------------------------------------------------------------
// gemv: M = 1 (any M works: threadgroup row y is row y of A). Threadgroup: 64 threads
// (2 simdgroups); grid: (ceil(N / 8), M) threadgroups. Needs K % 32 == 0.
template <typename T, bool NESTED, bool TG_TABLE>
[[kernel]] void bnb_gemv_4bit(
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
    constexpr uint R = BNB_GEMV_ROWS;
    constexpr uint C = BNB_GEMV_CHUNK;
    threadgroup float lut_tg[16];
    constant float* lut = bnb_mm_table(code, table);
    if (TG_TABLE) {
        if (tid < 16u) {
            lut_tg[tid] = lut[tid];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    const float offset = NESTED ? bnb_mm_offset(absmax_offset, offset_kind) : 0.0f;
    const bool vec_ok = (flags & BNB_MM_AVEC) != 0u;
    const uint row0 = tg.x * BNB_MM_ROWS_PER_TG + sg * R;
    const uint m = tg.y;
    device const T* a = A + m * lda;
    // Rows past N read row N - 1 (never stored), so that every lane stays in the loop.
    uint base[R];
    for (uint r = 0; r < R; ++r) {
        base[r] = min(row0 + r, N - 1u) * K;
    }
    float acc[R];
    for (uint r = 0; r < R; ++r) {
        acc[r] = 0.0f;
    }
    // Lanes past K in the last step leave the loop early: nothing below needs them until simd_sum.
    for (uint k = lane * C; k < K; k += 32u * C) {
        float x[C];
        bnb_mm_load<C>(a + k, vec_ok, x);
        for (uint r = 0; r < R; ++r) {
            const uint idx = base[r] + k;
            uint w[C / 8u];
            bnb_mm_chunk<C>(B, idx, w);
            const float s = bnb_mm_scale<NESTED>(idx >> block_shift, absmax, absmax_8bit, absmax_code, offset);
            acc[r] += TG_TABLE ? bnb_mm_dot<T, C>(w, x, &lut_tg[0], s) : bnb_mm_dot<T, C>(w, x, lut, s);
        }
    }
    for (uint r = 0; r < R; ++r) {
        const float v = bnb_mm_lane_sum(acc[r]);
        if (lane == 0u && row0 + r < N) {
            bnb_mm_store(out, bias, flags, m, row0 + r, N, v);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// batch: up to 8 rows of A per threadgroup. Threadgroup: 128 threads (4 simdgroups x 2 weight
// rows); grid: (ceil(N / 8), ceil(M / 8)) threadgroups. Needs K % 16 == 0.
template <typename T, bool NESTED>
[[kernel]] void bnb_gemm_4bit_batch(
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
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
    constexpr uint R = BNB_BATCH_ROWS;
    constexpr uint MT = BNB_BATCH_M;
    constexpr uint C = BNB_BATCH_CHUNK;
    constant float* lut = bnb_mm_table(code, table);
    const float offset = NESTED ? bnb_mm_offset(absmax_offset, offset_kind) : 0.0f;
    const bool vec_ok = (flags & BNB_MM_AVEC) != 0u;
    const uint row0 = tg.x * BNB_MM_ROWS_PER_TG + sg * R;
    const uint m0 = tg.y * MT;
    const uint mcount = min(MT, M - m0);  // the same for the whole threadgroup
    uint base[R];
    for (uint r = 0; r < R; ++r) {
        base[r] = min(row0 + r, N - 1u) * K;
    }
    float acc[MT][R];
    for (uint i = 0; i < MT; ++i) {
        for (uint r = 0; r < R; ++r) {
            acc[i][r] = 0.0f;
        }
    }
    for (uint k = lane * C; k < K; k += 32u * C) {
        // Dequantize each weight row's chunk once...
        float t[R][C];
        for (uint r = 0; r < R; ++r) {
            const uint idx = base[r] + k;
            uint w[C / 8u];
            bnb_mm_chunk<C>(B, idx, w);
            const float s = bnb_mm_scale<NESTED>(idx >> block_shift, absmax, absmax_8bit, absmax_code, offset);
            bnb_mm_dequant_chunk<T, C>(w, lut, s, t[r]);
        }
        // ... and use it for every row of A.
        for (uint i = 0; i < MT; ++i) {
            if (i < mcount) {
                float x[C];
                bnb_mm_load<C>(A + (m0 + i) * lda + k, vec_ok, x);
                for (uint r = 0; r < R; ++r) {
                    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    for (uint j = 0; j < C; ++j) {
                        d[j & 3u] = fma(x[j], t[r][j], d[j & 3u]);
                    }
                    acc[i][r] += bnb_mm_sum4(d);
                }
            }
        }
    }
    for (uint i = 0; i < MT; ++i) {
        if (i < mcount) {  // uniform over the threadgroup
            for (uint r = 0; r < R; ++r) {
                const float v = bnb_mm_lane_sum(acc[i][r]);
                if (lane == 0u && row0 + r < N) {
                    bnb_mm_store(out, bias, flags, m0 + i, row0 + r, N, v);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// mma: simdgroup_matrix tiles. Threadgroup: 128 threads; grid: (ceil(M / 32), ceil(N / 64))
// threadgroups (consecutive threadgroups share a weight tile, which stays in cache). Any K.

// v[0..8) = A[m, k .. k + 8) as float, 0 outside [0, M) x [0, K).
template <typename T>
inline void bnb_mma_load_a8(device const T* A, uint m, uint k, uint M, uint K, uint lda, bool vec_ok,
                            thread float* v) {
    if (m < M && vec_ok && k + 8u <= K) {
        device const T* p = A + m * lda + k;
        const vec<T, 4> lo = *reinterpret_cast<device const vec<T, 4>*>(p);
        const vec<T, 4> hi = *reinterpret_cast<device const vec<T, 4>*>(p + 4u);
        for (uint j = 0; j < 4u; ++j) {
            v[j] = float(lo[j]);
            v[j + 4u] = float(hi[j]);
        }
    } else {
        for (uint j = 0; j < 8u; ++j) {
            v[j] = (m < M && k + j < K) ? float(A[m * lda + k + j]) : 0.0f;
        }
    }
}

// v[0..16) = dequant(W)[n, k .. k + 16) in T (as floats, bnb_mm_weight), 0 outside [0, N) x [0, K).
template <typename T, bool NESTED>
inline void bnb_mma_dequant16(device const uchar* B, device const float* absmax, device const uchar* absmax_8bit,
                              device const float* absmax_code, float offset, constant float* lut, uint n, uint k,
                              uint N, uint K, uint block_shift, thread float* v) {
    if (n < N && (K & 15u) == 0u && k < K) {
        // One 8-byte load and one scale for the 16 nibbles (k and K are multiples of 16).
        const uint idx = n * K + k;
        uint w[2];
        bnb_mm_chunk<16u>(B, idx, w);
        const float s = bnb_mm_scale<NESTED>(idx >> block_shift, absmax, absmax_8bit, absmax_code, offset);
        for (uint j = 0; j < 8u; ++j) {
            const uint b = bnb_mm_byte(w, j);
            v[2u * j] = bnb_mm_weight<T>(lut[b >> 4], s);
            v[2u * j + 1u] = bnb_mm_weight<T>(lut[b & 15u], s);
        }
    } else {
        for (uint j = 0; j < 16u; ++j) {
            v[j] = 0.0f;
            if (n < N && k + j < K) {
                const uint idx = n * K + k + j;
                const uint b = B[idx >> 1];
                const uint nibble = (idx & 1u) != 0u ? (b & 15u) : (b >> 4);
                v[j] = bnb_mm_weight<T>(lut[nibble], bnb_mm_scale<NESTED>(idx >> block_shift, absmax, absmax_8bit,
                                                                          absmax_code, offset));
            }
        }
    }
}

template <typename T, bool NESTED>
[[kernel]] void bnb_gemm_4bit_mma(
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
    uint sg [[simdgroup_index_in_threadgroup]]) {
    constexpr uint BM = BNB_MMA_BM;
    constexpr uint BN = BNB_MMA_BN;
    constexpr uint BK = BNB_MMA_BK;
    // One buffer, three uses: the A tile [BM][BK] at 0 and the W tile [BK][BN] (k-major, so
    // that it is the right-hand 8x8 operand without transposition) at BM * BK during the K
    // loop; afterwards the output tile [BM][BN] (<= the two) at 0. 12 KB.
    threadgroup float smem[BNB_MMA_BM * BNB_MMA_BK + BNB_MMA_BK * BNB_MMA_BN];
    constexpr uint WS = BM * BK;
    static_assert(BM * BN <= BM * BK + BK * BN, "the output tile must fit the staging buffer");
    static_assert(BM * BK == 8u * BNB_MMA_THREADS && BN * BK == 16u * BNB_MMA_THREADS,
                  "each thread stages 8 values of A and 16 of W per K step");
    static_assert(BM == 32u && BN == 64u, "4 simdgroups of 16 x 32 outputs");

    constant float* lut = bnb_mm_table(code, table);
    const float offset = NESTED ? bnb_mm_offset(absmax_offset, offset_kind) : 0.0f;
    const bool vec_ok = (flags & BNB_MM_AVEC) != 0u;
    const uint m0 = tg.x * BM;
    const uint n0 = tg.y * BN;
    // Simdgroup sg computes output rows sm*16 .. +16 and columns sn*32 .. +32 of the tile.
    const uint sm = sg >> 1;
    const uint sn = sg & 1u;
    // Who stages what: A row tid/4, 8 values from column (tid%4)*8; W row tid/2, 16 values from
    // column (tid%2)*16.
    const uint ar = tid >> 2, ac = (tid & 3u) * 8u;
    const uint wr = tid >> 1, wc = (tid & 1u) * 16u;

    // Running sums on two levels (see "Accumulation" above): `group` adds up the steps of a group of
    // BNB_MMA_GROUP K steps, `acc` the groups.
    simdgroup_float8x8 acc[2][4];
    simdgroup_float8x8 group[2][4];
    for (uint i = 0; i < 2u; ++i) {
        for (uint j = 0; j < 4u; ++j) {
            acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
            group[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        }
    }
    for (uint k0 = 0; k0 < K; k0 += BK) {
        float v[16];
        bnb_mma_load_a8(A, m0 + ar, k0 + ac, M, K, lda, vec_ok, v);
        for (uint j = 0; j < 8u; ++j) {
            smem[ar * BK + ac + j] = v[j];
        }
        bnb_mma_dequant16<T, NESTED>(B, absmax, absmax_8bit, absmax_code, offset, lut, n0 + wr, k0 + wc, N, K,
                                     block_shift, v);
        for (uint j = 0; j < 16u; ++j) {
            smem[WS + (wc + j) * BN + wr] = v[j];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        // This step's BK terms in fresh tiles (a chain of BK fused multiply-adds per element), then
        // added to the running sums (see "Accumulation" above).
        simdgroup_float8x8 part[2][4];
        for (uint kk = 0; kk < BK; kk += 8u) {
            simdgroup_float8x8 a[2];
            simdgroup_float8x8 b[4];
            for (uint i = 0; i < 2u; ++i) {
                simdgroup_load(a[i], smem + (sm * 16u + i * 8u) * BK + kk, BK);
            }
            for (uint j = 0; j < 4u; ++j) {
                simdgroup_load(b[j], smem + WS + kk * BN + sn * 32u + j * 8u, BN);
            }
            for (uint i = 0; i < 2u; ++i) {
                for (uint j = 0; j < 4u; ++j) {
                    if (kk == 0u) {
                        simdgroup_multiply(part[i][j], a[i], b[j]);
                    } else {
                        simdgroup_multiply_accumulate(part[i][j], a[i], b[j], part[i][j]);
                    }
                }
            }
        }
        // (thread_elements: this thread's two elements of a tile, the same two of every tile)
        const bool group_end = (k0 / BK + 1u) % BNB_MMA_GROUP == 0u || k0 + BK >= K;  // uniform
        for (uint i = 0; i < 2u; ++i) {
            for (uint j = 0; j < 4u; ++j) {
                thread float2& g = group[i][j].thread_elements();
                g = g + part[i][j].thread_elements();
                if (group_end) {
                    thread float2& sum = acc[i][j].thread_elements();
                    sum = sum + g;
                    g = float2(0.0f);
                }
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    for (uint i = 0; i < 2u; ++i) {
        for (uint j = 0; j < 4u; ++j) {
            simdgroup_store(acc[i][j], smem + (sm * 16u + i * 8u) * BN + sn * 32u + j * 8u, BN);
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Consecutive threads store consecutive columns of a row.
    for (uint e = tid; e < BM * BN; e += BNB_MMA_THREADS) {
        const uint m = m0 + e / BN;
        const uint n = n0 + e % BN;
        if (m < M && n < N) {
            bnb_mm_store(out, bias, flags, m, n, N, smem[e]);
        }
    }
}
