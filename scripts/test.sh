#!/usr/bin/env bash
# The test suite, from a fresh machine: sets up the environment, then runs pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k fallback`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
