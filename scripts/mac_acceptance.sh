#!/usr/bin/env bash
# The one command a Mac owner runs to prove bnb-mps on their machine:
#
#     bash scripts/mac_acceptance.sh [--out DIR] [--python PYTHON] [--venv DIR] [--dry-run]
#
# It first compiles the kernel units with Xcode's offline Metal compiler (scripts/compile_metal.sh),
# the split-K unit as a step of its own before the others. In a fresh virtual environment it then
# installs torch for macOS arm64, bitsandbytes and bnb-mps (built natively with
# --no-build-isolation, so the Objective-C++ executor compiles against that torch), then runs
# `python -m bnb_mps`, the whole test suite including the `mps` tests on both GPU tiers (native and
# shader), the kernel benchmarks in their short mode, and `python -m bnb_mps tune` for one model (the
# routes of its 4-bit layers measured on this GPU). It writes acceptance-report.md (paste it into an
# issue) and acceptance-report.json into the current directory or --out DIR; logs, junit.xml and
# benchmark JSON go to DIR/acceptance-work/. The dry run compiles the kernels last, where xcrun
# metal works.
#
# Needs macOS on Apple Silicon with a working mps device, and network access for pip; it stops
# early, saying why, elsewhere. --dry-run exercises everything except the mps parts on any OS
# (CI runs it on Linux): the venv reuses the invoking Python's packages instead of downloading
# torch, bnb-mps is still installed into it with --no-build-isolation, and only a small part of
# the test suite runs, and a planted hanging step shows the time limit at work. Every step runs under
# a time limit (scripts/time_limit.py); one that runs out is recorded as "timed out", with its
# output, and the run goes on. Exit status: 0 when every step passed, 1 when one failed or timed
# out, 2 when the run could not start.
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=$PWD
PY=${PYTHON:-python3}
VENV=""
DRY=0

usage() { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=${2:?--out needs a directory}; shift 2 ;;
    --out=*) OUT=${1#--out=}; shift ;;
    --python) PY=${2:?--python needs an interpreter}; shift 2 ;;
    --venv) VENV=${2:?--venv needs a directory}; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "mac_acceptance: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

say() { printf '\n== %s\n' "$*"; }
die() { printf 'mac_acceptance: %s\n' "$*" >&2; exit 2; }

if [ "$DRY" = 0 ]; then
  if [ "$(uname -s)" != "Darwin" ] || [ "$(uname -m)" != "arm64" ]; then
    die "this is the Apple Silicon acceptance run, and this machine is $(uname -s) $(uname -m): there is no mps device to test. Use --dry-run to exercise everything except the mps parts."
  fi
fi
command -v "$PY" >/dev/null 2>&1 || die "no Python interpreter '$PY' (set --python or PYTHON)"
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 9) else 1)' || die "$PY is older than Python 3.9"

mkdir -p "$OUT" || die "cannot create $OUT"
OUT=$(cd "$OUT" && pwd)
WORK="$OUT/acceptance-work"
rm -rf "$WORK" && mkdir -p "$WORK"
VENV=${VENV:-$WORK/venv}
STEPS="$WORK/steps.tsv"
: > "$STEPS"

# step NAME LOG NOTE LIMIT -- COMMAND...: runs COMMAND (a program or one of this script's functions)
# under a time limit of LIMIT seconds (scripts/time_limit.py: macOS has no `timeout`), its output in
# LOG (and on screen), and records exit status, seconds and whether it timed out in steps.tsv.
# Returns the command's exit status (124 when it timed out: the run goes on to the next step).
# EXPECT=timed-out before the call: the step is a planted hang, which passes only when it times out.
# (bash 3.2, as macOS has.)
step() {
  local name=$1 log=$2 note=$3 limit=$4
  shift 5
  local start=$SECONDS rc outcome="" mark="$WORK/.timed-out"
  rm -f "$mark"
  say "$name"
  if [ "$(type -t "$1")" = function ]; then  # (a function runs in a bash of its own, under the limit)
    set -- bash -c "$(declare -f "$1"); \"\$@\"" bash "$@"
  fi
  "$PY" "$REPO/scripts/time_limit.py" "$limit" --mark "$mark" -- "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  [ -f "$mark" ] && outcome="timed out"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$log" "$note" "$outcome" \
    "${EXPECT:-}" >> "$STEPS"
  if [ "${EXPECT:-}" = timed-out ]; then
    [ -n "$outcome" ]
    return
  fi
  return $rc
}
skip_step() { printf '%s\t\t0\t\t%s\t\t\n' "$1" "$2" >> "$STEPS"; }
# What the functions run through `step` read (they run in a bash of their own).
export REPO PY VENV DRY

setup_venv() {
  rm -rf "$VENV"
  if [ "$DRY" = 1 ]; then
    # Reuse the invoking Python's packages (torch, bitsandbytes, pytest, the build tools) through a
    # .pth file instead of downloading them; bnb-mps itself is installed into the new venv.
    "$PY" -m venv --without-pip "$VENV" || return 1
    local parent site
    # Every site directory of the invoking Python (its venv, the system's, the user's).
    parent=$("$PY" -c 'import os, sys; print("\n".join(dict.fromkeys(p for p in sys.path if os.path.isdir(p) and os.path.basename(p) in ("site-packages", "dist-packages"))))')
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    printf '%s\n' "$parent" > "$site/_bnb_mps_acceptance_parent.pth"
    "$VENV/bin/python" -m pip --version >/dev/null 2>&1 || { echo "pip is not importable from $PY"; return 1; }
    # --ignore-installed: never touch the invoking environment's own bnb-mps.
    "$VENV/bin/python" -m pip install --no-build-isolation --no-deps --ignore-installed -e "$REPO" || return 1
  else
    "$PY" -m venv "$VENV" || return 1
    "$VENV/bin/python" -m pip install --upgrade pip || return 1
    # torch first (the macOS arm64 wheel has MPS), then the build tools, then bnb-mps against it;
    # bitsandbytes, transformers, peft and accelerate at the versions tested (constraints.txt).
    "$VENV/bin/python" -m pip install -c "$REPO/constraints.txt" torch bitsandbytes "scikit-build-core>=0.10" \
      "pybind11>=2.12" cmake ninja || return 1
    "$VENV/bin/python" -m pip install --no-build-isolation -c "$REPO/constraints.txt" -e "$REPO[test,e2e]" || return 1
  fi
  "$VENV/bin/python" -c 'import torch, bitsandbytes, bnb_mps; print("torch", torch.__version__, "| bitsandbytes", bitsandbytes.__version__, "| bnb_mps from", bnb_mps.__file__)'
}

VPY="$VENV/bin/python"
FAILED=0

# The kernel compile units through Xcode's offline Metal compiler (scripts/compile_metal.sh, as the
# macOS CI workflow runs it): the split-K unit first, as a step of its own, then the others; at
# metal3.1 (the offline metallib's) and, where this SDK has them, metal3.2 and metal4.0. Skipped
# where `xcrun metal` cannot compile a one-line kernel (the Command Line Tools alone have no Metal
# compiler; the tiers then compile the kernels at run time).
compile_kernels() {
  local args=(--std metal3.1 --try-std metal3.2 --try-std metal4.0) why
  if ! why=$(bash "$REPO/scripts/compile_metal.sh" --probe --std metal3.1 2>&1); then
    why=$(printf '%s' "$why" | tail -n 1 | tr '\t' ' ')
    say "compile the kernels: skipped, no offline Metal compiler here ($why)"
    skip_step "compile the kernels (xcrun metal)" "no offline Metal compiler here: $why"
    return
  fi
  if [ -f "$REPO/csrc/kernels/gemm_4bit_splitk.metal" ]; then
    step "compile the split-K unit (xcrun metal)" "$WORK/compile_splitk.log" "gemm_4bit_splitk" 600 -- \
      bash "$REPO/scripts/compile_metal.sh" "${args[@]}" --unit gemm_4bit_splitk || FAILED=1
    step "compile the other kernel units (xcrun metal)" "$WORK/compile_kernels.log" "" 1200 -- \
      bash "$REPO/scripts/compile_metal.sh" "${args[@]}" --skip gemm_4bit_splitk || FAILED=1
  else
    step "compile the kernels (xcrun metal)" "$WORK/compile_kernels.log" "" 1200 -- \
      bash "$REPO/scripts/compile_metal.sh" "${args[@]}" || FAILED=1
  fi
}
# Before everything else; the dry run compiles last instead, after the steps whose order
# tests/test_acceptance.py checks.
[ "$DRY" = 0 ] && compile_kernels

if [ "$DRY" = 1 ]; then
  say "dry run: everything except the mps parts (no GPU is used; the venv reuses $PY's packages)"
fi
step "create the venv and install bnb-mps" "$WORK/setup.log" "$VENV" 3600 -- setup_venv \
  || die "setting up the venv failed; see $WORK/setup.log"

if [ "$DRY" = 0 ]; then
  if ! "$VPY" -c 'import sys, torch; sys.exit(0 if torch.backends.mps.is_available() else 1)'; then
    reason=$("$VPY" -c 'import torch; print("torch", torch.__version__, "built with mps:", torch.backends.mps.is_built())' 2>&1)
    die "this Mac has no working mps device ($reason; macOS 12.3+ on Apple Silicon is needed). Nothing was tested."
  fi
fi

step "python -m bnb_mps" "$WORK/diagnostics.txt" "" 900 -- "$VPY" -m bnb_mps || FAILED=1

if [ "$DRY" = 1 ]; then
  # The time limit at work: a planted step that prints a line and hangs must be stopped at its limit,
  # recorded as "timed out" with that line, and the run must go on.
  EXPECT=timed-out step "a hanging step is stopped (planted, dry run)" "$WORK/planted_hang.log" \
    "must time out after 3 s" 3 -- "$VPY" -c 'print("planted step: hanging now", flush=True); import time; time.sleep(3600)' \
    || FAILED=1
fi

if [ "$DRY" = 1 ]; then
  # A small part of the suite: the mps suite's machinery and its mps tests (skipped here, which
  # still exercises the report's grouping).
  TESTS=("$REPO/tests/test_mps_families.py" "$REPO/tests/test_mps.py"
         -k "specials or same_bits or assert_close or device_views or every_kernel or uses_dtype or test_mps.py")
  NOTE="subset (dry run)"
else
  TESTS=("$REPO/tests")
  NOTE="whole suite, mps tests on the native and shader tiers"
fi
# BNB_MPS_ACCEPTANCE: the suite's own dry run of this script is skipped inside this run.
step "test suite" "$WORK/pytest.log" "$NOTE" 7200 -- \
  env BNB_MPS_ACCEPTANCE=1 "$VPY" -m pytest -q -p no:cacheprovider --rootdir "$REPO" -o junit_family=xunit2 \
    --junitxml "$WORK/junit.xml" "${TESTS[@]}" || FAILED=1

# First-use verification (bnb_mps.ops.verify) as a user's first process meets it, with an empty
# verification cache, then as every later process does, from the cache. Each run reports the tier's
# load and kernel compile apart from the verification; the first one's compile is the cold one for
# the emulated tier of a dry run (an empty module cache), whatever the user's cache holds.
step "kernel verification (cold)" "$WORK/verify_cold.log" "" 1800 -- \
  env BNB_MPS_CACHE_DIR="$WORK/verify-cache" BNB_MPS_VERIFY_CACHE="$WORK/verify-cache/verify.json" \
    "$VPY" -m bnb_mps verify --json "$WORK/verify_cold.json" || FAILED=1
step "kernel verification (cached)" "$WORK/verify_cached.log" "" 600 -- \
  env BNB_MPS_CACHE_DIR="$WORK/verify-cache" BNB_MPS_VERIFY_CACHE="$WORK/verify-cache/verify.json" \
    "$VPY" -m bnb_mps verify --cached --json "$WORK/verify_cached.json" || FAILED=1
# A GPU fault during verification: a test-only kernel (tests/fault_kernels/address_fault.metal, compiled by
# the native tier's compile path, never part of csrc/kernels) fails the command buffer of every launch of
# one family. The family must come out as "could not be verified", with Metal's error text, and not be
# cached; a clean verification right after must pass. (Not run where the native tier does not serve.)
step "kernel verification meets a command-buffer error" "$WORK/verify_fault.log" "" 900 -- \
  env BNB_MPS_VERIFY_CACHE="$WORK/verify-fault-cache/verify.json" \
    "$VPY" "$REPO/tests/command_buffer_fault.py" --json "$WORK/verify_fault.json" || FAILED=1

# What the Metal compiler does with the kernels' float arithmetic on this GPU: a*b + c contracted or
# not, per tier and language version, bare and behind bnb_math_mode.h, and under
# PYTORCH_MPS_FAST_MATH=1 in a fresh process (with NaN tests and sqrt). The dry run probes the emulator.
PROBE_ARGS=()
[ "$DRY" = 1 ] && PROBE_ARGS=(--tier emulated --n 1024)
step "math mode probes" "$WORK/probe_math_mode.log" "" 1200 -- \
  "$VPY" "$REPO/scripts/probe_math_mode.py" ${PROBE_ARGS[@]+"${PROBE_ARGS[@]}"} --json "$WORK/probe_math_mode.json" \
  || FAILED=1

step "kernel benchmarks (short)" "$WORK/bench_kernels.log" "" 1800 -- \
  "$VPY" "$REPO/scripts/bench_kernels.py" --short --json "$WORK/bench_kernels.json" \
    --chart "$OUT/bench_kernels.png" || FAILED=1

# Host cost per op call: the op layer with a no-op launch against a trivial kernel, and on a Mac the
# native tier's real launches (the pybind11 call and the encoding on PyTorch's stream).
step "host cost per op call" "$WORK/bench_op_overhead.log" "" 900 -- \
  "$VPY" "$REPO/scripts/bench_op_overhead.py" --native --rounds "$([ "$DRY" = 1 ] && echo 2 || echo 15)" \
    --calls "$([ "$DRY" = 1 ] && echo 50 || echo 2000)" --json "$WORK/bench_op_overhead.json" || FAILED=1

# Tuning (bnb_mps.ops.tuning): every route of one model's 4-bit layers measured on this GPU as at
# first use (kernel paths and variants, dequantize+linear, bitsandbytes' own), against dense fp16
# linear and, where mlx is installed, MLX's quantized_matmul; the table and the chart go into the
# report. Its own cache file, so the run measures afresh. The dry run measures a small shape on the
# emulated tier (host-clock figures that mean nothing for a GPU). The row counts: decode (1), the
# small batches of docs/small-batch.md (2..32, where the split-K kernel is the built-in route and its
# speed against gemv, small, batch and mma is for this run to show), and prefill (512, 2048).
TUNE_ARGS=(--model Llama-3-8B --m 1,2,4,8,16,32,512,2048)
[ "$DRY" = 1 ] && TUNE_ARGS=(--tier emulated --shapes 64x128 --m 1,8,40)
step "tuning (python -m bnb_mps tune)" "$WORK/tune.log" "${TUNE_ARGS[*]}" 3600 -- \
  env BNB_MPS_TUNE_CACHE="$WORK/tune-cache.json" "$VPY" -m bnb_mps tune "${TUNE_ARGS[@]}" --json "$WORK/tune.json" \
    --chart "$OUT/tune.png" || FAILED=1

if [ -f "$REPO/scripts/bench_optimizers.py" ]; then
  step "optimizer benchmarks (short)" "$WORK/bench_optimizers.log" "" 1800 -- \
    "$VPY" "$REPO/scripts/bench_optimizers.py" --short --json "$WORK/bench_optimizers.json" || FAILED=1
else
  skip_step "optimizer benchmarks (short)" "scripts/bench_optimizers.py is not in this checkout yet"
fi

[ "$DRY" = 1 ] && compile_kernels

say "report"
DRY_FLAG=()
[ "$DRY" = 1 ] && DRY_FLAG=(--dry-run)
"$VPY" "$REPO/scripts/acceptance_report.py" --out "$OUT" --work "$WORK" --repo "$REPO" ${DRY_FLAG[@]+"${DRY_FLAG[@]}"} \
  || die "writing the report failed"
exit $FAILED
