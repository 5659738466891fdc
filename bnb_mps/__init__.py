"""bnb-mps: Metal kernels for bitsandbytes on Apple Silicon."""

__version__ = "0.1.0"


def _entry_point() -> None:
    """Target of the `bitsandbytes.backends` entry point (placeholder)."""
