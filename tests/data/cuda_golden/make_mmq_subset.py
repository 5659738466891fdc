"""Writes cuda_h100_mmq_subset.pt, the part of the QLoRA-path reference outputs the tests use, from the
two full files (cuda_h100_mmq.pt.0 and .1, 22 MB, not kept in the repository).

usage: python make_mmq_subset.py DIR_OF_FULL_FILES

Kept: every `mmq/...` product; for every `mmq-w/...` weight, the packed bytes (nested0 only: the
nested1 bytes are the same quantization and are checked equal here), the absmax (float32, or the
uint8 codes of the nested form), the offset, the nested absmax, and the first ROWS rows of the
dequantized weight."""
import glob, sys, torch

ROWS = 16
res, meta = {}, None
for f in sorted(glob.glob(f"{sys.argv[1]}/cuda_h100_mmq.pt.*")):
    d = torch.load(f, weights_only=False)
    res.update(d["res"])
    meta = d
out = {}
for k, v in res.items():
    if k.startswith("mmq/"):
        out[k] = v
    elif k.startswith("mmq-w/"):
        packed, deq, absmax, offset, nested_absmax = v
        if k.endswith("nested1"):
            assert torch.equal(packed, res[k[: -1] + "0"][0]), k
            packed = torch.empty(0, dtype=torch.uint8)
        out[k] = (packed, deq[:ROWS].clone(), absmax, offset, nested_absmax)
meta = {k: meta[k] for k in ("cases", "mode", "errors", "torch", "bnb", "gpu")}
meta["subset"] = f"mmq and mmq-w only; dequantized weights: first {ROWS} rows; nested1 packed bytes in nested0"
torch.save({**meta, "res": out}, "cuda_h100_mmq_subset.pt")
print(len(out), "cases")
