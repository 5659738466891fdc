#!/usr/bin/env bash
# The test suite, from a fresh machine: sets up the environment, then runs pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k fallback`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# A full run (no arguments) also checks that every kernel was launched under the emulator, so
# that `slow` markers never leave a kernel variant out of the default run.
if [ "$#" -eq 0 ]; then
  set -- --kernel-coverage
fi
exec "${PYTHON:-python3}" -m pytest -q "$@"
