#!/usr/bin/env bash
# Syntax check of the native executor (csrc/mps_ops.mm) where no Apple SDK exists.
#
# Parses the file with clang as Objective-C++ under ARC (-fsyntax-only, warnings are errors), with
#   - the REAL torch headers of the Python in use (torch/extension.h, ATen/mps/MPSStream.h, ...),
#   - stand-in Apple headers from tests/native_stubs/ (Foundation, Metal, GCD, MPS; see its README),
#   - the kernel header generated exactly as the build generates it.
# The macOS 15 and 26 branches (mathMode, Metal 3.2 and 4.0) are parsed too, by defining __MAC_15_0 and
# __MAC_26_0 as a newer SDK would.
#
# What this verifies: the file is well-formed Objective-C++/ARC; its PyTorch API use matches the
# installed torch headers; its Metal/Foundation use matches the stand-in declarations.
# What it does not: that Apple's SDK agrees with the stand-ins, that it links, or that it runs.
#
# Usage: scripts/check_native_syntax.sh            (CLANGXX=clang++-15 to choose the compiler)
# Needs clang++ (Debian: apt-get install -y clang). Exit status: 0 clean, 1 errors, 2 missing tools.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
clangxx="${CLANGXX:-clang++}"
python="${PYTHON:-python3}"

if ! command -v "$clangxx" >/dev/null 2>&1; then
  echo "check_native_syntax: $clangxx not found (Debian/Ubuntu: apt-get install -y clang)" >&2
  exit 2
fi

torch_include="$("$python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')" || {
  echo "check_native_syntax: cannot import torch with $python" >&2
  exit 2
}
python_include="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"

generated="$(mktemp -d)"
trap 'rm -rf "$generated"' EXIT
"$python" "$root/bnb_mps/executors/_embed_kernels.py" --header "$generated/bnb_mps_kernels_embedded.h" 2>/dev/null

# -fobjc-runtime=macosx: Apple's Objective-C semantics (ARC, @autoreleasepool) on a Linux host.
# -fblocks: GCD blocks (on by default only for Apple targets).
"$clangxx" -fsyntax-only -x objective-c++ -std=c++20 \
  -fobjc-arc -fobjc-runtime=macosx-14.0 -fblocks \
  -Werror -Wall -Wextra -Wno-unused-parameter \
  -D__MAC_15_0=150000 -D__MAC_26_0=260000 \
  -DBNB_MPS_TORCH_VERSION='"syntax-check"' -DBNB_MPS_TORCH_CXX11_ABI=1 \
  -isystem "$root/tests/native_stubs" \
  -isystem "$torch_include" -isystem "$torch_include/torch/csrc/api/include" \
  -isystem "$python_include" \
  -I "$root/csrc" -I "$generated" \
  "$root/csrc/mps_ops.mm"
echo "check_native_syntax: csrc/mps_ops.mm parses cleanly (syntax and declared API only; see header)"
