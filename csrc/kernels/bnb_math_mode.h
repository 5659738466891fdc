// The kernels' floating-point mode, pinned in the source: safe (IEEE) math and no contraction of
// a * b + c into one fused multiply-add, whatever the compiler is asked for. Every `.metal` file
// includes this header first, before <metal_stdlib> (as Dawn puts its pragmas before the standard
// library), so that it covers the whole compile unit: the kernels and the library functions they
// inline alike. (bnb_common.h includes it too, first, for any other file.) bnb_common.h repeats
// the same pragmas right after <metal_stdlib>, so that a pragma of the standard library's own cannot
// loosen the kernels that follow it (the MSL lint's rule fp-contract checks both places).
//
// - `#pragma clang fp contract(off)`: no contraction, at every Metal language version. Metal's
//   compiler is clang, and a measurement on an M4 found this pragma effective without Metal 3.2,
//   while safe math alone (mathMode = Safe, or fastMathEnabled = NO) still contracts `a*b + c`.
//   So it is unconditional: the same op gives the same bits at Metal 3.1 (the native tier on
//   macOS 14 or built with an older SDK, the offline metallib, the shader tier on macOS 14 or with
//   torch 2.7 to 2.10), 3.2 and 4.0. (The scripts/mac_acceptance.sh probes check it on hardware.)
// - `#pragma METAL fp math_mode(safe)` / `#pragma METAL fp contract(off)`: the Metal Shading
//   Language's own spellings, from Metal 3.2 on (__METAL_VERSION__ >= 320; 4.0 is 400); below
//   that, safe math comes from the compile options (the native tier's, torch's unless
//   PYTORCH_MPS_FAST_MATH is set, -fno-fast-math offline).
// - No pragma chooses the math *function* library: fast math (PYTORCH_MPS_FAST_MATH) also selects
//   the fast variants of sqrt, exp, ... for unqualified calls. So the kernels call only
//   `metal::precise::` functions, a rule the MSL lint enforces (bnb_mps.msl.lint, rule float-math).
// The emulator and the address-space check define __METAL_VERSION__ 310; the emulator compiles
// as C++ with -fno-fast-math -ffp-contract=off (g++ ignores the clang pragma, clang applies it).
#pragma once

#pragma clang fp contract(off)

#if defined(__METAL_VERSION__) && __METAL_VERSION__ >= 320
#pragma METAL fp math_mode(safe)
#pragma METAL fp contract(off)
#endif
