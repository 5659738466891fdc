"""The chip table: lookups by name and GPU core count."""

import pytest

from bnb_mps import chips


@pytest.mark.parametrize(
    "name,cores,gbps",
    [("Apple M1", None, 68.25), ("Apple M1 Max", 32, 400.0), ("M2 Ultra", 76, 800.0), ("Apple M3 Max", 30, 300.0),
     ("Apple M3 Max", 40, 400.0), ("Apple M3 Max", None, 400.0), ("Apple M4 Pro", 20, 273.0),
     ("Apple M4 Max", 32, 410.0), ("Apple M4 Max", 40, 546.0), ("Apple M3 Ultra", 80, 819.0)],
)
def test_bandwidth_lookup(name, cores, gbps):
    assert chips.bandwidth(name, cores) == gbps


def test_unknown_chips_have_no_bandwidth():
    assert chips.bandwidth("Intel(R) Core(TM) i9") is None
    assert chips.bandwidth("Apple M9 Hyper") is None


def test_detect_is_none_off_apple_silicon(monkeypatch):
    monkeypatch.setattr(chips.platform, "system", lambda: "Linux")
    assert chips.detect() is None
