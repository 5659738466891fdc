// Optimizer update kernels (docs/semantics.md section 5), in place. Bodies and design: optimizer.h.
//
// Host names: <opt> is adam, ademamix, momentum, rmsprop, adagrad or lion (bitsandbytes' "lamb"
// runs the adam kernels and "lars" the momentum ones); <dt> is f16 (half), bf16 (bfloat) or f32
// (float), the dtype of g and p. n is the element count of p, uint32 (the op layer keeps the
// largest index, 2n for AdEMAMix, below 2^32 - 8192). Scalars are float32 unless noted; bc1, bc2
// and decay are computed by the op layer (1 - beta1^step, sqrt(1 - beta2^step),
// 1 - lr * weight_decay, each rounded to float32). flags: the BNB_OPTIM_* bits of optimizer.h
// (which buffers take vector accesses, step == 1, skip_zeros, clipping).
//
// bnb_optimizer_8bit_<opt>_<dt>          optimizer_update_8bit_blockwise, 256-element state blocks
//   buffer(0)  g          device const <dt>*   n gradients
//   buffer(1)  p          device <dt>*         n parameters, updated
//   buffer(2)  state1     device uchar*        n codes of qmap1 (2n for ademamix: m, then m2), updated
//   buffer(3)  state2     device uchar*        n codes of qmap2 (adam, ademamix; else state1 again)
//   buffer(4)  qmap1      device const float*  256 ascending values (signed dynamic code)
//   buffer(5)  qmap2      device const float*  256 ascending values (unsigned code; else qmap1 again)
//   buffer(6)  absmax1    device float*        ceil(n / 256) block scales (ademamix: m2's start at
//                                              absmax_m2), updated
//   buffer(7)  absmax2    device float*        ceil(n / 256) block scales (else absmax1 again), updated
//   buffer(8)  n          constant uint&
//   buffer(9)  absmax_m2  constant uint&       ademamix: index of m2's first block scale in absmax1
//   buffer(10) flags      constant uint&
//   buffer(11..21)        beta1, beta2, beta3, alpha, eps, lr, bc1, bc2, decay, weight_decay,
//                         gnorm_scale
//   threadgroup: (256, 1, 1); simdgroup s of threadgroup t updates blocks t * 8 + s + k * 8 * T
//   grid:        (T, 1, 1) threadgroups, any T >= 1 (the op layer: min(ceil(ceil(n / 256) / 8), 1024))
//
// bnb_optimizer_32bit_<opt>_<dt>         optimizer_update_32bit (the update)
// bnb_optimizer_32bit_unorm_<opt>_<dt>   the update-norm pass that precedes it when clipping
//   buffer(0)  g          device const <dt>*   n gradients
//   buffer(1)  p          device <dt>*         n parameters, updated (not by the unorm pass)
//   buffer(2)  state1     device float*        n states (2n for ademamix: m, then m2), updated
//   buffer(3)  state2     device float*        n states (adam, ademamix; else state1 again)
//   buffer(4)  unorm      device float*        unorm_vec: [0] = sum of u^2, written by the update
//                                              when clipping (else any buffer of the call)
//   buffer(5)  partials   device float*        T floats: written by the unorm pass, read by the
//                                              clipping update (else any buffer of the call)
//   buffer(6)  n          constant uint&
//   buffer(7)  flags      constant uint&
//   buffer(8..18)         beta1, beta2, beta3, alpha, eps, lr, bc1, bc2, decay, weight_decay,
//                         gnorm_scale
//   buffer(19) max_norm   constant float&      max_unorm * param_norm (clipping only)
//   threadgroup: (256, 1, 1); threadgroup t updates the 2048-element chunks t + k * T
//   grid:        (T, 1, 1) threadgroups, any T >= 1, the same T for the unorm pass and the update
//                that follows it (the op layer: min(ceil(n / 2048), 1024))
#include "bnb_math_mode.h"
#include "optimizer.h"

#define BNB_INSTANTIATE_OPTIM_DT(oname, opt, tname, type)                                                     \
    BNB_KERNEL_INSTANTIATE("bnb_optimizer_8bit_" #oname "_" #tname, bnb_optimizer_8bit_blockwise, type, opt) \
    BNB_KERNEL_INSTANTIATE("bnb_optimizer_32bit_" #oname "_" #tname, bnb_optimizer_32bit, type, opt, false)  \
    BNB_KERNEL_INSTANTIATE("bnb_optimizer_32bit_unorm_" #oname "_" #tname, bnb_optimizer_32bit, type, opt, true)

#define BNB_INSTANTIATE_OPTIM(tname, type)                                 \
    BNB_INSTANTIATE_OPTIM_DT(adam, BNB_OPTIM_ADAM, tname, type)           \
    BNB_INSTANTIATE_OPTIM_DT(ademamix, BNB_OPTIM_ADEMAMIX, tname, type)   \
    BNB_INSTANTIATE_OPTIM_DT(momentum, BNB_OPTIM_MOMENTUM, tname, type)   \
    BNB_INSTANTIATE_OPTIM_DT(rmsprop, BNB_OPTIM_RMSPROP, tname, type)     \
    BNB_INSTANTIATE_OPTIM_DT(adagrad, BNB_OPTIM_ADAGRAD, tname, type)     \
    BNB_INSTANTIATE_OPTIM_DT(lion, BNB_OPTIM_LION, tname, type)

BNB_INSTANTIATE_OPTIM(f16, half)
// bfloat needs Metal 3.1 (macOS 14), as bf16 tensors on mps do; older systems still get the rest.
#if defined(__HAVE_BFLOAT__)
BNB_INSTANTIATE_OPTIM(bf16, bfloat)
#endif
BNB_INSTANTIATE_OPTIM(f32, float)
