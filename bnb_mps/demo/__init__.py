"""`python -m bnb_mps demo` (also `bnb-mps demo`): QLoRA fine-tuning of a small Llama, end to end,
as a Mac user runs it on CUDA: 4-bit NF4 weights through transformers' BitsAndBytesConfig, LoRA
adapters from peft, a bitsandbytes 8-bit optimizer, a progress bar, a greedy sample before and
after, a summary of where each bitsandbytes op ran, and the kernel check: bnb-mps' kernels at work
on any machine (`check.py`). Nothing is downloaded. See `qlora.py`."""

from __future__ import annotations

import argparse
import importlib
import sys

from .qlora import SIZES, DemoError, Options, run

__all__ = ["REQUIREMENTS", "DemoError", "Options", "add_arguments", "main", "missing_requirements", "run"]

#: modules the demo needs beyond bnb-mps' own requirements (the module name is the pip name)
REQUIREMENTS = ("transformers", "peft", "matplotlib")


def missing_requirements() -> list[str]:
    missing = []
    for module in REQUIREMENTS:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    return missing


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", choices=list(SIZES), default="tiny",
                        help="model size: tiny (0.8M parameters; the whole run takes under a minute on one CPU core) or "
                        "small (24M parameters, for a GPU) (default: tiny)")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: 100)")
    parser.add_argument("--device", help="cpu, mps, cuda, auto (default: bnb_mps.device.get_device(); "
                        "BNB_MPS_DEVICE overrides)")
    parser.add_argument("--kernels", choices=["auto", "emulated"], default="auto",
                        help="auto: whatever serves bitsandbytes on the device (bnb-mps on mps); emulated: run "
                        "bitsandbytes' ops on CPU tensors through bnb-mps' Metal kernels under the emulator "
                        "(any machine; slow, small sizes only)")
    parser.add_argument("--optim", help="a transformers optimizer name (TrainingArguments.optim), e.g. "
                        "paged_adamw_8bit (default where paging works; adamw_bnb_8bit on cpu), adamw_torch")
    parser.add_argument("--lr", type=float, default=Options.lr, help=f"learning rate (default: {Options.lr:g})")
    parser.add_argument("--batch-size", type=int, help="sequences per micro-batch (default: 8)")
    parser.add_argument("--seq-len", type=int, help="tokens (characters) per sequence (default: 128 tiny, 256 small)")
    parser.add_argument("--accum", type=int,
                        help="gradient accumulation steps (default: bnb_mps.device.training_config)")
    parser.add_argument("--max-new-tokens", type=int, default=Options.max_new_tokens,
                        help=f"length of the samples (default: {Options.max_new_tokens})")
    parser.add_argument("--prompt", default=Options.prompt, help=f"sample prompt (default: {Options.prompt!r})")
    parser.add_argument("--seed", type=int, default=Options.seed)
    parser.add_argument("--out", default=Options.out,
                        help=f"directory for summary.json and demo_loss.png (default: ./{Options.out}/)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--no-kernel-check", dest="kernel_check", action="store_false",
                        help="skip the kernel check after training (on the CPU: the trained model again with its "
                        "4-bit products on bnb-mps' Metal kernels under the emulator, compared with the stock run; "
                        "on mps: the kernel families' first-use verification verdicts)")  # fmt: skip
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: 1 for tiny on the CPU "
                        "device, whose small matrices gain nothing from threads; torch's default otherwise)")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    missing = missing_requirements()
    if missing:
        print(f"bnb-mps demo needs {', '.join(REQUIREMENTS)}; missing: {', '.join(missing)}. "
              f"Install with: pip install {' '.join(missing)}", file=sys.stderr)  # fmt: skip
        return 1
    opts = Options(**{k: v for k, v in vars(args).items() if k in Options.__dataclass_fields__})
    try:
        run(opts)
    except DemoError as e:
        print(f"bnb-mps demo: {e}", file=sys.stderr)
        return 2
    return 0
