"""Paged optimizers on mps (bnb_mps.paged): bitsandbytes' paging functions are wrapped for mps
devices only, installed by registration and removed by unregister().

There is no mps device here, so the mps behaviour is shown on `meta` tensors standing in for an
mps device (the hook's DEVICE_TYPES extended to "meta" for the test): bitsandbytes' paged
optimizers then get plain state tensors on the parameter's device. Real mps runs are in
tests/test_optimizers_mps.py.
"""

from __future__ import annotations

import bitsandbytes as bnb
import bitsandbytes.functional as F
import pytest
import torch

import bnb_mps
from bnb_mps import paged, registration


@pytest.fixture
def registered():
    """bnb_mps registered for mps (as after `import bitsandbytes`), restored afterwards."""
    was = "MPS" in registration.registered_keys()
    bnb_mps.register()
    yield
    if not was:
        bnb_mps.unregister()


@pytest.fixture
def meta_as_mps(registered, monkeypatch):
    monkeypatch.setattr(paged, "DEVICE_TYPES", ("mps", "meta"))
    F.GlobalPageManager.get_instance().paged_tensors.clear()
    yield
    F.GlobalPageManager.get_instance().paged_tensors.clear()


def test_registration_installs_and_unregister_restores(registered):
    assert paged.installed()
    originals = {name: paged.original(name) for name in paged.WRAPPED}
    for name, original in originals.items():
        assert getattr(F, name) is not original and getattr(F, name).__wrapped__ is original
    bnb_mps.unregister()
    try:
        assert not paged.installed()
        for name, original in originals.items():
            assert getattr(F, name) is original  # bitsandbytes' own function object again
    finally:
        bnb_mps.register()
    assert paged.installed() and all(getattr(F, n).__wrapped__ is originals[n] for n in paged.WRAPPED)


def test_install_is_idempotent(registered):
    wrapped = {name: getattr(F, name) for name in paged.WRAPPED}
    paged.install()
    bnb_mps.register()
    assert {name: getattr(F, name) for name in paged.WRAPPED} == wrapped


def test_other_devices_go_to_bitsandbytes_unchanged(registered, monkeypatch):
    """cpu and cuda tensors reach bitsandbytes' own functions with the same arguments (the
    originals are replaced by recorders here: CUDA cannot exist on this machine)."""
    calls = []
    for name in paged.WRAPPED:
        monkeypatch.setitem(paged._originals, name, lambda *a, _n=name, **k: calls.append((_n, a, k)) or "original")
    # the wrappers captured the originals at install time: re-wrap around the recorders
    for name in paged.WRAPPED:
        monkeypatch.setattr(F, name, paged._WRAPPERS[name](paged._originals[name]))
    cuda = torch.device("cuda", 0)
    assert F.get_paged(3, 4, dtype=torch.uint8, device=cuda) == "original"
    assert F.get_paged(5) == "original"  # bitsandbytes' default device (cuda:0)
    A = torch.zeros(4)
    A.is_paged = True
    assert F.prefetch_tensor(A, to_cpu=True) == "original"
    assert F.elementwise_func("fill", A, None, 0.0) == "original"
    assert calls == [
        ("get_paged", (3, 4), {"dtype": torch.uint8, "device": cuda}),
        ("get_paged", (5,), {"dtype": torch.float32}),
        ("prefetch_tensor", (A, True), {}),
        ("elementwise_func", ("fill", A, None, 0.0, True), {}),
    ]


def test_cpu_behaviour_is_bitsandbytes_own(registered):
    """What bitsandbytes' CPU library does with a paging call, the hooked function does too."""
    for call in (lambda fn: fn(8, dtype=torch.float32, device=torch.device("cpu")),):
        with pytest.raises(RuntimeError) as theirs:
            call(paged.original("get_paged"))
        with pytest.raises(RuntimeError) as ours:
            call(F.get_paged)
        assert str(ours.value) == str(theirs.value)
    A = torch.ones(8)
    with pytest.raises(RuntimeError) as theirs:
        paged.original("elementwise_func")("fill", A, None, 0.0)
    with pytest.raises(RuntimeError) as ours:
        F.fill(A, 0.0)
    assert str(ours.value) == str(theirs.value)


def test_mps_like_buffers_are_plain_device_tensors(meta_as_mps):
    buf = F.get_paged(300, 400, dtype=torch.uint8, device=torch.device("meta"))
    assert buf.device.type == "meta" and buf.shape == (300, 400) and buf.dtype == torch.uint8
    assert buf.is_paged and buf.page_deviceid is None
    F.prefetch_tensor(buf)  # nothing to migrate
    F.GlobalPageManager.get_instance().paged_tensors.append(buf)
    F.GlobalPageManager.get_instance().prefetch_all()
    x = torch.full((6,), 3.0)  # fill / _mul on a served device use torch ops
    paged.DEVICE_TYPES = ("cpu",)
    try:
        F.fill(x, 2.0)
        assert torch.equal(x, torch.full((6,), 2.0))
        F._mul(x, torch.arange(6.0))
        assert torch.equal(x, 2.0 * torch.arange(6.0))
    finally:
        paged.DEVICE_TYPES = ("mps", "meta")


@pytest.mark.parametrize("cls,states", [
    (bnb.optim.PagedAdamW8bit, {"state1": torch.uint8, "state2": torch.uint8}),
    (bnb.optim.PagedAdamW, {"state1": torch.float32, "state2": torch.float32}),
    (bnb.optim.PagedLion8bit, {"state1": torch.uint8}),
    (bnb.optim.PagedAdEMAMix8bit, {"state1": torch.uint8, "state2": torch.uint8}),
], ids=["PagedAdamW8bit", "PagedAdamW", "PagedLion8bit", "PagedAdEMAMix8bit"])  # fmt: skip
def test_paged_optimizers_get_device_states(meta_as_mps, cls, states):
    """Large parameters (>= 1e5 elements, where bitsandbytes pages) of an mps-like device: the
    states are plain tensors on that device, registered with the page manager, and a step runs."""
    p = torch.nn.Parameter(torch.empty(512, 256, device="meta"))
    p.grad = torch.empty(512, 256, device="meta")
    opt = cls([p])
    opt.step()
    st = opt.state[p]
    for key, dtype in states.items():
        t = st[key]
        copies = (2,) if key == "state1" and cls is bnb.optim.PagedAdEMAMix8bit else ()
        assert t.device.type == "meta" and t.dtype == dtype and t.shape == (*copies, 512, 256), key
        assert t.is_paged
        assert any(t is q for q in F.GlobalPageManager.get_instance().paged_tensors)
    opt.step()  # prefetch_state on the paged states


def test_without_the_hook_paged_optimizers_fail_on_such_devices(meta_as_mps):
    """What the hook fixes: bitsandbytes' own get_paged needs the CUDA library."""
    bnb_mps.unregister()
    try:
        p = torch.nn.Parameter(torch.empty(512, 256, device="meta"))
        p.grad = torch.empty(512, 256, device="meta")
        with pytest.raises(RuntimeError, match="cget_managed_ptr"):
            bnb.optim.PagedAdamW8bit([p]).step()
    finally:
        bnb_mps.register()


def test_cpu_parameters_keep_bitsandbytes_behaviour(registered):
    """On cpu, bitsandbytes never pages (it warns and uses plain tensors): unchanged."""
    p = torch.nn.Parameter(torch.randn(512, 256))
    p.grad = torch.randn(512, 256)
    with pytest.warns(UserWarning, match="Paged optimizers are not supported on CPU"):
        opt = bnb.optim.PagedAdamW8bit([p])
        opt.step()
    assert not getattr(opt.state[p]["state1"], "is_paged", False)
