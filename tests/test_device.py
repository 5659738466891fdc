"""Tests for bnb_mps.device.

This machine has no MPS device (and no CUDA); where a test needs one, only its
availability, its tiny allocation or its out-of-memory error is mocked. Everything that
exists here (the CPU device, the CPU allocator's out-of-memory error, DataLoader) is real.
"""

import ast
import importlib.util
import logging
import os
import subprocess
import sys
import types

import extras
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bnb_mps
from bnb_mps import device as dev


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(dev.DEVICE_ENV_VAR, raising=False)
    monkeypatch.delenv("PYTORCH_ENABLE_MPS_FALLBACK", raising=False)


@pytest.fixture(autouse=True)
def _stub_backend_info(monkeypatch):
    """Every op on the native tier unless a test says otherwise (the real backend_info may
    load bitsandbytes, which takes seconds, and depends on what is built)."""
    set_backend_info(monkeypatch, {"optimizer_update_8bit_blockwise": "native", "quantize_4bit": "native"})


@pytest.fixture
def fake_mps(monkeypatch):
    """Pretend an MPS device exists; its probe succeeds unless a test changes `state`."""
    state = {"probe_error": None, "probed": []}
    real_probe = dev._probe

    def probe(device):
        state["probed"].append(device)
        if device.type == "mps":
            if state["probe_error"] is not None:
                raise state["probe_error"]
            return
        real_probe(device)

    monkeypatch.setattr(dev, "is_mps_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    monkeypatch.setattr(dev, "_probe", probe)
    return state


def set_backend_info(monkeypatch, tiers):
    """Install a bnb_mps.backend_info() answering `tiers` (op -> tier)."""
    info = {op: {"tier": tier, "reason": f"reason for {op}"} for op, tier in tiers.items()}
    monkeypatch.setattr(bnb_mps, "backend_info", lambda: info, raising=False)


def cpu_oom():
    """Raise the CPU allocator's real out-of-memory error (no machine can allocate 4 EiB)."""
    torch.empty(2**62, dtype=torch.uint8)


# --------------------------------------------------------------------------- import


@pytest.mark.model  # (a subprocess: tests/tiers.py)
def test_import_is_light():
    code = (
        "import sys, bnb_mps.device; "
        "print(sorted(m for m in ('bitsandbytes', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- is_mps_available / get_device


def test_is_mps_available_matches_torch():
    expected = torch.backends.mps.is_built() and torch.backends.mps.is_available()
    assert dev.is_mps_available() is bool(expected)


def test_is_mps_available_false_when_torch_query_fails(monkeypatch):
    def boom():
        raise RuntimeError("broken")

    monkeypatch.setattr(torch.backends.mps, "is_built", boom)
    assert dev.is_mps_available() is False


def test_auto_picks_best_available_here():
    if torch.cuda.is_available():
        expected = "cuda"
    elif dev.is_mps_available():
        expected = "mps"
    else:
        expected = "cpu"
    assert dev.get_device().type == expected
    assert dev.get_device("auto").type == expected


@pytest.mark.parametrize("pref", ["cpu", "CPU", " cpu ", torch.device("cpu")])
def test_explicit_cpu(pref):
    assert dev.get_device(pref) == torch.device("cpu")


@pytest.mark.parametrize("bad", ["gpu", "tpu", "metal", "cuda:x", "xpu", torch.device("meta")])
def test_invalid_device_lists_choices(bad):
    with pytest.raises(ValueError) as info:
        dev.get_device(bad)
    message = str(info.value)
    assert "preferred_device" in message
    for choice in ("'auto'", "'cpu'", "'cuda'", "'mps'"):
        assert choice in message


def test_device_of_wrong_type():
    with pytest.raises(TypeError, match="preferred_device"):
        dev.get_device(3)
    with pytest.raises(TypeError, match="fallback_on_error"):
        dev.get_device("cpu", fallback_on_error="yes")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_cuda_falls_back_with_reason(caplog):
    with caplog.at_level(logging.WARNING, logger="bnb_mps.device"):
        assert dev.get_device("cuda") == torch.device("cpu")
    assert "cuda" in caplog.text and "is_available() is False" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_cuda_without_fallback_raises():
    with pytest.raises(RuntimeError, match="cuda.*not usable.*is_available"):
        dev.get_device("cuda", fallback_on_error=False)


@pytest.mark.skipif(dev.is_mps_available(), reason="needs a machine without MPS")
def test_unavailable_mps_without_fallback_raises():
    with pytest.raises(RuntimeError, match="mps"):
        dev.get_device("mps", fallback_on_error=False)


def test_env_overrides_argument(monkeypatch):
    monkeypatch.setenv(dev.DEVICE_ENV_VAR, "cpu")
    # Without the override this would raise (no CUDA here) or return a CUDA device.
    assert dev.get_device("cuda:0", fallback_on_error=False) == torch.device("cpu")


def test_env_override_is_validated(monkeypatch):
    monkeypatch.setenv(dev.DEVICE_ENV_VAR, "quantum")
    with pytest.raises(ValueError, match=dev.DEVICE_ENV_VAR):
        dev.get_device("cpu")


def test_env_override_to_mps(monkeypatch, fake_mps):
    monkeypatch.setenv(dev.DEVICE_ENV_VAR, "mps")
    assert dev.get_device("cpu") == torch.device("mps")


def test_auto_prefers_mps_when_present(fake_mps):
    if torch.cuda.is_available():
        pytest.skip("CUDA ranks above MPS")
    assert dev.get_device() == torch.device("mps")
    assert dev.get_device("mps") == torch.device("mps")
    # The choice was confirmed with a probe on the device itself.
    assert torch.device("mps") in fake_mps["probed"]


def test_failing_probe_falls_back(fake_mps, caplog):
    fake_mps["probe_error"] = RuntimeError("MTLCreateSystemDefaultDevice returned nil")
    with caplog.at_level(logging.WARNING, logger="bnb_mps.device"):
        assert dev.get_device("mps") == torch.device("cpu")
    assert "test allocation failed" in caplog.text and "MTLCreateSystemDefaultDevice" in caplog.text


def test_failing_probe_without_fallback_raises(fake_mps):
    fake_mps["probe_error"] = RuntimeError("MTLCreateSystemDefaultDevice returned nil")
    with pytest.raises(RuntimeError, match="mps.*test allocation failed"):
        dev.get_device("mps", fallback_on_error=False)
    with pytest.raises(RuntimeError, match="mps"):
        dev.get_device(fallback_on_error=False)  # auto picks mps, which fails


def test_mps_index_other_than_zero_is_rejected(fake_mps):
    with pytest.raises(RuntimeError, match="single device"):
        dev.get_device("mps:1", fallback_on_error=False)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend two CUDA devices exist and their probe succeeds."""
    real_probe = dev._probe
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dev, "_probe", lambda d: None if d.type == "cuda" else real_probe(d))


def test_cuda_index_is_honoured(fake_cuda):
    got = dev.get_device(torch.device("cuda:1"))
    assert got.type == "cuda" and got.index == 1
    assert dev.get_device("cuda:0").index == 0
    assert dev.get_device() == torch.device("cuda")


def test_cuda_index_out_of_range(fake_cuda):
    with pytest.raises(RuntimeError, match="out of range"):
        dev.get_device("cuda:2", fallback_on_error=False)
    assert dev.get_device("cuda:5") != torch.device("cuda:5")


def test_probe_really_computes_on_cpu():
    dev._probe(torch.device("cpu"))  # must not raise
    with pytest.raises(Exception):
        dev._probe(torch.device("meta"))  # a meta tensor has no value to read back


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize(
    "name,expected",
    [
        ("fp32", torch.float32), ("float32", torch.float32),
        ("fp16", torch.float16), ("float16", torch.float16), ("half", torch.float16),
        ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
        ("BF16", torch.bfloat16), (" Half ", torch.float16),
    ],
)
def test_dtype_names(name, expected):
    assert dev.get_dtype_from_string(name) is expected


@pytest.mark.parametrize("bad", ["int8", "fp8", "", "float64", "double"])
def test_dtype_unknown_lists_choices(bad):
    with pytest.raises(ValueError) as info:
        dev.get_dtype_from_string(bad)
    for choice in ("fp32", "float32", "fp16", "float16", "half", "bf16", "bfloat16"):
        assert choice in str(info.value)


def test_dtype_not_a_string():
    with pytest.raises(TypeError, match="name"):
        dev.get_dtype_from_string(torch.float16)


# --------------------------------------------------------------------------- check_mps_limitations


def topics(findings):
    return {f.topic: f for f in findings}


def test_no_findings_off_mps():
    assert dev.check_mps_limitations("cpu", torch.float16, training=True) == []
    assert dev.check_mps_limitations(torch.device("cuda"), "bf16") == []


def test_findings_cover_every_topic(monkeypatch):
    set_backend_info(monkeypatch, {"quantize_4bit": "native"})
    found = topics(dev.check_mps_limitations("mps", "fp16", training=True))
    assert set(found) == {"bf16", "fp16_training", "compile", "distributed", "mps_fallback", "bitsandbytes"}
    assert all(f.level in ("info", "warning") for f in found.values())
    assert "NCCL" in found["distributed"].message


def test_bad_dtype_argument():
    with pytest.raises(ValueError, match="name"):
        dev.check_mps_limitations("mps", "int4")
    with pytest.raises(TypeError, match="dtype"):
        dev.check_mps_limitations("mps", 16)


@pytest.mark.parametrize(
    "mac,torch_version,status",
    [
        ("13.6.1", (2, 5), "no"),       # macOS too old
        ("14.0", (2, 2), "no"),         # torch too old
        ("14.4", (2, 3), "yes"),
        ("15.1", (2, 8), "yes"),
        ("", (2, 8), "unknown"),        # not macOS: cannot tell
    ],
)
def test_bf16_status_from_versions(monkeypatch, mac, torch_version, status):
    monkeypatch.setattr(dev, "is_mps_available", lambda: False)
    monkeypatch.setattr(dev.platform, "mac_ver", lambda: (mac, ("", "", ""), "arm64" if mac else ""))
    monkeypatch.setattr(dev, "_torch_version", lambda: torch_version)
    assert dev.mps_bf16_support()[0] == status
    found = topics(dev.check_mps_limitations("mps", "bf16"))
    assert found["bf16"].level == ("info" if status == "yes" else "warning")
    assert status in found["bf16"].message
    # Not asking for bf16 makes the same fact informational.
    assert topics(dev.check_mps_limitations("mps", "fp32"))["bf16"].level == "info"


def test_bf16_status_uses_a_device_op_when_mps_is_present(monkeypatch):
    # "MPS is available" is mocked but the bf16 op really runs and fails here: that must read "no".
    monkeypatch.setattr(dev, "is_mps_available", lambda: True)
    monkeypatch.setattr(dev, "_torch_version", lambda: (2, 8))
    status, reason = dev.mps_bf16_support()
    assert status == "no" and "bf16 computation on mps failed" in reason


@pytest.mark.mps
@pytest.mark.skipif(not dev.is_mps_available(), reason="needs an Apple Silicon mps device")
def test_bf16_status_on_hardware():
    expected = "yes" if torch.backends.mps.is_macos_or_newer(14, 0) and dev._torch_version() >= (2, 3) else "no"
    assert dev.mps_bf16_support()[0] == expected


@pytest.mark.parametrize("version,has_scaler", [((2, 7), False), ((2, 8), True), ((2, 13), True)])
def test_fp16_training_warning(monkeypatch, version, has_scaler):
    monkeypatch.setattr(dev, "_torch_version", lambda: version)
    training = topics(dev.check_mps_limitations("mps", torch.float16, training=True))
    assert training["fp16_training"].level == "warning"
    assert ("needs torch >= 2.8" in training["fp16_training"].message) is (not has_scaler)
    inference = topics(dev.check_mps_limitations("mps", torch.float16, training=False))
    assert inference["fp16_training"].level == "info"
    assert "fp16_training" not in topics(dev.check_mps_limitations("mps", torch.float32, training=True))


@pytest.mark.parametrize(
    "version,level,phrase",
    [((2, 3), "warning", "no MPS code generator"), ((2, 6), "warning", "no MPS code generator"),
     ((2, 7), "warning", "prototype"), ((2, 8), "info", "Measure"), ((2, 13), "info", "Measure")],
)
def test_compile_finding_by_torch_version(monkeypatch, version, level, phrase):
    monkeypatch.setattr(dev, "_torch_version", lambda: version)
    found = topics(dev.check_mps_limitations("mps", "fp32"))["compile"]
    assert found.level == level and phrase in found.message
    assert f"{version[0]}.{version[1]}" in found.message


def test_mps_fallback_env(monkeypatch):
    unset = topics(dev.check_mps_limitations("mps", "fp32"))["mps_fallback"].message
    assert "not set" in unset
    monkeypatch.setenv("PYTORCH_ENABLE_MPS_FALLBACK", "1")
    set_ = topics(dev.check_mps_limitations("mps", "fp32"))["mps_fallback"].message
    assert "PYTORCH_ENABLE_MPS_FALLBACK=1" in set_ and "not set" not in set_
    monkeypatch.setenv("PYTORCH_ENABLE_MPS_FALLBACK", "0")
    assert "not set" in topics(dev.check_mps_limitations("mps", "fp32"))["mps_fallback"].message


def test_bitsandbytes_all_on_gpu(monkeypatch):
    set_backend_info(monkeypatch, {"quantize_4bit": "native", "gemv_4bit": "shader"})
    found = topics(dev.check_mps_limitations("mps", "fp32"))["bitsandbytes"]
    assert found.level == "info" and "all 2" in found.message


def test_bitsandbytes_some_on_cpu(monkeypatch):
    set_backend_info(
        monkeypatch,
        {"quantize_4bit": "native", "gemv_4bit": "emulated", "optimizer_update_8bit_blockwise": "cpu"},
    )
    found = topics(dev.check_mps_limitations("mps", "fp32"))["bitsandbytes"]
    assert found.level == "warning"
    assert "2 of 3" in found.message
    assert "gemv_4bit: emulated (reason for gemv_4bit)" in found.message
    assert "optimizer_update_8bit_blockwise: cpu" in found.message
    assert "quantize_4bit" not in found.message


@pytest.mark.parametrize("how", ["missing", "raises"])
def test_bitsandbytes_info_unavailable(monkeypatch, how):
    if how == "missing":
        monkeypatch.delattr(bnb_mps, "backend_info", raising=False)
    else:
        def broken():
            raise OSError("library failed to load")

        monkeypatch.setattr(bnb_mps, "backend_info", broken, raising=False)
    found = topics(dev.check_mps_limitations("mps", "fp32"))["bitsandbytes"]
    assert found.level == "warning"
    assert "unavailable" in found.message and "CPU fallback" in found.message


def test_bitsandbytes_is_imported_when_no_op_is_known_yet(monkeypatch):
    # backend_info() lists bitsandbytes' ops, which exist once bitsandbytes is imported.
    fake_bnb = types.ModuleType("bitsandbytes")
    answers = iter([{}, {"gemv_4bit": {"tier": "shader", "reason": "torch.mps.compile_shader"}}])
    monkeypatch.setattr(bnb_mps, "backend_info", lambda: next(answers), raising=False)
    monkeypatch.setitem(sys.modules, "bitsandbytes", fake_bnb)
    found = topics(dev.check_mps_limitations("mps", "fp32"))["bitsandbytes"]
    assert found.level == "info" and "all 1" in found.message


def test_findings_are_logged_only_with_a_logger(caplog):
    log = logging.getLogger("test_device.findings")
    with caplog.at_level(logging.INFO):
        quiet = dev.check_mps_limitations("mps", "fp16", training=True)
    assert not [r for r in caplog.records if r.name == log.name]
    with caplog.at_level(logging.INFO, logger=log.name):
        findings = dev.check_mps_limitations("mps", "fp16", training=True, logger=log)
    records = [r for r in caplog.records if r.name == log.name]
    assert [r.getMessage() for r in records] == [str(f) for f in findings]
    assert [r.levelno for r in records] == [
        logging.WARNING if f.level == "warning" else logging.INFO for f in findings
    ]
    assert quiet == findings


# --------------------------------------------------------------------------- dataloader_kwargs


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.tensor([float(i * i)])


def test_dataloader_kwargs_per_device():
    cpus = os.cpu_count() or 1
    assert dev.dataloader_kwargs("mps") == {"num_workers": 0, "pin_memory": False, "persistent_workers": False}
    assert dev.dataloader_kwargs("mps", num_workers=2) == {
        "num_workers": 2, "pin_memory": False, "persistent_workers": True,
    }
    cuda = dev.dataloader_kwargs("cuda:0")
    assert cuda["pin_memory"] is True and cuda["num_workers"] == min(4, cpus)
    cpu = dev.dataloader_kwargs(torch.device("cpu"))
    assert cpu["pin_memory"] is False and cpu["num_workers"] == min(2, cpus)
    assert dev.dataloader_kwargs("cuda", num_workers=0)["persistent_workers"] is False


@pytest.mark.parametrize("device", ["cpu", "mps", "cuda"])
@pytest.mark.parametrize("workers", [None, 0, 2])
def test_dataloader_accepts_the_kwargs(device, workers):
    # DataLoader itself rejects persistent_workers without workers: it is the reference.
    kwargs = dev.dataloader_kwargs(device, num_workers=workers)
    torch.utils.data.DataLoader(Squares(), batch_size=4, **kwargs)
    assert kwargs["persistent_workers"] == (kwargs["num_workers"] > 0)


def test_dataloader_kwargs_load_all_data():
    kwargs = dev.dataloader_kwargs("cpu", num_workers=0)
    loader = torch.utils.data.DataLoader(Squares(), batch_size=4, **kwargs)
    assert torch.cat(list(loader)).flatten().tolist() == [float(i * i) for i in range(10)]


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_dataloader_kwargs_bad_workers(bad):
    with pytest.raises(ValueError, match="num_workers"):
        dev.dataloader_kwargs("cpu", num_workers=bad)


# --------------------------------------------------------------------------- training_config


def _training_arguments_names():
    """Field names of transformers.TrainingArguments and its optimizer names, read from the
    source with ast (importing transformers.training_args loads bitsandbytes: seconds)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None:
        extras.missing("transformers")
    path = os.path.join(spec.submodule_search_locations[0], "training_args.py")
    tree = ast.parse(open(path, encoding="utf-8").read())
    fields, optims = set(), set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "TrainingArguments":
            fields |= {s.target.id for s in node.body if isinstance(s, ast.AnnAssign)}
        if isinstance(node, ast.ClassDef) and node.name == "OptimizerNames":
            for s in node.body:
                if isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant):
                    optims.add(s.value.value)
    assert fields and optims, "could not read TrainingArguments from the transformers source"
    return fields, optims


KEYS = {"optim", "fp16", "bf16", "dataloader_pin_memory", dev.checkpointing_field(), "gradient_accumulation_steps"}


def test_checkpointing_goes_by_the_name_the_installed_transformers_takes(tmp_path):
    """transformers 5.24 deprecates `gradient_checkpointing` (a FutureWarning now, an error in v6):
    the config's fields build TrainingArguments with warnings as errors, on every device."""
    import warnings

    transformers = extras.require("transformers")
    field = dev.checkpointing_field()
    assert field == "activation_checkpointing"  # (constraints.txt pins transformers 5.24)
    cfg = dev.training_config("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = transformers.TrainingArguments(output_dir=str(tmp_path), **cfg)
    assert args.activation_checkpointing is False
    mps = {**dev.training_config("mps"), "bf16": False, "optim": "adamw_torch"}  # (no bf16 CPU here)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = transformers.TrainingArguments(output_dir=str(tmp_path), **mps)
    assert args.activation_checkpointing is True and args.gradient_accumulation_steps == 4


def test_training_config_cpu():
    cfg = dev.training_config("cpu")
    assert set(cfg) == KEYS
    assert cfg["optim"] == "adamw_torch" and not cfg["fp16"] and not cfg["bf16"]
    assert cfg["dataloader_pin_memory"] is False


def test_training_config_fields_exist_in_transformers(monkeypatch, fake_cuda):
    fields, optims = _training_arguments_names()
    set_backend_info(monkeypatch, {"optimizer_update_8bit_blockwise": "native"})
    monkeypatch.setattr(dev, "_bitsandbytes_importable", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    for device in ("cpu", "mps", "cuda"):
        cfg = dev.training_config(device)
        assert set(cfg) <= fields
        assert cfg["optim"] in optims
        assert isinstance(cfg["gradient_accumulation_steps"], int) and cfg["gradient_accumulation_steps"] >= 1


@pytest.mark.parametrize(
    "tier,paged,optim",
    [("native", True, "paged_adamw_8bit"), ("shader", True, "paged_adamw_8bit"),
     ("native", False, "adamw_bnb_8bit"), ("shader", False, "adamw_bnb_8bit"),
     ("emulated", True, "adamw_torch"), ("cpu", True, "adamw_torch"), ("cpu", False, "adamw_torch")],
)  # fmt: skip
def test_training_config_mps_optimizer_follows_tier(monkeypatch, tier, paged, optim):
    set_backend_info(monkeypatch, {"optimizer_update_8bit_blockwise": tier, "quantize_4bit": "native"})
    monkeypatch.setattr(dev, "_paged_optimizers_on_mps", lambda: paged)
    cfg = dev.training_config("mps")
    assert cfg["optim"] == optim
    assert cfg["fp16"] is False and cfg["dataloader_pin_memory"] is False
    assert cfg[dev.checkpointing_field()] is True and cfg["gradient_accumulation_steps"] > 1


def test_paged_optimizers_on_mps_follows_the_hook():
    from bnb_mps import paged

    import bitsandbytes  # noqa: F401  (registers bnb_mps, which installs the hook)

    assert dev._paged_optimizers_on_mps() is paged.installed() is True
    bnb_mps.unregister()
    try:
        assert dev._paged_optimizers_on_mps() is False
    finally:
        bnb_mps.register()


def test_training_config_mps_without_backend_info(monkeypatch):
    monkeypatch.delattr(bnb_mps, "backend_info", raising=False)
    assert dev.training_config("mps")["optim"] == "adamw_torch"
    set_backend_info(monkeypatch, {"quantize_4bit": "native"})  # optimizer op not reported
    assert dev.training_config("mps")["optim"] == "adamw_torch"


@pytest.mark.parametrize(
    "bf16_status,version,expected",
    [("yes", (2, 6), True), ("yes", (2, 5), False), ("no", (2, 8), False), ("unknown", (2, 8), False)],
)
def test_training_config_mps_bf16(monkeypatch, bf16_status, version, expected):
    monkeypatch.setattr(dev, "mps_bf16_support", lambda: (bf16_status, "mocked"))
    monkeypatch.setattr(dev, "_torch_version", lambda: version)
    assert dev.training_config("mps")["bf16"] is expected


@pytest.mark.parametrize("importable,optim", [(True, "adamw_bnb_8bit"), (False, "adamw_torch")])
@pytest.mark.parametrize("bf16", [True, False])
def test_training_config_cuda(monkeypatch, fake_cuda, importable, optim, bf16):
    monkeypatch.setattr(dev, "_bitsandbytes_importable", lambda: importable)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    cfg = dev.training_config("cuda")
    assert cfg["optim"] == optim
    assert cfg["bf16"] is bf16 and cfg["fp16"] is (not bf16)
    assert cfg["dataloader_pin_memory"] is True


def test_bitsandbytes_importable_detects_absence(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` fail
    assert dev._bitsandbytes_importable() is False
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))
    assert dev._bitsandbytes_importable() is True


# --------------------------------------------------------------------------- OOM detection


MPS_OOM = (
    "MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.20 GB, max allowed: "
    "18.13 GB). Tried to allocate 256.00 MB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 "
    "to disable upper limit for memory allocations (may cause system failure)."
)


def test_real_cpu_allocation_error_is_oom():
    with pytest.raises(RuntimeError) as info:
        cpu_oom()
    assert dev.is_out_of_memory(info.value)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError(MPS_OOM),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        torch.cuda.OutOfMemoryError("CUDA out of memory."),
        RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 123 bytes."),
        MemoryError(),
    ],
)
def test_oom_kinds(exc):
    assert dev.is_out_of_memory(exc)


@pytest.mark.parametrize(
    "exc",
    [RuntimeError("mat1 and mat2 shapes cannot be multiplied"), ValueError("out of memory"), KeyError("x")],
)
def test_not_oom(exc):
    assert not dev.is_out_of_memory(exc)


# --------------------------------------------------------------------------- find_max_batch_size


class Capacity:
    """A step that fits up to `capacity` samples; beyond that the real CPU allocator fails."""

    def __init__(self, capacity, error=cpu_oom):
        self.capacity, self.error, self.calls = capacity, error, []

    def __call__(self, batch_size):
        self.calls.append(batch_size)
        if batch_size > self.capacity:
            self.error()
        return torch.ones(batch_size).sum()


@settings(max_examples=300, deadline=None)
@given(
    capacity=st.integers(0, 5000),
    start=st.integers(1, 64),
    limit=st.one_of(st.none(), st.integers(1, 6000)),
)
def test_search_finds_the_largest_fitting_size(capacity, start, limit):
    if limit is not None and limit < start:
        limit = start
    calls = []

    def fits(n):
        calls.append(n)
        return n <= capacity

    got = dev._largest_fitting(fits, start, limit)
    expected = 0 if capacity < start else (capacity if limit is None else min(capacity, limit))
    assert got == expected
    assert limit is None or max(calls) <= limit
    # Doubling then bisection: logarithmic in the answer, never a linear scan.
    assert len(calls) <= 2 * max(expected, start).bit_length() + 4


@pytest.mark.parametrize(
    "capacity,start,limit,expected",
    [(1, 1, None, 1), (40, 8, None, 40), (5000, 8, 300, 300), (8, 8, 8, 8)],
)
def test_finds_the_largest_size_with_real_allocation_errors(capacity, start, limit, expected):
    step = Capacity(capacity)
    assert dev.find_max_batch_size(step, start=start, limit=limit) == expected
    assert max(step.calls) <= (limit or float("inf"))
    assert capacity + 1 in step.calls or limit is not None and limit <= capacity


def test_start_that_fails_returns_zero(caplog):
    with caplog.at_level(logging.WARNING, logger="bnb_mps.device"):
        assert dev.find_max_batch_size(Capacity(3), start=8) == 0
    assert "returning 0" in caplog.text


@pytest.mark.parametrize(
    "error",
    [
        lambda: (_ for _ in ()).throw(RuntimeError(MPS_OOM)),
        lambda: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory.")),
        lambda: (_ for _ in ()).throw(MemoryError()),
    ],
    ids=["mps", "cuda", "MemoryError"],
)
def test_every_backend_oom_counts_as_failure(error):
    assert dev.find_max_batch_size(Capacity(11, error), start=4) == 11


def test_other_errors_are_reraised():
    def shape_bug():
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)")

    with pytest.raises(RuntimeError, match="shapes"):
        dev.find_max_batch_size(Capacity(10, shape_bug), start=4)
    with pytest.raises(ValueError, match="bad"):
        dev.find_max_batch_size(lambda bs: (_ for _ in ()).throw(ValueError("bad")), start=4)


def test_caches_are_freed_between_tries(monkeypatch):
    freed = []
    monkeypatch.setattr(dev, "is_mps_available", lambda: True)
    monkeypatch.setattr(torch.mps, "empty_cache", lambda: freed.append(True))
    step = Capacity(11)
    assert dev.find_max_batch_size(step, start=4, device="mps") == 11
    assert len(freed) == len(step.calls)


def test_freeing_never_fails_on_cpu():
    dev._free_memory(None, collect=True)
    dev._free_memory(torch.device("cpu"), collect=False)
    assert dev.find_max_batch_size(Capacity(9), start=2, device="cpu") == 9


@pytest.mark.parametrize(
    "kwargs,exc,name",
    [
        ({"start": 0}, ValueError, "start"),
        ({"start": 2.0}, ValueError, "start"),
        ({"start": 8, "limit": 4}, ValueError, "limit"),
        ({"device": "abacus"}, ValueError, "device"),
    ],
)
def test_find_max_batch_size_bad_arguments(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        dev.find_max_batch_size(Capacity(10), **kwargs)
    with pytest.raises(TypeError, match="step_fn"):
        dev.find_max_batch_size(42)


# --------------------------------------------------------------------------- memory_stats


def test_memory_stats_cpu_reports_nothing():
    assert dev.memory_stats("cpu") == {
        "device": "cpu", "allocated": None, "driver_allocated": None, "recommended_max": None,
    }


def test_memory_stats_mps(monkeypatch):
    monkeypatch.setattr(dev, "is_mps_available", lambda: True)
    monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: 1000)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 4096)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 1 << 34)
    assert dev.memory_stats("mps") == {
        "device": "mps", "allocated": 1000, "driver_allocated": 4096, "recommended_max": 1 << 34,
    }


@pytest.mark.mps
@pytest.mark.skipif(not dev.is_mps_available(), reason="needs an Apple Silicon mps device")
def test_memory_stats_track_an_allocation_on_hardware():
    before = dev.memory_stats("mps")["allocated"]
    x = torch.empty(1 << 20, dtype=torch.float32, device="mps")
    after = dev.memory_stats("mps")
    assert after["allocated"] - before >= x.numel() * 4
    assert after["recommended_max"] > 0
