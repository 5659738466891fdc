"""The version of bnb-mps (the one pyproject.toml declares), in a module of its own so that the op
layer and the tools can read it without importing the package's public API."""

__version__ = "0.1.0"
