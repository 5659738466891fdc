#!/usr/bin/env bash
# The main job, from a fresh machine: set up (scripts/setup_env.sh), then fine-tune a tiny Llama
# with QLoRA end to end: `python -m bnb_mps demo`. The device is bnb_mps.device.get_device()'s
# choice: on a Mac, mps (bitsandbytes' ops served by bnb-mps' Metal kernels); elsewhere the CPU,
# where bitsandbytes' own CPU code serves them (the demo says which). Extra arguments go to the
# demo, e.g. `bash scripts/demo.sh --kernels emulated --steps 20` runs bnb-mps' kernels under the
# emulator on the CPU, `--size small` a larger model. The diagnostics: python -m bnb_mps info.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${PYTHON:-python3}" -m bnb_mps demo "$@"
