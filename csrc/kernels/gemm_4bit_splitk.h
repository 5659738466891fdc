// 4-bit (NF4 / FP4) products for small batches, 2 <= M <= 32 rows of A, split over K:
// y = A @ dequant(W).T (+ bias), docs/semantics.md section 4. Layout of W, A, y, the scales and the
// buffers: gemm_4bit.h and gemm_4bit_splitk.metal.
//
// Each weight byte and block scale is read once per call, as in the small kernel (gemm_4bit_small.h),
// but a threadgroup does not run over the whole of K: the N output columns are cut into tiles of
// 16 x S columns and K into S slices, and threadgroup (tile, slice) computes the tile's columns over
// its slice for all M rows of A. So each threadgroup reads only its slice of A (A is read
// ceil(N / (16 S)) times in all, where the small kernel, with as many threadgroups, reads it
// ceil(N / 16) times), and the grid still has at least ceil(N / 16) threadgroups, half the gemv
// kernel's.
//
// The S partial sums of an output meet in a workspace (docs/small-batch.md has the traffic figures).
// Threadgroup (tile, slice) writes its tile's M x 16 S float32 partial sums to its own slot of `work`
// (`bnb_splitk_partials`); an output is then the sum of its S slots in slice order (0, 1, ..., S - 1),
// plus the bias, rounded once to T (`bnb_splitk_add`): the same float32 additions in the same order
// whoever adds them, so every path below gives the same bits for the same S. `work` (and `counters`)
// are a per-device workspace of the op layer (bnb_mps/ops/workspace.py), allocated once, not per call,
// proportional to the output (M x N x S floats), not to the weight. Two ways to add the slots:
//
//   bnb_gemm_4bit_splitk          one dispatch, Metal >= 3.2 only (instantiated only there). After
//                                 writing its slot, a threadgroup counts itself in `counters[tile]`;
//                                 the threadgroup that counts S-th, whichever it is, adds the tile's
//                                 slots. No threadgroup waits for another (nothing assumes forward
//                                 progress between threadgroups). A threadgroup sees another's
//                                 device-memory writes within a dispatch only through Metal 3.2's
//                                 memory model: `work` is coherent(device); every thread issues a
//                                 device-scope release fence after its writes, then the threadgroup
//                                 barrier, then thread 0 counts; after the barrier that follows the
//                                 count, every thread of the last threadgroup issues a device-scope
//                                 acquire fence before it reads other slots. Below 3.2 nothing makes
//                                 that hand-over visible, so the kernel does not exist there.
//   bnb_gemm_4bit_splitk_partial  two dispatches, every language version: this one writes every
//   bnb_gemm_4bit_splitk_sum      slot; the sum kernel, encoded after it on the same stream (Metal
//                                 orders a compute encoder's dispatches), adds them. No counters.
//
// A counter holds the call's `tag` (bits 5..31: a number the op layer gives each call, unlike the tag
// any counter holds: never 0, and a count of calls that wraps only after 2^27 - 1 of them) and its
// count (bits 0..4). The first threadgroup of a call to count finds another tag and starts the count
// at 1 (nothing is reset after a call): a call that never finished (a GPU fault in the middle of a
// command buffer) leaves counts that the next call ignores.
//
// Inside a slice everything is the small kernel's (bnb_small_sums: A staged per step of 128 in
// threadgroup memory, 16 weights per lane dequantized once into registers, two alternating float32
// accumulators per row of A, the 8 lanes of a weight row added pairwise), once per group of 16
// columns of the tile (S groups; A's slice is staged again per group, lines the threadgroup has
// already read).
//
// Slices and lines. A weight row is K / 2 bytes, and a 128-byte line holds 256 of its weights; the
// slices are ceil(K / (256 S)) x 256 long (the last ones may be shorter, or empty: their partial sums
// are 0). Where K % 256 == 0 every row starts on a line, so slices cut no line: no line of the packed
// weight is read by two threadgroups. Otherwise row n starts phase(n) = (n K) % 256 weights into a line,
// and phase(n) repeats every P rows (P = 256 / the lowest set bit of K % 256: 2 where K % 256 == 128, 4
// where it is 64 or 192, up to 16). Where P divides S, each row is cut where its own lines begin:
// slice j of row n runs from j x span - phase(n) to (j + 1) x span - phase(n) (the first from 0, the
// last to K), and each group of 16 rows of a tile takes rows of one phase (rows c, c + P, c + 2 P, ...
// of the tile), so that the group's rows share one range of K and one staging of A, shifted by the
// phase: no line of the weight is then read by two threadgroups but the one that holds a row's end
// and the next row's start (the last slice of the one, the first of the other), for A's slice widened
// by up to 256 - 256 / P columns over the tile's groups. Where P does not divide S (K % 256 == 16,
// say) the slices cut every row at the same K, and the lines they cut are read by two threadgroups.
//
// The last tile. Where N is not a multiple of 16 S, the last tile holds fewer groups of 16 rows than S,
// and S threadgroups would each read all of A's slice, write partial sums and touch the scales' and
// tables' lines for those few rows. It takes fewer slices instead: the least power of two S' >= its
// groups (1 where it has 16 rows or fewer, which then adds its one slot), each threadgroup K / S' of
// its S' groups, as much work as every other threadgroup's. So the grid has ceil(N / 16) threadgroups
// or a few more (half the gemv kernel's), and no threadgroup idles.
//
// Geometry (threadgroups of 128 threads; `splits` = S; tiles = ceil(N / (16 S))):
//   splitk, splitk_partial: ((tiles - 1) S + S', 1, 1), threadgroup x taking slice x % S of tile x / S
//   splitk_sum:             (tiles, ceil(M x 16 S / 128), 1), threadgroup (t, c) adding elements
//                           128 c .. 128 c + 127 of tile t's M x 16 S outputs
// Needs K % 16 == 0, 1 <= M <= 32, S a power of two from 1 to 16 (the op layer takes 2, 4, 8 or 16)
// and 1 <= tag < 2^27.
#pragma once

#include "gemm_4bit_small.h"

#define BNB_SPLITK_SIMDS 4u     // simdgroups per threadgroup: 16 columns per group
#define BNB_SPLITK_THREADS 128u  // threads per threadgroup, of every split-K kernel
#define BNB_SPLITK_ALIGN 256u   // slices start at multiples of 256 in K: a 128-byte line of a weight row
#define BNB_SPLITK_COUNT_BITS 5u  // a tile counter: the call's tag above its count of threadgroups (S <= 31)
#define BNB_SPLITK_COUNT_MASK 31u

// S of tile `tile`: `splits`, but for a last tile of fewer groups of 16 rows, which takes the least power
// of two of slices that is not below its groups (see "The last tile" above).
inline uint bnb_splitk_tile_slices(uint N, uint splits, uint tile) {
    const uint cols = BNB_SPLITK_SIMDS * BNB_SMALL_ROWS * splits;
    const uint groups = (min(cols, N - tile * cols) + BNB_SPLITK_SIMDS * BNB_SMALL_ROWS - 1u) /
                        (BNB_SPLITK_SIMDS * BNB_SMALL_ROWS);
    uint S = 1u;
    while (S < groups) {
        S <<= 1u;
    }
    return S;
}

// Threadgroup x's partial sums (slice x % splits of tile x / splits) into its slot of `work`
// ([mcount][16 splits] float32). `Work` is `device float*`, or `coherent(device) device float*` where
// another threadgroup of the dispatch reads the slots. Returns the tile's S.
template <typename T, bool NESTED, typename Work>
inline uint bnb_splitk_partials(device const T* A, device const uchar* B, device const float* absmax,
                                device const uchar* absmax_8bit, device const float* absmax_code,
                                device const uchar* absmax_offset, constant float* code, uint M, uint N, uint K,
                                uint lda, uint block_shift, uint table, uint offset_kind, uint splits, Work work,
                                uint x, threadgroup T* a_tile, uint tid, uint lane, uint sg) {
    constexpr uint GROUP = BNB_SPLITK_SIMDS * BNB_SMALL_ROWS;  // columns per group: 16
    constant float* lut = bnb_mm_table(code, table);
    const float offset = NESTED ? bnb_mm_offset(absmax_offset, offset_kind) : 0.0f;
    const uint cols = GROUP * splits;  // columns per tile
    const uint mcount = min(M, BNB_SMALL_M);  // (the op layer never launches more rows)
    const uint q = lane % BNB_SMALL_LANES;
    const uint tile = x / splits;
    const uint slice = x % splits;
    const uint S = bnb_splitk_tile_slices(N, splits, tile);
    // K per slice, a multiple of 256 (see "Slices and lines" above)
    const uint span = (K + BNB_SPLITK_ALIGN * S - 1u) / (BNB_SPLITK_ALIGN * S) * BNB_SPLITK_ALIGN;
    // P, the rows after which a row's phase in its line repeats; 1 (no phases) where P does not divide S
    const uint rest = K % BNB_SPLITK_ALIGN;
    const uint period = rest == 0u ? 1u : BNB_SPLITK_ALIGN / (rest & (0u - rest));
    const uint P = S % period == 0u ? period : 1u;
    Work slot = work + x * (mcount * cols);

    for (uint g = 0; g < S; ++g) {
        // Group g holds the tile's rows of phase class c = g % P: rows (16 (g / P) + p) P + c, p < 16.
        const uint c = g % P;
        const uint col = (GROUP * (g / P) + sg * BNB_SMALL_ROWS + lane / BNB_SMALL_LANES) * P + c;  // (in the tile)
        const uint row = tile * cols + col;  // weight row = output column
        // Rows past N read a row of their phase below N, or row N - 1 (never stored), so that every lane
        // takes the same path over lines the tile reads anyway.
        const uint back = row < N ? 0u : (row - (N - 1u) + P - 1u) / P * P;
        const uint base = (back <= row ? row - back : N - 1u) * K;
        // The group's range of K: the slice's, moved back by the phase of its rows (0 where P = 1;
        // tile * cols is a multiple of 16 S and so of P), so that it starts on a line of each row.
        const uint phase = P == 1u ? 0u : (c * K) % BNB_SPLITK_ALIGN;
        const uint k_begin = slice == 0u ? 0u : min(K, slice * span - phase);
        const uint k_end = slice + 1u == S ? K : min(K, (slice + 1u) * span - phase);
        float v[BNB_SMALL_M];
        bnb_small_sums<T, NESTED, BNB_SPLITK_SIMDS>(A, B, absmax, absmax_8bit, absmax_code, lut, offset, lda,
                                                    block_shift, mcount, base, k_begin, k_end, a_tile, tid, q, v);
        for (uint i = 0; i < BNB_SMALL_M; ++i) {
            // The 8 lanes of a weight row hold the same sum: lane q stores rows i = q, q + 8, ...
            if (i < mcount && i % BNB_SMALL_LANES == q && row < N) {
                slot[i * cols + col] = v[i];
            }
        }
    }
    return S;
}

// Output e = i x cols + col of tile `tile` (cols = 16 splits; `tile_work`: the tile's S slots, `size`
// floats apart): the S slots added in slice order (0, 1, ..., S - 1), the bias added, rounded once to T.
template <typename T, typename Work>
inline void bnb_splitk_add(Work tile_work, uint S, uint size, uint e, uint cols, uint tile, uint N, device T* out,
                           device const T* bias, uint flags) {
    const uint i = e / cols;
    const uint col = e % cols;
    const uint n = tile * cols + col;
    if (n < N) {
        float v = tile_work[e];
        for (uint s = 1; s < S; ++s) {
            v += tile_work[s * size + e];
        }
        bnb_mm_store(out, bias, flags, i, n, N, v);
    }
}

#if __METAL_VERSION__ >= 320
// One dispatch: the slots handed over between the threadgroups of a tile (see the top of this file).
template <typename T, bool NESTED>
[[kernel]] void bnb_gemm_4bit_splitk(
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
    constant uint& splits [[buffer(17)]],
    coherent(device) device float* work [[buffer(18)]],
    device atomic_uint* counters [[buffer(19)]],
    constant uint& tag [[buffer(20)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
    threadgroup T a_tile[BNB_SMALL_M * BNB_SMALL_KS];
    threadgroup uint last[1];
    const uint S = bnb_splitk_partials<T, NESTED>(A, B, absmax, absmax_8bit, absmax_code, absmax_offset, code, M, N,
                                                  K, lda, block_shift, table, offset_kind, splits, work, tg.x, a_tile,
                                                  tid, lane, sg);
    const uint tile = tg.x / splits;
    // Release: this thread's partial sums, for every thread of the device, before the count that the
    // barrier orders after them. A count of another tag is another call's: this call's starts at 1.
    atomic_thread_fence(mem_flags::mem_device, memory_order_release, thread_scope_device);
    threadgroup_barrier(mem_flags::mem_device);
    if (tid == 0u) {
        uint seen = atomic_load_explicit(&counters[tile], memory_order_relaxed);
        uint counted;
        do {
            counted = (seen >> BNB_SPLITK_COUNT_BITS) == tag ? seen + 1u : (tag << BNB_SPLITK_COUNT_BITS) | 1u;
        } while (!atomic_compare_exchange_weak_explicit(&counters[tile], &seen, counted, memory_order_relaxed,
                                                       memory_order_relaxed));
        last[0] = (counted & BNB_SPLITK_COUNT_MASK) == S ? 1u : 0u;
    }
    threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
    if (last[0] == 0u) {  // (uniform over the threadgroup)
        return;
    }
    // Acquire, in every thread that reads: the other threadgroups' partial sums that the count observed.
    atomic_thread_fence(mem_flags::mem_device, memory_order_acquire, thread_scope_device);
    const uint cols = BNB_SPLITK_SIMDS * BNB_SMALL_ROWS * splits;
    const uint size = min(M, BNB_SMALL_M) * cols;
    coherent(device) device float* tile_work = work + tile * splits * size;
    for (uint e = tid; e < size; e += BNB_SPLITK_THREADS) {
        bnb_splitk_add(tile_work, S, size, e, cols, tile, N, out, bias, flags);
    }
}
#endif

// Two dispatches, 1 of 2: every threadgroup's partial sums into its slot (buffers 0..18 as the
// one-dispatch kernel's; bias, out and flags bound, not read).
template <typename T, bool NESTED>
[[kernel]] void bnb_gemm_4bit_splitk_partial(
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
    constant uint& splits [[buffer(17)]],
    device float* work [[buffer(18)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
    threadgroup T a_tile[BNB_SMALL_M * BNB_SMALL_KS];
    bnb_splitk_partials<T, NESTED>(A, B, absmax, absmax_8bit, absmax_code, absmax_offset, code, M, N, K, lda,
                                   block_shift, table, offset_kind, splits, work, tg.x, a_tile, tid, lane, sg);
}

// Two dispatches, 2 of 2: the outputs, each the sum of its tile's S slots. Buffers of its own:
//   buffer(0) work device const float*, buffer(1) bias, buffer(2) out (as buffers 18, 7 and 8 above),
//   buffer(3) M, buffer(4) N, buffer(5) flags, buffer(6) splits (as buffers 9, 10, 16 and 17).
template <typename T>
[[kernel]] void bnb_gemm_4bit_splitk_sum(
    device const float* work [[buffer(0)]],
    device const T* bias [[buffer(1)]],
    device T* out [[buffer(2)]],
    constant uint& M [[buffer(3)]],
    constant uint& N [[buffer(4)]],
    constant uint& flags [[buffer(5)]],
    constant uint& splits [[buffer(6)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
    const uint tile = tg.x;
    const uint cols = BNB_SPLITK_SIMDS * BNB_SMALL_ROWS * splits;
    const uint size = min(M, BNB_SMALL_M) * cols;
    const uint e = tg.y * BNB_SPLITK_THREADS + tid;
    if (e < size) {
        bnb_splitk_add(work + tile * splits * size, bnb_splitk_tile_slices(N, splits, tile), size, e, cols, tile, N,
                       out, bias, flags);
    }
}
