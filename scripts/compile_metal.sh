#!/usr/bin/env bash
# Compiles each kernel compile unit (csrc/kernels/*.metal, one .metal file with its includes) with
# Apple's offline Metal compiler at the requested Metal language versions, with the flags of the
# native build's metallib (csrc/metal_toolchain.cmake): -fno-fast-math, -ffp-contract=off where the
# compiler takes it, the version's minimum macOS, csrc/kernels on the include path.
#
#     bash scripts/compile_metal.sh [--std VERSION]... [--try-std VERSION]... [--unit NAME]...
#                                   [--skip NAME]... [--metallib] [--out DIR] [--probe]
#
#   --std VERSION      compile at this version (metal3.1, metal3.2, metal4.0); one this SDK lacks
#                      fails the run. Repeatable.
#   --try-std VERSION  the same, but a version this SDK lacks is reported "not in this SDK" and
#                      passes. Without --std and --try-std: --std metal3.1 --std metal3.2
#                      --try-std metal4.0.
#   --unit NAME        only csrc/kernels/NAME.metal (repeatable); --skip NAME: every unit but NAME.
#   --metallib         also link each unit's .air into a .metallib (xcrun metallib).
#   --out DIR          keep the .air, .metallib and compiler logs in DIR (default: a temporary
#                      directory, removed at exit).
#   --probe            compile only a one-line kernel at each version: is the compiler there?
#
# A version is in this SDK when a one-line kernel compiles at it. The split-K unit
# (gemm_4bit_splitk) is compiled first when present. One line per unit and version:
#
#     gemm_4bit_splitk metal3.2: ok
#     gemm_4bit_splitk metal3.2: FAILED: <the compiler's first error line>
#     gemm_4bit_splitk metal4.0: not in this SDK (<the probe's first error line>)
#
# Needs macOS with Xcode's Metal toolchain (the Command Line Tools alone have no Metal compiler;
# Xcode 26: xcodebuild -downloadComponent MetalToolchain). Exit status: 0 every unit compiled at
# every version tried that this SDK has; 1 a unit failed, or a --std version is not in this SDK;
# 2 usage error, no xcrun, or no units. (bash 3.2, as macOS has.)
set -uo pipefail
export LC_ALL=C  # (the units' name order, byte-wise)

ROOT=$(cd "$(dirname "$0")/.." && pwd -P)
KERNELS="$ROOT/csrc/kernels"
SPLITK=gemm_4bit_splitk

usage() { sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "compile_metal: $*" >&2; exit 2; }

REQUIRED=()
OPTIONAL=()
ONLY=()
SKIP=()
METALLIB=0
PROBE=0
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --std) REQUIRED+=("${2:?--std needs a version}"); shift 2 ;;
    --std=*) REQUIRED+=("${1#--std=}"); shift ;;
    --try-std) OPTIONAL+=("${2:?--try-std needs a version}"); shift 2 ;;
    --try-std=*) OPTIONAL+=("${1#--try-std=}"); shift ;;
    --unit) ONLY+=("${2:?--unit needs a name}"); shift 2 ;;
    --skip) SKIP+=("${2:?--skip needs a name}"); shift 2 ;;
    --metallib) METALLIB=1; shift ;;
    --out) OUT=${2:?--out needs a directory}; shift 2 ;;
    --probe) PROBE=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
if [ ${#REQUIRED[@]} -eq 0 ] && [ ${#OPTIONAL[@]} -eq 0 ]; then
  REQUIRED=(metal3.1 metal3.2)
  OPTIONAL=(metal4.0)
fi
for v in ${REQUIRED[@]+"${REQUIRED[@]}"} ${OPTIONAL[@]+"${OPTIONAL[@]}"}; do
  case "$v" in
    metal[0-9]*.[0-9]*) ;;
    *) die "not a Metal language version: $v (e.g. metal3.2)" ;;
  esac
done
command -v xcrun >/dev/null 2>&1 || die "no xcrun on PATH: this needs macOS with Xcode's Metal toolchain"

contains() {  # contains WORD LIST...
  local w=$1
  shift
  for x in "$@"; do [ "$x" = "$w" ] && return 0; done
  return 1
}

# The units: the split-K unit first, then the others in name order (the glob's).
UNITS=()
[ -f "$KERNELS/$SPLITK.metal" ] && UNITS+=("$SPLITK")
for path in "$KERNELS"/*.metal; do
  [ -f "$path" ] || continue
  name=$(basename "$path" .metal)
  [ "$name" = "$SPLITK" ] || UNITS+=("$name")
done
for name in ${ONLY[@]+"${ONLY[@]}"} ${SKIP[@]+"${SKIP[@]}"}; do
  [ -f "$KERNELS/$name.metal" ] || die "no unit $name (csrc/kernels/$name.metal)"
done
SELECTED=()
for name in ${UNITS[@]+"${UNITS[@]}"}; do
  if [ ${#ONLY[@]} -gt 0 ] && ! contains "$name" "${ONLY[@]}"; then continue; fi
  if [ ${#SKIP[@]} -gt 0 ] && contains "$name" "${SKIP[@]}"; then continue; fi
  SELECTED+=("$name")
done
[ "$PROBE" = 1 ] || [ ${#SELECTED[@]} -gt 0 ] || die "no units to compile in $KERNELS"

if [ -n "$OUT" ]; then
  mkdir -p "$OUT" || die "cannot create $OUT"
  OUT=$(cd "$OUT" && pwd)
else
  OUT=$(mktemp -d "${TMPDIR:-/tmp}/compile_metal.XXXXXX") || die "cannot create a temporary directory"
  trap 'rm -rf "$OUT"' EXIT
fi

# The minimum macOS of a language version (metal3.1 is the build's, csrc/metal_toolchain.cmake).
macos_min() {
  case "$1" in
    metal3.1) echo 14.0 ;;
    metal3.2) echo 15.0 ;;
    metal4.0) echo 26.0 ;;
    *) echo "" ;;
  esac
}

# The compiler's first error line in a log (else its first line).
first_error() {
  local line
  line=$(grep -m1 'error:' "$1" 2>/dev/null)
  [ -n "$line" ] || line=$(head -n1 "$1" 2>/dev/null)
  line=${line#"$ROOT/"}
  printf '%s' "${line:-no output}"
}

# probe VERSION: sets FLAGS to the compile flags at VERSION and returns 0 when a one-line kernel
# compiles with them; PROBE_ERROR holds the first error line otherwise.
probe() {
  local v=$1 min dir="$OUT/probe-$1"
  mkdir -p "$dir"
  printf 'kernel void bnb_mps_probe(device float* x [[buffer(0)]]) { x[0] = 1.0f; }\n' > "$dir/probe.metal"
  min=$(macos_min "$v")
  FLAGS=(-std="$v")
  [ -n "$min" ] && FLAGS+=(-mmacosx-version-min="$min")
  FLAGS+=(-fno-fast-math)
  if ! xcrun -sdk macosx metal "${FLAGS[@]}" -c "$dir/probe.metal" -o "$dir/probe.air" > "$dir/probe.log" 2>&1 \
     || [ ! -f "$dir/probe.air" ]; then
    PROBE_ERROR=$(first_error "$dir/probe.log")
    return 1
  fi
  if xcrun -sdk macosx metal "${FLAGS[@]}" -ffp-contract=off -c "$dir/probe.metal" -o "$dir/probe_contract.air" \
       > "$dir/probe_contract.log" 2>&1 && [ -f "$dir/probe_contract.air" ]; then
    FLAGS+=(-ffp-contract=off)
  fi
  return 0
}

STATUS=0
# Each version's flags (or its probe error), in version order.
VERSIONS=()
KINDS=()
VFLAGS=()
VERRORS=()
for v in ${REQUIRED[@]+"${REQUIRED[@]}"} ${OPTIONAL[@]+"${OPTIONAL[@]}"}; do
  contains "$v" ${VERSIONS[@]+"${VERSIONS[@]}"} && continue
  kind=optional
  contains "$v" ${REQUIRED[@]+"${REQUIRED[@]}"} && kind=required
  VERSIONS+=("$v")
  KINDS+=("$kind")
  if probe "$v"; then
    VFLAGS+=("${FLAGS[*]}")
    VERRORS+=("")
    [ "$PROBE" = 1 ] && echo "$v: ok (${FLAGS[*]})"
  else
    VFLAGS+=("")
    VERRORS+=("$PROBE_ERROR")
    if [ "$PROBE" = 1 ]; then
      echo "$v: not in this SDK ($PROBE_ERROR)"
      [ "$kind" = required ] && STATUS=1
    fi
  fi
done
[ "$PROBE" = 1 ] && exit $STATUS

for unit in "${SELECTED[@]}"; do
  i=0
  while [ $i -lt ${#VERSIONS[@]} ]; do
    v=${VERSIONS[$i]}
    if [ -n "${VERRORS[$i]}" ]; then
      if [ "${KINDS[$i]}" = required ]; then
        echo "$unit $v: FAILED: not in this SDK (${VERRORS[$i]})"
        STATUS=1
      else
        echo "$unit $v: not in this SDK (${VERRORS[$i]})"
      fi
      i=$((i + 1))
      continue
    fi
    # shellcheck disable=SC2206  # (the flags hold no spaces)
    flags=(${VFLAGS[$i]})
    air="$OUT/$unit.$v.air"
    log="$OUT/$unit.$v.log"
    rm -f "$air"
    if ! xcrun -sdk macosx metal "${flags[@]}" -I "$KERNELS" -c "$KERNELS/$unit.metal" -o "$air" > "$log" 2>&1 \
       || [ ! -f "$air" ]; then
      echo "$unit $v: FAILED: $(first_error "$log")"
      STATUS=1
    elif [ "$METALLIB" = 1 ] && { ! xcrun -sdk macosx metallib "$air" -o "$OUT/$unit.$v.metallib" >> "$log" 2>&1 \
                                  || [ ! -f "$OUT/$unit.$v.metallib" ]; }; then
      echo "$unit $v: FAILED: metallib: $(first_error "$log")"
      STATUS=1
    else
      warnings=$(grep -c 'warning:' "$log" 2>/dev/null)
      if [ "${warnings:-0}" -gt 0 ]; then
        echo "$unit $v: ok ($warnings warnings; first: $(grep -m1 'warning:' "$log"))"
      else
        echo "$unit $v: ok"
      fi
    fi
    i=$((i + 1))
  done
done
exit $STATUS
