#!/usr/bin/env bash
# Installs everything bnb-mps needs into the current Python environment, then bnb-mps itself
# (editable). Used by scripts/test.sh and scripts/diagnose.sh; safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# Every install takes constraints.txt (-c): the versions of bitsandbytes, transformers, peft and
# accelerate the project is tested with.
# torch first and pinned: an unpinned torch requirement pulls the CUDA build (several GB) on Linux.
TORCH_VERSION=${BNB_MPS_TORCH_VERSION:-2.13.0}
"$PY" -m pip install --quiet -c constraints.txt "torch==${TORCH_VERSION}"
"$PY" -m pip install --quiet -c constraints.txt bitsandbytes "scikit-build-core>=0.10" "pybind11>=2.12" cmake ninja

# Optional tools, installed only where that is possible without asking (root with apt-get);
# the tests that need them are skipped otherwise:
#   clang, clang-16: the emulator tests also compile kernels with clang++-16 (the first Debian
#     clang with _Float16 on x86-64); clang++ syntax-checks the Objective-C++ executor;
#   qemu-user, g++-aarch64-linux-gnu: run the emulator's aarch64 (Apple Silicon) fiber switch;
#   libobjc-12-dev (gcc's Objective-C runtime), libblocksruntime-dev: build and run the native
#     executor (csrc/mps_ops.mm) against the Metal model of tests/metal_model.
if { ! command -v clang++ || ! command -v clang++-16 || ! command -v qemu-aarch64 \
     || ! command -v aarch64-linux-gnu-g++ || ! dpkg -s libobjc-12-dev libblocksruntime-dev; } >/dev/null 2>&1 \
    && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
     clang clang-16 qemu-user g++-aarch64-linux-gnu libobjc-12-dev libblocksruntime-dev >/dev/null) \
    || echo "setup_env: optional tools could not be installed; the tests that need them are skipped" >&2
fi

# --no-build-isolation: the native (macOS) build compiles against the installed torch.
"$PY" -m pip install --quiet --no-build-isolation -c constraints.txt -e ".[test,e2e]"
# Bytecode for the editable checkout, as pip writes it for regular installs (the environment may
# set PYTHONDONTWRITEBYTECODE, and bitsandbytes imports bnb_mps on every `import bitsandbytes`).
"$PY" -m compileall -q bnb_mps >/dev/null || true
