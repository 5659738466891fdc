// 4-bit (NF4 / FP4) GEMV and GEMM, y = A @ dequant(W).T (+ bias) (docs/semantics.md section 4). Bodies and
// design notes: gemm_4bit.h.
//
// Host names: <sc> is `absmax` (plain float32 block scales) or `nested` (double-quantized);
// <dt> is f16 (half), bf16 (bfloat) or f32 (float), the dtype of A, bias and out.
//
//   bnb_gemv_4bit_<sc>_<dt>         M = 1 (decode), table read from constant memory
//   bnb_gemv_4bit_tglut_<sc>_<dt>   the same with the table copied to threadgroup memory
//   bnb_gemm_4bit_batch_<sc>_<dt>   up to 8 rows of A per threadgroup (M = 1 when K % 32 != 0; a
//                                   tuning route up to M = 32)
//   bnb_gemm_4bit_mma_<sc>_<dt>     M > 32, or K % 16 != 0
//   bnb_gemm_4bit_small_<sc>_<dt>   2 <= M <= 32 below K = 512, each weight byte read once
//                                   (gemm_4bit_small.h)
//   bnb_gemm_4bit_small_wide_<sc>_<dt>  the same with 8 weight rows per threadgroup (gemv's grid)
//
// The split-K kernels (2 <= M <= 32 from K = 512) are a compile unit of their own, with the same
// buffers 0..16: gemm_4bit_splitk.metal.
//
// Buffers (the same for all six; unused ones are bound to any non-empty buffer, never read):
//   buffer(0)  A             device const <dt>*    [M, K] with row stride lda (elements)
//   buffer(1)  B             device const uchar*   the packed weight, ceil(N*K / 2) bytes
//                                                  (16-byte aligned; any quant_storage, as bytes)
//   buffer(2)  absmax        device const float*   <sc> absmax: ceil(N*K / blocksize) scales;
//                                                  nested: ceil(nblocks / 256) nested scales
//   buffer(3)  absmax_8bit   device const uchar*   nested: the 8-bit codes of the scales
//   buffer(4)  absmax_code   device const float*   nested: the 256-entry code of those
//   buffer(5)  absmax_offset device const uchar*   nested: the offset's bytes (see offset_kind)
//   buffer(6)  code          constant float*       the 16-entry table when table == 0
//   buffer(7)  bias          device const <dt>*    [N], read when flags & 1
//   buffer(8)  out           device <dt>*          [M, N] contiguous
//   buffer(9)  M, buffer(10) N, buffer(11) K, buffer(12) lda     constant uint&
//   buffer(13) block_shift   constant uint&        log2(blocksize), blocksize in 32..4096
//   buffer(14) table         constant uint&        0: code buffer, 1: NF4, 2: FP4
//   buffer(15) offset_kind   constant uint&        0: float32, 1: float16, 2: bfloat16
//   buffer(16) flags         constant uint&        1: add bias; 2: A is 16-byte aligned at
//                                                  every row start (vector loads)
//
// Geometry (threadgroup; grid in threadgroups):
//   gemv:  (64, 1, 1);  (ceil(N / 8), M, 1)                 K % 32 == 0
//   batch: (128, 1, 1); (ceil(N / 8), ceil(M / 8), 1)       K % 16 == 0
//   mma:   (128, 1, 1); (ceil(M / 32), ceil(N / 64), 1)     any K
//   small: (128, 1, 1); (ceil(N / 16), 1, 1)                K % 16 == 0, M <= 32
//   small_wide: (64, 1, 1); (ceil(N / 8), 1, 1)             K % 16 == 0, M <= 32
// Limits (op layer): N*K, (M - 1) * lda + K and M*N below 2^32 - 8192.
#include "bnb_math_mode.h"
#include "gemm_4bit.h"
#include "gemm_4bit_small.h"

#define BNB_INSTANTIATE_MATMUL4(sname, nested, tname, type)                                                  \
    BNB_KERNEL_INSTANTIATE("bnb_gemv_4bit_" #sname "_" #tname, bnb_gemv_4bit, type, nested, false)         \
    BNB_KERNEL_INSTANTIATE("bnb_gemv_4bit_tglut_" #sname "_" #tname, bnb_gemv_4bit, type, nested, true)    \
    BNB_KERNEL_INSTANTIATE("bnb_gemm_4bit_batch_" #sname "_" #tname, bnb_gemm_4bit_batch, type, nested)    \
    BNB_KERNEL_INSTANTIATE("bnb_gemm_4bit_mma_" #sname "_" #tname, bnb_gemm_4bit_mma, type, nested)        \
    BNB_KERNEL_INSTANTIATE("bnb_gemm_4bit_small_" #sname "_" #tname, bnb_gemm_4bit_small, type, nested, 4u)   \
    BNB_KERNEL_INSTANTIATE("bnb_gemm_4bit_small_wide_" #sname "_" #tname, bnb_gemm_4bit_small, type, nested, 2u)

BNB_INSTANTIATE_MATMUL4(absmax, false, f16, half)
BNB_INSTANTIATE_MATMUL4(absmax, false, f32, float)
BNB_INSTANTIATE_MATMUL4(nested, true, f16, half)
BNB_INSTANTIATE_MATMUL4(nested, true, f32, float)
// bfloat needs Metal 3.1 (macOS 14), as bf16 tensors on mps do. The bf16 kernels only load and
// store bfloat; all arithmetic (simdgroup_matrix included) is float.
#if defined(__HAVE_BFLOAT__)
BNB_INSTANTIATE_MATMUL4(absmax, false, bf16, bfloat)
BNB_INSTANTIATE_MATMUL4(nested, true, bf16, bfloat)
#endif
