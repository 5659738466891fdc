"""bitsandbytes' own kernels, per dispatch key, as they were before bnb_mps' took their place.

bnb_mps.registration captures them when it registers a key (`capture`); what serves a call that
bnb_mps' kernels do not cover, a tuning route, and the CPU reference of first-use verification
(bnb_mps.ops.cpu_round_trip, which must never reach bnb_mps' own CPU registration) take them from here.
Imports nothing of bnb_mps.
"""

from __future__ import annotations

import torch

NAMESPACE = "bitsandbytes"

#: (dispatch key, schema) -> bitsandbytes' own kernel for that key, captured before bnb_mps' own
#: took its place (None where bitsandbytes has none)
_stock: dict[tuple[str, str], object] = {}


def schema(name: str):
    """bitsandbytes' schema `name` ("op" or "op.overload"), or None where it defines none."""
    base, _, overload = name.partition(".")
    try:
        return torch._C._get_schema(f"{NAMESPACE}::{base}", overload)
    except RuntimeError:
        return None


def capture(dispatch_key: str, name: str) -> None:
    """Keep bitsandbytes' own kernel of `name` for `dispatch_key` (its backend's, or its default
    kernel), as the dispatcher computes it while bnb_mps' is not registered, unless kept already."""
    if (dispatch_key, name) in _stock:
        return
    qualified = f"{NAMESPACE}::{name}"
    found = None
    get_kernel = getattr(torch.library, "get_kernel", None)  # (torch >= 2.9)
    if get_kernel is not None and schema(name) is not None:
        try:
            if torch._C._dispatch_has_computed_kernel_for_dispatch_key(qualified, dispatch_key):
                found = get_kernel(qualified, dispatch_key)
        except RuntimeError:
            found = None
    _stock[dispatch_key, name] = found


def stock_kernel(dispatch_key: str, name: str):
    """bitsandbytes' own implementation of schema `name` for `dispatch_key`, as a function of the
    call's positional arguments, or None where bitsandbytes has none (or torch cannot hand it out):
    it serves the calls whose arguments bitsandbytes accepts but bnb_mps' kernels do not cover."""
    kernel = _stock.get((dispatch_key, name))
    if kernel is None:
        return None
    keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, dispatch_key))
    call_boxed = kernel.call_boxed
    return lambda *args: call_boxed(keyset, *args)
