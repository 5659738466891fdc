# The C++ metadata key of op calls, Python module bnb_mps._opkey (csrc/op_key.cpp). Included by
# CMakeLists.txt on every platform. It reads tensors through torch's C++ objects, so it links
# against the torch of the build's Python and is built only when that Python imports torch (a
# `pip install --no-build-isolation` build, as scripts/setup_env.sh and the Mac install do); without
# it the op layer computes the same key in Python (bnb_mps.ops.plan), a few microseconds slower per
# call. -DBNB_MPS_OPKEY=OFF leaves it out.

option(BNB_MPS_OPKEY "Build bnb_mps._opkey, the C++ metadata key of op calls (needs torch at build time)" ON)
if(NOT BNB_MPS_OPKEY)
  message(STATUS "bnb_mps: op keys computed in Python (BNB_MPS_OPKEY=OFF)")
  return()
endif()

include("${CMAKE_CURRENT_LIST_DIR}/torch_env.cmake")
bnb_mps_query_torch("${Python_EXECUTABLE}" BNB_MPS_OPKEY_TORCH)
if(NOT BNB_MPS_OPKEY_TORCH_FOUND)
  message(STATUS "bnb_mps: op keys computed in Python (the build's Python imports no torch; build with "
                 "`pip install --no-build-isolation` for the C++ ones)")
  return()
endif()

set(_bnb_torch "${BNB_MPS_OPKEY_TORCH_LOCATION}")
set(_bnb_torch_libs)
foreach(_lib torch_python torch_cpu c10)
  find_library(_bnb_opkey_${_lib} ${_lib} PATHS "${_bnb_torch}/lib" NO_DEFAULT_PATH)
  if(NOT _bnb_opkey_${_lib})
    message(STATUS "bnb_mps: op keys computed in Python (no lib${_lib} in ${_bnb_torch}/lib)")
    return()
  endif()
  list(APPEND _bnb_torch_libs "${_bnb_opkey_${_lib}}")
endforeach()

Python_add_library(_opkey MODULE WITH_SOABI "${CMAKE_CURRENT_LIST_DIR}/op_key.cpp")
target_include_directories(_opkey SYSTEM PRIVATE "${_bnb_torch}/include" "${_bnb_torch}/include/torch/csrc/api/include")
target_link_libraries(_opkey PRIVATE ${_bnb_torch_libs})
target_compile_definitions(_opkey PRIVATE BNB_MPS_TORCH_VERSION="${BNB_MPS_OPKEY_TORCH_VERSION}"
                           BNB_MPS_TORCH_CXX11_ABI=${BNB_MPS_OPKEY_TORCH_CXX11_ABI})
if(NOT APPLE)
  target_compile_definitions(_opkey PRIVATE _GLIBCXX_USE_CXX11_ABI=${BNB_MPS_OPKEY_TORCH_CXX11_ABI})
  set(_bnb_origin "$ORIGIN")
else()
  set(_bnb_origin "@loader_path")
endif()
set_target_properties(_opkey PROPERTIES
  CXX_STANDARD 20  # torch >= 2.10 headers need C++20; older ones accept it
  CXX_STANDARD_REQUIRED ON
  CXX_VISIBILITY_PRESET hidden
  # torch's libraries: next to the installed package (site-packages/torch/lib), else where the
  # build found them. torch is always imported before this module.
  INSTALL_RPATH "${_bnb_origin}/../torch/lib;${_bnb_torch}/lib"
  BUILD_RPATH "${_bnb_torch}/lib")
bnb_mps_place_module(_opkey)

# The build record: which torch the module is built against, read before the module is imported
# (bnb_mps.ops.plan); a module built against another torch is not loaded.
bnb_mps_build_record(_opkey_build.json BNB_MPS_OPKEY_TORCH)
message(STATUS "bnb_mps: op keys in C++ (bnb_mps._opkey), against torch ${BNB_MPS_OPKEY_TORCH_VERSION} at ${_bnb_torch}")
