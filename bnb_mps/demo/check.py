"""The kernel check at the end of the demo: bnb-mps' kernels at work on any machine.

Where no Apple GPU serves bitsandbytes' ops (the CPU device), the demo trains on bitsandbytes' own
CPU code and never touches bnb-mps. The check then runs the trained model a second time with its
4-bit products on bnb-mps' Metal kernels under the Metal-on-CPU emulator (the `emulated` tier,
registered for CPU tensors by `bnb_mps.testing.use_emulated_kernels`): one evaluation batch (forward
and loss) and the greedy sample the demo printed, and compares both with the stock run of the same
inputs.

Both runs multiply by the same dequantized weights (docs/semantics.md section 3). They differ in how
each 4-bit product sums its terms in float32: the kernels in their order, the CPU's matmul in its
own. docs/semantics.md section 4 bounds the kernels' error: for float32, within 5 units of
2^-24 * sum |a*w| of the exact product up to K = 4096 terms, growing like sqrt(K) beyond. The check
measures it: every 4-bit product of the kernel run is compared with the exact (float64) product of
the dequantized weight on the same input (`Products.measure`). The layers after
each product (norms, attention, the output head) carry such differences on to the logits. To see how
large the stated accuracy lets the logit differences get, the stock model runs again with every 4-bit
product moved by its full allowed error, with random signs (`Products.perturb`). The largest logit
change of those runs is the "allowed" difference. A greedy token can change only where the top two
logits of the stock run are closer than twice that, and the check says whether any are.

On a Mac the ops already run on the Metal kernels, so there is no second run there: the section
shows what the GPU proved at first use (`gpu_verdicts`), the verification verdict of each kernel
family the demo used.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch

#: The evaluation batch: this many sequences of the training length. Its 4-bit products are the
#: emulator's slowest part: the tiny model's 28 products of 2 x 128 tokens took 5 s on a busy 2-core
#: x86 machine, the 80-token greedy sample 11 s (its 2,268 products of one row each).
EVAL_SEQUENCES = 2
#: Random sign patterns tried for the allowed logit difference (the largest difference counts).
SIGN_DRAWS = 2
#: docs/semantics.md section 4, float32: within 5 units of 2^-24 * sum |a*w| of the exact product up to
#: K = 4096 terms, growing like sqrt(K) beyond (tests/reference_matmul_4bit.fp32_units).
UNITS_PER_PRODUCT = 5.0
SOURCE = "docs/semantics.md section 4"


def product_units(K: int) -> float:
    """The float32 error allowed in a 4-bit product of K terms, in units of 2^-24 * sum |a*w|."""
    return UNITS_PER_PRODUCT * max(1.0, math.sqrt(K / 4096))


def ulp32(S: torch.Tensor) -> torch.Tensor:
    """The float32 unit in the last place at |S| (float64; the subnormal spacing below 2^-126)."""
    _, exponent = torch.frexp(S.double().abs().clamp_min(2.0**-126))  # S = m * 2^e, 0.5 <= m < 1
    return torch.ldexp(torch.ones_like(S, dtype=torch.float64), exponent - 24)


# -- the model's 4-bit products -----------------------------------------------------------------------


class Products:
    """The 4-bit layers of a model (bitsandbytes.nn.Linear4bit), each with the weight its products
    multiply by: bitsandbytes' own dequantization of its codes (the stock CPU code).

    `measure()` compares every product made while it is active with torch's linear of that weight on
    the same input (what bitsandbytes' CPU code computes); `perturb()` moves every product by its full
    allowed error, with random signs. Both work through forward hooks, so the model runs unchanged."""

    def __init__(self, model) -> None:
        import bitsandbytes as bnb
        import bitsandbytes.functional as F

        self.layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        self.weights: dict = {}  # layer -> (dequantized weight, |weight|^T in float64)
        for m in self.layers:
            W = F.dequantize_4bit(m.weight.data, m.weight.quant_state).reshape(m.weight.quant_state.shape)
            self.weights[m] = (W, W.double().abs().T.contiguous())
        self.calls = 0  # products measured
        self.values = 0  # output values measured
        self.beyond = 0  # of them, more than the allowed error away from the exact product
        self.worst_units = 0.0  # the largest |kernel - exact| of any of them, in units of 2^-24 * sum |a*w|

    def dtype(self) -> torch.dtype:
        """The dtype the 4-bit products compute in (the layers' compute dtype)."""
        return (self.layers[0].compute_dtype if self.layers else None) or torch.float32

    def _exact(self, m, x: torch.Tensor):
        """(the exact product of x and the dequantized weight in the compute dtype, as float64; the
        error allowed per value; its unit 2^-24 * sum |a*w|)."""
        dtype = m.compute_dtype or x.dtype
        W, W_abs_t = self.weights[m]
        x = x.to(dtype)
        bias = None if m.bias is None else m.bias.to(dtype).double()
        want = torch.nn.functional.linear(x.double(), W.to(dtype).double(), bias)
        S = x.double().abs() @ W_abs_t
        if bias is not None:
            S = S + bias.abs()
        unit = S * 2.0**-24
        allowed = product_units(x.shape[-1]) * unit
        if dtype != torch.float32:  # the kernel also rounds its result to the dtype once
            allowed = allowed + 0.5 * ulp32(want) * 2.0 ** (23 - torch.finfo(dtype).nmant)
        return want, allowed, unit

    @contextlib.contextmanager
    def _hooks(self, hook) -> Iterator[None]:
        handles = [m.register_forward_hook(hook) for m in self.layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def measure(self, tick: Callable[[], object] = lambda: None) -> Iterator["Products"]:
        def hook(m, inputs, y):
            with torch.no_grad():
                want, allowed, unit = self._exact(m, inputs[0])
                err = (y.double() - want).abs()
                self.beyond += int((err > allowed).sum())
                self.worst_units = max(self.worst_units, float((err / unit.clamp_min(2.0**-149)).max()))
                self.values += err.numel()
            self.calls += 1
            tick()

        with self._hooks(hook):
            yield self

    @contextlib.contextmanager
    def perturb(self, generator: torch.Generator) -> Iterator[None]:
        def hook(m, inputs, y):
            with torch.no_grad():
                _, allowed, _ = self._exact(m, inputs[0])
                signs = torch.randint(0, 2, y.shape, generator=generator, dtype=torch.float64) * 2 - 1
                return (y.double() + signs * allowed).to(y.dtype)

        with self._hooks(hook):
            yield


# -- the runs -----------------------------------------------------------------------------------------


@dataclass
class Greedy:
    """A greedy sample: the new tokens, and the logits each was chosen from ([tokens, vocabulary])."""

    tokens: torch.Tensor
    logits: torch.Tensor


def greedy(model, inputs: dict, max_new_tokens: int, suppress: list[int], pad_token_id: int) -> Greedy:
    """Greedy decoding of `max_new_tokens` tokens after `inputs` (one prompt); the `suppress` tokens
    are never chosen."""
    model.eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, suppress_tokens=suppress,
                             pad_token_id=pad_token_id, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :]
    return Greedy(tokens.cpu(), torch.stack([step[0] for step in out.logits]).float().cpu())


def evaluate(model, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(loss, logits) of one batch of token ids, as training computes them."""
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    return float(out.loss), out.logits.float().cpu()


def logit_diff(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(the largest |got - want|, and the largest difference at one position relative to that
    position's largest |logit|: the logits of a position matter relative to each other)."""
    if got.numel() == 0:
        return 0.0, 0.0
    d = (got.double() - want.double()).abs()
    rel = d.amax(dim=-1) / want.double().abs().amax(dim=-1).clamp_min(1e-30)
    return float(d.max()), float(rel.max())


def allowed_difference(draws: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> tuple[float, float]:
    """The allowed logit difference (abs, rel): the largest `logit_diff` of any (perturbed, stock) pair
    of logits of any sign draw. Every draw counts, not the last: each is one sample of how far products
    off by their allowed error move the logits."""
    allowed_abs = allowed_rel = 0.0
    for pairs in draws:
        for moved, stock in pairs:
            a, r = logit_diff(moved, stock)
            allowed_abs, allowed_rel = max(allowed_abs, a), max(allowed_rel, r)
    return allowed_abs, allowed_rel


def could_change_a_token(min_gap: float, allowed_abs: float, moved_a_token: bool) -> bool:
    """Whether the stated accuracy could change a greedy token: a perturbed run chose another one, or
    the closest top two logits of the stock sample lie within twice the allowed difference (each of
    the two may move by the allowed difference, towards the other)."""
    return moved_a_token or min_gap <= 2 * allowed_abs


def logits_within(diff_abs: float, diff_rel: float, allowed_abs: float, allowed_rel: float) -> bool:
    """Whether the kernel run's logits differ from the stock run's by no more than the allowed difference."""
    return diff_abs <= allowed_abs and diff_rel <= allowed_rel


def _masked(logits: torch.Tensor, suppress: list[int]) -> torch.Tensor:
    out = logits.clone()
    out[..., suppress] = -math.inf
    return out


def margins(logits: torch.Tensor, suppress: list[int]) -> torch.Tensor:
    """Per greedy step, how far the chosen token's logit lies above the runner-up's."""
    top2 = _masked(logits, suppress).topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def compared_steps(got: torch.Tensor, want: torch.Tensor) -> int:
    """The greedy steps whose logits both runs computed from the same tokens: up to the first
    differing token, that one included (its logits still came from the same prefix)."""
    n = min(len(got), len(want))
    differ = (got[:n] != want[:n]).nonzero()
    return min(int(differ[0]) + 1, n) if len(differ) else n


# -- the check on the emulated tier ---------------------------------------------------------------------


class Skip(Exception):
    """The check cannot run here; the message says why, in one line."""


def emulator_unavailable() -> Optional[str]:
    """Why bnb-mps' 4-bit product kernels cannot run under the emulator here (one line), or None.
    Compiles the kernels for the emulator, or reads them from its module cache, as a side effect."""
    from ..emulator import EmulatorError
    from ..executors import ExecutorUnavailable, emulated, load_tier

    try:
        load_tier("emulated")
        failures = emulated.unit_libraries().failures
    except (ExecutorUnavailable, EmulatorError, OSError, ValueError) as e:
        return _first_line(e)
    if "gemm_4bit" in failures:  # the compile unit of the 4-bit products (csrc/kernels/gemm_4bit.metal)
        return f"the 4-bit product kernels do not compile for the emulator: {_first_line(failures['gemm_4bit'])}"
    return None


def _first_line(e) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def emulated_check(model, eval_ids: torch.Tensor, prompt: dict, stock_sample: Greedy, suppress: list[int],
                   pad_token_id: int, *, quiet: bool = False, say: Callable[..., None] = print,
                   tier: str = "emulated") -> tuple[dict, list[str]]:  # fmt: skip
    """Runs the check on the CPU model `model`: the summary's `kernel_check` and its lines for the
    printed summary. `stock_sample` is the greedy sample of bitsandbytes' own code from `prompt`.
    `tier`: "emulated" (bnb-mps' emulated executor), or "shader": the shader tier as a Mac runs it
    (first-use verification, tuning, launch plans, torch.mps.compile_shader) over the model of torch's
    MPS runtime (bnb_mps.modelled_mps), its kernels under the emulator too.
    Never raises: a check that cannot run says why in one line and returns {"skipped": why}."""
    if tier not in ("emulated", "shader"):
        raise ValueError(f"tier must be 'emulated' or 'shader', got {tier!r}")
    say("", "kernel check: the trained model again, its 4-bit products on bnb-mps' Metal kernels under the "
        "emulator (--no-kernel-check skips this)")  # fmt: skip
    try:
        return _emulated_check(model, eval_ids, prompt, stock_sample, suppress, pad_token_id, quiet, tier)
    except Skip as skip:
        why = str(skip)
    except Exception as e:  # the demo must not fail on its check
        why = f"the check failed: {type(e).__name__}: {_first_line(e)}"
    say(f"  skipped: {why}")
    return {"skipped": why}, [f"  kernel check       skipped: {why}"]


def _emulated_check(model, eval_ids, prompt, stock_sample, suppress, pad_token_id, quiet,
                    tier: str = "emulated") -> tuple[dict, list[str]]:  # fmt: skip
    from tqdm.auto import tqdm

    from .. import ops
    from ..testing import use_emulated_kernels

    start = time.perf_counter()
    why = emulator_unavailable()
    if why is not None:
        raise Skip(why)
    load_seconds = time.perf_counter() - start
    products = Products(model)
    new_tokens = len(stock_sample.tokens)

    # 1. The stock run (bitsandbytes' CPU code) of the evaluation batch; the sample is the demo's own.
    loss_stock, logits_stock = evaluate(model, eval_ids)

    # 2. What the stated accuracy allows: the stock run again with every 4-bit product off by its full
    # allowed error, on the evaluation batch and on the sample's tokens (one forward over them).
    sequence = torch.cat([prompt["input_ids"][0], stock_sample.tokens])[None]
    at_sample = slice(prompt["input_ids"].shape[1] - 1, sequence.shape[1] - 1)  # the logits each token came from
    _, along_sample = evaluate(model, sequence)
    draws = []
    moved_a_token = False
    generator = torch.Generator().manual_seed(0)
    for _ in range(SIGN_DRAWS):
        with products.perturb(generator):
            _, logits = evaluate(model, eval_ids)
            _, moved = evaluate(model, sequence)
        draws.append([(logits, logits_stock), (moved[0, at_sample], along_sample[0, at_sample])])
        chosen = _masked(moved[0, at_sample], suppress).argmax(-1)
        moved_a_token |= bool((chosen != _masked(along_sample[0, at_sample], suppress).argmax(-1)).any())
    allowed_abs, allowed_rel = allowed_difference(draws)

    # 3. The kernel run: every 4-bit product on bnb-mps' kernels, each measured against the exact product.
    bar = tqdm(total=len(products.layers) * (1 + new_tokens), desc="kernel check", unit="product",
               disable=quiet, dynamic_ncols=True, leave=False)  # fmt: skip
    with bar, (use_emulated_kernels() if tier == "emulated" else _modelled_mps()) as kernels, \
            products.measure(bar.update):
        before = len(kernels.launched)  # (the shader tier verified its families first: not the model's kernels)
        ops.reset_call_counts()
        loss_kernels, logits_kernels = evaluate(model, eval_ids)
        sample = greedy(model, prompt, new_tokens, suppress, pad_token_id)
        launched = set(kernels.launched[before:])
    counts = {name: sum(tiers.values()) for name, tiers in sorted(ops.call_counts().items())}
    ops.reset_call_counts()

    same_tokens = len(sample.tokens) == new_tokens and bool((sample.tokens == stock_sample.tokens).all())
    n = compared_steps(sample.tokens, stock_sample.tokens)
    diffs = [logit_diff(logits_kernels, logits_stock), logit_diff(sample.logits[:n], stock_sample.logits[:n])]
    diff_abs, diff_rel = max(d[0] for d in diffs), max(d[1] for d in diffs)
    gaps = margins(stock_sample.logits, suppress)
    closest = int(gaps.argmin()) if len(gaps) else 0
    min_gap = float(gaps[closest]) if len(gaps) else math.inf
    K = max((m.in_features for m in products.layers), default=1)
    dtype = str(products.dtype()).removeprefix("torch.")
    bound = {
        "source": SOURCE,
        "statement": f"{dtype}: each 4-bit product within {product_units(K):g} units of 2^-24 * sum |a*w| of the "
                     f"exact product with the dequantized weight (K = {K}); the allowed logit difference is the "
                     "largest logit change of the stock model with every 4-bit product off by that much (random "
                     "signs)",
        "compute_dtype": dtype,
        "product_units": product_units(K),
        "max_product_units": products.worst_units,
        "products_measured": products.calls,
        "values_measured": products.values,
        "values_beyond": products.beyond,
        "max_abs_logit_diff": allowed_abs,
        "max_rel_logit_diff": allowed_rel,
        "greedy_min_gap": min_gap,
        "greedy_min_gap_token": closest + 1,
        "could_change_a_token": could_change_a_token(min_gap, allowed_abs, moved_a_token),
        "logits_within": logits_within(diff_abs, diff_rel, allowed_abs, allowed_rel),
    }  # fmt: skip
    result = {
        "tier": tier,
        "ops": counts,
        "kernels": sorted(launched),
        "max_abs_logit_diff": diff_abs,
        "max_rel_logit_diff": diff_rel,
        "loss_stock": loss_stock,
        "loss_kernels": loss_kernels,
        "same_tokens": same_tokens,
        "seconds": time.perf_counter() - start,
        "bound": bound,
    }
    return result, report_lines(result, tuple(eval_ids.shape), new_tokens, n, load_seconds)


@contextlib.contextmanager
def _modelled_mps() -> Iterator:
    """The shader tier over the model of torch's MPS runtime, its kernel families verified (their first
    use), tuning off: the built-in routes, so that the kernels are those a Mac runs before measuring."""
    import os

    from ..ops import routing, tuning
    from ..testing import use_modelled_mps

    saved = os.environ.get(tuning.ENV_VAR)
    os.environ[tuning.ENV_VAR] = "0"
    try:
        with use_modelled_mps() as mps:
            routing.route("gemm_4bit")
            yield mps
    finally:
        if saved is None:
            os.environ.pop(tuning.ENV_VAR, None)
        else:
            os.environ[tuning.ENV_VAR] = saved


def report_lines(check: dict, eval_shape: tuple, new_tokens: int, compared: int, load_seconds: float) -> list[str]:
    """The check in the printed summary."""
    b = check["bound"]
    took = f"{check['seconds']:.1f} s"
    if load_seconds >= 1:
        took += f", {load_seconds:.1f} s of it loading the kernels"
    if check["same_tokens"]:
        tokens = f"the same {new_tokens} tokens"
    else:
        tokens = f"differs from token {compared} of {new_tokens}"
    gap = f"closest top two logits {b['greedy_min_gap']:.2g} apart (token {b['greedy_min_gap_token']})"
    gap += (": the allowed difference can swap them" if b["could_change_a_token"]
            else ", beyond twice the allowed difference")  # fmt: skip
    beyond = f" ({b['values_beyond']} of {b['values_measured']} values above {b['product_units']:g})"
    return [
        f"  kernel check       the trained model again on bnb-mps' Metal kernels ({check['tier']} tier), {took}",
        "    ops              " + "; ".join(f"{op} {n} calls" for op, n in check["ops"].items())
        + f" ({', '.join(check['kernels'])})",
        f"    loss             {check['loss_stock']:.6f} stock, {check['loss_kernels']:.6f} kernels (evaluation batch "
        f"of {eval_shape[0]} x {eval_shape[1]} tokens)",
        f"    logits           differ by at most {check['max_abs_logit_diff']:.2g} ({check['max_rel_logit_diff']:.2g} "
        f"of a position's largest); allowed {b['max_abs_logit_diff']:.2g} ({b['max_rel_logit_diff']:.2g})"
        + ("" if b["logits_within"] else ": NOT within what the bound allows"),
        f"    greedy sample    {tokens}; {gap}",
        f"    bound            {b['source']}: a {b['compute_dtype']} 4-bit product within {b['product_units']:g} "
        f"units of 2^-24 * sum |a*w| of the exact product; the allowed logit difference is what products that far "
        f"off (random signs) make of the stock logits",
        f"    measured         products at most {b['max_product_units']:.2g} units off, over {b['products_measured']} "
        f"products" + (beyond if b["values_beyond"] else ""),
    ]  # fmt: skip


# -- on a Mac: what the GPU proved at first use ---------------------------------------------------------


def gpu_verdicts(tier: str, executor, op_names) -> dict:
    """The first-use verification verdicts (bnb_mps.ops.verify) of the kernel families behind the ops
    in `op_names` on `tier`: this process's, made when those ops were first used (run then, or read
    from the cache; the family of a path with a fallback that no call took, split-K where no call had
    2 to 32 rows, is verified here); and the tuning choices, where this bnb-mps has them
    (`bnb_mps.tuning_table()`)."""
    import bnb_mps

    from ..ops import verify

    check: dict = {"tier": tier}
    if verify.mode() == "0":
        check["verification"] = f"off ({verify.ENV_VAR}=0): the kernels served unverified"
    else:
        order = list(verify.FAMILIES)
        families = sorted({f for op in op_names for f in verify.families_behind(op, executor)}, key=order.index)
        check["verdicts"] = {}
        for family in families:
            v = verify.verdict(family, tier, executor)
            check["verdicts"][family] = {"passed": v.passed, "cached": v.cached, "seconds": v.seconds,
                                         "launches": v.launches, "result": v.describe()}  # fmt: skip
    tuning_table = getattr(bnb_mps, "tuning_table", None)
    if callable(tuning_table):
        try:
            check["tuning"] = tuning_table()
        except Exception as e:  # report, never fail
            check["tuning"] = f"not readable: {type(e).__name__}: {_first_line(e)}"
    return check


def _tuning_line(entry: dict) -> str:
    """One tuning choice (an entry of bnb_mps.tuning_table()) in a line."""
    line = f"{entry.get('op')} {entry.get('key')}: {entry.get('choice')}"
    if entry.get("default") not in (None, entry.get("choice")):
        line += f" (built-in: {entry['default']})"
    return line + (" (cached)" if entry.get("cached") else "")


def gpu_report_lines(check: dict, shown: int = 8) -> list[str]:
    """The verdicts (and the tuning choices) in the printed summary."""
    lines = [f"  kernel check       the {check['tier']} tier's kernel families, as this GPU verified them at first use"]
    if "verification" in check:
        lines.append(f"    verification     {check['verification']}")
    for family, v in check.get("verdicts", {}).items():
        how = "read from the cache" if v["cached"] else "run in this process"
        lines.append(f"    {family:<16} {'passed' if v['passed'] else 'FAILED'} ({v['seconds']:.2f} s, {how})"
                     + ("" if v["result"] == "passed" else f": {v['result']}"))  # fmt: skip
    tuning = check.get("tuning")
    if isinstance(tuning, dict):
        tuning = [f"{key}: {value}" for key, value in tuning.items()]
    if isinstance(tuning, (list, tuple)):
        tuning = [_tuning_line(entry) if isinstance(entry, dict) else entry for entry in tuning]
        lines.append(f"    tuning           {len(tuning)} choices")
        lines += [f"      {entry}" for entry in tuning[:shown]]
        if len(tuning) > shown:
            lines.append("      ... (all of them in summary.json)")
    elif tuning is not None:
        lines.append(f"    tuning           {tuning}")
    return lines
