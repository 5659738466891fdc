"""First-use verification (bnb_mps.ops.verify): every kernel family runs once on the tier that is to
serve it and is compared with the CPU round trip (or, for special values, with the results
docs/semantics.md defines); a family that fails never serves.

Faults are planted in copies of the kernel source that BNB_MPS_KERNEL_DIR points the tiers at; the
emulated tier, forced with BNB_MPS_EXECUTOR=emulated, is the tier verified. Each planted copy holds
several independent faults, each in code that only its own families run, and leaves other families
untouched, which must pass: the emulator compiles a kernel source once per machine (its module cache
is keyed by the text, and the copies are the same text every session), so a few copies cover every
family. Calls go through `op.redispatch(DispatchKeySet(MPS), ...)` on CPU tensors, which is what a
Mac's mps tensors reach.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch._C import DispatchKey, DispatchKeySet

import bnb_mps
import op_inputs
from bnb_mps import executors, ops
from bnb_mps.executors import PipelineLimitError
from bnb_mps.msl import source
from bnb_mps.ops import routing
from bnb_mps.ops import verify as verification
from bnb_mps.ops.verify import cache, first_use, machine_key, runner

KERNELS = Path(__file__).resolve().parents[1] / "csrc" / "kernels"
MPS = DispatchKeySet(DispatchKey.MPS)
ALL = set(verification.FAMILIES)
MATMUL = {"matmul_4bit_gemv", "matmul_4bit_tglut", "matmul_4bit_batch", "matmul_4bit_small", "matmul_4bit_small_wide",
          "matmul_4bit_splitk", "matmul_4bit_splitk_two", "matmul_4bit_mma"}
#: the families whose kernels exist from Metal 3.2 only: skipped at the emulator's default 3.1
FROM_3_2 = {"matmul_4bit_splitk"}
#: the Metal language version the planted faults are verified at: 3.2, where both split-K families run
PLANTED_METAL = "3.2"

pytestmark = [
    pytest.mark.filterwarnings("ignore::bnb_mps.executors.SlowTierWarning"),
    pytest.mark.filterwarnings("ignore::bnb_mps.ops.verify.VerificationWarning"),
]

if importlib.util.find_spec("bnb_mps._emu") is None:  # pragma: no cover
    pytest.skip("the emulator runtime is not built", allow_module_level=True)


def _emulated_environment(mp, cache: Path) -> None:
    mp.setenv("BNB_MPS_EXECUTOR", "emulated")
    mp.setenv(verification.CACHE_ENV_VAR, str(cache))
    for name in ("BNB_MPS_VERIFY", source.KERNEL_DIR_ENV, "BNB_MPS_EMU_FLOAT", "PYTORCH_MPS_FAST_MATH"):
        mp.delenv(name, raising=False)
    verification.reset()
    executors.reset()


@pytest.fixture
def emulated_tier(fresh_tier_selection, tmp_path):
    """BNB_MPS_EXECUTOR=emulated, a fresh verification cache, no verdicts in memory."""
    _emulated_environment(fresh_tier_selection, tmp_path / "cache" / "verify.json")
    yield fresh_tier_selection
    verification.reset()


def failed(verdicts) -> set[str]:
    return {name for name, v in verdicts.items() if not v.passed}


def tier_key(data: dict) -> str:
    """The cache file's key of the tier's verdicts (the families of one compile unit are under that key
    with the digest of their unit's text appended: `unit_keys`)."""
    (key,) = [k for k in data if " | unit " not in k]
    return key


def unit_keys(data: dict, key: str) -> dict:
    """{unit key: its families} of the families of one compile unit under the tier's `key`."""
    return {k: set(v) for k, v in data.items() if k.startswith(key + " | unit ")}


def first_case(name):
    return next(iter(op_inputs.cases(name)))[1]


# -- planted faults ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    what: str
    file: str
    old: str
    new: str
    # the families whose kernels hold the faulty code -> a pattern their verdict's "case: error" matches
    # (the case that catches the fault)
    families: dict = field(default_factory=dict)


# Each group: independent faults in different families, planted together in one copy.
GROUPS = {
    "A": [
        Fault("tiled int8 products flush their float partial sums only at the end (past 2^24 at K = 1088)",
              "int8_matmul.h", "if ((t + 1u) % TILES_PER_CHUNK == 0u || t + 1u == tiles) {",
              "if (t + 1u == tiles) {", {"int8_products": r"^int8_linear_matmul\.out 12x24x1088: .*17548352"}),
        Fault("the 32-bit optimizer kernel drops a partial last chunk", "optimizer.h",
              "const uint chunks = n / chunk + (n % chunk != 0u ? 1u : 0u);", "const uint chunks = n / chunk;",
              {"optimizer_32bit": r"^optimizer_update_32bit "}),
        Fault("the split-K kernel adds a call's counts to those the call before left", "gemm_4bit_splitk.h",
              ": (tag << BNB_SPLITK_COUNT_BITS) | 1u;",
              ": (tag << BNB_SPLITK_COUNT_BITS) | ((seen & BNB_SPLITK_COUNT_MASK) + 1u);",
              {"matmul_4bit_splitk": r"M=12 "}),  # (one dispatch only: the two have no counters)
        Fault("the gemv kernel keeps only the last step of each lane", "gemm_4bit.h", "acc[r] += TG_TABLE ?",
              "acc[r] = TG_TABLE ?", {"matmul_4bit_gemv": r"K=1280", "matmul_4bit_tglut": r"K=1280"}),
        Fault("blocks above 256 elements take the first simdgroup's maximum", "quantize_layout.h",
              "result = max(result, partial[j]);", "result = max(result, partial[0]);",
              {"blockwise_8bit": r"blocksize=(512|1024|2048|4096) ", "nf4_fp4": r"blocksize=(512|1024|2048|4096) "}),
        Fault("int8 quantization rounds half away from zero", "int8.h",
              "return int(metal::precise::clamp(metal::precise::rint(v), -127.0f, 127.0f));",
              "return int(metal::precise::clamp(metal::precise::round(v), -127.0f, 127.0f));",
              {"int8_quant": r"^int8_(vectorwise|double)_quant "}),
    ],
    "B": [
        Fault("the int8 gemv kernels without 16-byte loads skip the last column (K % 16 != 0)", "int8_matmul.h",
              "for (uint k = lane; k < K; k += 32u) {", "for (uint k = lane; k + 1u < K; k += 32u) {",
              {"int8_products": r"^int8_linear_matmul(\.out)? [15]x24x(100|1090):"}),
        Fault("the batch kernel keeps only the last step of each lane", "gemm_4bit.h", "acc[i][r] += bnb_mm_sum4(d);",
              "acc[i][r] = bnb_mm_sum4(d);", {"matmul_4bit_batch": r"M=5 "}),
        Fault("the small kernel keeps only the last even K step of each row", "gemm_4bit_small.h",
              "acc_even[i] += d;", "acc_even[i] = d;",
              {"matmul_4bit_small": r"M=12 ", "matmul_4bit_small_wide": r"M=12 ", "matmul_4bit_splitk": r"M=12 ",
               "matmul_4bit_splitk_two": r"M=12 "}),
        Fault("the mma kernel drops the last 8 columns of every K step", "gemm_4bit.h",
              "for (uint kk = 0; kk < BK; kk += 8u) {", "for (uint kk = 0; kk + 8u < BK; kk += 8u) {",
              {"matmul_4bit_mma": r"M=37 "}),
        Fault("the subnormal reciprocal of a block maximum above 2^126 is truncated, not rounded", "bnb_common.h",
              "q += 1u;  // round half to even", "q += 0u;  // round half to even",
              {"blockwise_8bit": r"special values .*up", "nf4_fp4": r"special values .*up"}),
        Fault("the 8-bit optimizer writes its block scales out of bounds", "optimizer.h",
              "        absmax1[b] = as_type<float>(bits1);", "        absmax1[b + 4096u] = as_type<float>(bits1);",
              {"optimizer_8bit": r"OutOfBounds"}),
    ],
    "C": [
        Fault("the gemv and batch kernels' scalar loads of an unaligned A swap neighbours", "gemm_4bit.h",
              "            x[j] = float(a[j]);", "            x[j] = float(a[j ^ 1u]);",
              {"matmul_4bit_gemv": r"unaligned A", "matmul_4bit_batch": r"unaligned A",
               "matmul_4bit_tglut": r"unaligned A"}),
        Fault("the small kernel stages A ignoring its row stride (rows K apart; in a split-K slice, k_end)",
              "gemm_4bit_small.h", "A[i * lda + kc]", "A[i * k_end + kc]",
              {"matmul_4bit_small": r"unaligned A", "matmul_4bit_small_wide": r"unaligned A",
               "matmul_4bit_splitk": r"M=12 ", "matmul_4bit_splitk_two": r"M=12 "}),  # (its slices end before K: every case)
        Fault("the mma kernel's scalar loads of A ignore its row stride", "gemm_4bit.h", "float(A[m * lda + k + j])",
              "float(A[m * K + k + j])", {"matmul_4bit_mma": r"unaligned A"}),
        Fault("NaN enters the block maximum", "bnb_common.h",
              "return (b > 0x7f800000u || b < 0x00800000u) ? 0u : b;", "return b < 0x00800000u ? 0u : b;",
              {"blockwise_8bit": r"special values .*nan", "nf4_fp4": r"special values .*nan",
               "int8_quant": r"^int8_(vectorwise|double)_quant special values .*nan"}),
        Fault("update-norm clipping scales by norm / bound instead of bound / norm", "optimizer.h",
              "lr_step = lr * metal::precise::divide(max_norm, norm);",
              "lr_step = lr * metal::precise::divide(norm, max_norm);", {"optimizer_32bit": r" lars "}),
        Fault("the 8-bit optimizer's non-finite gradient reset keeps the first state", "optimizer.h",
              "                } else {  // non-finite gradient: states reset to 0, parameter unchanged\n"
              "                    m[k] = 0.0f;\n",
              "                } else {  // non-finite gradient: states reset to 0, parameter unchanged\n",
              {"optimizer_8bit": r"non-finite gradients .*state1 where the gradient is not finite"}),
    ],
    # (alone: group B's fault in the small kernel's code, which the split-K kernel shares, fails its
    # family first)
    "D": [
        Fault("the split-K kernels' sum of a tile's slots leaves out the first slice", "gemm_4bit_splitk.h",
              "float v = tile_work[e];", "float v = 0.0f;",
              {"matmul_4bit_splitk": r"M=12 ", "matmul_4bit_splitk_two": r"M=12 "}),
    ],
    # (alone too: where rows are cut in their phase (K = 1984), the last slice stops a phase short of K;
    # K = 1040, whose 16 phases do not divide S = 4, is right)
    "E": [
        Fault("the split-K kernel's last slice of a row cut in its phase stops short of K", "gemm_4bit_splitk.h",
              "const uint k_end = slice + 1u == S ? K : min(K, (slice + 1u) * span - phase);",
              "const uint k_end = min(K, (slice + 1u) * span - phase);",
              {"matmul_4bit_splitk": r"M=5 N=72 K=1984 ", "matmul_4bit_splitk_two": r"M=5 N=72 K=1984 "}),
    ],
    # (alone too: a last tile of fewer groups than S counts to S where the host launched fewer threadgroups
    # for it, so some of its outputs are never written: first at N = 40, K = 1040 with float32 absmax in
    # blocks of 32 (bfloat16), where S = 2 and the last tile's 8 columns take one slice)
    "F": [
        Fault("the split-K kernel's last tile of fewer groups takes S slices", "gemm_4bit_splitk.h",
              "    uint S = 1u;\n    while (S < groups) {", "    uint S = splits;\n    while (S < groups) {",
              {"matmul_4bit_splitk": r"M=12 N=40 K=1040 .*never written", "matmul_4bit_splitk_two": r"M=12 N=40 K=1040 "}),
    ],
}


def plant(directory: Path, faults) -> Path:
    """A copy of the kernel source in `directory` with each fault's `old` replaced by its `new`."""
    shutil.copytree(KERNELS, directory)
    for f in faults:
        text = (directory / f.file).read_text()
        assert text.count(f.old) == 1, f"{f.old!r} occurs {text.count(f.old)} times in {f.file}"
        (directory / f.file).write_text(text.replace(f.old, f.new))
    return directory


@pytest.fixture(scope="session")
def planted_kernels(tmp_path_factory):
    """planted_kernels(group): the kernel directory with that group's faults, made once a session."""
    made: dict[str, Path] = {}

    def get(group: str) -> Path:
        if group not in made:
            made[group] = plant(tmp_path_factory.mktemp(f"planted-{group}") / "kernels", GROUPS[group])
        return made[group]

    return get


def expected_failures(faults) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in faults:
        for family, pattern in f.families.items():
            out.setdefault(family, []).append(pattern)
    return out


def assert_routed_past_failed_families(failed_families) -> None:
    """Every op of a failed family leaves the emulated tier, with the failing case as the reason;
    the other ops keep it."""
    bad_ops = {op for f in failed_families for op in verification.FAMILIES[f].ops}
    info = bnb_mps.backend_info()
    for op in {op for f in verification.FAMILIES.values() for op in f.ops}:
        if op in bad_ops:
            assert info[op]["tier"] in ("bitsandbytes", "cpu"), (op, info[op])
            assert "failed verification" in info[op]["reason"] and "case" in info[op]["reason"], info[op]
        else:
            assert info[op]["tier"] == "emulated", (op, info[op])


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_planted_faults_fail_exactly_the_families_that_hold_them(emulated_tier, planted_kernels, group):
    """At Metal 3.2 (PLANTED_METAL), so that both split-K families run: one dispatch and two."""
    from bnb_mps.executors import emulated

    emulated_tier.setenv(source.KERNEL_DIR_ENV, str(planted_kernels(group)))
    with emulated.settings(metal_version=PLANTED_METAL):
        verdicts = bnb_mps.verify("emulated")
        want = expected_failures(GROUPS[group])
        assert failed(verdicts) == set(want), {n: v.describe() for n, v in verdicts.items() if not v.passed}
        assert ALL - set(want), "each group leaves some families untouched"
        for family, patterns in want.items():
            v = verdicts[family]
            assert v.case and v.error and v.launches > 0 and not v.could_not_run, v
            for pattern in patterns:  # the case that catches the fault
                assert re.search(pattern, f"{v.case}: {v.error}"), (family, pattern, v.describe())
        assert_routed_past_failed_families(set(want))


# One fault a copy: a compile each (tens of seconds), so `slow`; the groups above plant a fault in
# every family in the default run.
SINGLE_FAULTS = [
    Fault("wrong NF4 table entry", "quantize_4bit.h", "0.0795803f,", "0.0895803f,", dict.fromkeys({"nf4_fp4"} | MATMUL, "")),
    Fault("off-by-one loop bound in dequantize_4bit", "quantize_4bit.h",
          "    for (uint k = 0; k < 4u; ++k) {\n        // blocksize is even",
          "    for (uint k = 0; k < 3u; ++k) {\n        // blocksize is even", {"nf4_fp4": ""}),
    Fault("dropped bias in the 4-bit products", "gemm_4bit.h", "        v += float(bias[n]);", "",
          dict.fromkeys(MATMUL, r" bias( \([a-z/]+\))?:")),
    Fault("off-by-one threshold table of the 8-bit quantizer", "quantize_8bit.h",
          "for (uint k = tid; k < 255u; k += threads) {", "for (uint k = tid; k < 254u; k += threads) {",
          {"blockwise_8bit": "", "optimizer_8bit": ""}),
    Fault("float32 subnormals enter the block and row maxima", "bnb_common.h",
          "return (b > 0x7f800000u || b < 0x00800000u) ? 0u : b;", "return b > 0x7f800000u ? 0u : b;",
          {"blockwise_8bit": r"special values .*subnormals", "nf4_fp4": r"special values .*subnormals",
           "int8_quant": r"subnormals"}),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("fault", SINGLE_FAULTS, ids=[f.what for f in SINGLE_FAULTS])
def test_a_single_planted_fault_fails_exactly_the_families_that_hold_it(emulated_tier, tmp_path, fault):
    emulated_tier.setenv(source.KERNEL_DIR_ENV, str(plant(tmp_path / "kernels", [fault])))
    verdicts = bnb_mps.verify("emulated")
    assert failed(verdicts) == set(fault.families), {n: v.describe() for n, v in verdicts.items() if not v.passed}
    for family, pattern in fault.families.items():
        assert re.search(pattern, f"{verdicts[family].case}: {verdicts[family].error}"), verdicts[family]
    assert_routed_past_failed_families(set(fault.families))


def test_a_failed_family_is_never_used_and_its_calls_still_return_the_right_answer(emulated_tier, planted_kernels):
    emulated_tier.setenv(source.KERNEL_DIR_ENV, str(planted_kernels("A")))  # nf4_fp4 fails, optimizer_8bit passes
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
    ops.op_packet("optimizer_update_8bit_blockwise").redispatch(MPS, *first_case("optimizer_update_8bit_blockwise"))
    assert any(k.startswith("bnb_optimizer_8bit_") for k in launched)


# -- the unmodified kernels --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def unmodified_run(tmp_path_factory):
    """One verification of the unmodified kernels under the emulator: (verdicts, kernels launched)."""
    from bnb_mps.executors import emulated

    launched: set[str] = set()
    real = emulated.EmulatedExecutor.launch
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("BNB_MPS_EXECUTOR", raising=False)
        _emulated_environment(mp, tmp_path_factory.mktemp("unmodified") / "verify.json")
        mp.setattr(emulated.EmulatedExecutor, "launch",
                   lambda self, kernel, **kw: launched.add(kernel) or real(self, kernel, **kw))  # fmt: skip
        verdicts = bnb_mps.verify("emulated")
        info = bnb_mps.backend_info()
    verification.reset()
    executors.reset()
    return verdicts, launched, info


def test_unmodified_kernels_pass_every_family(unmodified_run):
    verdicts, _, info = unmodified_run
    assert failed(verdicts) == set(), {n: v.describe() for n, v in verdicts.items() if not v.passed}
    assert set(verdicts) == ALL and not any(v.cached for v in verdicts.values())
    # at the emulator's default Metal 3.1 the one-dispatch split-K kernel does not exist: nothing to run
    assert {n for n, v in verdicts.items() if v.skipped} == FROM_3_2
    assert all(v.launches == 0 and "Metal >= 3.2" in v.skipped[0] for n, v in verdicts.items() if n in FROM_3_2)
    for f in verification.FAMILIES.values():
        for op in f.ops:
            assert info[op]["tier"] == "emulated", (op, info[op])


def test_cost_is_bounded(unmodified_run):
    """Launches and bytes verification adds (its time under the emulator is printed by `verify`)."""
    verdicts, _, _ = unmodified_run
    launches = sum(v.launches for v in verdicts.values())
    nbytes = sum(v.bytes for v in verdicts.values())
    # (229 launches, 4.67 MB measured: 9 launches each for the small path and its wide variant, 32 for the
    # two-dispatch split-K (two each for 12 products of its two shapes and for the four calls of 9 tiles of
    # 4 slices that would show a stale partial sum), none for the one-dispatch split-K at Metal 3.1, 179
    # before them)
    assert 0 < launches <= 235 and 0 < nbytes <= 4_750_000, (launches, nbytes)


_DTYPE_TAG = r"_(f16|bf16|f32)(_f32bias)?"
_OPTIMIZER = r"_(adam|ademamix|momentum|rmsprop|adagrad|lion)(?=_)"
_BLOCKSIZE = r"_(32|64|128|256|512|1024|2048|4096)$"


def template_and_path(kernel: str) -> str:
    """A kernel's template and path: its host name without dtype, blocksize and optimizer."""
    return re.sub(_DTYPE_TAG, "", re.sub(_OPTIMIZER, "", re.sub(_BLOCKSIZE, "", kernel)))


def dtype_family(kernel: str) -> str:
    """A kernel's template and dtype family: its host name without blocksize, optimizer and int8 path."""
    return re.sub(r"_(gemv1|gemv4|tile32|tile64)(_k16)?$", "", re.sub(_OPTIMIZER, "", re.sub(_BLOCKSIZE, "", kernel)))


def optimizer(kernel: str) -> str | None:
    """An optimizer kernel's template and optimizer: its host name without dtype."""
    m = re.match(r"(bnb_optimizer_(?:8bit|32bit_unorm|32bit))_(adam|ademamix|momentum|rmsprop|adagrad|lion)_", kernel)
    return f"{m.group(1)}_{m.group(2)}" if m else None


def test_verification_launches_every_kernel_template_path_and_dtype_family_the_ops_use(unmodified_run, library):
    """At least one kernel of each template and path (int8: with and without 16-byte loads), of each
    template and dtype family (the _f32bias kernels too) and of each optimizer's kernels; the
    threadgroup-table gemv kernels too (a variant tuning may pick)."""
    _, launched, _ = unmodified_run
    kernels = set(library.kernels)
    assert launched <= set(library.kernels)
    for project in (template_and_path, dtype_family, optimizer):
        classes: dict[str, set[str]] = {}
        for k in kernels:
            if project(k) is not None:
                classes.setdefault(project(k), set()).add(k)
        missing = sorted(c for c, members in classes.items() if not members & launched)
        assert not missing, f"{project.__name__}: no kernel of {missing} is launched by verification"
    print(f"verification launches {len(launched)} of the library's {len(library.kernels)} kernels")


# -- the cache -----------------------------------------------------------------------------------------------


def test_the_cache_is_written_read_and_invalidated_by_a_source_change(emulated_tier, planted_kernels):
    first = bnb_mps.verify("emulated")
    assert not any(v.cached for v in first.values())
    data = json.loads(verification.cache_path().read_text())
    key = tier_key(data)
    assert key.startswith("emulated | ") and source.source_hash() in key and torch.__version__ in key
    assert key.endswith(" | Metal 3.1 | float apple")
    split_k = source.source_hash(source.units()["gemm_4bit_splitk"])
    assert unit_keys(data, key) == {f"{key} | unit gemm_4bit_splitk {split_k}": {"matmul_4bit_splitk",
                                                                               "matmul_4bit_splitk_two"}}
    assert set(data[key]) | {"matmul_4bit_splitk", "matmul_4bit_splitk_two"} == ALL
    # A later process on the same machine (here: this one, its verdicts forgotten) reads the cache.
    verification.reset()
    again = bnb_mps.verify("emulated")
    assert all(v.cached for v in again.values())
    assert {n: (v.passed, v.launches) for n, v in again.items()} == {n: (v.passed, v.launches) for n, v in first.items()}
    # Any change to the kernel source is another key: verified again.
    emulated_tier.setenv(source.KERNEL_DIR_ENV, str(planted_kernels("A")))
    changed = bnb_mps.verify("emulated")
    assert not any(v.cached for v in changed.values()) and failed(changed)
    assert len(json.loads(verification.cache_path().read_text())) == 4  # (a tier key and a unit key each)
    # BNB_MPS_VERIFY=always ignores the cache; refresh=True too (one family each, for time).
    executor = executors.load_tier("emulated")
    verification.reset()
    assert verification.verdict("int8_quant", "emulated", executor).cached
    verification.reset()
    emulated_tier.setenv("BNB_MPS_VERIFY", "always")
    assert not verification.verdict("int8_quant", "emulated", executor).cached
    emulated_tier.delenv("BNB_MPS_VERIFY")
    verification.reset()
    assert not verification.verdict("int8_quant", "emulated", executor, refresh=True).cached


def test_the_cache_file_setting(monkeypatch, tmp_path):
    monkeypatch.setenv(verification.CACHE_ENV_VAR, str(tmp_path / "v.json"))
    monkeypatch.setenv("BNB_MPS_CACHE_DIR", str(tmp_path / "dir"))
    assert verification.cache_path() == tmp_path / "v.json"
    monkeypatch.delenv(verification.CACHE_ENV_VAR)
    assert verification.cache_path() == tmp_path / "dir" / "verify.json"
    monkeypatch.delenv("BNB_MPS_CACHE_DIR")
    assert verification.cache_path() == Path.home() / ".cache" / "bnb_mps" / "verify.json"


def test_the_test_session_never_writes_the_users_cache():
    assert os.environ.get(verification.CACHE_ENV_VAR), "tests/conftest.py sets the verification cache"
    assert Path(os.environ[verification.CACHE_ENV_VAR]).resolve() != (
        Path.home() / ".cache" / "bnb_mps" / "verify.json").resolve()


def _good_entry(family: str, passed: bool = True) -> dict:
    return {"family": family, "passed": passed, "seconds": 0.25, "case": None if passed else "some case",
            "error": None if passed else "2 of 8 elements differ", "launches": 3, "bytes": 100, "skipped": []}  # fmt: skip


def _malformed(key: str, family: str) -> dict:
    good = _good_entry(family)
    return {
        "not JSON": b"\x00\xff{garbage",
        "not UTF-8": b'{"\xff": 1}',
        "nested too deep": b"[" * 100_000,
        "a list": [1, 2],
        "a string": "verdicts",
        "the key holds a list": {key: []},
        "the key holds a string": {key: "passed"},
        "the entry is a list": {key: {family: []}},
        "passed is a string": {key: {family: {**good, "passed": "false"}}},
        "passed is a number": {key: {family: {**good, "passed": 1}}},
        "launches is a bool": {key: {family: {**good, "launches": True}}},
        "seconds is NaN": {key: {family: {**good, "seconds": math.nan}}},
        "negative launches": {key: {family: {**good, "launches": -1}}},
        "another family's entry": {key: {family: {**good, "family": "nf4_fp4"}}},
        "a field missing": {key: {family: {k: v for k, v in good.items() if k != "bytes"}}},
        "an unknown field": {key: {family: {**good, "verdict": "passed"}}},
        "skipped is not a list of strings": {key: {family: {**good, "skipped": [1]}}},
        "a failure without its case": {key: {family: {**_good_entry(family, False), "case": None}}},
    }


MALFORMED = list(_malformed("k", "f"))


@pytest.mark.parametrize("what", MALFORMED)
def test_malformed_cache_content_counts_as_missing_and_is_rewritten(emulated_tier, what):
    family = "int8_quant"  # (a family that verifies in a fraction of a second)
    executor = executors.load_tier("emulated")
    key = verification.cache_key("emulated", source.source_hash(), executor)
    content = _malformed(key, family)[what]
    path = verification.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    v = verification.verdict(family, "emulated", executor)  # must not raise
    assert v.passed and not v.cached and v.launches > 0, v  # run now, not taken from the file
    entry = json.loads(path.read_text())[key][family]  # rewritten, in the shape a later process reads
    assert cache.from_entry(family, entry) is not None and entry["passed"] is True
    verification.reset()
    again = verification.verdict(family, "emulated", executor)
    assert again.cached and again.passed


def test_a_well_formed_cached_failure_is_honoured(emulated_tier):
    """(The check above is not simply "never trust the file".)"""
    executor = executors.load_tier("emulated")
    key = verification.cache_key("emulated", source.source_hash(), executor)
    path = verification.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({key: {"int8_quant": _good_entry("int8_quant", passed=False)}}))
    v = verification.verdict("int8_quant", "emulated", executor)
    assert v.cached and not v.passed and v.case == "some case"
    assert "failed in case 'some case'" in verification.failure("int8_vectorwise_quant", "emulated", executor)


def test_an_unwritable_cache_never_raises(emulated_tier, tmp_path):
    (tmp_path / "a file").write_text("")
    emulated_tier.setenv(verification.CACHE_ENV_VAR, str(tmp_path / "a file" / "verify.json"))
    v = verification.verdict("int8_quant", "emulated", executors.load_tier("emulated"))
    assert v.passed and not v.cached


def test_the_cache_key_holds_the_math_mode(emulated_tier, monkeypatch):
    from bnb_mps.executors import shader

    h = source.source_hash()
    monkeypatch.setattr(shader, "_process_fast_math", False)  # (a process started without PYTORCH_MPS_FAST_MATH)
    assert verification.cache_key("shader", h).endswith(" | safe math")
    monkeypatch.setattr(shader, "_process_fast_math", True)  # (a process started with PYTORCH_MPS_FAST_MATH=1)
    monkeypatch.setattr(shader, "math_mode_pinned", lambda macos, torch_ver: False)  # Metal 3.1: fast math reaches the kernels
    assert verification.cache_key("shader", h).endswith(" | fast math")
    monkeypatch.setattr(shader, "math_mode_pinned", lambda macos, torch_ver: True)  # Metal >= 3.2: the pragmas hold
    assert verification.cache_key("shader", h).endswith(" | safe math")
    assert "math" not in verification.cache_key("native", h)  # (compiled with safe math whatever the variable says)
    # The emulator's float mode: a verdict made in one mode is not taken for the other.
    executor = executors.load_tier("emulated")
    assert verification.cache_key("emulated", h, executor).endswith(" | float apple")
    first = verification.verdict("int8_quant", "emulated", executor)
    monkeypatch.setenv("BNB_MPS_EMU_FLOAT", "ieee")
    assert verification.cache_key("emulated", h, executor).endswith(" | float ieee")
    verification.reset()
    in_ieee = verification.verdict("int8_quant", "emulated", executor)
    assert not first.cached and not in_ieee.cached and in_ieee.passed
    assert len(json.loads(verification.cache_path().read_text())) == 2


# -- what does not count as a failure, what is not cached -------------------------------------------------------


class Limited:
    """The emulated tier with pipelines that allow at most `maximum` threads per threadgroup: launches
    above it raise PipelineLimitError before running, as the native and shader tiers do."""

    name = "emulated"
    device_type = "cpu"

    def __init__(self, maximum: int) -> None:
        self.inner, self.maximum, self.refused = executors.load_tier("emulated"), maximum, []

    def launch(self, kernel, *, grid, threadgroup, args) -> None:
        if math.prod(threadgroup) > self.maximum:
            self.refused.append(kernel)
            raise PipelineLimitError(kernel, math.prod(threadgroup), self.maximum)
        self.inner.launch(kernel, grid=grid, threadgroup=threadgroup, args=args)


def test_a_refused_launch_skips_its_case_and_is_no_failure(emulated_tier, recwarn):
    limited = Limited(256)  # the 8-bit quantizer of blocksize 4096 launches 512 threads per threadgroup
    v = verification.verdict("blockwise_8bit", "emulated", limited)
    assert v.passed and not v.could_not_run and limited.refused == ["bnb_quantize_blockwise_f32_4096"]
    (skip,) = v.skipped
    assert skip.startswith("quantize_blockwise torch.float32 blocksize=4096") and "at most 256" in skip, skip
    assert "1 case(s) skipped" in v.describe()
    assert verification.failure("quantize_blockwise", "emulated", limited) is None
    assert not [w for w in recwarn if issubclass(w.category, verification.VerificationWarning)]
    # Cached as a pass that skipped that case.
    verification.reset()
    again = verification.verdict("blockwise_8bit", "emulated", limited)
    assert again.cached and again.passed and again.skipped == v.skipped


def test_a_verification_that_cannot_run_fails_the_family_in_this_process_only(emulated_tier, monkeypatch):
    real = verification.FAMILIES["int8_products"]
    boom = verification.Family("int8_products", real.ops, lambda: (_ for _ in ()).throw(RuntimeError("no such kernel")))
    monkeypatch.setitem(verification.FAMILIES, "int8_products", boom)
    verdicts = bnb_mps.verify("emulated")
    assert failed(verdicts) == {"int8_products"}
    v = verdicts["int8_products"]
    assert v.could_not_run and "RuntimeError: no such kernel" in v.error and "could not be verified" in v.describe()
    info = bnb_mps.backend_info()
    assert info["int8_linear_matmul"]["tier"] != "emulated" and "could not be verified" in info["int8_linear_matmul"]["reason"]
    assert info["gemm_4bit"]["tier"] == "emulated"
    # Not cached: the next process verifies that family again (and caches the others).
    data = json.loads(verification.cache_path().read_text())
    assert set().union(*map(set, data.values())) == ALL - {"int8_products"}
    monkeypatch.setitem(verification.FAMILIES, "int8_products", real)
    verification.reset()
    again = bnb_mps.verify("emulated")
    assert not again["int8_products"].cached and again["int8_products"].passed
    assert all(v.cached for name, v in again.items() if name != "int8_products")


def test_no_cxx_compiler_is_not_cached_as_a_failure(emulated_tier, tmp_path, monkeypatch):
    from bnb_mps import emulator
    from bnb_mps.emulator import build

    d = tmp_path / "kernels"
    shutil.copytree(KERNELS, d)
    for unit in d.glob("*.metal"):  # every compile unit another text: each compiled anew
        unit.write_text(unit.read_text() + "\n// another source text: compiled anew\n")
    emulated_tier.setenv(source.KERNEL_DIR_ENV, str(d))

    def no_compiler(compiler=None):
        raise emulator.CompileError("no C++ compiler found (tried c++, g++, clang++); set BNB_MPS_EMU_CXX")

    monkeypatch.setattr(build, "find_compiler", no_compiler)
    runs = []
    real = verification.run_family
    monkeypatch.setattr(verification, "run_family", lambda *a: runs.append(a[0].name) or real(*a))
    verdicts = bnb_mps.verify("emulated")
    # (the one-dispatch split-K family has nothing to compile at Metal 3.1: it passes, skipped, and is cached)
    assert failed(verdicts) == ALL - FROM_3_2
    assert all(v.could_not_run and "no C++ compiler" in v.error for n, v in verdicts.items() if n not in FROM_3_2)
    cached = json.loads(verification.cache_path().read_text()) if verification.cache_path().exists() else {}
    assert set().union(*map(set, cached.values())) == FROM_3_2
    verification.reset()
    bnb_mps.verify("emulated")
    assert sorted(runs) == sorted([*ALL, *(ALL - FROM_3_2)])  # verified again, not read from a cache


def test_kernel_source_that_does_not_compile_is_a_failure_of_the_kernels(monkeypatch):
    """(Cached like a wrong result: the source is part of the cache key.) Only a missing compiler
    means that the verification could not run."""
    from bnb_mps import emulator
    from bnb_mps.emulator import build

    error = emulator.CompileError("bnb_mps kernels: compiling kernels for the emulator failed (g++): ...")
    try:
        build.find_compiler()
    except emulator.CompileError as e:
        from extras import missing

        missing("a C++ compiler for the emulator", str(e))
    assert not runner.cannot_run(error)
    monkeypatch.setattr(build, "find_compiler", lambda compiler=None: (_ for _ in ()).throw(
        emulator.CompileError("no C++ compiler found (tried c++, g++, clang++); set BNB_MPS_EMU_CXX")))  # fmt: skip
    assert runner.cannot_run(error)
    assert not runner.cannot_run(emulator.OutOfBounds("out-of-bounds write"))
    assert not runner.cannot_run(RuntimeError("a GPU tier's error"))


def test_verify_0_skips_verification(emulated_tier, planted_kernels, monkeypatch):
    emulated_tier.setenv(source.KERNEL_DIR_ENV, str(planted_kernels("A")))  # int8 quantization is faulty there
    emulated_tier.setenv("BNB_MPS_VERIFY", "0")
    runs = []
    monkeypatch.setattr(verification, "run_family", lambda *a, **k: runs.append(a) or pytest.fail("verified"))
    assert bnb_mps.backend_info()["int8_vectorwise_quant"]["tier"] == "emulated"  # at the user's risk
    assert runs == [] and not verification.cache_path().exists()


def test_the_second_call_of_an_op_does_no_verification_work(emulated_tier, monkeypatch):
    """Routes are cached: once an op's first call verified its families (or read their verdicts),
    its later calls do not look at verification at all."""
    calls: dict[str, int] = {}
    # (each where it is looked up: routing asks the package for `failure`, the package's `run_family` is
    # looked up at each run, the rest are the names first_use and the cache call)
    for module, name in ((verification, "failure"), (first_use, "verdict"), (verification, "run_family"),
                         (cache, "read"), (cache, "cached"), (first_use, "cache_key"),
                         (first_use, "machine"), (machine_key, "machine")):  # fmt: skip
        real = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _real=real, _name=name, **k: calls.__setitem__(_name, calls.get(_name, 0) + 1)
                            or _real(*a, **k))  # fmt: skip
    args = first_case("int8_vectorwise_quant")
    for process in ("verifies", "reads the cache"):
        verification.reset()
        routing.forget()
        calls.clear()
        ops.op_packet("int8_vectorwise_quant").redispatch(MPS, *args)
        assert calls.get("failure") == 1 and calls.get("verdict") == 1, calls
        assert calls.get("run_family", 0) == (1 if process == "verifies" else 0), calls
        calls.clear()
        for _ in range(3):
            ops.op_packet("int8_vectorwise_quant").redispatch(MPS, *args)
        assert calls == {}, calls


# -- faults of one run, device errors, families that call ops -----------------------------------------------


class Dropping:
    """The emulated tier with a GPU fault: while `on`, launches do nothing (their outputs stay unwritten),
    as when the GPU aborts the command buffer that holds them."""

    name = "emulated"
    device_type = "cpu"

    def __init__(self, on: bool = True) -> None:
        self.inner, self.on, self.dropped = executors.load_tier("emulated"), on, 0

    def launch(self, kernel, *, grid, threadgroup, args) -> None:
        if self.on:
            self.dropped += 1
            return
        self.inner.launch(kernel, grid=grid, threadgroup=threadgroup, args=args)


def fault_first_runs(monkeypatch, fault) -> list[str]:
    """Wraps the package's run_family (its docstring says how): the first run of each family runs
    with `fault(executor)`. Returns the list of runs."""
    real = verification.run_family
    runs: list[str] = []

    def run(family, executor, device):
        runs.append(family.name)
        return real(family, fault(executor) if runs.count(family.name) == 1 else executor, device)

    monkeypatch.setattr(verification, "run_family", run)
    return runs


def stored(executor, family):
    """`family`'s entry in the cache file under the emulated tier's key, or None."""
    key = verification.cache_key("emulated", source.source_hash(), executor)
    path = verification.cache_path()
    return json.loads(path.read_text()).get(key, {}).get(family) if path.exists() else None


@pytest.mark.parametrize("family", ["int8_quant", "blockwise_8bit"])
def test_a_fault_of_the_first_run_only_serves_and_is_not_cached_as_failed(emulated_tier, monkeypatch, family):
    """A GPU fault is not a kernel failure: the first run's launches dropped (outputs never written),
    the second run clean. The family serves; its verdict, and the cache, record the first failure."""
    executor = executors.load_tier("emulated")
    runs = fault_first_runs(monkeypatch, lambda ex: Dropping())
    v = verification.verdict(family, "emulated", executor)
    assert runs == [family, family]
    assert v.passed and not v.could_not_run and "never written" in v.first_failure, v
    assert "passed on its second run" in v.describe() and "never written" in v.describe()
    entry = stored(executor, family)
    assert entry["passed"] is True and entry["first_failure"] == v.first_failure
    op = verification.FAMILIES[family].ops[0]
    assert verification.failure(op, "emulated", executor) is None
    assert routing.route(op).tier == "emulated"  # (the selection's executor: its verdict from the cache)
    verification.reset()
    again = verification.verdict(family, "emulated", executor)
    assert again.cached and again.passed and again.first_failure == v.first_failure and len(runs) == 2


def test_a_kernel_fault_in_the_first_run_only_serves(emulated_tier, planted_kernels, monkeypatch):
    """The same with the fault in the kernel source of the first run (group A's int8 rounding, through
    BNB_MPS_KERNEL_DIR), the second run on the installed kernels."""
    planted = planted_kernels("A")
    real = verification.run_family
    runs = []

    def run(family, executor, device):
        runs.append(family.name)
        with pytest.MonkeyPatch.context() as mp:
            if len(runs) == 1:
                mp.setenv(source.KERNEL_DIR_ENV, str(planted))
            return real(family, executor, device)

    monkeypatch.setattr(verification, "run_family", run)
    v = verification.verdict("int8_quant", "emulated", executors.load_tier("emulated"))
    assert runs == ["int8_quant"] * 2 and v.passed, v
    assert re.match(r"failed in case 'int8_(vectorwise|double)_quant ", v.first_failure), v.first_failure


def test_a_family_faulted_on_every_run_is_cached_as_failed(emulated_tier):
    dropping = Dropping()
    v = verification.verdict("int8_quant", "emulated", dropping)
    assert not v.passed and not v.could_not_run and dropping.dropped > 0, v
    # (reported as never written, not as the sentinel's value taken for a wrong result)
    assert "never written" in v.error and "never written" in v.first_failure
    assert "and again on a second run" in v.describe()
    assert stored(dropping.inner, "int8_quant")["passed"] is False
    verification.reset()
    again = verification.verdict("int8_quant", "emulated", executors.load_tier("emulated"))
    assert again.cached and not again.passed and again.case == v.case


def test_outputs_never_written_are_told_from_wrong_values():
    from bnb_mps.ops.verify import sentinel

    want = (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([7, 8], dtype=torch.uint8))
    got = (torch.tensor([1.0, 2.0, 3.0]), sentinel.filled((2,), torch.uint8))
    assert sentinel.unwritten(got, want) == ("result[1]: 2 of 2 elements were never written (they still hold the "
                                             "sentinel verification filled the output with before the launches)")
    assert sentinel.unwritten((want[0] * 2, want[1]), want) is None  # a wrong value is not unwritten
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.int64):
        s = sentinel.filled((3,), dtype)
        assert torch.isfinite(s.double()).all() and bool((s.double() < -1000).all()), (dtype, s)  # never NaN
    with sentinel.fresh_outputs():
        fresh = torch.empty(4, dtype=torch.float16)
        zeros = torch.zeros(4)
    assert torch.equal(fresh, sentinel.filled((4,), torch.float16)) and not zeros.any()
    assert not torch.equal(torch.empty(4, dtype=torch.float16).fill_(1), sentinel.filled((4,), torch.float16))


METAL_ERROR = ("Execution of the command buffer was aborted due to an error during execution. Caused GPU Address "
               "Fault Error (0000000b:kIOGPUCommandBufferCallbackErrorPageFault)")


class Watched:
    """The emulated tier reporting its command buffers' status as the native tier does
    (`watch_command_buffers`, csrc/mps_ops.h), which cannot exist here: the buffers of its first
    `failing` runs (one watch a run) report Metal's error."""

    name = "emulated"
    device_type = "cpu"

    def __init__(self, failing: int) -> None:
        self.inner, self.failing, self.watches = executors.load_tier("emulated"), failing, []

    def launch(self, kernel, *, grid, threadgroup, args, watch=None) -> None:
        self.inner.launch(kernel, grid=grid, threadgroup=threadgroup, args=args)
        if watch is not None:
            watch.track()

    def watch_command_buffers(self):
        watch = FakeWatch(METAL_ERROR if len(self.watches) < self.failing else None)
        self.watches.append(watch)
        return watch


class FakeWatch:
    def __init__(self, error) -> None:
        self.error, self.tracked = error, 0

    def track(self) -> None:
        self.tracked += 1

    def errors(self) -> list[str]:
        return [self.error] * self.tracked if self.error else []


def test_a_command_buffer_error_means_could_not_run_and_is_not_cached(emulated_tier):
    watched = Watched(failing=99)
    v = verification.verdict("int8_quant", "emulated", watched)
    assert not v.passed and v.could_not_run and v.device_error and len(watched.watches) == 2, v
    assert v.error == f"the GPU reported an error in a command buffer of the launches: {METAL_ERROR}"  # (once)
    assert all(w.tracked == watched.watches[0].tracked > 0 for w in watched.watches)  # every launch's buffer
    assert v.describe().startswith("could not be verified") and METAL_ERROR in v.describe()
    reason = verification.failure("int8_vectorwise_quant", "emulated", watched)
    assert "could not be verified" in reason and METAL_ERROR in reason
    assert stored(watched.inner, "int8_quant") is None  # not cached: verified again by the next process
    verification.reset()
    assert not verification.verdict("int8_quant", "emulated", watched).cached and len(watched.watches) == 4


def test_a_command_buffer_error_of_the_first_run_only_serves(emulated_tier):
    watched = Watched(failing=1)
    v = verification.verdict("int8_quant", "emulated", watched)
    assert v.passed and METAL_ERROR in v.first_failure and len(watched.watches) == 2, v
    assert stored(watched.inner, "int8_quant")["passed"] is True


def test_the_fault_kernel_of_the_acceptance_run_faults(library):
    """tests/fault_kernels/address_fault.metal (what scripts/mac_acceptance.sh launches to fail a command
    buffer on a Mac) writes far out of any buffer: under the emulator, a memory fault at that write."""
    import command_buffer_fault as cbf

    from bnb_mps import emulator
    from bnb_mps.kernel_args import uint64

    lib = emulator.Library(cbf.FAULT_KERNEL.read_text(), name=cbf.FAULT_KERNEL.name)
    out = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(emulator.EmulatorError, match="invalid memory access"):
        lib.launch(cbf.FAULT_NAME, grid=(1, 1, 1), threadgroup=(32, 1, 1), args=[out, uint64(cbf.FAR_ELEMENTS)])
    lib.launch(cbf.FAULT_NAME, grid=(1, 1, 1), threadgroup=(32, 1, 1), args=[out, uint64(0)])
    assert out.tolist() == [0xDEAD] + list(range(1, 32))  # (in bounds, every thread writes)


@pytest.mark.mps
def test_a_command_buffer_error_on_this_mac_is_could_not_run_and_not_cached(fresh_tier_selection, tmp_path):
    """The acceptance run's forced GPU fault (tests/command_buffer_fault.py), on the native tier."""
    import command_buffer_fault

    fresh_tier_selection.setenv(verification.CACHE_ENV_VAR, str(tmp_path / "verify.json"))
    executors.reset()
    result = command_buffer_fault.run()
    if not result["ran"]:
        pytest.skip(result["why"])
    assert result["ok"], result


def _nested_kernel(monkeypatch, wrong: bool):
    """int8_vectorwise_dequant's kernel (family int8_quant), made to call ops through the dispatcher:
    quantize_blockwise (family blockwise_8bit) and int8_vectorwise_quant (its own family); with
    `wrong`, its result doubled."""
    op = ops.OPS["int8_vectorwise_dequant"]
    real = op.kernel
    nested = []

    def kernel(executor, A, stats):
        A8 = torch.randn(256, generator=torch.Generator().manual_seed(1))
        nested.append(ops.op_packet("quantize_blockwise").redispatch(MPS, A8, op_inputs.signed_code(), 64))
        nested.append(ops.op_packet("int8_vectorwise_quant").redispatch(MPS, torch.randn(4, 16), 0.0))
        out = real(executor, A, stats)
        return out * 2 if wrong else out

    monkeypatch.setattr(op, "kernel", kernel)
    return nested


def _verify_in_a_thread(family: str):
    """The verdict of `family`, from another thread that must finish (a wait for itself would not)."""
    import threading

    done = {}
    thread = threading.Thread(target=lambda: done.setdefault(
        "v", verification.verdict(family, "emulated", executors.load_tier("emulated"))), daemon=True)  # fmt: skip
    thread.start()
    thread.join(300)
    assert not thread.is_alive(), "the verification waits for itself"
    return done["v"]


def test_a_family_whose_kernels_call_ops_does_not_wait_for_itself(emulated_tier, monkeypatch):
    """An op of another family, called from inside a family's verification, verifies that family on the
    same thread (the lock is reentrant); an op of the same family runs on the tier as part of it."""
    nested = _nested_kernel(monkeypatch, wrong=False)
    v = _verify_in_a_thread("int8_quant")
    assert v.passed and len(nested) >= 2, v
    info = bnb_mps.backend_info()
    assert info["quantize_blockwise"]["tier"] == info["int8_vectorwise_quant"]["tier"] == "emulated"
    assert verification.verdict("blockwise_8bit", "emulated", executors.load_tier("emulated")).passed


def test_routes_made_while_a_family_was_verified_are_made_again(emulated_tier, monkeypatch):
    """The op of its own family ran on the tier (and got a route) before the family's verdict was known:
    once the family fails, that route is dropped, and the op leaves the tier."""
    _nested_kernel(monkeypatch, wrong=True)
    v = _verify_in_a_thread("int8_quant")
    assert not v.passed and v.case.startswith("int8_vectorwise_dequant"), v
    r = routing.route("int8_vectorwise_quant")
    assert r.tier in ("bitsandbytes", "cpu") and "int8_quant kernels failed verification" in r.reason, r


# -- the API and the command ---------------------------------------------------------------------------------


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


def test_the_verify_table_shows_what_a_first_run_found():
    from bnb_mps.__main__ import verify_table

    verdicts = {"nf4_fp4": verification.Verdict("nf4_fp4", True, 1.5, launches=60, bytes=10,
                                                 first_failure="failed in case 'x': 2 of 8 elements differ"),
                "int8_quant": verification.Verdict("int8_quant", True, 0.5, launches=40, bytes=10)}  # fmt: skip
    text = " ".join(" ".join(verify_table(verdicts)).split())  # (wrapped at 100 columns)
    assert "nf4_fp4: passed on its second run, in a fresh command buffer (its first run failed in case 'x': 2 of 8" in text
    assert "int8_quant:" not in text  # (a plain pass has its row only)


@pytest.mark.model  # (a subprocess: tests/tiers.py)
def test_python_m_bnb_mps_verify(tmp_path):
    """The command, in a process of its own: the kernels' load and compile, then the verification,
    each with its time. (The emulator's compiled modules stay where this session keeps them.)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BNB_MPS_") or k == "BNB_MPS_CACHE_DIR"}
    env[verification.CACHE_ENV_VAR] = str(tmp_path / "verify.json")
    proc = subprocess.run([sys.executable, "-m", "bnb_mps", "verify", "--tier", "emulated", "--json",
                           str(tmp_path / "v.json")], capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ALL:
        assert any(line.startswith(name) and "passed" in line for line in proc.stdout.splitlines()), proc.stdout
    assert re.search(r"Loaded the emulated tier and its kernels in \d+\.\d\d s", proc.stdout), proc.stdout
    assert re.search(rf"{len(ALL)} of {len(ALL)} families passed in \d+\.\d\d s", proc.stdout), proc.stdout
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["load_seconds"] >= 0 and report["seconds"] > 0 and set(report["families"]) == ALL
    assert json.loads((tmp_path / "verify.json").read_text())  # its verdicts, in the file it was given


@pytest.mark.mps
def test_verification_on_this_mac(fresh_tier_selection, tmp_path):
    """Every family passes on the GPU tier that serves here, run now (not from a cache)."""
    fresh_tier_selection.setenv(verification.CACHE_ENV_VAR, str(tmp_path / "verify.json"))
    executors.reset()
    verification.reset()
    verdicts = bnb_mps.verify(refresh=True)
    assert failed(verdicts) == set(), {n: v.describe() for n, v in verdicts.items() if not v.passed}
    assert routing.route("gemm_4bit").tier in ("native", "shader")


# -- compare.close: the tolerance comparison's NaN and infinity policy ------------------------------------------


@pytest.mark.parametrize("got,want,passes", [
    (float("nan"), float("nan"), True),  # a NaN reference is matched by NaN
    (1.0, float("nan"), False),  # ... by nothing else
    (float("inf"), float("nan"), False),
    (float("nan"), 1.0, False),  # a NaN where the reference is finite
    (float("inf"), float("inf"), True),  # an infinity by the same infinity
    (float("-inf"), float("inf"), False),
    (1e30, float("inf"), False),
    (float("inf"), 1.0, False),
    (1.05, 1.0, True),  # finite: within the tolerance, 0.1
    (1.2, 1.0, False),
])
def test_close_matches_nan_and_infinities_exactly_and_measures_finite_values(got, want, passes):
    from bnb_mps.ops.verify.compare import close

    g = torch.tensor([0.5, got, 2.0], dtype=torch.float32)
    w = torch.tensor([0.5, want, 2.0], dtype=torch.float32)
    error = close(g, w, 0.1)
    assert (error is None) == passes, error
    if not passes:
        assert "1 of 3 elements" in error and "element 1" in error, error
    assert close(torch.tensor([1.0]), torch.tensor([1.0]), float("nan")) is not None  # (a NaN tolerance allows nothing)
