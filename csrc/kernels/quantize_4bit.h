// 4-bit blockwise quantization, NF4 and FP4 (docs/semantics.md section 3).
#pragma once

#include "bnb_common.h"
#include "quantize_layout.h"

#define BNB_FP4 0u
#define BNB_NF4 1u

// nibble -> value (float32, as bitsandbytes' tables).
constant float bnb_nf4_table[16] = {
    -1.0f, -0.6961928f, -0.52507305f, -0.3949175f, -0.28444138f, -0.18477343f, -0.091050036f, 0.0f,
    0.0795803f, 0.1609302f, 0.2461123f, 0.33791524f, 0.44070983f, 0.562617f, 0.72295684f, 1.0f};
// {0, 0.0625, 8, 12, 4, 6, 2, 3} / 12; bit 3 is the sign (nibble 8 is -0.0).
constant float bnb_fp4_table[16] = {
    0.0f, 0.0052083335f, 0.6666667f, 1.0f, 0.33333334f, 0.5f, 0.16666667f, 0.25f,
    -0.0f, -0.0052083335f, -0.6666667f, -1.0f, -0.33333334f, -0.5f, -0.16666667f, -0.25f};

// NF4: the number of midpoints fl32(c_k + c_{k+1}) / 2 strictly below s (ties to the lower
// nibble); NaN gives 0.
inline uint bnb_nf4_index(float s) {
    if (bnb_is_nan(s)) {
        return 0u;
    }
    uint q = 0u;
    for (uint k = 0; k < 15u; ++k) {
        q += s > (bnb_nf4_table[k] + bnb_nf4_table[k + 1u]) * 0.5f ? 1u : 0u;
    }
    return q;
}

// FP4: sign bit iff s < 0 (-0.0 and NaN are positive), magnitude by CUDA's decision tree of
// strict comparisons with these float32 constants; NaN gives 0.
inline uint bnb_fp4_index(float s) {
    if (bnb_is_nan(s)) {
        return 0u;
    }
    const float m = as_type<float>(as_type<uint>(s) & 0x7fffffffu);
    uint code;
    if (m > 0.29166667f) {
        code = m > 0.583333f ? (m > 0.8333333f ? 3u : 2u) : (m > 0.4166667f ? 5u : 4u);
    } else {
        code = m > 0.0859375f ? (m > 0.20833333f ? 7u : 6u) : (m > 0.00260417f ? 1u : 0u);
    }
    return code | (bnb_is_negative(s) ? 8u : 0u);
}

template <uint QUANT>
inline uint bnb_4bit_index(float s) {
    return QUANT == BNB_NF4 ? bnb_nf4_index(s) : bnb_fp4_index(s);
}

// The nibble of x in a block with reciprocal `rc`: the index of s = bnb_scaled(x, rc). FP4's sign
// bit is that of the IEEE s (set iff s < 0): where the GPU flushes a non-zero subnormal s to -0.0,
// the sign comes from x. (NF4 and the magnitude codes are the same for a subnormal s and for 0.)
template <uint QUANT>
inline uint bnb_4bit_code(float x, bnb_recip rc) {
    const float s = bnb_scaled(x, rc);
    uint q = bnb_4bit_index<QUANT>(s);
    if (QUANT == BNB_FP4 && s == 0.0f && bnb_is_negative(x) && bnb_scaled_is_nonzero(x, rc)) {
        q |= 8u;
    }
    return q;
}

template <uint QUANT>
inline float bnb_4bit_value(uint nibble) {
    return QUANT == BNB_NF4 ? bnb_nf4_table[nibble] : bnb_fp4_table[nibble];
}

// quantize_4bit: packed[j] = nibble(A[2j]) << 4 | nibble(A[2j+1]); absmax per block. For odd n
// the last low nibble encodes s = 0 of the last block (the element past the end loads as 0).
// Each lane takes a run of W = 2 * PAIRS_PER_LANE consecutive elements (W / 2 packed bytes).
// Launch: BNB_QUANT_THREADS(BLOCKSIZE) threads per threadgroup,
// ceil(n / BNB_QUANT_TG_ELEMS(BLOCKSIZE)) threadgroups (1-D).
template <typename T, uint BLOCKSIZE, uint QUANT>
[[kernel]] void bnb_quantize_4bit(
    device const T* A [[buffer(0)]],
    device uchar* packed [[buffer(1)]],
    device float* absmax [[buffer(2)]],
    constant uint& n [[buffer(3)]],
    uint tg [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
    constexpr uint W = BNB_SG_ELEMS(BLOCKSIZE) / 32u;
    threadgroup uint partial[BNB_MAX_SIMDS_PER_BLOCK];

    const uint start = bnb_slice_start<BLOCKSIZE>(tg, sg);
    const uint first = start + lane * W;
    float v[W];
    bnb_load_run<W>(A, first, n, v);
    uint bits = 0u;
    for (uint i = 0; i < W; ++i) {
        bits = max(bits, bnb_abs_bits(v[i]));
    }
    // With blocksize 32 a simdgroup holds two blocks: lanes 0-15 and 16-31.
    const uint sub = BLOCKSIZE < 64u ? first % BNB_SG_ELEMS(BLOCKSIZE) / BLOCKSIZE : 0u;
    bits = bnb_block_max_bits<BLOCKSIZE>(bits, sub, lane, sg, partial);

    const float amax = as_type<float>(bits);
    const bnb_recip rc = bnb_block_recip(bits);
    // The lane holding a block's first element writes its absmax (lanes 0 and 16 for blocksize 32).
    const uint block = first / BLOCKSIZE;
    if (first % BLOCKSIZE == 0u && block < bnb_num_blocks<BLOCKSIZE>(n)) {
        absmax[block] = amax;
    }
    uint b[W / 2u];
    for (uint i = 0; i < W / 2u; ++i) {
        // An all-zero block is stored as nibbles 0 explicitly (0 * inf = NaN would give them too,
        // but not under every math mode).
        b[i] = bits == 0u ? 0u : (bnb_4bit_code<QUANT>(v[2u * i], rc) << 4) | bnb_4bit_code<QUANT>(v[2u * i + 1u], rc);
    }
    bnb_store_bytes<W / 2u>(packed, first / 2u, (n + 1u) / 2u, b);
}

// dequantize_4bit: out[i] = T(table[nibble_i] * absmax[i >> blocksize_log2]), nibble 2j the
// high nibble of byte j (blocksizes are powers of two: a shift, not a division, per element). Launch: 256 threads per threadgroup, ceil(ceil(n / 2) / 1024) threadgroups
// (1-D); each thread handles a run of 4 bytes (one 4-byte load, 8 elements in two 4-element
// stores when all are in range).
#define BNB_DEQUANT4_THREADS 256u
#define BNB_DEQUANT4_BYTES_PER_THREAD 4u

template <typename T, uint QUANT>
[[kernel]] void bnb_dequantize_4bit(
    device const uchar* packed [[buffer(0)]],
    device const float* absmax [[buffer(1)]],
    device T* out [[buffer(2)]],
    constant uint& n [[buffer(3)]],
    constant uint& blocksize_log2 [[buffer(4)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]]) {
    const uint nbytes = (n + 1u) / 2u;
    const uint j = (tg * BNB_DEQUANT4_THREADS + tid) * BNB_DEQUANT4_BYTES_PER_THREAD;
    if (j >= nbytes) {
        return;
    }
    uchar4 bytes = uchar4(0);
    if (j + 4u <= nbytes) {
        bytes = *reinterpret_cast<const device uchar4*>(packed + j);
    } else {
        for (uint k = 0; j + k < nbytes; ++k) {
            bytes[k] = packed[j + k];
        }
    }
    float v[8];
    for (uint k = 0; k < 4u; ++k) {
        // blocksize is even: both nibbles of a byte share a block.
        const float scale = absmax[min(2u * (j + k), n - 1u) >> blocksize_log2];
        v[2u * k] = bnb_4bit_value<QUANT>(bytes[k] >> 4) * scale;
        v[2u * k + 1u] = bnb_4bit_value<QUANT>(bytes[k] & 15u) * scale;
    }
    bnb_store_run8(out, 2u * j, n, v);
}
