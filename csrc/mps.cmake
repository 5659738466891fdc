# The native Metal executor, Python module bnb_mps._native (csrc/mps_ops.mm).
# Included by CMakeLists.txt when COMPUTE_BACKEND=mps. Two ways to build it on a Mac:
#   pip install --no-build-isolation -e .        (torch must be importable at build time and be
#                                                 the torch you run with: the module links to it)
#   cmake -DCOMPUTE_BACKEND=mps -B build . && cmake --build build
#
# Steps: find the torch the build's Python imports; embed the kernel amalgamation
# (csrc/kernels, via bnb_mps/executors/_embed_kernels.py) as a generated header; build the module
# as Objective-C++ with ARC against torch's headers (including torch's bundled pybind11, so the
# module matches torch's); when `xcrun metal` exists, also build a .metallib of the same source
# that the module prefers to load at run time.

if(NOT APPLE)
  message(FATAL_ERROR "bnb_mps: COMPUTE_BACKEND=mps builds the Metal executor and needs macOS with "
                      "Apple's SDK; use -DCOMPUTE_BACKEND=cpu on this system")
endif()
enable_language(OBJCXX)

# --- torch -------------------------------------------------------------------------------------
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import torch; print(torch.utils.cmake_prefix_path)"
  OUTPUT_VARIABLE _bnb_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
  ERROR_VARIABLE _bnb_torch_error RESULT_VARIABLE _bnb_torch_status)
if(NOT _bnb_torch_status EQUAL 0)
  message(FATAL_ERROR "bnb_mps: the native Metal executor links against torch, but "
                      "${Python_EXECUTABLE} cannot import it:\n${_bnb_torch_error}\n"
                      "Install torch in this environment and build with "
                      "`pip install --no-build-isolation -e .` (build isolation hides torch).")
endif()
list(APPEND CMAKE_PREFIX_PATH "${_bnb_torch_prefix}")
find_package(Torch REQUIRED)
# torch_python holds THPVariable_* (tensor <-> Python object), which the module uses.
find_library(BNB_MPS_TORCH_PYTHON_LIBRARY torch_python PATHS "${TORCH_INSTALL_PREFIX}/lib"
             NO_DEFAULT_PATH REQUIRED)
message(STATUS "bnb_mps: native executor links torch from ${TORCH_INSTALL_PREFIX}")

# --- kernel source, embedded -------------------------------------------------------------------
set(_bnb_generated "${CMAKE_CURRENT_BINARY_DIR}/bnb_mps_generated")
file(GLOB_RECURSE _bnb_kernel_files CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/csrc/kernels/*")
add_custom_command(
  OUTPUT "${_bnb_generated}/bnb_mps_kernels_embedded.h" "${_bnb_generated}/bnb_mps_kernels.metal"
  COMMAND "${Python_EXECUTABLE}" "${PROJECT_SOURCE_DIR}/bnb_mps/executors/_embed_kernels.py"
          --kernels "${PROJECT_SOURCE_DIR}/csrc/kernels"
          --header "${_bnb_generated}/bnb_mps_kernels_embedded.h"
          --metal "${_bnb_generated}/bnb_mps_kernels.metal"
  DEPENDS ${_bnb_kernel_files}
          "${PROJECT_SOURCE_DIR}/bnb_mps/executors/_embed_kernels.py"
          "${PROJECT_SOURCE_DIR}/bnb_mps/msl/source.py"
  COMMENT "bnb_mps: embedding csrc/kernels into the native library"
  VERBATIM)

# --- the module --------------------------------------------------------------------------------
# Python_add_library (not pybind11_add_module): pybind11 comes from torch's own include directory,
# the copy torch itself was built with.
Python_add_library(_native MODULE WITH_SOABI
                   "${CMAKE_CURRENT_LIST_DIR}/mps_ops.mm"
                   "${_bnb_generated}/bnb_mps_kernels_embedded.h")
target_include_directories(_native PRIVATE "${CMAKE_CURRENT_LIST_DIR}" "${_bnb_generated}")
target_link_libraries(_native PRIVATE torch "${BNB_MPS_TORCH_PYTHON_LIBRARY}"
                      "-framework Metal" "-framework Foundation")
target_compile_options(_native PRIVATE $<$<COMPILE_LANGUAGE:OBJCXX>:-fobjc-arc>)
set_target_properties(_native PROPERTIES
  OBJCXX_STANDARD 20                 # torch >= 2.10 headers need C++20; older ones accept it
  OBJCXX_STANDARD_REQUIRED ON
  CXX_VISIBILITY_PRESET hidden
  OBJCXX_VISIBILITY_PRESET hidden
  # torch's dylibs: next to the installed package (site-packages/torch/lib), else where the build
  # found them. torch is always imported before this module, but dyld still resolves @rpath.
  INSTALL_RPATH "@loader_path/../torch/lib;${TORCH_INSTALL_PREFIX}/lib")
bnb_mps_place_module(_native)

# --- optional offline metallib -----------------------------------------------------------------
# Needs Xcode's Metal toolchain (the Command Line Tools alone have no `metal`). Same source, safe
# math (-fno-fast-math), MSL 3.1. A failure here only warns: the module then compiles the embedded
# source at run time instead.
execute_process(COMMAND xcrun -sdk macosx -f metal
                OUTPUT_QUIET ERROR_QUIET RESULT_VARIABLE _bnb_metal_status)
if(_bnb_metal_status EQUAL 0)
  if(SKBUILD)
    set(_bnb_metallib "${_bnb_generated}/bnb_mps_kernels.metallib")
    install(FILES "${_bnb_metallib}" DESTINATION "${BNB_MPS_INSTALL_DIR}" OPTIONAL)
  else()
    set(_bnb_metallib "${BNB_MPS_OUTPUT_DIR}/bnb_mps_kernels.metallib")
  endif()
  set(_bnb_air "${_bnb_generated}/bnb_mps_kernels.air")
  add_custom_command(
    OUTPUT "${_bnb_metallib}"
    COMMAND /bin/sh -c "xcrun -sdk macosx metal -std=metal3.1 -fno-fast-math -c \"$0\" -o \"$1\" && xcrun -sdk macosx metallib \"$1\" -o \"$2\" || { echo 'bnb_mps: warning: offline metallib build failed; the native library will compile the kernel source at run time' >&2; rm -f \"$2\"; }"
            "${_bnb_generated}/bnb_mps_kernels.metal" "${_bnb_air}" "${_bnb_metallib}"
    DEPENDS "${_bnb_generated}/bnb_mps_kernels.metal"
    COMMENT "bnb_mps: building bnb_mps_kernels.metallib with xcrun metal"
    VERBATIM)
  add_custom_target(bnb_mps_metallib ALL DEPENDS "${_bnb_metallib}")
  message(STATUS "bnb_mps: xcrun metal found; building bnb_mps_kernels.metallib")
else()
  message(STATUS "bnb_mps: xcrun metal not found; the native library compiles its embedded kernel "
                 "source at run time")
endif()
