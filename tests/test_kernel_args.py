"""bnb_mps.kernel_args.Scalar: exactly the bytes of a `constant T&` kernel parameter, with its value and
MSL type (so that executors bind it as it is, with nothing to convert per launch)."""

import copy
import math
import pickle
import struct

import pytest

from bnb_mps.kernel_args import Scalar, bool_, float16, float32, int32, int64, uint32, uint64


@pytest.mark.parametrize("scalar, fmt, value", [
    (uint32(2**32 - 1), "<I", 2**32 - 1), (int32(-5), "<i", -5), (uint64(2**63), "<Q", 2**63), (int64(-1), "<q", -1),
    (float32(0.1), "<f", 0.1), (float16(-1.5), "<e", -1.5), (bool_(True), "<?", True), (Scalar(200, "uchar"), "<B", 200),
])  # fmt: skip
def test_a_scalar_is_the_little_endian_bytes_of_its_type(scalar, fmt, value):
    assert isinstance(scalar, bytes) and bytes(scalar) == struct.pack(fmt, value) == scalar.to_bytes()
    assert type(scalar.to_bytes()) is bytes and scalar.nbytes == struct.calcsize(fmt)
    assert scalar.value == value and scalar.type in repr(scalar)


def test_values_outside_the_type_and_unknown_types_are_refused_when_made():
    for make, value in ((uint32, -1), (uint32, 2**32), (int32, 2**31), (float16, 1e6)):
        with pytest.raises(ValueError, match="does not fit the Metal type"):
            make(value)
    with pytest.raises(ValueError, match="type must be one of"):
        Scalar(1, "double")


def test_equality_is_type_and_bytes_and_a_scalar_is_immutable():
    assert uint32(5) == uint32(5) and hash(uint32(5)) == hash(uint32(5))
    assert uint32(5) != int32(5)  # the same bytes, another type
    assert uint32(5) == struct.pack("<I", 5)  # and its own bytes
    assert float32(0.0) != float32(-0.0) and float32(math.nan).value != float32(math.nan).value
    with pytest.raises(AttributeError):
        uint32(5).value = 6
    for clone in (copy.copy(uint32(7)), copy.deepcopy(uint32(7)), pickle.loads(pickle.dumps(uint32(7)))):
        assert type(clone) is Scalar and clone == uint32(7) and clone.type == "uint"
