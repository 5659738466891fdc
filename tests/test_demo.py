"""`python -m bnb_mps demo`: QLoRA end to end, and its report checked against independent counts.

The demo runs in this process with the smallest settings (a tiny Llama, a few steps, short
samples). What its summary claims is checked against what can be known without it: bitsandbytes
op calls counted by PyTorch's profiler (which sees every dispatcher call, nested ones included),
weight bytes computed from the model config and the 4-bit format, the corpus' alphabet.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import extras
import pytest
import torch

transformers = extras.require("transformers")
extras.require("peft")
extras.require("matplotlib")
extras.require("tqdm")  # (the kernel check's progress bar)

import bitsandbytes  # noqa: E402,F401  (defines the ops)

from bnb_mps import executors, ops, registration  # noqa: E402
from bnb_mps.__main__ import main as cli  # noqa: E402
from bnb_mps.demo import Options, check, data, qlora, run  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::bnb_mps.executors.SlowTierWarning")

QUANT_OPS = {"quantize_4bit", "quantize_blockwise", "dequantize_4bit", "dequantize_blockwise"}
BNB_MPS_TIERS = {"native", "shader", "emulated", "cpu"}  # tiers where bnb-mps' op layer serves every call
SMALLEST = dict(size="tiny", batch_size=4, seq_len=64, max_new_tokens=12, quiet=True)


def _in_cpu_round_trip(event) -> bool:
    """Whether a profiler event is, or runs inside, the CPU round trip's call of an op: bnb-mps'
    round trip calls the same op again on CPU copies, so that call's parent has its name."""
    while event is not None:
        if event.cpu_parent is not None and event.cpu_parent.name == event.name:
            return True
        event = event.cpu_parent
    return False


@contextlib.contextmanager
def bitsandbytes_calls():
    """Counts of bitsandbytes op calls (by schema base name), from PyTorch's profiler, which sees
    every call through the dispatcher, nested ones included, but not the redispatch of a handed-back
    op. Calls inside a CPU round trip (on CPU copies, made by bitsandbytes' CPU code) are left out."""
    counts: Counter = Counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield counts
    counts.update(e.name.split("::", 1)[1] for e in prof.events()
                  if e.name.startswith("bitsandbytes::") and not _in_cpu_round_trip(e))  # fmt: skip


def demo_run(tmp_path_factory, name, device=None, **settings):
    out = tmp_path_factory.mktemp(name)
    stdout = out / "stdout.txt"
    threads = torch.get_num_threads()
    with bitsandbytes_calls() as calls, open(stdout, "w") as f:
        summary = run(Options(out=str(out), device=device, **{**SMALLEST, **settings}), stdout=f)
    assert torch.get_num_threads() == threads  # the demo's thread setting does not leak
    return summary, out, calls, stdout.read_text()


@pytest.fixture(scope="module")
def check_inputs() -> dict:
    """What the cpu run's kernel check was given (the trained model, the evaluation batch, the prompt,
    the stock sample), kept to recompute the check's figures outside the demo."""
    return {}


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory, check_inputs):
    real = check.emulated_check

    def keep(model, eval_ids, prompt, stock_sample, suppress, pad_token_id, **kwargs):
        check_inputs.update(model=model, eval_ids=eval_ids, prompt=prompt, stock_sample=stock_sample,
                            suppress=suppress, pad_token_id=pad_token_id)  # fmt: skip
        return real(model, eval_ids, prompt, stock_sample, suppress, pad_token_id, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(check, "emulated_check", keep)
        return demo_run(tmp_path_factory, "cpu", device="cpu", steps=6)


@pytest.fixture(scope="module")
def emulated_run(tmp_path_factory):
    pytest.importorskip("bnb_mps._emu")
    return demo_run(tmp_path_factory, "emulated", kernels="emulated", steps=3, max_new_tokens=4, seq_len=32,
                    kernel_check=False)  # fmt: skip


def tiny_config() -> transformers.LlamaConfig:
    shape = qlora.SIZES["tiny"]
    vocab = len(data.SPECIAL_TOKENS) + len(set(data.corpus_text()))
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    return transformers.LlamaConfig(vocab_size=vocab, tie_word_embeddings=False, **{k: shape[k] for k in keys})


def expected_weight_bytes(config, dtype_bytes: int) -> tuple[int, int, int]:
    """(weight bytes in 4-bit NF4 with double quantization, in fp16, number of 4-bit layers), from
    the format: per 4-bit layer of n weights, n/2 bytes of codes, one uint8 absmax per block of 64,
    the 16-entry NF4 code, and the nested quantization's fp32 absmax per 256 blocks, its 256-entry
    code and its offset; every other parameter (embeddings, norms, output head) at its dtype."""
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    four_bit = fp16 = layers = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            n = module.weight.numel()
            blocks = math.ceil(n / 64)
            four_bit += math.ceil(n / 2) + blocks + 16 * 4 + 4 * math.ceil(blocks / 256) + 256 * 4 + 4
            layers += 1
            assert module.bias is None
        else:
            four_bit += sum(p.numel() * dtype_bytes for p in module.parameters(recurse=False))
    fp16 = 2 * sum(p.numel() for p in model.parameters())
    return four_bit, fp16, layers


# -- the run on the CPU device: bitsandbytes' own CPU code --------------------------------------------


def test_cpu_run_trains_and_writes_what_it_reports(cpu_run):
    summary, out, calls, stdout = cpu_run
    assert json.loads((out / "summary.json").read_text(encoding="utf-8")) == summary
    for key in ("device", "loss", "tokens_per_second", "weight_bytes_4bit", "weight_bytes_fp16", "ops"):
        assert key in summary
    assert summary["device"] == "cpu" and summary["kernels"] == "auto"

    losses = summary["loss"]
    assert len(losses) == summary["steps"] == 6 and all(math.isfinite(x) for x in losses)
    assert (losses[0], losses[-1]) == (summary["loss_first"], summary["loss_last"])
    # A random model starts near ln(vocabulary) nats per character; training must bring it down.
    assert losses[0] == pytest.approx(math.log(tiny_config().vocab_size), abs=0.3)
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses

    assert summary["tokens_per_step"] == 4 * 64 * summary["gradient_accumulation_steps"]
    assert summary["tokens_per_second"] == pytest.approx(6 * summary["tokens_per_step"] / summary["train_seconds"])
    assert summary["optimizer"]["name"] == "adamw_bnb_8bit" and "paged" in summary["optimizer"]["note"]

    alphabet = set(data.corpus_text())
    for sample in (summary["sample_before"], summary["sample_after"]):
        assert sample.startswith(qlora.PROMPT) and len(sample) == len(qlora.PROMPT) + 12
        assert set(sample) <= alphabet
    assert summary["sample_before"] != summary["sample_after"]

    for needle in ("sample before training:", "sample after training:", "summary", "tokens/s", "weights",
                   f"{losses[0]:.3f} (step 1) -> {losses[-1]:.3f} (step 6)"):  # fmt: skip
        assert needle in stdout


def test_cpu_run_memory_figures_match_the_models_parameters(cpu_run):
    summary = cpu_run[0]
    assert summary["compute_dtype"] == "float32"
    four_bit, fp16, _ = expected_weight_bytes(tiny_config(), dtype_bytes=4)
    assert summary["parameters"] * 2 == fp16 == summary["weight_bytes_fp16"]
    assert summary["weight_bytes_4bit"] == four_bit


def test_cpu_run_reports_that_bitsandbytes_served_its_ops_unseen(cpu_run):
    summary, _, calls, stdout = cpu_run
    layers = expected_weight_bytes(tiny_config(), 4)[2]
    # bitsandbytes' ops did run (its CPU kernels: bnb-mps serves mps tensors)...
    assert calls["quantize_4bit"] == layers and calls["gemm_4bit"] > 0 and calls["optimizer_update_8bit_blockwise"]
    # ...and none passed through bnb-mps' op layer, which is what the summary says.
    assert summary["ops"] == {}
    assert any("not counted" in n or "none was counted" in n for n in summary["ops_notes"])
    assert "none passed through bnb-mps" in stdout


def test_loss_plot_holds_the_curve(cpu_run):
    from matplotlib.image import imread

    out = cpu_run[1]
    png = out / "demo_loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(png)
    assert image.shape[:2] == (400, 640)
    # The curve is drawn in matplotlib's first colour (#1f77b4); markers for <= 30 steps.
    line = (abs(image[..., 0] - 0x1F / 255) < 0.02) & (abs(image[..., 1] - 0x77 / 255) < 0.02) & (
        abs(image[..., 2] - 0xB4 / 255) < 0.02
    )
    assert line.sum() > 100
    # Left to right it goes down, as the loss does: the first drawn column sits higher than the last.
    cols = [c for c in range(image.shape[1]) if line[:, c].any()]
    first_row = line[:, cols[0]].nonzero()[0].mean()
    last_row = line[:, cols[-1]].nonzero()[0].mean()
    assert first_row < last_row


# -- --kernels emulated: bnb-mps' Metal kernels under the emulator --------------------------------------


def test_emulated_kernels_serve_the_4bit_ops_and_the_counts_are_exact(emulated_run):
    summary, out, calls, stdout = emulated_run
    assert summary["kernels"] == "emulated" and summary["device"] == "cpu"
    assert QUANT_OPS <= set(summary["ops"])
    by_base: Counter = Counter()
    for name, row in summary["ops"].items():
        assert row["tier"] == "emulated" and "emulator" in row["served_by"], (name, row)
        by_base[name.split(".")[0]] += row["calls"]
    for base, n in by_base.items():
        assert n == calls[base], (base, n, calls[base])
    layers = expected_weight_bytes(tiny_config(), 4)[2]
    assert summary["ops"]["quantize_4bit"]["calls"] == layers  # one per 4-bit layer, at load
    # Every bitsandbytes op the run called (the profiler's count) went through bnb-mps' kernels:
    # the 4-bit forward (gemm_4bit) and the optimizer update included.
    assert {"gemm_4bit", "optimizer_update_8bit_blockwise"} <= set(summary["ops"])
    assert set(by_base) == {base for base, n in calls.items() if n}

    losses = summary["loss"]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.1, losses
    assert "emulator" in stdout and "quantize_4bit" in stdout
    assert (out / "demo_loss.png").exists()
    assert "CPU" not in registration.registered_keys()  # the emulated tier is gone after the run


# -- the kernel check: the trained model again on bnb-mps' kernels, against a recomputation ---------------

CHECK_KEYS = {"tier", "ops", "kernels", "max_abs_logit_diff", "max_rel_logit_diff", "loss_stock", "loss_kernels",
              "same_tokens", "seconds", "bound"}  # fmt: skip


@dataclass
class Recomputed:
    """The check's runs repeated here, with the test's own code: the stock run (bitsandbytes' CPU
    code) and the kernel run (bnb-mps' kernels under the emulator) of the evaluation batch and the
    greedy sample, and every 4-bit product of the kernel run against docs/semantics.md's reference."""

    loss_stock: float
    loss_kernels: float
    logits_stock: torch.Tensor
    logits_kernels: torch.Tensor
    tokens_stock: torch.Tensor
    tokens_kernels: torch.Tensor
    steps_stock: torch.Tensor  # [tokens, vocabulary]: the logits each greedy token was chosen from
    steps_kernels: torch.Tensor
    launched: set
    products: int = 0
    values: int = 0
    values_beyond: int = 0
    worst_units: float = 0.0


def _greedy(model, inputs, n, suppress, pad_token_id):
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, suppress_tokens=suppress,
                             pad_token_id=pad_token_id, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    return out.sequences[0, inputs["input_ids"].shape[1] :], torch.cat(out.logits).float()


def _forward(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    return float(out.loss), out.logits.float()


@contextlib.contextmanager
def measured_products(model, into: Recomputed):
    """Forward hooks on the 4-bit layers: each product against the float64 product of the weight
    dequantized as docs/semantics.md section 3 says (tests/reference_matmul_4bit), in units of
    2^-24 * sum |a*w|; more than fp32_units(K) counts as beyond the section 4 target."""
    import bitsandbytes as bnb
    import reference_matmul_4bit as R

    weights = {}
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            qs = m.weight.quant_state
            weights[m] = R.dequantized_weight(m.weight.data, qs.shape, qs.blocksize, qs.quant_type, qs.state2.absmax,
                                              qs.absmax, qs.state2.code, qs.offset)  # fmt: skip

    def hook(m, inputs, y):
        x = inputs[0].detach()
        W = weights[m]
        units = np.abs(y.detach().double().numpy() - R.matmul(x, W)) / (R.UNIT * R.magnitude(x, W))
        into.products += 1
        into.values += units.size
        into.values_beyond += int((units > R.fp32_units(x.shape[-1])).sum())
        into.worst_units = max(into.worst_units, float(units.max()))

    handles = [m.register_forward_hook(hook) for m in weights]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@pytest.fixture(scope="module")
def recomputed(cpu_run, check_inputs) -> Recomputed:
    from bnb_mps.testing import use_emulated_kernels

    summary = cpu_run[0]
    if "skipped" in summary["kernel_check"]:
        pytest.importorskip("bnb_mps._emu")  # no emulator here: the check had to skip (tested below)
        pytest.fail(f"the kernel check did not run: {summary['kernel_check']['skipped']}")
    c = check_inputs
    model, ids, prompt, n = c["model"], c["eval_ids"], c["prompt"], len(c["stock_sample"].tokens)
    threads = torch.get_num_threads()
    torch.set_num_threads(summary["cpu_threads"])  # as in the demo: the CPU's float sums depend on it
    try:
        model.eval()
        loss_s, logits_s = _forward(model, ids)
        tokens_s, steps_s = _greedy(model, prompt, n, c["suppress"], c["pad_token_id"])
        with use_emulated_kernels() as kernels:
            got = Recomputed(loss_s, math.nan, logits_s, None, tokens_s, None, steps_s, None, set())
            with measured_products(model, got):
                got.loss_kernels, got.logits_kernels = _forward(model, ids)
                got.tokens_kernels, got.steps_kernels = _greedy(model, prompt, n, c["suppress"], c["pad_token_id"])
        got.launched = set(kernels.launched)
    finally:
        torch.set_num_threads(threads)
    return got


def test_kernel_check_reports_the_kernels_that_served(cpu_run, recomputed):
    summary, out, _, stdout = cpu_run
    kc = summary["kernel_check"]
    assert set(kc) == CHECK_KEYS and kc["tier"] == "emulated"
    assert json.loads((out / "summary.json").read_text(encoding="utf-8"))["kernel_check"] == kc
    # One 4-bit product per 4-bit layer and forward: the evaluation batch, then one forward per greedy token.
    layers = expected_weight_bytes(tiny_config(), 4)[2]
    assert kc["ops"] == {"gemm_4bit": layers * (1 + 12)}
    # The kernels the recomputation launched (the batch's mma path and the decode's gemv path), all of
    # them kernels of the project's library.
    from bnb_mps.executors import emulated

    assert set(kc["kernels"]) == recomputed.launched <= set(emulated.unit_libraries().kernels)
    assert any("mma" in k for k in kc["kernels"]) and any("gemv" in k for k in kc["kernels"])
    assert 0 < kc["seconds"] < 600
    for needle in ("kernel check", "gemm_4bit", kc["kernels"][0], f"{kc['loss_stock']:.6f} stock",
                   check.SOURCE, "allowed"):  # fmt: skip
        assert needle in stdout


def test_kernel_check_figures_match_their_recomputation(cpu_run, check_inputs, recomputed):
    """The stock forward and the kernels' own forward, repeated outside the demo, give the losses,
    tokens and logit differences the summary reports, bit for bit (same model, inputs and threads)."""
    summary = cpu_run[0]
    kc, r = summary["kernel_check"], recomputed
    assert (kc["loss_stock"], kc["loss_kernels"]) == (r.loss_stock, r.loss_kernels)
    # the check's stock sample is the summary's "after training" sample, greedy
    tok = data.char_tokenizer(data.corpus_text())
    assert summary["sample_after"] == qlora.PROMPT + tok.decode(r.tokens_stock)
    assert torch.equal(check_inputs["stock_sample"].tokens, r.tokens_stock)
    assert kc["same_tokens"] == torch.equal(r.tokens_kernels, r.tokens_stock)
    assert kc["same_tokens"], "the kernels' greedy sample differs from the stock one"
    d_eval = (r.logits_kernels.double() - r.logits_stock.double()).abs()
    d_steps = (r.steps_kernels.double() - r.steps_stock.double()).abs()
    assert kc["max_abs_logit_diff"] == max(d_eval.max().item(), d_steps.max().item())
    rel = [(d.amax(-1) / want.double().abs().amax(-1)).max().item()
           for d, want in ((d_eval, r.logits_stock), (d_steps, r.steps_stock))]  # fmt: skip
    assert kc["max_rel_logit_diff"] == pytest.approx(max(rel), rel=1e-12)
    assert kc["max_abs_logit_diff"] > 0  # two float32 summation orders: some logit differs somewhere
    assert abs(kc["loss_kernels"] - kc["loss_stock"]) <= 1e-5 * kc["loss_stock"]


def test_kernel_check_bound_is_docs_semantics_section_4(cpu_run, check_inputs, recomputed):
    """Every 4-bit product of the kernel run, measured here against the section 3 weight: the figures
    of the bound; the logit difference lies within the allowed one, whose size a perturbation made
    here confirms; the greedy gap is the stock sample's."""
    import reference_matmul_4bit as R

    b, r = cpu_run[0]["kernel_check"]["bound"], recomputed
    kc = cpu_run[0]["kernel_check"]
    assert b["source"] == "docs/semantics.md section 4" and b["compute_dtype"] == "float32"
    assert b["product_units"] == R.fp32_units(tiny_config().intermediate_size) == 5
    assert (b["products_measured"], b["values_measured"], b["values_beyond"]) == (r.products, r.values,
                                                                                  r.values_beyond)  # fmt: skip
    assert b["max_product_units"] == pytest.approx(r.worst_units, rel=1e-9)
    assert 0 < r.worst_units and r.values_beyond == 0  # within section 4's target
    # the claim the check makes: the logits differ by no more than the stated accuracy explains
    assert b["logits_within"] is True
    assert kc["max_abs_logit_diff"] <= b["max_abs_logit_diff"] and kc["max_rel_logit_diff"] <= b["max_rel_logit_diff"]
    # The allowed difference is what products off by 5 units of 2^-24 * sum |a*w| make of the logits: an own
    # perturbation (random signs, its own generator) moves them by as much, within a factor of 3 (other
    # signs move them otherwise). The bound's parts are pinned by tests/test_demo_check.py: the error
    # per product, the perturbation's signs and size, the largest of the draws, the verdicts.
    moved = perturbed_logits(check_inputs["model"], check_inputs["eval_ids"], cpu_run[0]["cpu_threads"])
    own = (moved.double() - r.logits_stock.double()).abs().max().item()
    assert own / 3 <= b["max_abs_logit_diff"] <= 3 * own, (own, b["max_abs_logit_diff"])
    # the greedy gap, from the stock sample's logits (special tokens are never chosen)
    allowed = r.steps_stock.clone()
    allowed[:, check_inputs["suppress"]] = -math.inf
    top2 = allowed.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert b["greedy_min_gap"] == gaps.min().item() and b["greedy_min_gap_token"] == int(gaps.argmin()) + 1


def perturbed_logits(model, ids, threads: int) -> torch.Tensor:
    """The stock forward with every 4-bit product moved by fp32_units(K) units of 2^-24 * its sum |a*w|,
    with random signs."""
    import bitsandbytes as bnb
    import reference_matmul_4bit as R

    g = np.random.default_rng(1234)

    def hook(m, inputs, y):
        qs = m.weight.quant_state
        W = R.dequantized_weight(m.weight.data, qs.shape, qs.blocksize, qs.quant_type, qs.state2.absmax, qs.absmax,
                                 qs.state2.code, qs.offset)  # fmt: skip
        x = inputs[0].detach()
        delta = R.fp32_units(x.shape[-1]) * R.UNIT * R.magnitude(x, W) * g.choice([-1.0, 1.0], size=y.shape)
        return (y.double() + torch.from_numpy(delta)).float()

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _forward(model, ids)[1]
    finally:
        torch.set_num_threads(saved)
        for h in handles:
            h.remove()


def test_kernel_check_on_the_shader_tier_through_the_model_of_torchs_mps_runtime(cpu_run, check_inputs, monkeypatch):
    """The demo's kernel check on the shader tier as a Mac runs it (bnb_mps.testing.use_modelled_mps:
    first-use verification, launch plans, torch.mps.compile_shader's kernels under the emulator):
    with tuning off, the same kernels as the emulated run's, so the same losses, logits and tokens,
    bit for bit (the emulated check of the cpu run is the reference)."""
    from bnb_mps.ops import tuning

    summary = cpu_run[0]
    if "skipped" in summary["kernel_check"]:
        pytest.importorskip("bnb_mps._emu")  # no emulator here: the check had to skip (tested above)
        pytest.fail(f"the kernel check did not run: {summary['kernel_check']['skipped']}")
    monkeypatch.setenv(tuning.ENV_VAR, "0")
    c = check_inputs
    threads = torch.get_num_threads()
    torch.set_num_threads(summary["cpu_threads"])
    try:
        got, lines = check.emulated_check(c["model"], c["eval_ids"], c["prompt"], c["stock_sample"], c["suppress"],
                                          c["pad_token_id"], quiet=True, say=lambda *a: None, tier="shader")  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    want = summary["kernel_check"]
    assert "skipped" not in got, got
    assert got["tier"] == "shader" and want["tier"] == "emulated"
    assert got["kernels"] == want["kernels"] and got["ops"] == want["ops"]
    for key in ("loss_kernels", "max_abs_logit_diff", "max_rel_logit_diff", "same_tokens"):
        assert got[key] == want[key], key
    assert got["bound"]["max_product_units"] == want["bound"]["max_product_units"]


def test_no_kernel_check_leaves_none(emulated_run):
    summary, _, _, stdout = emulated_run
    assert "kernel_check" not in summary and "kernel check" not in stdout


def test_no_kernel_check_flag():
    import argparse

    from bnb_mps import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert parser.parse_args([]).kernel_check is True and Options().kernel_check is True
    assert parser.parse_args(["--no-kernel-check"]).kernel_check is False


def test_kernel_check_says_in_one_line_that_it_cannot_run_without_a_compiler(tmp_path, fresh_tier_selection):
    """No C++ compiler: the emulator cannot build the kernels, so the check is skipped with one line (and
    never reaches the model, here a stand-in that would fail)."""
    pytest.importorskip("bnb_mps._emu")
    from bnb_mps import emulator
    from bnb_mps.emulator import build
    from bnb_mps.msl import source

    kernels = tmp_path / "kernels"
    shutil.copytree(Path(source.kernel_dir()), kernels)
    for unit in kernels.glob("*.metal"):  # another source text: every unit is compiled anew
        unit.write_text(unit.read_text() + "\n// compiled anew\n")
    fresh_tier_selection.setenv(source.KERNEL_DIR_ENV, str(kernels))

    def no_compiler(compiler=None):
        raise emulator.CompileError("no C++ compiler found (tried c++, g++, clang++); set BNB_MPS_EMU_CXX")

    fresh_tier_selection.setattr(build, "find_compiler", no_compiler)
    said: list[str] = []
    result, lines = check.emulated_check(object(), None, None, None, [], 0, quiet=True,
                                         say=lambda *lines: said.extend(lines))  # fmt: skip
    assert result == {"skipped": result["skipped"]} and "no C++ compiler found" in result["skipped"]
    assert "\n" not in result["skipped"] and len(lines) == 1 and result["skipped"] in lines[0]
    assert said[-1].strip() == f"skipped: {result['skipped']}"


def test_kernel_check_that_fails_does_not_fail_the_demo():
    pytest.importorskip("bnb_mps._emu")
    said: list[str] = []
    result, lines = check.emulated_check(object(), None, None, None, [], 0, quiet=True,
                                         say=lambda *lines: said.extend(lines))  # fmt: skip
    assert said[-1].strip() == f"skipped: {result['skipped']}"
    assert result["skipped"].startswith("the check failed: ") and len(lines) == 1


# -- the kernel check on a Mac: the first-use verification verdicts ------------------------------------------


@pytest.fixture
def emulated_verification(fresh_tier_selection, tmp_path):
    """A verification cache of its own and no verdicts in memory; the emulated tier stands for a Mac's."""
    from bnb_mps.ops import verify

    pytest.importorskip("bnb_mps._emu")
    fresh_tier_selection.setenv(verify.CACHE_ENV_VAR, str(tmp_path / "verify.json"))
    fresh_tier_selection.delenv(verify.ENV_VAR, raising=False)
    verify.reset()
    yield fresh_tier_selection
    verify.reset()


def test_gpu_verdicts_are_those_of_first_use(emulated_verification):
    """The verdicts of the families behind the ops the run used, as first use made them (run, then
    read from the cache in a later process), with their lines in the summary."""
    from bnb_mps.ops import verify

    executor = executors.load_tier("emulated")
    used = ["quantize_4bit", "dequantize_4bit", "gemm_4bit"]
    first = check.gpu_verdicts("emulated", executor, used)
    # (the emulated tier compiles Metal 3.1: the two-dispatch split-K; the one-dispatch kernel does not exist)
    families = ["nf4_fp4", "matmul_4bit_gemv", "matmul_4bit_small", "matmul_4bit_batch", "matmul_4bit_mma",
                "matmul_4bit_splitk_two"]
    assert first["tier"] == "emulated" and list(first["verdicts"]) == families
    # run now (a fresh cache), and written to the cache as first use writes them
    written = {family: entry for entries in json.loads(verify.cache_path().read_text()).values()
               for family, entry in entries.items()}  # fmt: skip
    for family, v in first["verdicts"].items():
        assert (v["passed"], v["cached"], v["result"]) == (True, False, "passed")
        assert written[family]["passed"] is True and v["seconds"] == written[family]["seconds"] > 0
        assert v["launches"] == written[family]["launches"] > 0
    verify.reset()  # a later process: read from the cache
    later = check.gpu_verdicts("emulated", executor, used)
    assert all(v["cached"] and v["passed"] for v in later["verdicts"].values())
    lines = check.gpu_report_lines(later)
    assert "emulated tier" in lines[0] and all("read from the cache" in line for line in lines[1 : 1 + len(families)])
    import bnb_mps

    assert later["tuning"] == bnb_mps.tuning_table()  # the tuning choices of this process, as they stand
    assert lines[1 + len(families)] == f"    tuning           {len(later['tuning'])} choices"


def test_tuning_choices_are_one_line_each():
    entry = {"op": "gemm_4bit", "key": "f16 N=4096 K=4096 bs=64 nf4 nested M<=1", "choice": "gemv/tglut",
             "default": "gemv", "times": {"gemv": 1e-4, "gemv/tglut": 9e-5}, "cached": True}  # fmt: skip
    lines = check.gpu_report_lines({"tier": "native", "verdicts": {}, "tuning": [entry]})
    assert lines[-2:] == ["    tuning           1 choices",
                          "      gemm_4bit f16 N=4096 K=4096 bs=64 nf4 nested M<=1: gemv/tglut (built-in: gemv) (cached)"]


def test_gpu_verdicts_show_verification_off_and_tuning(emulated_verification):
    """BNB_MPS_VERIFY=0: no verdicts, and the summary says so; a tuning table (a later bnb-mps' API)
    is shown where the package has one."""
    import bnb_mps

    emulated_verification.setenv("BNB_MPS_VERIFY", "0")
    choices = {f"gemm_4bit M={m} N=384 K=128": "mma" for m in range(12)}
    emulated_verification.setattr(bnb_mps, "tuning_table", lambda: choices, raising=False)
    found = check.gpu_verdicts("emulated", executors.load_tier("emulated"), ["gemm_4bit"])
    assert "verdicts" not in found and "BNB_MPS_VERIFY=0" in found["verification"]
    assert found["tuning"] == choices
    lines = check.gpu_report_lines(found)
    assert any("12 choices" in line for line in lines) and any("all of them in summary.json" in line for line in lines)


# -- the command line ----------------------------------------------------------------------------------


def test_info_is_the_default_command(capsys):
    assert cli([]) == 0
    default = capsys.readouterr().out
    assert cli(["info"]) == 0
    assert capsys.readouterr().out == default and "executor tier" in default


def test_missing_requirement_exits_with_the_install_command(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    assert cli(["demo"]) == 1
    err = capsys.readouterr().err
    assert "missing: peft" in err and "pip install peft" in err


def test_missing_requirement_from_the_shell(tmp_path):
    (tmp_path / "peft.py").write_text("raise ImportError(\"No module named 'peft'\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "bnb_mps", "demo", "--out", str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode != 0
    assert "pip install peft" in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--optim", "no_such_optimizer"], "--optim no_such_optimizer"),
])  # fmt: skip
def test_bad_settings_exit_with_a_message(argv, message, tmp_path, capsys):
    assert cli(["demo", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


# -- the op layer's call counter -----------------------------------------------------------------------


@pytest.fixture
def no_gpu_tier(fresh_tier_selection):
    def unavailable(name):
        raise executors.ExecutorUnavailable(f"{name} stands in as unavailable")

    fresh_tier_selection.setattr(executors, "load_tier", unavailable)
    yield fresh_tier_selection
    registration.reinstate()


def test_call_counter_sees_only_the_first_call_of_a_handed_back_op(no_gpu_tier):
    """On the "bitsandbytes" route the op layer hands the op back on its first call; bitsandbytes
    then serves it directly, so later calls are not counted."""
    mps = torch._C.DispatchKeySet(torch._C.DispatchKey.MPS)
    ops.reset_call_counts()
    for _ in range(3):
        torch.ops.bitsandbytes.quantize_4bit.default.redispatch(mps, torch.randn(64), 64, "nf4", torch.uint8)
    assert ops.call_counts() == {"quantize_4bit": {"bitsandbytes": 1}}
    assert "quantize_4bit" not in registration.registered("MPS")  # bitsandbytes served the other two
    ops.reset_call_counts()
    assert ops.call_counts() == {}


def test_call_counter_counts_every_round_trip(fresh_tier_selection):
    fresh_tier_selection.setenv("BNB_MPS_EXECUTOR", "cpu")
    mps = torch._C.DispatchKeySet(torch._C.DispatchKey.MPS)
    code = torch.linspace(-1, 1, 256)
    ops.reset_call_counts()
    for _ in range(2):
        torch.ops.bitsandbytes.quantize_blockwise.default.redispatch(mps, torch.randn(64), code, 64)
    torch.ops.bitsandbytes.quantize_4bit.default.redispatch(mps, torch.randn(64), 64, "fp4", torch.uint8)
    assert ops.call_counts() == {"quantize_blockwise": {"cpu": 2}, "quantize_4bit": {"cpu": 1}}


# -- on a Mac --------------------------------------------------------------------------------------------


@pytest.mark.mps
def test_demo_on_mps(tmp_path_factory):
    """The demo as a Mac user runs it: the mps device, bnb-mps' best tier, the training settings
    bnb_mps.device advises (gradient checkpointing, accumulation, bf16 where it works)."""
    summary, out, calls, stdout = demo_run(tmp_path_factory, "mps", device="mps", steps=6)
    assert summary["device"].startswith("mps")
    assert summary["gradient_checkpointing"] is True and summary["gradient_accumulation_steps"] == 4
    losses = summary["loss"]
    assert all(math.isfinite(x) for x in losses) and sum(losses[-2:]) < sum(losses[:2]) - 0.6, losses
    dtype_bytes = torch.empty((), dtype=getattr(torch, summary["compute_dtype"])).element_size()
    four_bit, fp16, layers = expected_weight_bytes(tiny_config(), dtype_bytes)
    assert (summary["weight_bytes_4bit"], summary["weight_bytes_fp16"]) == (four_bit, fp16)

    assert QUANT_OPS <= set(summary["ops"])
    assert summary["ops"]["quantize_4bit"]["tier"] == ops.route("quantize_4bit").tier
    if executors.selection().tier in ("native", "shader"):
        for name in QUANT_OPS:
            assert summary["ops"][name]["tier"] == executors.selection().tier, name
    complete: Counter = Counter()
    partial = set()
    for name, row in summary["ops"].items():
        base = name.split(".")[0]
        if row["tier"] in BNB_MPS_TIERS:  # bnb-mps served every call: the count is complete
            complete[base] += row["calls"]
        else:  # handed back to bitsandbytes: only what passed through bnb-mps is counted
            assert row["tier"] == "bitsandbytes" and "not counted" in row["note"], (name, row)
            partial.add(base)
    for base, n in complete.items():
        if base not in partial:
            assert n == calls[base], (base, n, calls[base])
    assert summary["memory"]["allocated"] is not None
    assert (out / "demo_loss.png").exists() and "summary" in stdout
    # The kernel check on a Mac: no second run, the first-use verdicts of the families the run used.
    from bnb_mps.ops import verify

    kc = summary["kernel_check"]
    sel = executors.selection()
    if sel.executor is None:
        assert "no bnb-mps GPU tier" in kc["skipped"]
        return
    assert kc["tier"] == sel.tier and "max_abs_logit_diff" not in kc
    used = {name for name, row in summary["ops"].items() if row["tier"] == sel.tier}
    assert set(kc["verdicts"]) == {f for name in used for f in verify.families_behind(name, sel.executor)}
    for family, v in kc["verdicts"].items():
        assert v["passed"] and v["launches"] > 0, (family, v)
        assert f"{family}" in stdout


def test_shell_entry_point_runs_the_demo_module():
    """`python -m bnb_mps demo --help` (what scripts/demo.sh runs) lists the demo's options."""
    proc = subprocess.run([sys.executable, "-m", "bnb_mps", "demo", "--help"], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for option in ("--size", "--steps", "--device", "--kernels", "--optim", "--out", "--quiet"):
        assert option in proc.stdout


def test_console_script_names_itself_in_its_usage():
    """`bnb-mps demo --help` (the console script pip installs) shows `bnb-mps`, not `python -m`."""
    script = shutil.which("bnb-mps", path=str(Path(sys.executable).parent)) or shutil.which("bnb-mps")
    if script is None:
        pytest.skip("the bnb-mps console script is not installed in this environment")
    proc = subprocess.run([script, "demo", "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: bnb-mps demo "), proc.stdout[:200]


def test_op_report_on_mps_says_which_calls_went_uncounted():
    """The mps report (run on a Mac by test_demo_on_mps) from op-layer counts: complete counts for
    bnb-mps' tiers; a handed-back op shows the calls that passed through bnb-mps, and says the rest
    were not counted; one handed back before the run shows no count at all."""
    from bnb_mps.demo import report

    counts = {"quantize_4bit": {"shader": 28}, "gemm_4bit": {"bitsandbytes": 1},
              "optimizer_update_8bit_blockwise": {"cpu": 300}}  # fmt: skip
    rows, notes = report.op_report(counts, "mps", False, {"gemv_4bit": "no Metal kernel"}, ["gemm_4bit"])
    assert rows["quantize_4bit"] == {"tier": "shader", "calls": 28, "served_by": report.SERVED_BY["shader"]}
    assert rows["optimizer_update_8bit_blockwise"]["calls"] == 300
    assert rows["gemm_4bit"]["calls"] == 1 and "not counted" in rows["gemm_4bit"]["note"]
    assert rows["gemv_4bit"]["calls"] is None and rows["gemv_4bit"]["tier"] == "bitsandbytes"
    assert len(notes) == 1 and "not counted" in notes[0]
    table = "\n".join(report.op_table(rows))
    assert "gemv_4bit" in table and "?" in table and "300" in table
    # Off mps, nothing handed back before the run is listed: it concerns the mps key only.
    rows, notes = report.op_report({}, "cpu", False, {"gemv_4bit": "no Metal kernel"}, ["gemm_4bit"])
    assert rows == {} and "none was counted" in notes[0]


def test_independent_count_leaves_out_cpu_round_trips():
    """The mps test's reference count: an op whose kernel calls the same op again (what bnb-mps'
    CPU round trip does, on CPU copies) counts once, and what that inner call runs not at all;
    other nested calls count."""
    lib = torch.library.Library("bnb_mps_demo_test", "DEF")
    try:
        lib.define("outer(Tensor x) -> Tensor")
        lib.define("inner(Tensor x) -> Tensor")

        def outer(x):
            if x.dim() == 2:  # the round trip: the same op again, on a copy
                return torch.ops.bnb_mps_demo_test.outer(x.reshape(-1)).reshape(x.shape)
            return torch.ops.bnb_mps_demo_test.inner(x)

        lib.impl("outer", outer, "CPU")
        lib.impl("inner", lambda x: x + 1, "CPU")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            torch.ops.bnb_mps_demo_test.outer(torch.zeros(2, 2))  # round trip: counts outer once
            torch.ops.bnb_mps_demo_test.outer(torch.zeros(4))  # plain: outer and its nested inner
        kept = Counter(e.name for e in prof.events() if e.name.startswith("bnb_mps_demo_test::")
                       and not _in_cpu_round_trip(e))  # fmt: skip
        assert kept == {"bnb_mps_demo_test::outer": 2, "bnb_mps_demo_test::inner": 1}
    finally:
        lib._destroy()
