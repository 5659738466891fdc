// How the blockwise quantizers spread a tensor over threadgroups and simdgroups, and the
// blockwise absmax reduction they share.
//
// A simdgroup (32 lanes) covers SG_ELEMS consecutive elements: the whole block when the block
// has 64..256 elements, two blocks of 32 (4-bit, blocksize 32), or a 256-element slice of a
// larger block. Lane l takes the W = SG_ELEMS / 32 consecutive elements l * W .. l * W + W - 1
// of its slice with one or two vector loads, so a simdgroup reads its slice as one contiguous
// run. Vector accesses need their natural alignment: the op layer binds every tensor a kernel
// accesses with vectors at a 16-byte aligned address.
//   - blocksize <= 256: 4 independent simdgroups per threadgroup (128 threads), one slice each.
//   - blocksize  > 256: blocksize / 256 simdgroups share one block (64..512 threads), and the
//     per-simdgroup maxima meet in threadgroup memory.
#pragma once

#include "bnb_common.h"

// Elements one simdgroup covers for a given blocksize (clamped to 64..256).
#define BNB_SG_ELEMS(BLOCKSIZE) ((BLOCKSIZE) < 64u ? 64u : ((BLOCKSIZE) > 256u ? 256u : (BLOCKSIZE)))
// Simdgroups that share one block (1 unless blocksize > 256).
#define BNB_SIMDS_PER_BLOCK(BLOCKSIZE) ((BLOCKSIZE) > 256u ? (BLOCKSIZE) / 256u : 1u)
// Slots for the per-simdgroup maxima (4096 / 256); a plain literal so that the array has the
// same fixed size in every instantiation.
#define BNB_MAX_SIMDS_PER_BLOCK 16
// Independent simdgroups per threadgroup when a block fits one simdgroup.
#define BNB_SLICES_PER_TG 4u
// Threads per threadgroup a quantize kernel of this blocksize must be launched with.
#define BNB_QUANT_THREADS(BLOCKSIZE) (32u * ((BLOCKSIZE) > 256u ? (BLOCKSIZE) / 256u : BNB_SLICES_PER_TG))
// Elements one threadgroup covers.
#define BNB_QUANT_TG_ELEMS(BLOCKSIZE) ((BLOCKSIZE) > 256u ? (BLOCKSIZE) : BNB_SLICES_PER_TG * BNB_SG_ELEMS(BLOCKSIZE))

// Where this simdgroup's slice starts, in elements. All arithmetic is compile-time but `tg`/`sg`.
template <uint BLOCKSIZE>
inline uint bnb_slice_start(uint tg, uint sg) {
    if (BLOCKSIZE > 256u) {
        return tg * BLOCKSIZE + sg * 256u;
    }
    return (tg * BNB_SLICES_PER_TG + sg) * BNB_SG_ELEMS(BLOCKSIZE);
}

// The block-wide max of `bits` (bnb_abs_bits values) for the block holding this lane's
// elements. `sub` is the lane's block within its simdgroup (0, or 0/1 when two 32-element blocks
// share a simdgroup). Every lane of the threadgroup must call this (it holds SIMD collectives
// and, for blocks larger than 256, a threadgroup barrier). `partial` has one slot per simdgroup.
template <uint BLOCKSIZE>
inline uint bnb_block_max_bits(uint bits, uint sub, uint lane, uint sg, threadgroup uint* partial) {
    constexpr uint BLOCKS_PER_SG = BNB_SG_ELEMS(BLOCKSIZE) / (BLOCKSIZE < 64u ? BLOCKSIZE : BNB_SG_ELEMS(BLOCKSIZE));
    uint result = 0u;
    // One uniform simd_max per block of the simdgroup; lanes of other blocks contribute 0.
    for (uint g = 0; g < BLOCKS_PER_SG; ++g) {
        uint m = simd_max(sub == g ? bits : 0u);
        if (sub == g) {
            result = m;
        }
    }
    if (BNB_SIMDS_PER_BLOCK(BLOCKSIZE) > 1u) {
        if (lane == 0u) {
            partial[sg] = result;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        result = 0u;
        for (uint j = 0; j < BNB_SIMDS_PER_BLOCK(BLOCKSIZE); ++j) {
            result = max(result, partial[j]);
        }
    }
    return result;
}

// Number of blocks of n elements, without overflowing n + BLOCKSIZE - 1.
template <uint BLOCKSIZE>
inline uint bnb_num_blocks(uint n) {
    return n / BLOCKSIZE + (n % BLOCKSIZE != 0u ? 1u : 0u);
}

// Loads element idx as float, 0 past the end (zeros do not change a block's absmax).
template <typename T>
inline float bnb_load(const device T* src, uint idx, uint n) {
    return idx < n ? float(src[idx]) : 0.0f;
}

// v[0..W) = elements idx .. idx + W - 1 as float (0 past n), W in {2, 4, 8}, idx a multiple of
// W: vector loads when the whole run is in range, scalar ones at the tail.
template <uint W, typename T>
inline void bnb_load_run(const device T* src, uint idx, uint n, thread float* v) {
    if (idx + W <= n) {
        if (W == 2u) {
            const vec<T, 2> x = *reinterpret_cast<const device vec<T, 2>*>(src + idx);
            v[0] = float(x[0]);
            v[1] = float(x[1]);
        } else {
            for (uint h = 0; h < W; h += 4u) {
                const vec<T, 4> x = *reinterpret_cast<const device vec<T, 4>*>(src + idx + h);
                for (uint k = 0; k < 4u; ++k) {
                    v[h + k] = float(x[k]);
                }
            }
        }
    } else {
        for (uint k = 0; k < W; ++k) {
            v[k] = bnb_load(src, idx + k, n);
        }
    }
}

// dst[idx .. idx + W) = b[0..W) for the indices below n, W in {1, 2, 4, 8}, idx a multiple of W:
// vector stores when the whole run is in range.
template <uint W>
inline void bnb_store_bytes(device uchar* dst, uint idx, uint n, thread const uint* b) {
    if (W >= 2u && idx + W <= n) {
        if (W == 2u) {
            *reinterpret_cast<device uchar2*>(dst + idx) = uchar2(uchar(b[0]), uchar(b[1]));
        } else {
            for (uint h = 0; h < W; h += 4u) {
                *reinterpret_cast<device uchar4*>(dst + idx + h) =
                    uchar4(uchar(b[h]), uchar(b[h + 1u]), uchar(b[h + 2u]), uchar(b[h + 3u]));
            }
        }
    } else {
        for (uint k = 0; k < W; ++k) {
            if (idx + k < n) {
                dst[idx + k] = uchar(b[k]);
            }
        }
    }
}

// Eight values at dst (16-byte aligned) with one 16-byte store for the 2-byte types (a simdgroup's
// store instruction then covers 512 contiguous bytes, every line it touches full), two for float.
inline void bnb_store8(device half* dst, thread const float* v) {
    *reinterpret_cast<device uint4*>(dst) =
        uint4(as_type<uint>(half2(half(v[0]), half(v[1]))), as_type<uint>(half2(half(v[2]), half(v[3]))),
              as_type<uint>(half2(half(v[4]), half(v[5]))), as_type<uint>(half2(half(v[6]), half(v[7]))));
}
#if defined(__HAVE_BFLOAT__)
inline void bnb_store8(device bfloat* dst, thread const float* v) {
    *reinterpret_cast<device uint4*>(dst) =
        uint4(as_type<uint>(bfloat2(bfloat(v[0]), bfloat(v[1]))), as_type<uint>(bfloat2(bfloat(v[2]), bfloat(v[3]))),
              as_type<uint>(bfloat2(bfloat(v[4]), bfloat(v[5]))), as_type<uint>(bfloat2(bfloat(v[6]), bfloat(v[7]))));
}
#endif
inline void bnb_store8(device float* dst, thread const float* v) {
    *reinterpret_cast<device float4*>(dst) = float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<device float4*>(dst + 4) = float4(v[4], v[5], v[6], v[7]);
}

// dst[idx .. idx + 8) = T(v[0..8)) for the indices below n, idx a multiple of 8 (dst 16-byte
// aligned): vector stores when all eight are in range.
template <typename T>
inline void bnb_store_run8(device T* dst, uint idx, uint n, thread const float* v) {
    if (idx + 8u <= n) {
        bnb_store8(dst + idx, v);
    } else {
        for (uint k = 0; k < 8u; ++k) {
            if (idx + k < n) {
                dst[idx + k] = T(v[k]);
            }
        }
    }
}
