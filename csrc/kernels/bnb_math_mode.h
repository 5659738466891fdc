// The kernels' floating-point mode, pinned in the source: safe (IEEE) math and no contraction of
// a * b + c into one fused multiply-add, whatever math mode the compiler is asked for. Included
// by bnb_common.h before any kernel code, so it covers every kernel.
//
// `#pragma METAL fp math_mode(safe | relaxed | fast)` and `#pragma METAL fp contract(off | on |
// fast)` are the Metal Shading Language's spellings; at file scope they hold for the rest of the
// translation unit. Both are needed: safe math still contracts within a statement (contract "on").
// They are compiled for Metal 3.2 and later only (__METAL_VERSION__ >= 320; 4.0 is 400): earlier
// language versions are not known to honour them. Which version each executor compiles with:
// - shader tier, torch.mps.compile_shader (torch's MTLCompileOptions, read in its released macOS
//   wheels): torch >= 2.11 asks for Metal 3.2 on macOS 15 and 4.0 from macOS 26, so the pragmas
//   apply there; on macOS 14, and with torch 2.7 to 2.10 on any macOS, it asks for 3.1 at most
//   and they do not. There torch's own mode holds: safe, or fast when the environment sets
//   PYTORCH_MPS_FAST_MATH (bnb_mps/executors/shader.py warns once when that happens).
// - native tier: the runtime compile in csrc/mps_ops.mm asks for Metal 3.2 from macOS 15 on, so
//   the pragmas apply there, and for 3.1 on macOS 14, where they do not; the offline metallib is
//   built with -std=metal3.1 (csrc/metal_toolchain.cmake) and loaded on macOS 14 only. At 3.1 safe
//   math comes from the compile options (-fno-fast-math offline), and the optimizer update keeps
//   its own no-contraction (optimizer.h).
// - the emulator and the address-space check define __METAL_VERSION__ 310 and never see them
//   (the emulator compiles as C++ with -fno-fast-math -ffp-contract=off).
#pragma once

#if defined(__METAL_VERSION__) && __METAL_VERSION__ >= 320
#pragma METAL fp math_mode(safe)
#pragma METAL fp contract(off)
// 1 where the pragmas above pin the mode, else 0.
#define BNB_FP_MODE_PINNED 1
#else
#define BNB_FP_MODE_PINNED 0
#endif
