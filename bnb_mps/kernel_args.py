"""Typed scalar arguments for kernel launches.

A kernel parameter `constant uint& n [[buffer(3)]]` needs exactly four bytes of a uint; a bare
Python int does not say which width it is. Every executor (native, shader, emulated) accepts these
wrappers, and tensors, as launch arguments. This module knows Metal types, nothing else.
"""

from __future__ import annotations

import struct

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


class Scalar(bytes):
    """A scalar bound to a `constant T&` kernel parameter: exactly the bytes of the MSL type `type`
    holding `value` (little-endian). It is those bytes (a `bytes` object), so that an executor binds
    it as it is, with nothing to convert per launch.

    Two Scalars are equal when their types and bytes are; a Scalar equals its own bytes. Immutable."""

    def __new__(cls, value: int | float | bool, type: str) -> "Scalar":
        fmt = _FORMATS.get(type) if isinstance(type, str) else None
        if fmt is None:
            raise ValueError(f"type must be one of {sorted(_FORMATS)}, got {type!r}")
        try:
            raw = struct.pack(fmt, value)  # range check now, not at launch time
        except (struct.error, OverflowError) as e:
            raise ValueError(f"{value!r} does not fit the Metal type {type}: {e}") from None
        self = super().__new__(cls, raw)
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "type", type)
        return self

    def __setattr__(self, name, value):
        raise AttributeError(f"Scalar is immutable (cannot set {name!r})")

    def __eq__(self, other):
        if isinstance(other, Scalar):
            return self.type == other.type and bytes.__eq__(self, other)
        return bytes.__eq__(self, other)

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = bytes.__hash__

    def __repr__(self) -> str:
        return f"Scalar(value={self.value!r}, type={self.type!r})"

    def __reduce__(self):
        return (Scalar, (self.value, self.type))

    def to_bytes(self) -> bytes:
        """The bytes alone (a plain `bytes` object)."""
        return bytes(self)

    @property
    def nbytes(self) -> int:
        return len(self)


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
