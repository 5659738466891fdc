"""First-use verification (bnb_mps.ops.verify): every kernel family runs once on the tier that is to
serve it and is compared with the CPU round trip; a family that fails never serves.

Faults are planted in a copy of the kernel source that BNB_MPS_KERNEL_DIR points the tiers at (a
wrong table entry, an off-by-one loop bound, a dropped bias, a wrong rounding, an out-of-bounds
write); the emulated tier, forced with BNB_MPS_EXECUTOR=emulated, is the tier verified. Calls go
through `op.redispatch(DispatchKeySet(MPS), ...)` on CPU tensors, which is what a Mac's mps tensors
reach.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._C import DispatchKey, DispatchKeySet

import bnb_mps
import op_inputs
from bnb_mps import executors, ops
from bnb_mps.msl import source
from bnb_mps.ops import routing
from bnb_mps.ops import verify as verification

KERNELS = Path(__file__).resolve().parents[1] / "csrc" / "kernels"
MPS = DispatchKeySet(DispatchKey.MPS)
ALL = set(verification.FAMILIES)
MATMUL = {"matmul_4bit_gemv", "matmul_4bit_batch", "matmul_4bit_mma"}

pytestmark = [
    pytest.mark.filterwarnings("ignore::bnb_mps.executors.SlowTierWarning"),
    pytest.mark.filterwarnings("ignore::bnb_mps.ops.verify.VerificationWarning"),
]

if importlib.util.find_spec("bnb_mps._emu") is None:  # pragma: no cover
    pytest.skip("the emulator runtime is not built", allow_module_level=True)


@pytest.fixture
def emulated_tier(fresh_tier_selection, tmp_path):
    """BNB_MPS_EXECUTOR=emulated, a fresh verification cache, no verdicts in memory."""
    mp = fresh_tier_selection
    mp.setenv("BNB_MPS_EXECUTOR", "emulated")
    mp.setenv("BNB_MPS_CACHE_DIR", str(tmp_path / "cache"))
    mp.delenv("BNB_MPS_VERIFY", raising=False)
    mp.delenv(source.KERNEL_DIR_ENV, raising=False)
    verification.reset()
    executors.reset()
    yield mp
    verification.reset()


def planted(tmp_path: Path, old: str, new: str, file: str) -> Path:
    """A copy of the kernel source with `old` replaced by `new` (exactly once) in `file`."""
    d = tmp_path / "kernels"
    shutil.copytree(KERNELS, d)
    text = (d / file).read_text()
    assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times in {file}"
    (d / file).write_text(text.replace(old, new))
    return d


def failed(verdicts) -> set[str]:
    return {name for name, v in verdicts.items() if not v.passed}


def first_case(name):
    return next(iter(op_inputs.cases(name)))[1]


# (fault, file, old, new, the families whose kernels hold that code)
FAULTS = [
    ("wrong NF4 table entry", "quantize_4bit.h", "0.0795803f,", "0.0895803f,", {"nf4_fp4"} | MATMUL),
    ("off-by-one loop bound in dequantize_4bit", "quantize_4bit.h",
     "    for (uint k = 0; k < 4u; ++k) {\n        // blocksize is even",
     "    for (uint k = 0; k < 3u; ++k) {\n        // blocksize is even", {"nf4_fp4"}),
    ("dropped bias in the 4-bit products", "gemm_4bit.h", "        v += float(bias[n]);", "", MATMUL),
    ("int8 rounding half away from zero", "int8.h", "return int(clamp(rint(v), -127.0f, 127.0f));",
     "return int(clamp(round(v), -127.0f, 127.0f));", {"int8_quant"}),
    ("off-by-one threshold table of the 8-bit quantizer", "quantize_8bit.h",
     "for (uint k = tid; k < 255u; k += threads) {", "for (uint k = tid; k < 254u; k += threads) {",
     {"blockwise_8bit", "optimizer_8bit"}),
]  # fmt: skip


@pytest.mark.parametrize("fault,file,old,new,families", FAULTS, ids=[f[0] for f in FAULTS])
def test_a_planted_fault_fails_exactly_the_families_that_hold_it(emulated_tier, tmp_path, fault, file, old, new,
                                                                  families):  # fmt: skip
    emulated_tier.setenv(source.KERNEL_DIR_ENV, str(planted(tmp_path, old, new, file)))
    verdicts = bnb_mps.verify("emulated")
    assert failed(verdicts) == families, {n: v.describe() for n, v in verdicts.items() if not v.passed}
    for name in families:
        v = verdicts[name]
        assert v.case and v.error and v.launches > 0, v
    # Routing: every op of a failed family leaves the emulated tier, with the failing case as the
    # reason; the other ops keep it.
    bad_ops = {op for f in families for op in verification.FAMILIES[f].ops}
    info = bnb_mps.backend_info()
    for op in {op for f in verification.FAMILIES.values() for op in f.ops}:
        if op in bad_ops:
            assert info[op]["tier"] in ("bitsandbytes", "cpu"), (op, info[op])
            assert "failed verification" in info[op]["reason"] and "case" in info[op]["reason"], info[op]
        else:
            assert info[op]["tier"] == "emulated", (op, info[op])


def test_a_failed_family_is_never_used_and_its_calls_still_return_the_right_answer(emulated_tier, tmp_path):
    emulated_tier.setenv(source.KERNEL_DIR_ENV, str(planted(tmp_path, *FAULTS[0][2:4], FAULTS[0][1])))
    from bnb_mps.executors import emulated

    launched = []
    real = emulated.EmulatedExecutor.launch
    emulated_tier.setattr(emulated.EmulatedExecutor, "launch",
                          lambda self, kernel, **kw: launched.append(kernel) or real(self, kernel, **kw))  # fmt: skip
    bnb_mps.verify("emulated")  # (verification's own launches, before the user's calls)
    launched.clear()
    A = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    with pytest.warns(bnb_mps.ops.verify.VerificationWarning, match="mac_acceptance.sh"):
        got = ops.op_packet("quantize_4bit").redispatch(MPS, A, 64, "nf4", torch.uint8)
    assert not any("4bit" in k for k in launched)  # the faulty kernel never ran for the user
    want = torch.ops.bitsandbytes.quantize_4bit.default(A, 64, "nf4", torch.uint8)  # bitsandbytes on the CPU
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # An op of a family that passed is served by the tier's kernel.
    q, absmax = ops.op_packet("quantize_blockwise").redispatch(MPS, *first_case("quantize_blockwise"))
    assert any(k.startswith("bnb_quantize_blockwise") for k in launched)


def test_unmodified_kernels_pass_every_family(emulated_tier):
    verdicts = bnb_mps.verify("emulated")
    assert failed(verdicts) == set(), {n: v.describe() for n, v in verdicts.items() if not v.passed}
    assert set(verdicts) == ALL
    info = bnb_mps.backend_info()
    for f in verification.FAMILIES.values():
        for op in f.ops:
            assert info[op]["tier"] == "emulated", (op, info[op])


def test_the_cache_is_written_read_and_invalidated_by_a_source_change(emulated_tier, tmp_path):
    first = bnb_mps.verify("emulated")
    assert not any(v.cached for v in first.values())
    data = json.loads(verification.cache_path().read_text())
    (key,) = data
    assert key.startswith("emulated | ") and source.source_hash() in key and torch.__version__ in key
    assert set(data[key]) == ALL
    # A later process on the same machine (here: this one, its verdicts forgotten) reads the cache.
    verification.reset()
    again = bnb_mps.verify("emulated")
    assert all(v.cached for v in again.values())
    assert {n: (v.passed, v.launches) for n, v in again.items()} == {n: (v.passed, v.launches) for n, v in first.items()}
    # Any change to the kernel source (here, a comment) is another key: verified again.
    d = tmp_path / "changed"
    shutil.copytree(KERNELS, d)
    (d / "int8.h").write_text((d / "int8.h").read_text() + "\n// changed\n")
    emulated_tier.setenv(source.KERNEL_DIR_ENV, str(d))
    changed = bnb_mps.verify("emulated")
    assert not any(v.cached for v in changed.values()) and not failed(changed)
    assert len(json.loads(verification.cache_path().read_text())) == 2
    # BNB_MPS_VERIFY=always ignores the cache; refresh=True too.
    verification.reset()
    emulated_tier.setenv("BNB_MPS_VERIFY", "always")
    assert not any(v.cached for v in bnb_mps.verify("emulated").values())
    emulated_tier.delenv("BNB_MPS_VERIFY")
    verification.reset()
    assert not any(v.cached for v in bnb_mps.verify("emulated", refresh=True).values())


def test_verify_0_skips_verification(emulated_tier, tmp_path, monkeypatch):
    emulated_tier.setenv(source.KERNEL_DIR_ENV, str(planted(tmp_path, *FAULTS[3][2:4], FAULTS[3][1])))
    emulated_tier.setenv("BNB_MPS_VERIFY", "0")
    runs = []
    monkeypatch.setattr(verification, "run_family", lambda *a, **k: runs.append(a) or pytest.fail("verified"))
    assert bnb_mps.backend_info()["int8_vectorwise_quant"]["tier"] == "emulated"  # at the user's risk
    assert runs == [] and not verification.cache_path().exists()


def test_a_crash_in_one_family_leaves_the_others_serving(emulated_tier, tmp_path, monkeypatch):
    # A kernel that faults (an out-of-bounds write, which the emulator reports as an error) ...
    emulated_tier.setenv(source.KERNEL_DIR_ENV, str(planted(
        tmp_path, "        absmax1[b] = as_type<float>(bits1);", "        absmax1[b + 4096u] = as_type<float>(bits1);",
        "optimizer.h")))  # fmt: skip
    verdicts = bnb_mps.verify("emulated")
    assert failed(verdicts) == {"optimizer_8bit"}
    assert "OutOfBounds" in verdicts["optimizer_8bit"].error
    # ... and verification code that raises: only that family fails.
    boom = verification.Family("int8_products", verification.FAMILIES["int8_products"].ops,
                               lambda: (_ for _ in ()).throw(RuntimeError("no such kernel")))  # fmt: skip
    monkeypatch.setitem(verification.FAMILIES, "int8_products", boom)
    verification.reset()
    verdicts = bnb_mps.verify("emulated", refresh=True)
    assert failed(verdicts) == {"optimizer_8bit", "int8_products"}
    assert "RuntimeError: no such kernel" in verdicts["int8_products"].error
    info = bnb_mps.backend_info()
    assert info["int8_linear_matmul"]["tier"] != "emulated" and info["gemm_4bit"]["tier"] == "emulated"


def test_verify_api_arguments(emulated_tier):
    with pytest.raises(TypeError, match="tier must be a str"):
        bnb_mps.verify(3)
    with pytest.raises(ValueError, match="tier must be 'native', 'shader', 'emulated' or None"):
        bnb_mps.verify("metal")


def test_verify_with_no_tier_on_a_machine_without_kernel_tiers(fresh_tier_selection):
    fresh_tier_selection.setenv("BNB_MPS_EXECUTOR", "cpu")
    executors.reset()
    with pytest.raises(ValueError, match="tier='emulated'"):
        bnb_mps.verify()


def test_cost_is_bounded(emulated_tier):
    """Launches and bytes verification adds (its time under the emulator is printed by `verify`)."""
    verdicts = bnb_mps.verify("emulated")
    launches = sum(v.launches for v in verdicts.values())
    nbytes = sum(v.bytes for v in verdicts.values())
    assert 0 < launches <= 150 and 0 < nbytes <= 4 << 20, (launches, nbytes)


def test_python_m_bnb_mps_verify(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("BNB_MPS_")}
    env["BNB_MPS_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "bnb_mps", "verify", "--tier", "emulated"], capture_output=True,
                          text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ALL:
        assert any(line.startswith(name) and "passed" in line for line in proc.stdout.splitlines()), proc.stdout
    assert f"{len(ALL)} of {len(ALL)} families passed" in proc.stdout


@pytest.mark.mps
def test_verification_on_this_mac(fresh_tier_selection, tmp_path):
    """Every family passes on the GPU tier that serves here, run now (not from a cache)."""
    fresh_tier_selection.setenv("BNB_MPS_CACHE_DIR", str(tmp_path))
    executors.reset()
    verification.reset()
    verdicts = bnb_mps.verify(refresh=True)
    assert failed(verdicts) == set(), {n: v.describe() for n, v in verdicts.items() if not v.passed}
    assert routing.route("gemm_4bit").tier in ("native", "shader")
