"""The one place where bnb_mps meets PyTorch's dispatcher.

bnb_mps registers, through its own `torch.library.Library` fragment, a kernel for every
bitsandbytes op schema it knows, so that `unregister()` restores exactly the kernels
bitsandbytes had before. This module is imported by bitsandbytes' entry point on every
`import bitsandbytes`, so it is kept tiny: the op layer is imported on the first op call.

A schema bnb_mps does not know is left to bitsandbytes; so is a known one whose arguments differ
from what bnb_mps expects, and one whose route (`bnb_mps.ops.routing`) is bitsandbytes' own mps
implementation: both are found on the op's first call and handed back then
(`leave_to_bitsandbytes`). All are reported by `backend_info()` and `python -m bnb_mps`.
"""

from __future__ import annotations

import functools
import threading
import warnings

import torch

from . import stock
from .stock import NAMESPACE, stock_kernel  # noqa: F401  (stock_kernel: part of this module's interface)

# Every schema bnb_mps serves, with its argument names as bitsandbytes 0.50 defines them.
SCHEMAS: dict[str, tuple[str, ...]] = {
    "quantize_blockwise": ("A", "code", "blocksize"),
    "dequantize_blockwise": ("A", "absmax", "code", "blocksize", "dtype"),
    "dequantize_blockwise.out": ("A", "absmax", "code", "blocksize", "dtype", "out"),
    "quantize_4bit": ("A", "blocksize", "quant_type", "quant_storage"),
    "dequantize_4bit": ("A", "absmax", "blocksize", "quant_type", "shape", "dtype"),
    "dequantize_4bit.out": ("A", "absmax", "blocksize", "quant_type", "shape", "dtype", "out"),
    "gemv_4bit": ("A", "B", "shapeB", "absmax", "code", "blocksize"),
    "gemv_4bit.out": ("A", "B", "shapeB", "absmax", "code", "blocksize", "out"),
    "gemm_4bit": ("A", "B", "shapeB", "absmax", "blocksize", "quant_type", "bias", "absmax_8bit", "absmax_code",
                  "absmax_offset"),
    "int8_vectorwise_quant": ("A", "threshold"),
    "int8_vectorwise_dequant": ("A", "stats"),
    "int8_linear_matmul": ("A", "B"),
    "int8_linear_matmul.out": ("A", "B", "out"),
    "int8_mm_dequant": ("A", "row_stats", "col_stats", "dtype", "bias"),
    "int8_scaled_mm": ("A", "B", "row_stats", "col_stats", "bias", "dtype"),
    "int8_mixed_scaled_mm": ("A", "CA", "CB", "SCA", "SCB", "outlier_cols", "bias"),
    "int8_double_quant": ("A", "threshold"),
    "optimizer_update_8bit_blockwise": ("optimizer_name", "g", "p", "state1", "state2", "beta1", "beta2", "beta3",
                                        "alpha", "eps", "step", "lr", "qmap1", "qmap2", "absmax1", "absmax2",
                                        "weight_decay", "gnorm_scale", "skip_zeros"),
    "optimizer_update_32bit": ("optimizer_name", "g", "p", "state1", "state2", "unorm_vec", "max_unorm",
                               "param_norm", "beta1", "beta2", "beta3", "alpha", "eps", "weight_decay", "step",
                               "lr", "gnorm_scale", "skip_zeros"),
}  # fmt: skip

_lock = threading.Lock()
_libraries: dict[str, torch.library.Library] = {}
_names: dict[str, list[str]] = {}
_executors: dict[str, object] = {}
_skipped: dict[str, str] = {}


def _make_kernel(name: str, dispatch_key: str, executor):
    call = None

    def kernel(*args, **kwargs):
        nonlocal call
        if call is None:
            from .ops import dispatcher_entry  # the op layer, imported on first use

            hand_back = None if executor is not None else functools.partial(leave_to_bitsandbytes, dispatch_key=dispatch_key)
            call = dispatcher_entry(name, executor, hand_back, stock.stock_kernel(dispatch_key, name))
        return call(args, kwargs)

    kernel.__name__ = kernel.__qualname__ = "bnb_mps_" + name.replace(".", "_")
    return kernel


def register(dispatch_key: str = "MPS", executor=None, names=None) -> list[str]:
    """Register bnb_mps' kernels for `dispatch_key`; returns the schema names registered.

    With `executor`, every call runs its kernel on that executor, and only `names` are registered
    (used to put the emulated tier under the `CPU` key in tests). A key registered already is a no-op.

    Nothing here inspects bitsandbytes' schemas (that would cost more than the registration): a
    schema whose arguments differ from SCHEMAS is found on its first call and handed back to
    bitsandbytes then (`leave_to_bitsandbytes`); one bitsandbytes does not define is never called.
    """
    if dispatch_key == "MPS":  # paged optimizers and AdEMAMix8bit state loads on mps (undone by unregister)
        from . import ademamix_layout, paged

        paged.install()
        ademamix_layout.install()
    with _lock:
        if dispatch_key not in _libraries:
            wanted = [n for n in SCHEMAS if (names is None or n in names) and n not in _skipped]
            _install(dispatch_key, executor, wanted)
        return list(_names[dispatch_key])


def _install(dispatch_key: str, executor, wanted: list[str]) -> None:
    for name in wanted:  # (before bnb_mps' own kernels take their place)
        stock.capture(dispatch_key, name)
    lib = torch.library.Library(NAMESPACE, "IMPL")
    try:
        with warnings.catch_warnings():
            # Replacing bitsandbytes' own MPS kernels is the point; PyTorch warns about overrides.
            warnings.simplefilter("ignore")
            for name in wanted:
                lib.impl(name, _make_kernel(name, dispatch_key, executor), dispatch_key)
    except BaseException:
        lib._destroy()
        raise
    _libraries[dispatch_key] = lib
    _names[dispatch_key] = list(wanted)
    _executors[dispatch_key] = executor


def schema_mismatch(name: str):
    """Why bnb_mps cannot serve bitsandbytes' current schema `name`, or None if it can."""
    schema = stock.schema(name)
    if schema is None:
        return "bitsandbytes does not define this schema"
    got = tuple(a.name for a in schema.arguments)
    if got != SCHEMAS[name]:
        return f"schema arguments changed: bnb_mps expects {SCHEMAS[name]}, bitsandbytes has {got}"
    return None


def leave_to_bitsandbytes(name: str, reason: str, dispatch_key: str = "MPS"):
    """Withdraw bnb_mps' kernels for one schema (every key), so that bitsandbytes' own serve it;
    returns a function that runs a call on `dispatch_key` as the dispatcher now resolves it."""
    with _lock:
        _skipped[name] = reason
        for key in [k for k, names in _names.items() if name in names]:
            _libraries.pop(key)._destroy()
            _install(key, _executors[key], [n for n in _names[key] if n != name])
    from .ops.registry import op_packet

    packet = op_packet(name)
    keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, dispatch_key))
    return lambda *args, **kwargs: packet.redispatch(keyset, *args, **kwargs)


def reinstate() -> list[str]:
    """Register bnb_mps' kernels again for every schema it left to bitsandbytes (after the tier
    selection changed, e.g. in tests); returns their names."""
    with _lock:
        names = list(_skipped)
        _skipped.clear()
        for key in list(_libraries):
            missing = [n for n in names if n not in _names[key]]
            if missing and _executors[key] is None:
                _libraries.pop(key)._destroy()
                _install(key, _executors[key], _names[key] + missing)
        return names


def unregister(dispatch_key: str = "MPS") -> None:
    """Remove bnb_mps' kernels for `dispatch_key`; bitsandbytes' own (if any) serve again."""
    with _lock:
        lib = _libraries.pop(dispatch_key, None)
        _names.pop(dispatch_key, None)
        _executors.pop(dispatch_key, None)
        if lib is not None:
            lib._destroy()
    if dispatch_key == "MPS":
        from . import ademamix_layout, paged

        paged.uninstall()
        ademamix_layout.uninstall()


def registered(dispatch_key: str = "MPS") -> list[str]:
    return list(_names.get(dispatch_key, ()))


def registered_keys() -> list[str]:
    return list(_libraries)


def skipped() -> dict[str, str]:
    """Known ops left to bitsandbytes, with the reason."""
    return dict(_skipped)


def bitsandbytes_schemas() -> list[str]:
    """Every op schema defined in the bitsandbytes namespace ("quantize_4bit", "gemv_4bit.out", ...)."""
    prefix = f"{NAMESPACE}::"
    names = (n[len(prefix) :] for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix))
    return sorted(n for n in names if stock.schema(n) is not None)  # (registered kernels alone list a name too)


def unknown_schemas() -> list[str]:
    """bitsandbytes schemas this bnb_mps version does not know (left to bitsandbytes)."""
    return [n for n in bitsandbytes_schemas() if n not in SCHEMAS]
