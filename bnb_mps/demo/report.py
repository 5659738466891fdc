"""What the demo reports: weight memory, which tier served each bitsandbytes op, the loss plot."""

from __future__ import annotations

import math
from pathlib import Path

#: how each tier serves an op (the tier names of bnb_mps.ops.routing and the executors)
SERVED_BY = {
    "native": "bnb-mps Metal kernel, native library",
    "shader": "bnb-mps Metal kernel, torch.mps.compile_shader",
    "emulated": "bnb-mps Metal kernel, on the CPU under the emulator",
    "cpu": "via bnb-mps: bitsandbytes' CPU code with transfers (CPU round trip)",
    "bitsandbytes": "handed back by bnb-mps to bitsandbytes' own mps implementation",
}


def weight_bytes(model) -> tuple[int, int]:
    """(bytes the model's weights take as loaded, bytes the same weights take in fp16).

    A 4-bit weight counts its packed codes and every tensor of its quantization state (absmax,
    code, and with double quantization the nested absmax, code and offset); other parameters count
    at their own dtype. Each storage is counted once. Buffers (e.g. rotary tables) are not weights.
    """
    seen: set[tuple[int, int]] = set()
    loaded = fp16 = 0

    def add(t) -> int:
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            return 0
        seen.add(key)
        return t.numel() * t.element_size()

    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        if qs is None:
            loaded += add(p)
            fp16 += 2 * p.numel()
            continue
        loaded += add(p)
        for t in (qs.absmax, qs.code, qs.offset):
            if t is not None:
                loaded += add(t)
        if getattr(qs, "state2", None) is not None:
            loaded += add(qs.state2.absmax) + add(qs.state2.code)
        fp16 += 2 * math.prod(qs.shape)
    return loaded, fp16


def op_report(counts: dict[str, dict[str, int]], device_type: str, emulated: bool, handed_back_before: dict,
              kernel_less: list[str]) -> tuple[dict, list[str]]:  # fmt: skip
    """The summary's "ops" ({op: {"tier", "calls", "served_by"[, "note"]}}) and notes on what the
    op layer did not see.

    counts: bnb_mps.ops.call_counts() for the run; handed_back_before: ops bitsandbytes serves
    because bnb-mps handed them back before the run (registration.skipped()); kernel_less: ops
    without a bnb-mps Metal kernel.
    """
    ops: dict[str, dict] = {}
    for name, tiers in sorted(counts.items()):
        tier = max(tiers, key=tiers.get) if len(tiers) == 1 else "mixed"
        row = {"tier": tier, "calls": sum(tiers.values()), "served_by": SERVED_BY.get(tier, tier)}
        if len(tiers) > 1:
            row["calls_by_tier"] = dict(tiers)
        if "bitsandbytes" in tiers:
            row["note"] = ("bnb-mps handed the op back on its first call; bitsandbytes served its later calls "
                           "directly, which are not counted")  # fmt: skip
        ops[name] = row
    for name in sorted(set(handed_back_before) - set(ops)):
        if device_type == "mps":
            ops[name] = {"tier": "bitsandbytes", "calls": None, "served_by": SERVED_BY["bitsandbytes"],
                         "note": "handed back before this run: its calls do not pass through bnb-mps, not counted"}

    notes = []
    if emulated and kernel_less:
        bases = sorted({name.split(".")[0] for name in kernel_less if not name.startswith("int8_")})
        listed = ", ".join(bases) + (" and the int8 ops" if any(n.startswith("int8_") for n in kernel_less) else "")
        notes.append(f"bitsandbytes ops without a bnb-mps Metal kernel yet ({listed}) ran on bitsandbytes' own CPU "
                     "code: they do not pass through bnb-mps and are not counted; that code calls the quantize "
                     "and dequantize ops above, which bnb-mps served")  # fmt: skip
    elif not emulated and device_type != "mps":
        notes.append(f"every bitsandbytes op ran on bitsandbytes' own {device_type} code: bnb-mps serves mps "
                     f"tensors (and CPU tensors with --kernels emulated), so no call passed through it and none "
                     f"was counted")  # fmt: skip
    elif any(row["tier"] == "bitsandbytes" for row in ops.values()):
        notes.append("calls that bitsandbytes' own mps implementation served after the hand-back did not pass "
                     "through bnb-mps and are not counted")  # fmt: skip
    return ops, notes


def op_table(ops: dict) -> list[str]:
    if not ops:
        return []
    width = max(len(n) for n in ops)
    lines = [f"  {'op':<{width}}  {'tier':<12}  {'calls':>6}  served by", f"  {'-' * width}  {'-' * 12}  ------  ---------"]
    for name, row in ops.items():
        calls = "?" if row["calls"] is None else str(row["calls"])
        lines.append(f"  {name:<{width}}  {row['tier']:<12}  {calls:>6}  {row['served_by']}")
    return lines


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def plot_loss(losses: list[float], path: Path, title: str) -> None:
    """Write the loss curve as a PNG (matplotlib's Agg canvas: no display, no global backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(range(1, len(losses) + 1), losses, marker="o" if len(losses) <= 30 else None, markersize=3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (cross-entropy, nats/char)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
