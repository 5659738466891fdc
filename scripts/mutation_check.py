#!/usr/bin/env python3
"""Planted faults: does each test catch the fault it is about?

Each fault of `FAULTS` is one realistic one-line change to the package (file, exact old text, new
text) and the test selection that should catch it. The check copies the repository to a temporary
directory, plants each fault there in turn, runs its tests against that copy, and reports which
faults the tests caught (a test failed) and which survived (every selected test passed):

    python scripts/mutation_check.py              # every fault (about 20 minutes on 2 cores, 90 faults)
    python scripts/mutation_check.py T9 R2        # the faults named
    python scripts/mutation_check.py --list       # the faults, not run
    python scripts/mutation_check.py --json out.json

Where the faults are planted: the editable install (scikit-build-core's redirect mode) puts a finder
at the front of `sys.meta_path` that sends every `import bnb_mps...` to the working tree, whatever
PYTHONPATH says. The copy's tests therefore run with a `sitecustomize` of the check's own (first on
PYTHONPATH, inherited by every subprocess a test starts) that takes that finder out again, so that
`bnb_mps` is imported from the copy; the compiled extension modules the install built (the
emulator's runtime, the C++ op key) are copied next to the copy's sources. Before any fault, the
check proves it: `bnb_mps` must import from the copy, and the copy's tests must pass unchanged.

It runs on request, not in CI. docs/tests.md has the last score and why each survivor is left.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: seconds one fault's tests may take (a fault that hangs a test counts as caught: CI would time out)
TIMEOUT = 900


@dataclass(frozen=True)
class Fault:
    id: str
    file: str  # relative to the repository
    old: str  # exact text, found exactly once in the file
    new: str
    tests: tuple  # pytest arguments selecting the covering tests (paths, node ids, -k expressions)
    what: str  # the behaviour it breaks, in a few words


TUNING = "tests/test_tuning.py"
NOT_COVERED = "tests/test_not_covered.py"
JSON_CACHE = "tests/test_json_cache.py"
LINT = "tests/test_msl_lint.py"
DEMO_CHECK = "tests/test_demo_check.py"
MODELLED = "tests/test_modelled_mps.py"
SPLITK = "tests/test_splitk.py"
NATIVE_MODEL = "tests/test_native_model.py"
NATIVE_EXEC = "tests/test_executor_native.py"
VERIFY = "tests/test_verify.py"

FAULTS = [
    # -- tuning: the decision, the switches, the cache (bnb_mps/ops/tuning.py) -----------------------------
    Fault("T1", "bnb_mps/ops/tuning.py", "times[default] > times[best] * (1 + MARGIN)",
          "times[default] > times[best] * (1 - MARGIN)", (TUNING, "-k", "margin"),
          "the built-in route kept only when another is faster by more than the margin"),
    Fault("T2", "bnb_mps/ops/tuning.py", "best = min(times, key=lambda r: (times[r], r != default))",
          "best = max(times, key=lambda r: (times[r], r != default))", (TUNING, "-k", "margin"),
          "the fastest route is chosen"),
    Fault("T3", "bnb_mps/ops/candidates.py", "{' bias' if args[6] is not None else ''}", "",
          (TUNING, "-k", "gemm_shape_key"), "bias in the 4-bit product's shape key"),
    Fault("T4", "bnb_mps/ops/candidates.py", 'parts.append(f"{name}={_dtype(a.dtype)}{list(a.shape)}")',
          'parts.append(f"{name}={list(a.shape)}")', (TUNING, "-k", "tells_dtypes_apart"),
          "tensor dtypes in the other ops' shape key"),
    Fault("T5", "bnb_mps/ops/candidates.py", "return 1 << max(M - 1, 0).bit_length()",
          "return 1 << max(M, 0).bit_length()", (TUNING, "-k", "rounds_rows"), "M rounded up to a power of two"),
    Fault("T6", "bnb_mps/ops/tuning.py", "    skip = excluded()\n", "    skip = frozenset()\n",
          (TUNING, "-k", "excluded_routes"), "BNB_MPS_TUNE_EXCLUDE honoured"),
    Fault("T7", "bnb_mps/ops/tuning.py", '(tier in GPU_TIERS and on_gpu) else "0"', '(tier in GPU_TIERS) else "0"',
          (TUNING, "-k", "off_on_the_emulated"), "tuning off by default where timings mean nothing"),
    Fault("T8", "bnb_mps/ops/tuning.py", "errors[name] = first_line(e)", "raise",
          (TUNING, "-k", "candidate_that_raises"), "a candidate that raises is dropped, not the call"),
    Fault("T9", "bnb_mps/ops/tuning.py",
          "if found is not None and found.choice in _offered(c, tier, executor, verified)[0]:",
          "if found is not None:", (TUNING, "-k", "todays_candidates"),
          "a cached choice checked against today's candidates"),
    Fault("T9b", "bnb_mps/ops/tuning.py", "            if found.choice in offered:\n", "            if True:\n",
          (TUNING, "-k", "todays_candidates"), "a choice this process made checked against today's candidates"),
    Fault("T10", "bnb_mps/ops/tuning.py", 'if found is not None and (how != "always" or not found.cached):',
          "if found is not None:", (TUNING, "-k", "always_measures"), "BNB_MPS_TUNE=always measures cached keys again"),
    Fault("T10b", "bnb_mps/ops/tuning.py", '        if how == "1" and _fixed is None:\n', '        if _fixed is None:\n',
          (TUNING, "-k", "always_measures"), "BNB_MPS_TUNE=always ignores the cache"),
    Fault("T11", "bnb_mps/ops/tuning.py", "why = verify.unverified(route.families, tier, executor)", "why = None",
          (TUNING, "-k", "unverified_family"), "routes of unverified kernel families are no candidates"),
    Fault("T13", "bnb_mps/ops/tuning.py",
          "if not all(isinstance(r, str) and (t is None or _number(t)) for r, t in times.items()) or not _number(seconds):",
          "if not _number(seconds):", (TUNING, "-k", "malformed"), "a cache entry of the wrong shape is ignored"),
    Fault("T14", "bnb_mps/ops/tuning.py",
          "return {**data, machine: {**(kept if isinstance(kept, dict) else {}), d.key: entry}}",
          "return {**data, machine: {d.key: entry}}", (TUNING, "-k", "stored_choice_keeps"),
          "storing a choice keeps the machine's other entries"),
    Fault("T15", "bnb_mps/ops/tuning.py", "    return json_cache.read(cache_path())",
          "    return __import__('json').loads(cache_path().read_text()) if cache_path().is_file() else {}",
          (TUNING, "-k", "malformed_or_unreadable"), "a malformed cache counts as empty"),
    Fault("T15b", "bnb_mps/ops/tuning.py", "return entries if isinstance(entries, dict) else {}",
          "return entries or {}", (TUNING, "-k", "malformed_or_unreadable"),
          "a cache whose machine entries are no object counts as empty"),
    Fault("T16", "bnb_mps/ops/tuning.py", '    return frozenset(r.strip() for r in os.environ.get(EXCLUDE_ENV_VAR, "").split(",") if r.strip())',
          '    return frozenset(os.environ.get(EXCLUDE_ENV_VAR, "").split(","))', (TUNING, "-k", "excluded_routes"),
          "BNB_MPS_TUNE_EXCLUDE takes names with spaces around them"),
    Fault("T11b", "bnb_mps/ops/candidates.py", 'FALLBACK = {"splitk": WITHOUT_HANDOVER, "splitk/two": "small"}',
          "FALLBACK = {}",
          (TUNING, "-k", "gives_way_to_the_small"), "a split-K kernel that fails verification gives way to small"),
    Fault("T17", "bnb_mps/ops/candidates.py", "    if M > MAX_M_BUCKET:\n", "    if M >= MAX_M_BUCKET:\n",
          (TUNING, "-k", "rounds_rows"), "rows up to 4096 have buckets of their own"),
    Fault("T18", "bnb_mps/ops/tuning.py", "float(seconds), cached=True)", "float(seconds), cached=False)",
          (TUNING, "-k", "read_by_a_new_process"), "the table says which choices came from the cache"),
    Fault("T19", "bnb_mps/ops/tuning.py", "        if name != c.default:\n", "        if True:\n",
          (TUNING, "-k", "whatever_the_exclusion"), "the built-in route is never excluded"),
    Fault("T20", "bnb_mps/ops/tuning.py", 'if how == "0" or len(c.routes) < 2:', 'if how == "0" or len(c.routes) < 1:',
          (TUNING, "-k", "empty_product"), "an op with one route is not measured"),
    # -- timing (bnb_mps/ops/timing.py) ------------------------------------------------------------------------
    Fault("T12", "bnb_mps/ops/timing.py", "samples.append(_batch(call, n, clock) / n)",
          "samples.append(_batch(call, n, clock))", (TUNING, "-k", "seconds_per_call"), "time per call, not per batch"),
    Fault("TM1", "bnb_mps/ops/timing.py", "return statistics.median(samples)", "return min(samples)",
          (TUNING, "-k", "median_batch"), "the median batch counts"),
    Fault("TM2", "bnb_mps/ops/timing.py", "            if attempt == 2:\n", "            if attempt == 1:\n",
          (MODELLED, "-k", "retried or retries"), "a failed batch is timed once more"),
    Fault("TM3", "bnb_mps/ops/timing.py", "            raise e.__cause__ from None\n",
          "            raise TimingFailed(str(e)) from None\n", (TUNING, "-k", "raises_while_timed"),
          "a route's own error is the route's, not the clock's"),
    Fault("TM4", "bnb_mps/ops/tuning.py", "        except timing.TimingFailed:\n            raise\n",
          "        except timing.TimingFailed:\n            pass\n", (MODELLED, "-k", "fails_twice"),
          "a clock that fails keeps no decision"),
    Fault("TM5", "bnb_mps/ops/tuning.py", "    if torch.are_deterministic_algorithms_enabled():\n",
          "    if False:\n", (MODELLED, "-k", "deterministic"), "deterministic mode takes the built-in routes"),
    Fault("TM6", "bnb_mps/executors/clocks.py", "        if current().stream_id != default().stream_id:\n", "        if False:\n",
          (MODELLED, "-k", "another_stream"), "calls on another stream are not timed"),
    Fault("TM7", "bnb_mps/executors/clocks.py",
          "            mps.synchronize()  # (the device's, never the event's: see the module docstring)\n",
          "            end.synchronize()\n", (MODELLED, "-k", "first_use_timing or qlora"),
          "a timing event is never synchronized (torch 2.13/2.14 deadlock)"),
    Fault("TM8", "bnb_mps/ops/tuning.py", "    except Exception as e:  # noqa: BLE001  (first use must never fail the user's call)\n",
          "    except RuntimeError as e:  # noqa: BLE001  (first use must never fail the user's call)\n",
          (TUNING, "-k", "whatever_first_use_raises"), "whatever first use raises, the built-in route serves"),
    Fault("TM9", "bnb_mps/ops/tuning.py", 'return tier in GPU_TIERS and device.type == getattr(executor, "device_type", None)',
          "return tier in GPU_TIERS", (TUNING, "-k", "off_on_the_emulated"),
          "only the GPU tier's own device's calls are timed on its clock"),
    # -- the model of torch's MPS runtime (bnb_mps/modelled_mps) ------------------------------------------------
    Fault("MM1", "bnb_mps/modelled_mps/runtime.py", '"2.14": TorchBehaviour("2.14.1", True,',
          '"2.14": TorchBehaviour("2.14.1", False,', (MODELLED,),
          "torch 2.14 has the double-listener deadlock (its CPU sync flag is a bool)"),
    Fault("MM2", "bnb_mps/modelled_mps/runtime.py", "            if not end.completion_ns > start.completion_ns:\n",
          "            if False:\n", (MODELLED, "-k", "reverse"), "events recorded in reverse raise"),
    Fault("MM3", "bnb_mps/modelled_mps/runtime.py",
          "            if self.behaviour.public_streams and self.current_stream is not self.default_stream:\n",
          "            if False:\n", (MODELLED, "-k", "another_stream"), "Event.record() off the default stream raises"),
    # -- the Mac host path: clocks, watches, the models of torch's MPS runtime and of Metal (issue 41) ----------
    Fault("H1", "bnb_mps/executors/clocks.py", "        if errors:\n            raise ClockFailed(f\"a timed command buffer",
          "        if False:\n            raise ClockFailed(f\"a timed command buffer",
          (NATIVE_MODEL, "-k", "batch_failed or abort_while_timed"),
          "host: a command buffer that failed is no timing (native clock)"),
    Fault("H2", "bnb_mps/executors/clocks.py",
          "return _checked(max(e for _, e in spans) - min(s for s, _ in spans),",
          "return _checked(sum(e - s for s, e in spans),", (NATIVE_MODEL, "-k", "not_a_sum or several_calls"),
          "host: the native clock's batch is max(end) - min(start) of its command buffers"),
    Fault("H3", "bnb_mps/executors/clocks.py", "return _checked(ms / 1e3,", "return _checked(ms,",
          (MODELLED, "-k", "modelled_gpu_time"), "host: elapsed_time's milliseconds are seconds / 1000"),
    Fault("H4", "bnb_mps/executors/native.py",
          "        timing = self._timing\n\n        def launch_prepared(args) -> None:\n"
          "            watch = getattr(timing, \"watch\", None)",
          "        watch = getattr(self._timing, \"watch\", None)\n\n        def launch_prepared(args) -> None:\n",
          (NATIVE_EXEC, "-k", "watch_of_the_moment"), "host: a kept plan reads the timing watch per call"),
    Fault("H5", "bnb_mps/modelled_mps/runtime.py", '"2.15": TorchBehaviour("2.15.0", False, True, True)',
          '"2.15": TorchBehaviour("2.15.0", False, True, False)', (MODELLED, "-k", "memory_fault"),
          "host: torch 2.15's synchronize() raises an earlier command buffer's error (model)"),
    Fault("H6", "bnb_mps/modelled_mps/library.py",
          "                return f\"Execution of the command buffer was aborted",
          "                return None and f\"Execution of the command buffer was aborted", (MODELLED, "-k", "memory_fault"),
          "host: a kernel's memory fault fails its command buffer (model of compile_shader)"),
    Fault("H7", "csrc/mps_ops.mm",
          "      if (handler != nil) {\n        [stream->commandBuffer() addCompletedHandler:handler];  // (the buffer of the "
          "encoder above)\n        attached = true;\n      }\n    } catch (...) {\n      failure = std::current_exception();\n"
          "    }\n  });\n",
          "    } catch (...) {\n      failure = std::current_exception();\n    }\n  });\n  if (handler != nil && !failure) {\n"
          "    [stream->commandBuffer() addCompletedHandler:handler];\n    attached = true;\n  }\n",
          (NATIVE_MODEL, "-k", "watch_sees"),
          "host: a watched launch attaches its handler inside its dispatch block (Metal model: on the queue)"),
    Fault("H8", "bnb_mps/ops/verify/runner.py",
          "    try:  # (what ran before is not the family's: torch >= 2.15 raises an earlier command buffer's error "
          "here, once)\n        synchronize(executor)\n", "    try:\n        pass\n",
          (MODELLED, "-k", "earlier_command_buffer"),
          "host: verification takes an earlier buffer's error before its launches (torch 2.15)"),
    Fault("H9", "bnb_mps/executors/clocks.py", "            watch.track()  #", "            pass  #",
          (NATIVE_MODEL, "-k", "torch_s_own_work or several_calls"),
          "host: the native clock watches the stream's own buffer after each call (torch's work)"),
    Fault("H10", "bnb_mps/executors/clocks.py", "            if not (start.query() and end.query()):",
          "            if False:", (MODELLED, "-k", "faults_and_never"),
          "host: the event clock never waits for an event of a failed command buffer (torch <= 2.14)"),
    Fault("H11", "bnb_mps/executors/clocks.py", "if current().stream_id != default().stream_id:",
          "if current() != default():", (MODELLED, "-k", "by_stream_id"),
          "host: torch 2.15's streams compared by id"),
    Fault("H12", "bnb_mps/executors/native.py", "self._timing = threading.local()",
          "self._timing = type(\"Shared\", (), {})()", (NATIVE_EXEC, "-k", "per_thread"),
          "host: the timing watch is per thread"),
    Fault("H13", "csrc/mps_ops.mm", "      MPSCommandBuffer_t current = stream->*member(CurrentCommandBuffer{});\n",
          "      MPSCommandBuffer_t current = stream->commandBuffer();\n", (NATIVE_MODEL, "-k", "no_empty_buffer"),
          "host: track() makes no empty command buffer to watch"),
    Fault("H14", "bnb_mps/ops/verify/compare.py", "bad = torch.where(nan, ~torch.isnan(g),",
          "bad = torch.where(nan, torch.zeros_like(nan),", (VERIFY, "-k", "close_matches"),
          "host: a NaN reference is matched by NaN only (verify.compare.close)"),
    Fault("H15", "bnb_mps/executors/shader.py",
          "limit = getattr(fn, \"max_threads_per_threadgroup\", MAX_THREADS_PER_THREADGROUP)",
          "limit = MAX_THREADS_PER_THREADGROUP", (MODELLED, "-k", "register_heavy"),
          "host: the shader tier checks each pipeline's maxTotalThreadsPerThreadgroup"),
    Fault("H16", "tests/metal_model/metal.mm", "  if (_queue != nullptr && !bnb::on_queue(_queue)) {",
          "  if (false) {", (NATIVE_MODEL, "-k", "only_before_commit"),
          "host: the Metal model takes a completed handler only on the owning stream's queue"),
    Fault("H17", "bnb_mps/modelled_mps/library.py",
          "return REGISTER_HEAVY_MAX_THREADS if _SIMDGROUP_MATRIX.search(source) else MAX_THREADS_PER_THREADGROUP",
          "return MAX_THREADS_PER_THREADGROUP", (NATIVE_MODEL, "-k", "register_heavy"),
          "host: the models' pipelines allow fewer threads for register-heavy kernels"),
    Fault("H1b", "bnb_mps/executors/clocks.py", "        if errors:\n            raise ClockFailed(f\"a timed command buffer",
          "        if False:\n            raise ClockFailed(f\"a timed command buffer",
          (NATIVE_MODEL, "-k", "abort_while_timed"), "host: a route that aborts while timed is not taken and cached"),
    Fault("H18", "bnb_mps/modelled_mps/runtime.py",
          "            if buffer.error is None:  # (a failed buffer signals nothing",
          "            if True:  # (a failed buffer signals nothing", (MODELLED, "-k", "memory_fault or faults_and_never"),
          "host: an event recorded into a failed command buffer never completes (model of torch's runtime)"),
    # -- candidates (bnb_mps/ops/candidates.py) ----------------------------------------------------------------
    Fault("C1", "bnb_mps/ops/candidates.py", "return name != \"gemm_4bit\" or args[2][1] % args[4] == 0",
          "return True", (TUNING, "-k", "tune_command_measures"),
          "bitsandbytes' CPU gemm_4bit is a route only where no block straddles a row"),
    Fault("C2", "bnb_mps/ops/candidates.py",
          "return torch.randn(shape, generator=self.gen, device=self.on).to(self.device)",
          "return torch.randn(shape, device=self.on).to(self.device)", (TUNING, "-k", "random_numbers"),
          "measuring leaves the caller's random numbers alone"),
    Fault("C3", "bnb_mps/ops/candidates.py", "routes = {path: kernel(path) for path in paths[: 1 if op.name not in TUNED else None]}",
          "routes = {path: kernel(path) for path in paths[:1]}", (TUNING, "-k", "fastest_route_serves"),
          "every kernel path is a candidate"),
    Fault("C4", "bnb_mps/ops/candidates.py", "worth = math.prod(A.shape[:-1]) * N * K > 0",
          "worth = math.prod(A.shape[:-1]) * N * K >= 0", (TUNING, "-k", "empty_product"),
          "an empty product has its built-in route alone"),
    Fault("C5", "bnb_mps/ops/candidates.py", "    skip = op.planned.dynamic_positions if op.planned is not None else 0\n    parts",
          "    skip = 0\n    parts", (TUNING, "-k", "per_call_hyper"),
          "the optimizers' per-call values are no part of the shape key"),
    Fault("C6", "bnb_mps/ops/candidates.py", 'families = ("nf4_fp4", "blockwise_8bit") if args[7] is not None else ("nf4_fp4",)',
          'families = ("nf4_fp4",)', (TUNING, "-k", "8bit_family"),
          "dequantize+linear of nested scales needs the 8-bit family verified"),
    Fault("C7", "bnb_mps/ops/candidates.py", 'if name in ("gemv_4bit", "gemv_4bit.out", "dequantize_4bit", "dequantize_4bit.out"):',
          'if name in ("dequantize_4bit", "dequantize_4bit.out"):', (TUNING, "-k", "instruction_set"),
          "bitsandbytes' CPU gemv_4bit is no route"),
    # -- resolve (bnb_mps/ops/resolve.py) ----------------------------------------------------------------------
    Fault("R1", "bnb_mps/ops/resolve.py", "        if choice != routes.default:\n",
          "        if choice == routes.default:\n", (TUNING, "-k", "fastest_route_serves"), "the choice serves"),
    Fault("R2", "bnb_mps/ops/resolve.py", "    return not (op.planned is not None and op.planned.dynamic_positions)",
          "    return True", (NOT_COVERED, "-k", "uncovered_optimizer_call"),
          "an uncovered call with per-call values is not kept for its signature"),
    Fault("R3b", "bnb_mps/ops/resolve.py", "        return routes.routes[choice].build(args)\n",
          "        return routes.routes[choice].build(routes.fresh())\n", (TUNING, "-k", "contiguous_A"),
          "the choice built for the call's own arguments (layout)"),
    Fault("R4", "bnb_mps/ops/resolve.py", "        served = Stock(op.name, where.stock)\n",
          "        served = RoundTrip(op.name)\n", (NOT_COVERED, "-k", "mps_key_call_equals"),
          "an uncovered call goes to bitsandbytes' own implementation"),
    Fault("R5", "bnb_mps/ops/resolve.py", "return elsewhere(op, e, where, served.counted[1]), holds_for_signature(op)",
          "return elsewhere(op, e, where, served.counted[1]), True",
          (NOT_COVERED, "-k", "uncovered_optimizer_call"),
          "an uncovered per-call value is not kept for the signature (the run-time path)"),
    # -- dequantize+linear (bnb_mps/ops/dequantize_linear.py) ---------------------------------------------------
    Fault("D1", "bnb_mps/ops/dequantize_linear.py", "            absmax += args[9]", "            pass",
          (TUNING, "-k", "fastest_route_serves and dequantize"), "the nested scales' offset added"),
    Fault("D2", "bnb_mps/ops/dequantize_linear.py", "return torch.nn.functional.linear(A, weight, bias)",
          "return torch.nn.functional.linear(A, weight)", (TUNING, "-k", "fastest_route_serves and dequantize"),
          "the bias added"),
    Fault("D3", "bnb_mps/ops/dequantize_linear.py", "self._weight_args = (blocksize, quant_type, list(shapeB), A.dtype)",
          "self._weight_args = (blocksize, quant_type, list(shapeB), torch.float32)",
          (TUNING, "-k", "fastest_route_serves and dequantize"), "the weight dequantized to A's dtype"),
    Fault("D4", "bnb_mps/ops/dequantize_linear.py", "_NESTED_BLOCKSIZE = 256", "_NESTED_BLOCKSIZE = 128",
          (TUNING, "-k", "fastest_route_serves and dequantize"), "nested block scales in blocks of 256"),
    # -- validation and NotCovered ------------------------------------------------------------------------------
    Fault("N1", "bnb_mps/ops/int8.py", "    outliers = threshold > 0.0\n    if A.numel() == 0:  # rows",
          "    outliers = threshold != 0.0\n    if A.numel() == 0:  # rows", (NOT_COVERED, "-k", "threshold"),
          "a threshold that is not > 0 means no outliers (int8_vectorwise_quant)"),
    Fault("N1b", "bnb_mps/ops/int8.py", "    outliers = threshold > 0.0\n    if A.numel() == 0:\n",
          "    outliers = threshold == threshold\n    if A.numel() == 0:\n", (NOT_COVERED, "-k", "threshold"),
          "a threshold that is not > 0 means no outliers (int8_double_quant)"),
    Fault("N2", "bnb_mps/ops/optim.py", "    if step < 1:\n", "    if step < 0:\n",
          (NOT_COVERED, "-k", "uncovered_optimizer_call or step_zero"), "step 0 is not the kernels'"),
    Fault("N3", "bnb_mps/ops/optim.py", "if not abs(value) <= _FLOAT32_MAX:",
          "if abs(value) > _FLOAT32_MAX:", (NOT_COVERED, "-k", "uncovered_optimizer_call"),
          "a NaN hyperparameter is not the kernels'"),
    Fault("N3b", "bnb_mps/ops/optim.py", "if not abs(value) <= _FLOAT32_MAX:",
          "if not abs(value) < math.inf:", (NOT_COVERED, "-k", "uncovered_optimizer_call"),
          "a hyperparameter beyond float32's range is not the kernels'"),
    Fault("N4", "bnb_mps/ops/validation.py", "    if t.dtype not in dtypes and t.dtype in accepted:\n",
          "    if False:\n", (NOT_COVERED, "-k", "mps_key_call_equals"),
          "a dtype bitsandbytes accepts but the kernels do not is served elsewhere"),
    # -- verification's cache -----------------------------------------------------------------------------------
    Fault("V1", "bnb_mps/ops/verify/__init__.py", "        if not v.passed:\n            warn_once(",
          "        if False:\n            warn_once(", (TUNING, "-k", "unverified_family"), "a failed family's routes are no candidates"),
    Fault("V2", "bnb_mps/ops/verify/cache.py", "data[key] = {**data.get(key, {}), **{name: to_entry(v) for name, v in verdicts.items()}}",
          "data[key] = {name: to_entry(v) for name, v in verdicts.items()}", ("tests/test_verify.py", "-k",
                                                                              "cache_is_written_read"),
          "storing a verdict keeps the key's other families"),
    # -- json_cache ------------------------------------------------------------------------------------------------
    Fault("J1", "bnb_mps/json_cache.py", "    except Exception:  # (any malformed content", "    except ValueError:  # (any malformed content",
          (JSON_CACHE, "-k", "malformed"), "anything malformed or unreadable reads as empty"),
    Fault("J2", "bnb_mps/json_cache.py", 'lock = filelock.FileLock(f"{path}.lock")',
          'lock = filelock.FileLock(f"{path}.{os.getpid()}.lock")', (JSON_CACHE, "-k", "at_once"),
          "writers exclude each other"),
    Fault("J3", "bnb_mps/json_cache.py", "        os.replace(tmp, path)\n",
          "        path.write_bytes(Path(tmp).read_bytes()); os.unlink(tmp)\n", (JSON_CACHE, "-k", "reader"),
          "the file replaced, never written in place"),
    Fault("J4", "bnb_mps/json_cache.py", "        try:\n            yield\n        finally:\n            lock.release()\n",
          "        lock.release()\n        yield\n", (JSON_CACHE, "-k", "at_once"), "the lock held until the rename"),
    Fault("J5", "bnb_mps/json_cache.py", "    if key in held:\n", "    if False:\n",
          (JSON_CACHE, "-k", "inside_an_update"), "an update inside an update of the same file raises"),
    # -- the MSL lint's float-math rule ---------------------------------------------------------------------------
    Fault("L1", "bnb_mps/msl/lint.py", "                if not _FLOAT_ARGUMENT.search(code[m.end() : close - 1]):\n",
          "                if False:\n", (LINT, "-k", "bad_case or no_false_positive or legitimate or project"),
          "integer min/max/clamp/abs are not float math"),
    Fault("L2", "bnb_mps/msl/lint.py", 'if qualifier is not None and qualifier.group(1) == "precise":',
          'if qualifier is not None and qualifier.group(1) in ("precise", "metal"):', (LINT, "-k", "bad_case"),
          "metal:: calls follow fast math"),
    Fault("L3", "bnb_mps/msl/lint.py", 'if qualifier is not None and qualifier.group(1) == "precise":',
          'if qualifier is not None and qualifier.group(1) in ("precise", "fast"):', (LINT, "-k", "bad_case"),
          "fast:: calls are reported"),
    Fault("L4", "bnb_mps/msl/lint.py", '            if re.search(r"(?:->|\\.)\\s*$", before):\n',
          '            if re.search(r"(?:->|\\.|\\s)\\s*$", before):\n', (LINT, "-k", "bad_case"),
          "only member functions are exempt"),
    # -- the demo's kernel check (bnb_mps/demo/check.py) -----------------------------------------------------------
    Fault("DC1", "bnb_mps/demo/check.py", "return UNITS_PER_PRODUCT * max(1.0, math.sqrt(K / 4096))",
          "return UNITS_PER_PRODUCT", (DEMO_CHECK,), "the error per product grows like sqrt(K) beyond 4096"),
    Fault("DC2", "bnb_mps/demo/check.py", "allowed_abs, allowed_rel = max(allowed_abs, a), max(allowed_rel, r)",
          "allowed_abs, allowed_rel = a, r", (DEMO_CHECK,), "the largest sign draw counts, not the last"),
    Fault("DC3", "bnb_mps/demo/check.py", "        unit = S * 2.0**-24\n", "        unit = S * 2.0**-23\n",
          (DEMO_CHECK,), "the unit 2^-24 * sum |a*w|"),
    Fault("DC4", "bnb_mps/demo/check.py",
          "signs = torch.randint(0, 2, y.shape, generator=generator, dtype=torch.float64) * 2 - 1",
          "signs = torch.ones(y.shape, dtype=torch.float64)", (DEMO_CHECK,), "random signs"),
    Fault("DC5", "bnb_mps/demo/check.py", "return moved_a_token or min_gap <= 2 * allowed_abs",
          "return moved_a_token or min_gap <= allowed_abs", (DEMO_CHECK,),
          "a gap within twice the allowed difference can swap the top two"),
    Fault("DC6", "bnb_mps/demo/check.py", "return diff_abs <= allowed_abs and diff_rel <= allowed_rel",
          "return diff_abs <= allowed_abs", (DEMO_CHECK,), "both differences within"),
    Fault("DC7", "bnb_mps/demo/check.py", "return min(int(differ[0]) + 1, n) if len(differ) else n",
          "return min(int(differ[0]), n) if len(differ) else n", (DEMO_CHECK,),
          "the first differing token's logits are compared"),
    Fault("DC8", "bnb_mps/demo/check.py", "top2 = _masked(logits, suppress).topk(2, dim=-1).values",
          "top2 = logits.topk(2, dim=-1).values", (DEMO_CHECK,), "suppressed tokens are never chosen"),
    Fault("DC9", "bnb_mps/demo/check.py", "rel = d.amax(dim=-1) / want.double().abs().amax(dim=-1).clamp_min(1e-30)",
          "rel = d.amax(dim=-1) / want.double().abs().amax().clamp_min(1e-30)", (DEMO_CHECK,),
          "the relative difference is per position"),
    # -- the CUDA comparison (issue 33): the arithmetic brought to CUDA's --------------------------------------
    Fault("CU1", "csrc/kernels/int8.h", "metal::precise::divide(float(T(x * 127.0f)), col_max)",
          "metal::precise::divide(x * 127.0f, col_max)", ("tests/test_cuda_golden.py", "-k", "int8"),
          "int8_double_quant's column codes round x * 127 to A's dtype first, as CUDA's torch ops do"),
    Fault("CU2", "csrc/kernels/int8.h",
          "metal::precise::divide(127.0f, m) : 127.0f * metal::precise::divide(1.0f, m);",
          "metal::precise::divide(127.0f, m) : metal::precise::divide(127.0f, m);",
          ("tests/test_kernels_int8.py", "-k", "vectorwise"), "the int8 row scale is 127 * fl32(1 / max), as CUDA's"),
    Fault("CU3", "bnb_mps/ademamix_layout.py", "out[blocks:] = flat[blocks - 1 : 2 * blocks - 1]",
          "out[blocks:] = flat[blocks : 2 * blocks]", ("tests/test_ademamix_layout.py",),
          "AdEMAMix8bit's slow-EMA scales read from CUDA's overlapping layout"),
    # -- the split-K product (issue 34): a protocol between threadgroups and a per-device workspace ------------
    Fault("SK1", "csrc/kernels/gemm_4bit_splitk.h", "last[0] = (counted & BNB_SPLITK_COUNT_MASK) == S ? 1u : 0u;",
          "last[0] = (counted & BNB_SPLITK_COUNT_MASK) == 1u ? 1u : 0u;", (SPLITK,),
          "the tile's sums are added by the last threadgroup to count, after every slice is written"),
    Fault("SK2", "csrc/kernels/gemm_4bit_splitk.h", ": (tag << BNB_SPLITK_COUNT_BITS) | 1u;",
          ": (tag << BNB_SPLITK_COUNT_BITS) | ((seen & BNB_SPLITK_COUNT_MASK) + 1u);",
          (SPLITK, MODELLED, "-k", "splitk or split_k"),
          "a call's counts start afresh under its tag, whatever an earlier call left"),
    Fault("SK8", "csrc/kernels/gemm_4bit_splitk.h",
          "memory_order_relaxed,\n                                                       memory_order_relaxed));",
          "memory_order_relaxed,\n                                                       memory_order_relaxed) && false);",
          (SPLITK,), "a count whose weak compare-and-swap fails is tried again (it may fail spuriously on a GPU)"),
    Fault("SK9", "csrc/kernels/gemm_4bit_splitk.h",
          "    threadgroup_barrier(mem_flags::mem_device);\n    if (tid == 0u) {",
          "    if (tid == 0u) {", (SPLITK,),
          "a threadgroup counts itself in only after all of its threads wrote their partial sums"),
    Fault("SK7", "bnb_mps/ops/workspace.py", "    return (next(_calls) - 1) % (TAGS - 1) + 1\n",
          "    return 1\n", (SPLITK,), "each call counts under a tag of its own"),
    Fault("SK3", "csrc/kernels/gemm_4bit_splitk.h", "for (uint s = 1; s < S; ++s) {",
          "for (uint s = 1; s + 1u < S; ++s) {", (SPLITK,), "every slice's partial sums are added"),
    Fault("SK4", "csrc/kernels/gemm_4bit_splitk.h",
          "(K + BNB_SPLITK_ALIGN * S - 1u) / (BNB_SPLITK_ALIGN * S) * BNB_SPLITK_ALIGN;",
          "(K + BNB_SMALL_KS * S - 1u) / (BNB_SMALL_KS * S) * BNB_SMALL_KS;", (SPLITK,),
          "slices start on a line of the packed weight: no line is read by two slices"),
    Fault("SK5", "bnb_mps/ops/workspace.py", "if buf is None or buf.numel() < numel:", "if buf is None:", (SPLITK,),
          "a call that needs more workspace than the device's buffer has grows it"),
    Fault("SK6", "bnb_mps/ops/matmul_4bit.py", "        if K < SPLITK_MIN_K:\n            return \"small\"",
          "        if True:\n            return \"small\"", ("tests/test_small_batch_cost.py", "-k", "targets and not every"),
          "the built-in route for 2..32 rows from K = 512 is the split-K kernel"),
    Fault("SK10", "bnb_mps/ops/matmul_4bit.py", "S = splitk_splits(M, K, A.element_size(), scale_bytes, blocksize)",
          "S = splitk_splits(M, K, A.element_size(), 1, blocksize)", ("tests/test_small_batch_cost.py", "-k", "slices"),
          "the split-K slices are chosen for float32 absmax's 4 bytes of scales a block"),
    Fault("SK11", "bnb_mps/ops/small_batch.py", "4 * (2 * S - 1) + out)", "4 * (2 * S - 1) + itemsize)",
          ("tests/test_small_batch_cost.py", "-k", "slices"),
          "the split-K slices are chosen counting the output's lines (a tile narrower than a line writes a line)"),
    Fault("SK15", "bnb_mps/ops/small_batch.py", "    return min(costs, key=costs.__getitem__)\n",
          "    return next(iter(costs))\n",
          ("tests/test_small_batch_cost.py", "-k", "whichever_models_less"),
          "the built-in route of 2..32 rows is the split-K or small kernel, whichever models less over the bucket"),
    Fault("SK12", "csrc/kernels/gemm_4bit_splitk.h", "const uint phase = P == 1u ? 0u : (c * K) % BNB_SPLITK_ALIGN;",
          "const uint phase = 0u;", (SPLITK,),
          "where K % 256 != 0, each weight row is cut where its own lines begin: no line read by two slices"),
    Fault("SK13", "csrc/kernels/gemm_4bit_splitk.h",
          "const uint k_end = slice + 1u == S ? K : min(K, (slice + 1u) * span - phase);",
          "const uint k_end = min(K, (slice + 1u) * span - phase);", (SPLITK,),
          "the last slice runs to K, also where the phase moves its start back past S slices' reach"),
    Fault("SK16", "csrc/kernels/gemm_4bit_splitk.h", "    uint S = 1u;\n    while (S < groups) {",
          "    uint S = splits;\n    while (S < groups) {", (SPLITK,),
          "a last tile of fewer groups than S takes as many slices as the host launches for it"),
    Fault("SK17", "bnb_mps/ops/small_batch.py", "return (tiles - 1) * S + (1 << (groups - 1).bit_length())",
          "return tiles * S", ("tests/test_small_batch_cost.py", "-k", "last_tile"),
          "a last tile of fewer groups than S has fewer threadgroups: half the gemv kernel's, the 1.25x target"),
    Fault("SK14", "csrc/kernels/gemm_4bit_splitk.h",
          "const uint back = row < N ? 0u : (row - (N - 1u) + P - 1u) / P * P;",
          "const uint back = row < N ? 0u : row - (N - 1u);", (SPLITK,),
          "a tile's rows past N read a row of their own phase, over lines the tile reads anyway"),
    # -- the split-K hand-over under Apple's memory model (issue 41; docs/emulator.md, "Memory model") ----------
    Fault("SK18", "csrc/kernels/gemm_4bit_splitk.h",
          "    atomic_thread_fence(mem_flags::mem_device, memory_order_release, thread_scope_device);\n"
          "    threadgroup_barrier(mem_flags::mem_device);\n",
          "    threadgroup_barrier(mem_flags::mem_device);\n",
          (SPLITK, "-k", "memory_model or fence or one_dispatch or whichever"),
          "every thread that wrote a partial sum releases it at device scope before the count (Metal 3.2)"),
    Fault("SK19", "csrc/kernels/gemm_4bit_splitk.h", "    coherent(device) device float* work [[buffer(18)]],\n",
          "    device float* work [[buffer(18)]],\n", (SPLITK, "-k", "memory_model or whichever"),
          "the one-dispatch kernel's workspace is coherent(device) (Metal 3.2)"),
    Fault("SK20", "csrc/kernels/gemm_4bit_splitk.h",
          "    bnb_splitk_partials<T, NESTED>(A, B, absmax, absmax_8bit, absmax_code, absmax_offset, code, M, N, K, lda,\n"
          "                                   block_shift, table, offset_kind, splits, work, tg.x, a_tile, tid, lane, sg);\n"
          "}\n",
          "    const uint S = bnb_splitk_partials<T, NESTED>(A, B, absmax, absmax_8bit, absmax_code, absmax_offset, code, M,\n"
          "        N, K, lda, block_shift, table, offset_kind, splits, work, tg.x, a_tile, tid, lane, sg);\n"
          "    threadgroup_barrier(mem_flags::mem_device);\n"
          "    const uint cols = BNB_SPLITK_SIMDS * BNB_SMALL_ROWS * splits;\n"
          "    const uint size = min(M, BNB_SMALL_M) * cols;\n"
          "    if (tg.x % splits + 1u == S) {\n"
          "        for (uint e = tid; e < size; e += BNB_SPLITK_THREADS) {\n"
          "            bnb_splitk_add(work + tg.x / splits * splits * size, S, size, e, cols, tg.x / splits, N, out, bias,\n"
          "                           flags);\n"
          "        }\n"
          "    }\n"
          "}\n",
          (SPLITK, "-k", "memory_model"),
          "the two-dispatch split-K adds the slices in its second dispatch only (the first reads no other slot)"),
    Fault("SK21", "csrc/kernels/gemm_4bit_splitk.h",
          "    atomic_thread_fence(mem_flags::mem_device, memory_order_acquire, thread_scope_device);\n", "",
          (SPLITK, "-k", "memory_model"),
          "every thread of the tile's last threadgroup acquires the other slots at device scope before it reads them"),
]


# -- the copy ----------------------------------------------------------------------------------------------------

SITECUSTOMIZE = '''
"""mutation_check: bnb_mps from this copy, not from the editable install's working tree."""
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("_editable_skbc_")
                    and "ScikitBuild" not in type(f).__name__]
'''


def make_copy(root: Path) -> tuple[Path, dict]:
    """The repository's files (tracked and new ones, not ignored) under root/repo, the installed
    extension modules beside its bnb_mps, and root/site/sitecustomize.py; returns (copy, environment)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")  # fmt: skip
    copy = root / "repo"
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, copy / name)
    for module in ("bnb_mps._emu", "bnb_mps._opkey"):
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin:
            origin = Path(spec.origin)
            for f in origin.parent.glob(origin.name.split(".")[0] + "*"):
                if f.is_file() and not (copy / "bnb_mps" / f.name).exists():
                    shutil.copy2(f, copy / "bnb_mps" / f.name)
    site = root / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    path = os.pathsep.join([str(site), str(copy), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "1"}  # (no stale bytecode between faults)
    return copy, env


def check_isolation(copy: Path, env: dict, python: str) -> None:
    """Raises unless bnb_mps (and its compiled emulator runtime) import from the copy."""
    code = "import bnb_mps, bnb_mps.ops.tuning as t; print(bnb_mps.__file__); print(t.__file__)"
    out = subprocess.run([python, "-c", code], cwd=copy, env=env, capture_output=True, text=True, timeout=600)
    where = out.stdout.split()
    if out.returncode != 0 or len(where) != 2 or not all(Path(w).is_relative_to(copy) for w in where):
        raise SystemExit(f"mutation_check: bnb_mps does not import from the copy {copy}:\n{out.stdout}{out.stderr}")


def run_tests(copy: Path, env: dict, python: str, tests: tuple) -> tuple[int, str, float]:
    start = time.monotonic()
    cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", "-W", "ignore", *tests]
    try:
        out = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=TIMEOUT)
        code, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired:
        code, text = -1, f"timed out after {TIMEOUT} s"
    return code, text, time.monotonic() - start


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def baseline_runs(faults: list) -> list[tuple]:
    """The faults' test selections, one pytest run per test file (its -k expressions or'ed)."""
    by_file: dict = {}
    for f in faults:
        path, rest = f.tests[0], f.tests[1:]
        if rest[:1] == ("-k",) and len(rest) == 2:
            if by_file.get(path, []) is not None:
                by_file.setdefault(path, []).append(f"({rest[1]})")
        else:
            by_file[path] = None  # (the whole file, or a selection only pytest can combine: run it whole)
    return [(path,) if ks is None else (path, "-k", " or ".join(sorted(set(ks)))) for path, ks in sorted(by_file.items())]


def plant(copy: Path, fault: Fault) -> str:
    """Plants `fault` in the copy; returns the file's original text."""
    path = copy / fault.file
    text = path.read_text(encoding="utf-8")
    if text.count(fault.old) != 1:
        raise LookupError(f"{fault.id}: the old text occurs {text.count(fault.old)} times in {fault.file}")
    path.write_text(text.replace(fault.old, fault.new), encoding="utf-8")
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ids", nargs="*", help="the faults to plant (default: all)")
    parser.add_argument("--list", action="store_true", help="list the faults and exit")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--python", default=sys.executable, help="the interpreter whose packages the tests use")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = parser.parse_args(argv)
    unknown = set(args.ids) - {f.id for f in FAULTS}
    if unknown:
        parser.error(f"unknown faults: {', '.join(sorted(unknown))}")
    faults = [f for f in FAULTS if not args.ids or f.id in args.ids]
    if args.list:
        for f in faults:
            print(f"{f.id:5} {f.file:36} {f.what}")
        return 0
    root = Path(tempfile.mkdtemp(prefix="bnb-mps-mutation-"))
    try:
        copy, env = make_copy(root)
        check_isolation(copy, env, args.python)
        selections = baseline_runs(faults)
        print(f"copy: {copy}; baseline: the {len(selections)} test files, unchanged", flush=True)
        for tests in selections:
            code, text, seconds = run_tests(copy, env, args.python, tests)
            if code != 0:
                print(f"baseline fails ({' '.join(tests)}): {last_line(text)}\n{text[-3000:]}")
                return 2
        results = []
        for f in faults:
            try:
                original = plant(copy, f)
            except LookupError as e:
                results.append({**asdict(f), "result": "not planted", "detail": str(e), "seconds": 0.0})
                print(f"{f.id:5} NOT PLANTED  {e}", flush=True)
                continue
            try:
                code, text, seconds = run_tests(copy, env, args.python, f.tests)
            finally:
                (copy / f.file).write_text(original, encoding="utf-8")
            result = "caught" if code not in (0, 5) else "survived"
            if code == 5:
                text = "no test selected: " + text
            results.append({**asdict(f), "result": result, "detail": last_line(text), "seconds": round(seconds, 1)})
            print(f"{f.id:5} {result.upper():9} {seconds:6.1f} s  {f.what}: {last_line(text)}", flush=True)
        planted = [r for r in results if r["result"] != "not planted"]
        caught = sum(r["result"] == "caught" for r in planted)
        print(f"\ncaught {caught} of {len(planted)} planted faults ({100 * caught / max(1, len(planted)):.0f}%)"
              + (f"; {len(results) - len(planted)} not planted (their text is gone)" if len(planted) < len(results)
                 else ""))  # fmt: skip
        for r in planted:
            if r["result"] == "survived":
                print(f"  survived: {r['id']} {r['file']}: {r['what']}")
        if args.json:
            Path(args.json).write_text(json.dumps({"caught": caught, "planted": len(planted), "faults": results},
                                                  indent=1, default=list))  # fmt: skip
        return 0
    finally:
        if args.keep:
            print(f"kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
