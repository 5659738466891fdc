#!/usr/bin/env bash
# Installs everything bnb-mps needs into the current Python environment, then bnb-mps itself
# (editable). Used by scripts/test.sh and scripts/diagnose.sh; safe to run again: where the last run
# set up this environment from the same inputs (this script, constraints.txt, pyproject.toml, the
# build files and the emulator's C++ sources, the torch pin) and everything still imports, it does
# nothing (build/setup_env.stamp; BNB_MPS_SETUP=always installs regardless).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

TORCH_VERSION=${BNB_MPS_TORCH_VERSION:-2.13.0}
# The state of the last setup: a digest of its inputs, kept in build/setup_env.stamp.
STATE='
import hashlib, pathlib, sys
inputs = [pathlib.Path(p) for p in ("scripts/setup_env.sh", "constraints.txt", "pyproject.toml", "CMakeLists.txt")]
inputs += sorted(pathlib.Path("csrc").glob("*.cmake")) + sorted(p for p in pathlib.Path("csrc/emu").rglob("*") if p.is_file())
h = hashlib.sha256(f"{sys.executable} {sys.version} torch=={sys.argv[2]}".encode())
for p in inputs:
    h.update(str(p).encode() + b"\0" + p.read_bytes())
stamp = pathlib.Path("build/setup_env.stamp")
if sys.argv[1] == "write":
    stamp.parent.mkdir(exist_ok=True)
    stamp.write_text(h.hexdigest())
else:
    import bitsandbytes, peft, pytest, torch, transformers, bnb_mps._emu
    print("up to date" if stamp.is_file() and stamp.read_text() == h.hexdigest() else "changed")
'
if [ "${BNB_MPS_SETUP:-}" != always ] \
    && [ "$("$PY" -c "$STATE" check "$TORCH_VERSION" 2>/dev/null)" = "up to date" ]; then
  exit 0
fi

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
"$PY" -c "$STATE" write "$TORCH_VERSION"
