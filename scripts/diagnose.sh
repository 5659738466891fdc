#!/usr/bin/env bash
# The diagnostics, from a fresh machine: set up, then report which tier serves each bitsandbytes
# op on this machine and how to get the fast one. (The main job is scripts/demo.sh.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${PYTHON:-python3}" -m bnb_mps "$@"
