# The offline Metal compiler, probed for real. `xcrun -f metal` succeeds even when Xcode's Metal
# toolchain component is not installed, so the probe compiles and links a one-line kernel with the
# same options as the real build. Used by csrc/mps.cmake; tested in script mode with a stand-in
# `xcrun` by tests/test_build_scripts.py.

# The kernels use bfloat, which needs Metal 3.1; Metal 3.1 came with macOS 14 (Sonoma), so a
# library built for it is only loadable from macOS 14 on. (On older systems the native library
# compiles its embedded source instead, without the bfloat kernels.) At metal3.1 the kernels'
# `#pragma METAL fp` lines (csrc/kernels/bnb_math_mode.h, Metal >= 3.2) are compiled out: safe math
# comes from -fno-fast-math, an option of the offline compiler that the Metal Shading Language
# specification documents (its "Compiler Options", math intrinsics options), and no contraction from
# the source's unconditional `#pragma clang fp contract(off)`. -ffp-contract=off, which no Apple
# document found for this project lists for the `metal` compiler, is added as well where the probe
# shows the toolchain accepts it (BNB_MPS_METAL_FLAGS then ends with it).
set(BNB_MPS_METAL_STD "metal3.1")
set(BNB_MPS_METAL_MACOS_MIN "14.0")
set(BNB_MPS_METAL_FLAGS -std=${BNB_MPS_METAL_STD} -mmacosx-version-min=${BNB_MPS_METAL_MACOS_MIN} -fno-fast-math)
set(BNB_MPS_METAL_NO_CONTRACT -ffp-contract=off)

# bnb_mps_probe_metal_compiler(<ok_var> <why_var> <work_dir>)
#   <ok_var> TRUE when `xcrun metal` and `xcrun metallib` build a library from a one-line kernel
#   with BNB_MPS_METAL_FLAGS; otherwise FALSE and <why_var> says what failed. When the compiler
#   also takes BNB_MPS_METAL_NO_CONTRACT, it is appended to BNB_MPS_METAL_FLAGS (in the caller's scope).
function(bnb_mps_probe_metal_compiler ok_var why_var work_dir)
  file(MAKE_DIRECTORY "${work_dir}")
  file(WRITE "${work_dir}/probe.metal"
       "kernel void bnb_mps_probe(device float* x [[buffer(0)]]) { x[0] = 1.0f; }\n")
  execute_process(COMMAND xcrun -sdk macosx metal ${BNB_MPS_METAL_FLAGS} -c probe.metal -o probe.air
                  WORKING_DIRECTORY "${work_dir}" RESULT_VARIABLE _status
                  OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
  if(NOT _status EQUAL 0 OR NOT EXISTS "${work_dir}/probe.air")
    string(REGEX REPLACE "\n.*" "" _first "${_err}${_out}")
    set(${ok_var} FALSE PARENT_SCOPE)
    set(${why_var} "xcrun metal cannot compile a one-line kernel (${_first}); install Xcode and its Metal toolchain (xcodebuild -downloadComponent MetalToolchain)" PARENT_SCOPE)
    return()
  endif()
  execute_process(COMMAND xcrun -sdk macosx metallib probe.air -o probe.metallib
                  WORKING_DIRECTORY "${work_dir}" RESULT_VARIABLE _status
                  OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
  if(NOT _status EQUAL 0 OR NOT EXISTS "${work_dir}/probe.metallib")
    string(REGEX REPLACE "\n.*" "" _first "${_err}${_out}")
    set(${ok_var} FALSE PARENT_SCOPE)
    set(${why_var} "xcrun metallib cannot link a one-line kernel (${_first})" PARENT_SCOPE)
    return()
  endif()
  execute_process(COMMAND xcrun -sdk macosx metal ${BNB_MPS_METAL_FLAGS} ${BNB_MPS_METAL_NO_CONTRACT} -c probe.metal
                          -o probe_contract.air
                  WORKING_DIRECTORY "${work_dir}" RESULT_VARIABLE _status OUTPUT_QUIET ERROR_QUIET)
  if(_status EQUAL 0 AND EXISTS "${work_dir}/probe_contract.air")
    set(BNB_MPS_METAL_FLAGS ${BNB_MPS_METAL_FLAGS} ${BNB_MPS_METAL_NO_CONTRACT} PARENT_SCOPE)
  endif()
  set(${ok_var} TRUE PARENT_SCOPE)
  set(${why_var} "" PARENT_SCOPE)
endfunction()
