"""The suite's tiers (docs/tests.md): every test module is in one, and its tests carry that marker.

    unit      no emulator, no subprocess: Python logic against references (seconds)
    kernels   the kernels under the Metal-on-CPU emulator, through the op layer or directly
    model     the models of torch's MPS runtime and of Metal, subprocesses, end-to-end clients
    mps       needs Apple Silicon (skipped elsewhere; a marker of its own on each test)
    slow      long tails, run with -m slow (a marker of its own on each test)

A module not listed in KERNELS or MODEL is `unit`. conftest.py refuses a subprocess or an emulator
launch in a `unit` test and a subprocess in a `kernels` test (TierViolation), so that the tiers say
what they hold. A test may carry a tier marker of its own, which wins over its module's.
"""

from __future__ import annotations

TIERS = ("unit", "kernels", "model")

KERNELS = {
    "emulator/test_api.py", "emulator/test_coherence.py", "emulator/test_detectors.py", "emulator/test_features.py",
    "emulator/test_float_mode.py", "emulator/test_profile.py",
    "test_ademamix_layout.py", "test_apple_float.py", "test_coherence_families.py", "test_coherence_products.py",
    "test_cuda_golden.py", "test_cuda_products.py", "test_device.py", "test_fallback.py", "test_geometry_kernel.py",
    "test_kernel_traffic.py", "test_kernel_units.py", "test_kernels_int8.py", "test_kernels_matmul_4bit.py",
    "test_kernels_quant.py", "test_matmul_4bit_accuracy.py", "test_memory_bounded.py", "test_mps_families.py",
    "test_not_covered.py", "test_optimizer_kernels.py", "test_optimizers_bnb.py", "test_plan_cache.py",
    "test_profile_ops.py", "test_registration.py", "test_routing.py", "test_small_batch_cost.py", "test_splitk.py",
    "test_tuning.py", "test_verify.py", "test_whole_stack_int8.py", "test_whole_stack_matmul_4bit.py",
    "test_whole_stack_quant.py",
}

MODEL = {
    "emulator/test_context_switch.py",
    "test_acceptance.py", "test_address_space.py", "test_bench_emulator.py", "test_bench_gemm4bit.py",
    "test_bench_int8.py", "test_bench_kernels.py", "test_bench_op_overhead.py", "test_bench_optimizers.py",
    "test_benchmark_training.py", "test_build_scripts.py", "test_ci_workflows.py", "test_demo.py",
    "test_e2e_clients.py", "test_e2e_int8.py", "test_executor_native.py", "test_executor_shader.py",
    "test_json_cache.py", "test_modelled_mps.py", "test_mutation_check.py", "test_native_model.py",
    "test_probe_math_mode.py", "test_testing_plugin.py", "test_versions.py", "test_wheel.py",
}


class TierViolation(AssertionError):
    """A `unit` test started a subprocess or an emulator launch: list its module in tests/tiers.py."""


def tier_of(relative_path: str) -> str:
    """The tier of a test module, by its path relative to tests/."""
    if relative_path in MODEL:
        return "model"
    if relative_path in KERNELS:
        return "kernels"
    return "unit"
