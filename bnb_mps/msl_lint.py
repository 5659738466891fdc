"""`python -m bnb_mps.msl_lint [paths...]`: the static checks of Metal kernel source.

Files or directories (default: the project's `csrc/kernels/`). Prints `file:line: [rule] message`
per finding and exits 1 if there is any. The checks live in `bnb_mps.msl`.
"""

from __future__ import annotations

import sys

from .msl.lint import main

if __name__ == "__main__":
    sys.exit(main())
