"""Typed scalar arguments for kernel launches.

A kernel parameter `constant uint& n [[buffer(3)]]` needs exactly four bytes of a uint; a bare
Python int does not say which width it is. Every executor (native, shader, emulated) accepts these
wrappers, and tensors, as launch arguments. This module knows Metal types, nothing else.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

# MSL scalar type -> struct format (little-endian, as on every Apple GPU and on x86-64/arm64).
_FORMATS = {
    "bool": "<?",
    "char": "<b",
    "uchar": "<B",
    "short": "<h",
    "ushort": "<H",
    "int": "<i",
    "uint": "<I",
    "long": "<q",
    "ulong": "<Q",
    "half": "<e",
    "float": "<f",
}


@dataclass(frozen=True)
class Scalar:
    """A scalar bound to a `constant T&` kernel parameter; `type` is the MSL type name."""

    value: int | float | bool
    type: str

    def __post_init__(self) -> None:
        if self.type not in _FORMATS:
            raise ValueError(f"type must be one of {sorted(_FORMATS)}, got {self.type!r}")
        self.to_bytes()  # range check now, not at launch time

    def to_bytes(self) -> bytes:
        try:
            return struct.pack(_FORMATS[self.type], self.value)
        except (struct.error, OverflowError) as e:
            raise ValueError(f"{self.value!r} does not fit the Metal type {self.type}: {e}") from None

    @property
    def nbytes(self) -> int:
        return struct.calcsize(_FORMATS[self.type])


def uint32(v: int) -> Scalar:
    return Scalar(int(v), "uint")


def int32(v: int) -> Scalar:
    return Scalar(int(v), "int")


def uint64(v: int) -> Scalar:
    return Scalar(int(v), "ulong")


def int64(v: int) -> Scalar:
    return Scalar(int(v), "long")


def float32(v: float) -> Scalar:
    return Scalar(float(v), "float")


def float16(v: float) -> Scalar:
    return Scalar(float(v), "half")


def bool_(v: bool) -> Scalar:
    return Scalar(bool(v), "bool")
