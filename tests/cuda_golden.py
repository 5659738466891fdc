"""bitsandbytes' CUDA outputs (tests/data/cuda_golden/) and the same calls on the device under test.

`load(set_name)` gives the stored outputs, case name -> tuple of tensors (and what CUDA refused);
`run(case, device)` makes the stored case's calls (through torch.ops.bitsandbytes and bitsandbytes'
own classes, as the reference run made them) and returns the outputs in the same order. The rules
the outputs are compared by are in cuda_golden_rules.py.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from cuda_golden_inputs import Case

DATA = os.path.join(os.path.dirname(__file__), "data", "cuda_golden")
FILES = {"main": "cuda_h100.pt", "edge": "cuda_h100_edge.pt", "mmq": "cuda_h100_mmq_subset.pt"}
DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

_loaded: dict = {}


def load(set_name: str) -> tuple[dict, dict]:
    """(outputs, errors): case name -> tuple of CPU tensors (and a string for a list of state
    names); case name -> the exception CUDA raised."""
    if set_name not in _loaded:
        d = torch.load(os.path.join(DATA, FILES[set_name]), weights_only=False)
        _loaded[set_name] = (d["res"], d["errors"])
    return _loaded[set_name]


def tensor(x: np.ndarray, dt: str, device) -> torch.Tensor:
    return torch.from_numpy(np.array(x, copy=True)).to(DT[dt]).to(device)


def make_optimizer(name: str, p):
    import bitsandbytes as bnb

    O = bnb.optim
    return {
        "adam8": lambda: O.Adam8bit([p], lr=1e-3, weight_decay=0.01),
        "adamw8": lambda: O.AdamW8bit([p], lr=1e-3),
        "momentum8": lambda: O.SGD8bit([p], lr=1e-2, momentum=0.9),
        "rmsprop8": lambda: O.RMSprop8bit([p], lr=1e-3),
        "lion8": lambda: O.Lion8bit([p], lr=1e-4),
        "adagrad8": lambda: O.Adagrad8bit([p], lr=1e-2),
        "ademamix8": lambda: O.AdEMAMix8bit([p], lr=1e-3),
        "adam32": lambda: O.Adam([p], lr=1e-3, optim_bits=32),
        "momentum32": lambda: O.SGD32bit([p], lr=1e-2, momentum=0.9),
        "lion32": lambda: O.Lion32bit([p], lr=1e-4),
        "rmsprop32": lambda: O.RMSprop32bit([p], lr=1e-3),
        "adagrad32": lambda: O.Adagrad32bit([p], lr=1e-2),
        "ademamix32": lambda: O.AdEMAMix32bit([p], lr=1e-3),
        "lamb32": lambda: O.LAMB32bit([p], lr=1e-3),
        "lars32": lambda: O.LARS32bit([p], lr=1e-2, momentum=0.9),
    }[name]()


def run(case: Case, device="cpu") -> tuple:
    """The case's outputs on `device`, in the stored order."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    ops = torch.ops.bitsandbytes
    a, dt = case.args, case.dtype
    code8 = F.create_dynamic_map().float().to(device)
    if case.family in ("q8", "edge-q8", "edge-blocks-q8"):
        x = tensor(a["x"], dt, device)
        q, am = ops.quantize_blockwise(x, code8, a["blocksize"])
        return q, am, ops.dequantize_blockwise(q, am, code8, a["blocksize"], DT[dt])
    if case.family in ("q4", "edge-q4", "edge-blocks-q4"):
        x = tensor(a["x"], dt, device)
        p, am = ops.quantize_4bit(x, a["blocksize"], a["quant_type"], torch.uint8)
        return p, am, ops.dequantize_4bit(p, am, a["blocksize"], a["quant_type"], [x.numel()], DT[dt])
    if case.family == "mm":
        A, B = tensor(a["A"], dt, device), torch.from_numpy(a["packed"]).to(device)
        absmax, shape = torch.from_numpy(a["absmax"]).to(device), [a["N"], a["K"]]
        out = (ops.gemm_4bit(A, B, shape, absmax, a["blocksize"], a["quant_type"]),)
        if a["M"] == 1:
            table = F.get_4bit_type(a["quant_type"], device="cpu").float().to(device)
            out += (ops.gemv_4bit(A, B, shape, absmax, table, a["blocksize"]),)
        return out
    if case.family == "int8":
        A, W = tensor(a["A"], dt, device), tensor(a["W"], dt, device)
        ca, sa, oc = ops.int8_vectorwise_quant(A, a["threshold"])
        cb, sb, _ = ops.int8_vectorwise_quant(W, 0.0)
        acc = ops.int8_linear_matmul(ca, cb)
        y = ops.int8_mm_dequant(acc, sa, sb, torch.float16)
        ys = ops.int8_scaled_mm(ca, cb, sa, sb, None, DT[dt])
        return ca, sa, (oc if oc is not None else torch.empty(0)), cb, sb, acc, y, ys
    if case.family == "int8dq":
        out = ops.int8_double_quant(tensor(a["A"], dt, device), a["threshold"])
        return tuple(o if o is not None else torch.empty(0) for o in out)
    if case.family == "edge-int8":
        out = ops.int8_vectorwise_quant(tensor(a["A"], dt, device), a["threshold"])
        return tuple(o if o is not None else torch.empty(0) for o in out)
    if case.family in ("opt", "edge-opt"):
        p = torch.nn.Parameter(tensor(a["p"], dt, device))
        o = make_optimizer(a["optimizer"], p)
        for g in a["grads"]:
            p.grad = tensor(g, dt, device)
            o.step()
        st = o.state[p]
        keys = sorted(k for k, v in st.items() if isinstance(v, torch.Tensor) and v.numel() > 1)
        return (p.data,) + tuple(st[k] for k in keys) + (",".join(keys),)
    if case.family in ("mmq-w", "mmq"):
        qB, state = F.quantize_4bit(tensor(a["W"], dt, device), blocksize=64, quant_type="nf4",
                                    compress_statistics=bool(a["nested"]))  # fmt: skip
        if case.family == "mmq":
            bias = tensor(a["bias"], dt, device) if a["bias"] is not None else None
            with torch.no_grad():
                return (bnb.matmul_4bit(tensor(a["A"], dt, device), qB.t(), state, bias=bias),)
        nested = state.state2 if a["nested"] else None
        offset = torch.as_tensor(state.offset if a["nested"] else 0.0, dtype=torch.float32).reshape(1)
        return (qB, F.dequantize_4bit(qB, state), state.absmax, offset,
                nested.absmax if a["nested"] else torch.empty(0))  # fmt: skip
    raise ValueError(f"unknown case family {case.family!r}")
