#!/usr/bin/env bash
# The main job for now, from a fresh machine: set up, then report which tier serves each
# bitsandbytes op on this machine and how to get the fast one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${PYTHON:-python3}" -m bnb_mps "$@"
