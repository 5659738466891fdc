"""On Apple hardware: the 4-bit GEMV / GEMM kernels on the native and shader tiers, against the
float64 reference of docs/semantics.md section 4 (the same shapes, references and tolerances as the emulator
tests, plus real model sizes), and bitsandbytes' API on `mps` tensors through them. Skipped
elsewhere."""

from __future__ import annotations

from dataclasses import replace

import bitsandbytes as bnb
import bitsandbytes.functional as F
import pytest
import torch

import reference_matmul_4bit as R
import spec_reference as ref
from matmul_4bit_cases import DT, Case, gemm_args, splitk_slices_per_tile
from bnb_mps.ops.plan import language_version_of
from bnb_mps import executors, ops
from bnb_mps.ops import matmul_4bit

pytestmark = pytest.mark.mps

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class Recording:
    """Forwards to a GPU tier and records kernel names."""

    def __init__(self, inner):
        self.inner, self.name, self.launched = inner, inner.name, []

    def launch(self, kernel, **kw):
        self.launched.append(kernel)
        self.inner.launch(kernel, **kw)


def to_mps(args):
    return [a.to("mps") if isinstance(a, torch.Tensor) else a for a in args]


def run_gemm(executor, case: Case):
    A, args, W, bias = gemm_args(case, "mps")  # A built on mps in the case's layout
    A = A.cpu()
    rec = Recording(executor)
    y = ops.call(ops.OPS["gemm_4bit"], tuple(args), {}, rec)
    torch.mps.synchronize()
    version = language_version_of(executor)
    path = matmul_4bit.choose_path(case.M, case.N, case.K, language_version=version)
    assert len(rec.launched) == (2 if path == "splitk/two" else 1) and y.device.type == "mps", rec.launched
    assert path.split("/")[0] in rec.launched[0]
    return R.check_accuracy(y.cpu().reshape(-1, case.N), A.reshape(-1, case.K), W, bias, linear_device="mps")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M", [1, 8, 512])
def test_4096x4096_nested_nf4(executor, M, dtype):
    figures = run_gemm(executor, Case(M, 4096, 4096, dtype=dtype, nested=True, bias=True, seed=M))
    print(f"{executor.name} M={M} {dtype}: {figures}")


@pytest.mark.parametrize("shape", [(14336, 4096), (4096, 14336), (11008, 4096)])
@pytest.mark.parametrize("M", [1, 3, 32])
def test_llama_shapes(executor, shape, M):
    N, K = shape
    run_gemm(executor, Case(M, N, K, dtype=torch.float16, nested=True, seed=N + M))


@pytest.mark.parametrize("route", ["splitk", "splitk/two"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_gives_the_same_bits_every_time(executor, dtype, route):
    """The split-K kernels' threadgroups meet through device memory (csrc/kernels/gemm_4bit_splitk.h): in
    one dispatch (Metal >= 3.2 only: skipped on a tier below) the last of a tile to count adds the tile's
    partial sums; in two, a second dispatch adds them. On the GPU, with threadgroups truly running at
    once, 30 calls of each shape alternating A and -A (so that a partial sum read before its slice wrote
    it, still holding the previous call's, gives another number) must each give the bits of the first
    call with the same A, within the reference's bound, and the one dispatch leave each tile's counter with its threadgroups' count (S, or fewer for a last tile of fewer
    groups) under the last call's tag (what the emulator shows with threadgroups in several orders)."""
    from bnb_mps.ops import workspace

    version = language_version_of(executor)
    if route == "splitk" and not matmul_4bit.handover(version):
        pytest.skip(f"the {executor.name} tier compiles Metal {version}: no one-dispatch split-K kernel")
    workspace.release()  # (only this test's buffers below: other tests leave theirs, on other devices too)
    # (2880: rows cut where their own lines begin, a group of each tile per phase; 1000 columns: a partial
    # tile; 1040 columns at S = 4: a last tile of 16, one threadgroup over all of K)
    for M, N, K in ((5, 4096, 4096), (32, 11008, 4096), (13, 1000, 1040), (8, 1000, 2880), (8, 1040, 1024)):
        case = Case(M, N, K, dtype=dtype, nested=True, bias=True, seed=M + K)
        assert matmul_4bit.choose_path(M, N, K, language_version=version) in ("splitk", "splitk/two")
        A, args, W, bias = gemm_args(case, "mps")
        signed = [args, [-args[0], *args[1:]]]
        ys = [ops.OPS["gemm_4bit"].kernel(executor, *signed[i % 2], route=route) for i in range(30)]
        torch.mps.synchronize()
        for i, y in enumerate(ys):
            assert torch.equal(y.cpu().view(torch.uint8), ys[i % 2].cpu().view(torch.uint8)), (M, N, K, i)
        for sign, y in ((1, ys[0]), (-1, ys[1])):
            R.check_accuracy(y.cpu().reshape(-1, N), sign * A.cpu().reshape(-1, K), W, bias, linear_device="mps")
        if route == "splitk/two":
            continue
        (counters,) = [buf for key, buf in workspace._buffers.items()
                       if key[1] == "splitk counters" and key[0].type == "mps"]
        S = matmul_4bit.splitk_splits(M, K, dtype.itemsize)
        slices = splitk_slices_per_tile(N, S)
        c = counters[: len(slices)].cpu().long() & 0xFFFFFFFF
        assert (c & 31).tolist() == slices and len(set((c >> 5).tolist())) == 1, (M, N, K, c)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize", ref.BLOCKSIZES_4BIT)
def test_every_blocksize(executor, blocksize, quant_type):
    for i, M in enumerate((1, 6, 70)):
        for K in (48, 1040):  # blocks straddling rows; K % 32 != 0
            run_gemm(executor, Case(M, 300, K, dtype=DTYPES[i], blocksize=blocksize, quant_type=quant_type,
                                    nested=i == 1, bias=i == 2, seed=blocksize + M))  # fmt: skip


ODD = [
    Case(1, 1, 1), Case(100, 3, 1), Case(1, 7, 16), Case(9, 1, 16), Case(1, 9, 33), Case(33, 10, 100),
    Case(1, 1, 64), Case(33, 1, 64), Case(100, 65, 64, bias=True), Case(9, 8, 512), Case(8, 9, 32, bias=True),
    Case(3, 4097, 4112, nested=True), Case(257, 129, 4100, nested=True),
]  # fmt: skip


@pytest.mark.parametrize("case", ODD, ids=str)
def test_odd_shapes(executor, case):
    for dtype in DTYPES:
        run_gemm(executor, replace(case, dtype=dtype))


@pytest.mark.parametrize("layout", ["batched", "strided", "transposed", "misaligned", "broadcast"])
@pytest.mark.parametrize("M", [1, 6, 96])
def test_layouts_and_storage(executor, layout, M):
    for dtype, storage in zip(DTYPES, (torch.uint8, torch.bfloat16, torch.float32)):
        run_gemm(executor, Case(M, 256, 512, dtype=dtype, layout=layout, storage=storage, nested=M == 6, seed=M))


@pytest.mark.parametrize("offset_dtype", DTYPES, ids=str)
def test_nested_offset_dtypes(executor, offset_dtype):
    for M in (1, 7, 40):
        run_gemm(executor, Case(M, 512, 1024, dtype=torch.bfloat16, nested=True, offset_dtype=offset_dtype, seed=M))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("M", [1, 5, 100])
def test_identity_weight(executor, M, quant_type):
    for K in (256, 33):
        nib, absmax = ref.quantize_4bit_nibbles(torch.eye(K), 32, quant_type)
        packed = torch.from_numpy(ref.pack_nibbles(nib)).reshape(-1, 1).to("mps")
        for dtype in DTYPES:
            A = torch.randn(M, K).to(dtype).to("mps")
            y = ops.call(ops.OPS["gemm_4bit"], (A, packed, [K, K], torch.from_numpy(absmax).to("mps"), 32, quant_type),
                         {}, executor)  # fmt: skip
            assert torch.equal(y.cpu(), A.cpu())


@pytest.mark.parametrize("table", ["constant", "threadgroup"])
def test_gemv_code_table(executor, table):
    route = {"route": "gemv/tglut"} if table == "threadgroup" else {}  # (the variant tuning may pick)
    N, K = 1024, 2048
    nib, absmax = ref.quantize_4bit_nibbles(torch.randn(N, K), 64, "nf4")
    packed, absmax = torch.from_numpy(ref.pack_nibbles(nib)).reshape(-1, 1), torch.from_numpy(absmax)
    for code in (F.get_4bit_type("nf4", device="cpu"), F.get_4bit_type("fp4", device="cpu"), torch.linspace(-3, 5, 16)):
        W = R.dequantized_weight(packed, (N, K), 64, code, absmax)
        for dtype in DTYPES:
            A = torch.randn(1, 1, K).to(dtype)
            rec = Recording(executor)
            y = matmul_4bit.gemv_4bit(rec, *to_mps([A, packed, [N, K], absmax, code, 64]), **route)
            assert rec.launched == [f"bnb_gemv_4bit{'_tglut' if table == 'threadgroup' else ''}_absmax_{DT[dtype]}"]
            R.check_accuracy(y.cpu().reshape(1, N), A.reshape(1, K), W, linear_device="mps")


@pytest.mark.parametrize("tier", ["native", "shader"])
def test_linear4bit_on_mps(tier, fresh_tier_selection):
    """A QLoRA layer on mps through bitsandbytes' API: forward on every path and a backward step."""
    fresh_tier_selection.setenv("BNB_MPS_EXECUTOR", tier)
    executors.reset()
    if executors.selection().tier != tier:
        pytest.skip(f"{tier} tier unavailable: {executors.selection().reason}")
    K, N = 4096, 1024
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(0)
        layer = bnb.nn.Linear4bit(K, N, bias=True, compute_dtype=dtype, quant_type="nf4", compress_statistics=True)
        W = layer.weight.data.clone()
        layer = layer.to("mps")
        want_packed, want_absmax = ref.quantize_4bit(W, 64, "nf4")
        assert torch.equal(layer.weight.data.cpu().reshape(-1), want_packed.reshape(-1))
        q8, nested, offset = ref.double_quantize(want_absmax, F.create_dynamic_map(signed=True))
        Wq = R.dequantized_weight(want_packed, (N, K), 64, "nf4", nested, q8, F.create_dynamic_map(signed=True), offset)
        bias = layer.bias.data.to(dtype).cpu()
        for seq in (1, 4, 256):
            x = torch.randn(1, seq, K).to(dtype)
            with torch.no_grad():
                y = layer(x.to("mps"))
            R.check_accuracy(y.cpu().reshape(-1, N), x.reshape(-1, K), Wq, bias, linear_device="mps")
        x = torch.randn(2, 64, K).to(dtype).to("mps").requires_grad_(True)
        y = layer(x)
        y.float().pow(2).mean().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
