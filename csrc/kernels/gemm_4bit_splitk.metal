// Split-K 4-bit (NF4 / FP4) products for 2 <= M <= 32 rows of A from K = 512, y = A @ dequant(W).T
// (+ bias) (docs/semantics.md section 4). Bodies and design notes: gemm_4bit_splitk.h. A compile unit
// of its own: the one-dispatch kernel's Metal 3.2 spelling (coherent(device), atomic_thread_fence)
// is the part of the source a compiler may reject, and a unit that does not compile takes only its
// own kernels out of service.
//
// Host names (<sc>, <dt> as in gemm_4bit.metal):
//   bnb_gemm_4bit_splitk_<sc>_<dt>          one dispatch; instantiated only at Metal >= 3.2
//   bnb_gemm_4bit_splitk_partial_<sc>_<dt>  two dispatches, 1: every threadgroup's partial sums
//   bnb_gemm_4bit_splitk_sum_<dt>           two dispatches, 2: the outputs from the partial sums
//
// Buffers of splitk and splitk_partial: 0..16 as in gemm_4bit.metal (the partial kernel does not read
// bias, out or flags), then
//   buffer(17) splits        constant uint&        S, slices of K (1, 2, 4, 8 or 16)
//   buffer(18) work          device float*         workspace, >= ceil(N / (16 S)) * S * M * 16 S floats
//                                                  (coherent(device) in the one-dispatch kernel)
//   one dispatch only:
//   buffer(19) counters      device atomic_uint*   ceil(N / (16 S)) counters (zeroed when allocated)
//   buffer(20) tag           constant uint&        the call's tag, 1..2^27 - 1, unlike the tag any
//                                                  counter holds (the op layer counts calls)
// Buffers of splitk_sum:
//   buffer(0) work device const float*, buffer(1) bias, buffer(2) out, buffer(3) M, buffer(4) N,
//   buffer(5) flags, buffer(6) splits: as buffers 18, 7, 8, 9, 10, 16 and 17 of splitk_partial
//
// Geometry (threadgroups of (128, 1, 1); tiles = ceil(N / (16 S)); S' the last tile's slices, the least
// power of two >= its groups of 16 columns):
//   splitk, splitk_partial: ((tiles - 1) S + S', 1, 1)       K % 16 == 0, M <= 32
//   splitk_sum:             (tiles, ceil(M * 16 S / 128), 1)  after splitk_partial, on the same stream
// Limits (op layer): as gemm_4bit.metal's, and tiles * S * M * 16 S below 2^32 - 8192.
#include "bnb_math_mode.h"
#include "gemm_4bit.h"
#include "gemm_4bit_small.h"
#include "gemm_4bit_splitk.h"

#if __METAL_VERSION__ >= 320
#define BNB_INSTANTIATE_SPLITK_ONE(sname, nested, tname, type) \
    BNB_KERNEL_INSTANTIATE("bnb_gemm_4bit_splitk_" #sname "_" #tname, bnb_gemm_4bit_splitk, type, nested)
#else
#define BNB_INSTANTIATE_SPLITK_ONE(sname, nested, tname, type)
#endif

#define BNB_INSTANTIATE_SPLITK(sname, nested, tname, type)                                                    \
    BNB_INSTANTIATE_SPLITK_ONE(sname, nested, tname, type)                                                    \
    BNB_KERNEL_INSTANTIATE("bnb_gemm_4bit_splitk_partial_" #sname "_" #tname, bnb_gemm_4bit_splitk_partial, type, \
                           nested)

BNB_INSTANTIATE_SPLITK(absmax, false, f16, half)
BNB_INSTANTIATE_SPLITK(absmax, false, f32, float)
BNB_INSTANTIATE_SPLITK(nested, true, f16, half)
BNB_INSTANTIATE_SPLITK(nested, true, f32, float)
BNB_KERNEL_INSTANTIATE("bnb_gemm_4bit_splitk_sum_f16", bnb_gemm_4bit_splitk_sum, half)
BNB_KERNEL_INSTANTIATE("bnb_gemm_4bit_splitk_sum_f32", bnb_gemm_4bit_splitk_sum, float)
// bfloat needs Metal 3.1 (macOS 14), as bf16 tensors on mps do; all arithmetic is float.
#if defined(__HAVE_BFLOAT__)
BNB_INSTANTIATE_SPLITK(absmax, false, bf16, bfloat)
BNB_INSTANTIATE_SPLITK(nested, true, bf16, bfloat)
BNB_KERNEL_INSTANTIATE("bnb_gemm_4bit_splitk_sum_bf16", bnb_gemm_4bit_splitk_sum, bfloat)
#endif
