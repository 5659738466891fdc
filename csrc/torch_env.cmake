# Which torch a Python imports, and whether the torch a build links against is the torch of the
# environment that will run the module. Used by csrc/mps.cmake (the native executor links to torch)
# and tested in script mode by tests/test_build_scripts.py.
#
# bnb_mps_query_torch(<python> <prefix> [USER_ENVIRONMENT])
#   Sets <prefix>_FOUND, <prefix>_VERSION, <prefix>_CXX11_ABI (0/1) and <prefix>_LOCATION (the
#   torch package directory) in the caller's scope. With USER_ENVIRONMENT, <python> runs without
#   the variables pip's isolated build environment sets (PYTHONPATH, PYTHONNOUSERSITE), i.e. in the
#   environment the user installs into and runs.
function(bnb_mps_query_torch python prefix)
  set(_cmd "${python}")
  if(ARGN STREQUAL "USER_ENVIRONMENT")
    set(_cmd "${CMAKE_COMMAND}" -E env --unset=PYTHONPATH --unset=PYTHONNOUSERSITE "${python}")
  endif()
  execute_process(
    COMMAND ${_cmd} -c "import os, torch; print(torch.__version__); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(os.path.dirname(os.path.realpath(torch.__file__)))"
    OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _status OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT _status EQUAL 0)
    set(${prefix}_FOUND FALSE PARENT_SCOPE)
    set(${prefix}_ERROR "${_err}" PARENT_SCOPE)
    return()
  endif()
  string(REPLACE "\n" ";" _lines "${_out}")
  list(GET _lines 0 _version)
  list(GET _lines 1 _abi)
  list(GET _lines 2 _location)
  set(${prefix}_FOUND TRUE PARENT_SCOPE)
  set(${prefix}_VERSION "${_version}" PARENT_SCOPE)
  set(${prefix}_CXX11_ABI "${_abi}" PARENT_SCOPE)
  set(${prefix}_LOCATION "${_location}" PARENT_SCOPE)
endfunction()

# bnb_mps_check_user_torch(<python> <build_prefix>)
#   Says clearly whether the torch found by the build (<build_prefix>_*, from bnb_mps_query_torch)
#   is the torch of the user's environment. It is not under pip's default build isolation, which
#   installs the newest torch into a temporary environment: the module would then be refused at
#   run time (bnb_mps.executors.native compares its build record with the running torch).
function(bnb_mps_check_user_torch python build_prefix)
  bnb_mps_query_torch("${python}" _user USER_ENVIRONMENT)
  set(_build "torch ${${build_prefix}_VERSION} at ${${build_prefix}_LOCATION}")
  set(_fix "Build with the torch you run: pip install --no-build-isolation -e . (or without -e)")
  if(NOT _user_FOUND)
    message(WARNING "bnb_mps: the native executor is being built against ${_build}, but the environment "
                    "you install into has no importable torch (this looks like pip's isolated build "
                    "environment). The native tier will refuse this build unless you run exactly that "
                    "torch. ${_fix}")
  elseif(NOT _user_VERSION STREQUAL ${build_prefix}_VERSION
         OR NOT _user_CXX11_ABI STREQUAL ${build_prefix}_CXX11_ABI)
    message(WARNING "bnb_mps: the native executor is being built against ${_build}, but the environment "
                    "you install into runs torch ${_user_VERSION} at ${_user_LOCATION}. The native tier "
                    "will refuse this build at run time (it records the torch it was built against). ${_fix}")
  elseif(NOT _user_LOCATION STREQUAL ${build_prefix}_LOCATION)
    message(STATUS "bnb_mps: native executor built against ${_build} (pip's build environment); the same "
                   "version as the torch at ${_user_LOCATION} in the environment you install into")
  else()
    message(STATUS "bnb_mps: native executor built against ${_build}, the torch of this environment")
  endif()
endfunction()

# bnb_mps_build_record(<file name> <prefix>)
#   Writes the build record of a module linked against the torch found as <prefix>_* (from
#   bnb_mps_query_torch): {"torch_version", "torch_cxx11_abi"} in <file name>, installed next to the
#   module. bnb_mps reads it before importing the module and refuses a module built against another
#   torch (or C++ ABI): bnb_mps.executors.native.build_mismatch.
function(bnb_mps_build_record name prefix)
  set(_record "${CMAKE_CURRENT_BINARY_DIR}/${name}")
  file(WRITE "${_record}"
       "{\"torch_version\": \"${${prefix}_VERSION}\", \"torch_cxx11_abi\": ${${prefix}_CXX11_ABI}}\n")
  if(SKBUILD)
    install(FILES "${_record}" DESTINATION ${BNB_MPS_INSTALL_DIR})
  else()
    file(COPY "${_record}" DESTINATION "${BNB_MPS_OUTPUT_DIR}")
  endif()
endfunction()
