// LLM.int8() kernels (docs/semantics.md section 6). Bodies: int8.h (quantization, dequantization),
// int8_matmul.h (exact int8 products and their fused dequantization).
//
// Host names: <dt> is f16 (half), bf16 (bfloat) or f32 (float). Tensors are flat, contiguous and
// bound 16-byte aligned. rows = numel / cols; every count is uint32 (the op layer keeps every
// tensor below 2^32 - 8192 elements). <tb> is the bit pattern of the smallest float32 >= the
// outlier threshold (> 0): |x| >= threshold is then exactly |x| >= as_type<float>(tb).
//
// bnb_int8_vectorwise_quant_<dt>                       int8_vectorwise_quant, threshold 0
//   buffer(0) A          device const <dt>*   rows x cols
//   buffer(1) CA         device char*         rows x cols
//   buffer(2) row_stats  device float*        rows
//   buffer(3) cols       constant uint&
//   threadgroup: (T, 1, 1), T in {32, 64, 128, 256} (the op layer: ~cols / 16, at least 32)
//   grid:        (rows, 1, 1) threadgroups: one row each
//
// bnb_int8_vectorwise_quant_outliers_<dt>              int8_vectorwise_quant, threshold > 0
//   buffers 0-3 as above, then
//   buffer(4) flags      device atomic_uint*  ceil(cols / 32) words, zeroed by the caller; bit c % 32
//                                             of word c / 32 set when column c holds an outlier
//   buffer(5) tb         constant uint&
//   geometry as above. Outliers are 0 in CA and left out of row_stats; the other elements of
//   outlier columns are zeroed afterwards by bnb_int8_outlier_finish.
//
// bnb_int8_outlier_finish
//   buffer(0) flags         device const uint*  ceil(cols / 32) words (complete)
//   buffer(1) CA            device char*        rows x cols (any buffer when zero_rows == 0)
//   buffer(2) outlier_cols  device long*        capacity cols: the flagged columns, ascending
//   buffer(3) count         device uint*        1: how many were written
//   buffer(4) cols          constant uint&
//   buffer(5) zero_rows     constant uint&      rows of CA whose flagged columns become 0
//   threadgroup: (256, 1, 1)
//   grid:        (1 + ceil(zero_rows * ceil(cols / 32) / 256), 1, 1) threadgroups: threadgroup
//                0 writes the list, the others zero CA
//
// bnb_int8_double_quant_stats_<dt>                     int8_double_quant pass 1, threshold 0
//   buffer(0) A          device const <dt>*   rows x cols
//   buffer(1) row_stats  device float*        rows
//   buffer(2) col_stats  device atomic_uint*  cols, zeroed by the caller (float bits, atomic max)
//   buffer(3) rows       constant uint&
//   buffer(4) cols       constant uint&
//   threadgroup: (T, 1, 1), T in {32, 64, 128, 256}
//   grid:        (ceil(rows / 32), 1, 1) threadgroups: 32 rows each
// bnb_int8_double_quant_stats_outliers_<dt>            the same with a threshold
//   buffers 0-4 as above, buffer(5) flags (as above, zeroed), buffer(6) tb
//
// bnb_int8_double_quant_apply_<dt>                     int8_double_quant pass 2, threshold 0
//   buffer(0) A          device const <dt>*   rows x cols
//   buffer(1) row_stats  device const float*  rows
//   buffer(2) col_stats  device const float*  cols
//   buffer(3) CA         device char*         rows x cols
//   buffer(4) CAt        device char*         rows x cols (not transposed)
//   buffer(5) cols       constant uint&
//   threadgroup: (T, 1, 1), T in {32, 64, 128, 256}
//   grid:        (ceil(cols / (4 T)), rows, 1) threadgroups: 4 columns per thread
// bnb_int8_double_quant_apply_outliers_<dt>            the same with a threshold
//   buffers 0-5 as above, buffer(6) flags (complete), buffer(7) tb,
//   buffer(8) zero_cols constant uint& (1: zero flagged columns of CA, i.e. rows > 1)
//
// bnb_int8_vectorwise_dequant                          float32 out
//   buffer(0) A      device const char*   n
//   buffer(1) stats  device const float*  n / cols
//   buffer(2) out    device float*        n
//   buffer(3) n      constant uint&
//   buffer(4) cols   constant uint&
//   threadgroup: (256, 1, 1);  grid: (ceil(n / 1024), 1, 1): 4 elements per thread
//
// bnb_int8_mm_dequant_<dt>[_f32bias]                   bias of type <dt>, or float with _f32bias
//   buffer(0) A          device const int*    n = rows x cols
//   buffer(1) row_stats  device const float*  rows
//   buffer(2) col_stats  device const float*  cols
//   buffer(3) bias       device const <bias>* cols (any buffer when has_bias == 0)
//   buffer(4) out        device <dt>*         n
//   buffer(5) n          constant uint&
//   buffer(6) cols       constant uint&
//   buffer(7) has_bias   constant uint&
//   threadgroup: (256, 1, 1);  grid: (ceil(n / 1024), 1, 1): 4 elements per thread
//
// Products, A [M, K] int8, B [N, K] int8; <path> and geometry by M:
//   gemv1 (M == 1), gemv4 (M <= 8): threadgroup (128, 1, 1), grid (ceil(N / 16), ceil(M / MR), 1),
//                                   MR = 1 or 4
//   tile32 (M <= 32), tile64:       threadgroup (128, 1, 1), grid (ceil(N / 64), ceil(M / BM), 1),
//                                   BM = 32 or 64
//   suffix _k16 when K % 16 == 0 (16-byte loads of A and B), none otherwise.
//
// bnb_int8_linear_matmul_<path>[_k16]                  int32 out
//   buffer(0) A    device const char*  M x K
//   buffer(1) B    device const char*  N x K
//   buffer(2) out  device int*         M x N
//   buffer(3) M, buffer(4) N, buffer(5) K  constant uint&
//
// bnb_int8_scaled_mm_<dt>[_f32bias]_<path>[_k16]       <dt> out: int8_scaled_mm, int8_mixed_scaled_mm
//   buffer(0) A             device const char*   M x K
//   buffer(1) B             device const char*   N x K
//   buffer(2) row_stats     device const float*  M
//   buffer(3) col_stats     device const float*  N
//   buffer(4) bias          device const <bias>* N (any buffer when has_bias == 0)
//   buffer(5) out           device <dt>*         M x N
//   buffer(6) M, buffer(7) N, buffer(8) K, buffer(9) has_bias   constant uint&
//   buffer(10) Afp          device const <dt>*   M x K: the fp activations (mixed only)
//   buffer(11) outlier_cols device const long*   n_out column indices (mixed only)
//   buffer(12) subA         device <dt>*         M x n_out: Afp[:, outlier_cols] (mixed only)
//   buffer(13) n_out        constant uint&       0: plain int8_scaled_mm (buffers 10-12 unused,
//                                                any buffer)
#include "bnb_math_mode.h"
#include "int8_matmul.h"

#define BNB_INT8_QUANT_ALL(tname, type)                                                                         \
    BNB_KERNEL_INSTANTIATE("bnb_int8_vectorwise_quant_" #tname, bnb_int8_vectorwise_quant, type)              \
    BNB_KERNEL_INSTANTIATE("bnb_int8_vectorwise_quant_outliers_" #tname, bnb_int8_vectorwise_quant_outliers, type) \
    BNB_KERNEL_INSTANTIATE("bnb_int8_double_quant_stats_" #tname, bnb_int8_double_quant_stats, type)          \
    BNB_KERNEL_INSTANTIATE("bnb_int8_double_quant_stats_outliers_" #tname, bnb_int8_double_quant_stats_outliers, type) \
    BNB_KERNEL_INSTANTIATE("bnb_int8_double_quant_apply_" #tname, bnb_int8_double_quant_apply, type)          \
    BNB_KERNEL_INSTANTIATE("bnb_int8_double_quant_apply_outliers_" #tname, bnb_int8_double_quant_apply_outliers, type)

// One output type and bias type: mm_dequant and the eight product paths.
#define BNB_INT8_SCALED_ALL(name, type, btype)                                                                   \
    BNB_KERNEL_INSTANTIATE("bnb_int8_mm_dequant_" #name, bnb_int8_mm_dequant, type, btype)                    \
    BNB_KERNEL_INSTANTIATE("bnb_int8_scaled_mm_" #name "_gemv1", bnb_int8_gemv_scaled, type, btype, 1u, false) \
    BNB_KERNEL_INSTANTIATE("bnb_int8_scaled_mm_" #name "_gemv1_k16", bnb_int8_gemv_scaled, type, btype, 1u, true) \
    BNB_KERNEL_INSTANTIATE("bnb_int8_scaled_mm_" #name "_gemv4", bnb_int8_gemv_scaled, type, btype, 4u, false) \
    BNB_KERNEL_INSTANTIATE("bnb_int8_scaled_mm_" #name "_gemv4_k16", bnb_int8_gemv_scaled, type, btype, 4u, true) \
    BNB_KERNEL_INSTANTIATE("bnb_int8_scaled_mm_" #name "_tile32", bnb_int8_tiled_scaled, type, btype, 32u, false) \
    BNB_KERNEL_INSTANTIATE("bnb_int8_scaled_mm_" #name "_tile32_k16", bnb_int8_tiled_scaled, type, btype, 32u, true) \
    BNB_KERNEL_INSTANTIATE("bnb_int8_scaled_mm_" #name "_tile64", bnb_int8_tiled_scaled, type, btype, 64u, false) \
    BNB_KERNEL_INSTANTIATE("bnb_int8_scaled_mm_" #name "_tile64_k16", bnb_int8_tiled_scaled, type, btype, 64u, true)

BNB_KERNEL_INSTANTIATE("bnb_int8_linear_matmul_gemv1", bnb_int8_gemv_i32, 1u, false)
BNB_KERNEL_INSTANTIATE("bnb_int8_linear_matmul_gemv1_k16", bnb_int8_gemv_i32, 1u, true)
BNB_KERNEL_INSTANTIATE("bnb_int8_linear_matmul_gemv4", bnb_int8_gemv_i32, 4u, false)
BNB_KERNEL_INSTANTIATE("bnb_int8_linear_matmul_gemv4_k16", bnb_int8_gemv_i32, 4u, true)
BNB_KERNEL_INSTANTIATE("bnb_int8_linear_matmul_tile32", bnb_int8_tiled_i32, 32u, false)
BNB_KERNEL_INSTANTIATE("bnb_int8_linear_matmul_tile32_k16", bnb_int8_tiled_i32, 32u, true)
BNB_KERNEL_INSTANTIATE("bnb_int8_linear_matmul_tile64", bnb_int8_tiled_i32, 64u, false)
BNB_KERNEL_INSTANTIATE("bnb_int8_linear_matmul_tile64_k16", bnb_int8_tiled_i32, 64u, true)

BNB_INT8_QUANT_ALL(f16, half)
BNB_INT8_QUANT_ALL(f32, float)
BNB_INT8_SCALED_ALL(f16, half, half)
BNB_INT8_SCALED_ALL(f16_f32bias, half, float)
BNB_INT8_SCALED_ALL(f32, float, float)
// bfloat needs Metal 3.1 (macOS 14), as bf16 tensors on mps do; older systems still get the rest.
#if defined(__HAVE_BFLOAT__)
BNB_INT8_QUANT_ALL(bf16, bfloat)
BNB_INT8_SCALED_ALL(bf16, bfloat, bfloat)
BNB_INT8_SCALED_ALL(bf16_f32bias, bfloat, float)
#endif
