#!/usr/bin/env bash
# The test suite, from a fresh machine: sets up what is missing (scripts/setup_env.sh), then runs
# pytest in tiers (tests/tiers.py, docs/tests.md):
#   bash scripts/test.sh            the edit loop: the `unit` and `kernels` tiers
#   bash scripts/test.sh --all      every tier, as CI runs it (also what CI=true selects)
#   bash scripts/test.sh ARGS...    pytest with ARGS (e.g. `-m model`, `-k fallback`, a file)
# The full gate adds --kernel-coverage, which fails the run unless every kernel was launched under
# the emulator (`slow` markers may leave out sizes, never a kernel variant), and --durations=25.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
full=(--kernel-coverage --durations=25)
if [ "$#" -eq 1 ] && [ "$1" = --all ]; then
  set -- "${full[@]}"
elif [ "$#" -eq 0 ]; then
  case "${CI:-}" in
    true|1|yes|TRUE|True) set -- "${full[@]}" ;;
    *) set -- -m "unit or kernels" ;;
  esac
fi
exec "${PYTHON:-python3}" -m pytest -q "$@"
