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
# that the module prefers to load at run time where it is current and the run-time compile would
# not pin more (macOS 14; bnb_mps/executors/native.py, choose_library).
#
# Compile units: at run time the kernel source is compiled one compile unit (one .metal file with
# its includes) at a time, so that a unit that does not compile takes out only its own kernels. The
# offline metallib stays one library of the whole amalgamation: built here, with the build's own
# compiler, it either holds every kernel or is not built (a warning), and at run time a metallib
# that does not load falls back to compiling the units one by one.

if(NOT APPLE)
  message(FATAL_ERROR "bnb_mps: COMPUTE_BACKEND=mps builds the Metal executor and needs macOS with "
                      "Apple's SDK; use -DCOMPUTE_BACKEND=cpu on this system")
endif()
enable_language(OBJCXX)

# --- torch -------------------------------------------------------------------------------------
include("${CMAKE_CURRENT_LIST_DIR}/torch_env.cmake")
bnb_mps_query_torch("${Python_EXECUTABLE}" BNB_MPS_TORCH)
if(NOT BNB_MPS_TORCH_FOUND)
  message(FATAL_ERROR "bnb_mps: the native Metal executor links against torch, but "
                      "${Python_EXECUTABLE} cannot import it:\n${BNB_MPS_TORCH_ERROR}\n"
                      "Install torch in this environment and build with "
                      "`pip install --no-build-isolation -e .` (build isolation hides torch).")
endif()
bnb_mps_check_user_torch("${Python_EXECUTABLE}" BNB_MPS_TORCH)
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import torch; print(torch.utils.cmake_prefix_path)"
  OUTPUT_VARIABLE _bnb_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE)
list(APPEND CMAKE_PREFIX_PATH "${_bnb_torch_prefix}")
find_package(Torch REQUIRED)
# torch_python holds THPVariable_* (tensor <-> Python object), which the module uses.
find_library(BNB_MPS_TORCH_PYTHON_LIBRARY torch_python PATHS "${TORCH_INSTALL_PREFIX}/lib"
             NO_DEFAULT_PATH REQUIRED)
message(STATUS "bnb_mps: native executor links torch from ${TORCH_INSTALL_PREFIX}")

# The build record: the torch this module is built against. bnb_mps.executors.native reads it
# before importing the module and refuses a module built against another torch (or C++ ABI).
bnb_mps_build_record(_native_build.json BNB_MPS_TORCH)

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
target_compile_definitions(_native PRIVATE BNB_MPS_TORCH_VERSION="${BNB_MPS_TORCH_VERSION}"
                           BNB_MPS_TORCH_CXX11_ABI=${BNB_MPS_TORCH_CXX11_ABI})
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
# Needs Xcode's Metal toolchain (the Command Line Tools alone have no working `metal`), probed by
# compiling a one-line kernel (csrc/metal_toolchain.cmake). Same source and flags everywhere: safe
# math, MSL 3.1, macOS 14 minimum. A failure of the real build only warns: the module then
# compiles the embedded source at run time instead.
include("${CMAKE_CURRENT_LIST_DIR}/metal_toolchain.cmake")
bnb_mps_probe_metal_compiler(_bnb_metal_ok _bnb_metal_why "${CMAKE_CURRENT_BINARY_DIR}/bnb_mps_metal_probe")
if(_bnb_metal_ok)
  if(SKBUILD)
    set(_bnb_metallib "${_bnb_generated}/bnb_mps_kernels.metallib")
    install(FILES "${_bnb_metallib}" DESTINATION "${BNB_MPS_INSTALL_DIR}" OPTIONAL)
  else()
    set(_bnb_metallib "${BNB_MPS_OUTPUT_DIR}/bnb_mps_kernels.metallib")
  endif()
  set(_bnb_air "${_bnb_generated}/bnb_mps_kernels.air")
  string(REPLACE ";" " " _bnb_metal_flags "${BNB_MPS_METAL_FLAGS}")
  add_custom_command(
    OUTPUT "${_bnb_metallib}"
    COMMAND /bin/sh -c "xcrun -sdk macosx metal ${_bnb_metal_flags} -c \"$0\" -o \"$1\" && xcrun -sdk macosx metallib \"$1\" -o \"$2\" || { echo 'bnb_mps: warning: offline metallib build failed; the native library will compile the kernel source at run time' >&2; rm -f \"$2\"; }"
            "${_bnb_generated}/bnb_mps_kernels.metal" "${_bnb_air}" "${_bnb_metallib}"
    DEPENDS "${_bnb_generated}/bnb_mps_kernels.metal"
    COMMENT "bnb_mps: building bnb_mps_kernels.metallib with xcrun metal"
    VERBATIM)
  add_custom_target(bnb_mps_metallib ALL DEPENDS "${_bnb_metallib}")
  message(STATUS "bnb_mps: kernel library: offline metallib (xcrun metal works; ${BNB_MPS_METAL_STD}, "
                 "macOS >= ${BNB_MPS_METAL_MACOS_MIN}), with the embedded source as fallback")
else()
  message(STATUS "bnb_mps: kernel library: compiled from the embedded source at run time (no offline "
                 "metallib: ${_bnb_metal_why})")
endif()
