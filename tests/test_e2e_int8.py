"""A transformers model loaded with `BitsAndBytesConfig(load_in_8bit=True)` running bnb_mps' int8
kernels (under the emulator, on CPU tensors).

A tiny Llama is built from a config (no downloads), given a few large feature channels (RMSNorm
gains) so that its activations carry LLM.int8() outliers past the default threshold of 6.0, saved,
and reloaded in 8-bit. Loading quantizes every Linear but the head with our kernel; the forward
pass runs every Linear8bitLt through our quantization and fused mixed int8 product. The logits are
compared with (1) the same model whose int8 layers compute tests/reference_int8.py's docs/semantics.md
composition, (2) stock bitsandbytes' own CPU int8 path on the same quantized weights, and (3) the
fp32 model, within the int8 error.
"""

from __future__ import annotations

import copy

import extras
import pytest
import torch

pytest.importorskip("bnb_mps._emu")
transformers = extras.require("transformers")
extras.require("accelerate")  # (transformers loads quantized models through it)

import bitsandbytes as bnb  # noqa: E402

import reference_int8 as ref  # noqa: E402
from bnb_mps.testing import use_emulated_kernels  # noqa: E402

THRESHOLD = 6.0  # BitsAndBytesConfig's default llm_int8_threshold
SEQ = 12


@pytest.fixture
def saved_model(tmp_path, offline):
    """A randomly initialised fp32 Llama (hidden 64, 2 layers) with outlier feature channels."""
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # normalized activations ~N(0, 1): these channels reach 6+
            layer.input_layernorm.weight[[5, 40]] = torch.tensor([9.0, -7.0])
            layer.post_attention_layernorm.weight[17] = 8.0
    model.save_pretrained(tmp_path)
    return model, tmp_path


def load_8bit(path):
    qc = transformers.BitsAndBytesConfig(load_in_8bit=True)
    return transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=qc, device_map="cpu")


class ReferenceInt8Linear(torch.nn.Module):
    """What MatMul8bitLt computes in inference, from tests/reference_int8.py: the activation (as
    fp16) and the weight (as fp16) quantized row-wise, outlier columns in floating point."""

    def __init__(self, linear: torch.nn.Linear, threshold: float):
        super().__init__()
        self.weight, self.bias, self.threshold = linear.weight.detach(), linear.bias, threshold
        self.CB, self.SCB, _ = ref.int8_vectorwise_quant(self.weight.half(), 0.0)

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        CA, SCA, cols = ref.int8_vectorwise_quant(x2.half(), self.threshold)
        out, _, _ = ref.int8_mixed_scaled_mm(x2, CA, self.CB, SCA, self.SCB, cols, self.bias)
        return out.reshape(*x.shape[:-1], -1)


def reference_int8_model(original, names):
    model = copy.deepcopy(original)
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, ReferenceInt8Linear(getattr(owner, child), THRESHOLD))
    return model


def test_from_pretrained_8bit_forward(saved_model):
    original, path = saved_model
    with use_emulated_kernels() as kernels:
        model = load_8bit(path)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear8bitLt)}
    expected = {n for n, m in original.named_modules() if isinstance(m, torch.nn.Linear)} - {"lm_head"}
    assert set(layers) == expected and len(layers) == 14
    assert kernels.launched == ["bnb_int8_vectorwise_quant_f16"] * 14
    originals = original.state_dict()
    for name, layer in layers.items():
        CB, SCB, _ = ref.int8_vectorwise_quant(originals[name + ".weight"].half(), 0.0)
        assert torch.equal(layer.weight.data, CB) and torch.equal(layer.weight.SCB, SCB), name
        assert layer.state.threshold == THRESHOLD

    ids = torch.randint(0, original.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with use_emulated_kernels() as kernels, torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.dtype == torch.float32
    per_layer = ["bnb_int8_vectorwise_quant_outliers_f16", "bnb_int8_outlier_finish", "bnb_int8_scaled_mm_f32_tile32_k16"]
    assert kernels.launched == per_layer * 14  # no int32 matrix, no separate dequantization
    with_outliers = [n for n, m in layers.items() if m.state.idx is not None and m.state.idx.numel()]
    assert len(with_outliers) >= 4, with_outliers  # the q/k/v and gate/up inputs carry outliers

    with torch.no_grad():
        reference = reference_int8_model(original, layers)(input_ids=ids).logits
        stock = model(input_ids=ids).logits  # bitsandbytes' own CPU int8 path, same int8 weights
        full = original(input_ids=ids).logits
    scale = full.abs().max().item()
    # (1) docs/semantics.md's composition: the same int8 maths; the layers' outputs agree to float32 rounding of
    # the outlier sums, which the following fp32 ops carry along.
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5 * scale)
    # (2) stock bitsandbytes' CPU path is docs/semantics.md's algorithm with two float deviations: its
    # int8_mm_dequant multiplies by 6.200124e-05 (fl32(1/16129) is 6.200012e-05: 2e-5 relative),
    # and its quantizer scales by fl32(fl32(1/max) * 127) (torch's `127.0 / t` is a reciprocal
    # times 127), not fl32(127 / max), which moves a code by one where the product sits next to a
    # .5 tie. Its logits stay within a fraction of the int8 error of ours (measured: 0.003 of a
    # logit scale of 0.6, against an int8 error of 0.013).
    torch.testing.assert_close(logits, stock, rtol=0, atol=0.01 * scale)
    # (3) the fp32 model: int8 error, visible (so (1) and (2) are not trivially met) and small.
    err = (logits - full).abs().max().item()
    assert 1e-3 * scale < err < 0.05 * scale, (err, scale)
