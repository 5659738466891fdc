"""Tooling for the project's Metal Shading Language source (`csrc/kernels/`).

- `source`: where the kernel files are and the one amalgamation every executor compiles;
- `text`: offset-preserving text utilities (comment/string stripping, top-level splitting),
  shared by the lint and the emulator's pre-pass;
- `lint`: what compiles as C++ under the emulator but is not valid (or not allowed) MSL.

`python -m bnb_mps.msl_lint [paths...]` runs the static checks from the command line.
"""
