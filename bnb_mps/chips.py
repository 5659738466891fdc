"""Apple Silicon chips and their unified-memory bandwidth, for benchmarks and cost estimates.

Bandwidths are Apple's published peak figures (GB/s, 10^9 bytes per second), from the chips'
announcements in Apple Newsroom and the Mac technical specifications pages:
  M1 68.25 (LPDDR4X-4266 on a 128-bit bus; Apple quotes no figure for the M1 itself),
  M1 Pro 200, M1 Max 400 (Newsroom, 2021-10-18), M1 Ultra 800 (Newsroom, 2022-03-08),
  M2 100 (Newsroom, 2022-06-06), M2 Pro 200, M2 Max 400 (Newsroom, 2023-01-17),
  M2 Ultra 800 (Newsroom, 2023-06-05),
  M3 100, M3 Pro 150, M3 Max 300 with the 30-core GPU / 400 with the 40-core GPU
  (Newsroom, 2023-10-30), M3 Ultra 819 (Newsroom, 2025-03-05),
  M4 120, M4 Pro 273, M4 Max 410 with the 32-core GPU / 546 with the 40-core GPU
  (Newsroom, 2024-10-28 and 2024-10-30), M5 153 (Newsroom, 2025-10-15).
Peak figures: kernels reach a fraction of them (well-tuned GEMV about 85-94%).
"""

from __future__ import annotations

import platform
import re
import subprocess
from dataclasses import dataclass
from typing import Optional

#: chip name -> peak memory bandwidth in GB/s; variants by GPU core count as (cores, GB/s) pairs
#: in ascending order (the first entry whose core count is >= the chip's applies).
BANDWIDTH_GBPS: dict[str, object] = {
    "M1": 68.25, "M1 Pro": 200.0, "M1 Max": 400.0, "M1 Ultra": 800.0,
    "M2": 100.0, "M2 Pro": 200.0, "M2 Max": 400.0, "M2 Ultra": 800.0,
    "M3": 100.0, "M3 Pro": 150.0, "M3 Max": ((30, 300.0), (40, 400.0)), "M3 Ultra": 819.0,
    "M4": 120.0, "M4 Pro": 273.0, "M4 Max": ((32, 410.0), (40, 546.0)),
    "M5": 153.0,
}  # fmt: skip


@dataclass(frozen=True)
class Chip:
    name: str  # e.g. "M2 Max"
    gpu_cores: Optional[int]
    bandwidth_gbps: Optional[float]  # None when the chip is not in the table


def bandwidth(name: str, gpu_cores: Optional[int] = None) -> Optional[float]:
    """Peak bandwidth of chip `name` ("M3 Max", "Apple M3 Max" ...) in GB/s, or None if unknown."""
    m = re.search(r"\b(M\d+(?: (?:Pro|Max|Ultra))?)\b", name)
    if m is None or m.group(1) not in BANDWIDTH_GBPS:
        return None
    entry = BANDWIDTH_GBPS[m.group(1)]
    if isinstance(entry, float):
        return entry
    variants = list(entry)
    if gpu_cores is None:
        return variants[-1][1]  # the full chip, the usual configuration
    for cores, gbps in variants:
        if gpu_cores <= cores:
            return gbps
    return variants[-1][1]


def peak_bandwidths() -> dict[str, float]:
    """Every chip of the table with its peak bandwidth in GB/s (the full chip where the bandwidth
    depends on the GPU configuration), in table order."""
    return {name: bandwidth(name) for name in BANDWIDTH_GBPS}  # type: ignore[misc]


def _sysctl(key: str) -> Optional[str]:
    try:
        out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _gpu_cores() -> Optional[int]:
    try:
        import torch

        return int(torch._C._mps_get_core_count())
    except Exception:
        pass
    try:
        out = subprocess.run(["system_profiler", "SPDisplaysDataType"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"Total Number of Cores:\s*(\d+)", out.stdout)
    return int(m.group(1)) if m else None


def detect() -> Optional[Chip]:
    """This machine's Apple chip (from `sysctl machdep.cpu.brand_string`), or None off Apple Silicon."""
    if platform.system() != "Darwin" or platform.machine() != "arm64":
        return None
    brand = _sysctl("machdep.cpu.brand_string") or ""
    m = re.search(r"\b(M\d+(?: (?:Pro|Max|Ultra))?)\b", brand)
    if m is None:
        return None
    cores = _gpu_cores()
    return Chip(m.group(1), cores, bandwidth(m.group(1), cores))
