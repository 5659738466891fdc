"""Checks shared by the two GPU tiers (native, shader), done in Python before anything reaches Metal.

Both run once per kernel launch, so they stay cheap: no allocation beyond the error path.
"""

from __future__ import annotations

from .base import ExecutorUnavailable

# Metal's limit on threads per threadgroup on every Apple GPU; a pipeline may allow fewer (the
# native library checks that one too).
MAX_THREADS_PER_THREADGROUP = 1024

# The kernels' SIMD-group reductions, lane layouts and simdgroup counts assume 32 lanes, the SIMD
# width of every Apple GPU so far. A GPU reporting another width must not run them.
SIMD_WIDTH = 32

# The device type of the tensors the GPU tiers bind: "mps". The test-side model of torch's MPS
# runtime (bnb_mps.modelled_mps) sets "cpu" while it is active, where CPU tensors stand in for mps
# ones; executors read it when they are made.
_tensor_device = "mps"


def tensor_device() -> str:
    """The device type of the tensors a GPU tier made now binds ("mps"; "cpu" under the model)."""
    return _tensor_device


def check_simd_width(width, kernel: str) -> None:
    """Raise ExecutorUnavailable unless a pipeline's thread execution width is SIMD_WIDTH."""
    if width != SIMD_WIDTH:
        raise ExecutorUnavailable(
            f"this GPU runs kernel {kernel!r} with a SIMD width of {width}; bnb_mps' kernels are written for "
            f"{SIMD_WIDTH} (every Apple GPU so far)"
        )


def _dim3(what: str, value, minimum: int) -> tuple[int, int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise ValueError(f"{what} must be a tuple of 3 ints (x, y, z), got {value!r}")
    for v in value:
        if type(v) is not int:  # bool and float are mistakes here
            raise TypeError(f"{what} must hold ints, got {value!r}")
        if v < minimum:
            raise ValueError(f"{what} dimensions must be >= {minimum}, got {value!r}")
    return value


def check_geometry(grid, threadgroup) -> bool:
    """Validate a launch's geometry; False when the grid is empty (the launch is a no-op).

    `grid` counts threadgroups (each >= 0), `threadgroup` counts threads per group (each >= 1,
    at most 1024 in total).
    """
    gx, gy, gz = _dim3("grid", grid, 0)
    tx, ty, tz = _dim3("threadgroup", threadgroup, 1)
    if tx * ty * tz > MAX_THREADS_PER_THREADGROUP:
        raise ValueError(
            f"threadgroup {tuple(threadgroup)} has {tx * ty * tz} threads; Metal allows at most "
            f"{MAX_THREADS_PER_THREADGROUP}"
        )
    return gx != 0 and gy != 0 and gz != 0


def mps_unavailable_reason() -> str:
    """Why torch.backends.mps.is_available() is False, as precisely as torch says."""
    import torch

    if not torch.backends.mps.is_built():
        return f"this torch ({torch.__version__}) was built without MPS support; install a macOS arm64 build of torch"
    return "torch.backends.mps.is_available() is False (needs an Apple Silicon Mac with a supported macOS)"
