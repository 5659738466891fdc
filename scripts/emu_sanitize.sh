#!/usr/bin/env bash
# Runs the emulator tests with the runtime and every kernel module built with AddressSanitizer
# and UndefinedBehaviorSanitizer (g++). The sanitized runtime is built here, on the side; the
# installed one is not touched.
#
#   scripts/emu_sanitize.sh [pytest args...]      (default: tests/emulator)
set -euo pipefail
cd "$(dirname "$0")/.."

CXX=${CXX:-g++}
OUT=${BNB_MPS_SANITIZE_DIR:-build/emu-sanitize}
SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
mkdir -p "$OUT"
EXT=$(python -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
MOD="$OUT/_emu$EXT"

echo "building the sanitized runtime: $MOD"
$CXX -std=c++17 -O1 -g $SAN -shared -fPIC -fvisibility=hidden \
  $(python -m pybind11 --includes) -Icsrc/emu/include \
  csrc/emu/src/binding.cpp csrc/emu/src/runtime.cpp csrc/emu/src/context.cpp \
  -o "$MOD" -lpthread -ldl

# Python itself is not instrumented: the ASan runtime must be loaded first.
export LD_PRELOAD="$($CXX -print-file-name=libasan.so):$($CXX -print-file-name=libubsan.so)"
# The emulator handles SIGSEGV itself (guard pages); leaks in CPython/torch are not ours.
export ASAN_OPTIONS="handle_segv=0:allow_user_segv_handler=1:detect_leaks=0:detect_stack_use_after_return=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export BNB_MPS_EMU_MODULE="$MOD"
export BNB_MPS_EMU_CXX="$CXX"
# Alignment checks off for kernels: buffers are placed to end exactly at a guard page, which can
# misalign vector loads that are aligned on the host (the runtime re-runs such dispatches aligned).
export BNB_MPS_EMU_CXXFLAGS="$SAN -fno-sanitize=alignment -O1"
export BNB_MPS_EMU_STACK_KB=${BNB_MPS_EMU_STACK_KB:-512}
export BNB_MPS_CACHE_DIR="$OUT/cache"

if [ $# -eq 0 ]; then set -- tests/emulator; fi
exec python -m pytest -p no:faulthandler -q "$@"
