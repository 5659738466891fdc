"""`python -m bnb_mps.msl_lint [paths...]`: the static checks of Metal kernel source.

Files or directories (default: the project's `csrc/kernels/`). Runs the MSL lint and the
address-space check (see `bnb_mps.msl.checks`); prints `file:line: [rule] message` per finding and
exits 1 if there is any. The checks live in `bnb_mps.msl`.
"""

from __future__ import annotations

import sys

from .msl.checks import main

if __name__ == "__main__":
    sys.exit(main())
