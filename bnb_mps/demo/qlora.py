"""The QLoRA run of `python -m bnb_mps demo`, written as a Mac user writes one for CUDA.

1. A small Llama is built from a `transformers.LlamaConfig` (random weights, nothing downloaded),
   saved, and loaded in 4-bit with `BitsAndBytesConfig(load_in_4bit=True, nf4, double
   quantization)` and `device_map={"": device}`: transformers' bitsandbytes quantizer never picks
   mps by itself, so the device is named.
2. It samples some text (greedy), trains LoRA adapters (peft) on a public-domain book with a
   bitsandbytes 8-bit optimizer, gradient checkpointing and accumulation as
   `bnb_mps.device.training_config` advises for the device, and samples again.
3. The kernel check (`check.py`; --no-kernel-check skips it): where no Apple GPU serves the ops (the
   CPU device), the trained model runs again with its 4-bit products on bnb-mps' Metal kernels under
   the emulator, compared with the stock run; on mps, the first-use verification verdicts of the
   kernel families the run used.
4. It reports the loss, tokens/s, the weight memory in 4-bit against fp16, which tier served each
   bitsandbytes op and how often (counted in bnb-mps' op layer) and the kernel check, and writes
   `summary.json` and `demo_loss.png`.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import check, data, report

#: model and training shapes per --size; the whole tiny run takes 40 s on one x86 core (measured)
SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, batch_size=8, seq_len=128, steps=100, lora_r=16),
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, batch_size=8, seq_len=256, steps=100, lora_r=16),
}  # fmt: skip

DEFAULT_OPTIM = "paged_adamw_8bit"  # bitsandbytes' PagedAdamW8bit, as transformers names it
PROMPT = "Alice was beginning to "
MAX_GRAD_NORM = 1.0  # transformers.Trainer's default


@dataclass
class Options:
    size: str = "tiny"
    steps: Optional[int] = None  # None: the size's default
    device: Optional[str] = None  # None: bnb_mps.device.get_device()
    kernels: str = "auto"  # "auto" | "emulated"
    optim: Optional[str] = None  # a transformers optimizer name; None: paged_adamw_8bit where it pages
    lr: float = 3e-3
    batch_size: Optional[int] = None
    seq_len: Optional[int] = None
    accum: Optional[int] = None  # None: training_config(device)
    max_new_tokens: int = 80
    prompt: str = PROMPT
    seed: int = 0
    out: str = "bnb_mps_demo"
    quiet: bool = False  # no progress bar
    kernel_check: bool = True  # the kernel check after training (bnb_mps.demo.check); --no-kernel-check skips it
    threads: Optional[int] = None  # CPU threads; None: 1 for tiny on the CPU device, torch's default otherwise


class DemoError(Exception):
    """A setting the demo cannot run with; the message says why and what to do."""


def _choose_device(opts: Options):
    """bnb_mps.device.get_device() as a user calls it; --kernels emulated needs the CPU."""
    from ..device import get_device

    wanted = opts.device or ("cpu" if opts.kernels == "emulated" else None)
    device = get_device(wanted)  # falls back (with a logged warning) when the device is unusable
    if wanted not in (None, "auto") and device.type != wanted.split(":")[0]:
        print(f"note: device {wanted} is not usable here; running on {device}", flush=True)
    if opts.kernels == "emulated" and device.type != "cpu":
        raise DemoError(f"--kernels emulated runs bitsandbytes' ops on CPU tensors, but the device is {device} "
                        "(from --device or BNB_MPS_DEVICE); use --device cpu")  # fmt: skip
    return device


def _optimizer_spec(name: Optional[str], device, lr: float):
    """(optimizer class, its keyword arguments, transformers name, note). Names are transformers'
    (`TrainingArguments.optim`), resolved the way transformers' Trainer resolves them."""
    from transformers import Trainer, TrainingArguments

    note = ""
    if name is None:
        name = DEFAULT_OPTIM
        if device.type == "cpu":
            # bitsandbytes pages optimizer states through CUDA's managed memory; on a CPU tensor it
            # warns and keeps them in ordinary memory, which is exactly adamw_bnb_8bit.
            name = "adamw_bnb_8bit"
            note = (f"{DEFAULT_OPTIM} pages its states through CUDA's managed memory; on cpu the demo uses "
                    "adamw_bnb_8bit, the same bitsandbytes 8-bit AdamW without paging")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        try:
            args = TrainingArguments(output_dir=tmp, optim=name, learning_rate=lr, report_to=[])
            cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
        except (ValueError, ImportError) as e:
            raise DemoError(f"--optim {name}: {e}") from None
    if "optim_bits" in kwargs:
        # bitsandbytes keeps 32-bit states for tensors under 4096 elements (min_8bit_size); a real
        # model's LoRA matrices are above that, this small model's are not: 0 gives them the 8-bit
        # states that QLoRA on a real model uses.
        kwargs["min_8bit_size"] = 0
    return cls, kwargs, name, note


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' own progress bars and info messages off while the demo saves and loads."""
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _sync(device) -> None:
    import torch

    if device.type == "mps":
        torch.mps.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize()


def _sample(model, tok, prompt: str, max_new_tokens: int, device) -> tuple[str, "check.Greedy"]:
    """A greedy sample from `prompt` (text only: the special tokens are never chosen), and its tokens
    and logits (what the kernel check compares)."""
    inputs = tok(prompt, return_tensors="pt").to(device)
    sample = check.greedy(model, inputs, max_new_tokens, _special_ids(tok), tok.pad_token_id)
    return prompt + tok.decode(sample.tokens), sample


def _special_ids(tok) -> list[int]:
    return [tok.convert_tokens_to_ids(t) for t in data.SPECIAL_TOKENS]


def _what_serves(device, emulated: bool) -> str:
    if emulated:
        return ("bitsandbytes' ops on CPU tensors go to bnb-mps' Metal kernels, run by the Metal-on-CPU emulator "
                "(for showing the kernels at work on any machine; slow, so small sizes only)")  # fmt: skip
    if device.type == "mps":
        from .. import executors

        sel = executors.selection()
        if sel.executor is None:
            return (f"bitsandbytes' ops on mps pass through bnb-mps, which has no GPU tier here ({sel.reason}): "
                    "bitsandbytes' own mps code serves what it can run, the CPU round trip the rest")  # fmt: skip
        return (f"bitsandbytes' ops on mps pass through bnb-mps: its Metal kernels on the {sel.tier} tier "
                f"({sel.reason}) where it has one, else bitsandbytes' own mps code or the CPU round trip")
    return (f"bitsandbytes' ops on {device.type} run bitsandbytes' own {device.type} code; bnb-mps serves mps "
            "tensors (add --kernels emulated to run its Metal kernels under the emulator here)")  # fmt: skip


def _short_serves(device, emulated: bool) -> str:
    if emulated:
        return "bitsandbytes' ops on bnb-mps' Metal kernels under the emulator"
    if device.type == "mps":
        from .. import executors

        return f"bnb-mps, {executors.selection().tier} tier"
    return f"bitsandbytes' own {device.type} code"


def _kernel_check(model, tok, corpus_ids, seq_len: int, sample, opts: Options, device, emulated: bool, counts: dict,
                  say) -> tuple[dict, list[str]]:  # fmt: skip
    """The summary's `kernel_check` and its lines (bnb_mps.demo.check): on mps with a kernel tier, the
    verification verdicts of the kernel families the run used; on the CPU, the trained model again on
    bnb-mps' kernels under the emulator, against bitsandbytes' own CPU code."""
    if device.type == "mps":
        from .. import executors

        sel = executors.selection()
        if sel.executor is not None:
            used = [name for name, tiers in counts.items() if sel.tier in tiers]
            found = check.gpu_verdicts(sel.tier, sel.executor, used)
            return found, check.gpu_report_lines(found)
        why = f"no bnb-mps GPU tier serves ops here ({sel.reason})"
    elif device.type != "cpu":
        why = (f"the model is on {device.type}, and the emulator runs bnb-mps' kernels on CPU tensors "
               "(--device cpu runs the check)")  # fmt: skip
    else:
        eval_ids = data.Windows(corpus_ids, check.EVAL_SEQUENCES, seq_len, opts.seed + 1).next()  # not a training draw
        prompt = tok(opts.prompt, return_tensors="pt")
        special = _special_ids(tok)
        if emulated:  # the sample above ran on the kernels; the check compares them with bitsandbytes' own code
            sample = check.greedy(model, prompt, len(sample.tokens), special, tok.pad_token_id)
        return check.emulated_check(model, eval_ids, prompt, sample, special, tok.pad_token_id, quiet=opts.quiet,
                                    say=say)  # fmt: skip
    say(f"kernel check skipped: {why}")
    return {"skipped": why}, [f"  kernel check       skipped: {why}"]


def run(opts: Options, stdout=None) -> dict:
    """Run the demo; returns the summary (also written to <out>/summary.json)."""
    import torch

    threads = torch.get_num_threads()
    try:
        return _run(opts, stdout)
    finally:
        torch.set_num_threads(threads)


def _run(opts: Options, stdout) -> dict:
    import peft
    import torch
    import transformers
    from tqdm.auto import tqdm

    from .. import __version__, ops, registration
    from ..device import checkpointing_field, memory_stats, training_config

    def say(*lines: str) -> None:
        for line in lines:
            print(line, file=stdout or sys.stdout, flush=True)

    if opts.size not in SIZES:
        raise DemoError(f"--size {opts.size!r}: expected one of {', '.join(SIZES)}")
    if opts.kernels not in ("auto", "emulated"):
        raise DemoError(f"--kernels {opts.kernels!r}: expected auto or emulated")
    shape = SIZES[opts.size]
    steps = shape["steps"] if opts.steps is None else opts.steps
    batch_size = opts.batch_size or shape["batch_size"]
    seq_len = opts.seq_len or shape["seq_len"]
    checked = (("--steps", steps), ("--batch-size", batch_size), ("--seq-len", seq_len), ("--accum", opts.accum),
               ("--max-new-tokens", opts.max_new_tokens), ("--threads", opts.threads))
    for flag, value in checked:
        if value is not None and value < 1:
            raise DemoError(f"{flag} must be at least 1, got {value}")
    emulated = opts.kernels == "emulated"
    device = _choose_device(opts)
    tc = training_config(device)
    accum = opts.accum or tc["gradient_accumulation_steps"]
    checkpointing = bool(tc[checkpointing_field()])
    compute_dtype = torch.bfloat16 if tc["bf16"] else torch.float32
    threads = opts.threads
    if threads is None and device.type == "cpu" and opts.size == "tiny":
        # The tiny model's matrices are 128 wide: threads cost more than they bring. Measured on a
        # 2-core x86 machine: the whole run took 40 s with one thread, 63 s with two (training
        # alone 25 s and 22 s); with the machine busy, a step took 0.6 s with one, 2.4 s with two.
        threads = 1
    if threads is not None:
        torch.set_num_threads(threads)
    optim_cls, optim_kwargs, optim_name, optim_note = _optimizer_spec(opts.optim, device, opts.lr)
    out_dir = Path(opts.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    text = data.corpus_text()
    tok = data.char_tokenizer(text)
    corpus_ids = data.encode_corpus(tok, text)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"], num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"], max_position_embeddings=max(seq_len, 512),
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip

    say(f"bnb-mps {__version__} demo: QLoRA fine-tuning of a {opts.size} Llama on {device}",
        f"  {_what_serves(device, emulated)}")  # fmt: skip
    if device.type == "cpu":
        say(f"  CPU threads: {torch.get_num_threads()}" + ("" if opts.threads else " (--threads to change)"))
    if emulated and opts.size != "tiny":
        say("  note: the emulator runs every kernel thread on the CPU; sizes above tiny are slow")

    kernels = contextlib.nullcontext()
    if emulated:
        from ..testing import use_emulated_kernels

        kernels = use_emulated_kernels()
    handed_back_before = registration.skipped()
    ops.reset_call_counts()
    with kernels, _quiet_transformers():
        # 1. the model: built from its config, saved, loaded in 4-bit exactly as from the Hub
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            torch.manual_seed(opts.seed)
            base = transformers.LlamaForCausalLM(config)
            n_params = sum(p.numel() for p in base.parameters())
            base.save_pretrained(tmp)
            del base
            bnb_config = transformers.BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=compute_dtype,
            )  # fmt: skip
            model = transformers.AutoModelForCausalLM.from_pretrained(
                tmp, quantization_config=bnb_config, device_map={"": device}, dtype=compute_dtype
            )
        _sync(device)
        load_seconds = time.perf_counter() - t0
        if device.type == "cpu":
            # On CPUs with AVX512-BF16 bitsandbytes repacks 4-bit weights into a CPU-only layout at
            # the first forward in eval mode, and later training forwards then lose the gradient
            # through the base layers; keep the layout every other device uses.
            for module in model.modules():
                if hasattr(module, "support_avx512bf16_for_cpu"):
                    module.support_avx512bf16_for_cpu = False
        bytes_4bit, bytes_fp16 = report.weight_bytes(model)
        say(f"  model: {n_params / 1e6:.2f}M parameters ({config.num_hidden_layers} layers, hidden "
            f"{config.hidden_size}, {len(tok)} character tokens), loaded in 4-bit NF4 with double "
            f"quantization in {load_seconds:.1f} s; compute dtype {str(compute_dtype).removeprefix('torch.')}",
            f"  weights: {report.human_bytes(bytes_4bit)} in 4-bit, {report.human_bytes(bytes_fp16)} in fp16 "
            f"({bytes_fp16 / bytes_4bit:.1f}x smaller)")  # fmt: skip

        # 2. a sample before training
        before, _ = _sample(model, tok, opts.prompt, opts.max_new_tokens, device)
        say("", "sample before training:", "  " + before.replace("\n", "\n  "), "")

        # 3. LoRA adapters on every 4-bit linear layer, as QLoRA does. The embeddings and the output
        # head (full precision, not quantized) train too: a model built from random weights has no
        # vocabulary to adapt, and these hold it.
        lora = peft.LoraConfig(r=shape["lora_r"], lora_alpha=2 * shape["lora_r"], lora_dropout=0.05,
                               target_modules="all-linear", modules_to_save=["embed_tokens", "lm_head"],
                               task_type="CAUSAL_LM")  # fmt: skip
        with warnings.catch_warnings():  # peft asks transformers 5 for a renamed attribute
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = peft.prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=checkpointing,
                gradient_checkpointing_kwargs={"use_reentrant": False},
            )  # fmt: skip
            model = peft.get_peft_model(model, lora)
        trainable = [p for p in model.parameters() if p.requires_grad]
        n_trainable = sum(p.numel() for p in trainable)
        optimizer = optim_cls(trainable, **optim_kwargs)
        warmup = max(1, (3 * steps) // 10)
        schedule = transformers.get_constant_schedule_with_warmup(optimizer, warmup)
        say(f"  training {n_trainable / 1e3:.0f}K parameters (LoRA adapters of rank {shape['lora_r']} on the 4-bit "
            f"layers; embeddings and output head) for {steps} steps: optimizer {optim_name} "
            f"({type(optimizer).__module__}.{type(optimizer).__name__}), lr {opts.lr:g} ({warmup} warm-up "
            f"steps), batch {batch_size} x "
            f"{seq_len} tokens x {accum} accumulation, gradient checkpointing {'on' if checkpointing else 'off'}")
        if optim_note:
            say(f"  note: {optim_note}")

        # 4. training
        windows = data.Windows(corpus_ids, batch_size, seq_len, opts.seed)
        model.train()
        model.config.use_cache = False
        losses: list[float] = []
        tokens_per_step = batch_size * seq_len * accum
        train_seconds = 0.0
        bar = tqdm(total=steps, desc="QLoRA", unit="step", disable=opts.quiet, dynamic_ncols=True)
        for _ in range(steps):
            t0 = time.perf_counter()
            loss_sum = 0.0
            for _ in range(accum):
                batch = windows.next().to(device)
                loss = model(input_ids=batch, labels=batch).loss
                (loss / accum).backward()
                loss_sum += loss.item()
            torch.nn.utils.clip_grad_norm_(trainable, MAX_GRAD_NORM)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            dt = time.perf_counter() - t0
            train_seconds += dt
            losses.append(loss_sum / accum)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}")
            bar.update()
        bar.close()
        model.config.use_cache = True

        # 5. a sample after training
        after, after_sample = _sample(model, tok, opts.prompt, opts.max_new_tokens, device)
        say("", "sample after training:", "  " + after.replace("\n", "\n  "), "")

    counts = ops.call_counts()

    # 6. the kernel check: bnb-mps' kernels on this run's model (emulated), or what the GPU verified (mps)
    kernel_check, check_lines = None, []
    if opts.kernel_check:
        with _quiet_transformers():
            kernel_check, check_lines = _kernel_check(model, tok, corpus_ids, seq_len, after_sample, opts, device,
                                                      emulated, counts, say)  # fmt: skip

    kernel_less = sorted(name for name, op in ops.OPS.items() if op.kernel is None)
    op_rows, op_notes = report.op_report(counts, device.type, emulated, handed_back_before, kernel_less)
    tokens_per_second = steps * tokens_per_step / train_seconds
    if not all(math.isfinite(x) for x in losses):
        say("warning: the loss is not finite: " + ", ".join(f"{x:.3f}" for x in losses))
    summary = {
        "bnb_mps": __version__,
        "device": str(device),
        "kernels": opts.kernels,
        "size": opts.size,
        "parameters": n_params,
        "trainable_parameters": n_trainable,
        "steps": steps,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "gradient_accumulation_steps": accum,
        "gradient_checkpointing": checkpointing,
        "compute_dtype": str(compute_dtype).removeprefix("torch."),
        "cpu_threads": torch.get_num_threads(),
        "optimizer": {"name": optim_name, "class": f"{type(optimizer).__module__}.{type(optimizer).__name__}",
                      "lr": opts.lr, "note": optim_note},  # fmt: skip
        "loss": losses,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "tokens_per_step": tokens_per_step,
        "tokens_per_second": tokens_per_second,
        "train_seconds": train_seconds,
        "load_seconds": load_seconds,
        "weight_bytes_4bit": bytes_4bit,
        "weight_bytes_fp16": bytes_fp16,
        "ops": op_rows,
        "ops_notes": op_notes,
        "memory": memory_stats(device),
        "sample_before": before,
        "sample_after": after,
    }
    if kernel_check is not None:
        summary["kernel_check"] = kernel_check
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    report.plot_loss(losses, out_dir / "demo_loss.png",
                     f"QLoRA, {opts.size} Llama in 4-bit NF4 on {device}, {optim_name}")  # fmt: skip

    say("summary",
        f"  device             {device} ({_short_serves(device, emulated)})",
        f"  loss               {losses[0]:.3f} (step 1) -> {losses[-1]:.3f} (step {steps})",
        f"  tokens/s           {tokens_per_second:,.0f} ({steps} steps of {tokens_per_step} tokens in "
        f"{train_seconds:.1f} s)",
        f"  weights            {report.human_bytes(bytes_4bit)} in 4-bit vs {report.human_bytes(bytes_fp16)} in fp16",
        f"  optimizer          {optim_name}",
        "  bitsandbytes ops   " + ("(calls counted in bnb-mps' op layer)" if op_rows else "none passed through bnb-mps"),
        *report.op_table(op_rows),
        *(f"  note: {n}" for n in op_notes),
        *check_lines,
        f"  wrote              {out_dir / 'summary.json'}, {out_dir / 'demo_loss.png'}")  # fmt: skip
    return summary
