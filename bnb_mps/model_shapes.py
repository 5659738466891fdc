"""The 4-bit linear layers of a few popular models: shapes only, for `python -m bnb_mps tune --model NAME`.

Each layer is (names, N, K): out features by in features, the [N, K] weight of `gemm_4bit`. Taken from
the models' published configurations (nothing is downloaded):

    Llama-3-8B     hidden 4096, intermediate 14336, 32 attention heads and 8 key/value heads of 128
    Mistral-7B     hidden 4096, intermediate 14336, 32 attention heads and 8 key/value heads of 128
    Qwen2.5-1.5B   hidden 1536, intermediate 8960, 12 attention heads and 2 key/value heads of 128
    Qwen2.5-7B     hidden 3584, intermediate 18944, 28 attention heads and 4 key/value heads of 128
    Flux-block     a FLUX.1 transformer block (diffusers' FluxTransformer2DModel): hidden 3072, MLP
                   ratio 4; the double-stream block's attention, feed-forward and modulation, the
                   single-stream block's output projection (attention and MLP concatenated) and modulation
"""

from __future__ import annotations


def _llm(hidden: int, intermediate: int, kv_heads: int, head_dim: int = 128) -> list[tuple[str, int, int]]:
    return [("q_proj, o_proj", hidden, hidden), ("k_proj, v_proj", kv_heads * head_dim, hidden),
            ("gate_proj, up_proj", intermediate, hidden), ("down_proj", hidden, intermediate)]  # fmt: skip


MODELS: dict[str, list[tuple[str, int, int]]] = {
    "Llama-3-8B": _llm(4096, 14336, 8),
    "Mistral-7B": _llm(4096, 14336, 8),
    "Qwen2.5-1.5B": _llm(1536, 8960, 2),
    "Qwen2.5-7B": _llm(3584, 18944, 4),
    "Flux-block": [("attention to_q/k/v/out, add_*_proj, to_add_out", 3072, 3072), ("ff up (net.0.proj)", 12288, 3072),
                   ("ff down (net.2)", 3072, 12288), ("norm1 modulation", 18432, 3072),
                   ("single block proj_mlp", 12288, 3072), ("single block proj_out", 3072, 15360),
                   ("single block modulation", 9216, 3072)],
}  # fmt: skip


def layers(name: str) -> list[tuple[str, int, int]]:
    """The layers of model `name` (any letter case), each shape once: the first layer of a shape names it."""
    found = {m.lower(): m for m in MODELS}.get(name.lower())
    if found is None:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    out: dict[tuple[int, int], tuple[str, int, int]] = {}
    for layer, N, K in MODELS[found]:
        out.setdefault((N, K), (layer, N, K))
    return list(out.values())
