// How the blockwise quantizers spread a tensor over threadgroups and simdgroups, and the
// blockwise absmax reduction they share.
//
// A simdgroup (32 lanes) covers SG_ELEMS consecutive elements: the whole block when the block
// has 64..256 elements, two blocks of 32 (4-bit, blocksize 32), or a 256-element slice of a
// larger block. Loads are striped: at step i, lane l takes element (or element pair)
// i * 32 + l of its slice, so each load instruction of a simdgroup touches consecutive memory.
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
