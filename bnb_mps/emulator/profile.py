"""A kernel's memory traffic, measured by the emulator (`Library.profile`), and a bandwidth-bound
time estimate per Apple chip.

Memory-bound kernels on Apple GPUs are decided mostly by how many bytes they move and by how well
each SIMD-group memory instruction's accesses fall into 128-byte cache lines. Both are counted
exactly from the kernel's own accesses:

- per buffer argument: bytes requested by loads, stores and atomics; distinct bytes touched;
  distinct lines touched (`lines`: the DRAM traffic lower bound, every line moved once); and the
  distinct lines each threadgroup touches, summed over threadgroups
  (`lines_summed_over_threadgroups`: the traffic when nothing is reused between threadgroups);
- SIMD-group memory transactions: for each SIMD-group memory instruction, the number of distinct
  lines its lanes touch, summed (`simd_transactions`), against the ideal `bytes / line_bytes`
  (`simd_transactions_ideal`); their ratio is the coalescing efficiency (1.0: every instruction
  moves whole lines; 1/32 when each lane of a 32-wide load hits its own line). See
  `Library.profile` for how instructions are reconstructed and divergent control flow approximated;
- threadgroup memory allocated per threadgroup (the largest), bytes loaded and stored there,
  barriers executed per threadgroup (the most), threads and threadgroups launched, SIMD-group
  collectives executed (once per simdgroup).

The estimate. Traffic terms (bytes): `unique_lines` = lines x line_bytes, the floor reached when
caches keep every line until it is no longer needed; `lines_summed_over_threadgroups` x line_bytes,
when each threadgroup fetches what it touches (perfect reuse inside a threadgroup, none between
threadgroups). The estimate takes the largest term (currently always the second: a threadgroup's
lines are among all lines) at the chip's peak bandwidth (bnb_mps.chips):

    time = max(traffic terms) / bandwidth,    efficiency = required_bytes / max(traffic terms)

the efficiency being the share of peak bandwidth the kernel would reach if it ran at that time
while only its required bytes count as useful. Both are bounds under a simple model, not
predictions: caches between threadgroups usually recover part of the re-read traffic (a lookup
table every threadgroup reads), launch overhead and latency are ignored, and uncoalesced accesses
cost more than their lines (they appear in the coalescing efficiency, which is reported separately).
Only a Mac measures the real time (scripts/bench_kernels.py).

How the accesses are seen: kernels compile as C++ where device pointers are plain pointers, so
the profiler uses a second build of the kernel module, made by clang with
`-fsanitize-coverage=trace-loads,trace-stores`: the compiler calls a hook before every load and
store with its address and width, the hook (bnb_emu/kernel.h) drops what is neither a bound buffer
nor threadgroup memory, and the runtime attributes the rest to the running lane. Chosen over
wrapping device pointers in the shim (which would change what every kernel compiles to and slow
every launch) and over page protection (a fault per access, no widths). The shim makes a vector
copy one access of its width in that build (as the GPU loads it), and the vectorisers are off so
that the CPU compiler neither merges nor splits the kernel's accesses. Plain launches keep the
uninstrumented module: their code is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

#: Cache line of Apple GPUs, in bytes.
LINE_BYTES = 128

#: Chips shown by KernelProfile.__str__ (all of bnb_mps.chips are in to_dict()).
SHOWN_CHIPS = ("M1", "M2 Pro", "M3 Max", "M4 Max")


@dataclass(frozen=True)
class BufferTraffic:
    """What one buffer argument saw."""

    size: int  # bytes bound
    load_bytes: int
    store_bytes: int
    atomic_bytes: int
    accesses: int  # device accesses into this buffer
    unique_bytes: int
    lines: int
    lines_summed_over_threadgroups: int
    transactions: int  # lines touched by SIMD-group memory instructions into this buffer
    line_bytes: int = LINE_BYTES

    @property
    def bytes_requested(self) -> int:
        return self.load_bytes + self.store_bytes + self.atomic_bytes

    @property
    def transactions_ideal(self) -> float:
        return self.bytes_requested / self.line_bytes

    @property
    def coalescing_efficiency(self) -> Optional[float]:
        return self.transactions_ideal / self.transactions if self.transactions else None

    def to_dict(self) -> dict:
        return {
            "size": self.size, "load_bytes": self.load_bytes, "store_bytes": self.store_bytes,
            "atomic_bytes": self.atomic_bytes, "accesses": self.accesses, "unique_bytes": self.unique_bytes,
            "lines": self.lines, "lines_summed_over_threadgroups": self.lines_summed_over_threadgroups,
            "transactions": self.transactions, "transactions_ideal": self.transactions_ideal,
            "coalescing_efficiency": self.coalescing_efficiency,
        }  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    """Bandwidth-bound time of a kernel on one chip."""

    chip: str
    gbps: float  # peak bandwidth, GB/s
    traffic_bytes: int  # the largest traffic term
    required_bytes: Optional[int]

    @property
    def time_s(self) -> float:
        return self.traffic_bytes / (self.gbps * 1e9)

    @property
    def efficiency(self) -> Optional[float]:
        """required bytes / traffic: the share of peak bandwidth spent on required bytes."""
        if self.required_bytes is None or not self.traffic_bytes:
            return None
        return self.required_bytes / self.traffic_bytes


@dataclass(frozen=True)
class KernelProfile:
    """The memory traffic of one dispatch (see the module docstring for every figure)."""

    kernel: str
    grid: tuple[int, int, int]  # threadgroups per grid
    threadgroup: tuple[int, int, int]  # threads per threadgroup (dispatch size)
    line_bytes: int
    buffers: tuple[Optional[BufferTraffic], ...]  # argument order; None for scalars
    simd_instructions: int
    simd_transactions: int
    threads: int
    threadgroups: int
    barriers: int  # per threadgroup (the most any threadgroup executed)
    barriers_total: int
    simd_collectives: int
    threadgroup_memory_bytes: int  # per threadgroup (the largest allocation)
    threadgroup_load_bytes: int
    threadgroup_store_bytes: int
    threadgroup_atomic_bytes: int
    required_bytes: Optional[int] = None

    @classmethod
    def from_counts(cls, kernel: str, grid: Sequence[int], threadgroup: Sequence[int], counted: Sequence[bool],
                    sizes: Sequence[int], line_bytes: int, counts: Optional[dict],
                    required_bytes: Optional[int] = None) -> "KernelProfile":
        """From the runtime's counts (None: nothing ran)."""
        c = counts or {}
        raw = c.get("buffers") or [{} for _ in counted]
        buffers = tuple(
            BufferTraffic(size=size, line_bytes=line_bytes,
                          **{k: b.get(k, 0) for k in ("load_bytes", "store_bytes", "atomic_bytes", "accesses",
                                                      "unique_bytes", "lines", "lines_summed_over_threadgroups",
                                                      "transactions")})
            if is_buffer else None
            for is_buffer, size, b in zip(counted, sizes, raw)
        )  # fmt: skip
        return cls(
            kernel=kernel, grid=tuple(grid), threadgroup=tuple(threadgroup), line_bytes=line_bytes, buffers=buffers,
            simd_instructions=c.get("instructions", 0), simd_transactions=c.get("transactions", 0),
            threads=c.get("threads", 0), threadgroups=c.get("threadgroups", 0), barriers=c.get("barriers_max", 0),
            barriers_total=c.get("barriers", 0), simd_collectives=c.get("collectives", 0),
            threadgroup_memory_bytes=c.get("threadgroup_memory_max", 0),
            threadgroup_load_bytes=c.get("threadgroup_load_bytes", 0),
            threadgroup_store_bytes=c.get("threadgroup_store_bytes", 0),
            threadgroup_atomic_bytes=c.get("threadgroup_atomic_bytes", 0), required_bytes=required_bytes,
        )  # fmt: skip

    # -- totals over the buffers --------------------------------------------------------------

    def _sum(self, attr: str) -> int:
        return sum(getattr(b, attr) for b in self.buffers if b is not None)

    @property
    def load_bytes(self) -> int:
        return self._sum("load_bytes")

    @property
    def store_bytes(self) -> int:
        return self._sum("store_bytes")

    @property
    def atomic_bytes(self) -> int:
        return self._sum("atomic_bytes")

    @property
    def bytes_requested(self) -> int:
        return self.load_bytes + self.store_bytes + self.atomic_bytes

    @property
    def unique_bytes(self) -> int:
        return self._sum("unique_bytes")

    @property
    def lines(self) -> int:
        return self._sum("lines")

    @property
    def lines_summed_over_threadgroups(self) -> int:
        return self._sum("lines_summed_over_threadgroups")

    @property
    def simd_transactions_ideal(self) -> float:
        return self.bytes_requested / self.line_bytes

    @property
    def coalescing_efficiency(self) -> Optional[float]:
        """simd_transactions_ideal / simd_transactions (None when nothing was accessed)."""
        return self.simd_transactions_ideal / self.simd_transactions if self.simd_transactions else None

    # -- the estimate -------------------------------------------------------------------------

    def traffic_terms(self) -> dict[str, int]:
        """The traffic terms of the estimate, in bytes."""
        return {
            "unique_lines": self.lines * self.line_bytes,
            "lines_summed_over_threadgroups": self.lines_summed_over_threadgroups * self.line_bytes,
        }

    @property
    def traffic_bytes(self) -> int:
        return max(self.traffic_terms().values())

    @property
    def traffic_efficiency(self) -> Optional[float]:
        """required_bytes / traffic_bytes (None without required_bytes)."""
        if self.required_bytes is None or not self.traffic_bytes:
            return None
        return self.required_bytes / self.traffic_bytes

    def estimate(self, chip: str, gbps: Optional[float] = None, required_bytes: Optional[int] = None) -> Estimate:
        """The estimate on `chip` (a name of bnb_mps.chips, or any name with `gbps` given)."""
        from .. import chips

        if gbps is None:
            gbps = chips.bandwidth(chip)
            if gbps is None:
                raise ValueError(f"unknown chip {chip!r}; known: {', '.join(chips.BANDWIDTH_GBPS)}")
        req = self.required_bytes if required_bytes is None else required_bytes
        return Estimate(chip, float(gbps), self.traffic_bytes, req)

    def estimates(self, chip_names: Optional[Iterable[str]] = None, required_bytes: Optional[int] = None) -> list[Estimate]:
        """Estimates on every chip of bnb_mps.chips (or on `chip_names`)."""
        from .. import chips

        table = chips.peak_bandwidths()
        names = list(table) if chip_names is None else list(chip_names)
        return [self.estimate(n, table.get(n), required_bytes) for n in names]

    # -- reports ------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """Plain data (JSON-serialisable). Keys scripts can rely on: "buffers" (argument order; None
        for scalars, else a dict with "load_bytes", "store_bytes", "unique_bytes", "lines",
        "lines_summed_over_threadgroups", ...), "simd_transactions", "simd_transactions_ideal",
        "threadgroup_memory_bytes", "barriers", "threads", "threadgroups", and more."""
        return {
            "kernel": self.kernel,
            "grid": list(self.grid),
            "threadgroup": list(self.threadgroup),
            "line_bytes": self.line_bytes,
            "buffers": [b.to_dict() if b is not None else None for b in self.buffers],
            "load_bytes": self.load_bytes,
            "store_bytes": self.store_bytes,
            "atomic_bytes": self.atomic_bytes,
            "unique_bytes": self.unique_bytes,
            "lines": self.lines,
            "lines_summed_over_threadgroups": self.lines_summed_over_threadgroups,
            "simd_instructions": self.simd_instructions,
            "simd_transactions": self.simd_transactions,
            "simd_transactions_ideal": self.simd_transactions_ideal,
            "coalescing_efficiency": self.coalescing_efficiency,
            "threadgroup_memory_bytes": self.threadgroup_memory_bytes,
            "threadgroup_load_bytes": self.threadgroup_load_bytes,
            "threadgroup_store_bytes": self.threadgroup_store_bytes,
            "threadgroup_atomic_bytes": self.threadgroup_atomic_bytes,
            "barriers": self.barriers,
            "barriers_total": self.barriers_total,
            "simd_collectives": self.simd_collectives,
            "threads": self.threads,
            "threadgroups": self.threadgroups,
            "traffic_terms": self.traffic_terms(),
            "traffic_bytes": self.traffic_bytes,
            "required_bytes": self.required_bytes,
            "traffic_efficiency": self.traffic_efficiency,
            "estimates": {e.chip: {"gbps": e.gbps, "time_s": e.time_s, "efficiency": e.efficiency}
                          for e in self.estimates()},
        }  # fmt: skip

    def __str__(self) -> str:
        grid = "x".join(str(g) for g in self.grid)
        tg = "x".join(str(t) for t in self.threadgroup)
        out = [f"profile of {self.kernel}: grid {grid} threadgroups of {tg} threads "
               f"({self.threadgroups} threadgroups, {self.threads} threads run)"]  # fmt: skip
        head = ("buffer", "bytes bound", "loaded", "stored", "atomic", "unique bytes", "lines", "lines/TG summed",
                "transactions", "ideal", "coalescing")  # fmt: skip
        rows = [head]
        for i, b in enumerate(self.buffers):
            if b is None:
                rows.append((str(i), "scalar") + ("",) * (len(head) - 2))
                continue
            rows.append((str(i), str(b.size), str(b.load_bytes), str(b.store_bytes), str(b.atomic_bytes),
                         str(b.unique_bytes), str(b.lines), str(b.lines_summed_over_threadgroups),
                         str(b.transactions), f"{b.transactions_ideal:g}", _ratio(b.coalescing_efficiency)))  # fmt: skip
        rows.append(("total", "", str(self.load_bytes), str(self.store_bytes), str(self.atomic_bytes),
                     str(self.unique_bytes), str(self.lines), str(self.lines_summed_over_threadgroups),
                     str(self.simd_transactions), f"{self.simd_transactions_ideal:g}",
                     _ratio(self.coalescing_efficiency)))  # fmt: skip
        widths = [max(len(r[k]) for r in rows) for k in range(len(head))]
        out += ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        out.append(f"  SIMD-group memory instructions: {self.simd_instructions}, {self.simd_transactions} "
                   f"transactions ({self.line_bytes}-byte lines) vs {self.simd_transactions_ideal:g} ideal: "
                   f"coalescing efficiency {_ratio(self.coalescing_efficiency)}")  # fmt: skip
        out.append(f"  per threadgroup: {self.threadgroup_memory_bytes} bytes of threadgroup memory, "
                   f"{self.barriers} barriers; threadgroup memory loaded {self.threadgroup_load_bytes} B, stored "
                   f"{self.threadgroup_store_bytes} B in all; {self.simd_collectives} SIMD-group collectives")  # fmt: skip
        terms = ", ".join(f"{k.replace('_', ' ')} {_bytes(v)}" for k, v in self.traffic_terms().items())
        req = ""
        if self.required_bytes is not None:
            req = f"; required {_bytes(self.required_bytes)}: traffic efficiency {_ratio(self.traffic_efficiency)}"
        out.append(f"  traffic: {terms}{req}")
        shown = [e for e in self.estimates() if e.chip in SHOWN_CHIPS]
        out.append("  estimated time (traffic / peak bandwidth): " +
                   ", ".join(f"{e.chip} {_seconds(e.time_s)}" for e in shown))  # fmt: skip
        return "\n".join(out)


def _ratio(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _seconds(t: float) -> str:
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    if t >= 1e-6:
        return f"{t * 1e6:.2f} us"
    return f"{t * 1e9:.0f} ns"


def summarize(profiles: Sequence[KernelProfile], required_bytes: Optional[int] = None,
              chip_names: Iterable[str] = SHOWN_CHIPS) -> dict:
    """Totals over the launches of one operation (e.g. the profiles recorded by
    `bnb_mps.testing.use_emulated_kernels(profile=True)` for one op call): traffic adds up, and so
    do the launches' estimated times (each launch's largest traffic term at peak bandwidth)."""
    from .. import chips

    def total(attr: str):
        return sum(getattr(p, attr) for p in profiles)

    transactions, ideal = total("simd_transactions"), total("simd_transactions_ideal")
    traffic = total("traffic_bytes")
    table = chips.peak_bandwidths()
    return {
        "kernels": [p.kernel for p in profiles],
        "bytes_requested": total("bytes_requested"),
        "unique_bytes": total("unique_bytes"),
        "lines": total("lines"),
        "lines_summed_over_threadgroups": total("lines_summed_over_threadgroups"),
        "simd_transactions": transactions,
        "simd_transactions_ideal": ideal,
        "coalescing_efficiency": ideal / transactions if transactions else None,
        "traffic_bytes": traffic,
        "required_bytes": required_bytes,
        "traffic_efficiency": required_bytes / traffic if required_bytes is not None and traffic else None,
        "estimated_time_s": {c: traffic / (table[c] * 1e9) for c in chip_names},
    }
