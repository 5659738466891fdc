// 8-bit blockwise quantize / dequantize kernels (docs/semantics.md section 2). Bodies: quantize_8bit.h.
//
// Host names: <dt> is f16 (half), bf16 (bfloat) or f32 (float); <bs> is 64, 128, 256, 512, 1024,
// 2048 or 4096. n is the element count, uint32 (the op layer keeps n < 2^32 - 8192).
//
// bnb_quantize_blockwise_<dt>_<bs>
//   buffer(0) A       device const <dt>*   input, n elements (flat, contiguous)
//   buffer(1) code    device const float*  256 ascending code values
//   buffer(2) out     device uchar*        n code indices
//   buffer(3) absmax  device float*        ceil(n / bs) block maxima
//   buffer(4) n       constant uint&
//   threadgroup: (T, 1, 1) with T = 128 for bs <= 256, bs / 8 for bs > 256 (64..512)
//   grid:        (min(ceil(n / E), G), 1, 1) threadgroups for any G >= 1, E = 4 * bs for
//                bs <= 256, bs for bs > 256; threadgroup t takes the E-element chunks t, t + G, ...
//
// bnb_dequantize_blockwise_<dt>
//   buffer(0) A          device const uchar*  n code indices
//   buffer(1) code       device const float*  256 code values
//   buffer(2) absmax     device const float*  ceil(n / blocksize) block scales
//   buffer(3) out        device <dt>*         n values
//   buffer(4) n          constant uint&
//   buffer(5) blocksize_log2  constant uint&  log2 of the blocksize (a power of two)
//   threadgroup: (256, 1, 1)
//   grid:        (ceil(n / 2048), 1, 1) threadgroups
#include "bnb_math_mode.h"
#include "quantize_8bit.h"

#define BNB_INSTANTIATE_QUANT8(tname, type, bs) \
    BNB_KERNEL_INSTANTIATE("bnb_quantize_blockwise_" #tname "_" #bs, bnb_quantize_blockwise, type, bs)

#define BNB_INSTANTIATE_QUANT8_ALL(tname, type) \
    BNB_INSTANTIATE_QUANT8(tname, type, 64)     \
    BNB_INSTANTIATE_QUANT8(tname, type, 128)    \
    BNB_INSTANTIATE_QUANT8(tname, type, 256)    \
    BNB_INSTANTIATE_QUANT8(tname, type, 512)    \
    BNB_INSTANTIATE_QUANT8(tname, type, 1024)   \
    BNB_INSTANTIATE_QUANT8(tname, type, 2048)   \
    BNB_INSTANTIATE_QUANT8(tname, type, 4096)   \
    BNB_KERNEL_INSTANTIATE("bnb_dequantize_blockwise_" #tname, bnb_dequantize_blockwise, type)

BNB_INSTANTIATE_QUANT8_ALL(f16, half)
// bfloat needs Metal 3.1 (macOS 14), as bf16 tensors on mps do; older systems still get the rest.
#if defined(__HAVE_BFLOAT__)
BNB_INSTANTIATE_QUANT8_ALL(bf16, bfloat)
#endif
BNB_INSTANTIATE_QUANT8_ALL(f32, float)
