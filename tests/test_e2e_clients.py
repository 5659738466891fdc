"""Real clients of bitsandbytes running on bnb_mps' kernels (under the emulator, on CPU tensors).

A tiny causal LM is built from a transformers config (no downloads), saved, and reloaded in 4-bit
through `BitsAndBytesConfig`; then peft trains LoRA adapters on it with `bnb.optim.AdamW8bit`.
Inside `use_emulated_kernels()` every quantize/dequantize op that bitsandbytes issues on a CPU
tensor runs bnb_mps' Metal kernels, and so does the 8-bit optimizer update; the other ops (GEMM
composition) stay with bitsandbytes' CPU code. Results are checked against tests/spec_reference.py.
"""

from __future__ import annotations

import math

import extras
import pytest
import torch

pytest.importorskip("bnb_mps._emu")
transformers = extras.require("transformers")
peft = extras.require("peft")
extras.require("accelerate")  # (transformers loads quantized models through it)

import bitsandbytes as bnb  # noqa: E402
import bitsandbytes.functional as F  # noqa: E402

import spec_reference as ref  # noqa: E402
from bnb_mps.testing import use_emulated_kernels  # noqa: E402

CODE = F.create_dynamic_map(signed=True)  # the 8-bit code bitsandbytes uses for nested absmax
BLOCKSIZE = 64  # BitsAndBytesConfig's default bnb_4bit_blocksize
SEQ = 16


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN, -0.0 != +0.0)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


@pytest.fixture
def saved_model(tmp_path, offline):
    """A randomly initialised fp32 Llama (hidden 64, 2 layers, 4 heads, vocab 128) saved to tmp_path."""
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    return model, tmp_path


def load_4bit(path, quant_type="nf4", double_quant=True):
    qc = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.float32,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=qc, device_map="cpu")
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            # On CPUs with AVX512-BF16, bitsandbytes repacks 4-bit weights in place into its own CPU
            # layout at the first eval forward and then runs its own bf16 GEMV. That path exists on
            # no other device; pin the portable one (gemm_4bit -> dequantize kernels), the one an
            # mps tensor takes, so the test checks the same thing on every CPU.
            module.support_avx512bf16_for_cpu = False
    return model


def quantized_names(original) -> set[str]:
    """transformers quantizes every Linear except the output head (kept in full precision)."""
    return {n for n, m in original.named_modules() if isinstance(m, torch.nn.Linear)} - {"lm_head"}


def linear4bit_modules(model) -> dict[str, bnb.nn.Linear4bit]:
    return {name: m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def reference_scales(absmax: torch.Tensor, double_quant: bool) -> tuple[torch.Tensor, tuple]:
    """(per-block scales a dequantizer uses, (q8, nested, offset) or ())."""
    if not double_quant:
        return absmax, ()
    q8, nested, offset = ref.double_quantize(absmax, CODE)
    return ref.nested_scales(q8, CODE, nested, offset), (q8, nested, offset)


def reference_dequantized_model(original, names, quant_type="nf4", double_quant=True):
    """The original fp32 model with each quantized Linear's weight replaced by its docs/semantics.md round trip."""
    sd = {k: v.clone() for k, v in original.state_dict().items()}
    for name in names:
        W = sd[name + ".weight"]
        packed, absmax = ref.quantize_4bit(W, BLOCKSIZE, quant_type)
        scales, _ = reference_scales(absmax, double_quant)
        sd[name + ".weight"] = ref.dequantize_4bit(packed, scales, BLOCKSIZE, quant_type, W.shape, torch.float32)
    model = transformers.LlamaForCausalLM(original.config).eval()
    model.load_state_dict(sd)
    return model


def token_batch(vocab_size, seed=1):
    return torch.randint(0, vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("quant_type", "double_quant"), [("nf4", True), ("fp4", False)])
def test_from_pretrained_4bit_quantizes_bit_exact_and_forward_matches(saved_model, quant_type, double_quant):
    original, path = saved_model
    with use_emulated_kernels() as kernels:
        model = load_4bit(path, quant_type, double_quant)
    loaded = list(kernels.launched)

    layers = linear4bit_modules(model)
    assert set(layers) == quantized_names(original) and len(layers) == 14
    assert loaded.count(f"bnb_quantize_4bit_{quant_type}_f32_{BLOCKSIZE}") == len(layers)
    assert loaded.count("bnb_quantize_blockwise_f32_256") == (len(layers) if double_quant else 0)

    originals = original.state_dict()
    for name, layer in layers.items():
        W = originals[name + ".weight"]
        want_packed, want_absmax = ref.quantize_4bit(W, BLOCKSIZE, quant_type)
        qs = layer.weight.quant_state
        assert same(layer.weight.data, want_packed), name
        assert (qs.shape, qs.blocksize, qs.quant_type, qs.dtype) == (W.shape, BLOCKSIZE, quant_type, torch.float32)
        assert qs.nested == double_quant
        if double_quant:
            q8, nested, offset = ref.double_quantize(want_absmax, CODE)
            assert same(qs.absmax, q8) and same(qs.state2.absmax, nested), name
            assert same(qs.offset.reshape(()), offset.reshape(())) and same(qs.state2.code, CODE)
            assert qs.state2.blocksize == 256
        else:
            assert same(qs.absmax, want_absmax), name

    ids = token_batch(original.config.vocab_size)
    with use_emulated_kernels() as kernels, torch.no_grad():
        logits = model(input_ids=ids).logits
    # Each 4-bit layer runs one fused 4-bit matmul kernel (nested absmax decoded inside it); no
    # weight is dequantized.
    matmuls = [k for k in kernels.launched if k.startswith(("bnb_gemm_4bit_", "bnb_gemv_4bit_"))]
    assert len(matmuls) == len(layers), kernels.launched
    assert all(k.endswith("_nested_f32" if double_quant else "_absmax_f32") for k in matmuls), matmuls
    assert not any(k.startswith("bnb_dequantize") for k in kernels.launched), kernels.launched

    with torch.no_grad():
        want = reference_dequantized_model(original, layers, quant_type, double_quant)(input_ids=ids).logits
        full_precision = original(input_ids=ids).logits
    # Both models compute with the same weights (the docs/semantics.md dequantization, in float32), so only
    # summation-order noise of float32 matmuls may separate them: a few ulps of logits of
    # magnitude < 1, while quantizing moves the logits by ~0.07, which the next line checks so
    # that this comparison can tell the two apart.
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    assert (full_precision - want).abs().max() > 1e-2


def test_qlora_training_with_adamw8bit(saved_model):
    original, path = saved_model
    ids = token_batch(original.config.vocab_size, seed=2)
    with use_emulated_kernels() as kernels:
        model = load_4bit(path)
        model = peft.prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs={"use_reentrant": False})
        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])  # fmt: skip
        model = peft.get_peft_model(model, lora)
        base = linear4bit_modules(model)  # peft's LoRA layers subclass Linear4bit; keep the bases
        base = {n: m for n, m in base.items() if type(m) is bnb.nn.Linear4bit}
        assert len(base) == 14
        frozen = {n: (m.weight.data.clone(), m.weight.quant_state.absmax.clone()) for n, m in base.items()}
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        assert trainable and all("lora_" in n for n in trainable)
        before = {n: p.detach().clone() for n, p in trainable.items()}
        # LoRA matrices (<= 512 elements) are below the default min_8bit_size of 4096, which would
        # give them 32-bit state; 0 makes the optimizer keep its states in 8 bits as in real QLoRA.
        opt = bnb.optim.AdamW8bit(trainable.values(), lr=1e-2, min_8bit_size=0)

        model.train()
        n_load = len(kernels.launched)
        losses = []
        for _ in range(8):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    trained = set(kernels.launched[n_load:])

    assert {"bnb_dequantize_4bit_nf4_f32", "bnb_dequantize_blockwise_f32", "bnb_optimizer_8bit_adam_f32"} <= trained
    assert all(math.isfinite(x) for x in losses), losses
    # LoRA's B starts at zero, so the first loss is the base model's: the docs/semantics.md-dequantized model's.
    with torch.no_grad():
        want_first = reference_dequantized_model(original, quantized_names(original))(
            input_ids=ids, labels=ids
        ).loss.item()
    assert losses[0] == pytest.approx(want_first, rel=1e-5)
    assert losses[-1] < 0.9 * losses[0], losses  # overfitting one fixed batch
    assert all(s["state1"].dtype == torch.uint8 and s["state2"].dtype == torch.uint8 for s in opt.state.values())
    for n, p in trainable.items():
        assert not torch.equal(p.detach(), before[n]), f"{n} did not change"
    for n, m in base.items():
        packed, absmax = frozen[n]
        assert same(m.weight.data, packed) and same(m.weight.quant_state.absmax, absmax), f"{n} changed"
