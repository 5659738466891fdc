"""On Apple hardware: the optimizer kernels on the native and shader tiers against docs/semantics.md section 5
(tests/reference_optim.py) with docs/semantics.md 5.3's one-step tolerances; bitsandbytes' optimizer classes on
`mps` parameters against torch.optim with bitsandbytes' tolerances; paged optimizers and
transformers' `optim="paged_adamw_8bit"` on mps. Skipped elsewhere.

The deviations measured on a Mac are printed (`pytest -s`): docs/semantics.md allows 2 ulp on p, code
differences near thresholds and 1 ulp on absmax; where the GPU computes exactly as the reference
does, every figure is 0. p's ulps are counted at the magnitude of the step's operands (old p, new
p): random states make some updates nearly cancel p, and there a different rounding of the update
(a fused multiply-add) would be many ulps of the tiny result but still a rounding of the operands.
"""

from __future__ import annotations

import bitsandbytes as bnb
import extras
import pytest
import torch

import optim_inputs as oi
import reference_optim as R
from bnb_mps import backend_info, executors, ops

pytestmark = pytest.mark.mps

OP8, OP32 = "optimizer_update_8bit_blockwise", "optimizer_update_32bit"


def run(executor, name, args):
    mine = oi.to_device(oi.clone(args), "mps")
    ops.call(ops.OPS[name], tuple(mine), {}, executor)
    torch.mps.synchronize()
    return [a.cpu() if isinstance(a, torch.Tensor) else a for a in mine]


def close_states_32(got, want):
    """32-bit states: float32 rounding of each operation, with room for a contracted multiply-add
    where two terms nearly cancel (relative 1e-6 of the state, absolute 1e-12)."""
    for g, w in ((got[3], want.state1), (got[4], want.state2)):
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("dtype", oi.DTYPES, ids=str)
@pytest.mark.parametrize("name", oi.NAMES_8BIT)
def test_8bit_one_step(executor, name, dtype):
    for n, seed in ((3 * 256 + 77, 1), (1, 2), (40 * 256, 3)):
        args = oi.args_8bit(name, n, dtype, seed=seed)
        got = run(executor, OP8, args)
        dev = oi.compare_8bit(got, R.optimizer_8bit(*oi.clone(args)), p_before=args[2])
        print(f"{executor.name} 8-bit {name} {dtype} n={n}: {dev}")
        again = run(executor, OP8, args)  # the same bits every time
        assert all(torch.equal(a, b) for a, b in zip(got[2:5], again[2:5]) if isinstance(a, torch.Tensor))


@pytest.mark.parametrize("dtype", oi.DTYPES, ids=str)
@pytest.mark.parametrize("name", oi.NAMES_32BIT)
def test_32bit_one_step(executor, name, dtype):
    for max_unorm in (0.0, 0.002):
        args = oi.args_32bit(name, 2 * 2048 + 77, dtype, seed=4, max_unorm=max_unorm)
        got = run(executor, OP32, args)
        want = R.optimizer_32bit(*oi.clone(args))
        dev = oi.compare_32bit(got, want, max_state_ulps=1 << 30, p_before=args[2])
        close_states_32(got, want)
        print(f"{executor.name} 32-bit {name} {dtype} clip={max_unorm}: {dev}")


def test_edge_cases(executor):
    """Non-finite gradients, all-zero blocks, skip_zeros, tails."""
    for name in oi.NAMES_8BIT:
        g = torch.randn(300, generator=oi.gen(5)) * 0.01
        g[3], g[4], g[5] = float("nan"), float("inf"), 0.0
        g[256:] = 0.0
        for skip in (False, True):
            args = oi.args_8bit(name, 300, torch.float32, seed=6, g=g.clone(), skip_zeros=skip)
            oi.compare_8bit(run(executor, OP8, args), R.optimizer_8bit(*oi.clone(args)), p_before=args[2])


def test_bitsandbytes_api_on_mps_uses_a_gpu_tier():
    info = backend_info()
    for name in (OP8, OP32):
        assert info[name]["tier"] in executors.GPU_TIERS, info[name]


@pytest.mark.parametrize("name", ["adamw8bit", "lion8bit", "ademamix8bit", "momentum8bit", "rmsprop8bit",
                                  "adagrad8bit", "paged_adamw8bit"])  # fmt: skip
def test_bitsandbytes_8bit_classes_on_mps(name):
    from test_optimizers_bnb import run_8bit

    for shape, gtype in (((1024, 32), torch.float32), ((4097,), torch.bfloat16), ((1024, 1024), torch.float16)):
        run_8bit(name, shape, gtype, device="mps")


@pytest.mark.parametrize("name", ["adam", "paged_adamw", "momentum", "lars", "rmsprop", "adagrad", "lion", "ademamix"])
def test_bitsandbytes_32bit_classes_on_mps(name):
    from test_optimizers_bnb import run_32bit

    run_32bit(name, (1024, 32), torch.float32, device="mps")
    if name != "lars":
        run_32bit(name, (4097,), torch.bfloat16, steps=20, device="mps")


@pytest.mark.parametrize("paged_cls,plain_cls", [
    (bnb.optim.PagedAdamW8bit, bnb.optim.AdamW8bit), (bnb.optim.PagedAdamW, bnb.optim.AdamW),
    (bnb.optim.PagedLion8bit, bnb.optim.Lion8bit), (bnb.optim.PagedAdEMAMix8bit, bnb.optim.AdEMAMix8bit),
], ids=["PagedAdamW8bit", "PagedAdamW", "PagedLion8bit", "PagedAdEMAMix8bit"])  # fmt: skip
def test_paged_optimizers_on_mps(paged_cls, plain_cls):
    """Paged states are plain mps tensors; the paged optimizer computes exactly what the plain one
    does."""
    torch.manual_seed(0)
    start = torch.randn(512, 256) * 0.1  # >= 1e5 elements: bitsandbytes pages these states
    grads = [torch.randn(512, 256) * 0.01 for _ in range(5)]
    results = []
    for cls in (paged_cls, plain_cls):
        p = torch.nn.Parameter(start.to("mps"))
        opt = cls([p])
        for g in grads:
            p.grad = g.to("mps")
            opt.step()
        results.append((p.detach().cpu(), {k: v.cpu() for k, v in opt.state[p].items() if torch.is_tensor(v)}))
        if cls is paged_cls:
            assert opt.state[p]["state1"].device.type == "mps" and opt.state[p]["state1"].is_paged
    (p_paged, s_paged), (p_plain, s_plain) = results
    assert torch.equal(p_paged, p_plain)
    for k in s_plain:
        assert torch.equal(s_paged[k], s_plain[k]), k


def test_transformers_trainer_with_paged_adamw_8bit(tmp_path):
    transformers = extras.require("transformers")
    extras.require("accelerate")  # (the Trainer runs through it)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("mps")
    ids = torch.randint(0, 128, (8, 16))

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    args = transformers.TrainingArguments(output_dir=str(tmp_path), optim="paged_adamw_8bit", learning_rate=3e-3,
                                          per_device_train_batch_size=8, max_steps=30, logging_steps=5,
                                          report_to=[], save_strategy="no", dataloader_pin_memory=False)  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Data())
    trainer.train()
    opt = trainer.optimizer
    inner = getattr(opt, "optimizer", opt)
    assert isinstance(inner, bnb.optim.AdamW) and inner.is_paged
    eight_bit = [s for s in inner.state.values() if s["state1"].dtype == torch.uint8]
    assert eight_bit and all(s["state1"].device.type == "mps" for s in eight_bit)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < 0.7 * losses[0], losses
