// 4-bit (NF4 / FP4) blockwise quantize / dequantize kernels (docs/semantics.md section 3). Bodies:
// quantize_4bit.h.
//
// Host names: <qt> is nf4 or fp4; <dt> is f16 (half), bf16 (bfloat) or f32 (float); <bs> is 32,
// 64, 128, 256, 512, 1024, 2048 or 4096. n is the element count, uint32 (the op layer keeps
// n < 2^32 - 8192). The packed output is plain bytes; any quant_storage dtype is a view of them.
//
// bnb_quantize_4bit_<qt>_<dt>_<bs>
//   buffer(0) A       device const <dt>*  input, n elements (flat, contiguous)
//   buffer(1) packed  device uchar*       ceil(n / 2) bytes, element 2j in the high nibble of byte j
//   buffer(2) absmax  device float*       ceil(n / bs) block maxima
//   buffer(3) n       constant uint&
//   threadgroup: (T, 1, 1) with T = 128 for bs <= 256, bs / 8 for bs > 256 (64..512)
//   grid:        (ceil(n / E), 1, 1) threadgroups, E = 256 for bs = 32, 4 * bs for 64 <= bs <= 256,
//                bs for bs > 256
//
// bnb_dequantize_4bit_<qt>_<dt>
//   buffer(0) packed     device const uchar*  ceil(n / 2) bytes
//   buffer(1) absmax     device const float*  ceil(n / blocksize) block scales
//   buffer(2) out        device <dt>*         n values
//   buffer(3) n          constant uint&
//   buffer(4) blocksize_log2  constant uint&  log2 of the blocksize (a power of two, >= 2)
//   threadgroup: (256, 1, 1)
//   grid:        (ceil(ceil(n / 2) / 1024), 1, 1) threadgroups
#include "bnb_math_mode.h"
#include "quantize_4bit.h"

#define BNB_INSTANTIATE_QUANT4(qname, quant, tname, type, bs) \
    BNB_KERNEL_INSTANTIATE("bnb_quantize_4bit_" #qname "_" #tname "_" #bs, bnb_quantize_4bit, type, bs, quant)

#define BNB_INSTANTIATE_QUANT4_ALL(qname, quant, tname, type) \
    BNB_INSTANTIATE_QUANT4(qname, quant, tname, type, 32)     \
    BNB_INSTANTIATE_QUANT4(qname, quant, tname, type, 64)     \
    BNB_INSTANTIATE_QUANT4(qname, quant, tname, type, 128)    \
    BNB_INSTANTIATE_QUANT4(qname, quant, tname, type, 256)    \
    BNB_INSTANTIATE_QUANT4(qname, quant, tname, type, 512)    \
    BNB_INSTANTIATE_QUANT4(qname, quant, tname, type, 1024)   \
    BNB_INSTANTIATE_QUANT4(qname, quant, tname, type, 2048)   \
    BNB_INSTANTIATE_QUANT4(qname, quant, tname, type, 4096)   \
    BNB_KERNEL_INSTANTIATE("bnb_dequantize_4bit_" #qname "_" #tname, bnb_dequantize_4bit, type, quant)

BNB_INSTANTIATE_QUANT4_ALL(nf4, BNB_NF4, f16, half)
BNB_INSTANTIATE_QUANT4_ALL(nf4, BNB_NF4, f32, float)
BNB_INSTANTIATE_QUANT4_ALL(fp4, BNB_FP4, f16, half)
BNB_INSTANTIATE_QUANT4_ALL(fp4, BNB_FP4, f32, float)
// bfloat needs Metal 3.1 (macOS 14), as bf16 tensors on mps do; older systems still get the rest.
#if defined(__HAVE_BFLOAT__)
BNB_INSTANTIATE_QUANT4_ALL(nf4, BNB_NF4, bf16, bfloat)
BNB_INSTANTIATE_QUANT4_ALL(fp4, BNB_FP4, bf16, bfloat)
#endif
